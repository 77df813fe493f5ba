"""The method comparison of the paper's Table 3 and its figures; optional (extras/).

    python -m extras.compare --seeds 0 1 2 --out results   # GRPO, RTI and its 3 ablations x 3 seeds, 2 runs at a time
    python -m extras.compare --quick --seeds 0             # a smoke run: 4 steps of 4 tasks, 30 test tasks

Every run is `python rti.py` with the method's flags (and any flags given after `--`), from the same warm start, with
the same budget and seeds. Writes compare.md, compare.csv and (with matplotlib) fig5_correction_ppl.png,
fig6_training_curves.png and fig7_weighted_ratio.png under --out.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
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


METHODS = {   # the paper's Table 3 rows, all from the same warm start, budget and seeds
    "GRPO": ["--method", "grpo"],
    "RTI": ["--method", "rti"],
    "RTI w/o verifier": ["--method", "rti", "--verifier", "none"],
    "RTI w/o PPL gate": ["--method", "rti", "--no-ppl-gate"],
    "RTI w/o reweight": ["--method", "rti", "--no-reweight"],
}
FULL = ["--eval-tasks", "150", "--eval-every", "4"]    # the default budget (8 steps), test curve every 4 steps
QUICK = ["--steps", "4", "--eval-tasks", "30", "--eval-every", "0", "--batch-tasks", "4"]
BOUNDARY_SAMPLES, BOUNDARY_TASKS, BOUNDARY_TASKS_QUICK = 16, 150, 30   # the warm start's boundary: 16 samples a task


def slug(name: str) -> str:
    return name.lower().replace(" ", "-").replace("/", "")


def run_one(args: tuple) -> str:
    """One training run as a subprocess of `python rti.py` (one thread each, so `jobs` runs share the cores)."""
    flags, out, log = args
    with open(log, "w") as f:
        subprocess.run([sys.executable, "rti.py", *flags, "--out", out, "--threads", "1", "--no-progress"],
                       stdout=f, stderr=subprocess.STDOUT, check=True)
    return out


def mean_std(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, (sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1)) ** 0.5


def compare(seeds: list[int], out_dir: str, quick: bool, jobs: int, extra: list[str]) -> dict:
    """Train every method of METHODS for every seed from the same warm start, then write the table (markdown and
    CSV), the beyond-the-boundary counts and the figures under out_dir. Returns the per-run results."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = [(name, seed) for seed in seeds for name in METHODS]
    work = [([*METHODS[name], "--seed", str(seed), "--no-eval-before", *(QUICK if quick else FULL), *extra],
             str(out / f"{slug(name)}-s{seed}"), str(out / f"{slug(name)}-s{seed}.log")) for name, seed in runs]
    t0 = time.time()
    torch.set_num_threads(jobs)
    model, tok = rti.load_model(warmstart_dir(extra))
    tasks = envs.make_tasks("test")[:BOUNDARY_TASKS_QUICK if quick else BOUNDARY_TASKS]
    warm = rti.evaluate_policy(rti.Sampler(model, tok, seed=seeds[0]), tasks, BOUNDARY_SAMPLES, seed=seeds[0],
                               per_task=True)
    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(run_one, work))
    wall = time.time() - t0
    results = {run: json.loads((Path(w[1]) / "results.json").read_text()) for run, w in zip(runs, work)}
    command = ["python -m extras.compare"] + (["--quick"] if quick else []) + ["--seeds", *map(str, seeds), "--jobs",
                                                                               str(jobs), *extra]
    write_report(results, warm, seeds, out, wall, " ".join(command))
    try:
        plot_curves(out, seeds[0], warm[0]["p@1"])
        plot_heatmap(out / f"rti-s{seeds[0]}" / "model", out / "fig7_weighted_ratio.png", seed=seeds[0])
    except ImportError:
        print("matplotlib is not installed: no figures (pip install matplotlib)")
    return results


