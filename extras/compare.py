"""The method comparison of the paper's Table 3: the runs; optional (extras/).

    python -m extras.compare --seeds 0 1 2 --out results   # GRPO, RTI and its 3 ablations x 3 seeds
    python -m extras.compare --quick --seeds 0             # a smoke run: 4 steps of 4 tasks
    python -m extras.compare --methods GSPO AEPO LUFFY OPD # the paper's other baselines
    python -m extras.compare --methods GSPO --baseline-flags 'GSPO=--lr 3e-5'  # its settings

Every run is `python rti.py` with the method's flags (a baseline of BASELINES: its own command,
`python -m extras.gspo` ..., rti.py's loop with its settings), and any flags given after `--`, from
the same warm start, with the same budget and seeds: 48 steps of 8 tasks x 8, test p@1 every 8
steps; `--jobs` runs go at a time. The same command again resumes: finished runs are kept,
unfinished ones go on from their last checkpoint. Then it writes the report (compare.md,
compare.csv: extras/compare_report.py) and the figures (fig5, fig6, fig7:
extras/compare_figures.py) under --out.

    python -m extras.compare --equal-episodes results/a results/b --seeds 0 1 2 --out results/ab

reads the runs of earlier comparisons (with other --steps, say) and writes equal_episodes.md:
every method found there, per seed, at equal sampled episodes and at equal tokens (a teacher's
counted with the policy's).
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

import envs
import intervene
import rti
import runtime
from extras.compare_figures import plot_compute, plot_curves, plot_heatmap
from extras.compare_report import (
    BOUNDARY_SAMPLES,
    compute_table,
    corrections_written,
    curve_table,
    family_report,
    has_grpo_and_rti,
    mechanics_table,
    split_section,
    training_minutes,
    write_report,
)
from policy import Sampler, load_model

# the paper's Table 3 rows and the strong baseline practitioners use for sparse rewards (DAPO's
# dynamic sampling), all from the same warm start, budget and seeds; each method at the learning
# rate chosen for it on val: RTI rti.py's 1e-4; GRPO (--grpo-lr) 1e-4 from warmstart-evidence (the
# default) and warmstart, 3e-5 from warmstart-route0 (at 1e-4 it collapses there)
GRPO_LR = "1e-4"
METHODS = {
    "GRPO": ["--method", "grpo"],
    "GRPO + dynamic sampling": ["--method", "grpo", "--dynamic-sampling"],
    "RTI": ["--method", "rti"],
    "RTI w/o verifier": ["--method", "rti", "--verifier", "none"],
    "RTI w/o PPL gate": ["--method", "rti", "--no-ppl-gate"],
    "RTI w/o reweight": ["--method", "rti", "--no-reweight"],
}
# the paper's other baselines, each a command of its own: rti.py's loop with the method's settings
# and parts (rti.Method); LUFFY and OPD learn from the teacher (extras/teacher.py). Chosen with
# --methods; the learning rates are rti.py's until chosen on val
BASELINES = {
    "GSPO": "extras.gspo",
    "AEPO": "extras.aepo",
    "LUFFY": "extras.luffy",
    "OPD": "extras.opd",
}
CHOICES = [*METHODS, *BASELINES]
# the baselines that learn from a teacher (--teacher)
TEACHER_GUIDED = ("LUFFY", "OPD")
# the budget of a run: past GRPO's plateau
FULL = ["--steps", "48", "--eval-tasks", "150", "--eval-every", "8", "--save-every", "4"]
QUICK = ["--steps", "4", "--eval-tasks", "30", "--eval-every", "0", "--batch-tasks", "4"]
# test tasks on which the warm start's boundary is sampled (BOUNDARY_SAMPLES samples each)
BOUNDARY_TASKS = 150
BOUNDARY_TASKS_QUICK = 30


def is_grpo(name: str) -> bool:
    """Whether method `name` is one of the GRPO methods (GRPO, GRPO + dynamic sampling)."""
    return METHODS.get(name, [])[:2] == ["--method", "grpo"]


@dataclass(frozen=True)
class MethodSettings:
    """Settings chosen on val for some methods only (extras.compare's flags of the same names):
    the GRPO methods' learning rate and train split ('': the runs' own), the teacher LUFFY and OPD
    learn from ('': their default), and any flags of one baseline of BASELINES (NAME=FLAGS)."""

    grpo_lr: str = GRPO_LR
    grpo_train_split: str = ""
    teacher: str = ""
    baseline_flags: tuple[str, ...] = ()

    def flags(self, name: str) -> list[str]:
        """The flags these settings add to method `name`'s runs."""
        flags = []
        if is_grpo(name):
            flags += ["--lr", self.grpo_lr]
            flags += ["--train-split", self.grpo_train_split] if self.grpo_train_split else []
        if self.teacher and name in TEACHER_GUIDED:
            flags += ["--teacher", self.teacher]
        for item in self.baseline_flags:
            baseline, _, words = item.partition("=")
            flags += shlex.split(words) if baseline == name else []
        return flags

    def words(self) -> list[str]:
        """These settings as extras.compare's flags, defaults left out (the report's command)."""
        words = ["--grpo-lr", self.grpo_lr] if self.grpo_lr != GRPO_LR else []
        words += ["--grpo-train-split", self.grpo_train_split] if self.grpo_train_split else []
        words += ["--teacher", self.teacher] if self.teacher else []
        for item in self.baseline_flags:
            words += ["--baseline-flags", shlex.quote(item)]
        return words


