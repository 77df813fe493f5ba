"""Rollout-Time Intervention: validate / correct / verify failed trajectories, then gate them by perplexity.

When every trajectory of a group fails, its rewards have no spread and GRPO learns nothing from the task.
`intervene_batch` turns some of those failures into successes at rollout time:

  1. replay   each selected failed trajectory; the validator checks every step against the rubric, up to the first
              invalid one;
  2. correct  the corrector (by default the policy itself, shown the hint and the validator's reason) rewrites it,
              up to `correction_tries` times; the verifier accepts or rejects each rewrite;
  3. continue the policy samples the rest of the episode from the corrected state; new steps are validated and
              corrected the same way, up to `max_corrections` per trajectory;
  4. gate     a corrected success is kept iff the perplexity of what the agent wrote (`gate_scope`) under the policy
              WITHOUT the hint is at most `ppl_max`; kept ones join or replace their group (`group_mode`).

This file never imports the trainer: it needs only what the `Policy` and `Episode` protocols below state (rti.py's
Sampler and Trajectory are one pair; tests/test_layout.py drives it with a pair of its own), so it can be copied into
another trainer with envs.py's StepCheck and loss.py's token codes.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from envs import Env, StepCheck
from loss import INTERVENED, POLICY, group_rows

HINT_OPEN, HINT_CLOSE = "<hint>", "</hint>"
VALIDATOR_PROMPT = (
    "you check one step of an agent against a rubric . {rubric} . history {history} . "
    "proposed step {action} . answer valid or invalid then the reason"
)
VERIFIER_PROMPT = (
    "you check a rewritten step of an agent against a rubric . {rubric} . history {history} . "
    "rewritten step {action} . answer accept or reject"
)
PROMPT_WORDS = sorted(
    set(" ".join([VALIDATOR_PROMPT, VERIFIER_PROMPT]).split())
    - {"{rubric}", "{history}", "{action}"}
    | {HINT_OPEN, HINT_CLOSE, "llm", "flagged"}
)


def format_hint(reason: str, hint: str) -> str:
    """The block a self-corrector sees at the end of the user message: `<hint> reason ; hint </hint>`.

    The hint is left out when the reason already ends with it (Navigation's reasons do)."""
    text = (
        reason if reason and reason.endswith(hint) else " ; ".join(p for p in (reason, hint) if p)
    )
    return f"{HINT_OPEN} {text} {HINT_CLOSE}"


@dataclass
class RTIConfig:
    """Flags of the intervention; __post_init__ raises ValueError("field: why") for a bad value."""

    validator: str = "rubric"  # "rubric" | "llm"
    corrector: str = "self"  # "self" | "rule"
    verifier: str = (
        "rubric"  # "rubric" | "llm" | "none" (the paper's "w/o verifier": every rewrite accepted)
    )
    group_mode: str = "replace"  # "paired" | "replace": see intervene_batch
    intervene_per_group: int = (
        0  # replace: failed trajectories corrected per triggered group; 0 = half of it
    )
    ppl_gate: bool = True  # False = "w/o PPL gate"
    ppl_max: float = (
        1.3  # the 95th percentile of the warm start's own agent PPL (Navigation, fit split)
    )
    gate_scope: str = (
        "agent"  # tokens the gate's perplexity is over: "agent" | "intervened" | "trajectory"
    )
    correction_tries: int = 3
    max_corrections: int = 8  # per trajectory

    def __post_init__(self):
        for name, ok, why in [
            (name, getattr(self, name) in table, f"must be one of {sorted(table)}")
            for name, table in (
                ("validator", VALIDATORS),
                ("corrector", CORRECTORS),
                ("verifier", VERIFIERS),
                ("group_mode", ("paired", "replace")),
                ("gate_scope", GATE_SCOPES),
            )
        ] + [
            ("ppl_max", self.ppl_max > 1, "must be > 1 (a perplexity)"),
            ("correction_tries", self.correction_tries >= 1, "must be >= 1"),
            ("max_corrections", self.max_corrections >= 0, "must be >= 0"),
            ("intervene_per_group", self.intervene_per_group >= 0, "must be >= 0"),
        ]:
            if not ok:
                raise ValueError(f"{name}: {why}, got {getattr(self, name)!r}")


# ----------------------------------------------------------------------------- what this file needs from a trainer


class Policy(Protocol):
    """What this file calls on the policy (rti.Sampler is one). `chat` gives the token pieces of its chat: prompt_ids,
    turn_ids, ids, text, action_text, action_ids, eos_id. A session decodes rows in lockstep and has feed(rows,
    chunks), keep(rows) and retract(row, n); a turn comes back as (token ids, log-probs at the sampling temperature);
    score gives log pi(y_t | y_<t) of every token of each sequence."""

    chat: Any
    max_turn_tokens: int

    def session(self, prefixes: list[list[int]], seeds: list[int] | None = None) -> Any: ...
    def sample_turn(
        self, session: Any, rows: list[int]
    ) -> tuple[list[list[int]], list[list[float]]]: ...
    def generate(
        self, contexts: list[list[int]], max_new: int
    ) -> tuple[list[list[int]], list[list[float]]]: ...
    def score(self, seqs: list[list[int]]) -> list[list[float]]: ...


class Episode(Protocol):
    """A trajectory (rti.Trajectory is one): per-token lists, agent turns as (start, end) in ids, the episode's text.
    truncated(k) copies the episode before turn k; step(...) records an agent turn, executes it in env and returns
    the tokens to feed next, or None when the episode ended (reward set)."""

    task: Any
    group: int
    ids: list[int]
    loss_mask: list[int]
    source: list[int]
    turns: list[tuple[int, int]]
    actions: list[str]
    observations: list[str]
    reward: float
    intervention: dict | None
    seed: int | None  # the episode's sampling stream (None: the policy's own)

    def truncated(self, k: int) -> "Episode": ...
    def step(
        self, chat: Any, env: Env, agent_ids: list[int], logp: list[float], source: int
    ) -> list[int] | None: ...


@dataclass
class StepUnderReview:
    """One step under review: the episode so far (ending with a user message), its env, the proposed action."""

    traj: Episode
    env: Env
    action: str = ""
    reason: str = ""  # the validator's, when it flags the step


@dataclass
class Rewrite:
    agent_ids: list[int]
    logp: list[float]  # behaviour log-probs log mu_t (0 for a deterministic corrector)
    action: str


def history_text(traj: Episode) -> str:  # the episode as text, for the LLM roles' prompts
    return " ".join(f"{o} ; {a} ;" for o, a in zip(traj.observations, traj.actions))


# ----------------------------------------------------------------------------- roles


class Role:
    """A validator, corrector or verifier; the LLM ones ask the policy."""

    def __init__(self, policy: Policy):
        self.policy = policy


class RubricValidator(Role):
    """The environment's own step check (the reward-side evidence)."""

    def check(self, cases: list[StepUnderReview]) -> list[StepCheck]:
        return [c.env.check_step(c.action) for c in cases]


class LLMValidator(Role):
    """The policy prompted with the rubric; `valid` / `invalid <reason>`. An unparseable answer flags nothing."""

    def check(self, cases: list[StepUnderReview]) -> list[StepCheck]:
        return [
            parse_validator(a)
            for a in ask(
                self.policy,
                [
                    VALIDATOR_PROMPT.format(
                        rubric=c.env.rubric_text(), history=history_text(c.traj), action=c.action
                    )
                    for c in cases
                ],
            )
        ]


def parse_validator(answer: str) -> StepCheck:
    words = answer.split()
    if words[:1] == ["invalid"]:
        return StepCheck(False, " ".join(words[1:]) or "llm flagged")
    return StepCheck(
        True, ""
    )  # "valid" or anything unparseable: the claim "this step is wrong" is rejected


class SelfCorrector(Role):
    """The policy itself rewrites the step, seeing the episode so far plus the hint block; log mu = its log-probs."""

    def rewrite(self, cases: list[StepUnderReview]) -> list[Rewrite]:
        chat = self.policy.chat
        contexts = [
            context_with(chat, c.traj, format_hint(c.reason, c.env.hint()), c.env.observation_role)
            for c in cases
        ]
        ids, logps = self.policy.generate(contexts, self.policy.max_turn_tokens)
        return [Rewrite(i, lp, chat.action_text(i)) for i, lp in zip(ids, logps)]


class RuleCorrector(Role):
    """The environment's optimal action; deterministic, so log mu = 0."""

    def rewrite(self, cases: list[StepUnderReview]) -> list[Rewrite]:
        chat, actions = self.policy.chat, [c.env.optimal_action() for c in cases]
        ids = [chat.action_ids(a) + [chat.eos_id] for a in actions]
        return [Rewrite(i, [0.0] * len(i), a) for a, i in zip(actions, ids)]


class RubricVerifier(Role):
    """Integrity post-check: one complete, well-formed action that passes the step check, and nothing else."""

    def accept(self, cases: list[StepUnderReview], rewrites: list[Rewrite]) -> list[bool]:
        return [
            bool(r.agent_ids)
            and r.agent_ids[-1] == self.policy.chat.eos_id
            and HINT_OPEN not in r.action
            and HINT_CLOSE not in r.action
            and c.env.check_step(r.action).valid
            for c, r in zip(cases, rewrites)
        ]


class LLMVerifier(Role):
    """The policy prompted with the rubric and the rewrite; only an answer starting with `accept` accepts."""

    def accept(self, cases: list[StepUnderReview], rewrites: list[Rewrite]) -> list[bool]:
        return [
            a.split()[:1] == ["accept"]
            for a in ask(
                self.policy,
                [
                    VERIFIER_PROMPT.format(
                        rubric=c.env.rubric_text(), history=history_text(c.traj), action=r.action
                    )
                    for c, r in zip(cases, rewrites)
                ],
            )
        ]


class AcceptAll(Role):
    """No verifier (the paper's "w/o verifier" ablation)."""

    def accept(self, cases, rewrites) -> list[bool]:
        return [True] * len(rewrites)


def ask(policy: Policy, prompts: list[str], max_new: int = 8) -> list[str]:
    """One short answer per prompt, each in a fresh single-message chat."""
    return [
        policy.chat.text(i)
        for i in policy.generate([policy.chat.prompt_ids(p) for p in prompts], max_new)[0]
    ]


def context_with(chat, traj: Episode, extra: str, role: str | None = None) -> list[int]:
    """The episode's tokens with `extra` appended to its last user message (rendered as a `role` observation)."""
    content = traj.observations[-1] + " " + extra
    if not traj.turns:
        return chat.prompt_ids(content)
    return traj.ids[: traj.turns[-1][1]] + chat.turn_ids(content, role)


VALIDATORS = {
    "rubric": RubricValidator,
    "llm": LLMValidator,
}  # the flag values of RTIConfig's roles
CORRECTORS = {"self": SelfCorrector, "rule": RuleCorrector}
VERIFIERS = {"rubric": RubricVerifier, "llm": LLMVerifier, "none": AcceptAll}


# ----------------------------------------------------------------------------- the pipeline


def call_role(fn, cases, *args, default, stats):
    """Call a role; if it raises or returns the wrong number of answers, every case gets `default`."""
    try:
        out = fn(cases, *args) if cases else []
        if len(out) != len(cases):
            raise ValueError(f"role returned {len(out)} answers for {len(cases)} cases")
        return out
    except Exception:  # a broken role rejects; the run goes on
        stats["role_errors"] += 1
        return [default] * len(cases)


def correct(
    cases: list[StepUnderReview], corrector, verifier, tries: int, stats: Counter
) -> list[Rewrite | None]:
    """Ask the corrector and the verifier up to `tries` times per flagged step; the first accepted rewrite wins. One
    verdict per step is counted (accepted or rejected, as the paper's Table 6), and every attempt."""
    result: list[Rewrite | None] = [None] * len(cases)
    todo = list(range(len(cases)))
    for _ in range(tries):
        rewrites = call_role(corrector.rewrite, [cases[i] for i in todo], default=None, stats=stats)
        asked = [(i, r) for i, r in zip(todo, rewrites) if r is not None]
        verdicts = call_role(
            verifier.accept,
            [cases[i] for i, _ in asked],
            [r for _, r in asked],
            default=False,
            stats=stats,
        )
        for (i, r), ok in zip(asked, verdicts):
            result[i] = r if ok else None
        stats["correction_attempts"] += len(todo)
        todo = [i for i in todo if result[i] is None]
    stats["corrections_accepted"] += len(cases) - result.count(None)
    stats["corrections_rejected"] += result.count(None)
    return result


def intervene_batch(
    policy: Policy, trajs: list[Episode], cfg: RTIConfig, make_env: Callable[[Any], Env]
) -> tuple[list[Episode], dict]:
    """Run RTI on one training batch of groups; `make_env(task)` gives a fresh environment to replay an episode in.
    Returns the new batch and the step's counts (evaluate.intervention_rates adds the rates of the paper's Table 6).

    Trigger: group g is intervened on iff max_i r_i = 0. group_mode "paired" (what the paper's Table 6 counts imply):
    every trajectory of a triggered group is validated and corrected, validation goes on after a rejected step, and
    a corrected trajectory that succeeds and passes the gate joins its group beside its original (same `group`), so
    the two share a prefix with opposite-sign advantages. "replace": the first `intervene_per_group` trajectories
    (default half) are corrected from their first flagged step only, and a kept correction replaces its original."""
    validator, corrector = VALIDATORS[cfg.validator](policy), CORRECTORS[cfg.corrector](policy)
    verifier, paired, stats = VERIFIERS[cfg.verifier](policy), cfg.group_mode == "paired", Counter()
    groups = group_rows([t.group for t in trajs])
    triggered = [g for g, idx in groups.items() if max(trajs[i].reward for i in idx) <= 0]
    chosen = [
        i
        for g in triggered
        for i in (
            groups[g]
            if paired
            else groups[g][: cfg.intervene_per_group or max(1, len(groups[g]) // 2)]
        )
    ]
    stats.update(groups=len(groups), groups_triggered=len(triggered), intervened=len(chosen))
    if not chosen:
        return trajs, dict(stats)
    fixed = first_corrections(
        [trajs[i] for i in chosen], make_env, validator, corrector, verifier, cfg, stats
    )
    done = continue_episodes(
        policy, [(chosen[j], c, r) for j, c, r in fixed], validator, corrector, verifier, cfg, stats
    )
    out, successes = list(trajs), [(i, t) for i, t in done if t.reward > 0]
    stats.update(with_accepted=len(done), corrected_successes=len(successes))
    for (i, t), ppl in zip(
        successes, intervened_ppl(policy, [t for _, t in successes], cfg.gate_scope)
    ):
        keep = (not cfg.ppl_gate) or ppl <= cfg.ppl_max  # 4. gate
        stats["gate_kept" if keep else "gate_dropped"] += 1
        stats["ppl_kept_sum" if keep else "ppl_dropped_sum"] += ppl
        t.intervention["ppl"] = ppl
        if keep:
            stats["calls_corrected_sum"] += len(t.actions)
            stats["calls_original_sum"] += len(trajs[i].actions)
            if paired:
                out.append(t)
            else:
                out[i] = t
    return out, dict(stats)


def review(cases: list[StepUnderReview], validator, stats: Counter) -> list[bool]:
    """Validate the steps: True where flagged, with the validator's reason in the case (a broken one flags none)."""
    checks = call_role(validator.check, cases, default=StepCheck(True), stats=stats)
    for case, check in zip(cases, checks):
        case.reason = check.reason
    stats["steps_checked"] += len(cases)
    stats["steps_flagged"] += sum(not c.valid for c in checks)
    return [not c.valid for c in checks]


def first_corrections(
    trajs: list[Episode], make_env, validator, corrector, verifier, cfg: RTIConfig, stats: Counter
) -> list[tuple[int, StepUnderReview, Rewrite]]:
    """1. replay, 2. correct: replay the trajectories' actions in lockstep in fresh envs, validating each step, and
    correct the flagged ones; return (index, step, rewrite) of each trajectory's first accepted rewrite, its env in
    the state before that step. After a rejection the original action stands and, in paired mode, the replay goes on
    to the next flagged step (rounds: every trajectory's next flag, then their corrections together)."""
    items = [
        (j, make_env(t.task), 0) for j, t in enumerate(trajs)
    ]  # (trajectory, its env, next step)
    for _, env, _ in items:
        env.reset()
    out, tries = [], cfg.correction_tries if cfg.max_corrections > 0 else 0
    while items:
        flagged = []
        while items:
            items = [(j, env, k) for j, env, k in items if k < len(trajs[j].actions)]
            cases = [
                StepUnderReview(trajs[j].truncated(k), env, trajs[j].actions[k])
                for j, env, k in items
            ]
            flags = review(cases, validator, stats)
            flagged += [(j, case, k) for (j, _, k), case, bad in zip(items, cases, flags) if bad]
            items = [
                (j, env, k + 1) for (j, env, k), case, bad in zip(items, cases, flags) if not bad
            ]
            for j, env, k in items:
                env.step(trajs[j].actions[k - 1])
        for (j, case, k), rw in zip(
            flagged, correct([c for _, c, _ in flagged], corrector, verifier, tries, stats)
        ):
            if rw is not None:
                out.append((j, case, rw))
            elif cfg.group_mode == "paired":
                case.env.step(case.action)
                items.append((j, case.env, k + 1))
    return out


def continue_episodes(
    policy: Policy, fixed, validator, corrector, verifier, cfg: RTIConfig, stats: Counter
) -> list:
    """Execute each accepted rewrite, then let the policy sample the rest of the episodes in lockstep through one
    KV cache, validating each new step and correcting it (up to cfg.max_corrections per trajectory)."""
    chat, trajs, env_of = policy.chat, [c.traj for _, c, _ in fixed], [c.env for _, c, _ in fixed]
    for t in trajs:
        t.intervention = {"corrections": 0}

    def step(r, agent_ids, logp, source) -> list[int]:  # the tokens to feed row r next
        trajs[r].intervention["corrections"] += source == INTERVENED
        return trajs[r].step(chat, env_of[r], agent_ids, logp, source) or []

    seeds = [
        t.seed for t in trajs
    ]  # continue each episode on a stream of its own (None: the policy's)
    session = policy.session(
        [t.ids for t in trajs], None if None in seeds else [s + 1 for s in seeds]
    )
    live = list(range(len(trajs)))  # live[i]: the episode in session row i
    feed = [
        rw.agent_ids + step(r, rw.agent_ids, rw.logp, INTERVENED)
        for r, (_, _, rw) in enumerate(fixed)
    ]
    while True:
        going = [i for i, r in enumerate(live) if not env_of[r].done]
        if len(going) < len(live):
            session.keep(going)  # finished episodes leave the batch
        live, feed = [live[i] for i in going], [feed[i] for i in going]
        if not live:
            return [(i, t) for (i, _, _), t in zip(fixed, trajs)]
        session.feed(list(range(len(live))), feed)
        ids, logps = policy.sample_turn(session, list(range(len(live))))
        todo = [
            j
            for j, r in enumerate(live)
            if trajs[r].intervention["corrections"] < cfg.max_corrections
        ]
        cases = [
            StepUnderReview(trajs[live[j]], env_of[live[j]], chat.action_text(ids[j])) for j in todo
        ]
        bad = [(j, c) for j, c, flag in zip(todo, cases, review(cases, validator, stats)) if flag]
        rewrites = dict(
            zip(
                [j for j, _ in bad],
                correct([c for _, c in bad], corrector, verifier, cfg.correction_tries, stats),
            )
        )
        feed = []
        for j, r in enumerate(live):
            rw = rewrites.get(j)
            if rw is None:
                feed.append(step(r, ids[j], logps[j], POLICY))
            else:
                session.retract(j, len(ids[j]))
                feed.append(rw.agent_ids + step(r, rw.agent_ids, rw.logp, INTERVENED))


GATE_SCOPES = ("intervened", "agent", "trajectory")


def intervened_ppl(policy: Policy, trajs: list[Episode], scope: str = "agent") -> list[float]:
    """PPL = exp(-mean_{t in S} log pi_old(y_t | h_t)), scored by the policy without the hint in its context (our
    reading of the paper's gate), over the tokens S of `scope`: the intervened tokens I (a corrector rewrites whole
    turns, so I is the corrected turns), every agent token ("agent": the sequence perplexity of what the agent
    wrote), or every token after the first message ("trajectory")."""
    out = []
    for t, lp in zip(trajs, policy.score([t.ids for t in trajs]) if trajs else []):
        picks = (
            t.loss_mask
            if scope == "agent"
            else [i >= t.turns[0][0] for i in range(len(t.ids))]
            if scope == "trajectory"
            else [s == INTERVENED and m for s, m in zip(t.source, t.loss_mask)]
        )
        vals = [v for v, pick in zip(lp, picks) if pick]
        nll = -sum(vals) / len(vals) if vals else 0.0
        out.append(math.exp(nll) if nll < 700 else math.inf)  # exp overflows a float past ~709
    return out
