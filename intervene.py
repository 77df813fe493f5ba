"""Rollout-Time Intervention: validate / correct / verify failed trajectories, then gate them by
perplexity.

When every trajectory of a group fails, its rewards have no spread and GRPO learns nothing from
the task. `intervene_batch` turns some of those failures into successes at rollout time, through
one `Intervention`: the roles an RTIConfig names, and the counts they add up.

  1. replay    each selected failed trajectory; the validator checks every step against the
               rubric, up to the first invalid one (`Intervention.first_corrections`);
  2. correct   the corrector (by default the policy itself, shown the validator's reason and the
               grader's evidence, or a hint) rewrites it, up to `correction_tries` times; the
               verifier accepts or rejects each rewrite (`Intervention.correct`);
  3. continue  the policy samples the rest of the episode from the corrected state, through the
               same lockstep loop as every rollout (`play`); new steps are validated and corrected
               the same way, up to `max_corrections` per trajectory (`Intervention.continue_episodes`);
  4. gate      a corrected success is kept iff the perplexity of what the agent wrote
               (`gate_scope`) under the policy WITHOUT the note is at most `ppl_max`; kept ones
               join or replace their group (`group_mode`; `Intervention.gate`).

This file never imports the trainer: it needs only what the `Policy` and `Episode` protocols
below state, a sampler that turns token contexts into turns and scores sequences (policy.Sampler
and rti.Trajectory are one pair; tests/test_intervene.py drives it with a policy written on plain
`model.generate`, tests/test_layout.py with a pair of its own), so it can be copied into another
trainer with envs.py's StepCheck and loss.py's token codes.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from envs import Env, StepCheck
from loss import INTERVENED, POLICY, group_rows, require, require_choices

HINT_OPEN = "<hint>"
HINT_CLOSE = "</hint>"
VALIDATOR_PROMPT = (
    "you check one step of an agent against a rubric . {rubric} . history {history} . "
    "proposed step {action} . answer valid or invalid then the reason"
)
VERIFIER_PROMPT = (
    "you check a rewritten step of an agent against a rubric . {rubric} . history {history} . "
    "rewritten step {action} . accept only a step the history justifies . answer accept or reject"
)
PROMPT_WORDS = sorted(
    set(" ".join([VALIDATOR_PROMPT, VERIFIER_PROMPT]).split())
    - {"{rubric}", "{history}", "{action}"}
    | {HINT_OPEN, HINT_CLOSE, "llm", "flagged"}
)


def format_hint(reason: str, hint: str) -> str:
    """The block a self-corrector sees at the end of the user message:
    `<hint> reason ; hint </hint>`. The hint is left out when the reason already ends with it
    (Navigation's reasons do)."""
    if reason and reason.endswith(hint):
        text = reason
    else:
        text = " ; ".join(p for p in (reason, hint) if p)
    return f"{HINT_OPEN} {text} {HINT_CLOSE}"


# ----------------------------------------------------------------------------- what this file needs


class Policy(Protocol):
    """What this file calls on the policy: any sampler that continues token sequences and scores
    them. `chat` gives the token pieces of its chat: prompt_ids, turn_ids, ids, text, action_text,
    action_ids, eos_id.

    generate(contexts, max_new, streams) samples one agent turn (at most max_new tokens, default
    max_turn_tokens) after each context: (token ids, log-probs at the sampling temperature).
    `streams[i]`, when given, is the Stream of the episode that context i belongs to (`play`
    passes one per episode, the same object every turn): sampling goes on along it, and a
    sampler may keep state there between turns (policy.Sampler keeps a KV cache). score(seqs)
    gives log pi(y_t | y_<t) of every token of each sequence (0.0 for the first)."""

    chat: Any
    max_turn_tokens: int

    def generate(
        self, contexts: list[list[int]], max_new: int | None = None, streams: list | None = None
    ) -> tuple[list[list[int]], list[list[float]]]: ...
    def score(self, seqs: list[list[int]]) -> list[list[float]]: ...


@dataclass(eq=False)
class Stream:
    """One episode's sampling stream, from its first turn to its last: `seed` starts it (None: the
    policy draws one), and `state` is the policy's to keep between turns."""

    seed: int | None = None
    state: Any = None


class Episode(Protocol):
    """A trajectory (rti.Trajectory is one): per-token lists, agent turns as (start, end) in ids,
    the episode's text. truncated(k) copies the episode before turn k; step(...) records an agent
    turn, executes it in env and appends the observation's tokens (reward set when the episode
    ends)."""

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

    def truncated(self, k: int) -> Episode: ...
    def step(
        self, chat: Any, env: Env, agent_ids: list[int], logp: list[float], source: int
    ) -> None: ...


@dataclass
class Turn:
    """An agent turn as it enters an episode: its tokens, their log-probs (log mu for a
    correction) and who wrote it (POLICY or INTERVENED)."""

    ids: list[int]
    logp: list[float]
    source: int = POLICY


def play(
    policy: Policy,
    episodes: list[Episode],
    env_list: list[Env],
    streams: list[Stream],
    revise: Callable[[list[int], list[Turn]], list[Turn]] | None = None,
) -> None:
    """Play episodes to their end in lockstep, in place: each round, one batched policy.generate
    gives every live episode its next turn (episode i on streams[i]), and each turn is executed in
    its env (env_list[i]) and recorded (Episode.step). `revise(live, turns)` may replace sampled
    turns before they are executed (the continuation's validator and corrector). The project's
    one lockstep loop: rollouts (rti.rollout) and corrected episodes (Intervention) both run it."""
    live = [i for i, env in enumerate(env_list) if not env.done]
    while live:
        ids, logps = policy.generate(
            [episodes[i].ids for i in live], streams=[streams[i] for i in live]
        )
        turns = [Turn(a, lp) for a, lp in zip(ids, logps)]
        if revise is not None:
            turns = revise(live, turns)
        for i, turn in zip(live, turns):
            episodes[i].step(policy.chat, env_list[i], turn.ids, turn.logp, turn.source)
        live = [i for i in live if not env_list[i].done]


@dataclass
class StepUnderReview:
    """One step under review: the episode so far (ending with a user message), its env, the
    proposed action."""

    traj: Episode
    env: Env
    action: str = ""
    reason: str = ""  # the validator's, when it flags the step


@dataclass
class Rewrite:
    """A corrector's rewrite of one step: the agent turn's tokens and the action they spell."""

    agent_ids: list[int]
    logp: list[float]  # behaviour log-probs log mu_t (0 for a deterministic corrector)
    action: str
    # what the env makes of it (rewrite_kind): justified, leaked or invalid; set by the pipeline
    kind: str = ""


# ----------------------------------------------------------------------------- roles


class Role:
    """A validator, corrector or verifier; the LLM ones ask the policy."""

    def __init__(self, policy: Policy, cfg: RTIConfig | None = None):
        self.policy = policy
        self.cfg = cfg or RTIConfig()


class RubricValidator(Role):
    """The environment's own step check (the reward-side evidence)."""

    def check(self, cases: list[StepUnderReview]) -> list[StepCheck]:
        return [c.env.check_step(c.action) for c in cases]


class LLMValidator(Role):
    """The policy prompted with the rubric; `valid` / `invalid <reason>`. An unparseable answer
    flags nothing."""

    def check(self, cases: list[StepUnderReview]) -> list[StepCheck]:
        prompts = [
            VALIDATOR_PROMPT.format(
                rubric=c.env.rubric_text(), history=history_text(c.traj), action=c.action
            )
            for c in cases
        ]
        return [parse_validator(a) for a in ask(self.policy, prompts)]


def parse_validator(answer: str) -> StepCheck:
    """An LLM validator's answer as a StepCheck: only `invalid ...` flags the step."""
    words = answer.split()
    if words[:1] == ["invalid"]:
        return StepCheck(False, " ".join(words[1:]) or "llm flagged")
    # "valid" or anything unparseable: the claim "this step is wrong" is rejected
    return StepCheck(True, "")


class SelfCorrector(Role):
    """The policy itself rewrites the step, seeing the episode so far plus the hint block (what
    --corrector-sees names); log mu = its log-probs."""

    def rewrite(self, cases: list[StepUnderReview]) -> list[Rewrite]:
        chat = self.policy.chat
        contexts = [
            context_with(
                chat, c.traj, corrector_note(c, self.cfg.corrector_sees), c.env.observation_role
            )
            for c in cases
        ]
        ids, logps = self.policy.generate(contexts, self.policy.max_turn_tokens)
        return [Rewrite(i, lp, chat.action_text(i)) for i, lp in zip(ids, logps)]


def corrector_note(case: StepUnderReview, sees: str) -> str:
    """The hint block a self-corrector is shown after the episode so far: the validator's reason
    with the hint (`hint`: the action the agent's context determines), or with the evidence instead
    of the hint (`evidence`: what the grader knows, e.g. Navigation's remaining shortest path)."""
    if sees == "hint":
        return format_hint(case.reason, case.env.hint())
    return format_hint(reason_without_hint(case), case.env.evidence())


def reason_without_hint(case: StepUnderReview) -> str:
    """The validator's reason without the hint it may end with ('wrong move ; next A 1 4 do route'
    -> 'wrong move'): what a note that names another action keeps of it."""
    return case.reason.removesuffix(" ; " + case.env.hint())


class RuleCorrector(Role):
    """The environment's optimal action; deterministic, so log mu = 0."""

    def rewrite(self, cases: list[StepUnderReview]) -> list[Rewrite]:
        chat = self.policy.chat
        actions = [c.env.optimal_action() for c in cases]
        ids = [chat.action_ids(a) + [chat.eos_id] for a in actions]
        return [Rewrite(i, [0.0] * len(i), a) for a, i in zip(actions, ids)]


class ValidityVerifier(Role):
    """Validity post-check: one complete, well-formed action that passes the step check, and
    nothing else."""

    def accept(self, cases: list[StepUnderReview], rewrites: list[Rewrite]) -> list[bool]:
        return [
            self.well_formed(r) and c.env.check_step(r.action).valid
            for c, r in zip(cases, rewrites)
        ]

    def well_formed(self, rewrite: Rewrite) -> bool:
        """One complete turn (it ends with eos) that does not echo the hint block."""
        return (
            bool(rewrite.agent_ids)
            and rewrite.agent_ids[-1] == self.policy.chat.eos_id
            and HINT_OPEN not in rewrite.action
            and HINT_CLOSE not in rewrite.action
        )


class RubricVerifier(ValidityVerifier):
    """Integrity post-check (the paper's Post-Check): a well-formed, valid action that the agent's
    own context justifies (Env.justified). A corrector shown the grader's evidence can write a
    valid step the agent could never have known to take; trained on, such a step teaches the
    policy to guess. This verifier rejects it, and the corrector is asked again."""

    def accept(self, cases: list[StepUnderReview], rewrites: list[Rewrite]) -> list[bool]:
        return [self.well_formed(r) and c.env.justified(r.action) for c, r in zip(cases, rewrites)]


class LLMVerifier(Role):
    """The policy prompted with the rubric and the rewrite; only an answer starting with `accept`
    accepts."""

    def accept(self, cases: list[StepUnderReview], rewrites: list[Rewrite]) -> list[bool]:
        prompts = [
            VERIFIER_PROMPT.format(
                rubric=c.env.rubric_text(), history=history_text(c.traj), action=r.action
            )
            for c, r in zip(cases, rewrites)
        ]
        return [a.split()[:1] == ["accept"] for a in ask(self.policy, prompts)]


class AcceptAll(Role):
    """No verifier (the paper's "w/o verifier" ablation)."""

    def accept(self, cases, rewrites) -> list[bool]:
        return [True] * len(rewrites)


def ask(policy: Policy, prompts: list[str], max_new: int = 8) -> list[str]:
    """One short answer per prompt, each in a fresh single-message chat."""
    contexts = [policy.chat.prompt_ids(p) for p in prompts]
    answers, _ = policy.generate(contexts, max_new)
    return [policy.chat.text(i) for i in answers]


def history_text(traj: Episode) -> str:
    """The episode as text, for the LLM roles' prompts."""
    return " ".join(f"{o} ; {a} ;" for o, a in zip(traj.observations, traj.actions))


def context_with(chat, traj: Episode, extra: str, role: str | None = None) -> list[int]:
    """The episode's tokens with `extra` appended to its last user message (rendered as a `role`
    observation)."""
    content = traj.observations[-1] + " " + extra
    if not traj.turns:
        return chat.prompt_ids(content)
    return traj.ids[: traj.turns[-1][1]] + chat.turn_ids(content, role)


# ----------------------------------------------------------------------------- the flags

VALIDATORS = {"rubric": RubricValidator, "llm": LLMValidator}
CORRECTORS = {"self": SelfCorrector, "rule": RuleCorrector}
VERIFIERS = {
    "rubric": RubricVerifier,
    "valid": ValidityVerifier,
    "llm": LLMVerifier,
    "none": AcceptAll,
}
CORRECTOR_SEES = ("hint", "evidence")
REWRITE_KINDS = ("justified", "leaked", "invalid")
GROUP_MODES = ("paired", "replace")
GATE_SCOPES = ("intervened", "agent", "trajectory")


@dataclass
class RTIConfig:
    """Flags of the intervention, checked when built (validate)."""

    validator: str = field(
        default="rubric",
        metadata={
            "help": "who checks each step against the rubric: rubric = the environment's own step"
            " check; llm = the policy prompted with the rubric",
            "choices": tuple(VALIDATORS),
        },
    )
    corrector: str = field(
        default="self",
        metadata={
            "help": "who rewrites a flagged step: self = the policy, shown the validator's reason"
            " and what --corrector-sees names; rule = the environment's optimal action",
            "choices": tuple(CORRECTORS),
        },
    )
    corrector_sees: str = field(
        default="evidence",
        metadata={
            "help": "what the self-corrector is shown beside the validator's reason: evidence = what"
            " the grader knows (Navigation: the rest of a shortest path), as the paper's corrector"
            " is shown the rubric; a corrector can copy it into a step the agent could not have"
            " justified, which the rubric verifier rejects; hint = the action the agent's context"
            " determines (Navigation: 'do route'), which leaves the verifier nothing to catch",
            "choices": CORRECTOR_SEES,
        },
    )
    verifier: str = field(
        default="rubric",
        metadata={
            "help": "who accepts a rewrite: rubric = a well-formed, valid action that the agent's"
            " context justifies (the integrity post-check); valid = well-formed and valid only;"
            " llm = the policy prompted with the rubric; none = every rewrite is accepted (the"
            ' paper\'s "w/o verifier")',
            "choices": tuple(VERIFIERS),
        },
    )
    group_mode: str = field(
        default="replace",
        metadata={
            "help": "paired = every trajectory of a triggered group is corrected and a kept one"
            " joins the group beside its original; replace = the first intervene_per_group are"
            " corrected and a kept one replaces its original",
            "choices": GROUP_MODES,
        },
    )
    intervene_per_group: int = field(
        default=0,
        metadata={
            "help": "replace: failed trajectories corrected per triggered group; 0 = half of it"
        },
    )
    ppl_gate: bool = field(
        default=True,
        metadata={
            "help": "keep a corrected success only if its perplexity is at most ppl_max; off ="
            ' the paper\'s "w/o PPL gate"'
        },
    )
    ppl_max: float = field(
        default=1.3,
        metadata={
            "help": "the gate's perplexity bound: a corrected success whose perplexity exceeds it"
            " is dropped"
        },
    )
    gate_scope: str = field(
        default="agent",
        metadata={
            "help": "tokens the gate's perplexity is over: agent = every token the agent wrote;"
            " intervened = the corrected turns; trajectory = every token after the first message",
            "choices": GATE_SCOPES,
        },
    )
    correction_tries: int = field(
        default=3,
        metadata={"help": "rewrites asked per flagged step; the first one accepted wins"},
    )
    max_corrections: int = field(
        default=8,
        metadata={"help": "corrected steps per trajectory at most; later steps go unchecked"},
    )

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """require() every field (loss.require: the message names the flag)."""
        require_choices(self)
        require(self, "ppl_max", self.ppl_max > 1, "must be > 1 (a perplexity)")
        require(self, "correction_tries", self.correction_tries >= 1, "must be >= 1")
        require(self, "max_corrections", self.max_corrections >= 0, "must be >= 0")
        require(self, "intervene_per_group", self.intervene_per_group >= 0, "must be >= 0")


# ----------------------------------------------------------------------------- the pipeline


def intervene_batch(
    policy: Policy, trajs: list[Episode], cfg: RTIConfig, make_env: Callable[[Any], Env]
) -> tuple[list[Episode], dict]:
    """Run RTI on one training batch of groups; `make_env(task)` gives a fresh environment to
    replay an episode in. Returns the new batch and the step's counts (evaluate.intervention_rates
    adds the rates of the paper's Table 6).

    Trigger: group g is intervened on iff max_i r_i = 0. group_mode "paired" (what the paper's
    Table 6 counts imply): every trajectory of a triggered group is validated and corrected,
    validation goes on after a rejected step, and a corrected trajectory that succeeds and passes
    the gate joins its group beside its original (same `group`), so the two share a prefix with
    opposite-sign advantages. "replace": the first `intervene_per_group` trajectories (default
    half) are corrected from their first flagged step only, and a kept correction replaces its
    original."""
    run = Intervention(policy, cfg)
    chosen = run.choose(trajs)
    if not chosen:
        return trajs, dict(run.stats)
    fixes = run.first_corrections(trajs, chosen, make_env)  # 1. replay, 2. correct
    run.continue_episodes(fixes)  # 3. continue
    out = run.gate(trajs, fixes)  # 4. gate
    return out, dict(run.stats)


@dataclass
class Replay:
    """A trajectory being replayed in a fresh env: its index in the batch, the env, and the step
    that env is about to take."""

    traj_index: int
    env: Env
    next_step: int = 0


@dataclass
class Fix:
    """A trajectory's first accepted rewrite: its index in the batch, the step under review (the
    episode before that step, continued in place by stage 3, and its env) and the rewrite."""

    traj_index: int
    case: StepUnderReview
    rewrite: Rewrite


def failed_groups(trajs: list[Episode], groups: dict[int, list[int]]) -> list[int]:
    """The ids of the groups (`groups`: loss.group_rows of the trajectories' groups) in which no
    trajectory succeeded, max reward <= 0: RTI's trigger, and where GRPO learns nothing."""
    return [g for g, rows in groups.items() if max(trajs[i].reward for i in rows) <= 0]


class Intervention:
    """The roles of one RTIConfig (built on `policy`) applied to one batch, and the counts they add
    up in `stats` (the keys evaluate.RATES reads)."""

    def __init__(self, policy: Policy, cfg: RTIConfig):
        self.policy = policy
        self.cfg = cfg
        self.validator = VALIDATORS[cfg.validator](policy, cfg)
        self.corrector = CORRECTORS[cfg.corrector](policy, cfg)
        self.verifier = VERIFIERS[cfg.verifier](policy, cfg)
        self.paired = cfg.group_mode == "paired"
        self.stats = Counter()

    def choose(self, trajs: list[Episode]) -> list[int]:
        """The trigger: the indices of the trajectories to correct. In each group with no success
        (max reward <= 0), every one (paired) or the first intervene_per_group (replace; 0 = half
        the group, at least 1)."""
        groups = group_rows([t.group for t in trajs])
        triggered = failed_groups(trajs, groups)
        chosen = []
        for g in triggered:
            rows = groups[g]
            if not self.paired:
                rows = rows[: self.cfg.intervene_per_group or max(1, len(rows) // 2)]
            chosen += rows
        self.stats.update(
            groups=len(groups), groups_triggered=len(triggered), intervened=len(chosen)
        )
        return chosen

    def call_role(self, fn, cases, *args, default):
        """Call a role on `cases`. A role that answers a different number of cases than it was
        asked gets `default` for every case (a rejection; counted in role_errors); a role that
        raises stops the run: a bug is not a rejection."""
        out = fn(cases, *args) if cases else []
        if len(out) != len(cases):
            self.stats["role_errors"] += 1
            return [default] * len(cases)
        return out

    def review(self, cases: list[StepUnderReview]) -> list[bool]:
        """Validate the steps: True where flagged, with the validator's reason in the case (a
        validator answering a wrong number of cases flags none: call_role)."""
        checks = self.call_role(self.validator.check, cases, default=StepCheck(True))
        for case, check in zip(cases, checks):
            case.reason = check.reason
        self.stats["steps_checked"] += len(cases)
        self.stats["steps_flagged"] += sum(not c.valid for c in checks)
        return [not c.valid for c in checks]

    def correct(self, cases: list[StepUnderReview], tries: int) -> list[Rewrite | None]:
        """Ask the corrector and the verifier up to `tries` times per flagged step; the first
        accepted rewrite wins (None: none was). One verdict per step is counted (accepted or
        rejected, as the paper's Table 6), and every attempt."""
        result: list[Rewrite | None] = [None] * len(cases)
        todo = list(range(len(cases)))
        for _ in range(tries):
            rewrites = self.call_role(
                self.corrector.rewrite, [cases[i] for i in todo], default=None
            )
            asked = [(i, r) for i, r in zip(todo, rewrites) if r is not None]
            for i, r in asked:
                r.kind = rewrite_kind(cases[i].env, r.action)
                self.stats[f"rewrites_{r.kind}"] += 1
            verdicts = self.call_role(
                self.verifier.accept,
                [cases[i] for i, _ in asked],
                [r for _, r in asked],
                default=False,
            )
            for (i, r), ok in zip(asked, verdicts):
                result[i] = r if ok else None
                self.stats[f"accepted_{r.kind}"] += ok
                self.stats["attempts_rejected"] += not ok
            self.stats["correction_attempts"] += len(todo)
            todo = [i for i in todo if result[i] is None]
        self.stats["corrections_accepted"] += len(cases) - result.count(None)
        self.stats["corrections_rejected"] += result.count(None)
        return result

    def first_corrections(
        self, trajs: list[Episode], chosen: list[int], make_env: Callable[[Any], Env]
    ) -> list[Fix]:
        """1. replay, 2. correct: replay the chosen trajectories' actions in lockstep in fresh envs,
        validating each step, and correct the flagged ones; return each trajectory's first accepted
        rewrite, its env in the state before that step. After a rejection the original action
        stands and, in paired mode, the replay goes on to the next flagged step (rounds: every
        trajectory's next flag, then their corrections together)."""
        replays = [Replay(i, make_env(trajs[i].task)) for i in chosen]
        for r in replays:
            r.env.reset()
        tries = self.cfg.correction_tries if self.cfg.max_corrections > 0 else 0
        fixes = []
        while replays:
            flagged = []  # (replay, case) of the steps flagged this round
            while replays:
                replays = [r for r in replays if r.next_step < len(trajs[r.traj_index].actions)]
                cases = [
                    StepUnderReview(
                        trajs[r.traj_index].truncated(r.next_step),
                        r.env,
                        trajs[r.traj_index].actions[r.next_step],
                    )
                    for r in replays
                ]
                flags = self.review(cases)
                flagged += [(r, case) for r, case, bad in zip(replays, cases, flags) if bad]
                replays = [r for r, bad in zip(replays, flags) if not bad]
                for r in replays:
                    r.env.step(trajs[r.traj_index].actions[r.next_step])
                    r.next_step += 1
            rewrites = self.correct([case for _, case in flagged], tries)
            for (r, case), rewrite in zip(flagged, rewrites):
                if rewrite is not None:
                    fixes.append(Fix(r.traj_index, case, rewrite))
                elif self.paired:
                    case.env.step(case.action)
                    r.next_step += 1
                    replays.append(r)
        return fixes

    def continue_episodes(self, fixes: list[Fix]) -> None:
        """3. continue: execute each accepted rewrite, then let the policy play the rest of the
        episodes (fix.case.traj, in place) through `play`, each on a stream of its own, validating
        each new step and correcting it (up to cfg.max_corrections per trajectory)."""
        trajs = [f.case.traj for f in fixes]
        env_list = [f.case.env for f in fixes]
        for f in fixes:
            f.case.traj.intervention = {"corrections": 0, "leaked": 0}
            self.record(f.case, f.rewrite)
            f.case.traj.step(
                self.policy.chat, f.case.env, f.rewrite.agent_ids, f.rewrite.logp, INTERVENED
            )

        def revise(live: list[int], turns: list[Turn]) -> list[Turn]:
            """The sampled turns, with the flagged ones of trajectories that have corrections left
            replaced by their accepted rewrite."""
            todo = [
                j
                for j, i in enumerate(live)
                if trajs[i].intervention["corrections"] < self.cfg.max_corrections
            ]
            cases = [
                StepUnderReview(
                    trajs[live[j]], env_list[live[j]], self.policy.chat.action_text(turns[j].ids)
                )
                for j in todo
            ]
            flagged = [(j, case) for j, case, bad in zip(todo, cases, self.review(cases)) if bad]
            rewrites = self.correct([case for _, case in flagged], self.cfg.correction_tries)
            turns = list(turns)
            for (j, case), rewrite in zip(flagged, rewrites):
                if rewrite is not None:
                    self.record(case, rewrite)
                    turns[j] = Turn(rewrite.agent_ids, rewrite.logp, INTERVENED)
            return turns

        # each episode goes on on a stream of its own
        seeds = [t.seed for t in trajs]
        streams = [Stream(None if None in seeds else s + 1) for s in seeds]
        play(self.policy, trajs, env_list, streams, revise)

    @staticmethod
    def record(case: StepUnderReview, rewrite: Rewrite) -> None:
        """Count an accepted rewrite in its trajectory's intervention record."""
        case.traj.intervention["corrections"] += 1
        case.traj.intervention["leaked"] += rewrite.kind == "leaked"

    def gate(self, trajs: list[Episode], fixes: list[Fix]) -> list[Episode]:
        """4. gate: the batch with the corrected successes whose perplexity (intervened_ppl over
        cfg.gate_scope) is at most cfg.ppl_max (all of them without the gate) beside (paired) or
        instead of (replace) their originals."""
        successes = [f for f in fixes if f.case.traj.reward > 0]
        self.stats.update(with_accepted=len(fixes), corrected_successes=len(successes))
        ppls = intervened_ppl(self.policy, [f.case.traj for f in successes], self.cfg.gate_scope)
        out = list(trajs)
        for fix, ppl in zip(successes, ppls):
            corrected = fix.case.traj
            keep = (not self.cfg.ppl_gate) or ppl <= self.cfg.ppl_max
            verdict = "kept" if keep else "dropped"
            leaky = corrected.intervention["leaked"] > 0
            self.stats[f"gate_{verdict}"] += 1
            self.stats[f"ppl_{verdict}_sum"] += ppl
            # trajectories that hold a leaked step, and their perplexity
            self.stats[f"gate_{verdict}_leaky"] += leaky
            self.stats[f"ppl_{verdict}_leaky_sum"] += ppl if leaky else 0.0
            corrected.intervention["ppl"] = ppl
            if not keep:
                continue
            # what enters the trained batch: corrected turns, and those that copied evidence
            self.stats["kept_corrected_turns"] += corrected.intervention["corrections"]
            self.stats["kept_leaked_turns"] += corrected.intervention["leaked"]
            self.stats["calls_corrected_sum"] += len(corrected.actions)
            self.stats["calls_original_sum"] += len(trajs[fix.traj_index].actions)
            if self.paired:
                out.append(corrected)
            else:
                out[fix.traj_index] = corrected
        return out


def rewrite_kind(env: Env, action: str) -> str:
    """What a rewrite is in the env's state before it: `invalid` (the step check refuses it),
    `leaked` (valid, but not justified by the agent's context: copied from the evidence) or
    `justified`. Counted for every rewrite, whatever the verifier decides."""
    if not env.check_step(action).valid:
        return "invalid"
    return "justified" if env.justified(action) else "leaked"


def intervened_ppl(policy: Policy, trajs: list[Episode], scope: str = "agent") -> list[float]:
    """PPL = exp(-mean_{t in S} log pi_old(y_t | h_t)), scored by the policy without the hint in
    its context (our reading of the paper's gate), over the tokens S of `scope`: the intervened
    tokens I (a corrector rewrites whole turns, so I is the corrected turns), every agent token
    ("agent": the sequence perplexity of what the agent wrote), or every token after the first
    message ("trajectory")."""
    scores = policy.score([t.ids for t in trajs]) if trajs else []
    out = []
    for t, lp in zip(trajs, scores):
        if scope == "agent":
            picks = t.loss_mask
        elif scope == "trajectory":
            picks = [i >= t.turns[0][0] for i in range(len(t.ids))]
        else:
            picks = [s == INTERVENED and m for s, m in zip(t.source, t.loss_mask)]
        vals = [v for v, pick in zip(lp, picks) if pick]
        nll = -sum(vals) / len(vals) if vals else 0.0
        out.append(math.exp(nll) if nll < 700 else math.inf)  # exp overflows a float past ~709
    return out