def program(name: str) -> list[str]:
    """The command that trains a method, after `python`: rti.py, or a baseline's module."""
    return ["-m", BASELINES[name]] if name in BASELINES else ["rti.py"]


def slug(name: str) -> str:
    """A method's name as a directory name: 'RTI w/o verifier' -> 'rti-wo-verifier'."""
    return name.lower().replace(" ", "-").replace("/", "")


def run_one(args: tuple) -> str:
    """One training run (flags, run directory, log file[, program: default rti.py]) as a
    subprocess of `python rti.py` or of a baseline's command (one thread each, so `jobs` runs
    share the cores); a run with results is kept, one with a checkpoint resumes from it."""
    flags, out, log = args[:3]
    words = args[3] if len(args) > 3 else ["rti.py"]
    if (Path(out) / "results.json").exists():
        return out
    resume = ["--resume"] if (Path(out) / "ckpt.pt").exists() else []
    command = [sys.executable, *words, *flags, *resume]
    command += ["--out", out, "--threads", "1", "--no-progress"]
    with open(log, "a" if resume else "w") as f:
        subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, check=True)
    return out


def command_line(
    seeds: list[int],
    out_dir: str,
    quick: bool = False,
    jobs: int | None = None,
    extra: list[str] = (),
    methods=tuple(METHODS),
    equal_episodes: list[str] = (),
    settings: MethodSettings = MethodSettings(),
) -> str:
    """The `python -m extras.compare` command that reproduces a comparison (or an
    --equal-episodes table), for its report."""
    subset = []
    if list(methods) != list(METHODS):
        subset = ["--methods", *(f'"{m}"' if " " in m else m for m in methods)]
    words = [
        "python -m extras.compare",
        *(["--quick"] if quick else []),
        *(["--equal-episodes", *equal_episodes] if equal_episodes else []),
        "--seeds",
        *map(str, seeds),
        *subset,
        *(["--jobs", str(jobs)] if jobs is not None else []),
        *settings.words(),
        "--out",
        out_dir,
        *(["--", *extra] if extra else []),
    ]
    return " ".join(words)


