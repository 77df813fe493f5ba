"""The method comparison of the paper's Table 3 and its figures; optional (extras/).

    python -m extras.compare --seeds 0 1 2 --out results   # GRPO, RTI and its 3 ablations x 3 seeds, 2 runs at a time
    python -m extras.compare --quick --seeds 0             # a smoke run: 4 steps of 4 tasks, 30 test tasks

Every run is `python rti.py` with the method's flags (and any flags given after `--`), from the same warm start, with
the same budget and seeds: 48 steps of 8 tasks x 8, test p@1 every 8 steps. Writes compare.md, compare.csv and (with
matplotlib) fig5_correction_ppl.png, fig6_training_curves.png and fig7_weighted_ratio.png under --out. The same
command again resumes: finished runs are kept, unfinished ones go on from their last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import envs
import intervene
import loss
import rti
from evaluate import COLUMNS, format_table


def pyplot():
    """matplotlib's pyplot on a file backend (ImportError, said by compare, when matplotlib is missing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


METHODS = {  # the paper's Table 3 rows, all from the same warm start, budget and seeds
    "GRPO": ["--method", "grpo"],
    "RTI": ["--method", "rti"],
    "RTI w/o verifier": ["--method", "rti", "--verifier", "none"],
    "RTI w/o PPL gate": ["--method", "rti", "--no-ppl-gate"],
    "RTI w/o reweight": ["--method", "rti", "--no-reweight"],
}
FULL = [
    "--steps",
    "48",
    "--eval-tasks",
    "150",
    "--eval-every",
    "8",
    "--save-every",
    "4",
]  # past GRPO's plateau
QUICK = ["--steps", "4", "--eval-tasks", "30", "--eval-every", "0", "--batch-tasks", "4"]
BOUNDARY_SAMPLES, BOUNDARY_TASKS, BOUNDARY_TASKS_QUICK = (
    16,
    150,
    30,
)  # the warm start's boundary: 16 samples a task


def slug(name: str) -> str:
    return name.lower().replace(" ", "-").replace("/", "")


def run_one(args: tuple) -> str:
    """One training run as a subprocess of `python rti.py` (one thread each, so `jobs` runs share the cores); a run
    with results is kept, one with a checkpoint resumes from it."""
    flags, out, log = args
    if (Path(out) / "results.json").exists():
        return out
    resume = ["--resume"] if (Path(out) / "ckpt.pt").exists() else []
    with open(log, "a" if resume else "w") as f:
        subprocess.run(
            [
                sys.executable,
                "rti.py",
                *flags,
                *resume,
                "--out",
                out,
                "--threads",
                "1",
                "--no-progress",
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
            check=True,
        )
    return out


def mean_std(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, (sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1)) ** 0.5


def compare(
    seeds: list[int],
    out_dir: str,
    quick: bool,
    jobs: int,
    extra: list[str],
    methods: list[str] = tuple(METHODS),
) -> dict:
    """Train each of `methods` (names of METHODS) for every seed from the same warm start, then write the table
    (markdown and CSV), the beyond-the-boundary counts and the figures under out_dir. Returns the per-run results."""
    run_cfg = rti.parse_args(extra)[
        2
    ]  # the runs' flags, checked (a bad one exits) before any run starts
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = [(name, seed) for seed in seeds for name in methods]
    work = [
        (
            [
                *METHODS[name],
                "--seed",
                str(seed),
                "--no-eval-before",
                *(QUICK if quick else FULL),
                *extra,
            ],
            str(out / f"{slug(name)}-s{seed}"),
            str(out / f"{slug(name)}-s{seed}.log"),
        )
        for name, seed in runs
    ]
    t0 = time.time()
    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(run_one, work))
    wall = time.time() - t0
    init, split = run_cfg.init, run_cfg.test_split
    warm = warm_boundary(
        out, init, split, BOUNDARY_TASKS_QUICK if quick else BOUNDARY_TASKS, seeds[0], jobs
    )
    results = {
        run: json.loads((Path(w[1]) / "results.json").read_text()) for run, w in zip(runs, work)
    }
    logs = read_logs(out, methods, seeds)
    subset = (
        ["--methods", *(f'"{m}"' if " " in m else m for m in methods)]
        if list(methods) != list(METHODS)
        else []
    )
    command = [
        "python -m extras.compare",
        *(["--quick"] if quick else []),
        "--seeds",
        *map(str, seeds),
        *subset,
        "--jobs",
        str(jobs),
        "--out",
        out_dir,
        *(["--", *extra] if extra else []),
    ]
    curves, minutes = (
        curve_table(logs, seeds, warm[0]["p@1"], methods),
        training_minutes(logs, seeds, methods),
    )
    if not has_grpo_and_rti(
        methods
    ):  # a subset such as the ablations on more seeds: their table and curves
        write_report(
            results, warm, seeds, out, wall, " ".join(command), curves + ["", minutes], split=split
        )
        return results
    policy, batch = warm_batch(
        init, seeds[0]
    )  # one warm-start batch for what the corrections write, and fig7
    write_report(
        results,
        warm,
        seeds,
        out,
        wall,
        " ".join(command),
        curves,
        mechanics_table(logs, seeds) + ["", minutes, "", corrections_written(batch, init)],
        split,
    )
    try:
        plot_curves(logs, out, seeds, warm[0]["p@1"], split)
        plot_heatmap(policy, batch, out / "fig7_weighted_ratio.png")
    except ImportError:
        print("matplotlib is not installed: no figures (pip install -r requirements-plots.txt)")
    return results


