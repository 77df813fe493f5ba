"""extras/: every command answers --help, with help text and choices for every flag; the
comparison's runs, report and figures."""

import argparse
import ast
import importlib
import json
import runpy
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import rti
import runtime
from extras import compare, compare_figures, compare_report

ROOT = Path(__file__).resolve().parent.parent
# the extras modules that are commands (a `main`), found in the files without importing them
EXTRAS_COMMANDS = sorted(
    f"extras.{path.stem}"
    for path in (ROOT / "extras").glob("*.py")
    if any(
        isinstance(node, ast.FunctionDef) and node.name == "main"
        for node in ast.parse(path.read_text()).body
    )
)
COMMANDS = ["rti", *EXTRAS_COMMANDS]
NEEDS_TRL = {"extras.trl_rti", "extras.bench_trl"}  # optional: skipped without trl

# The str-valued options that take any value (paths, model names, split names, ...), each with why;
# every other str-valued option is one of a few words and must list its choices.
CONFIG_FREE_FORM = {  # rti.Config's, in every parser runtime.build_parser builds
    "model": "'tiny' or any model directory",
    "init": "any checkpoint directory, or ''",
    "user_model": "'', 'scripted' or any model directory",
    "train_split": "the env's split names; tau2's come from the tau2 package",
    "test_split": "the env's split names; tau2's come from the tau2 package",
    "ood_split": "the env's split names, or ''",
    "out": "any run directory",
    "path": "the model directory to evaluate",
}
FREE_FORM = {
    "rti": CONFIG_FREE_FORM,
    "extras.audit": {},
    "extras.bench": {"model": "any model directory"},
    "extras.bench_trl": {"model": "any model directory", "out": "any directory"},
    "extras.compare": {
        "out": "any directory",
        "extra": "any flags of rti.py",
        "equal_episodes": "--out folders of earlier comparisons",
        "grpo_lr": "a learning rate, passed on to rti.py's --lr as written",
        "teacher": "any model directory, or ''",
        "grpo_train_split": "the env's split names (the env comes after --), or ''",
        "baseline_flags": "NAME=FLAGS, each checked by the baseline's own parser",
    },
    "extras.scale": {
        **CONFIG_FREE_FORM,
        "device": "cuda:N names any GPU",
        "attn_implementation": "transformers' kernels, hub kernels included",
        "model_config": "a preset name, a model directory or a config.json",
    },
    "extras.tau2": {"split": "tau2's split names, from the tau2 package"},
    "extras.trl_rti": {"model": "any model directory", "out": "any directory"},
    "extras.warmstart": {**CONFIG_FREE_FORM, "ws_out": "any directory"},
    "extras.teacher": {**CONFIG_FREE_FORM, "ws_out": "any directory"},
    "extras.gspo": CONFIG_FREE_FORM,
    "extras.aepo": CONFIG_FREE_FORM,
    "extras.luffy": {**CONFIG_FREE_FORM, "teacher": "any model directory"},
    "extras.opd": {**CONFIG_FREE_FORM, "teacher": "any model directory"},
}
# the flags of rti.Config's nested configs (loss.py's LossConfig, intervene.py's RTIConfig)
NESTED = {f.name for parent, f in runtime.flag_fields(rti.Config) if parent}


def import_command(name: str):
    if name in NEEDS_TRL:
        pytest.importorskip("trl", reason="needs the optional package trl")
    return importlib.import_module(name)


def option_problems(parser: argparse.ArgumentParser, free_form: dict, dests) -> list[str]:
    """What is missing on the options of `parser` whose dest is in `dests`: help text, and choices
    for a str-valued option that is not in `free_form`."""
    problems = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.dest not in dests:
            continue
        name = "/".join(action.option_strings) or action.dest
        if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
            problems.append(f"{name}: no help text")
        takes_a_word = action.nargs != 0 and action.type in (None, str)
        if takes_a_word and action.choices is None and action.dest not in free_form:
            problems.append(f"{name}: a str value without choices (or add it to FREE_FORM)")
    return problems