def compare(
    seeds: list[int],
    out_dir: str,
    quick: bool,
    jobs: int,
    extra: list[str],
    methods: list[str] = tuple(METHODS),
    settings: MethodSettings = MethodSettings(),
) -> dict:
    """Train each of `methods` (names of METHODS and BASELINES) for every seed from the same warm
    start, with the `settings` chosen for some of them, then write the table (markdown and CSV),
    the beyond-the-boundary counts and the figures under out_dir. Returns the per-run results."""
    out = Path(out_dir)
    runs = [(name, seed) for seed in seeds for name in methods]
    budget = QUICK if quick else FULL
    work = [
        (
            [*METHODS.get(name, []), "--seed", str(seed), "--no-eval-before", *budget, *extra]
            + settings.flags(name),
            str(out / f"{slug(name)}-s{seed}"),
            str(out / f"{slug(name)}-s{seed}.log"),
            program(name),
        )
        for name, seed in runs
    ]
    # every method's flags, checked (a bad one exits) before any run starts
    for (name, seed), (flags, *_) in zip(runs, work):
        if seed == seeds[0]:
            check_run(name, flags)
    # the flags after --, as the first method's command reads them (a baseline's own flags too)
    run_cfg = check_run(methods[0], extra)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(run_one, work))
    wall = time.time() - t0
    split = run_cfg.test_split
    n_boundary = BOUNDARY_TASKS_QUICK if quick else BOUNDARY_TASKS
    warm = warm_boundary(out, run_cfg.init, run_cfg.env, split, n_boundary, seeds[0], jobs)
    results = {
        run: json.loads((Path(w[1]) / "results.json").read_text()) for run, w in zip(runs, work)
    }
    logs = read_logs([out], methods, seeds)
    command = command_line(seeds, out_dir, quick, jobs, extra, methods, settings=settings)
    curves = curve_table(logs, seeds, warm[0]["p@1"], methods)
    curves += family_report(logs, seeds, methods)
    minutes = training_minutes(logs, seeds, methods)
    compute = compute_table(logs, seeds, methods)
    if not has_grpo_and_rti(methods):
        # a subset such as the ablations on more seeds: their table and curves
        report_lines = curves + ["", minutes]
        write_report(
            results, warm, seeds, out, wall, command, report_lines, split=split, compute=compute
        )
        return results
    # one warm-start batch for what the corrections write, and for fig7
    policy, batch = warm_batch(run_cfg.init, run_cfg.env, run_cfg.train_split, seeds[0])
    mechanics = mechanics_table(logs, seeds)
    mechanics += ["", minutes, "", corrections_written(batch, run_cfg.init)]
    write_report(results, warm, seeds, out, wall, command, curves, mechanics, split, compute)
    try:
        plot_curves(logs, out, seeds, warm[0]["p@1"], split)
        if compute:
            plot_compute(logs, out, seeds, methods, split)
        plot_heatmap(policy, batch, out / "fig7_weighted_ratio.png")
    except ImportError:
        print("matplotlib is not installed: no figures (pip install -r requirements-plots.txt)")
    return results


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def run_files(folders: list, methods, seeds: list[int], name: str) -> dict[tuple[str, int], Path]:
    """Each run's file `name` (metrics.jsonl, results.json): the run of (method, seed) from the
    first of `folders` that holds it; a run found in none is left out."""
    files = {}
    for method in methods:
        for seed in seeds:
            paths = [Path(f) / f"{slug(method)}-s{seed}" / name for f in folders]
            found = [path for path in paths if path.exists()]
            if found:
                files[(method, seed)] = found[0]
    return files


def read_logs(folders: list, methods, seeds: list[int]) -> dict[tuple[str, int], list[dict]]:
    """Every run's metrics.jsonl (run_files), read once for the report's tables and figures."""
    return {
        run: read_jsonl(path)
        for run, path in run_files(folders, methods, seeds, "metrics.jsonl").items()
    }


def warm_start_file(out: Path, env: str, split: str) -> Path:
    """Where a comparison keeps its warm start's figures on env's `split`: warm_start_SPLIT.json,
    warm_start_ENV_SPLIT.json for an env other than rti.Config's."""
    name = split if env == rti.Config.env else f"{env}_{split}"
    return out / f"warm_start_{name}.json"