def warmstart_dir(extra: list[str]) -> str:
    return extra[extra.index("--init") + 1] if "--init" in extra else rti.WARMSTART_DIR


def boundary(results: dict, warm_tasks: list[list[bool]], seeds: list[int]) -> tuple[int, dict[str, float]]:
    """The test tasks the warm-started policy never solves in its 16 samples, and the share of them each trained
    policy solves at least once in its evaluation samples (averaged over seeds)."""
    never = [i for i, s in enumerate(warm_tasks) if not any(s)]
    out = {}
    for name in METHODS:
        shares = [100.0 * sum(any(results[(name, s)]["after_tasks"][i]) for i in never) / len(never)
                  for s in seeds if never]
        out[name] = sum(shares) / len(shares) if shares else float("nan")
    return len(never), out


def write_report(results: dict, warm: tuple, seeds: list[int], out, wall: float, command: str) -> None:
    """compare.md, compare.csv and (with matplotlib) the figures."""
    keys = [k for k, _ in COLUMNS]
    rows, spread, csv = {}, {}, ["method,seed," + ",".join(keys)]
    warm_summary, warm_tasks = warm
    rows[f"warm start ({BOUNDARY_SAMPLES} samples)"] = warm_summary
    for name in METHODS:
        per_seed = [results[(name, s)]["after"] for s in seeds]
        rows[name] = {k: mean_std([r[k] for r in per_seed])[0] for k in keys}
        spread[name] = mean_std([r["p@1"] for r in per_seed])[1]
        csv += [f"{name},{s}," + ",".join(f"{r[k]:.2f}" for k in keys) for s, r in zip(seeds, per_seed)]
    n_never, never = boundary(results, warm_tasks, seeds)
    gap = [results[("RTI", s)]["after"]["p@1"] - results[("GRPO", s)]["after"]["p@1"] for s in seeds]
    lines = [f"Command: `{command}` ({len(seeds)} seeds, wall time {wall / 60:.1f} min)", "",
             format_table(rows), "",
             f"Beyond the boundary: {n_never} of {len(warm_tasks)} test tasks are never solved by the warm start in "
             f"{BOUNDARY_SAMPLES} samples; the last column is the share of them a trained policy solves in its "
             f"evaluation samples (mean over seeds).", "",
             "| method | p@1 std over seeds | solves never-solved tasks (%) |", "| --- | --- | --- |"]
    lines += [f"| {n} | {spread[n]:.2f} | {never[n]:.1f} |" for n in METHODS]
    lines += ["", f"RTI minus GRPO p@1 per seed: {', '.join(f'{g:+.2f}' for g in gap)} "
                  f"(mean {sum(gap) / len(gap):+.2f})"]
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    (out / "compare.csv").write_text("\n".join(csv) + "\n")
    print("\n".join(lines))


# ----------------------------------------------------------------------------- figures (matplotlib, optional)

def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def plot_curves(out, seed: int, start_p1: float | None = None) -> None:
    """fig6: train success and test p@1 against step, GRPO vs RTI (the paper's Figure 6), test p@1 starting from the
    warm start's `start_p1` at step 0; fig5: perplexity of corrections kept vs dropped by the gate over training
    (Figure 5)."""
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    for name in ("GRPO", "RTI"):
        rows = read_jsonl(out / f"{slug(name)}-s{seed}" / "metrics.jsonl")
        train = [r for r in rows if "train_success" in r]
        a.plot([r["step"] for r in train], [100 * r["train_success"] for r in train], label=f"{name} (sampled)")
        if name == "RTI":
            a.plot([r["step"] for r in train], [100 * r["train_success_after_rti"] for r in train], "--",
                   label="RTI (after intervention)")
        test = ([(0, start_p1)] if start_p1 is not None else []) + [(r["step"], r["test/p@1"]) for r in rows
                                                                     if "test/p@1" in r]
        b.plot(*zip(*test), "o-", label=name)
    a.set(xlabel="step", ylabel="train success (%)", title="training rollouts")
    b.set(xlabel="step", ylabel="test p@1", title="test split")
    a.legend(), b.legend()
    fig.tight_layout()
    fig.savefig(out / "fig6_training_curves.png", dpi=120)
    plt.close(fig)
    rows = [r for r in read_jsonl(out / f"rti-s{seed}" / "metrics.jsonl") if "rti/groups" in r]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for key, label in (("rti/ppl_kept_mean", "kept by the gate"), ("rti/ppl_dropped_mean", "dropped by the gate")):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) == r.get(key)]   # skip NaN
        if pts:
            ax.plot(*zip(*pts), "o-", label=label)
    ax.set(xlabel="step", ylabel="PPL of intervened tokens", title="corrections: gate decisions (RTI)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fig5_correction_ppl.png", dpi=120)
    plt.close(fig)