@pytest.mark.parametrize("command", ["rti.py", "envs.py", *EXTRAS_COMMANDS])
def test_every_command_answers_help(command, monkeypatch, capsys):
    """Each command of the README, run in this process as `python COMMAND --help` runs it (runpy:
    its `__main__` block too), exits 0 and prints its usage (envs.py prints a sample task on any
    use)."""
    if command.endswith(".py"):
        run = runpy.run_path
        target = str(ROOT / command)
    else:
        import_command(command)
        run = runpy.run_module
        target = command
    monkeypatch.setattr(sys, "argv", [command, "--help"])
    code = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is imported already
        try:
            run(target, run_name="__main__")
        except SystemExit as e:
            code = e.code
    out = capsys.readouterr().out
    assert code in (0, None) and ("usage:" in out or "first message" in out), out[-2000:]


def test_rti_answers_help_from_a_fresh_interpreter():
    """The one real process: `python rti.py --help` from the checkout, as the README runs it."""
    out = subprocess.run(
        [sys.executable, "rti.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr[-2000:]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_has_help_and_choices(command):
    """Every option of every command (rti.py's own run flags, the extras commands') has help text,
    a str-valued option that takes one of a few words lists them, and --help shows defaults."""
    parser = import_command(command).build_parser()
    assert issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter)
    free_form = FREE_FORM.get(command, {})
    dests = {a.dest for a in parser._actions}
    stale = set(free_form) - dests
    assert not stale, f"FREE_FORM[{command!r}] names options it has not: {stale}"
    problems = option_problems(parser, free_form, dests - NESTED)
    assert not problems, "\n".join(problems)


def test_every_nested_config_option_has_help_and_choices():
    """The same for the flags of loss.py's and intervene.py's configs, which rti.py, extras.scale
    and extras.warmstart share: their help text and choices sit in their fields' metadata."""
    problems = option_problems(runtime.build_parser(rti.Config), {}, NESTED)
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------- the comparison


def test_boundary_counts_tasks_the_warm_start_never_solves():
    # tasks 0, 2, 3 never solved
    warm = [[False] * 16, [True] + [False] * 15, [False] * 16, [False] * 16]
    after = {
        # seed 0 solves task 0
        0: [[True, False, False, False], [False] * 4, [False] * 4, [False] * 4],
        # seed 1 solves tasks 0 and 2
        1: [[True] * 4, [True] * 4, [False, True, False, False], [False] * 4],
    }
    results = {(name, s): {"after_tasks": after[s]} for name in compare.METHODS for s in (0, 1)}
    n, share = compare_report.boundary(results, warm, [0, 1])
    assert n == 3
    assert share["RTI"] == pytest.approx((100 / 3 + 200 / 3) / 2)


def test_report_writes_the_table_and_the_gap(tmp_path):
    def summary(p1):
        return {k: p1 for k, _ in compare_report.COLUMNS}

    results = {}
    for name in compare.METHODS:
        for s, p1 in ((0, 10.0), (1, 20.0)):
            bonus = 15.0 if name == "RTI" else 0.0
            results[(name, s)] = {
                "after": summary(p1 + bonus),
                "after_tasks": [[p1 > 10] * 4, [False] * 4],
            }
    warm = (summary(5.0), [[False] * 16, [True] * 16])
    compare_report.write_report(
        results, warm, [0, 1], tmp_path, 60.0, "python -m extras.compare --seeds 0 1"
    )
    md = (tmp_path / "compare.md").read_text()
    assert "| RTI | 30.00 |" in md and "| GRPO | 15.00 |" in md
    assert "warm start (16 samples) | 5.00" in md
    assert "RTI minus GRPO p@1 per seed: +15.00, +15.00 (mean +15.00)" in md
    assert "1 of 2 test tasks are never solved" in md
    csv = (tmp_path / "compare.csv").read_text().splitlines()
    assert len(csv) == 1 + 2 * len(compare.METHODS) and csv[0].startswith("method,seed,p@1")


def test_a_subset_of_methods_reports_only_those(tmp_path):
    results = {
        (name, 0): {
            "after": {k: 10.0 + 20 * (name == "RTI") for k, _ in compare_report.COLUMNS},
            "after_tasks": [[False] * 4],
        }
        for name in ("GRPO", "RTI")
    }
    warm = ({k: 5.0 for k, _ in compare_report.COLUMNS}, [[False] * 16])
    compare_report.write_report(
        results, warm, [0], tmp_path, 1.0, "python -m extras.compare --seeds 0 --methods GRPO RTI"
    )
    md = (tmp_path / "compare.md").read_text()
    assert "| RTI | 30.00 |" in md and "w/o" not in md and "+20.00" in md
    assert len((tmp_path / "compare.csv").read_text().splitlines()) == 3
    # the ablations alone: no gap to give
    after = {k: 40.0 for k, _ in compare_report.COLUMNS}
    ablations = {
        (name, 0): {"after": after, "after_tasks": [[True] * 4]}
        for name in ("RTI w/o verifier", "RTI w/o reweight")
    }
    compare_report.write_report(
        ablations, warm, [0], tmp_path, 1.0, "python -m extras.compare --seeds 0 --methods ..."
    )
    md = (tmp_path / "compare.md").read_text()
    assert "| RTI w/o reweight | 40.00 |" in md
    assert "| GRPO |" not in md and "RTI minus GRPO" not in md


def test_curve_table_gives_each_evaluation_and_each_seeds_gap(tmp_path):
    # test p@1 at steps 8 and 16
    p1 = {"GRPO": {0: [10, 12], 1: [11, 9]}, "RTI": {0: [30, 40], 1: [20, 35]}}
    for name in compare.METHODS:
        for s in (0, 1):
            run = tmp_path / f"{compare.slug(name)}-s{s}"
            run.mkdir()
            vals = p1.get(name, p1["RTI"])[s]
            rows = [
                {"step": 8, "train_success": 0.1, "test/p@1": vals[0]},
                {"step": 9, "train_success": 0.2},
                {"step": 16, "test/p@1": vals[1]},
            ]
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    methods = list(compare.METHODS)
    lines = compare_report.curve_table(
        compare.read_logs([tmp_path], methods, [0, 1]), [0, 1], 5.0, methods
    )
    assert lines[0] == "| p@1 at step | 0 | 8 | 16 |"
    assert "| GRPO | 5.00 | 10.50 | 10.50 |" in lines and "| RTI | 5.00 | 25.00 | 37.50 |" in lines
    assert "| RTI - GRPO, seed 1 | +0.00 | +9.00 | +26.00 |" in lines
    logs = compare.read_logs([tmp_path], ["RTI w/o verifier"], [0, 1])
    lines = compare_report.curve_table(logs, [0, 1], 5.0, ["RTI w/o verifier"])
    # no gap rows
    assert lines[2] == "| RTI w/o verifier | 5.00 | 25.00 | 37.50 |" and len(lines) == 3


def test_mechanics_table_averages_each_block_over_steps_and_seeds():
    logs = {
        ("GRPO", 0): [
            {"step": 1, "train_success": 0.0, "trained_rows": 0},
            {"step": 2, "train_success": 0.5},
            {"step": 3, "train_success": 1.0, "trained_rows": 16},
        ],
        ("GRPO", 1): [
            {"step": 1, "train_success": 0.25},
            {"step": 2, "train_success": 0.25},
            {"step": 3, "train_success": 0.0},
        ],
        ("RTI", 0): [
            {
                "step": 1,
                "rti/trigger_rate": 1.0,
                "intervened/clip_frac": 0.5,
                "intervened_frac": 0.1,
            },
            {"step": 2, "rti/trigger_rate": 0.5, "intervened/clip_frac": float("nan")},
            {"step": 3, "rti/trigger_rate": 0.0, "intervened/clip_frac": 0.0, "intervened_frac": 0},
        ],
        ("RTI", 1): [
            {"step": 1, "rti/trigger_rate": 0.5},
            {"step": 2, "rti/trigger_rate": 0.0},
            {"step": 3, "rti/trigger_rate": 0.0},
        ],
    }
    lines = compare_report.mechanics_table(logs, [0, 1], block=2)
    assert lines[0] == "| steps | 1-2 | 3-3 |"
    # (0 + 50 + 25 + 25) / 4, (100 + 0) / 2
    assert "| GRPO train success, sampled (%) | 25.00 | 50.00 |" in lines
    assert "| RTI groups triggered (%) | 50.00 | 0.00 |" in lines  # (100 + 50 + 50 + 0) / 4
    # NaN steps and those without intervened tokens sit out
    assert "| RTI intervened tokens clipped (%) | 50.00 | - |" in lines
    assert "| GRPO trained rows a step | 0.00 | 16.00 |" in lines
    assert "| GRPO train success, sampled (%), seed 1 | 25.00 | 0.00 |" in lines


def test_rewritten_actions_counts_the_corrected_turns_of_intervened_trajectories():
    from loss import INTERVENED, POLICY

    class T:
        def __init__(self, turns, actions, source, intervention):
            self.turns = turns
            self.actions = actions
            self.source = source
            self.intervention = intervention

    corrected = T(
        [(0, 2), (2, 4), (4, 5)],
        ["move up", "route", "finish"],
        [POLICY, POLICY, INTERVENED, INTERVENED, INTERVENED],
        {"corrections": 2},
    )
    original = T([(0, 2)], ["route"], [INTERVENED, INTERVENED], None)  # not intervened: not counted
    assert compare_report.rewritten_actions([corrected, original]) == {"route": 1, "finish": 1}


def test_a_rerun_comparison_keeps_finished_runs_and_resumes_the_others(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(compare.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    done, half, new = (tmp_path / n for n in ("done", "half", "new"))
    done.mkdir()
    half.mkdir()
    (done / "results.json").write_text("{}")
    (half / "ckpt.pt").write_bytes(b"")
    for out in (done, half, new):
        compare.run_one((["--method", "rti"], str(out), str(tmp_path / f"{out.name}.log")))
    assert len(calls) == 2 and "--resume" in calls[0] and "--resume" not in calls[1]
    assert calls[0][calls[0].index("--out") + 1] == str(half)


def test_method_settings_reach_their_methods_only(tmp_path, capsys):
    """--grpo-lr and --grpo-train-split reach the GRPO methods' runs only (RTI's stay rti.py's),
    --teacher LUFFY's and OPD's only, --baseline-flags its baseline's only; the report's command
    names what is not a default, and a bad value stops before any run."""
    gspo = "GSPO=--lr 3e-5 --train-split 'fit-share-0.25'"
    settings = compare.MethodSettings("3e-5", "train-share-0.1", "T", (gspo, "OPD=--lr 1e-5"))
    for name in compare.CHOICES:
        expected = ["--lr", "3e-5", "--train-split", "train-share-0.1"] if "GRPO" in name else []
        expected += ["--teacher", "T"] if name in ("LUFFY", "OPD") else []
        expected += ["--lr", "3e-5", "--train-split", "fit-share-0.25"] if name == "GSPO" else []
        expected += ["--lr", "1e-5"] if name == "OPD" else []
        assert settings.flags(name) == expected
    assert compare.MethodSettings().flags("RTI") == []
    assert compare.MethodSettings().flags("GRPO") == ["--lr", compare.GRPO_LR]
    line = compare.command_line([0], "out", settings=settings)
    assert (
        " --grpo-lr 3e-5 --grpo-train-split train-share-0.1 --teacher T --baseline-flags " in line
    )
    # the report's command, read back by a shell, gives the same settings
    args = compare.build_parser().parse_args(shlex.split(line)[3:])
    assert args.baseline_flags == [gspo, "OPD=--lr 1e-5"]
    assert "--grpo" not in compare.command_line([0], "out") and "--teacher" not in line[:20]
    runs = ["--out", str(tmp_path / "runs")]
    # (flags, the exit's words, the error the method's own command prints, naming the flag)
    refusals = [
        (["--grpo-lr", "fast"], "GRPO: its runs would stop", "--lr: invalid float value: 'fast'"),
        (["--grpo-lr", "0"], "GRPO: its runs would stop", "--lr: must be > 0"),
        (
            ["--methods", "GRPO", "RTI", "--teacher", "checkpoints/teacher"],
            "--teacher: no method",
            "",
        ),
        (
            ["--methods", "OPD", "--teacher", "nowhere"],
            "OPD: its runs",
            "--teacher: holds no model",
        ),
        (["--methods", "RTI", "--grpo-train-split", "fit"], "--grpo-train-split: no GRPO", ""),
        (["--grpo-train-split", "train-share-0.1"], "GRPO: its runs", "--train-split: must be a"),
        (["--methods", "GSPO", "--baseline-flags", "GSPO"], "'GSPO' is not NAME=FLAGS", ""),
        (["--methods", "GSPO", "--baseline-flags", "RTI=--lr 1"], "'RTI=--lr 1' is not NAME=", ""),
        (["--methods", "GSPO", "--baseline-flags", "OPD=--lr 1"], "OPD is not in --methods", ""),
        (
            ["--methods", "GSPO", "--baseline-flags", "GSPO=--lrr 1"],
            "GSPO: its",
            "unrecognized arguments: --lrr",
        ),
        (
            ["--methods", "GSPO", "--baseline-flags", "GSPO=", "--baseline-flags", "GSPO="],
            "twice",
            "",
        ),
        (["--methods", "GSPO", "--baseline-flags", "GSPO=--train-split ood"], "GSPO: its", "ood"),
    ]
    for flags, message, error in refusals:
        with pytest.raises(SystemExit, match=message) as stop:
            compare.main([*flags, *runs])
        assert error in capsys.readouterr().err
        # the exit names the run's whole command, the flag that fails it included
        assert "its runs" not in message or flags[-1].split("=")[-1] in str(stop.value)
    # the flags after -- go to every run: each method's own command checks them
    with pytest.raises(SystemExit, match="LUFFY: its runs"):
        compare.main(["--methods", "LUFFY", *runs, "--", "--luffy-teacher-tries", "0"])
    assert "--luffy-teacher-tries: must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="GRPO: its runs"):
        compare.main(["--methods", "LUFFY", "GRPO", *runs, "--", "--luffy-teacher-tries", "2"])
    assert "unrecognized arguments: --luffy-teacher-tries" in capsys.readouterr().err
    assert compare.check_run("LUFFY", ["--luffy-teacher-tries", "2"]).luffy_teacher_tries == 2
    assert not (tmp_path / "runs").exists()
    for name in compare.CHOICES:  # every method's own flags pass its own command's check
        compare.check_run(name, [*compare.METHODS.get(name, []), *compare.QUICK])


def test_the_warm_start_boundary_is_sampled_once(tmp_path):
    warm = [{"p@1": 12.5}, [[True] * 16, [False] * 16]]
    (tmp_path / "warm_start_val.json").write_text(json.dumps(warm))
    # read back, no model
    assert (
        list(compare.warm_boundary(tmp_path, "no/such/model", "navigation", "val", 2, 0, 1)) == warm
    )
    # another number of tasks, split or env: sampled again, from the model
    others = [("navigation", "val", 3), ("navigation", "test", 2), ("navigation-keys", "val", 2)]
    for env, split, n in others:
        with pytest.raises(FileNotFoundError):
            compare.warm_boundary(tmp_path, "no/such/model", env, split, n, 0, 1)


@pytest.mark.slow
def test_quick_comparison_end_to_end(tmp_path):
    """`python -m extras.compare --quick` trains all five methods and writes the table."""
    subprocess.run(
        [sys.executable, "-m", "extras.compare", "--quick", "--seeds", "0", "--out", str(tmp_path)],
        cwd=ROOT,
        check=True,
    )
    md = (tmp_path / "compare.md").read_text()
    for name in compare.METHODS:
        assert f"| {name} |" in md
    assert "RTI minus GRPO p@1 per seed:" in md
    assert len((tmp_path / "compare.csv").read_text().splitlines()) == 1 + len(compare.METHODS)


@pytest.mark.slow
def test_one_warm_start_batch_gives_the_corrections_line_and_fig7(tmp_path):
    policy, batch = compare.warm_batch(rti.WARMSTART_DIR, "navigation", "train", seed=0, n_tasks=8)
    # the warm start fails whole groups on many train tasks: some are intervened
    assert any(t.intervention for t in batch)
    line = compare_report.corrections_written(batch, "the warm start")
    words = compare_report.rewritten_actions(batch)
    kept = sum(1 for t in batch if t.intervention)
    assert f"on 8 train tasks x 8 from the warm start, RTI keeps {kept} " in line
    assert f"with {sum(words.values())} rewritten turns" in line
    try:
        compare_figures.pyplot()
    except ImportError:
        return  # matplotlib is optional: the line above is all a report without it gets
    compare_figures.plot_heatmap(policy, batch, tmp_path / "fig7.png")
    assert (tmp_path / "fig7.png").stat().st_size > 0


def compute_log(episodes_per_step: int, p1: dict[int, float], steps: int = 4) -> list[dict]:
    """A metrics log as runtime.Progress writes it: compute totals every step, test p@1 at `p1`'s
    steps, one training minute a step."""
    rows = []
    for step in range(1, steps + 1):
        rows.append(
            {
                "step": step,
                "total/episodes": episodes_per_step * step,
                "total/generated_tokens": 10 * episodes_per_step * step,
                "time/train_total": 60.0 * step,
            }
        )
        if step in p1:
            rows.append({"step": step, "test/p@1": p1[step]})
    return rows


def test_compute_table_compares_methods_at_equal_sampled_episodes():
    """A method that samples more per step is read at the last evaluation within the smallest
    final episode count of its seed."""
    logs = {
        ("GRPO", 0): compute_log(64, {2: 5.0, 4: 6.0}),
        ("RTI", 0): compute_log(128, {2: 40.0, 4: 80.0}),
    }
    lines = compare_report.compute_table(logs, [0], ["GRPO", "RTI"])
    grpo, rti_row = lines[2], lines[3]
    assert grpo == "| 0 | GRPO | 256 (0) | 2,560 (0) | 0 | 4.0 | 6.00 | 6.00 (4) | 6.00 (4) |"
    # RTI reached 256 episodes (2,560 tokens) at step 2: compared there, not at its end
    assert rti_row == "| 0 | RTI | 512 (0) | 5,120 (0) | 0 | 4.0 | 80.00 | 40.00 (2) | 40.00 (2) |"
    logs[("GRPO", 0)] = [{"step": 1, "train_success": 0.0}]  # a log of older code
    assert compare_report.compute_table(logs, [0], ["GRPO", "RTI"]) == []


def test_family_report_reads_each_family_over_training_and_at_equal_episodes():
    """Each family's curve, and its p@1 where compute_table reads the run: RTI, sampling twice
    GRPO's episodes a step, at step 2 (GRPO's budget), GRPO at its end."""
    logs = {
        ("GRPO", 0): compute_log(64, {2: 5.0, 4: 6.0}),
        ("RTI", 0): compute_log(128, {2: 40.0, 4: 80.0}),
    }
    families = {("GRPO", 0): {2: (8, 1), 4: (9, 3)}, ("RTI", 0): {2: (50, 20), 4: (90, 70)}}
    for run, by_step in families.items():
        for row in logs[run]:
            if "test/p@1" in row:
                plain, keys = by_step[row["step"]]
                row.update({"test/plain/p@1": plain, "test/keys/p@1": keys, "test/keys/n": 4})
    assert compare_report.family_keys(logs) == ["test/plain/p@1", "test/keys/p@1"]
    lines = compare_report.family_report(logs, [0], ["GRPO", "RTI"])
    assert "| GRPO | 1.00 | 3.00 |" in lines and "| RTI | 20.00 | 70.00 |" in lines  # keys curve
    assert "| RTI - GRPO, seed 0 | +19.00 | +67.00 |" in lines
    table = lines[lines.index("p@1 per task family at equal sampled episodes:") + 2 :]
    assert table[0] == "| method | test, plain, at equal episodes | test, keys, at equal episodes |"
    assert table[2] == "| GRPO | 9.00 (9.00 at 4) | 3.00 (3.00 at 4) |"
    assert table[3] == "| RTI | 50.00 (50.00 at 2) | 20.00 (20.00 at 2) |"
    one_family = {
        run: [{k: v for k, v in r.items() if k.count("/") < 2} for r in rows]
        for run, rows in logs.items()
    }
    assert compare_report.family_report(one_family, [0], ["GRPO", "RTI"]) == []


def test_compute_table_counts_the_teachers_episodes_and_tokens():
    """A teacher's episodes and generated tokens add to the policy's, and the tokens it scores
    count at equal tokens: a method whose teacher doubles its compute is read at half its steps."""
    logs = {
        ("GRPO", 0): compute_log(64, {2: 5.0, 4: 6.0}),
        ("LUFFY", 0): compute_log(64, {2: 50.0, 4: 60.0}),
        ("OPD", 0): compute_log(64, {2: 70.0, 4: 90.0}),
    }
    for step, row in enumerate(r for r in logs[("LUFFY", 0)] if "total/episodes" in r):
        row["total/teacher/episodes"] = 64 * (step + 1)
        row["total/teacher/generated_tokens"] = 640 * (step + 1)
    for step, row in enumerate(r for r in logs[("OPD", 0)] if "total/episodes" in r):
        row["total/teacher/scored_tokens"] = 640 * (step + 1)
    lines = compare_report.compute_table(logs, [0], ["GRPO", "LUFFY", "OPD"])
    assert lines[2] == "| 0 | GRPO | 256 (0) | 2,560 (0) | 0 | 4.0 | 6.00 | 6.00 (4) | 6.00 (4) |"
    # LUFFY: 512 episodes (256 the teacher's) and 5,120 tokens: read at step 2 on both
    assert lines[3] == (
        "| 0 | LUFFY | 512 (256) | 5,120 (2,560) | 0 | 4.0 | 60.00 | 50.00 (2) | 50.00 (2) |"
    )
    # OPD: the teacher samples nothing, but scores 2,560 tokens: equal episodes at its end,
    # equal tokens at step 2
    assert (
        lines[4]
        == "| 0 | OPD | 256 (0) | 2,560 (0) | 2,560 | 4.0 | 90.00 | 90.00 (4) | 70.00 (2) |"
    )


def test_equal_episodes_reads_runs_of_several_comparisons(tmp_path):
    """Runs of different --steps in two --out folders are set side by side in one table; a folder
    without a method's runs for every seed is an error naming the seeds."""

    def write_run(folder: str, name: str, rows: list[dict]) -> None:
        run = tmp_path / folder / f"{compare.slug(name)}-s0"
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    write_run("a", "GRPO", compute_log(64, {2: 5.0, 4: 6.0}))
    write_run("a", "RTI", compute_log(128, {2: 40.0, 4: 80.0}))
    write_run("b", "GRPO + dynamic sampling", compute_log(256, {1: 7.0}, steps=1))
    out = tmp_path / "ab"
    compare.main(
        ["--equal-episodes", str(tmp_path / "a"), str(tmp_path / "b"), "--seeds", "0"]
        + ["--out", str(out)]
    )
    table = (out / "equal_episodes.md").read_text().splitlines()
    assert "| 0 | GRPO | 256 (0) | 2,560 (0) | 0 | 4.0 | 6.00 | 6.00 (4) | 6.00 (4) |" in table
    dynamic = "| 0 | GRPO + dynamic sampling | 256 (0) | 2,560 (0) | 0 | 1.0 | 7.00 | 7.00 (1) |"
    assert dynamic + " 7.00 (1) |" in table
    assert "| 0 | RTI | 512 (0) | 5,120 (0) | 0 | 4.0 | 80.00 | 40.00 (2) | 40.00 (2) |" in table
    # the curves over the union of the runs' evaluation steps, "-" where a run has none
    assert "| p@1 at step | 1 | 2 | 4 |" in table
    assert "| GRPO | - | 5.00 | 6.00 |" in table
    assert "| GRPO + dynamic sampling | 7.00 | - | - |" in table
    assert "| RTI - GRPO, seed 0 | - | +35.00 | +74.00 |" in table
    command = f"python -m extras.compare --equal-episodes {tmp_path / 'a'} {tmp_path / 'b'}"
    assert f"Command: `{command} --seeds 0 --out {out}`" in table[0]
    # the p@1 by split and family at the end, once every run has its results.json
    assert "p@1 after training by split and task family, mean (seeds):" not in table
    for folder, name in (("a", "GRPO"), ("a", "RTI"), ("b", "GRPO + dynamic sampling")):
        after = {"p@1": 50.0, "keys/p@1": 10.0 if name == "GRPO" else 30.0}
        results = tmp_path / folder / f"{compare.slug(name)}-s0" / "results.json"
        results.write_text(json.dumps({"after": after, "config": {"env": "navigation"}}))
    compare.main(
        ["--equal-episodes", str(tmp_path / "a"), str(tmp_path / "b"), "--seeds", "0"]
        + ["--out", str(out)]
    )
    table = (out / "equal_episodes.md").read_text().splitlines()
    assert "| method | test | test, keys |" in table
    assert "| GRPO | 50.00 (50.00) | 10.00 (10.00) |" in table
    assert "| RTI | 50.00 (50.00) | 30.00 (30.00) |" in table
    with pytest.raises(SystemExit, match=r"for every seed \[0, 1\]"):
        compare.main(["--equal-episodes", str(tmp_path / "a"), "--seeds", "0", "1"])


def test_the_report_gives_each_family_and_the_ood_split_per_seed():
    """Runs with task families and an OOD split: one row a method, the test split, each family and
    the OOD split, mean over seeds with each seed's value; runs with neither add no table."""

    def run(p1, keys, ood):
        return {
            "after": {"p@1": p1, "plain/p@1": p1 + 5, "keys/p@1": keys},
            "after_ood": {"p@1": ood},
        }

    results = {("GRPO", 0): run(50, 10, 4), ("GRPO", 1): run(60, 30, 6), ("RTI", 0): run(70, 50, 8)}
    results[("RTI", 1)] = run(80, 70, 12)
    lines = compare_report.split_table(results, [0, 1])
    assert lines[0] == "| method | test | test, plain | test, keys | ood |"
    assert (
        lines[2]
        == "| GRPO | 55.00 (50.00, 60.00) | 60.00 (55.00, 65.00) | 20.00 (10.00, 30.00) | 5.00 (4.00, 6.00) |"
    )
    assert lines[3].startswith("| RTI | 75.00 (70.00, 80.00) |") and lines[3].endswith(
        "| 10.00 (8.00, 12.00) |"
    )
    assert compare_report.split_table({("GRPO", 0): {"after": {"p@1": 1.0}}}, [0]) == []