def warm_boundary(
    out: Path, init: str, env: str, split: str, n_tasks: int, seed: int, threads: int
) -> tuple[dict, list[list[bool]]]:
    """The warm start on the first n_tasks tasks of env's `split` (the runs' --env, --test-split),
    BOUNDARY_SAMPLES samples each: (summary, per-task successes), kept in warm_start_file so that
    a resumed comparison does not sample them again."""
    path = warm_start_file(out, env, split)
    tasks = envs.env_tasks(env, split)[:n_tasks]
    cached = json.loads(path.read_text()) if path.exists() else None
    if cached and len(cached[1]) == len(tasks):
        return tuple(cached)
    torch.set_num_threads(threads)
    model, tok = load_model(init)
    sampler = Sampler(model, tok, seed=seed, env=env)
    warm = rti.evaluate_policy(sampler, tasks, BOUNDARY_SAMPLES, seed=seed, per_task=True)
    path.write_text(json.dumps(warm))
    return warm


def warm_batch(model_dir, env: str, split: str, seed: int = 0, n_tasks: int = 32) -> tuple:
    """(policy, batch): one rollout of the first n_tasks tasks of env's `split` (the runs'
    --train-split) x 8 from `model_dir`,
    intervened with the default RTIConfig. From the warm start (a run's first step), since a
    trained model seldom fails a whole group."""
    model, tok = load_model(str(model_dir))
    policy = Sampler(model, tok, seed=seed, env=env)
    trajs = rti.rollout(policy, envs.env_tasks(env, split)[:n_tasks], 8, seed)
    batch, _ = intervene.intervene_batch(policy, trajs, intervene.RTIConfig(), policy.make_env)
    return policy, batch


def equal_episodes(folders: list[str], seeds: list[int], out_dir: str) -> list[str]:
    """The compute table (compute_table), the p@1 curves (curve_table, and each task family's) and,
    when every run has its results.json, the p@1 by split and family at the end (split_section),
    over the runs of earlier comparisons, wherever they lie: every method of CHOICES with a metrics
    log for each seed in one of `folders` (the first folder holding it wins), written to
    out_dir/equal_episodes.md with the command that made it."""
    logs = read_logs(folders, CHOICES, seeds)
    methods = [name for name in CHOICES if all((name, s) in logs for s in seeds)]
    if not methods:
        raise SystemExit(f"no method has a metrics.jsonl for every seed {seeds} in {folders}")
    table = compute_table(logs, seeds, methods)
    if not table:
        raise SystemExit("these runs' logs record no compute (total/episodes): runs of older code")
    found = run_files(folders, methods, seeds, "results.json")
    results = {run: json.loads(path.read_text()) for run, path in found.items()}
    complete = len(results) == len(methods) * len(seeds)
    command = command_line(seeds, out_dir, equal_episodes=folders)
    # the runs' --env, for the warm start's file (rti.Config's if no run has finished)
    env = next(iter(results.values()))["config"]["env"] if results else rti.Config.env
    warm_files = [warm_start_file(Path(f), env, "test") for f in folders]
    warm = [json.loads(path.read_text())[0]["p@1"] for path in warm_files if path.exists()]
    lines = [
        f"Per seed and method at equal sampled episodes and at equal tokens, a teacher's counted "
        f"with the policy's: each run's last test evaluation within the seed's smallest final "
        f"count over the methods. Command: `{command}`",
        "",
        *table,
        "",
        "Test p@1 at every evaluation, mean over seeds"
        + (" (step 0: the warm start of the first folder with one)" if warm else "")
        + ":",
        "",
        *curve_table(logs, seeds, warm[0] if warm else None, methods),
        *family_report(logs, seeds, methods),
    ]
    lines += split_section(results, seeds) if complete else []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "equal_episodes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m extras.compare",
        description="GRPO vs RTI vs its three ablations from the same warm start (Table 3), and "
        "the paper's other baselines (GSPO, AEPO, LUFFY, OPD)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 4 steps of 4 tasks, 30 test tasks, no evaluation between",
    )
    p.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2], help="every method runs once per seed"
    )
    p.add_argument(
        "--methods",
        nargs="+",
        default=list(METHODS),
        choices=CHOICES,
        metavar="NAME",
        help=f"methods of {CHOICES} (quote names with spaces); without GRPO and RTI both, "
        "the report is the table and the curves",
    )
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel, one thread each")
    p.add_argument(
        "--grpo-lr",
        default=GRPO_LR,
        help="the GRPO methods' learning rate, chosen for them on val per warm start: 1e-4 from "
        "warmstart-evidence and warmstart, 3e-5 from warmstart-route0 (RTI keeps rti.py's)",
    )
    p.add_argument(
        "--grpo-train-split",
        default="",
        metavar="SPLIT",
        help="the GRPO methods' --train-split where their choice on val differs from the other "
        "methods' ('': the runs' own; navigation-keys: e.g. train-share-0.1, train drawn with "
        "another share of the keys family)",
    )
    p.add_argument(
        "--teacher",
        default="",
        metavar="DIR",
        help=f"the teacher {', '.join(TEACHER_GUIDED)} learn from, a model with the policy's "
        "tokenizer ('': checkpoints/teacher; navigation-keys: checkpoints/teacher-keys)",
    )
    p.add_argument(
        "--baseline-flags",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help=f"flags chosen on val for one baseline of {list(BASELINES)}, added to its runs "
        "after the flags given after -- (e.g. 'GSPO=--lr 3e-5 --train-split train-share-0.25'); "
        "once per baseline",
    )
    p.add_argument(
        "--out", default="results", help="directory of the runs, the report and the figures"
    )
    p.add_argument(
        "--equal-episodes",
        nargs="+",
        metavar="DIR",
        help="run nothing: read the runs under these --out folders of earlier comparisons (of "
        "any --steps) and write --out/equal_episodes.md, every method per seed at equal sampled "
        "episodes",
    )
    p.add_argument(
        "extra",
        nargs=argparse.REMAINDER,
        help="flags passed on to every `python rti.py` run (after --)",
    )
    return p


