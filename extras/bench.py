"""Side-by-side speed figures of the core (printed, never asserted); optional (extras/).

python -m extras.bench [MODEL_DIR] --repeats 2 --threads 2   # on an otherwise idle machine
python -m extras.bench --repeats 0                            # only the demo's time split
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import tempfile
import time

import torch

import envs
import intervene
import rti
import runtime
from loss import advantages_by_group
from policy import Sampler, load_model


def bench(
    model_dir: str,
    tasks: int = 8,
    group: int = 8,
    repeats: int = 3,
    threads: int = 1,
    seed: int = 0,
) -> None:
    """Side-by-side timings on one machine, alternating so that drift hits both sides: rollout
    throughput batched (B x G episodes in lockstep) vs one episode at a time on the same tasks, and
    one training step of GRPO vs RTI (both group modes) from the same sampled batch and the same
    weights, split into the intervention and the update (whose cost follows the tokens it trains:
    RTI makes all-fail groups learnable)."""
    torch.set_num_threads(threads)
    model, tok = load_model(model_dir)
    batch_tasks = envs.make_tasks("train")[:tasks]
    cfg = runtime.make_config(rti.Config, batch_tasks=tasks, group_size=group)
    rates = {"batched": [], "one at a time": []}
    for r in range(repeats):
        for mode in rates:
            policy = Sampler(model, tok, seed=seed + r)
            t0 = time.perf_counter()
            if mode == "batched":
                trajs = rti.rollout(policy, batch_tasks, group)
            else:
                trajs = [
                    t
                    for task in batch_tasks
                    for _ in range(group)
                    for t in rti.rollout(policy, [task], 1)
                ]
            dt = time.perf_counter() - t0
            rates[mode].append((len(trajs) / dt, sum(len(t.ids) for t in trajs) / dt, dt))
    print(
        f"rollout, {tasks} tasks x {group} episodes, train split, {threads} thread(s), "
        f"{repeats} alternating repeats"
    )
    for mode, xs in rates.items():
        med = sorted(xs, key=lambda x: x[2])[len(xs) // 2]
        print(
            f"  {mode:14s} {med[0]:7.1f} episodes/s {med[1]:9.0f} tokens/s   "
            f"({med[2]:.2f} s per batch)"
        )
    ratios = sorted(b[0] / s[0] for b, s in zip(rates["batched"], rates["one at a time"]))
    ratio = ratios[len(ratios) // 2]
    print(f"  batched / one at a time: {ratio:.1f}x episodes per second")

    # (intervention s, update s, trained tokens) per repeat
    parts = {"grpo": [], "replace": [], "paired": []}
    for r in range(repeats):
        policy = Sampler(model, tok, seed=seed + r)
        trajs = rti.rollout(policy, batch_tasks, group)
        for method in parts:
            p = Sampler(copy.deepcopy(model), tok, seed=seed + r)
            opt = torch.optim.AdamW(p.model.parameters(), lr=cfg.lr)
            t0 = time.perf_counter()
            batch = [copy.copy(t) for t in trajs]
            if method != "grpo":
                mode = dataclasses.replace(cfg.rti, group_mode=method)
                batch, _ = intervene.intervene_batch(p, batch, mode, p.make_env)
            t1 = time.perf_counter()
            adv = advantages_by_group(
                torch.tensor([t.reward for t in batch]), [t.group for t in batch]
            )
            keep = [i for i in range(len(batch)) if adv[i] != 0]
            if keep:
                rti.update(p, opt, [batch[i] for i in keep], adv[keep], cfg)
            parts[method].append(
                (t1 - t0, time.perf_counter() - t1, sum(len(batch[i].ids) for i in keep))
            )
    med = {m: sorted(a + u for a, u, _ in v)[len(v) // 2] for m, v in parts.items()}
    print(
        f"where the after-sampling time goes, mean of {repeats}: intervention / update on the "
        "trained tokens (the update's throughput: tokens of the trained rows per second)"
    )
    for m, xs in parts.items():
        inter, upd, toks = (sum(x[k] for x in xs) / len(xs) for k in range(3))
        print(
            f"  {m:8s} intervention {inter:6.2f} s   update {upd:6.2f} s on {toks:6.0f} tokens "
            f"({toks / max(upd, 1e-9):.0f} tokens/s)"
        )
    roll = sorted(x[2] for x in rates["batched"])[len(rates["batched"]) // 2]
    for name, t in (
        ("after-sampling step time on the same batch", med),
        ("whole step with the batched rollout", {m: v + roll for m, v in med.items()}),
    ):
        print(
            f"{name}: GRPO {t['grpo']:.2f} s, "
            f"RTI replace {t['replace']:.2f} s ({t['replace'] / t['grpo']:.2f}x), "
            f"RTI paired {t['paired']:.2f} s ({t['paired'] / t['grpo']:.2f}x)"
        )


def demo_split() -> None:
    """The demo as `python rti.py` runs it (its defaults: the warm start, 8 RTI steps of 8 x 8, an
    evaluation of 100 test tasks x 4 before and after, 2 threads) and where its time goes."""
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        res = rti.train(
            runtime.make_config(rti.Config, out=out, progress=False), log=runtime.silent
        )
        wall = time.perf_counter() - start
    parts = res["seconds"]
    parts["other (loading, tasks, checkpoints)"] = wall - sum(parts.values())
    print(f"the demo (python rti.py): {wall:.0f} s in train()")
    for name, seconds in parts.items():
        print(f"  {name:38s} {seconds:6.1f} s  {100 * seconds / wall:5.1f}%")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m extras.bench",
        description="rollout throughput batched vs one at a time; GRPO vs RTI step time",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("model", nargs="?", default=rti.WARMSTART_DIR, help="the model directory")
    p.add_argument("--tasks", type=int, default=8, help="B: train tasks of the batch")
    p.add_argument("--group", type=int, default=8, help="G: episodes sampled per task")
    p.add_argument("--repeats", type=int, default=3, help="alternating repeats of each measurement")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument(
        "--demo",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the demo (its own settings) and print its time split",
    )
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.repeats:
        bench(args.model, args.tasks, args.group, args.repeats, args.threads)
    if args.demo:
        demo_split()


if __name__ == "__main__":
    main()