def read_logs(out: Path, methods, seeds: list[int]) -> dict[tuple[str, int], list[dict]]:
    """Every run's metrics.jsonl, read once for the report's tables and figures."""
    return {
        (name, s): read_jsonl(out / f"{slug(name)}-s{s}" / "metrics.jsonl")
        for name in methods
        for s in seeds
    }


def warm_boundary(
    out: Path, init: str, split: str, n_tasks: int, seed: int, threads: int
) -> tuple[dict, list[list[bool]]]:
    """The warm start on the first n_tasks tasks of `split` (the runs' --test-split), BOUNDARY_SAMPLES samples each:
    (summary, per-task successes), kept in warm_start_SPLIT.json so that a resumed comparison does not sample them
    again."""
    path, tasks = out / f"warm_start_{split}.json", envs.env_tasks("navigation", split)[:n_tasks]
    cached = json.loads(path.read_text()) if path.exists() else None
    if cached and len(cached[1]) == len(tasks):
        return tuple(cached)
    torch.set_num_threads(threads)
    model, tok = rti.load_model(init)
    warm = rti.evaluate_policy(
        rti.Sampler(model, tok, seed=seed), tasks, BOUNDARY_SAMPLES, seed=seed, per_task=True
    )
    path.write_text(json.dumps(warm))
    return warm


def has_grpo_and_rti(methods) -> bool:
    """Whether `methods` hold GRPO and RTI both: the report's gaps, mechanics and figures compare the two."""
    return {"GRPO", "RTI"} <= set(methods)


def methods_of(results: dict) -> list[str]:
    return list(dict.fromkeys(name for name, _ in results))  # in the order they were run


def boundary(
    results: dict, warm_tasks: list[list[bool]], seeds: list[int]
) -> tuple[int, dict[str, float]]:
    """The test tasks the warm-started policy never solves in its 16 samples, and the share of them each trained
    policy solves at least once in its evaluation samples (averaged over seeds)."""
    never = [i for i, s in enumerate(warm_tasks) if not any(s)]
    out = {}
    for name in methods_of(results):
        shares = [
            100.0 * sum(any(results[(name, s)]["after_tasks"][i]) for i in never) / len(never)
            for s in seeds
            if never
        ]
        out[name] = sum(shares) / len(shares) if shares else float("nan")
    return len(never), out