def check_run(name: str, flags: list[str]) -> rti.Config:
    """Method `name`'s config from `flags`, read by its own parser and config as its run would;
    a flag they refuse prints the error naming it, and the exit names the run."""
    if name in BASELINES:
        module = importlib.import_module(BASELINES[name])
        config, prog, defaults = module.CONFIG, module.PROG, module.SETTINGS
    else:
        config, prog, defaults = rti.Config, "rti.py", None
    try:
        return runtime.parse_args(flags, config, prog=prog, defaults=defaults)[2]
    except SystemExit:
        command = " ".join(["python", *program(name), *map(shlex.quote, flags)])
        raise SystemExit(f"{name}: its runs would stop with the error above: {command}") from None


def check_baseline_flags(items: list[str], methods: list[str]) -> None:
    """Exit naming the problem unless each of `items` is NAME=FLAGS, NAME a baseline of `methods`
    given once (its command checks FLAGS: check_run)."""
    names = [item.partition("=")[0] for item in items]
    for item in items:
        name, equals, _ = item.partition("=")
        if not equals or name not in BASELINES:
            raise SystemExit(
                f"--baseline-flags: {item!r} is not NAME=FLAGS, NAME of {list(BASELINES)}"
            )
        if name not in methods:
            raise SystemExit(f"--baseline-flags: {name} is not in --methods")
        if names.count(name) > 1:
            raise SystemExit(f"--baseline-flags: {name} is given twice (put its flags in one)")


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    extra = [a for a in args.extra if a != "--"]
    if args.equal_episodes:
        if extra:
            raise SystemExit("--equal-episodes runs nothing: it takes no flags after --")
        equal_episodes(args.equal_episodes, args.seeds, args.out)
        return
    if args.teacher and not set(args.methods) & set(TEACHER_GUIDED):
        raise SystemExit(f"--teacher: no method of --methods learns from one ({TEACHER_GUIDED})")
    if args.grpo_train_split and not any(map(is_grpo, args.methods)):
        raise SystemExit("--grpo-train-split: no GRPO method in --methods")
    check_baseline_flags(args.baseline_flags, args.methods)
    settings = MethodSettings(
        args.grpo_lr, args.grpo_train_split, args.teacher, tuple(args.baseline_flags)
    )
    compare(args.seeds, args.out, args.quick, args.jobs, extra, args.methods, settings)


if __name__ == "__main__":
    main()
