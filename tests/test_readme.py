"""README.md, a page a newcomer reads in ten minutes: at most 300 lines of at most 100 columns, the
demo command, what RTI is and where each paper concept lives within its first 80 lines; the code
names it gives exist; its links resolve (and docs/'s); and every command of its shell blocks (and
of docs/'s current pages) runs as written from the checkout: its flags parse with the command's own
parser, then the command answers --help, in this process as tests/test_extras.py runs them."""

import importlib
import re
import runpy
import shlex
import sys
import warnings
from pathlib import Path

import pytest

import rti
import runtime

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# the pages whose commands and code names describe the code as it is now (docs/RESULTS.md records
# commands as they were typed at the commit each result names, so only its links are checked)
CURRENT = [README, *(ROOT / "docs" / f for f in ("METHOD.md", "INTEGRATION.md", "SCALING.md"))]
PAGES = [README, ROOT / "extras" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NEEDS_TRL = {"extras.trl_rti", "extras.bench_trl"}  # optional: skipped without trl
# the paper's concepts the first 80 lines must place in the code ("continu": continuation)
CONCEPTS = ("validator", "corrector", "verifier", "continu", "perplexity gate")
CONCEPTS += ("importance weights", "group advantages")


def shell_commands(text: str) -> list[list[str]]:
    """The commands of a markdown text's ```bash and ```sh blocks, as argument lists: a line that
    ends in a backslash goes on on the next, comments are dropped, `a && b` is two commands."""
    commands = []
    for block in re.findall(r"^```(?:bash|sh)\n(.*?)^```", text, re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = []
            for word in [*shlex.split(line, comments=True), "&&"]:
                if word != "&&":
                    command.append(word)
                elif command:
                    commands.append(command)
                    command = []
    return commands


def python_command(words: list[str]) -> tuple[str, str, list[str]] | None:
    """(kind, target, arguments) of `python FILE.py ...`, `python -m MODULE ...` or
    `torchrun [its flags] -m MODULE ...`; None for any other command (pip, ...)."""
    if words[0] == "torchrun":
        i = words.index("-m")
        return "module", words[i + 1], words[i + 2 :]
    if words[0] != "python":
        return None
    if words[1] == "-m":
        return "module", words[2], words[3:]
    return "script", words[1], words[2:]


def page_commands(pages) -> list:
    out = []
    for page in pages:
        for words in shell_commands(page.read_text()):
            command = python_command(words)
            if command:
                label = f"{page.relative_to(ROOT)}: {' '.join(words)}"
                out.append(pytest.param(*command, id=label[:90]))
    return out


def parse_own_flags(kind: str, target: str, args: list[str]) -> None:
    """The command's arguments through its own parser (a renamed flag, a stale choice or a missing
    subcommand fails here); flags after `--` (extras.compare passes them to every rti.py run)
    through rti.py's."""
    module = rti if target == "rti.py" else None
    if kind == "module":
        module = importlib.import_module(target)
    if module is None:  # envs.py: a sample task, no flags
        assert not args, f"python {target} takes no arguments"
        return
    parser, runs = module.build_parser(), runtime.build_parser(rti.Config)
    parser.allow_abbrev = runs.allow_abbrev = False  # the flags as written, not a prefix of them
    try:
        parsed = parser.parse_args(args)
        extra = [a for a in getattr(parsed, "extra", None) or [] if a != "--"]
        if extra:
            runs.parse_args(extra)
    except SystemExit as e:
        pytest.fail(f"{target} {' '.join(args)}: its parser refuses it (exit {e.code})")


def check_pytest_command(args: list[str]) -> None:
    """`python -m pytest ...` is this test runner: the files it names exist and the markers it
    selects are declared in pytest.ini."""
    declared = (ROOT / "pytest.ini").read_text()
    for i, arg in enumerate(args):
        if i > 0 and args[i - 1] == "-m":
            assert f"{arg}:" in declared, f"marker {arg} is not declared in pytest.ini"
        elif not arg.startswith("-"):
            assert (ROOT / arg).exists(), f"pytest names {arg}, which does not exist"


# ----------------------------------------------------------------------------- the README's shape


def test_readme_is_short_and_narrow():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines, more than 300"
    wide = [f"{i}: {len(line)}" for i, line in enumerate(lines, 1) if len(line) > 100]
    assert not wide, f"README.md lines over 100 columns: {wide}"


def test_readme_opens_with_the_demo_what_rti_is_and_where_concepts_live():
    head = "\n".join(README.read_text().splitlines()[:80])
    assert "python rti.py" in head and "## What RTI is" in head
    table = head.split("## Where each concept lives", 1)[-1].lower()
    assert "## where each concept lives" in head.lower()
    missing = [c for c in CONCEPTS if c not in table]
    assert not missing, f"the concept table in the first 80 lines lacks {missing}"


# ----------------------------------------------------------------------------- names and links

CODE_NAME = re.compile(r"`((?:envs|loss|intervene|rti|evaluate|extras\.\w+)(?:\.[A-Za-z_]\w*)+)`")
FILE_SUFFIXES = {"py", "md", "txt", "pt", "jsonl", "csv", "png", "json"}


@pytest.mark.parametrize("page", CURRENT, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_code_name_exists(page):
    """Each `module.Name` (or `module.Class.method`) a current page names resolves in the code."""
    missing = []
    for name in sorted(set(CODE_NAME.findall(page.read_text()))):
        parts = name.split(".")
        if parts[-1] in FILE_SUFFIXES:
            continue  # a file name (envs.py), not a code name
        split = 2 if parts[0] == "extras" else 1
        if parts[0] in NEEDS_TRL or ".".join(parts[:2]) in NEEDS_TRL:
            pytest.importorskip("trl", reason="needs the optional package trl")
        obj = importlib.import_module(".".join(parts[:split]))
        for attr in parts[split:]:
            if not hasattr(obj, attr):
                missing.append(name)
                break
            obj = getattr(obj, attr)
    assert not missing, f"{page.name} names what the code has not: {missing}"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.+)$", page.read_text(), re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    """Links and images point at files that exist, and an #anchor at a heading of its page."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
            continue
        if anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


# ----------------------------------------------------------------------------- the commands


def test_the_readme_has_commands():
    commands = [c for c in map(python_command, shell_commands(README.read_text())) if c]
    assert ("script", "rti.py", []) in commands and len(commands) >= 10


@pytest.mark.parametrize(("kind", "target", "args"), page_commands(CURRENT))
def test_every_command_runs_as_written(kind, target, args, monkeypatch, capsys):
    """The command's flags parse, and the command, with --help added after its own flags (before
    a `--`, after which flags belong to the runs it starts), exits 0 printing its usage."""
    if target == "pytest":
        check_pytest_command(args)
        return
    if target in NEEDS_TRL:
        pytest.importorskip("trl", reason="needs the optional package trl")
    assert kind == "module" or (ROOT / target).exists(), f"no file {target}"
    parse_own_flags(kind, target, args)
    cut = args.index("--") if "--" in args else len(args)
    argv = [*args[:cut], "--help", *args[cut:]]
    monkeypatch.setattr(sys, "argv", [target, *argv])
    code = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is imported already
        try:
            if kind == "script":
                runpy.run_path(str(ROOT / target), run_name="__main__")
            else:
                runpy.run_module(target, run_name="__main__")
        except SystemExit as e:
            code = e.code
    out = capsys.readouterr().out
    assert code in (0, None) and "usage:" in out, out[-2000:]
