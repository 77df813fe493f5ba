"""Speed against TRL 1.16, side by side on the same tiny warm-start model; optional (extras/).

    python -m extras.bench_trl        # full size: 64 train tasks x G 8, 3 alternating repeats
    python -m extras.bench_trl --tasks 2 --group-size 2 --repeats 1 --step-tasks 2   # smoke run

1. rollout: episodes per second of our lockstep, KV-cached sampling (`rti.rollout`) against
   TRL's tool loop (`GRPOTrainer._generate_and_score_completions` with
   `environment_factory=NavigationToolEnv`, which calls `model.generate` on the whole
   conversation every turn). Same tasks, G, temperature 1, at most 4 new tokens a turn, the
   task's own turn limit (the environment enforces it in both; TRL's loop stops at the extra turn
   after it, see extras/trl_rti.py). Goal: ours >= 5x TRL's.
2. one single-turn GRPO step: B prompts (each task's first observation) x G, one turn of at most
   4 tokens, reward 1 iff that first action passes the step check, group advantages, one
   forward/backward over all rows (token-mean: TRL's `dapo` with one accumulation step), clip
   1.0, one AdamW step. Ours: a DecodeSession turn + rti.update; TRL's: `training_step` (its
   generation, scoring and backward) + the optimizer step. Goal: ours <= 0.9x TRL's.

Repeats alternate ours / TRL's, each on its own copy of the model, and the medians are compared.
The machine state (CPUs, torch threads, load average before and after) is printed with the
figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from extras import trl_rti
from extras.trl_rti import (
    POLICY,
    GRPOTrainer,
    Sampler,
    Trajectory,
    envs,
    group_advantages,
    load_model,
    rollout,
    train_config,
    update,
)

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def first_step_reward(completions, task, **kwargs) -> list[float]:
    """1.0 iff the completion's text is a first action that passes Navigation's step check."""
    out = []
    for c, t in zip(completions, task):
        text = c[-1]["content"] if isinstance(c, list) else c
        env = envs.Navigation(trl_rti.task_of({"task": t}))
        out.append(float(env.check_step(" ".join(text.split())).valid))
    return out


def prompt_dataset(tasks):
    """Rows for the single-turn step: the first observation as the user message, plus the task."""

    def first_observation(row) -> dict:
        first = envs.Navigation(trl_rti.task_of(row)).reset()
        return {"prompt": [{"role": "user", "content": first}]}

    return trl_rti.navigation_dataset(tasks).map(first_observation)


# ----------------------------------------------------------------------------- 1. rollout


def ours_rollout(model, tok, tasks, G, seed):
    sampler = Sampler(model, tok, max_turn_tokens=4)
    t0 = time.perf_counter()
    trajs = rollout(sampler, tasks, G, seed)
    dt = time.perf_counter() - t0
    return dt, {
        "success": sum(t.reward for t in trajs) / len(trajs),
        "turns": sum(len(t.actions) for t in trajs) / len(trajs),
    }


def trl_rollout_trainer(model, tok, tasks, G, out):
    args = trl_rti.trl_args(
        out,
        1,
        len(tasks),
        G,
        max_completion_length=1536,
        max_tool_calling_iterations=max(t.max_turns for t in tasks) + 1,
        generation_kwargs={"max_new_tokens": 4},
    )
    return GRPOTrainer(
        model=model,
        processing_class=trl_rti.tool_tokenizer(tok),
        train_dataset=trl_rti.navigation_dataset(tasks),
        environment_factory=trl_rti.NavigationToolEnv,
        args=args,
    )


def trl_rollout(trainer, rows):
    trainer.model.train()  # as in TRL's training loop (its metrics go to the "train" bucket)
    t0 = time.perf_counter()
    trainer._generate_and_score_completions(rows)
    dt = time.perf_counter() - t0
    m = trainer._metrics["train"]
    turns = m["tools/call_frequency"][-1] + 1  # + the closing turn
    return dt, {"success": m["reward"][-1], "turns": turns}


# ----------------------------------------------------------------------------- 2. GRPO step


def ours_step(model, tok, opt, tasks, G, seed):
    """Sample one turn for B x G rows in one DecodeSession, score, group advantages, rti.update
    (token-mean)."""
    sampler = Sampler(model, tok, max_turn_tokens=4, seed=seed)
    cfg = train_config(micro_batch=len(tasks) * G, agg="token-mean", clip_high=0.2, grad_clip=1.0)
    t0 = time.perf_counter()
    model.eval()
    prompts = [sampler.chat.prompt_ids(envs.Navigation(t).reset()) for t in tasks for _ in range(G)]
    session = sampler.session(prompts)
    ids, logps = sampler.sample_turn(session, list(range(len(prompts))))
    trajs = []
    for k, (p, a, lp) in enumerate(zip(prompts, ids, logps)):
        t = Trajectory(task=tasks[k // G], group=k // G)
        t.add(p, 0, POLICY)
        t.add(a, 1, POLICY, lp)
        t.reward = float(envs.Navigation(t.task).check_step(sampler.chat.action_text(a)).valid)
        trajs.append(t)
    adv = group_advantages(torch.tensor([t.reward for t in trajs]), G)
    metrics = update(sampler, opt, trajs, adv, cfg)
    dt = time.perf_counter() - t0
    return dt, {"reward": float(sum(t.reward for t in trajs) / len(trajs)), "loss": metrics["loss"]}


def trl_step_trainer(model, tok, tasks, G, out):
    args = trl_rti.trl_args(
        out, 1, len(tasks), G, max_completion_length=4, loss_type="dapo", max_grad_norm=1.0
    )
    trainer = GRPOTrainer(
        model=model,
        processing_class=tok,
        reward_funcs=[first_step_reward],
        train_dataset=prompt_dataset(tasks),
        args=args,
    )
    trainer.create_optimizer()
    return trainer


def trl_step(trainer, rows):
    model = trainer.model
    t0 = time.perf_counter()
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer.training_step(model, rows, None)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    dt = time.perf_counter() - t0
    return dt, {"reward": trainer._metrics["train"]["reward"][-1], "loss": float(loss)}


# ----------------------------------------------------------------------------- driver


def machine(threads):
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{os.cpu_count()} CPUs, torch threads {threads}, load average {load}"


def run(a) -> dict:
    torch.set_num_threads(a.threads)
    print("machine before:", machine(a.threads))
    tasks = envs.make_tasks(a.split)[: a.tasks]
    step_tasks = envs.make_tasks(a.split)[: a.step_tasks]
    G = a.group_size
    ours_m, ours_tok = load_model(a.model)
    trl_m, trl_tok = load_model(a.model)
    trl_r = trl_rollout_trainer(trl_m, trl_tok, tasks, G, a.out)
    rows = [r for r in trl_rti.navigation_dataset(tasks) for _ in range(G)]
    res = {k: [] for k in ("ours_rollout", "trl_rollout", "ours_step", "trl_step")}
    info = {}
    for r in range(a.repeats):
        dt, info["ours_rollout"] = ours_rollout(ours_m, ours_tok, tasks, G, seed=r)
        res["ours_rollout"].append(dt)
        dt, info["trl_rollout"] = trl_rollout(trl_r, rows)
        res["trl_rollout"].append(dt)
        print(
            f"repeat {r}: rollout ours {res['ours_rollout'][-1]:.2f} s {info['ours_rollout']}, "
            f"TRL {res['trl_rollout'][-1]:.2f} s {info['trl_rollout']}",
            flush=True,
        )
    del trl_r
    ours_s, ours_stok = load_model(a.model)
    opt = torch.optim.AdamW(ours_s.parameters(), lr=1e-4, weight_decay=0.0)
    trl_s, trl_stok = load_model(a.model)
    trl_t = trl_step_trainer(trl_s, trl_stok, step_tasks, G, a.out)
    srows = [r for r in prompt_dataset(step_tasks) for _ in range(G)]
    for r in range(a.repeats):
        dt, info["ours_step"] = ours_step(ours_s, ours_stok, opt, step_tasks, G, seed=r)
        res["ours_step"].append(dt)
        dt, info["trl_step"] = trl_step(trl_t, srows)
        res["trl_step"].append(dt)
        print(
            f"repeat {r}: step ours {res['ours_step'][-1]:.2f} s {info['ours_step']}, "
            f"TRL {res['trl_step'][-1]:.2f} s {info['trl_step']}",
            flush=True,
        )
    med = {k: statistics.median(v) for k, v in res.items()}
    n = len(tasks) * G
    ours_eps = n / med["ours_rollout"]
    trl_eps = n / med["trl_rollout"]
    print(f"\nrollout, {len(tasks)} tasks x G {G} = {n} episodes, median of {a.repeats}:")
    print(
        f"  ours {ours_eps:.1f} episodes/s ({med['ours_rollout']:.2f} s), "
        f"TRL tool loop {trl_eps:.1f} episodes/s ({med['trl_rollout']:.2f} s): "
        f"{ours_eps / trl_eps:.2f}x (goal >= 5x)"
    )
    print(f"single-turn GRPO step, {len(step_tasks)} prompts x G {G}, median of {a.repeats}:")
    print(
        f"  ours {med['ours_step']:.3f} s, TRL {med['trl_step']:.3f} s: "
        f"{med['ours_step'] / med['trl_step']:.2f}x TRL's time (goal <= 0.9x)"
    )
    print("machine after:", machine(a.threads))
    return {
        "median_s": med,
        "rollout_ratio": ours_eps / trl_eps,
        "step_ratio": med["ours_step"] / med["trl_step"],
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m extras.bench_trl",
        description="Our rollout and GRPO step against TRL 1.16's, side by side.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--tasks", type=int, default=64, help="tasks of the rollout comparison")
    p.add_argument("--group-size", type=int, default=8, help="G: episodes or samples per task")
    p.add_argument(
        "--step-tasks", type=int, default=16, help="prompts of the single-turn step (x group size)"
    )
    p.add_argument("--repeats", type=int, default=3, help="alternating repeats; medians compared")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument(
        "--split",
        default="train",
        choices=tuple(envs.SPLITS),
        help="Navigation split the tasks come from, in order",
    )
    p.add_argument("--model", default=trl_rti.WARMSTART, help="the model directory, both sides")
    p.add_argument("--out", default="runs/bench_trl", help="TRL's output directory")
    return p


def main(argv=None):
    run(build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
