"""Rollout-Time Intervention (RTI) trainer: one file from the config to the training loop.

    python rti.py                        # the demo: tiny Qwen3 from its warm start, 8 RTI steps
    python rti.py eval runs/demo/model   # pass@1..4 and pass^1..4 of a saved model
    python rti.py --help                 # every flag, with its help text, default and choices

Reading order: `Config` (what a run can set), `train_step` (what one step does: sample, intervene,
advantages, update), then what the step uses (trajectories and rollout, the policy's batched
decoding and scoring, the chat rendering, the model), then the training loop `train`, and last
the flag machinery and the commands.

Data flows one way: envs (tasks, rubric) -> rollout here -> intervene.py (RTI) -> loss.py ->
AdamW. GPUs, LoRA and FSDP2 (extras/scale.py) plug in through `Backend`, the one object the loop
asks where the model runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import time
import warnings
import zlib
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm
from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    DynamicLayer,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

import envs
import evaluate
import intervene
from intervene import RTIConfig
from loss import (
    POLICY,
    LossConfig,
    advantages_by_group,
    combine_metrics,
    group_rows,
    policy_loss,
)

# the demo's warm start: its corrector, shown the grader's evidence, copies the path in part of
# its rewrites (python -m extras.warmstart rebuilds it)
WARMSTART_DIR = "checkpoints/warmstart-evidence"
METHODS = ("grpo", "rti")
LOSS_DENOMINATORS = ("batch", "trained")
EVAL_SEED_OFFSET = 10_000  # evaluations sample on streams of their own, apart from training's


# ----------------------------------------------------------------------------- config


@dataclass
class Config:
    """The run's settings. Every field is a flag `--field-name` (booleans also `--no-field-name`),
    and so is every field of the nested `loss` (loss.py) and `rti` (intervene.py) configs; the help
    text of each sits beside it, in its metadata, and `python rti.py --help` prints it."""

    model: str = field(
        default="tiny",
        metadata={
            "help": "'tiny' builds the 0.8M-parameter Qwen3 of this file; a directory loads a "
            "local Hugging Face causal LM (nothing is downloaded)"
        },
    )
    init: str = field(
        default=WARMSTART_DIR,
        metadata={"help": "starting weights of the tiny model ('' = random, as built)"},
    )
    seed: int = field(
        default=0,
        metadata={
            "help": "seeds the task order, every episode's sampling stream and a random model"
        },
    )
    threads: int = field(default=2, metadata={"help": "torch CPU threads"})
    env: str = field(
        default="navigation",
        metadata={"help": "the environment (envs.ENVS)", "choices": tuple(envs.ENVS)},
    )
    user_model: str = field(
        default="",
        metadata={
            "help": "who plays the user in envs that have one: '' = the policy model, 'scripted', "
            "or a local model directory"
        },
    )
    train_split: str = field(
        default="train",
        metadata={
            "help": "split the training tasks come from (Navigation: 'fit' leaves 'val' out)"
        },
    )
    test_split: str = field(
        default="test",
        metadata={
            "help": "split the evaluations run on (Navigation: 'val' while choosing settings)"
        },
    )
    batch_tasks: int = field(default=8, metadata={"help": "B: tasks per training step"})
    group_size: int = field(
        default=8, metadata={"help": "G: trajectories sampled per task (advantages need >= 2)"}
    )
    temperature: float = field(
        default=1.0,
        metadata={"help": "sampling temperature; log-probs are scored at the same temperature"},
    )
    top_p: float = field(
        default=1.0,
        metadata={
            "help": "nucleus sampling: the smallest set of tokens of mass >= top_p (1 = off)"
        },
    )
    max_turn_tokens: int = field(default=4, metadata={"help": "new tokens per agent turn, at most"})
    method: str = field(
        default="rti",
        metadata={
            "help": "grpo: group RL alone; rti: GRPO plus rollout-time intervention on the groups "
            "where every trajectory failed",
            "choices": METHODS,
        },
    )
    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "DAPO's filter_groups: keep only groups whose rewards differ (after the "
            "intervention, with rti) and sample rounds of new tasks until the batch holds "
            "--batch-tasks of them"
        },
    )
    max_sampling_rounds: int = field(
        default=4,
        metadata={"help": "dynamic sampling: rounds a step at most; then the batch may be short"},
    )
    steps: int = field(default=8, metadata={"help": "training steps, one rollout batch each"})
    lr: float = field(
        default=1e-4,
        metadata={
            "help": "AdamW learning rate (1e-4 chosen for rti on val; GRPO's was chosen apart, per"
            " warm start: 3e-5 from warmstart-route0, 1e-4 from warmstart and warmstart-evidence)"
        },
    )
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    updates_per_batch: int = field(default=1, metadata={"help": "epochs over each rollout batch"})
    mini_batches: int = field(
        default=4,
        metadata={
            "help": "optimizer steps per epoch, each on a shuffled part of the batch; from the "
            "second one on, the ratio and the clip act (chosen on the validation split)"
        },
    )
    loss_denominator: str = field(
        default="trained",
        metadata={
            "help": "what a mini-batch's loss is averaged over: 'batch', all its rows' tokens, "
            "zero-advantage rows included (as TRL and verl: a step is as large as the share of "
            "rows that teach); 'trained', only the rows with a non-zero advantage (a step on one "
            "group is as large as a step on a full batch)",
            "choices": LOSS_DENOMINATORS,
        },
    )
    warmup_steps: int = field(
        default=0, metadata={"help": "linear learning-rate warm-up over the first N steps"}
    )
    micro_batch: int = field(
        default=8,
        metadata={
            "help": "rows per forward/backward pass (gradients accumulate); memory grows as "
            "rows x T^2"
        },
    )
    grad_clip: float = field(default=1.0, metadata={"help": "clip the gradient's global norm"})
    eval_every: int = field(
        default=10, metadata={"help": "evaluate every N steps (0: only before and after)"}
    )
    eval_samples: int = field(default=4, metadata={"help": "samples per evaluation task"})
    eval_tasks: int = field(
        default=100,
        metadata={"help": "evaluate on the first N tasks of --test-split (0: no evaluation)"},
    )
    eval_before: bool = field(default=True, metadata={"help": "evaluate the starting policy too"})
    out: str = field(
        default="runs/demo",
        metadata={"help": "run directory: metrics.jsonl, results.json, ckpt.pt, model/"},
    )
    resume: bool = field(
        default=False, metadata={"help": "continue the run in --out from its checkpoint"}
    )
    save_every: int = field(
        default=10, metadata={"help": "write the checkpoint every N steps and at the end"}
    )
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})
    loss: LossConfig = field(default_factory=LossConfig)
    rti: RTIConfig = field(default_factory=RTIConfig)

    def validate(self) -> None:
        """Raise ValueError("--flag: why") for a bad value (LossConfig and RTIConfig check their
        own fields when built)."""
        for name in (
            "batch_tasks",
            "max_turn_tokens",
            "updates_per_batch",
            "mini_batches",
            "max_sampling_rounds",
            "micro_batch",
            "eval_samples",
            "threads",
            "save_every",
        ):
            require(self, name, getattr(self, name) >= 1, "must be >= 1")
        for name in ("steps", "eval_every", "eval_tasks", "warmup_steps"):
            require(self, name, getattr(self, name) >= 0, "must be >= 0")
        for name in ("temperature", "lr", "grad_clip"):
            require(self, name, getattr(self, name) > 0, "must be > 0")
        require(self, "group_size", self.group_size >= 2, "must be >= 2 for group advantages")
        require(self, "top_p", 0 < self.top_p <= 1, "must be in (0, 1]")
        require(self, "method", self.method in METHODS, f"must be one of {METHODS}")
        require(
            self,
            "loss_denominator",
            self.loss_denominator in LOSS_DENOMINATORS,
            f"must be one of {LOSS_DENOMINATORS}",
        )
        require(
            self,
            "group_size",
            self.rti.intervene_per_group <= self.group_size,
            "must be >= --intervene-per-group",
        )
        require(
            self,
            "model",
            self.model == "tiny" or Path(self.model).is_dir(),
            "must be 'tiny' or a local model directory",
        )
        try:
            splits = envs.env_class(self.env).splits()
        except (ImportError, ValueError) as e:
            raise ValueError(f"--env: {e}") from None
        for name in ("train_split", "test_split"):
            require(
                self,
                name,
                getattr(self, name) in splits,
                f"must be a split of {self.env}: {splits}",
            )
        require(
            self,
            "init",
            self.env == "navigation" or self.model != "tiny" or not self.init,
            "the tiny warm start is a Navigation model: pass --init '' (a random tiny model) "
            "or --model PATH",
        )
        require(
            self.loss,
            "kl_coef",
            self.loss.kl_coef == 0,
            "the KL penalty needs a reference model's log-probs and this loop loads no reference "
            "model: use --kl-coef 0 (the default, as the paper's runs)",
        )
        require(
            self,
            "user_model",
            self.user_model in ("", "scripted") or Path(self.user_model).is_dir(),
            "must be '', 'scripted' or a local model directory",
        )


def require(cfg, name: str, ok: bool, why: str) -> None:
    """Raise ValueError("--flag-name: why, got VALUE") unless `ok`."""
    if not ok:
        raise ValueError(f"--{name.replace('_', '-')}: {why}, got {getattr(cfg, name)!r}")


# ----------------------------------------------------------------------------- one training step


def train_step(
    sampler: Sampler,
    opt,
    tasks: list,
    cfg: Config,
    seed: int | None = None,
    backend: Backend | None = None,
    draw_tasks: Callable[[], list] | None = None,
) -> dict:
    """One step of GRPO or RTI on a batch of tasks; returns the step's metrics.

    1. sample     G trajectories of each task (`rollout`)
    2. intervene  RTI only: correct the groups where every trajectory failed (intervene.py);
                  with --dynamic-sampling, 1 and 2 repeat on new tasks (`draw_tasks()`) until the
                  batch holds as many groups with a reward spread as `tasks` has (`sample_batch`)
    3. advantages group z-scores of the rewards (loss.advantages_by_group); rows whose advantage is
                  0 teach nothing: they are not run, and count in the loss's denominator or not
                  (--loss-denominator)
    4. update     PPO-style AdamW steps on the clipped surrogate (`update`, loss.policy_loss)

    `seed` fixes the episodes' sampling streams and the mini-batch shuffle (the trainer derives it
    from --seed and the step). Groups may differ in size (paired RTI adds corrections to their
    group): advantages are taken group by group."""
    backend = backend or Backend(cfg)
    with backend.gathered(sampler.model):  # processes run different numbers of forwards in here
        trajs, metrics = sample_batch(sampler, tasks, cfg, seed, draw_tasks)
    sampled = time.time()

    rewards = torch.tensor([t.reward for t in trajs])
    group_ids = [t.group for t in trajs]
    advantages = advantages_by_group(rewards, group_ids, scale=cfg.loss.scale_advantages)
    metrics["train_success_after_rti"] = float(rewards.mean())
    metrics["groups_with_spread"] = float(
        np.mean([has_spread([trajs[i] for i in rows]) for rows in group_rows(group_ids).values()])
    )

    trained = [i for i in range(len(trajs)) if advantages[i] != 0]
    rows = trained if cfg.loss_denominator == "trained" else list(range(len(trajs)))
    if backend.all_reduce(len(trained)):  # with several processes, every one joins the update
        update_trajs = [trajs[i] for i in rows]
        metrics.update(
            update(sampler, opt, update_trajs, advantages[rows], cfg, backend, seed or 0)
        )
    metrics["time/update"] = time.time() - sampled
    metrics["trained_rows"] = len(trained)
    if cfg.method == "rti" and "tokens/trained" in metrics:
        # the reweighting's figures, summed over the run like the intervention's counts
        metrics["rti/trained_tokens"] = metrics["tokens/trained"]
        metrics["rti/intervened_tokens"] = metrics["tokens/intervened"]
        metrics["rti/intervened_weight_sum"] = metrics["weight_mean"] * metrics["tokens/intervened"]
        metrics["rti/intervened_ratio_tokens"] = metrics["tokens/intervened_ratio"]
        metrics["rti/intervened_clipped"] = round(
            metrics["intervened/clip_frac"] * metrics["tokens/intervened_ratio"]
        )
    return backend.reduce_metrics(metrics)


def sample_batch(
    sampler: Sampler,
    tasks: list,
    cfg: Config,
    seed: int | None,
    draw_tasks: Callable[[], list] | None = None,
) -> tuple[list[Trajectory], dict]:
    """Steps 1 and 2 of train_step: the batch to learn from, and what sampling it cost.

    Without --dynamic-sampling: one rollout of `tasks` (intervened with RTI). With it (DAPO's
    `filter_groups`): only groups whose rewards differ are kept, and rounds of new tasks from
    `draw_tasks()` are sampled until the batch holds len(tasks) of them (the extra ones of the
    last round are dropped) or --max-sampling-rounds rounds have run; the batch may then be short.
    Metrics: sampled and continued episodes, generated tokens (the policy's, every role included),
    rounds, the rollout's success, and RTI's counts summed over the rounds."""
    target = len(tasks)
    rounds = cfg.max_sampling_rounds if cfg.dynamic_sampling else 1
    tokens_before = sampler.generated_tokens
    sampled = []  # every rollout episode of every round
    groups = []  # the batch, group by group (dynamic sampling)
    counts = Counter()  # RTI's counts, summed over rounds
    rollout_seconds = 0.0
    intervene_seconds = 0.0
    for round_index in range(rounds):
        if round_index > 0:
            tasks = draw_tasks()
        start = time.time()
        trajs = rollout(sampler, tasks, cfg.group_size, round_seed(seed, round_index))
        rolled_out = time.time()
        sampled += trajs
        if cfg.method == "rti":
            trajs, round_counts = intervene.intervene_batch(
                sampler, trajs, cfg.rti, sampler.make_env
            )
            counts.update(round_counts)
        rollout_seconds += rolled_out - start
        intervene_seconds += time.time() - rolled_out
        if not cfg.dynamic_sampling:
            break
        rows_of_group = group_rows([t.group for t in trajs]).values()
        groups += [
            [trajs[i] for i in rows]
            for rows in rows_of_group
            if has_spread([trajs[i] for i in rows])
        ]
        if len(groups) >= target:
            break
    if cfg.dynamic_sampling:
        groups = groups[:target]
        trajs = [t for group in groups for t in group]
        for index, group in enumerate(groups):  # groups of different rounds must stay apart
            for t in group:
                t.group = index
    metrics = {
        "train_success": float(np.mean([t.reward for t in sampled])),
        "turns": float(np.mean([len(t.actions) for t in sampled])),
        # ints are summed over processes (Backend.reduce_metrics), floats averaged
        "sampled_episodes": len(sampled),
        "continued_episodes": int(counts.get("with_accepted", 0)),
        "generated_tokens": int(sampler.generated_tokens - tokens_before),
        "sampling_rounds": float(round_index + 1),
        "batch_groups": len({t.group for t in trajs}),
        "time/rollout": rollout_seconds,
        "time/intervene": intervene_seconds,
    }
    if cfg.method == "rti":
        rates = evaluate.intervention_rates(dict(counts))
        metrics.update({f"rti/{k}": v for k, v in rates.items()})
    return trajs, metrics


def round_seed(seed: int | None, round_index: int) -> int | None:
    """The sampling seed of a dynamic-sampling round: the step's own for the first round, a
    derived one after it (so a task drawn again samples new episodes)."""
    if seed is None or round_index == 0:
        return seed
    return zlib.crc32(f"{seed}/round/{round_index}".encode())


def has_spread(group: list[Trajectory]) -> bool:
    """Whether a group's rewards differ: only then do its advantages teach anything."""
    return len({t.reward for t in group}) > 1


def update(
    sampler: Sampler,
    opt,
    trajs: list[Trajectory],
    advantages: torch.Tensor,
    cfg: Config,
    backend: Backend | None = None,
    seed: int = 0,
) -> dict:
    """PPO-style updates on one rollout batch; returns the update's metrics.

    pi_old's log-probs come from one scoring pass at the sampling temperature; then
    `updates_per_batch` epochs, each of `mini_batches` AdamW steps on shuffled parts of the batch
    (verl's ppo_mini_batch_size, TRL's steps_per_generation), so that from the second step on the
    ratio and the clip act. With a single step per batch pi_old is the policy being updated: its
    log-probs are that step's own forward pass (detached), and every ratio is 1.

    Metric `loss` is the mean of the steps' losses, `grad_norm` the last step's; the others are
    the micro-batches' figures joined (loss.combine_metrics). Rows whose advantage is 0 are never
    run (their loss is 0), but they count in the mini-batch's token or row total
    (--loss-denominator batch passes them in)."""
    backend = backend or Backend(cfg)
    model = sampler.model
    n_steps = cfg.updates_per_batch * cfg.mini_batches
    old_logp = None
    if n_steps > 1:
        teaching = [r for r in range(len(trajs)) if advantages[r] != 0]
        with backend.gathered(model):
            scores = sampler.score([trajs[r].ids for r in teaching])
        old_logp = dict(zip(teaching, scores))
    model.train()
    rng = random.Random(seed)
    order = list(range(len(trajs)))
    metrics = []
    mean_loss = 0.0
    for _ in range(cfg.updates_per_batch):
        if cfg.mini_batches > 1:
            rng.shuffle(order)
        for part in np.array_split(order, cfg.mini_batches):
            rows = sorted(part.tolist(), key=lambda r: len(trajs[r].ids))  # less padding
            opt.zero_grad(set_to_none=True)
            losses, part_metrics = backward_mini_batch(
                sampler, trajs, advantages, old_logp, rows, cfg, backend
            )
            for loss in losses:
                mean_loss += loss / n_steps
            metrics += part_metrics
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
    out = combine_metrics(metrics)
    out["loss"] = backend.all_reduce(mean_loss)
    if hasattr(grad_norm, "full_tensor"):  # a sharded (FSDP) norm
        grad_norm = grad_norm.full_tensor()
    out["grad_norm"] = float(grad_norm)
    return out


def backward_mini_batch(
    sampler: Sampler,
    trajs: list[Trajectory],
    advantages: torch.Tensor,
    old_logp: dict[int, list[float]] | None,
    rows: list[int],
    cfg: Config,
    backend: Backend,
) -> tuple[list[float], list[dict]]:
    """Accumulate the gradient of the loss of mini-batch `rows`, `micro_batch` rows at a time;
    returns each micro-batch's share of the loss and the metrics of each non-empty one.

    Each micro-batch's loss is weighted by its share of the mini-batch's tokens (token-mean) or
    rows, so the shares add up to the mini-batch's loss. Rows with advantage 0 are not run (their
    loss is 0) but count in those totals. With several processes the mini-batch is
    the global one: shares use global counts, every process runs as many micro-batches as the
    busiest (empty ones where it has none), and the loss is scaled by the world size, as FSDP
    averages gradients."""
    device = sampler.device
    n_tokens = backend.all_reduce(sum(sum(trajs[r].loss_mask) for r in rows))
    n_rows = backend.all_reduce(len(rows))
    teaching = [r for r in rows if advantages[r] != 0]
    n_micro = int(backend.all_reduce(math.ceil(len(teaching) / cfg.micro_batch), "max"))
    losses = []
    metrics_list = []
    for start in range(0, n_micro * cfg.micro_batch, cfg.micro_batch):
        idx = teaching[start : start + cfg.micro_batch]
        micro = [trajs[r] for r in idx] or [empty_trajectory(sampler.tok.pad_token_id)]
        adv = advantages[idx] if idx else torch.zeros(1)
        logp = token_logprobs(
            sampler.model,
            [t.ids for t in micro],
            sampler.tok.pad_token_id,
            sampler.temperature,
            device,
        )
        mask = pad_rows([t.loss_mask for t in micro], 0, torch.float32, device)
        if old_logp is None:
            old = logp.detach()
        else:
            old = pad_rows([old_logp[r] for r in idx] or [[0.0]], 0, torch.float32, device)
        loss, metrics = policy_loss(
            logp,
            old,
            adv.to(device),
            mask,
            source=pad_rows([t.source for t in micro], 0, torch.long, device),
            behavior_logp=pad_rows([t.sample_logp for t in micro], 0, torch.float32, device),
            config=cfg.loss,
        )
        if cfg.loss.agg == "token-mean":
            share = mask.sum().item() / max(1, n_tokens)
        else:
            share = len(idx) / max(1, n_rows)
        (loss * share * backend.world).backward()
        losses.append(loss.item() * share)
        if idx:
            metrics_list.append({"loss": loss.item(), **metrics})
    return losses, metrics_list


def empty_trajectory(pad_id: int) -> Trajectory:
    """A one-token row with nothing to train: the micro-batch of a process that has no rows left."""
    return Trajectory(None, -1, ids=[pad_id], loss_mask=[0], source=[POLICY], sample_logp=[0.0])


# ----------------------------------------------------------------------------- trajectories and rollout


@dataclass
class Trajectory:
    """One episode as the exact token sequence the model saw, with per-token bookkeeping."""

    task: object
    group: int
    ids: list[int] = field(default_factory=list)
    # 1 on agent tokens, 0 on prompt and environment tokens
    loss_mask: list[int] = field(default_factory=list)
    # POLICY or INTERVENED: who wrote each token
    source: list[int] = field(default_factory=list)
    # log-prob of each token when it was sampled (policy) or written (corrector)
    sample_logp: list[float] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    # (start, end) of each agent turn in ids
    turns: list[tuple[int, int]] = field(default_factory=list)
    # observations[i] is the user content before agent turn i
    observations: list[str] = field(default_factory=list)
    reward: float = 0.0
    rubric: dict = field(default_factory=dict)
    intervention: dict | None = None
    # the sampling stream of this episode (episode_seed)
    seed: int | None = None

    def truncated(self, k: int) -> Trajectory:
        """A copy of the episode before agent turn k (it ends with the message turn k answered)."""
        end = self.turns[k][0] if k < len(self.turns) else len(self.ids)
        return Trajectory(
            task=self.task,
            group=self.group,
            ids=self.ids[:end],
            loss_mask=self.loss_mask[:end],
            source=self.source[:end],
            sample_logp=self.sample_logp[:end],
            actions=self.actions[:k],
            turns=self.turns[:k],
            observations=self.observations[: k + 1],
            seed=self.seed,
        )

    def add(self, ids: list[int], loss_mask: int, source: int, logp: list[float] | None = None):
        """Append tokens that share a loss mask and a source (log-probs 0 when not given)."""
        self.ids += ids
        self.loss_mask += [loss_mask] * len(ids)
        self.source += [source] * len(ids)
        self.sample_logp += logp if logp is not None else [0.0] * len(ids)

    def step(self, chat: Chat, env, agent_ids, logp, source=POLICY) -> list[int] | None:
        """Record an agent turn and execute its action in `env`.

        A turn cut off before its eos is closed with an eos that is not trained. Returns the tokens
        that follow the turn in the model's context (that eos, then the observation), or None when
        the episode ended (then reward and rubric are set)."""
        start = len(self.ids)
        self.add(agent_ids, 1, source, logp)
        closed = agent_ids[-1:] == [chat.eos_id]
        if not closed:
            self.add([chat.eos_id], 0, POLICY)
        self.turns.append((start, len(self.ids)))
        self.actions.append(chat.action_text(agent_ids))
        observation, done = env.step(self.actions[-1])
        if done:
            result = env.score()
            self.reward = float(result.success)
            self.rubric = dict(result.items)
            return None
        self.observations.append(observation)
        chunk = chat.turn_ids(observation, env.observation_role)
        self.add(chunk, 0, POLICY)
        closing_eos = [] if closed else [chat.eos_id]
        return closing_eos + chunk


def episode_seed(seed: int, task_id: str, j: int) -> int:
    """The sampling stream of sample j of a task: a function of (seed, task, j) alone, so an
    episode samples the same tokens whatever else shares its batch, on one process or several."""
    # 32 bits: torch's CPU generator seeds from the low 32
    return zlib.crc32(f"{seed}/{task_id}/{j}".encode())


def rollout(
    sampler: Sampler, tasks: list, group_size: int, seed: int | None = None
) -> list[Trajectory]:
    """Sample B x G multi-turn episodes in lockstep: one batched decoding pass per turn for all
    live episodes.

    The KV cache is kept across turns, so each turn feeds only the new observation tokens. Each
    episode samples from its own stream (episode_seed); `seed` None draws one from sampler.gen."""
    sampler.model.eval()
    if seed is None:
        seed = int(torch.randint(2**62, (1,), generator=sampler.gen, device=sampler.gen.device))
    env_list = []
    trajs = []
    for g, task in enumerate(tasks):
        for j in range(group_size):
            env = sampler.make_env(task)
            traj = Trajectory(
                task, g, observations=[env.reset()], seed=episode_seed(seed, task.task_id, j)
            )
            traj.add(sampler.chat.prompt_ids(traj.observations[0]), 0, POLICY)
            env_list.append(env)
            trajs.append(traj)
    session = sampler.session([t.ids for t in trajs], [t.seed for t in trajs])
    live = list(range(len(trajs)))  # live[i]: the episode in session row i
    while live:
        ids, logps = sampler.sample_turn(session, list(range(len(live))))
        chunks = [
            trajs[e].step(sampler.chat, env_list[e], agent_ids, agent_logp)
            for e, agent_ids, agent_logp in zip(live, ids, logps)
        ]
        going = [i for i, chunk in enumerate(chunks) if chunk is not None]
        if len(going) < len(live):
            session.keep(going)  # finished episodes leave the batch
        live = [live[i] for i in going]
        session.feed(list(range(len(live))), [chunks[i] for i in going])
    return trajs


def evaluate_policy(
    sampler: Sampler,
    tasks: list,
    n: int,
    seed: int = 1234,
    chunk: int = 256,
    per_task: bool = False,
):
    """pass@k / pass^k of the policy on `tasks` with n samples each (evaluate.summarize), on
    streams of their own, at most `chunk` episodes at once. per_task=True also returns the
    successes, one list of n booleans per task."""
    successes = []
    tasks_per_chunk = max(1, chunk // n)
    for i in range(0, len(tasks), tasks_per_chunk):
        trajs = rollout(sampler, tasks[i : i + tasks_per_chunk], n, seed)
        for g in range(0, len(trajs), n):
            successes.append([t.reward > 0 for t in trajs[g : g + n]])
    summary = evaluate.summarize(successes, k_max=min(4, n))
    return (summary, successes) if per_task else summary


# ----------------------------------------------------------------------------- the policy


class Sampler:
    """The policy as the loop and intervene.py (its `Policy` protocol) use it: the network
    `model`, its chat pieces, batched sampling through KV-cached sessions and log-prob scoring."""

    def __init__(
        self,
        model,
        tok,
        temperature=1.0,
        top_p=1.0,
        max_turn_tokens=4,
        seed=0,
        micro_batch=8,
        env="navigation",
        user=None,
        chat: Chat | None = None,
    ):
        self.model = model
        self.tok = tok
        self.chat = chat or Chat(tok, env)
        self.user = user  # plays the user in envs that have one (Env.make_user)
        self.temperature = temperature
        self.top_p = top_p
        self.max_turn_tokens = max_turn_tokens
        self.micro_batch = micro_batch
        self.device = next(model.parameters()).device
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self.generated_tokens = 0  # every token this policy sampled, in any role: a compute figure

    def make_env(self, task) -> envs.Env:
        """A fresh environment for `task` (with its user, if the env has one)."""
        return self.chat.env_cls.make(task, self.user)

    def session(self, prefixes: list[list[int]], seeds: list[int] | None = None) -> DecodeSession:
        """A decoding session; row i samples from stream `seeds[i]` (default: drawn from self.gen)."""
        if seeds is None:
            seeds = torch.randint(
                2**62, (len(prefixes),), generator=self.gen, device=self.gen.device
            ).tolist()
        return DecodeSession(self.model, prefixes, self.tok.pad_token_id, seeds)

    def sample_turn(self, session: DecodeSession, rows: list[int], max_new: int | None = None):
        """One agent turn for each row of `session` in `rows`: (token ids, log-probs)."""
        ids, logps = session.sample_turn(
            rows, max_new or self.max_turn_tokens, self.chat.eos_id, self.temperature, self.top_p
        )
        self.generated_tokens += sum(map(len, ids))
        return ids, logps

    def generate(self, contexts: list[list[int]], max_new: int | None = None):
        """One agent turn for each context, encoding the contexts afresh (the LLM roles' calls)."""
        if not contexts:
            return [], []
        return self.sample_turn(self.session(contexts), list(range(len(contexts))), max_new)

    @torch.no_grad()
    def score(self, seqs: list[list[int]]) -> list[list[float]]:
        """log pi(y_t | y_<t) at the sampling temperature of every token (0.0 for the first)."""
        out = []
        for i in range(0, len(seqs), self.micro_batch):
            batch = seqs[i : i + self.micro_batch]
            logp = token_logprobs(
                self.model, batch, self.tok.pad_token_id, self.temperature, self.device
            )
            out += [logp[j, : len(s)].tolist() for j, s in enumerate(batch)]
        return out


def sample_token(
    logits: torch.Tensor, temperature: float, top_p: float, gens: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample row i from softmax(logits_i / T), optionally nucleus-filtered, with its own
    generator gens[i]; return the ids and log pi(id) at temperature T.

    Gumbel-max: id = argmax_v log p_v + g_v, g_v = -log(-log u_v), u_v uniform. One generator per
    row makes a row's sample independent of which other rows share the batch."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    kept = logp
    if top_p < 1.0:
        probs, order = logp.exp().sort(dim=-1, descending=True)
        outside = probs.cumsum(-1) - probs >= top_p  # mass before the token already reaches top_p
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, outside)
        kept = logp.masked_fill(drop, float("-inf"))
    uniform = torch.stack(
        [torch.rand(logp.shape[-1], generator=g, device=g.device) for g in gens]
    ).to(logp.device)
    gumbel = -torch.log(-torch.log(uniform.clamp(1e-20, 1 - 1e-7)))
    ids = (kept + gumbel).argmax(-1)
    return ids, logp.gather(-1, ids[:, None]).squeeze(-1)


def sdpa_shared_kv(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, except on the CPU for several query tokens under a mask (a
    decoding session's fed chunks): there grouped-query attention reads each KV head where it is
    (SDPA's enable_gqa) instead of copying it once per query head first (transformers' repeat_kv,
    which copies the whole cache at every layer). The same values bit for bit (tests check)."""
    plain = (
        query.device.type != "cpu"
        or getattr(module, "num_key_value_groups", 1) == 1
        or query.shape[2] == 1  # one query token: transformers packs the heads already
        or attention_mask is None  # transformers uses enable_gqa already
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
    )
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=kwargs.get("dropout", 0.0),
        scale=kwargs.get("scaling"),
        enable_gqa=True,
    )
    return out.transpose(1, 2).contiguous(), None


SDPA_SHARED_KV = "sdpa_shared_kv"
AttentionInterface.register(SDPA_SHARED_KV, sdpa_shared_kv)
AttentionMaskInterface.register(SDPA_SHARED_KV, sdpa_mask)  # SDPA's masks, as for "sdpa"


class KVBuffer(DynamicLayer):
    """One layer's KV cache in a preallocated buffer that doubles when full: a fed token is
    written in place, where transformers' DynamicLayer copies the whole cache (torch.cat) at
    every forward. `keys` and `values` are views of the filled part, as DynamicLayer's."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.set(key_states[:, :, :0], value_states[:, :, :0])
        end = self.keys.shape[-2] + key_states.shape[-2]
        if end > self.key_buffer.shape[-2]:
            self.set(self.keys, self.values, capacity=2 * end)
        start = self.keys.shape[-2]
        self.key_buffer[:, :, start:end] = key_states
        self.value_buffer[:, :, start:end] = value_states
        self.keys = self.key_buffer[:, :, :end]
        self.values = self.value_buffer[:, :, :end]
        return self.keys, self.values

    def set(self, keys, values, capacity: int = 0) -> None:
        """Hold `keys` and `values` ([rows, heads, slots, head_dim]) in a new buffer with room for
        `capacity` slots (at least twice theirs)."""
        rows, heads, slots, head_dim = keys.shape
        capacity = self.room(slots, capacity)
        self.key_buffer = keys.new_empty(rows, heads, capacity, head_dim)
        self.value_buffer = values.new_empty(rows, heads, capacity, head_dim)
        self.key_buffer[:, :, :slots] = keys
        self.value_buffer[:, :, :slots] = values
        self.keys = self.key_buffer[:, :, :slots]
        self.values = self.value_buffer[:, :, :slots]

    @staticmethod
    def room(slots: int, capacity: int = 0) -> int:
        """The slots of a new buffer that is to hold `slots`: `capacity`, and at least twice
        `slots` and 64 (so appends rarely copy)."""
        return max(capacity, 2 * slots, 64)

    def pack(self, rows: torch.Tensor, columns: torch.Tensor) -> None:
        """Keep rows `rows` of the cache, renumbered, row i holding its slots columns[i] in its
        first columns: one gather from the old buffer into the new one."""
        _, heads, capacity, head_dim = self.key_buffer.shape
        n, slots = columns.shape
        # the (row, head, slot) cells to keep, in the old buffer seen as [cells, head_dim]
        head = torch.arange(heads, device=rows.device)
        cells = (
            (rows[:, None, None] * heads + head[:, None]) * capacity + columns[:, None, :]
        ).flatten()

        def packed(buffer: torch.Tensor) -> torch.Tensor:
            out = buffer.new_empty(n, heads, self.room(slots), head_dim)
            out[:, :, :slots] = buffer.view(-1, head_dim)[cells].view(n, heads, slots, head_dim)
            return out

        self.key_buffer = packed(self.key_buffer)
        self.value_buffer = packed(self.value_buffer)
        self.keys = self.key_buffer[:, :, :slots]
        self.values = self.value_buffer[:, :, :slots]


class DecodeSession:
    """N rows decoded in lockstep through one KV cache that is kept across turns.

    Rows grow independently: a call that feeds tokens to some rows pads the others with masked
    slots (holes), and position ids count only real tokens, so each row computes exactly what it
    would alone (tests check this), but for a sliding-window layer, whose window counts holes too.
    The last token of a sampled turn is not fed at once: it waits (`pending`) and goes in with
    the next chunk, which saves one forward pass a turn. `keep` drops finished rows and packs out
    holes; `retract` takes a row's latest turn back (to replace it)."""

    def __init__(
        self, model, prefixes: list[list[int]], pad_id: int, seeds: list[int] | None = None
    ):
        self.model = model
        self.pad_id = pad_id
        self.n = len(prefixes)
        device = next(model.parameters()).device
        if seeds is None:
            seeds = range(self.n)
        # one sampling stream per row
        self.gens = [torch.Generator(device=device).manual_seed(int(s) % 2**63) for s in seeds]
        self.cache = DynamicCache(config=model.config)
        if not any(self.cache.is_sliding):
            self.cache.layers = [KVBuffer() for _ in self.cache.layers]
        self.mask = torch.zeros(self.n, 0, dtype=torch.long, device=device)
        # real tokens per row
        self.length = torch.zeros(self.n, dtype=torch.long, device=device)
        self.last_logits = torch.zeros(self.n, model.config.vocab_size, device=device)
        # the cache slot of each real token, per row
        self.real_slots: list[list[int]] = [[] for _ in range(self.n)]
        # the last token of each row's latest turn, until the next feed takes it in
        self.pending: list[list[int]] = [[] for _ in range(self.n)]
        # next-token logits before the latest turn, per row (for retract)
        self.saved_logits: dict[int, torch.Tensor] = {}
        self.feed(list(range(self.n)), prefixes)

    @torch.no_grad()
    def feed(self, rows: list[int], chunks: list[list[int]]) -> None:
        """Append chunks[i] (after the row's pending token, if any) to row rows[i] in one forward
        pass; those rows' next-token logits are updated."""
        device = self.mask.device
        start = self.mask.shape[1]
        chunk_of = [[] for _ in range(self.n)]  # what each row is fed
        for r, chunk in zip(rows, chunks):
            chunk_of[r] = self.pending[r] + list(chunk)
            self.pending[r] = []
            self.real_slots[r].extend(range(start, start + len(chunk_of[r])))
        if not any(chunk_of):
            return
        # each chunk left-aligned, trailing pads are holes
        ids = pad_rows(chunk_of, self.pad_id, torch.long, device)
        lengths = torch.tensor([len(c) for c in chunk_of], device=device)
        new_mask = (torch.arange(ids.shape[1], device=device) < lengths[:, None]).long()
        positions = self.length[:, None] + (new_mask.cumsum(-1) - 1).clamp(min=0)
        self.mask = torch.cat([self.mask, new_mask], 1)
        fed = lengths > 0
        last = lengths[fed] - 1
        # only the columns whose logits are used: all of them is GBs at a 150k vocabulary
        columns = torch.unique(last)
        # the first chunks fill an empty cache left-aligned: under causal attention no real token
        # sees the pads after it, so no mask is needed, and SDPA runs its causal kernel
        out = self.model(
            input_ids=ids,
            attention_mask=self.mask if start else None,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=columns,
        )
        self.last_logits[fed] = out.logits[fed, torch.searchsorted(columns, last)].float()
        self.length += lengths

    @torch.no_grad()
    def sample_turn(
        self, rows: list[int], max_new: int, eos_id: int, temperature: float, top_p: float
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Sample one agent turn (up to max_new tokens, stopping at eos) for each row in `rows`;
        each turn's last token is left pending."""
        waiting = [r for r in rows if self.pending[r]]
        self.feed(waiting, [[] for _ in waiting])  # a pending token must be in before sampling
        ids_out = [[] for _ in rows]
        logp_out = [[] for _ in rows]
        live = list(range(len(rows)))
        self.saved_logits = {r: self.last_logits[r].clone() for r in rows}  # for retract
        while live:
            live_rows = [rows[i] for i in live]
            tokens, logps = sample_token(
                self.last_logits[live_rows], temperature, top_p, [self.gens[r] for r in live_rows]
            )
            for i, token, logp in zip(live, tokens.tolist(), logps.tolist()):
                ids_out[i].append(token)
                logp_out[i].append(logp)
            going = [i for i in live if ids_out[i][-1] != eos_id and len(ids_out[i]) < max_new]
            for i in set(live) - set(going):
                self.pending[rows[i]] = [ids_out[i][-1]]
            self.feed([rows[i] for i in going], [[ids_out[i][-1]] for i in going])
            live = going
        return ids_out, logp_out

    @torch.no_grad()
    def keep(self, rows: list[int]) -> None:
        """Keep only `rows`, renumbered: row rows[i] becomes row i, its real tokens packed to the
        left of the cache (their keys carry their positions already), so finished episodes and
        holes stop costing compute and memory."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        real = [self.real_slots[r] for r in rows]
        if any(self.cache.is_sliding):
            # a sliding-window layer keeps its last columns only: drop rows, keep the holes
            self.mask = self.mask[idx]
            for layer in self.cache.layers:
                layer.keys = layer.keys[idx]
                layer.values = layer.values[idx]
        else:
            # columns[i, j]: the cache slot of row i's j-th real token, -1 past its end
            columns = pad_rows(real, -1, torch.long, idx.device)
            self.mask = (columns >= 0).long()
            columns = columns.clamp(min=0)
            real = [list(range(len(slots))) for slots in real]
            for layer in self.cache.layers:
                layer.pack(idx, columns)
        self.real_slots = real
        self.length = self.length[idx]
        self.last_logits = self.last_logits[idx]
        self.gens = [self.gens[r] for r in rows]
        self.pending = [self.pending[r] for r in rows]
        self.n = len(rows)
        self.saved_logits = {
            i: self.saved_logits[r] for i, r in enumerate(rows) if r in self.saved_logits
        }

    @torch.no_grad()
    def retract(self, row: int, n_tokens: int) -> None:
        """Take back the row's latest turn of n_tokens: its pending last token is dropped and the
        others are masked out (they become holes); its next-token logits return to what they were
        before the turn."""
        n_fed = n_tokens - len(self.pending[row])
        self.pending[row] = []
        kept = len(self.real_slots[row]) - n_fed
        slots = self.real_slots[row][kept:]
        del self.real_slots[row][kept:]
        self.mask[row, slots] = 0
        self.length[row] -= n_fed
        self.last_logits[row] = self.saved_logits[row]


def pad_rows(rows: list[list], fill, dtype, device) -> torch.Tensor:
    """[N, T] tensor of right-padded rows, T = the longest row."""
    width = max(map(len, rows), default=0)
    padded = [list(r) + [fill] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=dtype, device=device).reshape(len(rows), width)


# logits per chunk of token_logprobs (positions x vocabulary): 32 MB in fp32, 55 positions of
# Qwen3's 151,936-token vocabulary, every position of the tiny model's batches
LOGPROB_CHUNK = 2**23


def token_logprobs(
    model, seqs: list[list[int]], pad_id: int, temperature: float, device, chunk=LOGPROB_CHUNK
) -> torch.Tensor:
    """[B, T] log-probs of each token given the ones before it, at the sampling temperature, of
    the right-padded sequences (column 0 and padded positions are 0).

    No full-vocabulary tensor of the batch: a hook takes the output head's input (the final hidden
    states) and leaves the head the last position only; chunked_logprobs then applies the head to
    the real positions `chunk` logits at a time. Memory: a few chunks (x 4 bytes), where the
    logits of every position, an fp32 copy, a divided copy and a full log_softmax took B x T x V
    x 8 bytes, 12 with backward (111 GiB for 8 rows of 8k tokens at Qwen3's vocabulary).

    The model's own logits of the last position must equal the head's: a model that changes its
    logits after the head (Gemma's soft-capping, a logit scale) fails this check and is scored
    from its full logits instead (the plain path, with a warning; `model._rti_full_logits`).

    No attention mask: under causal attention a real token never sees the pads after it, so the
    pads (whatever their id) change nothing, and SDPA can run its faster causal kernel."""
    ids = pad_rows(seqs, pad_id, torch.long, device)
    lengths = torch.tensor([len(s) for s in seqs], device=device)
    # needed[b, t]: token t + 1 of row b is real, so its log-prob given tokens 0..t is wanted
    needed = torch.arange(1, ids.shape[1], device=device) < lengths[:, None]
    head = model.get_output_embeddings()
    if head is None or getattr(model, "_rti_full_logits", False):
        logits = model(input_ids=ids, use_cache=False).logits
        return logprobs_from_logits(logits, ids, needed, temperature)
    inputs = []
    hook = head.register_forward_pre_hook(partial(keep_head_input, inputs))
    try:
        out = model(input_ids=ids, use_cache=False)
    finally:
        hook.remove()
    if not head_gives_logits(head, inputs, out.logits, ids.shape):
        warnings.warn(
            f"{type(model).__name__} changes its logits after the output head: its log-probs "
            "come from its full logits (B x T x V in memory)",
            stacklevel=2,
        )
        model._rti_full_logits = True
        logits = model(input_ids=ids, use_cache=False).logits
        return logprobs_from_logits(logits, ids, needed, temperature)
    if ids.numel() * head.weight.shape[0] <= chunk:
        # the batch fits one chunk (the tiny model's do): the head runs on every position, as in
        # the model's own forward, for the same values and gradients bit for bit
        return logprobs_from_logits(head(inputs[0]), ids, needed, temperature)
    hidden = inputs[0][:, :-1][needed]
    values = chunked_logprobs(head, hidden, ids[:, 1:][needed], temperature, chunk)
    logp = torch.zeros(needed.shape, dtype=values.dtype, device=device)
    return F.pad(logp.masked_scatter(needed, values), (1, 0))


def keep_head_input(inputs: list, head, args: tuple) -> tuple:
    """Forward pre-hook of the output head: keep its input [B, T, H] in `inputs`, and pass the
    head the last position only (its logits are token_logprobs' check)."""
    inputs.append(args[0])
    return (args[0][:, -1:],) + args[1:]


@torch.no_grad()
def head_gives_logits(head, inputs: list, logits: torch.Tensor, shape) -> bool:
    """Whether the head's input was caught once, at every position of the batch, and the model's
    logits of the last position are the head's output, bit for bit."""
    if len(inputs) != 1 or inputs[0].shape[:2] != shape or logits.shape[1] != 1:
        return False
    return torch.equal(logits.float(), head(inputs[0][:, -1:]).float())


def logprobs_from_logits(logits, ids: torch.Tensor, needed: torch.Tensor, temperature: float):
    """token_logprobs from the logits of every position [B, T, V]: the plain form, B x T x V x 8
    bytes (a model whose logits are not its head's, a batch that fits one chunk)."""
    logits = logits[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return F.pad(torch.where(needed, logp, 0.0), (1, 0))


def chunked_logprobs(
    head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, chunk=LOGPROB_CHUNK
) -> torch.Tensor:
    """[N] log-probs of targets [N] after hidden states [N, H], at temperature T, a slice of
    max(1, chunk // V) rows at a time (V: the vocabulary, the head's output size):

        log pi(y | h) = z_y / T - logsumexp(z / T),   z = head(h)

    With gradients on, each slice runs under activation checkpointing, so backward too holds one
    slice's logits at a time (it computes them again: one more head forward)."""
    rows = max(1, chunk // head.weight.shape[0])
    grad = torch.is_grad_enabled() and hidden.requires_grad
    out = []
    # one slice at least: with no position to score the result still depends on the model (an
    # empty micro-batch's backward must reach every layer, for FSDP's collectives)
    for start in range(0, max(1, hidden.shape[0]), rows):
        part = (head, hidden[start : start + rows], targets[start : start + rows], temperature)
        if grad:
            out.append(checkpoint(slice_logprobs, *part, use_reentrant=False))
        else:
            out.append(slice_logprobs(*part))
    return torch.cat(out)


def slice_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    """One slice of chunked_logprobs: log_softmax of the fp32 logits over the vocabulary, at the
    targets (a temperature of 1 divides nothing: the same values, one copy fewer)."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)


# ----------------------------------------------------------------------------- chat rendering


class Chat:
    """Token ids of the pieces of a multi-turn chat, rendered through the tokenizer's own chat
    template (token-in, token-out).

    A training sequence is prompt_ids(first message) + [agent ids ... eos] +
    turn_ids(observation) + [agent ...] ... The agent's ids are kept exactly as sampled; only
    prompt and observation text is tokenized. Here an observation is a user message and an action
    is the turn's text (the tiny model); extras/chat_tools.py's ToolChat renders templates that
    take tools (Qwen3): actions as tool calls, observations as tool messages."""

    MARK = "\x00MSG\x00"
    REPLY = "\x00REPLY\x00"

    def __init__(self, tok, env: str = "navigation"):
        self.tok = tok
        self.env_cls = envs.env_class(env)
        self.eos_id = tok.eos_token_id
        first_message = self.render([{"role": "user", "content": self.MARK}])
        self.prompt_pre, self.prompt_post = first_message.split(self.MARK)
        self.turn_pre, self.turn_post = self.after_turn("user")

    def render(self, messages: list[dict]) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def after_turn(self, role: str) -> list[str]:
        """The template's text after an agent turn's eos, around the next `role` message.

        Past turns are never re-rendered, so a template that renders history differently (Qwen3
        drops past turns' empty think blocks) still gives the tokens the model saw."""
        eos = self.tok.eos_token
        turn = self.render(
            [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": self.REPLY},
                {"role": role, "content": self.MARK},
            ]
        )
        end = turn.find(eos, turn.find(self.REPLY))
        if self.REPLY not in turn or end < 0:
            raise ValueError(
                f"chat template does not close an assistant turn with the eos token {eos!r}"
            )
        return turn[end + len(eos) :].split(self.MARK)

    def ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False).input_ids

    def prompt_ids(self, content: str) -> list[int]:
        return self.ids(self.prompt_pre + content + self.prompt_post)

    def turn_ids(self, content: str, role: str | None = None) -> list[int]:
        """Ids after the agent's eos: the next observation (`role`: the env's observation_role),
        then the assistant header."""
        return self.ids(self.turn_pre + content + self.turn_post)

    def text(self, agent_ids: list[int]) -> str:
        """An agent turn as text, without its eos and special tokens."""
        ids = [i for i in agent_ids if i != self.eos_id]
        return self.tok.decode(ids, skip_special_tokens=True).strip()

    def action_text(self, agent_ids: list[int]) -> str:
        """The env action a turn performs (its text here; ToolChat parses its tool call)."""
        return self.text(agent_ids)

    def action_ids(self, action: str) -> list[int]:
        """Ids of a turn (without eos) that performs `action`."""
        return self.ids(action)


# ----------------------------------------------------------------------------- model and tokenizer

SPECIAL = ["<pad>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>", "<|im_end|>"]
# compact: a turn costs 2 marker tokens plus the agent's eos (14 tokens a Navigation turn)
TINY_TEMPLATE = (
    "{% for m in messages %}{% if not loop.first %} {% endif %}"
    "<|{{ m['role'] }}|> {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %} <|im_end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %} <|assistant|>{% endif %}"
)


def load_model(
    path_or_tiny: str, seed: int = 0, dtype: torch.dtype = torch.float32, env: str = "navigation"
):
    """(model, tokenizer). `tiny` builds both from scratch: a word-level tokenizer over the words
    of `env` and of intervene's prompts, with a chat template, and build_tiny_model. A directory
    loads any local Hugging Face causal LM (nothing is downloaded). A model on transformers' SDPA
    attention gets sdpa_shared_kv: the same values, faster in decoding sessions on the CPU."""
    if path_or_tiny == "tiny":
        tok = build_tiny_tokenizer(env)
        model = build_tiny_model(len(tok), seed).to(dtype)
    elif not Path(path_or_tiny).is_dir():
        raise FileNotFoundError(
            f"model directory {path_or_tiny!r} not found (nothing is downloaded)"
        )
    else:
        tok = AutoTokenizer.from_pretrained(path_or_tiny, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            path_or_tiny, local_files_only=True, dtype=dtype
        )
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
    if model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(SDPA_SHARED_KV)
    return model, tok


def build_tiny_tokenizer(env: str = "navigation") -> PreTrainedTokenizerFast:
    """A word-level tokenizer: one id per word of SPECIAL, the env's vocabulary and intervene's
    prompt words, in that order (the committed checkpoints depend on it)."""
    vocab = {}
    for word in SPECIAL + envs.env_class(env).vocabulary() + intervene.PROMPT_WORDS:
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        chat_template=TINY_TEMPLATE,
    )


def build_tiny_model(vocab_size: int, seed: int = 0) -> Qwen3ForCausalLM:
    """A 0.8M-parameter Qwen3: hidden 128, 4 layers, 4 heads, 2 KV heads, head_dim 32, 2,048
    positions, tied embeddings; weights drawn from `seed`."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=SPECIAL.index("<|im_end|>"),
    )
    return Qwen3ForCausalLM(config)


# ----------------------------------------------------------------------------- where the model runs


class Backend:
    """One process, fp32 on the CPU: where the model runs, the one thing the loop asks.

    extras/scale.py subclasses it for GPUs, bf16, LoRA, gradient checkpointing, chat templates with
    tools and FSDP2 across torchrun processes. With one process the collective methods return
    their input and a process's share of a batch is the whole batch."""

    rank = 0
    world = 1
    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def gathered(self, model):
        """A context that holds the full weights for a stretch of inference (FSDP gathers them)."""
        return nullcontext()

    def all_reduce(self, x: float, op: str = "sum") -> float:
        """x summed (or maxed) over processes."""
        return x

    def reduce_metrics(self, metrics: dict) -> dict:
        """A step's metrics combined over processes."""
        return metrics

    def my_tasks(self, tasks: list) -> list:
        """This process's share of a batch, whole groups."""
        return tasks

    def prepare(self, model, tok, env: str) -> tuple:
        """The loaded model ready to train, and the Chat that renders its turns."""
        return model.to(self.device, self.dtype), Chat(tok, env)

    def evaluate(self, sampler: Sampler, tasks: list, n: int, seed: int):
        """(summary, per-task successes) of the policy on `tasks` (evaluate_policy)."""
        return evaluate_policy(sampler, tasks, n, seed=seed, per_task=True)

    def save_checkpoint(self, path: Path, sampler: Sampler, opt, state: dict) -> None:
        """Model, optimizer and `state` in one file, written atomically."""
        tmp = path.with_suffix(".tmp")
        torch.save(
            {"model": sampler.model.state_dict(), "optimizer": opt.state_dict(), **state}, tmp
        )
        os.replace(tmp, path)

    def load_checkpoint(self, path: Path, sampler: Sampler, opt) -> dict:
        """Restore model and optimizer from `path`; return the saved state."""
        if not path.exists():
            raise FileNotFoundError(f"--resume: no checkpoint at {path}")
        state = torch.load(path, weights_only=False)
        sampler.model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        return state

    def save_model(self, sampler: Sampler, path: Path) -> None:
        """The trained model and its tokenizer, loadable by load_model."""
        sampler.model.save_pretrained(path)
        sampler.tok.save_pretrained(path)


# ----------------------------------------------------------------------------- the training loop


def train(cfg: Config, log=print, backend: Backend | None = None) -> dict:
    """The training loop: `cfg.steps` calls of train_step, with evaluations, a metrics log and
    checkpoints. Returns the test metrics {"before", "after"} (evaluate.summarize), the run's
    intervention statistics and the sampler. With several processes each runs it on its share of
    every batch; process 0 logs and writes."""
    cfg.validate()  # the command line's errors for a config built in Python (make_config)
    backend = backend or Backend(cfg)
    seed_everything(cfg.seed, cfg.threads)
    main_process = backend.rank == 0
    if not main_process:
        log = silent
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl" if main_process else None
    checkpoint = out / "ckpt.pt"

    sampler = init_sampler(cfg, backend)
    trainable = [p for p in sampler.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    train_tasks = envs.env_tasks(cfg.env, cfg.train_split)
    test_tasks = envs.env_tasks(cfg.env, cfg.test_split)[: cfg.eval_tasks]
    task_rng = random.Random(cfg.seed)

    def draw_tasks() -> list:
        """This process's share of a batch of training tasks, drawn from the run's task order."""
        return backend.my_tasks(task_rng.sample(train_tasks, cfg.batch_tasks))

    results = {}
    progress = Progress()
    if cfg.resume:
        progress = load_checkpoint(backend, checkpoint, sampler, opt, task_rng)
        log(f"resumed from {checkpoint} at step {progress.step}")
        truncate_metrics(metrics_path, progress.step)  # the rows past the checkpoint come again
    else:
        truncate_metrics(metrics_path, 0)
        if cfg.eval_tasks and cfg.eval_before:
            results["before"], results["before_tasks"] = run_test(
                backend, sampler, test_tasks, cfg, progress
            )
            log(f"before training: test p@1 {results['before']['p@1']:.2f}")
            log_test(metrics_path, 0, results["before"])

    bar = tqdm(
        range(progress.step, cfg.steps),
        desc=f"{cfg.method} training",
        disable=not (cfg.progress and main_process),
        file=sys.stderr,
    )
    for step in bar:
        tasks = draw_tasks()
        start = time.time()
        for group in opt.param_groups:  # a function of the step alone: --resume needs no state
            group["lr"] = learning_rate(step, cfg)
        step_seed = cfg.seed * envs.SEED_STRIDE + step
        metrics = train_step(sampler, opt, tasks, cfg, step_seed, backend, draw_tasks)
        metrics["step"] = step + 1
        metrics["time/step"] = time.time() - start
        progress.add(metrics)
        metrics.update(progress.totals())
        evaluate_now = cfg.eval_every and (step + 1) % cfg.eval_every == 0
        if evaluate_now and cfg.eval_tasks and step + 1 < cfg.steps:
            summary = run_test(backend, sampler, test_tasks, cfg, progress)[0]
            metrics.update({f"test/{k}": v for k, v in summary.items()})
        append_metrics(metrics_path, metrics)
        bar.set_postfix(
            success=f"{metrics['train_success']:.2f}", loss=f"{metrics.get('loss', 0):.3f}"
        )
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            save_checkpoint(backend, checkpoint, sampler, opt, task_rng, progress, cfg)

    if cfg.method == "rti":
        results["interventions"] = evaluate.run_totals(progress.rti_steps)
    if cfg.eval_tasks:
        results["after"], results["after_tasks"] = run_test(
            backend, sampler, test_tasks, cfg, progress
        )
        log_test(metrics_path, cfg.steps, results["after"])
    results["seconds"] = {
        "evaluation": progress.eval_seconds,
        "rollout": progress.rollout_seconds,
        "intervention": progress.intervene_seconds,
        "update": progress.update_seconds,
    }
    if cfg.eval_tasks and main_process:
        run = {"config": dataclasses.asdict(cfg), **results}
        (out / "results.json").write_text(json.dumps(run))
    backend.save_model(sampler, out / "model")
    return {**results, "sampler": sampler}


def silent(*args, **kwargs) -> None:
    """The log of a process other than the first."""


def seed_everything(seed: int, threads: int) -> None:
    """Python's, NumPy's and torch's global generators, and torch's CPU threads."""
    torch.set_num_threads(threads)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def init_sampler(cfg: Config, backend: Backend) -> Sampler:
    """The policy to train: the tiny model from --init (the committed warm start by default), or
    --model PATH."""
    tiny_init = cfg.model == "tiny" and cfg.init
    if tiny_init and not (Path(cfg.init) / "config.json").exists():
        raise FileNotFoundError(
            f"--init {cfg.init!r} holds no checkpoint (the warm start: python -m extras.warmstart)"
        )
    model, tok = load_model(cfg.init if tiny_init else cfg.model, cfg.seed, backend.dtype, cfg.env)
    model, chat = backend.prepare(model, tok, cfg.env)
    sampler = Sampler(
        model,
        tok,
        cfg.temperature,
        cfg.top_p,
        cfg.max_turn_tokens,
        cfg.seed + backend.rank,
        cfg.micro_batch,
        cfg.env,
        chat=chat,
    )
    sampler.user = envs.env_class(cfg.env).make_user(cfg.user_model, sampler)
    return sampler


def learning_rate(step: int, cfg: Config) -> float:
    """--lr, ramped up linearly over the first --warmup-steps steps."""
    if not cfg.warmup_steps:
        return cfg.lr
    return cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps)


def run_test(backend: Backend, sampler: Sampler, tasks: list, cfg: Config, progress: Progress):
    """(summary, per-task successes) on the test tasks, on evaluation streams of their own; the
    time it takes goes to progress.eval_seconds."""
    start = time.time()
    result = backend.evaluate(sampler, tasks, cfg.eval_samples, cfg.seed + EVAL_SEED_OFFSET)
    progress.eval_seconds += time.time() - start
    return result


def truncate_metrics(path: Path | None, last_step: int) -> None:
    """Keep the metrics log's rows up to `last_step` (a fresh run keeps none)."""
    if path is None:
        return
    rows = path.read_text().splitlines() if last_step and path.exists() else []
    kept = [row for row in rows if json.loads(row)["step"] <= last_step]
    path.write_text("".join(row + "\n" for row in kept))


def append_metrics(path: Path | None, row: dict) -> None:
    """One JSON row of metrics.jsonl (None: this process does not log)."""
    if path is None:
        return
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def log_test(path: Path | None, step: int, summary: dict) -> None:
    """An evaluation's row of metrics.jsonl: the test metrics at `step`."""
    append_metrics(path, {"step": step, **{f"test/{k}": v for k, v in summary.items()}})


@dataclass
class Progress:
    """What a run has done so far, kept in its checkpoint: the steps taken, each step's
    intervention counts (for the run's statistics) and the compute spent."""

    step: int = 0
    rti_steps: list[dict] = field(default_factory=list)
    episodes: int = 0  # rollout episodes and RTI's continuations of corrected ones
    generated_tokens: int = 0  # tokens the policy sampled, in every role
    train_seconds: float = 0.0  # time in training steps, evaluations left out
    rollout_seconds: float = 0.0  # the parts of it: sampling,
    intervene_seconds: float = 0.0  # RTI's intervention,
    update_seconds: float = 0.0  # and the update
    eval_seconds: float = 0.0  # time in evaluations

    def add(self, metrics: dict) -> None:
        """Count a finished step (train_step's metrics, with "step" and "time/step")."""
        self.step = metrics["step"]
        self.rti_steps.append({k[4:]: v for k, v in metrics.items() if k.startswith("rti/")})
        self.episodes += metrics["sampled_episodes"] + metrics["continued_episodes"]
        self.generated_tokens += metrics["generated_tokens"]
        self.train_seconds += metrics["time/step"]
        self.rollout_seconds += metrics["time/rollout"]
        self.intervene_seconds += metrics["time/intervene"]
        self.update_seconds += metrics["time/update"]

    def totals(self) -> dict:
        """The compute so far, as metrics: the x-axes of a comparison at matched compute."""
        return {
            "total/episodes": self.episodes,
            "total/generated_tokens": self.generated_tokens,
            "time/train_total": self.train_seconds,
        }


def save_checkpoint(backend, path, sampler, opt, task_rng, progress: Progress, cfg) -> None:
    """Everything --resume needs to continue the run as if it had never stopped: weights,
    optimizer, the progress, and the task order's and the sampling generators' states."""
    state = {
        "progress": dataclasses.asdict(progress),
        "task_rng": task_rng.getstate(),
        "sample_rng": sampler.gen.get_state(),
        "torch_rng": torch.get_rng_state(),
        "config": dataclasses.asdict(cfg),
    }
    backend.save_checkpoint(path, sampler, opt, state)


def load_checkpoint(backend, path, sampler, opt, task_rng) -> Progress:
    """Restore what save_checkpoint wrote; return the run's progress."""
    state = backend.load_checkpoint(path, sampler, opt)
    task_rng.setstate(state["task_rng"])
    sampler.gen.set_state(state["sample_rng"])
    torch.set_rng_state(state["torch_rng"])
    return Progress(**state["progress"])


# ----------------------------------------------------------------------------- flags

FLAG_TYPES = {
    "int": int,
    "float": float,
    "str": str,
    "int | None": lambda s: None if s == "none" else int(s),
}


def flag_fields(cls) -> list[tuple[str | None, dataclasses.Field]]:
    """(name of the nested config or None, field) for every flag of a config class."""
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory):
            out += [(f.name, nested) for nested in dataclasses.fields(f.default_factory)]
        else:
            out.append((None, f))
    return out


def make_config(cls=Config, **flags):
    """A config from flat flag names, as the command line gives them:
    make_config(ppl_max=3, lr=1e-4) sets rti.ppl_max and lr."""
    owner = {f.name: parent for parent, f in flag_fields(cls)}
    unknown = set(flags) - set(owner)
    if unknown:
        raise TypeError(f"unknown config fields {sorted(unknown)}")
    nested = {}
    for f in dataclasses.fields(cls):
        if f.name in owner.values():
            own_flags = {k: v for k, v in flags.items() if owner[k] == f.name}
            nested[f.name] = f.default_factory(**own_flags)
    top = {k: v for k, v in flags.items() if owner[k] is None}
    return cls(**top, **nested)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Prints each flag's default after its help text, an empty string as ''."""

    def _get_help_string(self, action):
        if action.default == "" and "%(default)" not in (action.help or ""):
            return f"{action.help} (default: '')"
        return super()._get_help_string(action)


def build_parser(cls=Config, commands=("train", "eval"), prog="rti.py") -> argparse.ArgumentParser:
    """The command line of a config class: a flag per field, with the help text and choices of
    the field's metadata, grouped by the config that owns it; the description is the first line
    of the docstring of the module that defines `cls`."""
    module = sys.modules[cls.__module__]
    p = argparse.ArgumentParser(
        prog=prog,
        description=(module.__doc__ or "").strip().split("\n")[0],
        usage=f"python {prog} [{' | '.join(commands)}] [MODEL_DIR] [--flag VALUE ...]",
        formatter_class=HelpFormatter,
    )
    p.add_argument("command", nargs="?", default=commands[0], choices=commands, help="what to run")
    p.add_argument("path", nargs="?", help="a model directory, for the commands that read one")
    run_fields = {f.name for f in dataclasses.fields(Config)}
    groups = {None: p.add_argument_group("run (rti.py)")}
    if cls is not Config:
        groups[cls.__name__] = p.add_argument_group(f"{cls.__name__} ({prog.removeprefix('-m ')})")
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory):
            nested_module = f.default_factory.__module__
            groups[f.name] = p.add_argument_group(f"{f.name} ({nested_module}.py)")
    for parent, f in flag_fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        if parent is None and f.name not in run_fields:
            parent = cls.__name__  # a field the subclass adds
        if f.type in ("bool", bool):
            groups[parent].add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
            )
        else:
            groups[parent].add_argument(
                flag,
                type=FLAG_TYPES[f.type],
                default=f.default,
                choices=f.metadata.get("choices"),
                metavar=f.type.split()[0].upper() if "choices" not in f.metadata else None,
                help=help_text,
            )
    return p


def parse_args(argv=None, cls=Config, commands=("train", "eval"), prog="rti.py"):
    """(command, model directory given after it or None, validated config) from the command
    line; a bad flag exits naming it. The directory, if any, becomes --model (a model to
    evaluate)."""
    p = build_parser(cls, commands, prog)
    args = vars(p.parse_args(argv))
    command = args.pop("command")
    path = args.pop("path")
    if path:
        args.update(model=path, init="")
    try:
        cfg = make_config(cls, **args)
        cfg.validate()
    except ValueError as e:  # LossConfig and RTIConfig say "field: why"
        name, why = str(e).split(":", 1)
        if not name.startswith("--"):
            name = "--" + name.replace("_", "-")
        p.error(f"{name}:{why}")
    return command, path, cfg


# ----------------------------------------------------------------------------- commands


def report(cfg: Config, res: dict, seconds: float) -> str:
    """The demo's printout: the before/after table and the run's intervention statistics."""
    names = {"before": "warm start", "after": f"after {cfg.steps} steps"}
    rows = {names[k]: res[k] for k in ("before", "after") if k in res}
    lines = []
    if rows:
        lines.append(
            f"\n{cfg.method} on the {cfg.test_split} split "
            f"({cfg.eval_tasks} tasks x {cfg.eval_samples} samples):"
        )
        lines.append(evaluate.format_table(rows))
    if "interventions" in res:
        statistics = evaluate.intervention_report(res["interventions"])
        lines.append(f"\ninterventions over the run:\n{statistics}")
    if "seconds" in res:
        parts = ", ".join(f"{name} {t:.0f} s" for name, t in res["seconds"].items())
        lines.append(f"time: {parts}")
    lines.append(
        f"wall time {seconds:.0f} s; metrics in {cfg.out}/metrics.jsonl, model in {cfg.out}/model"
    )
    return "\n".join(lines)


def eval_table(cfg: Config, backend: Backend) -> str:
    """pass@1..4 and pass^1..4 of --model on the first --eval-tasks tasks of --test-split."""
    sampler = init_sampler(cfg, backend)
    tasks = envs.env_tasks(cfg.env, cfg.test_split)[: cfg.eval_tasks]
    summary = evaluate_policy(sampler, tasks, cfg.eval_samples, seed=cfg.seed)
    return evaluate.format_table({cfg.model: summary})


def main(argv=None) -> None:
    command, _, cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    start = time.time()
    if command == "eval":  # python rti.py eval MODEL_DIR [--test-split ... --eval-tasks N ...]
        print(eval_table(cfg, Backend(cfg)))
    else:
        print(report(cfg, train(cfg), time.time() - start))


if __name__ == "__main__":
    main()
