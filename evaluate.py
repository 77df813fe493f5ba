"""Evaluation metrics as in the paper: pass@k, pass^k, and their averages over k = 1..4.

With n samples per task of which c succeed:

    >>> round(pass_at_k(4, 1, 2), 4), round(pass_hat_k(4, 3, 2), 4)
    (0.5, 0.5)
    >>> s = summarize([[True, True, False, False], [False] * 4])
    >>> s["pass@1"], s["pass@4"], round(s["pass^2"], 2)
    (25.0, 50.0, 8.33)
"""
from __future__ import annotations

from math import comb

K_MAX = 4  # the paper reports k = 1..4 with n = 4 samples per task
COLUMNS = (("p@1", "p@1"), ("avg_p@k", "avg p@k"), ("avg_p^k", "avg p^k")) + tuple(
    (f"pass@{k}", f"pass@{k}") for k in range(1, K_MAX + 1)) + tuple(
    (f"pass^{k}", f"pass^{k}") for k in range(1, K_MAX + 1))  # Table 1 columns, then Table 3's


def _check(n: int, c: int, k: int) -> None:
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chance that at least one of k samples drawn without replacement from the n succeeds:
    pass@k = 1 - C(n - c, k) / C(n, k)."""
    _check(n, c, k)
    return 1.0 - comb(n - c, k) / comb(n, k)


def pass_hat_k(n: int, c: int, k: int) -> float:
    """Chance that all k samples drawn without replacement from the n succeed ("pass^k"):
    pass^k = C(c, k) / C(n, k)."""
    _check(n, c, k)
    return comb(c, k) / comb(n, k)


def mean_over_k(values: list[float]) -> float:
    """avg p@k = mean of pass@1..pass@k_max (likewise avg p^k from pass^1..pass^k_max).

    >>> round(mean_over_k([35.33, 40.00, 41.33, 43.33]), 2)   # GRPO Navigation, Table 1
    40.0
    """
    if not values:
        raise ValueError("need at least one value")
    return sum(values) / len(values)


def summarize(successes: list[list[bool]], k_max: int = K_MAX) -> dict[str, float]:
    """Metrics in percent, averaged over tasks. successes[task] = the n sample outcomes (n >= k_max,
    the same n for every task). Keys: pass@1..pass@k_max, pass^1..pass^k_max, p@1 (= pass@1),
    avg_p@k, avg_p^k."""
    if not successes:
        raise ValueError("no tasks to summarize")
    n = len(successes[0])
    if any(len(s) != n for s in successes):
        raise ValueError(f"every task needs the same number of samples; got {sorted({len(s) for s in successes})}")
    if not 1 <= k_max <= n:
        raise ValueError(f"need 1 <= k_max <= n samples per task; got k_max={k_max} n={n}")
    counts = [sum(bool(x) for x in s) for s in successes]
    out = {}
    for name, fn in (("pass@", pass_at_k), ("pass^", pass_hat_k)):
        for k in range(1, k_max + 1):
            out[f"{name}{k}"] = 100.0 * sum(fn(n, c, k) for c in counts) / len(counts)
    out["p@1"] = out["pass@1"]
    out["avg_p@k"] = mean_over_k([out[f"pass@{k}"] for k in range(1, k_max + 1)])
    out["avg_p^k"] = mean_over_k([out[f"pass^{k}"] for k in range(1, k_max + 1)])
    return out


def format_table(rows: dict[str, dict[str, float]]) -> str:
    """Markdown table, one row per method, in the paper's column order (p@1, avg p@k, avg p^k,
    then pass@1..4, pass^1..4); only columns some row has; 2 decimals, '-' where missing.

    >>> print(format_table({"GRPO": {"p@1": 35.333, "avg_p@k": 40.0}}))
    | method | p@1 | avg p@k |
    | --- | --- | --- |
    | GRPO | 35.33 | 40.00 |
    """
    cols = [(key, head) for key, head in COLUMNS if any(key in r for r in rows.values())]
    lines = ["| method | " + " | ".join(h for _, h in cols) + " |",
             "| --- | " + " | ".join("---" for _ in cols) + " |"]
    for method, r in rows.items():
        cells = [f"{r[key]:.2f}" if key in r else "-" for key, _ in cols]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- evaluating checkpoints

def evaluate_checkpoint(model_dir: str, split: str = "test", samples: int = 4, tasks: int | None = None,
                        seed: int = 0, temperature: float = 1.0, threads: int = 2, per_task: bool = False,
                        env: str = "navigation", max_turn_tokens: int = 4, thinking: bool = False,
                        user_model: str = "", device: str = "cpu"):
    """pass@k / pass^k of a saved model (a directory written by rti.py, or any local chat model) on a split of an env,
    n = `samples` per task (per_task=True: also each task's successes). For tau2 with a real model give the turn room
    to write a tool call (max_turn_tokens of a few hundred); `user_model` plays tau2 airline / retail users
    (rti.make_user: "" = the evaluated model, "scripted", or a directory)."""
    import torch
    import envs
    import rti
    torch.set_num_threads(threads)
    model, tok = rti.load_model(model_dir)
    policy = rti.Policy(model.to(device), tok, temperature=temperature, max_turn_tokens=max_turn_tokens, seed=seed,
                        thinking=thinking, env=env)
    policy.user = rti.make_user(rti.Config(env=env, user_model=user_model, device=device), policy)
    return rti.evaluate_policy(policy, envs.env_tasks(env, split)[:tasks], samples, seed=seed, per_task=per_task)


# ----------------------------------------------------------------------------- the method comparison (Table 3)

METHODS = {   # the paper's Table 3 rows, all from the same warm start, budget and seeds
    "GRPO": ["--method", "grpo"],
    "RTI": ["--method", "rti"],
    "RTI w/o verifier": ["--method", "rti", "--no-verify"],
    "RTI w/o PPL gate": ["--method", "rti", "--no-ppl-gate"],
    "RTI w/o reweight": ["--method", "rti", "--no-reweight"],
}
FULL = ["--eval-tasks", "150", "--eval-every", "4"]    # the default budget (12 steps), test curve every 4 steps
QUICK = ["--steps", "4", "--eval-tasks", "30", "--eval-every", "0", "--batch-tasks", "4"]
BOUNDARY_SAMPLES, BOUNDARY_TASKS, BOUNDARY_TASKS_QUICK = 16, 150, 30   # the warm start's boundary: 16 samples a task


def slug(name: str) -> str:
    return name.lower().replace(" ", "-").replace("/", "")


def run_one(args: tuple) -> str:
    """One training run as a subprocess of `python rti.py` (one thread each, so `jobs` runs share the cores)."""
    import subprocess
    import sys
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
    import json
    import time
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = [(name, seed) for seed in seeds for name in METHODS]
    work = [([*METHODS[name], "--seed", str(seed), "--no-eval-before", *(QUICK if quick else FULL), *extra],
             str(out / f"{slug(name)}-s{seed}"), str(out / f"{slug(name)}-s{seed}.log")) for name, seed in runs]
    t0 = time.time()
    warm = evaluate_checkpoint(warmstart_dir(extra), "test", BOUNDARY_SAMPLES,
                               BOUNDARY_TASKS_QUICK if quick else BOUNDARY_TASKS, seed=seeds[0], threads=jobs,
                               per_task=True)
    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(run_one, work))
    wall = time.time() - t0
    results = {(name, seed): json.loads((Path(w[1]) / "results.json").read_text()) for (name, seed), w in zip(runs, work)}
    write_report(results, warm, seeds, out, wall, " ".join(["python evaluate.py compare"] + (["--quick"] if quick else [])
                                                            + ["--seeds", *map(str, seeds), "--jobs", str(jobs), *extra]))
    try:
        plot_curves(out, seeds[0], warm[0]["p@1"])
        plot_heatmap(out / f"rti-s{seeds[0]}" / "model", out / "fig7_weighted_ratio.png", seed=seeds[0])
    except ImportError:
        print("matplotlib is not installed: no figures (pip install matplotlib)")
    return results


def warmstart_dir(extra: list[str]) -> str:
    import rti
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
    import json
    return [json.loads(line) for line in open(path)]


def plot_curves(out, seed: int, start_p1: float | None = None) -> None:
    """fig6: train success and test p@1 against step, GRPO vs RTI (the paper's Figure 6), test p@1 starting from the
    warm start's `start_p1` at step 0; fig5: perplexity of corrections kept vs dropped by the gate over training
    (Figure 5)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch
    import envs
    import intervene
    import loss
    import rti
    model, tok = rti.load_model(str(model_dir))
    policy = rti.Policy(model, tok, seed=seed)
    traj = None
    for i in range(0, 600, 8):
        trajs, _ = intervene.intervene(policy, rti.rollout(policy, envs.make_tasks("train")[i:i + 8], 8),
                                       intervene.RTIConfig(ppl_gate=False))
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


# ----------------------------------------------------------------------------- benchmarks (figures, never asserts)

def bench(model_dir: str, tasks: int = 8, group: int = 8, repeats: int = 3, threads: int = 1, seed: int = 0) -> None:
    """Side-by-side timings on one machine, alternating so that drift hits both sides:
    rollout throughput batched (B x G episodes in lockstep) vs one episode at a time on the same tasks, and one
    training step of GRPO vs RTI from the same sampled batch and the same weights."""
    import copy
    import time
    import torch
    import envs
    import intervene
    import loss as rl_loss
    import rti
    torch.set_num_threads(threads)
    model, tok = rti.load_model(model_dir)
    batch_tasks = envs.make_tasks("train")[:tasks]
    cfg = rti.Config(batch_tasks=tasks, group_size=group, micro_batch=tasks * group)
    rates = {"batched": [], "one at a time": []}
    for r in range(repeats):
        for mode in rates:
            policy = rti.Policy(model, tok, seed=seed + r)
            t0 = time.perf_counter()
            if mode == "batched":
                trajs = rti.rollout(policy, batch_tasks, group)
            else:
                trajs = [t for task in batch_tasks for _ in range(group) for t in rti.rollout(policy, [task], 1)]
            dt = time.perf_counter() - t0
            rates[mode].append((len(trajs) / dt, sum(len(t.ids) for t in trajs) / dt, dt))
    print(f"rollout, {tasks} tasks x {group} episodes, train split, {threads} thread(s), {repeats} alternating repeats")
    for mode, xs in rates.items():
        med = sorted(xs, key=lambda x: x[2])[len(xs) // 2]
        print(f"  {mode:14s} {med[0]:7.1f} episodes/s {med[1]:9.0f} tokens/s   ({med[2]:.2f} s per batch)")
    ratio = sorted(b[0] / s[0] for b, s in zip(rates["batched"], rates["one at a time"]))[len(rates["batched"]) // 2]
    print(f"  batched / one at a time: {ratio:.1f}x episodes per second")

    times = {"grpo": [], "rti": []}
    for r in range(repeats):
        policy = rti.Policy(model, tok, seed=seed + r)
        trajs = rti.rollout(policy, batch_tasks, group)
        for method in times:
            p = rti.Policy(copy.deepcopy(model), tok, seed=seed + r)
            opt = torch.optim.AdamW(p.model.parameters(), lr=cfg.lr)
            t0 = time.perf_counter()
            batch = [copy.copy(t) for t in trajs]
            if method == "rti":
                batch, _ = intervene.intervene(p, batch, intervene.RTIConfig.from_config(cfg))
            adv = rl_loss.group_advantages(torch.tensor([t.reward for t in batch]), group)
            keep = [i for i in range(len(batch)) if adv[i] != 0]
            if keep:
                rti.update(p, opt, [batch[i] for i in keep], adv[keep], cfg)
            times[method].append(time.perf_counter() - t0)
    med = {m: sorted(v)[len(v) // 2] for m, v in times.items()}
    print(f"after-sampling step time on the same batch: GRPO {med['grpo']:.2f} s, RTI {med['rti']:.2f} s "
          f"(RTI / GRPO {med['rti'] / med['grpo']:.2f}x; sampling itself, common to both, excluded)")


def main(argv=None) -> None:
    import argparse
    p = argparse.ArgumentParser(description="Evaluate a checkpoint (pass@k, pass^k) or run the method comparison.")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("eval", help="evaluate a saved model directory on a split")
    e.add_argument("model", help="a model directory saved by rti.py (e.g. runs/demo/model or checkpoints/warmstart)")
    e.add_argument("--env", default="navigation", help="navigation | tau2-telecom | tau2-airline | tau2-retail")
    e.add_argument("--split", default="test", help="a split of the env (tau2: test, train, base, ...)")
    e.add_argument("--max-turn-tokens", type=int, default=4, help="new tokens per agent turn (tau2: e.g. 512)")
    e.add_argument("--thinking", action="store_true", help="Qwen3 thinking mode")
    e.add_argument("--user-model", default="", help="tau2 airline/retail user: '' = the model, 'scripted', a dir")
    e.add_argument("--device", default="cpu")
    e.add_argument("--samples", type=int, default=4)
    e.add_argument("--tasks", type=int, default=None, help="first N tasks of the split (default: all)")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--threads", type=int, default=2)
    c = sub.add_parser("compare", help="GRPO vs RTI vs its three ablations from the same warm start (Table 3)")
    c.add_argument("--quick", action="store_true", help="4 steps of 4 tasks, 30 test tasks: a smoke run, about 1.5 minutes")
    c.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    c.add_argument("--jobs", type=int, default=2, help="runs in parallel, one thread each")
    c.add_argument("--out", default="results")
    c.add_argument("extra", nargs=argparse.REMAINDER, help="flags passed on to every `python rti.py` run")
    b = sub.add_parser("bench", help="rollout throughput batched vs one at a time; GRPO vs RTI step time")
    b.add_argument("model", nargs="?", default="checkpoints/warmstart")
    b.add_argument("--tasks", type=int, default=8)
    b.add_argument("--group", type=int, default=8)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if args.command == "bench":
        bench(args.model, args.tasks, args.group, args.repeats, args.threads)
    elif args.command == "eval":
        import envs
        try:
            splits = envs.env_splits(args.env)
        except (ValueError, ImportError) as e:
            p.error(f"--env: {e}")
        if args.split not in splits:
            p.error(f"--split: unknown split {args.split!r} of {args.env}; known: {sorted(splits)}")
        if args.samples < K_MAX:
            p.error(f"--samples: need at least {K_MAX} samples per task for pass@1..{K_MAX}, got {args.samples}")
        res = evaluate_checkpoint(args.model, args.split, args.samples, args.tasks, args.seed, threads=args.threads,
                                  env=args.env, max_turn_tokens=args.max_turn_tokens, thinking=args.thinking,
                                  user_model=args.user_model, device=args.device)
        print(format_table({args.model: res}))
    elif args.command == "compare":
        compare(args.seeds, args.out, args.quick, args.jobs, [a for a in args.extra if a != "--"])


if __name__ == "__main__":
    main()
