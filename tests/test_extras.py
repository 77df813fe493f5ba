"""extras/: the comparison's report, and every optional command answers --help from a fresh checkout."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from extras import compare

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "command",
    [
        ["rti.py"],
        ["envs.py"],
        ["-m", "extras.compare"],
        ["-m", "extras.bench"],
        ["-m", "extras.scale"],
        ["-m", "extras.tau2"],
        ["-m", "extras.warmstart"],
        ["-m", "extras.trl_rti"],
        ["-m", "extras.bench_trl"],
    ],
)
def test_every_command_answers_help(command):
    """Each command of the README starts and prints its usage (envs.py and extras.tau2 print theirs on any use)."""
    out = subprocess.run(
        [sys.executable, *command, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode in (0, 1) and (
        "usage" in (out.stdout + out.stderr).lower() or "first message" in out.stdout
    ), out.stderr[-2000:]


def test_boundary_counts_tasks_the_warm_start_never_solves():
    warm = [
        [False] * 16,
        [True] + [False] * 15,
        [False] * 16,
        [False] * 16,
    ]  # tasks 0, 2, 3 never solved
    after = {
        0: [
            [True, False, False, False],
            [False] * 4,
            [False] * 4,
            [False] * 4,
        ],  # seed 0 solves task 0
        1: [[True] * 4, [True] * 4, [False, True, False, False], [False] * 4],
    }  # seed 1 solves tasks 0 and 2
    results = {(name, s): {"after_tasks": after[s]} for name in compare.METHODS for s in (0, 1)}
    n, share = compare.boundary(results, warm, [0, 1])
    assert n == 3
    assert share["RTI"] == pytest.approx((100 / 3 + 200 / 3) / 2)


def test_report_writes_the_table_and_the_gap(tmp_path):
    def summary(p1):
        return {k: p1 for k, _ in compare.COLUMNS}

    results = {}
    for name in compare.METHODS:
        for s, p1 in ((0, 10.0), (1, 20.0)):
            bonus = 15.0 if name == "RTI" else 0.0
            results[(name, s)] = {
                "after": summary(p1 + bonus),
                "after_tasks": [[p1 > 10] * 4, [False] * 4],
            }
    warm = (summary(5.0), [[False] * 16, [True] * 16])
    compare.write_report(
        results, warm, [0, 1], tmp_path, 60.0, "python -m extras.compare --seeds 0 1"
    )
    md = (tmp_path / "compare.md").read_text()
    assert (
        "| RTI | 30.00 |" in md
        and "| GRPO | 15.00 |" in md
        and "warm start (16 samples) | 5.00" in md
    )
    assert "RTI minus GRPO p@1 per seed: +15.00, +15.00 (mean +15.00)" in md
    assert "1 of 2 test tasks are never solved" in md
    csv = (tmp_path / "compare.csv").read_text().splitlines()
    assert len(csv) == 1 + 2 * len(compare.METHODS) and csv[0].startswith("method,seed,p@1")


def test_a_subset_of_methods_reports_only_those(tmp_path):
    results = {
        (name, 0): {
            "after": {k: 10.0 + 20 * (name == "RTI") for k, _ in compare.COLUMNS},
            "after_tasks": [[False] * 4],
        }
        for name in ("GRPO", "RTI")
    }
    warm = ({k: 5.0 for k, _ in compare.COLUMNS}, [[False] * 16])
    compare.write_report(
        results, warm, [0], tmp_path, 1.0, "python -m extras.compare --seeds 0 --methods GRPO RTI"
    )
    md = (tmp_path / "compare.md").read_text()
    assert "| RTI | 30.00 |" in md and "w/o" not in md and "+20.00" in md
    assert len((tmp_path / "compare.csv").read_text().splitlines()) == 3
    ablations = {
        (name, 0): {"after": {k: 40.0 for k, _ in compare.COLUMNS}, "after_tasks": [[True] * 4]}
        for name in ("RTI w/o verifier", "RTI w/o reweight")
    }  # the ablations alone: no gap to give
    compare.write_report(
        ablations, warm, [0], tmp_path, 1.0, "python -m extras.compare --seeds 0 --methods ..."
    )
    md = (tmp_path / "compare.md").read_text()
    assert (
        "| RTI w/o reweight | 40.00 |" in md and "| GRPO |" not in md and "RTI minus GRPO" not in md
    )


def test_curve_table_gives_each_evaluation_and_each_seeds_gap(tmp_path):
    p1 = {
        "GRPO": {0: [10, 12], 1: [11, 9]},
        "RTI": {0: [30, 40], 1: [20, 35]},
    }  # test p@1 at steps 8 and 16
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
    lines = compare.curve_table(compare.read_logs(tmp_path, compare.METHODS, [0, 1]), [0, 1], 5.0)
    assert lines[0] == "| p@1 at step | 0 | 8 | 16 |"
    assert "| GRPO | 5.00 | 10.50 | 10.50 |" in lines and "| RTI | 5.00 | 25.00 | 37.50 |" in lines
    assert "| RTI - GRPO, seed 1 | +0.00 | +9.00 | +26.00 |" in lines
    lines = compare.curve_table(
        compare.read_logs(tmp_path, ["RTI w/o verifier"], [0, 1]), [0, 1], 5.0, ["RTI w/o verifier"]
    )
    assert (
        lines[2] == "| RTI w/o verifier | 5.00 | 25.00 | 37.50 |" and len(lines) == 3
    )  # no gap rows


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
    lines = compare.mechanics_table(logs, [0, 1], block=2)
    assert lines[0] == "| steps | 1-2 | 3-3 |"
    assert (
        "| GRPO train success, sampled (%) | 25.00 | 50.00 |" in lines
    )  # (0 + 50 + 25 + 25) / 4, (100 + 0) / 2
    assert "| RTI groups triggered (%) | 50.00 | 0.00 |" in lines  # (100 + 50 + 50 + 0) / 4
    assert (
        "| RTI intervened tokens clipped (%) | 50.00 | - |" in lines
    )  # NaN steps and those without intervened
    # tokens sit out
    assert "| GRPO trained rows a step | 0.00 | 16.00 |" in lines
    assert "| GRPO train success, sampled (%), seed 1 | 25.00 | 0.00 |" in lines


def test_rewritten_actions_counts_the_corrected_turns_of_intervened_trajectories():
    from loss import INTERVENED, POLICY

    class T:
        def __init__(self, turns, actions, source, intervention):
            self.turns, self.actions, self.source, self.intervention = (
                turns,
                actions,
                source,
                intervention,
            )

    corrected = T(
        [(0, 2), (2, 4), (4, 5)],
        ["move up", "route", "finish"],
        [POLICY, POLICY, INTERVENED, INTERVENED, INTERVENED],
        {"corrections": 2},
    )
    original = T([(0, 2)], ["route"], [INTERVENED, INTERVENED], None)  # not intervened: not counted
    assert compare.rewritten_actions([corrected, original]) == {"route": 1, "finish": 1}


def test_a_rerun_comparison_keeps_finished_runs_and_resumes_the_others(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(compare.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    done, half, new = (tmp_path / n for n in ("done", "half", "new"))
    done.mkdir(), half.mkdir()
    (done / "results.json").write_text("{}")
    (half / "ckpt.pt").write_bytes(b"")
    for out in (done, half, new):
        compare.run_one((["--method", "rti"], str(out), str(tmp_path / f"{out.name}.log")))
    assert len(calls) == 2 and "--resume" in calls[0] and "--resume" not in calls[1]
    assert calls[0][calls[0].index("--out") + 1] == str(half)


def test_the_warm_start_boundary_is_sampled_once(tmp_path):
    warm = [{"p@1": 12.5}, [[True] * 16, [False] * 16]]
    (tmp_path / "warm_start_val.json").write_text(json.dumps(warm))
    assert (
        list(compare.warm_boundary(tmp_path, "no/such/model", "val", 2, 0, 1)) == warm
    )  # read back, no model
    for split, n in (
        ("val", 3),
        ("test", 2),
    ):  # another number of tasks or split: sampled again, from the model
        with pytest.raises(FileNotFoundError):
            compare.warm_boundary(tmp_path, "no/such/model", split, n, 0, 1)


@pytest.mark.slow
def test_quick_comparison_end_to_end(tmp_path):
    """`python -m extras.compare --quick` trains all five methods and writes the table (about 1.5 minutes)."""
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


def test_one_warm_start_batch_gives_the_corrections_line_and_fig7(tmp_path):
    policy, batch = compare.warm_batch(compare.rti.WARMSTART_DIR, seed=0, n_tasks=8)
    assert any(
        t.intervention for t in batch
    )  # the warm start fails whole groups on ~70% of train tasks
    line = compare.corrections_written(batch, "the warm start")
    words = compare.rewritten_actions(batch)
    assert (
        f"on 8 train tasks x 8 from the warm start, RTI keeps {sum(1 for t in batch if t.intervention)} "
        in line
    )
    assert f"with {sum(words.values())} rewritten turns" in line
    try:
        compare.pyplot()
    except ImportError:
        return  # matplotlib is optional: the line above is all a report without it gets
    compare.plot_heatmap(policy, batch, tmp_path / "fig7.png")
    assert (tmp_path / "fig7.png").stat().st_size > 0
