"""Rollout-Time Intervention (RTI) trainer: the algorithm, from its config to the training loop.

    python rti.py                        # the demo: tiny Qwen3 from its warm start, 8 RTI steps
    python rti.py eval runs/demo/model   # pass@1..4 and pass^1..4 of a saved model
    python rti.py --help                 # every flag, with its help text, default and choices

Read top-down: `Config` (what a run can set), `train_step` (one step: sample, intervene,
advantages, update), group sampling and `rollout`, the `update`, then the training loop `train`
and `main`. Data flows one way: envs.py (tasks, rubric) -> rollout here -> intervene.py (RTI) ->
loss.py -> AdamW. The policy (model, chat, sampler, KV-cached decoding, log-probs) is policy.py;
the run's settings, command line, metrics log and checkpoints are runtime.py. GPUs, LoRA and FSDP2
(extras/scale.py) plug in through `Backend`, the one object the loop asks where the model runs.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
import zlib
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers.utils import logging as transformers_logging

import envs
import evaluate
import intervene
import runtime
from intervene import RTIConfig, Stream
from loss import (
    POLICY,
    LossConfig,
    advantages_by_group,
    combine_metrics,
    group_rows,
    loss_metrics,
    policy_loss,
    require,
)
from policy import Chat, Sampler, load_model, pad_rows, token_logprobs
from runtime import WARMSTART_DIR  # noqa: F401 (rti.WARMSTART_DIR: the demo's warm start)

METHODS = ("grpo", "rti")
LOSS_DENOMINATORS = ("batch", "trained")
EVAL_SEED_OFFSET = 10_000  # evaluations sample on streams of their own, apart from training's


# ----------------------------------------------------------------------------- config


@dataclass
class Config(runtime.RunConfig):
    """The algorithm's settings, after the run's (runtime.RunConfig: model, seed, splits,
    evaluations, the run folder). Every field is a flag `--field-name` (booleans also
    `--no-field-name`), and so is every field of the nested `loss` (loss.py) and `rti`
    (intervene.py) configs; the help text of each sits beside it, in its metadata, and
    `python rti.py --help` prints it."""

    FLAG_GROUP = "algorithm"  # the title of its flags in --help (not a field: no annotation)
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
    lr: float = field(default=1e-4, metadata={"help": "AdamW learning rate"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    updates_per_batch: int = field(default=1, metadata={"help": "epochs over each rollout batch"})
    mini_batches: int = field(
        default=4,
        metadata={
            "help": "optimizer steps per epoch, each on a shuffled part of the batch; from the "
            "second one on, the ratio and the clip act"
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
    loss: LossConfig = field(default_factory=LossConfig)
    rti: RTIConfig = field(default_factory=RTIConfig)

    def validate(self) -> None:
        """The run's checks, then require() every field of the algorithm, the nested configs' too
        (loss.require: the message names the flag)."""
        super().validate()
        self.loss.validate()
        self.rti.validate()
        for name in (
            "batch_tasks",
            "max_turn_tokens",
            "updates_per_batch",
            "mini_batches",
            "max_sampling_rounds",
            "micro_batch",
        ):
            require(self, name, getattr(self, name) >= 1, "must be >= 1")
        for name in ("steps", "warmup_steps"):
            require(self, name, getattr(self, name) >= 0, "must be >= 0")
        for name in ("temperature", "lr", "grad_clip"):
            require(self, name, getattr(self, name) > 0, "must be > 0")
        require(self, "group_size", self.group_size >= 2, "must be >= 2 for group advantages")
        require(self, "top_p", 0 < self.top_p <= 1, "must be in (0, 1]")
        require(
            self,
            "group_size",
            self.rti.intervene_per_group <= self.group_size,
            "must be >= --intervene-per-group",
        )
        require(
            self.loss,
            "kl_coef",
            self.loss.kl_coef == 0,
            "the KL penalty needs a reference model's log-probs and this loop loads no reference "
            "model: use --kl-coef 0 (the default, as the paper's runs)",
        )


# ----------------------------------------------------------------------------- one training step


def train_step(
    policy: Sampler,
    opt,
    tasks: list,
    cfg: Config,
    seed: int | None = None,
    backend: Backend | None = None,
    draw_tasks: Callable[[], list] | None = None,
    method: Method | None = None,
) -> dict:
    """One step of GRPO or RTI (or of a `method` of extras/) on a batch of tasks; returns the
    step's metrics.

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
    group): advantages are taken group by group. `method` (default GRPO's and RTI's, `Method`)
    gives the rollout, the advantages and the loss."""
    backend = backend or Backend()
    method = method or Method()
    with backend.gathered(policy.model):  # processes run different numbers of forwards in here
        trajs, metrics = sample_batch(policy, tasks, cfg, seed, draw_tasks, method)
        sampled = time.time()
        advantages = method.advantages(policy, trajs, cfg)

    rewards = torch.tensor([t.reward for t in trajs])
    group_ids = [t.group for t in trajs]
    metrics["train_success_after_rti"] = float(rewards.mean())
    metrics["groups_with_spread"] = float(
        np.mean([has_spread([trajs[i] for i in rows]) for rows in group_rows(group_ids).values()])
    )

    trained = [i for i, teaches in enumerate(teaching(advantages)) if teaches]
    rows = trained if cfg.loss_denominator == "trained" else list(range(len(trajs)))
    if backend.all_reduce(len(trained)):  # with several processes, every one joins the update
        batch = [trajs[i] for i in rows]
        step = update(policy, opt, batch, advantages[rows], cfg, seed or 0, backend, method)
        metrics.update(step)
    metrics["time/update"] = time.time() - sampled
    metrics["trained_rows"] = len(trained)
    if cfg.method == "rti" and "tokens/trained" in metrics:
        # the reweighting's figures, summed over the run like the intervention's counts
        metrics.update({f"rti/{k}": v for k, v in evaluate.reweighting_counts(metrics).items()})
    metrics.update(method.metrics())
    return backend.reduce_metrics(metrics)


def teaching(advantages: torch.Tensor) -> list[bool]:
    """Whether each row's advantage (one a row [N], or one a token [N, T]) is non-zero anywhere:
    only those rows teach, and only they are run in the update."""
    nonzero = advantages != 0
    return (nonzero.any(-1) if nonzero.dim() > 1 else nonzero).tolist()


def sample_batch(
    policy: Sampler,
    tasks: list,
    cfg: Config,
    seed: int | None,
    draw_tasks: Callable[[], list] | None = None,
    method: Method | None = None,
) -> tuple[list[Trajectory], dict]:
    """Steps 1 and 2 of train_step: the batch to learn from, and what sampling it cost.

    Without --dynamic-sampling: one rollout of `tasks` (intervened with RTI). With it (DAPO's
    `filter_groups`): only groups whose rewards differ are kept, and rounds of new tasks from
    `draw_tasks()` are sampled until the batch holds len(tasks) of them (the extra ones of the
    last round are dropped) or --max-sampling-rounds rounds have run; the batch may then be short.
    Metrics: sampled and continued episodes, generated tokens (the policy's, every role included),
    rounds, the rollout's success, the share of its groups in which every episode failed (before
    any intervention: where GRPO learns nothing), and RTI's counts summed over the rounds. The
    rollout is `method`'s (default `rollout`)."""
    method = method or Method()
    target = len(tasks)
    rounds = cfg.max_sampling_rounds if cfg.dynamic_sampling else 1
    tokens_before = policy.generated_tokens
    sampled = []  # every rollout episode of every round
    groups = []  # the batch, group by group (dynamic sampling)
    counts = Counter()  # RTI's counts, summed over rounds
    n_failed = n_groups = 0  # the rollout's groups in which every episode failed, and all of them
    rollout_seconds = 0.0
    intervene_seconds = 0.0
    for round_index in range(rounds):
        if round_index > 0:
            tasks = draw_tasks()
        start = time.time()
        trajs = method.rollout(policy, tasks, cfg, round_seed(seed, round_index))
        rolled_out = time.time()
        sampled += trajs
        sampled_rows = group_rows([t.group for t in trajs])
        n_failed += len(intervene.failed_groups(trajs, sampled_rows))
        n_groups += len(sampled_rows)
        if cfg.method == "rti":
            trajs, round_counts = intervene.intervene_batch(policy, trajs, cfg.rti, policy.make_env)
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
        "groups_all_failed": n_failed / n_groups,
        "turns": float(np.mean([len(t.actions) for t in sampled])),
        # ints are summed over processes (Backend.reduce_metrics), floats averaged
        "sampled_episodes": len(sampled),
        "continued_episodes": int(counts.get("with_accepted", 0)),
        "generated_tokens": int(policy.generated_tokens - tokens_before),
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

    def step(self, chat: Chat, env: envs.Env, agent_ids, logp, source=POLICY) -> None:
        """Record an agent turn, execute its action in `env` and append what the model sees next:
        the observation's tokens, or, when the episode ends, the reward and the rubric. A turn cut
        off before its eos is closed with an eos that is not trained."""
        start = len(self.ids)
        self.add(agent_ids, 1, source, logp)
        if agent_ids[-1:] != [chat.eos_id]:
            self.add([chat.eos_id], 0, POLICY)
        self.turns.append((start, len(self.ids)))
        self.actions.append(chat.action_text(agent_ids))
        observation, done = env.step(self.actions[-1])
        if done:
            result = env.score()
            self.reward = float(result.success)
            self.rubric = dict(result.items)
            return
        self.observations.append(observation)
        self.add(chat.turn_ids(observation, env.observation_role), 0, POLICY)