def curve_table(
    logs: dict, seeds: list[int], start_p1: float, methods: list[str] = tuple(METHODS)
) -> list[str]:
    """Test p@1 at every evaluation, mean over seeds (and each seed's RTI - GRPO gap), as markdown lines; `logs`:
    read_logs'."""
    p1 = {
        (name, s): {0: start_p1, **per_step(logs[(name, s)], "test/p@1")}
        for name in methods
        for s in seeds
    }
    steps = sorted(set.intersection(*(set(v) for v in p1.values())))
    lines = [
        "| p@1 at step | " + " | ".join(map(str, steps)) + " |",
        "| --- |" + " --- |" * len(steps),
    ]
    lines += [
        f"| {name} | "
        + " | ".join(f"{sum(p1[(name, s)][t] for s in seeds) / len(seeds):.2f}" for t in steps)
        + " |"
        for name in methods
    ]
    gap_seeds = seeds if has_grpo_and_rti(methods) else []
    lines += [
        f"| RTI - GRPO, seed {s} | "
        + " | ".join(f"{p1[('RTI', s)][t] - p1[('GRPO', s)][t]:+.2f}" for t in steps)
        + " |"
        for s in gap_seeds
    ]
    return lines


MECHANICS = [  # (row label, method, metrics key, scale): what the update saw, step by step
    ("train success, sampled (%)", "GRPO", "train_success", 100),
    ("train success, sampled (%)", "RTI", "train_success", 100),
    ("train success after intervention (%)", "RTI", "train_success_after_rti", 100),
    ("groups triggered (%)", "RTI", "rti/trigger_rate", 100),
    ("trained rows a step", "GRPO", "trained_rows", 1),
    ("trained rows a step", "RTI", "trained_rows", 1),
    ("intervened share of trained tokens (%)", "RTI", "intervened_frac", 100),
    ("intervened ratio, mean of step means", "RTI", "intervened/ratio_mean", 1),
    ("intervened ratio, mean of step maxima", "RTI", "intervened/ratio_max", 1),
    ("intervened tokens clipped (%)", "RTI", "intervened/clip_frac", 100),
    ("policy tokens clipped (%)", "GRPO", "policy/clip_frac", 100),
    ("policy tokens clipped (%)", "RTI", "policy/clip_frac", 100),
    ("token weight, mean of step maxima", "RTI", "weight_max", 1),
]


def mechanics_table(logs: dict, seeds: list[int], block: int = 8) -> list[str]:
    """MECHANICS' metrics averaged over each block of `block` steps and over seeds (a step without the metric sits
    out, and so does a step with no intervened token from the intervened tokens' ratios and the token weights),
    plus GRPO's sampled train success per seed, as markdown lines; `logs`: read_logs'."""
    last = max(r["step"] for rows in logs.values() for r in rows)
    blocks = [(a, min(a + block - 1, last)) for a in range(1, last + 1, block)]

    def cell(runs: list[dict[int, float]], scale: float, lo: int, hi: int) -> str:
        vals = [v for r in runs for t, v in r.items() if lo <= t <= hi]
        return f"{scale * sum(vals) / len(vals):.2f}" if vals else "-"

    def values(
        rows: list[dict], key: str
    ) -> dict[int, float]:  # the loss gives ratio 1 and weight 1 to a step
        intervened_only = key.startswith(
            ("intervened/", "weight_")
        )  # with no intervened token: it sits out here
        frac = per_step(rows, "intervened_frac")
        return {
            t: v
            for t, v in per_step(rows, key).items()
            if not intervened_only or frac.get(t, 0) > 0
        }

    specs = [
        (f"{name} {label}", [values(logs[(name, s)], key) for s in seeds], scale)
        for label, name, key, scale in MECHANICS
    ]
    specs += [
        (
            f"GRPO train success, sampled (%), seed {s}",
            [per_step(logs[("GRPO", s)], "train_success")],
            100,
        )
        for s in seeds
    ]
    lines = [
        "| steps | " + " | ".join(f"{a}-{b}" for a, b in blocks) + " |",
        "| --- |" + " --- |" * len(blocks),
    ]
    return lines + [
        f"| {label} | " + " | ".join(cell(runs, scale, a, b) for a, b in blocks) + " |"
        for label, runs, scale in specs
    ]


def training_minutes(logs: dict, seeds: list[int], methods) -> str:
    """Each method's training time a run (the sum of its step times, evaluations left out), mean over seeds."""
    mins = {
        name: sum(sum(r.get("time/step", 0) for r in logs[(name, s)]) for s in seeds)
        / len(seeds)
        / 60
        for name in methods
    }
    return (
        "Training time a run (sum of step times, mean over seeds; evaluations not counted): "
        + ", ".join(f"{name} {m:.1f} min" for name, m in mins.items())
    )


