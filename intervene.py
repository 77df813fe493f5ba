"""Rollout-Time Intervention: validate / correct / verify failed trajectories, then gate them by perplexity.

When every trajectory of a group fails, the group's rewards have no spread and GRPO learns nothing from the task.
`intervene` turns some of those failures into successes at rollout time:

  1. replay   each selected failed trajectory from the start; the validator checks every step against the rubric
              and stops at the first invalid one;
  2. correct  the corrector (by default the policy itself, shown the rubric hint and the validator's reason)
              rewrites that step, up to `correction_tries` times, and the verifier accepts or rejects each rewrite;
  3. continue the policy samples the rest of the episode from the corrected state; each new step is validated and
              corrected the same way, up to `max_corrections` per trajectory;
  4. gate     a corrected trajectory that succeeds is kept iff the perplexity of its rewritten tokens under the policy
              WITHOUT the hint is at most `ppl_max`; kept ones replace the failed trajectory they came from.

This file never imports the trainer. It needs a `policy` object with: `chat` (prompt_ids, turn_ids, ids, text,
action_text, action_ids, eos_id), `session(prefixes)`, `sample_turn(session, rows)`, `generate(contexts, max_new)`,
`score(seqs)`, `max_turn_tokens`; and trajectories with the fields of rti.Trajectory (ids, loss_mask, source,
sample_logp, turns, actions, observations, reward, rubric) and its `truncated(k)` and `step` methods.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from envs import StepCheck

POLICY, INTERVENED = 0, 1   # same codes as loss.py (kept literal so this file needs no torch)

HINT_OPEN, HINT_CLOSE = "<hint>", "</hint>"
VALIDATOR_PROMPT = ("you check one step of an agent against a rubric . {rubric} . history {history} . "
                    "proposed step {action} . answer valid or invalid then the reason")
VERIFIER_PROMPT = ("you check a rewritten step of an agent against a rubric . {rubric} . history {history} . "
                   "rewritten step {action} . answer accept or reject")
PROMPT_WORDS = sorted(set(" ".join([VALIDATOR_PROMPT, VERIFIER_PROMPT]).split()) - {
    "{rubric}", "{history}", "{action}"} | {HINT_OPEN, HINT_CLOSE, "llm", "flagged"})


def format_hint(reason: str, hint: str) -> str:
    """The block a self-corrector sees at the end of the user message: `<hint> reason ; hint </hint>`.

    The hint is left out when the reason already ends with it (Navigation's reasons do)."""
    text = reason if reason and reason.endswith(hint) else " ; ".join(p for p in (reason, hint) if p)
    return f"{HINT_OPEN} {text} {HINT_CLOSE}"


@dataclass
class RTIConfig:
    validator: str = "rubric"       # "rubric" | "llm"
    corrector: str = "self"         # "self" | "rule"
    verifier: str = "rubric"        # "rubric" | "llm" | "none"
    verify: bool = True             # False = "w/o verifier": every rewrite is accepted
    ppl_gate: bool = True           # False = "w/o PPL gate"
    ppl_max: float = 4.0
    correction_tries: int = 3
    max_corrections: int = 8        # per trajectory
    intervene_per_group: int = 0    # failed trajectories corrected per triggered group; 0 = half of it

    @classmethod
    def from_config(cls, cfg) -> "RTIConfig":
        return cls(**{k: getattr(cfg, k) for k in cls.__dataclass_fields__})


@dataclass
class Case:
    """One step under review: the episode so far (a trajectory ending with a user message), its env, an action."""
    traj: object
    env: object
    action: str = ""
    agent_ids: tuple = ()
    reason: str = ""


@dataclass
class Rewrite:
    agent_ids: list[int]
    logp: list[float]          # behaviour log-probs log mu_t (0 for a deterministic corrector)
    action: str


def history_text(traj) -> str:
    return " ".join(f"{o} ; {a} ;" for o, a in zip(traj.observations, traj.actions))


# ----------------------------------------------------------------------------- roles

class RubricValidator:
    """The environment's own step check (the reward-side evidence)."""
    def check(self, cases: list[Case]) -> list[StepCheck]:
        return [c.env.check_step(c.action) for c in cases]


class LLMValidator:
    """The policy prompted with the rubric; `valid` / `invalid <reason>`. An unparseable answer flags nothing."""
    def __init__(self, policy):
        self.policy = policy

    def check(self, cases: list[Case]) -> list[StepCheck]:
        prompts = [VALIDATOR_PROMPT.format(rubric=c.env.rubric_text(), history=history_text(c.traj),
                                           action=c.action) for c in cases]
        answers = ask(self.policy, prompts)
        return [parse_validator(a) for a in answers]


def parse_validator(answer: str) -> StepCheck:
    words = answer.split()
    if words[:1] == ["invalid"]:
        return StepCheck(False, " ".join(words[1:]) or "llm flagged")
    return StepCheck(True, "")   # "valid" or anything unparseable: the claim "this step is wrong" is rejected


class SelfCorrector:
    """The policy itself rewrites the step, seeing the episode so far plus the hint block; log mu = its log-probs."""
    def __init__(self, policy):
        self.policy = policy

    def rewrite(self, cases: list[Case]) -> list[Rewrite]:
        chat = self.policy.chat
        contexts = [context_with(chat, c.traj, format_hint(c.reason, c.env.hint()), c.env.observation_role)
                    for c in cases]
        ids, logps = self.policy.generate(contexts, self.policy.max_turn_tokens)
        return [Rewrite(i, lp, chat.action_text(i)) for i, lp in zip(ids, logps)]


class RuleCorrector:
    """The environment's optimal action; deterministic, so log mu = 0."""
    def __init__(self, policy):
        self.policy = policy

    def rewrite(self, cases: list[Case]) -> list[Rewrite]:
        out = []
        for c in cases:
            action = c.env.optimal_action()
            ids = self.policy.chat.action_ids(action) + [self.policy.chat.eos_id]
            out.append(Rewrite(ids, [0.0] * len(ids), action))
        return out


class RubricVerifier:
    """Integrity post-check: one complete, well-formed action that passes the step check, and nothing else."""
    def __init__(self, policy):
        self.eos_id = policy.chat.eos_id

    def accept(self, cases: list[Case], rewrites: list[Rewrite]) -> list[bool]:
        return [bool(r.agent_ids) and r.agent_ids[-1] == self.eos_id and HINT_OPEN not in r.action
                and HINT_CLOSE not in r.action and c.env.check_step(r.action).valid
                for c, r in zip(cases, rewrites)]


class LLMVerifier:
    """The policy prompted with the rubric and the rewrite; only an answer starting with `accept` accepts."""
    def __init__(self, policy):
        self.policy = policy

    def accept(self, cases: list[Case], rewrites: list[Rewrite]) -> list[bool]:
        prompts = [VERIFIER_PROMPT.format(rubric=c.env.rubric_text(), history=history_text(c.traj),
                                          action=r.action) for c, r in zip(cases, rewrites)]
        return [a.split()[:1] == ["accept"] for a in ask(self.policy, prompts)]


class AcceptAll:
    """No verifier (the paper's "w/o verifier" ablation)."""
    def __init__(self, policy=None):
        pass

    def accept(self, cases, rewrites) -> list[bool]:
        return [True] * len(rewrites)


def ask(policy, prompts: list[str], max_new: int = 8) -> list[str]:
    """One short answer per prompt, each in a fresh single-message chat."""
    ids, _ = policy.generate([policy.chat.prompt_ids(p) for p in prompts], max_new)
    return [policy.chat.text(i) for i in ids]


def context_with(chat, traj, extra: str, role: str | None = None) -> list[int]:
    """The episode's tokens with `extra` appended to its last user message (rendered as a `role` observation)."""
    content = traj.observations[-1] + " " + extra
    if not traj.turns:
        return chat.prompt_ids(content)
    return traj.ids[:traj.turns[-1][1]] + chat.turn_ids(content, role)


def make_roles(policy, cfg: RTIConfig):
    validators = {"rubric": RubricValidator, "llm": LLMValidator}
    correctors = {"self": SelfCorrector, "rule": RuleCorrector}
    verifiers = {"rubric": RubricVerifier, "llm": LLMVerifier, "none": AcceptAll}
    for name, table in (("validator", validators), ("corrector", correctors), ("verifier", verifiers)):
        if getattr(cfg, name) not in table:
            raise ValueError(f"unknown {name} {getattr(cfg, name)!r}; choose from {sorted(table)}")
    validator = validators[cfg.validator]() if cfg.validator == "rubric" else validators[cfg.validator](policy)
    verifier = verifiers[cfg.verifier if cfg.verify else "none"](policy)
    return validator, correctors[cfg.corrector](policy), verifier


# ----------------------------------------------------------------------------- the pipeline

class Stats(dict):
    def add(self, key, n=1):
        self[key] = self.get(key, 0) + n


def safe(fn, cases, *args, default, stats):
    """Call a role; if it raises or returns the wrong number of answers, every case gets `default`."""
    if not cases:
        return []
    try:
        out = fn(cases, *args)
        if len(out) != len(cases):
            raise ValueError(f"role returned {len(out)} answers for {len(cases)} cases")
        return out
    except Exception:   # a broken role rejects; the run goes on
        stats.add("role_errors")
        return [default] * len(cases)


def correct(cases: list[Case], corrector, verifier, tries: int, stats: Stats) -> list[Rewrite | None]:
    """Ask the corrector and the verifier up to `tries` times per case; the first accepted rewrite wins."""
    result: list[Rewrite | None] = [None] * len(cases)
    todo = list(range(len(cases)))
    for _ in range(tries):
        if not todo:
            break
        rewrites = safe(corrector.rewrite, [cases[i] for i in todo], default=None, stats=stats)
        ok = [r is not None for r in rewrites]
        verdicts = safe(verifier.accept, [cases[i] for i, o in zip(todo, ok) if o],
                        [r for r in rewrites if r is not None], default=False, stats=stats)
        verdicts = iter(verdicts)
        still = []
        for i, r, o in zip(todo, rewrites, ok):
            if o and next(verdicts):
                result[i] = r
                stats.add("corrections_accepted")
            else:
                stats.add("corrections_rejected")
                still.append(i)
        todo = still
    return result


def intervene(policy, trajs: list, cfg: RTIConfig, make_env=None) -> tuple[list, dict]:
    """Run RTI on one training batch (B groups of G, laid out group by group). Returns the new list and stats.

    Trigger: group g is intervened on iff max_i r_i = 0. Only the first `intervene_per_group` trajectories of a
    triggered group (default half) are corrected, so a group whose corrections all succeed keeps a reward spread."""
    import envs as envs_module
    make_env = make_env or (lambda task: envs_module.make_env(task, getattr(policy, "user", None)))
    validator, corrector, verifier = make_roles(policy, cfg)
    stats = Stats()
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(trajs):
        groups.setdefault(t.group, []).append(i)
    triggered = [g for g, idx in groups.items() if max(trajs[i].reward for i in idx) <= 0]
    stats.update(groups=len(groups), groups_triggered=len(triggered))
    chosen = [i for g in triggered for i in groups[g][:cfg.intervene_per_group or max(1, len(groups[g]) // 2)]]
    stats["intervened"] = len(chosen)
    if not chosen:
        return trajs, finalize(stats)
    flagged = replay([trajs[i] for i in chosen], make_env, validator, stats)                # 1. replay
    flagged = flagged if cfg.max_corrections > 0 else []
    rewrites = correct([c for _, c in flagged], corrector, verifier, cfg.correction_tries, stats)   # 2. correct
    fixed = [(chosen[j], c, r) for (j, c), r in zip(flagged, rewrites) if r is not None]
    done = continue_episodes(policy, fixed, validator, corrector, verifier, cfg, stats)   # 3. continue
    out = list(trajs)                                                                      # 4. gate and replace
    successes = [(i, t) for i, t in done if t.reward > 0]
    stats.update(with_accepted=len(done), corrected_successes=len(successes))
    for (i, t), ppl in zip(successes, intervened_ppl(policy, [t for _, t in successes])):
        keep = (not cfg.ppl_gate) or ppl <= cfg.ppl_max
        stats.setdefault("ppl_kept" if keep else "ppl_dropped", []).append(ppl)
        t.intervention["ppl"] = ppl
        if keep:
            stats.setdefault("calls_corrected", []).append(len(t.actions))
            stats.setdefault("calls_original", []).append(len(trajs[i].actions))
            out[i] = t
    return out, finalize(stats)


def replay(trajs: list, make_env, validator, stats: Stats) -> list[tuple[int, Case]]:
    """Replay the trajectories' actions in lockstep, validating each step; return (index, Case) for each
    trajectory's first flagged step, its env left in the state before that step."""
    live = []
    for j, t in enumerate(trajs):
        env = make_env(t.task)
        env.reset()
        live.append((j, env))
    flagged, k = [], 0
    while live:
        live = [(j, env) for j, env in live if k < len(trajs[j].actions)]
        cases = [Case(trajs[j].truncated(k), env, trajs[j].actions[k]) for j, env in live]
        checks = safe(validator.check, cases, default=StepCheck(True), stats=stats)
        stats.add("steps_checked", len(cases))
        still = []
        for (j, env), case, check in zip(live, cases, checks):
            if check.valid:
                env.step(case.action)
                still.append((j, env))
            else:
                case.reason = check.reason
                flagged.append((j, case))
        stats.add("steps_flagged", len(live) - len(still))
        live, k = still, k + 1
    return flagged


def continue_episodes(policy, fixed, validator, corrector, verifier, cfg: RTIConfig, stats: Stats) -> list:
    """Execute each accepted rewrite, then let the policy sample the rest of the episodes in lockstep through one
    KV cache, validating each new step and correcting it (up to cfg.max_corrections per trajectory)."""
    chat = policy.chat
    rows = [(i, case.traj, case.env) for i, case, _ in fixed]
    for _, t, _ in rows:
        t.intervention = {"corrections": 0}

    def step(r, agent_ids, logp, source) -> list[int] | None:
        _, t, env = rows[r]
        t.intervention["corrections"] += source == INTERVENED
        return t.step(chat, env, agent_ids, logp, source)

    seeds = [t.seed for _, t, _ in rows]   # continue each episode on a stream of its own (None: the policy's)
    session = policy.session([t.ids for _, t, _ in rows], None if None in seeds else [s + 1 for s in seeds])
    live = list(range(len(rows)))     # live[i]: the episode in session row i
    feed = [rewrite.agent_ids + (step(r, rewrite.agent_ids, rewrite.logp, INTERVENED) or [])
            for r, (_, _, rewrite) in enumerate(fixed)]
    while True:
        going = [i for i, r in enumerate(live) if not rows[r][2].done]
        if len(going) < len(live):
            session.keep(going)       # finished episodes leave the batch
        live, feed = [live[i] for i in going], [feed[i] for i in going]
        if not live:
            break
        session.feed(list(range(len(live))), feed)
        ids, logps = policy.sample_turn(session, list(range(len(live))))
        review = [j for j, r in enumerate(live) if rows[r][1].intervention["corrections"] < cfg.max_corrections]
        cases = [Case(rows[live[j]][1], rows[live[j]][2], chat.action_text(ids[j]), tuple(ids[j])) for j in review]
        checks = safe(validator.check, cases, default=StepCheck(True), stats=stats)
        stats.add("steps_checked", len(cases))
        bad = []
        for j, c, chk in zip(review, cases, checks):
            if not chk.valid:
                c.reason = chk.reason
                bad.append((j, c))
        stats.add("steps_flagged", len(bad))
        rewrites = dict(zip([j for j, _ in bad], correct([c for _, c in bad], corrector, verifier,
                                                         cfg.correction_tries, stats)))
        feed = []
        for j, r in enumerate(live):
            rw = rewrites.get(j)
            if rw is None:
                chunk = step(r, ids[j], logps[j], POLICY)
                feed.append(chunk or [])
            else:
                session.retract(j, len(ids[j]))
                chunk = step(r, rw.agent_ids, rw.logp, INTERVENED)
                feed.append(rw.agent_ids + (chunk or []))
    return [(i, t) for i, t, _ in rows]


def intervened_ppl(policy, trajs: list) -> list[float]:
    """PPL = exp(-mean_{t in I} log pi_old(y_t | h_t)) over the intervened tokens I, scored by the policy without the
    hint in its context (our reading of the paper's gate; DESIGN.md section 3)."""
    if not trajs:
        return []
    scored = policy.score([t.ids for t in trajs])
    out = []
    for t, lp in zip(trajs, scored):
        vals = [v for v, s, m in zip(lp, t.source, t.loss_mask) if s == INTERVENED and m]
        nll = -sum(vals) / len(vals) if vals else 0.0
        out.append(math.exp(nll) if nll < 700 else math.inf)   # exp overflows a float past ~709
    return out


MEANS = {"ppl_kept_mean": "gate_kept", "ppl_dropped_mean": "gate_dropped",   # mean -> the count it averages over
         "calls_corrected_mean": "gate_kept", "calls_original_mean": "gate_kept"}


def finalize(stats: Stats) -> dict:
    """Counts plus the rates and means a reader compares with the paper's Table 6."""
    s = dict(stats)
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
    for key in ("ppl_kept", "ppl_dropped", "calls_corrected", "calls_original"):
        xs = s.pop(key, [])
        s[f"{key}_mean"] = mean(xs)
        if key.startswith("ppl"):
            s[key.replace("ppl_", "gate_")] = len(xs)
    return with_rates(s)


def with_rates(s: dict) -> dict:
    div = lambda a, b: s.get(a, 0) / s[b] if s.get(b) else float("nan")
    s["trigger_rate"] = div("groups_triggered", "groups")
    s["flag_rate"] = div("steps_flagged", "steps_checked")
    tried = s.get("corrections_accepted", 0) + s.get("corrections_rejected", 0)
    s["accept_rate"] = s.get("corrections_accepted", 0) / tried if tried else float("nan")
    s["with_accepted_rate"] = div("with_accepted", "intervened")
    s["corrected_success_rate"] = div("corrected_successes", "with_accepted")
    return s


def total(steps: list[dict]) -> dict:
    """The statistics of a whole run from its per-step ones: counts add up, means are weighted by their counts."""
    s: dict = {}
    for st in steps:
        for k, v in st.items():
            if k in MEANS:
                if st.get(MEANS[k]):
                    s[k + "_sum"] = s.get(k + "_sum", 0.0) + v * st[MEANS[k]]
            elif not k.endswith("_rate"):
                s[k] = s.get(k, 0) + v
    for k, n in MEANS.items():
        s[k] = s.pop(k + "_sum", float("nan")) / s[n] if s.get(n) else float("nan")
    return with_rates(s)


def report(s: dict) -> str:
    """A few lines in the terms of the paper's Table 6."""
    f = lambda x: "n/a" if x != x else f"{100 * x:.1f}%"
    g = lambda x: "n/a" if x != x else f"{x:.2f}"
    return "\n".join([
        f"groups triggered (all G failed): {s.get('groups_triggered', 0)} of {s.get('groups', 0)} "
        f"({f(s['trigger_rate'])})",
        f"steps flagged by the validator: {s.get('steps_flagged', 0)} of {s.get('steps_checked', 0)} "
        f"({f(s['flag_rate'])})",
        f"corrections accepted by the verifier: {s.get('corrections_accepted', 0)} of "
        f"{s.get('corrections_accepted', 0) + s.get('corrections_rejected', 0)} ({f(s['accept_rate'])})",
        f"intervened trajectories with >= 1 accepted correction: {s.get('with_accepted', 0)} of "
        f"{s.get('intervened', 0)} ({f(s['with_accepted_rate'])}); of those successful: "
        f"{s.get('corrected_successes', 0)} ({f(s['corrected_success_rate'])})",
        f"perplexity gate: kept {s.get('gate_kept', 0)} (mean PPL {g(s['ppl_kept_mean'])}), dropped "
        f"{s.get('gate_dropped', 0)} (mean PPL {g(s['ppl_dropped_mean'])})",
        f"tool calls per kept trajectory: corrected {g(s['calls_corrected_mean'])} vs original "
        f"{g(s['calls_original_mean'])}"])