def episode_seed(seed: int, task_id: str, j: int) -> int:
    """The sampling stream of sample j of a task: a function of (seed, task, j) alone, so an
    episode samples the same tokens whatever else shares its batch, on one process or several."""
    # 32 bits: torch's CPU generator seeds from the low 32
    return zlib.crc32(f"{seed}/{task_id}/{j}".encode())


def rollout(
    policy: Sampler, tasks: list, group_size: int, seed: int | None = None
) -> list[Trajectory]:
    """Sample B x G multi-turn episodes: sample j of task g starts from the env's first message
    on stream episode_seed(seed, task, j), and intervene.play runs them all in lockstep, one
    batched turn for every live episode at a time. `seed` None draws one from policy.gen."""
    policy.model.eval()
    if seed is None:
        seed = int(torch.randint(2**62, (1,), generator=policy.gen, device=policy.gen.device))
    starts = [
        start_episode(policy, task, g, episode_seed(seed, task.task_id, j))
        for g, task in enumerate(tasks)
        for j in range(group_size)
    ]
    trajs = [traj for traj, _ in starts]
    intervene.play(policy, trajs, [env for _, env in starts], [Stream(t.seed) for t in trajs])
    return trajs


def start_episode(policy: Sampler, task, group: int, seed: int) -> tuple[Trajectory, envs.Env]:
    """A new episode of `task` in `group`, on sampling stream `seed`, and its env: the env's first
    message as the prompt, no turn yet."""
    env = policy.make_env(task)
    traj = Trajectory(task, group, observations=[env.reset()], seed=seed)
    traj.add(policy.chat.prompt_ids(traj.observations[0]), 0, POLICY)
    return traj, env


