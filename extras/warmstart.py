"""The supervised warm start of the tiny Navigation policy; optional (extras/): its result is
committed.

    python -m extras.warmstart    # rebuild checkpoints/warmstart-evidence (the demo's start)
    python -m extras.warmstart --ws-evidence-frac 0 --ws-out checkpoints/warmstart   # hint only
    python -m extras.warmstart report --train-split fit --test-split val   # p@1, all-fail groups

The tiny model learns from a teacher's successful episodes on the `easy` split: next-token loss on
the agent's actions plus an auxiliary loss on observation tokens (with actions alone a
from-scratch model stalls). The teacher sees the map and walks shortest paths; it starts only
`ws_route_frac` of legs with the route tool (then follows the route), so the policy rarely calls
the tool by itself: that is the capability boundary RL has to cross. In `ws_hint_frac` of turns
the teacher is shown the `<hint> ... </hint>` block a self-corrector sees and does what it says
(`route` when it holds none), so the policy learns from the start to follow a hint and a route.
In `ws_evidence_frac` of those blocks it is shown the grader's evidence instead (the rest of a
shortest path) and, holding no route, copies the path's first move in `ws_copy_frac` of them: the
policy, as a corrector shown the evidence, then writes rewrites the agent's context justifies and
rewrites it cannot (leaked), and the post-check has something to catch.
RL itself (rti.py) trains agent tokens only.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers.utils import logging as transformers_logging

import envs
import intervene
import loss
import rti
import runtime
from loss import group_rows
from policy import Chat, load_model, pad_rows


@dataclass
class WarmStartConfig(rti.Config):
    """rti.Config (model, seed, threads, grad_clip, progress, env: whose vocabulary the tiny
    tokenizer holds; the `report` command's sampling and evaluation flags) plus the warm start's
    flags; every field is a flag."""

    init: str = field(
        default="",
        metadata={"help": "unused: the warm start trains a tiny model from its random weights"},
    )

    ws_split: str = field(
        default="easy",
        metadata={
            "help": "Navigation split of the teacher's episodes ('fit': train without val; with"
            " --ws-env-tasks, --env's split of that name)",
            "choices": tuple(envs.Navigation.splits()),
        },
    )
    ws_env_tasks: bool = field(
        default=False,
        metadata={
            "help": "draw the episodes from --env's own --ws-split (navigation-keys: its keys tasks"
            " too), not Navigation's: a teacher of the family (python -m extras.teacher), never a"
            " warm start, which must not see it"
        },
    )
    ws_steps: int = field(default=700, metadata={"help": "optimizer steps of the warm start"})
    ws_batch: int = field(default=32, metadata={"help": "teacher episodes per step"})
    ws_lr: float = field(
        default=3e-3,
        metadata={"help": "AdamW learning rate: 50 warm-up steps, then cosine decay to 0"},
    )
    ws_hint_frac: float = field(
        default=0.3,
        metadata={
            "help": "share of teacher turns with the corrector's hint block before the action"
        },
    )
    ws_route_frac: float = field(
        default=0.05,
        metadata={
            "help": "share of legs the teacher starts with the route tool (1: the oracle's "
            "episodes)"
        },
    )
    ws_evidence_frac: float = field(
        default=0.5,
        metadata={
            "help": "share of hint blocks that show the grader's evidence (the rest of a shortest"
            " path) instead of the hint, as --corrector-sees evidence does"
        },
    )
    ws_copy_frac: float = field(
        default=0.5,
        metadata={
            "help": "shown the evidence while holding no route, the share of turns the teacher"
            " copies the path's first move instead of calling `route`: a corrector that can leak"
        },
    )
    ws_follow_frac: float = field(
        default=0.0,
        metadata={
            "help": "share of hint blocks whose 'do' names a random phrase of the tokenizer's words"
            " (never a tool call of --env), which the teacher writes (an unknown action; it then"
            " goes on): a corrector that writes whatever action its note names, as an instruction-following"
            " policy does, even one it has never written as the agent"
        },
    )
    ws_follow_tools: bool = field(
        default=False,
        metadata={
            "help": "the phrase a --ws-follow-frac note names is one of --env's tool calls that"
            " Navigation lacks (navigation-keys: `find key`) instead of a random one: the policy"
            " learns to write the tool when a note names it, as an LLM agent knows a tool from its"
            " schema, and never sees a task that needs it"
        },
    )
    ws_obs_weight: float = field(
        default=1.0,
        metadata={"help": "weight of the auxiliary next-token loss on observation tokens"},
    )
    ws_out: str = field(
        default=rti.WARMSTART_DIR,
        metadata={
            "help": "directory the warm-started model is saved to (and `report` reads by default)"
        },
    )

    def validate(self) -> None:
        loss.require(
            self,
            "ws_split",
            self.ws_split in envs.Navigation.splits(),
            f"must be a Navigation split: {envs.Navigation.splits()}",
        )
        env_splits = envs.env_class(self.env).splits()
        loss.require(
            self,
            "ws_split",
            not self.ws_env_tasks or self.ws_split in env_splits,
            f"with --ws-env-tasks, must be a split of --env {self.env}: {env_splits}",
        )
        loss.require(
            self,
            "ws_steps",
            self.ws_steps >= 1 and self.ws_batch >= 1,
            "ws_steps and ws_batch must be >= 1",
        )
        loss.require(self, "ws_lr", self.ws_lr > 0, "must be > 0")
        loss.require(self, "ws_hint_frac", 0 <= self.ws_hint_frac <= 1, "must be in [0, 1]")
        loss.require(self, "ws_route_frac", 0 <= self.ws_route_frac <= 1, "must be in [0, 1]")
        for name in ("ws_evidence_frac", "ws_copy_frac", "ws_follow_frac"):
            loss.require(self, name, 0 <= getattr(self, name) <= 1, "must be in [0, 1]")
        loss.require(
            self,
            "ws_follow_tools",
            not self.ws_follow_tools or bool(new_tool_calls(self.env)),
            f"--env {self.env} has no tool call that Navigation lacks",
        )
        super().validate()


COMMANDS = ("warmstart", "report")
PROG = "-m extras.warmstart"


def teacher_sequence(
    chat: Chat,
    task,
    rng: random.Random,
    hint_frac: float,
    obs_weight: float,
    route_frac: float,
    evidence_frac: float = 0.0,
    copy_frac: float = 0.0,
    follow_frac: float = 0.0,
    words: tuple[str, ...] = (),
    banned: frozenset[str] = frozenset(),
    phrases: tuple[str, ...] = (),
):
    """Token ids and per-token loss weights of a teacher's successful episode for `task`.

    The teacher sees the map and plays the task's own env (envs.player): it walks shortest paths,
    starting a share `route_frac` of legs with the `route` tool, following a route it holds and
    calling any other tool the state asks for (navigation-keys: `find key` after a locked door);
    on a routed leg it calls `route` again whenever it holds none (after a key spent the route).
    A share `hint_frac` of turns carries the hint block a self-corrector will see
    (intervene.format_hint) at the end of the user message, and the teacher does what it says
    (calls `route` when it holds none), so the policy learns both to follow a hint and, rarely, to
    call the tool. Agent tokens weigh 1, observation tokens
    `obs_weight` (an auxiliary loss: with actions alone a from-scratch model stalls), hint tokens
    0. A share `evidence_frac` of the hint blocks show the grader's evidence instead of the hint
    (intervene.corrector_note); holding no route, the teacher then copies the path's first move in
    a share `copy_frac` of them and calls `route` in the others, so the policy, as a corrector
    shown evidence, sometimes writes a step its context cannot justify. A share `follow_frac` of
    the hint blocks name a random phrase of 1-3 `words`, never one of `banned` (or one of
    `phrases`, if given), instead of the action (follow_note); the teacher writes it (the env
    answers 'error unknown action' and the teacher goes on): the policy learns to write what its
    note names.
    """
    env = envs.player(task)(replace(task, max_turns=envs.MAX_NUMBER))
    content = env.reset()
    ids = []
    weights = []
    leg = -1  # the leg (waypoints visited) the teacher last acted on
    routed = False  # whether the teacher calls `route` on this leg when it holds no route
    n_post = len(chat.ids(chat.turn_post))
    while not env.done:
        piece = chat.prompt_ids if env.turns == 0 else chat.turn_ids
        plain = piece(content)
        w = [obs_weight] * len(plain)
        best = env.optimal_action()
        new_leg = leg < env.visited
        if new_leg:
            routed = False
        if rng.random() < hint_frac:
            # the hint of a step check that flags a random wrong action
            wrong = rng.choice([a for a in envs.ACTIONS if not env.check_step(a).valid])
            case = intervene.StepUnderReview(None, env, wrong, env.check_step(wrong).reason)
            action = best
            sees = "hint"
            if evidence_frac and rng.random() < evidence_frac:
                sees = "evidence"
                if best == "route" and rng.random() < copy_frac:
                    action = env.shortest_moves()[0]  # copied from the evidence: a leak
            note = intervene.corrector_note(case, sees)
            if follow_frac and rng.random() < follow_frac:
                action = rng.choice(phrases) if phrases else random_phrase(rng, words, banned)
                note = follow_note(case, sees, action)
            hinted = piece(content + " " + note)
            n_hint = len(hinted) - len(plain)
            w = [obs_weight] * len(hinted)
            w[len(hinted) - n_post - n_hint : len(hinted) - n_post] = [0.0] * n_hint
            plain = hinted
        elif best != "route":  # a held route's move, finish, or a tool the state asks for
            action = best
        else:
            if new_leg:
                routed = rng.random() < route_frac
            action = "route" if routed else env.shortest_moves()[0]
        leg = env.visited
        agent = chat.action_ids(action) + [chat.eos_id]
        ids += plain + agent
        weights += w + [1.0] * len(agent)
        content = env.step(action)[0]
    weights[0] = 0.0
    return ids, weights


def follow_note(case: intervene.StepUnderReview, sees: str, phrase: str) -> str:
    """The hint block of intervene.corrector_note with `phrase` as the action it names: the hint's
    'next A 1 4 do route' becomes 'next A 1 4 do PHRASE'; the evidence 'next A 1 4 path up' gets
    ' do PHRASE' after it (as a keys task's evidence names its tool)."""
    hint = case.env.hint()
    why = intervene.reason_without_hint(case)
    if sees == "hint" or case.env.evidence() == hint:  # the evidence hides nothing: the hint
        named = hint.removesuffix(case.env.optimal_action()) + phrase
    else:
        named = f"{case.env.evidence()} do {phrase}"
    return intervene.format_hint(why, named)


def new_tool_calls(env: str) -> tuple[str, ...]:
    """The tool calls of `env` that plain Navigation lacks (navigation-keys: 'find key')."""
    navigation = set(envs.Navigation.TOOL_CALLS)
    return tuple(a for a in envs.env_class(env).TOOL_CALLS if a not in navigation)


def random_phrase(rng: random.Random, words: tuple[str, ...], banned: frozenset[str]) -> str:
    """1 to 3 words drawn uniformly from `words`, e.g. 'key 7 up', redrawn while one of
    `banned`."""
    while True:
        phrase = " ".join(rng.choice(words) for _ in range(rng.randint(1, 3)))
        if phrase not in banned:
            return phrase


def lr_factor(step: int, steps: int) -> float:
    """The learning-rate schedule of the warm start: 50 warm-up steps, then cosine decay to 0 at
    `steps`."""
    warmup = min(1.0, (step + 1) / 50)
    return warmup * 0.5 * (1 + math.cos(math.pi * min(step, steps) / max(1, steps)))


def warmstart(cfg: WarmStartConfig, log=print):
    """Supervised warm start on optimal `easy` trajectories: weighted next-token cross-entropy
    sum_t w_t CE_t / sum_t w_t (teacher_sequence's weights); saves model + tokenizer to
    cfg.ws_out."""
    if not cfg.progress:
        transformers_logging.disable_progress_bar()  # its "Loading weights" and "Writing" bars
    model, tok = load_model(cfg.model, cfg.seed, env=cfg.env)
    chat = Chat(tok, cfg.env)
    tasks = envs.env_tasks(cfg.env if cfg.ws_env_tasks else "navigation", cfg.ws_split)
    # a followed phrase: any words of the tokenizer's env, never one of its tool calls
    env_cls = envs.env_class(cfg.env)
    words = tuple(w for w in env_cls.vocabulary() if w not in envs.SEPARATORS)
    banned = frozenset(env_cls.TOOL_CALLS)
    phrases = new_tool_calls(cfg.env) if cfg.ws_follow_tools else ()
    rng = random.Random(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.ws_lr, weight_decay=0.0)
    schedule = functools.partial(lr_factor, steps=cfg.ws_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    model.train()
    t0 = time.time()
    losses = []
    batches = []
    bar = tqdm(range(cfg.ws_steps), desc="warm start", disable=not cfg.progress, file=sys.stderr)
    for step in bar:
        if not batches:
            # draw 8 batches at once and group similar lengths: less padding, same data
            pool = [
                teacher_sequence(
                    chat,
                    rng.choice(tasks),
                    rng,
                    cfg.ws_hint_frac,
                    cfg.ws_obs_weight,
                    cfg.ws_route_frac,
                    cfg.ws_evidence_frac,
                    cfg.ws_copy_frac,
                    cfg.ws_follow_frac,
                    words,
                    banned,
                    phrases,
                )
                for _ in range(8 * cfg.ws_batch)
            ]
            pool.sort(key=lambda b: len(b[0]))
            batches = [pool[i : i + cfg.ws_batch] for i in range(0, len(pool), cfg.ws_batch)]
            rng.shuffle(batches)
        batch = batches.pop()
        ids = pad_rows([b[0] for b in batch], tok.pad_token_id, torch.long, model.device)
        mask = pad_rows([[1] * len(b[0]) for b in batch], 0, torch.long, model.device)
        w = pad_rows([b[1] for b in batch], 0.0, torch.float32, model.device)[:, 1:].reshape(-1)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        ce = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
        )
        loss = (ce * w).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 20 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
    model.save_pretrained(cfg.ws_out)
    tok.save_pretrained(cfg.ws_out)
    info = {
        "steps": cfg.ws_steps,
        "seconds": round(time.time() - t0, 1),
        "first_loss": (losses or [math.nan])[0],
        "last_loss": float(np.mean(losses[-20:] or [math.nan])),
        "config": dataclasses.asdict(cfg),
    }
    (Path(cfg.ws_out) / "warmstart.json").write_text(json.dumps(info, indent=1))
    log(
        f"warm start: {cfg.ws_steps} steps in {info['seconds']} s, "
        f"loss {info['first_loss']:.3f} -> {info['last_loss']:.3f}, saved to {cfg.ws_out}"
    )
    return model, tok, losses


def tool_use(trajs) -> dict:
    """What the policy does with the route tool, replayed from its episodes:
    `route_calls_per_leg` (calls over the legs it worked on), `legs_routed` (share of those legs
    with a call), `valid_with_route` (share of actions taken while holding a route that pass the
    step check) and `valid_without_route` (the same without one)."""
    calls = 0
    legs = 0
    routed = 0
    valid = {True: 0, False: 0}  # holding a route -> actions that pass the step check
    taken = {True: 0, False: 0}  # holding a route -> actions
    for t in trajs:
        env = envs.player(t.task)(t.task)
        legs_with_a_call = set()
        for action in t.actions:
            holding = bool(env.route)
            valid[holding] += env.check_step(action).valid
            taken[holding] += 1
            if action == "route":
                calls += 1
                legs_with_a_call.add(env.visited)
            env.step(action)
        legs += min(env.visited + 1, len(t.task.waypoints))
        routed += len(legs_with_a_call)
    return {
        "route_calls_per_leg": calls / max(1, legs),
        "legs_routed": routed / max(1, legs),
        "valid_with_route": valid[True] / max(1, taken[True]),
        "valid_without_route": valid[False] / max(1, taken[False]),
    }


def report(cfg: WarmStartConfig, model_dir: str, log=print) -> dict:
    """`python -m extras.warmstart report [MODEL_DIR]`: the checkpoint where RL starts, in the
    figures that decide whether RL can start from it: p@1 on --test-split (--eval-tasks x
    --eval-samples; and by task family where the split mixes them), the share of
    --group-size-sample groups on --train-split with no success (--batch-tasks tasks), and how it
    uses the route tool on both."""
    sampler = rti.init_policy(dataclasses.replace(cfg, model=model_dir, init=""), rti.Backend())
    test_tasks = envs.env_tasks(cfg.env, cfg.test_split)[: cfg.eval_tasks]
    train_tasks = envs.env_tasks(cfg.env, cfg.train_split)[: cfg.batch_tasks]
    with torch.no_grad():
        test = rti.rollout(sampler, test_tasks, cfg.eval_samples, 1234)
        train = rti.rollout(sampler, train_tasks, cfg.group_size, 99)
    groups = group_rows([t.group for t in train]).values()
    all_fail = [max(train[i].reward for i in rows) == 0 for rows in groups]
    successes = [
        [test[i].reward > 0 for i in rows] for rows in group_rows([t.group for t in test]).values()
    ]
    by_family = rti.with_families({}, test_tasks, successes)
    out = {
        "test_p@1": 100 * float(np.mean([t.reward for t in test])),
        **{f"test_{k}": v for k, v in by_family.items() if k.endswith("/p@1")},
        "train_all_fail": float(np.mean(all_fail)),
        "train_p@1": 100 * float(np.mean([t.reward for t in train])),
        **{f"test_{k}": v for k, v in tool_use(test).items()},
        **{f"train_{k}": v for k, v in tool_use(train).items()},
    }
    log(f"{model_dir}: " + ", ".join(f"{k} {v:.3f}" for k, v in out.items()))
    return out


def build_parser():
    return runtime.build_parser(WarmStartConfig, COMMANDS, PROG)


def main(argv=None) -> None:
    command, path, cfg = runtime.parse_args(argv, WarmStartConfig, COMMANDS, prog=PROG)
    torch.set_num_threads(cfg.threads)
    if command == "report":
        report(cfg, path or cfg.ws_out)
    else:
        warmstart(cfg)


if __name__ == "__main__":
    main()