def plot_heatmap(model_dir, png, seed: int = 0) -> None:
    """fig7: the calibrated weighted ratio rho_t * w_t on the agent tokens of one intervened trajectory, at its
    first update (rho_t = 1 there, so the figure shows the token weights w_t), beside the naive ratio pi / mu."""
    plt = pyplot()
    model, tok = rti.load_model(str(model_dir))
    policy = rti.Sampler(model, tok, seed=seed)
    traj = None
    for i in range(0, 600, 8):
        trajs, _ = intervene.intervene_batch(policy, rti.rollout(policy, envs.make_tasks("train")[i:i + 8], 8),
                                             intervene.RTIConfig(ppl_gate=False), policy.make_env)
        traj = next((t for t in trajs if t.intervention and loss.INTERVENED in t.source), None)
        if traj:
            break
    if traj is None:
        return
    old = torch.tensor([policy.score([traj.ids])[0]])
    beh, src, mask = (torch.tensor([x]) for x in (traj.sample_logp, traj.source, traj.loss_mask))
    w = loss.token_weights(beh, old, (src == loss.INTERVENED) & (mask > 0))[0]
    naive = torch.exp(old - beh)[0]
    idx = [i for i, m in enumerate(traj.loss_mask) if m][:96]
    words = tok.convert_ids_to_tokens([traj.ids[i] for i in idx])
    cols = 12
    rows_ = (len(idx) + cols - 1) // cols
    fig, axes = plt.subplots(2, 1, figsize=(cols * 0.9, rows_ * 0.9 + 1.5))
    for ax, vals, title in ((axes[0], w, "weighted ratio rho*w at the first update (= w)"),
                            (axes[1], torch.where(src[0] == loss.INTERVENED, naive, torch.ones_like(naive)),
                             "naive ratio pi_old / mu (intervened tokens)")):
        grid = torch.full((rows_, cols), float("nan"))
        for j, i in enumerate(idx):
            grid[j // cols, j % cols] = vals[i]
        im = ax.imshow(grid.numpy(), cmap="coolwarm", vmin=0, vmax=max(2.0, float(vals[idx].max())))
        for j, i in enumerate(idx):
            mark = "*" if traj.source[i] == loss.INTERVENED else ""
            ax.text(j % cols, j // cols, mark + words[j].replace("<|im_end|>", "eos"), ha="center", va="center",
                    fontsize=6)
        ax.set_title(title, fontsize=9)
        ax.set_xticks([]), ax.set_yticks([])
        fig.colorbar(im, ax=ax, fraction=0.02)
    fig.suptitle("agent tokens of one corrected trajectory (* = intervened)", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m extras.compare",
                                description="GRPO vs RTI vs its three ablations from the same warm start (Table 3)")
    p.add_argument("--quick", action="store_true", help="4 steps of 4 tasks, 30 test tasks: a smoke run, 1.5 minutes")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel, one thread each")
    p.add_argument("--out", default="results")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="flags passed on to every `python rti.py` run (after --)")
    args = p.parse_args(argv)
    compare(args.seeds, args.out, args.quick, args.jobs, [a for a in args.extra if a != "--"])


if __name__ == "__main__":
    main()