def evaluate_policy(
    policy: Sampler,
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
        trajs = rollout(policy, tasks[i : i + tasks_per_chunk], n, seed)
        for g in range(0, len(trajs), n):
            successes.append([t.reward > 0 for t in trajs[g : g + n]])
    summary = evaluate.summarize(successes, k_max=min(4, n))
    return (summary, successes) if per_task else summary


# ----------------------------------------------------------------------------- the update


def update(
    policy: Sampler,
    opt,
    trajs: list[Trajectory],
    advantages: torch.Tensor,
    cfg: Config,
    seed: int = 0,
    backend: Backend | None = None,
    method: Method | None = None,
) -> dict:
    """PPO-style updates on one rollout batch; returns the update's metrics.

    pi_old's log-probs come from one scoring pass at the sampling temperature; then
    `updates_per_batch` epochs, each of `mini_batches` AdamW steps on shuffled parts of the batch
    (verl's ppo_mini_batch_size, TRL's steps_per_generation), so that from the second step on the
    ratio and the clip act. With a single step per batch pi_old is the policy being updated: its
    log-probs are that step's own forward pass (detached), and every ratio is 1.

    Each step accumulates gradients over micro-batches of --micro-batch rows; a micro-batch's loss
    is weighted by its share of the mini-batch's tokens (token-mean) or rows, so the shares add up
    to the mini-batch's loss. Rows whose advantage is 0 are never run (their loss is 0), but they
    count in that total (--loss-denominator batch passes them in). Metric `loss` is the mean of
    the steps' losses, `grad_norm` the last step's; the others are the micro-batches' figures
    joined (loss.combine_metrics). `advantages`: one a row [N], or one a token [N, T] (T at least
    the longest row); the loss is `method`'s (default loss.policy_loss)."""
    backend = backend or Backend()
    model = policy.model
    n_steps = cfg.updates_per_batch * cfg.mini_batches
    teaches = teaching(advantages)
    old_logp = None
    if n_steps > 1:
        rows = [r for r in range(len(trajs)) if teaches[r]]
        with backend.gathered(model):
            old_logp = dict(zip(rows, policy.score([trajs[r].ids for r in rows])))
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
            taught = [r for r in rows if teaches[r]]
            micro_batches = [
                taught[i : i + cfg.micro_batch] for i in range(0, len(taught), cfg.micro_batch)
            ]
            if cfg.loss.agg == "token-mean":
                total = sum(sum(trajs[r].loss_mask) for r in rows)
            else:
                total = len(rows)
            # several processes: the mini-batch is the global one (Backend.accumulation)
            total, micro_batches = backend.accumulation(total, micro_batches)
            opt.zero_grad(set_to_none=True)
            for idx in micro_batches:
                loss, size, figures = micro_batch_loss(
                    policy, trajs, advantages, old_logp, idx, cfg, method
                )
                share = size / total if total else 0.0
                (loss * share).backward()
                mean_loss += loss.item() * share / n_steps
                if idx:
                    metrics.append({"loss": loss.item(), **figures})
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
    out = combine_metrics(metrics)
    # with several processes each share carries the world size (Backend.accumulation)
    out["loss"] = backend.all_reduce(mean_loss) / backend.world
    if hasattr(grad_norm, "full_tensor"):  # a sharded (FSDP) norm
        grad_norm = grad_norm.full_tensor()
    out["grad_norm"] = float(grad_norm)
    return out


def micro_batch_loss(
    policy: Sampler,
    trajs: list[Trajectory],
    advantages: torch.Tensor,
    old_logp: dict[int, list[float]] | None,
    idx: list[int],
    cfg: Config,
    method: Method | None = None,
) -> tuple[torch.Tensor, int, dict]:
    """(loss.policy_loss of rows `idx` (or `method`'s loss), its size in the loss's unit: tokens
    under token-mean, else rows, loss.loss_metrics' figures). pi_old is old_logp's scores, or this
    forward pass's own (detached) when there is one step per batch. An empty `idx` runs one
    untrained pad row: a process with no rows left still joins every collective of a distributed
    backward."""
    device = policy.device
    pad = Trajectory(None, -1, [policy.tok.pad_token_id], [0], [POLICY], [0.0])
    micro = [trajs[r] for r in idx] or [pad]
    logp = token_logprobs(
        policy.model,
        [t.ids for t in micro],
        policy.tok.pad_token_id,
        policy.temperature,
        device,
    )
    mask = pad_rows([t.loss_mask for t in micro], 0, torch.float32, device)
    if old_logp is None:
        old = logp.detach()
    else:
        old = pad_rows([old_logp[r] for r in idx] or [[0.0]], 0, torch.float32, device)
    adv = advantages[idx] if idx else torch.zeros(1)
    if adv.dim() > 1:  # one a token: the micro-batch's width
        adv = adv[:, : logp.shape[1]]
    inputs = dict(
        logp=logp,
        old_logp=old,
        advantages=adv.to(device),
        loss_mask=mask,
        source=pad_rows([t.source for t in micro], 0, torch.long, device),
        behavior_logp=pad_rows([t.sample_logp for t in micro], 0, torch.float32, device),
        config=cfg.loss,
    )
    size = sum(sum(trajs[r].loss_mask) for r in idx) if cfg.loss.agg == "token-mean" else len(idx)
    loss, figures = (method or Method()).loss(inputs, cfg)
    return loss, size, figures


# ----------------------------------------------------------------------------- what a method changes


class Method:
    """The parts of a training step a method may replace: GRPO's and RTI's here (RTI's intervention
    follows the rollout in sample_batch). The baselines of extras/ (AEPO, LUFFY, OPD) subclass it
    and run `main(argv, their Config, their Method)`; train_step calls it once a step."""

    def rollout(self, policy: Sampler, tasks: list, cfg: Config, seed: int | None):
        """The groups of a batch: --group-size episodes of each task (`rollout`)."""
        return rollout(policy, tasks, cfg.group_size, seed)

    def advantages(self, policy: Sampler, trajs: list[Trajectory], cfg: Config) -> torch.Tensor:
        """One advantage a row [N]: group z-scores of the rewards (loss.advantages_by_group); a
        method may give one a token instead, [N, T] with T the longest row."""
        rewards = torch.tensor([t.reward for t in trajs])
        group_ids = [t.group for t in trajs]
        return advantages_by_group(rewards, group_ids, scale=cfg.loss.scale_advantages)

    def loss(self, inputs: dict, cfg: Config) -> tuple[torch.Tensor, dict]:
        """(the loss of a micro-batch, its figures) from loss.policy_loss's inputs."""
        return policy_loss(**inputs), loss_metrics(**inputs)

    def metrics(self) -> dict:
        """The method's own figures of the step just taken (a teacher's compute): ints add up over
        processes and in the run's totals."""
        return {}


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

    def gathered(self, model):
        """A context that holds the full weights for a stretch of inference (FSDP gathers them)."""
        return nullcontext()

    def all_reduce(self, x: float, op: str = "sum") -> float:
        """x summed (or maxed) over processes."""
        return x

    def accumulation(self, total: float, micro_batches: list[list[int]]) -> tuple:
        """(loss denominator, micro-batches) of a mini-batch's gradient accumulation on this
        process. Several processes: the denominator of the global mini-batch over the world size
        (their data-parallel gradients are averaged), and as many micro-batches as the busiest
        process runs (empty ones added, for the collectives)."""
        return total, micro_batches

    def reduce_metrics(self, metrics: dict) -> dict:
        """A step's metrics combined over processes."""
        return metrics

    def my_tasks(self, tasks: list) -> list:
        """This process's share of a batch, whole groups."""
        return tasks

    def prepare(self, model, tok, env: str) -> tuple:
        """The loaded model ready to train, and the Chat that renders its turns."""
        return model.to(self.device, self.dtype), Chat(tok, env)

    def evaluate(self, policy: Sampler, tasks: list, n: int, seed: int):
        """(summary, per-task successes) of the policy on `tasks` (evaluate_policy)."""
        return evaluate_policy(policy, tasks, n, seed=seed, per_task=True)

    def save_checkpoint(self, path: Path, policy: Sampler, opt, state: dict) -> None:
        """Model, optimizer and `state` in one file, written atomically."""
        tmp = path.with_suffix(".tmp")
        torch.save(
            {"model": policy.model.state_dict(), "optimizer": opt.state_dict(), **state}, tmp
        )
        tmp.replace(path)

    def load_checkpoint(self, path: Path, policy: Sampler, opt) -> dict:
        """Restore model and optimizer from `path`; return the saved state."""
        if not path.exists():
            raise FileNotFoundError(f"--resume: no checkpoint at {path}")
        state = torch.load(path, weights_only=False)
        policy.model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        return state

    def save_model(self, policy: Sampler, path: Path) -> None:
        """The trained model and its tokenizer, loadable by policy.load_model."""
        policy.model.save_pretrained(path)
        policy.tok.save_pretrained(path)


# ----------------------------------------------------------------------------- the training loop


def train(
    cfg: Config, log=print, backend: Backend | None = None, method: Method | None = None
) -> dict:
    """The training loop: `cfg.steps` calls of train_step, with evaluations, a metrics log and
    checkpoints. Returns the test metrics {"before", "after"} (evaluate.summarize; with
    --ood-split also "before_ood", "after_ood"), the run's intervention statistics and the policy
    ("sampler"). With several processes each runs it on its
    share of every batch; process 0 logs and writes. `method`: train_step's."""
    cfg.validate()  # the command line's errors for a config built in Python (make_config)
    backend = backend or Backend()
    runtime.seed_everything(cfg.seed, cfg.threads)
    main_process = backend.rank == 0
    if not main_process:
        log = runtime.silent
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl" if main_process else None
    checkpoint = out / "ckpt.pt"

    policy = init_policy(cfg, backend)
    trainable = [p for p in policy.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    train_tasks = envs.env_tasks(cfg.env, cfg.train_split)
    test_tasks = envs.env_tasks(cfg.env, cfg.test_split)[: cfg.eval_tasks]
    ood_tasks = envs.env_tasks(cfg.env, cfg.ood_split)[: cfg.eval_tasks] if cfg.ood_split else []
    task_rng = random.Random(cfg.seed)

    def draw_tasks() -> list:
        """This process's share of a batch of training tasks, drawn from the run's task order."""
        return backend.my_tasks(task_rng.sample(train_tasks, cfg.batch_tasks))

    results = {}
    progress = runtime.Progress()
    if cfg.resume:
        progress = runtime.load_checkpoint(backend, checkpoint, policy, opt, task_rng)
        log(f"resumed from {checkpoint} at step {progress.step}")
        runtime.truncate_metrics(metrics_path, progress.step)  # later rows come again
    else:
        runtime.truncate_metrics(metrics_path, 0)
        if cfg.eval_tasks and cfg.eval_before:
            results["before"], results["before_tasks"] = run_test(
                backend, policy, test_tasks, cfg, progress
            )
            log(f"before training: test p@1 {results['before']['p@1']:.2f}")
            runtime.log_test(metrics_path, 0, results["before"])
            if ood_tasks:
                results["before_ood"] = run_test(backend, policy, ood_tasks, cfg, progress)[0]
                runtime.log_test(metrics_path, 0, results["before_ood"], "ood")

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
        metrics = train_step(policy, opt, tasks, cfg, step_seed, backend, draw_tasks, method)
        metrics["step"] = step + 1
        metrics["time/step"] = time.time() - start
        progress.add(metrics)
        metrics.update(progress.totals())
        evaluate_now = cfg.eval_every and (step + 1) % cfg.eval_every == 0
        if evaluate_now and cfg.eval_tasks and step + 1 < cfg.steps:
            summary = run_test(backend, policy, test_tasks, cfg, progress)[0]
            metrics.update({f"test/{k}": v for k, v in summary.items()})
        runtime.append_metrics(metrics_path, metrics)
        bar.set_postfix(
            success=f"{metrics['train_success']:.2f}", loss=f"{metrics.get('loss', 0):.3f}"
        )
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            runtime.save_checkpoint(backend, checkpoint, policy, opt, task_rng, progress, cfg)

    if cfg.method == "rti":
        results["interventions"] = evaluate.run_totals(progress.rti_steps)
    if cfg.eval_tasks:
        results["after"], results["after_tasks"] = run_test(
            backend, policy, test_tasks, cfg, progress
        )
        runtime.log_test(metrics_path, cfg.steps, results["after"])
        if ood_tasks:
            results["after_ood"] = run_test(backend, policy, ood_tasks, cfg, progress)[0]
            runtime.log_test(metrics_path, cfg.steps, results["after_ood"], "ood")
    results["seconds"] = {
        "evaluation": progress.eval_seconds,
        "rollout": progress.rollout_seconds,
        "intervention": progress.intervene_seconds,
        "update": progress.update_seconds,
    }
    if cfg.eval_tasks and main_process:
        run = {"config": dataclasses.asdict(cfg), **results}
        (out / "results.json").write_text(json.dumps(run))
    backend.save_model(policy, out / "model")
    return {**results, "sampler": policy}


def init_policy(cfg: Config, backend: Backend) -> Sampler:
    """The policy to train: the tiny model from --init (the committed warm start by default), or
    --model PATH."""
    tiny_init = cfg.model == "tiny" and cfg.init
    if not cfg.progress:
        transformers_logging.disable_progress_bar()  # its "Loading weights" bar
    model, tok = load_model(cfg.init if tiny_init else cfg.model, cfg.seed, backend.dtype, cfg.env)
    model, chat = backend.prepare(model, tok, cfg.env)
    policy = Sampler(
        model,
        tok,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_turn_tokens=cfg.max_turn_tokens,
        seed=cfg.seed + backend.rank,
        micro_batch=cfg.micro_batch,
        env=cfg.env,
        chat=chat,
    )
    policy.user = envs.env_class(cfg.env).make_user(cfg.user_model, policy)
    return policy


def learning_rate(step: int, cfg: Config) -> float:
    """--lr, ramped up linearly over the first --warmup-steps steps."""
    if not cfg.warmup_steps:
        return cfg.lr
    return cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps)


def run_test(backend: Backend, policy: Sampler, tasks: list, cfg: Config, progress):
    """(summary, per-task successes) on `tasks`, on evaluation streams of their own; a split that
    mixes task families (a task's `family`) adds each family's figures ("keys/p@1", ...). The time it
    takes goes to progress.eval_seconds."""
    start = time.time()
    summary, successes = backend.evaluate(
        policy, tasks, cfg.eval_samples, cfg.seed + EVAL_SEED_OFFSET
    )
    progress.eval_seconds += time.time() - start
    return with_families(summary, tasks, successes), successes


def with_families(summary: dict, tasks: list, successes: list[list[bool]]) -> dict:
    """`summary` plus each task family's figures ("keys/p@1", ...) when `tasks` mix families (a
    task's `family`, as navigation-keys' have)."""
    families = [getattr(task, "family", "") for task in tasks]
    if len(set(families)) < 2:
        return summary
    k_max = min(evaluate.K_MAX, len(successes[0]))
    by_family = evaluate.summarize_by(families, successes, k_max)
    return {**summary, **{f"{f}/{k}": v for f, part in by_family.items() for k, v in part.items()}}


# ----------------------------------------------------------------------------- commands


def report(cfg: Config, res: dict, seconds: float) -> str:
    """The demo's printout: the before/after table and the run's intervention statistics."""
    names = {
        "before": "warm start",
        "after": f"after {cfg.steps} steps",
        "before_ood": f"warm start, {cfg.ood_split}",
        "after_ood": f"after {cfg.steps} steps, {cfg.ood_split}",
    }
    rows = {names[k]: res[k] for k in names if k in res}
    lines = []
    if rows:
        lines.append(
            f"\n{cfg.method} on the {cfg.test_split} split "
            f"({cfg.eval_tasks} tasks x {cfg.eval_samples} samples):"
        )
        lines.append(report_table(rows))
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


def report_table(rows: dict[str, dict]) -> str:
    """evaluate.format_table of `rows`, each followed by a row per task family it has figures of
    ("keys/p@1", ...: with_families)."""
    table = {}
    for name, summary in rows.items():
        table[name] = summary
        for family in dict.fromkeys(k.split("/")[0] for k in summary if "/" in k):
            part = {k.split("/", 1)[1]: v for k, v in summary.items() if k.startswith(family + "/")}
            table[f"{name}, {family} tasks"] = part
    return evaluate.format_table(table)


def eval_table(cfg: Config, backend: Backend) -> str:
    """pass@1..4 and pass^1..4 of --model on the first --eval-tasks tasks of --test-split."""
    policy = init_policy(cfg, backend)
    tasks = envs.env_tasks(cfg.env, cfg.test_split)[: cfg.eval_tasks]
    summary, successes = evaluate_policy(policy, tasks, cfg.eval_samples, cfg.seed, per_task=True)
    return report_table({cfg.model: with_families(summary, tasks, successes)})


def build_parser():
    """rti.py's command line: a flag per field of Config (runtime.build_parser)."""
    return runtime.build_parser(Config)


def main(argv=None, config=Config, method=Method, prog="rti.py", defaults=None) -> None:
    """The command line of rti.py, or of a baseline of extras/: its `config` class, its `method`
    class, its `prog` and the flags' `defaults` it sets (runtime.build_parser)."""
    command, _, cfg = runtime.parse_args(argv, config, prog=prog, defaults=defaults)
    torch.set_num_threads(cfg.threads)
    start = time.time()
    if command == "eval":  # python rti.py eval MODEL_DIR [--test-split ... --eval-tasks N ...]
        print(eval_table(cfg, Backend()))
    else:
        print(report(cfg, train(cfg, method=method()), time.time() - start))


if __name__ == "__main__":
    main()