def write_report(
    results: dict,
    warm: tuple,
    seeds: list[int],
    out,
    wall: float,
    command: str,
    curves: list[str] = (),
    mechanics: list[str] = (),
    split: str = "test",
) -> None:
    """compare.md (with `curves`, curve_table's lines, if given), compare.csv; `split`: the runs' --test-split."""
    keys = [k for k, _ in COLUMNS]
    rows, spread, csv = {}, {}, ["method,seed," + ",".join(keys)]
    warm_summary, warm_tasks = warm
    rows[f"warm start ({BOUNDARY_SAMPLES} samples)"] = warm_summary
    for name in methods_of(results):
        per_seed = [results[(name, s)]["after"] for s in seeds]
        rows[name] = {k: mean_std([r[k] for r in per_seed])[0] for k in keys}
        spread[name] = mean_std([r["p@1"] for r in per_seed])[1]
        csv += [
            f"{name},{s}," + ",".join(f"{r[k]:.2f}" for k in keys) for s, r in zip(seeds, per_seed)
        ]
    n_never, never = boundary(results, warm_tasks, seeds)
    gap = (
        [results[("RTI", s)]["after"]["p@1"] - results[("GRPO", s)]["after"]["p@1"] for s in seeds]
        if has_grpo_and_rti(methods_of(results))
        else []
    )
    lines = [
        f"Command: `{command}` ({len(seeds)} seeds; this invocation {wall / 60:.1f} min, a resumed one counts "
        f"only its own part)",
        "",
        format_table(rows),
        "",
        f"Beyond the boundary: {n_never} of {len(warm_tasks)} {split} tasks are never solved by the warm start in "
        f"{BOUNDARY_SAMPLES} samples; the last column is the share of them a trained policy solves in its "
        f"evaluation samples (mean over seeds).",
        "",
        "| method | p@1 std over seeds | solves never-solved tasks (%) |",
        "| --- | --- | --- |",
    ]
    lines += [
        f"| {n} | {spread[n]:.2f} | {never[n]:.1f} |"
        if len(seeds) > 1
        else f"| {n} | - | {never[n]:.1f} |"
        for n in methods_of(results)
    ]
    lines += (
        [
            "",
            f"RTI minus GRPO p@1 per seed: {', '.join(f'{g:+.2f}' for g in gap)} "
            f"(mean {sum(gap) / len(gap):+.2f})",
        ]
        if gap
        else []
    )
    if curves:
        lines += [
            "",
            f"p@1 on {split} over training, mean over seeds (step 0: the warm start, 16 samples a task; "
            "then the runs' 4):",
            "",
            *curves,
        ]
    if mechanics:
        lines += [
            "",
            "What the update saw, mean over seeds and over each block of steps:",
            "",
            *mechanics,
        ]
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    (out / "compare.csv").write_text("\n".join(csv) + "\n")
    print("\n".join(lines))


# ----------------------------------------------------------------------------- figures (matplotlib, optional)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def per_step(rows: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in rows if key in r and r[key] == r[key]}  # skip NaN


def band(ax, runs: list[dict[int, float]], label: str, style: str = "-", smooth: int = 1) -> None:
    """Mean over runs (seeds) of a `smooth`-step moving average at each step, and their min-max spread; a run with
    no value in a window (the gate dropped nothing then) sits that step out."""
    steps = sorted(set().union(*runs))
    if not steps:
        return
    cols = []
    for i in range(len(steps)):
        window = steps[max(0, i - smooth + 1) : i + 1]
        vals = [[r[t] for t in window if t in r] for r in runs]
        cols.append([sum(v) / len(v) for v in vals if v])
    (line,) = ax.plot(steps, [sum(c) / len(c) for c in cols], style, label=label)
    ax.fill_between(
        steps, [min(c) for c in cols], [max(c) for c in cols], color=line.get_color(), alpha=0.15
    )


def plot_curves(
    logs: dict, out, seeds: list[int], start_p1: float | None = None, split: str = "test"
) -> None:
    """fig6 (the paper's Figure 6): train success and test p@1 against step, GRPO vs RTI, mean over seeds with their
    spread, p@1 on `split` from the warm start's `start_p1` at step 0, and the share of RTI's groups that triggered an
    intervention; fig5 (Figure 5): perplexity of the corrections the gate kept vs dropped over training; `logs`:
    read_logs'."""
    plt = pyplot()
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 3.6))
    for name in ("GRPO", "RTI"):
        runs = [logs[(name, s)] for s in seeds]
        band(
            a,
            [{k: 100 * v for k, v in per_step(r, "train_success").items()} for r in runs],
            f"{name} (sampled)",
            smooth=4,
        )
        if name == "RTI":
            band(
                a,
                [
                    {k: 100 * v for k, v in per_step(r, "train_success_after_rti").items()}
                    for r in runs
                ],
                "RTI (after intervention)",
                "--",
                smooth=4,
            )
            band(
                c,
                [{k: 100 * v for k, v in per_step(r, "rti/trigger_rate").items()} for r in runs],
                "RTI",
                smooth=4,
            )
        start = {0: start_p1} if start_p1 is not None else {}
        band(b, [{**start, **per_step(r, "test/p@1")} for r in runs], name, "o-")
    a.set(xlabel="step", ylabel="train success (%)", title="training rollouts (4-step mean)")
    b.set(
        xlabel="step",
        ylabel=f"{split} p@1",
        title=f"{split} split (mean, spread over {len(seeds)} seeds)",
    )
    c.set(
        xlabel="step",
        ylabel="groups triggered (%)",
        title="groups with no success: intervened (4-step mean)",
    )
    a.legend(), b.legend()
    fig.tight_layout()
    fig.savefig(out / "fig6_training_curves.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for key, label in (
        ("rti/ppl_kept_mean", "kept by the gate"),
        ("rti/ppl_dropped_mean", "dropped by the gate"),
    ):
        band(ax, [per_step(logs[("RTI", s)], key) for s in seeds], label, "o-", smooth=4)
    ax.set(
        xlabel="step",
        ylabel="PPL (agent tokens)",
        title="corrections: gate decisions (RTI, 4-step mean)",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fig5_correction_ppl.png", dpi=120)
    plt.close(fig)


def rewritten_actions(trajs: list) -> Counter:
    """The actions the corrector wrote (the turns whose tokens are INTERVENED) in the intervened trajectories of a
    batch, by action word: `route` (the tool call), `move` (back onto the held route), `finish`."""
    return Counter(
        a.split()[0] if a.split() else "(empty)"
        for t in trajs
        if t.intervention
        for (start, _), a in zip(t.turns, t.actions)
        if t.source[start] == loss.INTERVENED
    )


def warm_batch(model_dir, seed: int = 0, n_tasks: int = 32) -> tuple:
    """(policy, batch): one rollout of the first n_tasks train tasks x 8 from `model_dir`, intervened with the default
    RTIConfig. From the warm start (a run's first step): a trained model seldom fails a whole group."""
    model, tok = rti.load_model(str(model_dir))
    policy = rti.Sampler(model, tok, seed=seed)
    batch, _ = intervene.intervene_batch(
        policy,
        rti.rollout(policy, envs.make_tasks("train")[:n_tasks], 8, seed),
        intervene.RTIConfig(),
        policy.make_env,
    )
    return policy, batch


def corrections_written(batch: list, source: str) -> str:
    """What the corrections teach: rewritten_actions of the corrections RTI kept in warm_batch's `batch` (sampled
    from `source`), as a report line."""
    words = rewritten_actions(batch)
    n = sum(words.values())
    return (
        f"What the corrections write (`compare.corrections_written`): on {len({t.group for t in batch})} train "
        f"tasks x 8 from {source}, RTI keeps {sum(1 for t in batch if t.intervention)} corrected trajectories "
        f"with {n} rewritten turns: "
        + ", ".join(f"{w} {c} ({100 * c / max(1, n):.1f}%)" for w, c in words.most_common())
    )


def plot_heatmap(policy, trajs: list, png) -> None:
    """fig7 (the paper's Figure 7): the calibrated weighted ratio rho_t * w_t on the agent tokens of one intervened
    trajectory of `trajs` (warm_batch's) as a second mini-batch would see it (`--mini-batches 2`): pi_old scored,
    then one AdamW step of `policy` on the rest of its batch, then rho_t = pi / pi_old. Beside it, the naive ratio
    pi_old / mu on the intervened tokens."""
    plt = pyplot()
    from matplotlib.colors import TwoSlopeNorm

    model, tok, cfg = (
        policy.model,
        policy.tok,
        rti.make_config(mini_batches=1),
    )  # the first of two steps
    j = next(
        (j for j, t in enumerate(trajs) if t.intervention and loss.INTERVENED in t.source), None
    )
    if j is None:
        print("fig7 not drawn: the batch has no intervened trajectory")
        return
    traj, old = trajs[j], torch.tensor(policy.score([trajs[j].ids]))
    adv = loss.advantages_by_group(
        torch.tensor([t.reward for t in trajs]), [t.group for t in trajs]
    )
    rest = [k for k in range(len(trajs)) if k != j and adv[k] != 0]
    rti.update(
        policy,
        torch.optim.AdamW(model.parameters(), lr=cfg.lr),
        [trajs[k] for k in rest],
        adv[rest],
        cfg,
    )
    rho = torch.exp(torch.tensor(policy.score([traj.ids])) - old)[0]
    beh, src, mask = (torch.tensor([x]) for x in (traj.sample_logp, traj.source, traj.loss_mask))
    w = loss.token_weights(beh, old, (src == loss.INTERVENED) & (mask > 0))[0]
    naive = torch.exp(old - beh)[0]
    idx = [i for i, m in enumerate(traj.loss_mask) if m][:96]
    words = tok.convert_ids_to_tokens([traj.ids[i] for i in idx])
    cols = 12
    rows_ = (len(idx) + cols - 1) // cols
    fig, axes = plt.subplots(2, 1, figsize=(cols * 0.9, rows_ * 0.9 + 1.5))
    for ax, vals, title in (
        (axes[0], rho * w, "weighted ratio rho*w at a second mini-batch step (rho = pi / pi_old)"),
        (
            axes[1],
            torch.where(src[0] == loss.INTERVENED, naive, torch.ones_like(naive)),
            "naive ratio pi_old / mu (intervened tokens)",
        ),
    ):
        grid = torch.full((rows_, cols), float("nan"))
        for k, i in enumerate(idx):
            grid[k // cols, k % cols] = vals[i]
        norm = TwoSlopeNorm(
            vmin=0.0, vcenter=1.0, vmax=max(2.0, float(vals[idx].max()))
        )  # white at ratio 1
        im = ax.imshow(grid.numpy(), cmap="coolwarm", norm=norm)
        for k, i in enumerate(idx):
            mark = "*" if traj.source[i] == loss.INTERVENED else ""
            ax.text(
                k % cols,
                k // cols,
                mark + words[k].replace("<|im_end|>", "eos"),
                ha="center",
                va="center",
                fontsize=6,
            )
        ax.set_title(title, fontsize=9)
        ax.set_xticks([]), ax.set_yticks([])
        fig.colorbar(im, ax=ax, fraction=0.02)
    fig.suptitle(
        f"agent tokens of one corrected trajectory (* = intervened); policy-token rho in "
        f"[{float(rho[idx].min()):.3f}, {float(rho[idx].max()):.3f}]",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m extras.compare",
        description="GRPO vs RTI vs its three ablations from the same warm start (Table 3)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="4 steps of 4 tasks, 30 test tasks: a smoke run, 1.5 minutes",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--methods",
        nargs="+",
        default=list(METHODS),
        choices=list(METHODS),
        metavar="NAME",
        help=f"a subset of {list(METHODS)} (quote names with spaces); without GRPO and RTI both, "
        "the report is the table and the curves",
    )
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel, one thread each")
    p.add_argument("--out", default="results")
    p.add_argument(
        "extra",
        nargs=argparse.REMAINDER,
        help="flags passed on to every `python rti.py` run (after --)",
    )
    args = p.parse_args(argv)
    compare(
        args.seeds,
        args.out,
        args.quick,
        args.jobs,
        [a for a in args.extra if a != "--"],
        args.methods,
    )


if __name__ == "__main__":
    main()
