"""intervene.py on a scripted policy and the Navigation task.

The policy is a real `policy.Sampler` (tiny model, real tokenizer, real KV-cached sessions and scoring) whose choices are
scripted: `sample_turn` plays a plan (optimal moves, with wrong ones at given turns) and feeds the chosen ids into the
session as the real sampler does; `generate` answers the roles' one-off prompts as the corrector / validator / verifier
functions a test gives, and records every context it was shown. Trajectories are produced by `rti.rollout` with that
policy, so they are genuine token sequences. The last test runs the whole intervention with a policy of its own, written
on plain `model.generate` and a forward pass (no KV session).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
import random
import re
from dataclasses import dataclass

import pytest
import torch

import envs
import evaluate
import intervene
import loss as loss_mod
import rti
import runtime
from intervene import INTERVENED, POLICY, RTIConfig
from policy import Chat, DecodeSession, Sampler, load_model

torch.set_num_threads(1)

# the first 12 tasks of a fixed easy-like split (not envs.SPLITS, which may be retuned)
SPEC = envs.SplitSpec(7, 7, 0.10, 1, 2, n=12, seed=1)
EASY = [
    envs.generate_task(SPEC, random.Random(SPEC.seed * envs.SEED_STRIDE + i), f"easy-{i:04d}")
    for i in range(SPEC.n)
]
T_SHORT, T_MID, T_LONG = (
    EASY[6],
    EASY[1],
    EASY[5],
)  # 5, 8 and 11 oracle actions; a wall or edge next to most steps
FIRST_MESSAGE = {envs.Navigation(t).reset(): t for t in EASY}
RUBRIC = {envs.Navigation(t).rubric_text(): t for t in EASY}
ROLE_PROMPT = re.compile(
    r"\. (rubric visit .*? turns) \. history (.*?)\s?\. (?:proposed|rewritten) step (.*?) \. "
    r"(?:accept only a step the history justifies \. )?answer "
)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("tiny", seed=0)


def test_scripted_tasks_fit_the_scenarios():
    assert [len(envs.optimal_actions(t)) for t in (T_SHORT, T_MID, T_LONG)] == [5, 8, 11]
    assert len(FIRST_MESSAGE) == len(RUBRIC) == len(EASY)
    for task, steps in (
        (T_SHORT, 4),
        (T_MID, 6),
        (T_LONG, 5),
    ):  # a wall move exists at each of these states
        env = envs.Navigation(task)
        for a in envs.optimal_actions(task)[:steps]:
            assert wrong_action(env, "wall") in envs.MOVES
            env.step(a)


# ----------------------------------------------------------------------------- the scripted policy


def parse_chat(text: str) -> list[tuple[str, str, bool]]:
    """(role, content, closed) of each message of a decoded tiny-template chat (`<|role|> content [<|im_end|>]`)."""
    msgs = []
    for role, body in re.findall(
        r"<\|(user|assistant|system)\|>((?:(?!<\|(?:user|assistant|system)\|>).)*)", text
    ):
        words = body.split()
        closed = bool(words) and words[-1] == "<|im_end|>"
        msgs.append((role, " ".join(words[:-1] if closed else words), closed))
    return msgs


def wrong_action(env, kind: str) -> str:
    """'wall': the first move into a wall or off the grid in env's state; anything else is taken literally."""
    if kind == "wall":
        return next(a for a in envs.MOVES if env.check_step(a).reason.startswith("wall"))
    return kind


def plan(per_row: list[dict] | None = None, every: dict | None = None):
    """Optimal moves, except at turn k a wrong action: per_row[row][k] (a rollout), or every[k] (any row)."""

    def choose(row, task, actions):
        env = envs.run_actions(task, actions)
        kind = (per_row[row] if per_row is not None else every or {}).get(len(actions))
        return wrong_action(env, kind) if kind else env.optimal_action()

    return choose


@dataclass
class Query:
    """What a role was asked: the decoded context, and the episode it is about (task, actions so far, env there)."""

    role: str
    ids: list
    text: str
    task: object
    actions: list
    env: object
    hint: str = ""  # corrector: the text inside <hint> ... </hint>
    action: str = ""  # validator: the proposed step; verifier: the rewrite
    attempt: int = 0  # how many times this exact context was asked before


class RecordingSession(DecodeSession):
    """A DecodeSession that also keeps each row's number when the session started (rows are renumbered when finished
    ones leave)."""

    def __init__(self, model, prefixes, pad_id, seeds=None):
        self.origin = list(range(len(prefixes)))
        super().__init__(model, prefixes, pad_id, seeds)

    def keep(self, rows):
        self.origin = [self.origin[r] for r in rows]
        super().keep(rows)


def turn_logp(turn: int, n: int) -> list[float]:
    """Made-up behaviour log-probs of a sampled turn (distinct per turn and position)."""
    return [-(0.01 * (turn + 1) + 0.001 * i) for i in range(n)]


def role_logp(n: int) -> list[float]:
    """Made-up log-probs of a generated answer (the corrector's log mu)."""
    return [-0.3 - 0.2 * i for i in range(n)]


class ScriptedPolicy(Sampler):
    def __init__(
        self, tiny, max_turn_tokens=4, corrector=None, validator=None, verifier=None, scores=None
    ):
        super().__init__(*tiny, max_turn_tokens=max_turn_tokens)
        self.plan = plan(every={})
        self.corrector = corrector or (lambda q: q.env.optimal_action())
        self.validator = validator or (lambda q: "valid")
        self.verifier = verifier or (lambda q: "accept")
        self.scores = scores
        self.check_logits = False
        self.sessions = 0
        self.turn_calls: list[
            tuple[list[int], list[int], list[float]]
        ] = []  # (context, ids, logp) per turn
        self.role_calls: dict[str, list[Query]] = {"corrector": [], "validator": [], "verifier": []}
        self.score_calls: list[list[list[int]]] = []
        self._asked: dict[tuple, int] = {}

    def reset_records(self):
        self.sessions = 0
        self.turn_calls.clear()
        self.score_calls.clear()
        for v in self.role_calls.values():
            v.clear()

    def session(self, prefixes, seeds=None):
        self.sessions += 1
        return RecordingSession(self.model, prefixes, self.tok.pad_token_id, seeds)

    def episode(self, ids):
        """(task, actions) of a training-sequence context (or a corrector context, hint stripped)."""
        msgs = parse_chat(self.tok.decode(ids))
        task = FIRST_MESSAGE[msgs[0][1].split(" <hint>")[0]]
        return task, [c for r, c, closed in msgs if r == "assistant" and closed]

    def sample_turn(self, session, rows, max_new=None):
        max_new = max_new or self.max_turn_tokens
        session.saved_logits = {
            r: session.last_logits[r].clone() for r in rows
        }  # what retract restores
        for r in rows:
            session.turn_start[r] = len(session.tokens[r])
        ids_out, logp_out = [], []
        for r in rows:
            ctx = list(session.tokens[r])
            if self.check_logits:  # the cache holds exactly the recorded context
                with torch.no_grad():
                    ref = self.model(input_ids=torch.tensor([ctx])).logits[0, -1]
                assert torch.allclose(session.last_logits[r], ref, atol=1e-4)
            task, actions = self.episode(ctx)
            ids = (self.chat.ids(self.plan(session.origin[r], task, actions)) + [self.chat.eos_id])[
                :max_new
            ]
            ids_out.append(ids)
            logp_out.append(turn_logp(len(actions), len(ids)))
            self.turn_calls.append((ctx, ids, logp_out[-1]))
        session.feed(rows, ids_out)
        return ids_out, logp_out

    def query(self, ctx) -> Query:
        text = self.tok.decode(ctx)
        msgs = parse_chat(text)
        first = msgs[0][1]
        if first.startswith("you check"):
            role = "validator" if first.startswith("you check one step") else "verifier"
            rubric, history, action = ROLE_PROMPT.search(first).groups()
            task = RUBRIC[rubric]
            actions = history.rstrip(" ;").split(" ; ")[1::2] if history else []
            q = Query(
                role, ctx, text, task, actions, envs.run_actions(task, actions), action=action
            )
        else:
            task, actions = self.episode(ctx)
            hint = re.search(r"<hint> (.*) </hint>", text)
            q = Query(
                "corrector",
                ctx,
                text,
                task,
                actions,
                envs.run_actions(task, actions),
                hint=hint.group(1) if hint else "",
            )
        key = (q.role, tuple(ctx))
        q.attempt = self._asked.get(key, 0)
        self._asked[key] = q.attempt + 1
        return q

    def generate(self, contexts, max_new=None, streams=None):
        if (
            streams is not None
        ):  # an episode's turn: the real sampler's session, scripted choices (sample_turn)
            return super().generate(contexts, max_new, streams)
        max_new = max_new or self.max_turn_tokens
        ids_out, logp_out = [], []
        for ctx in contexts:
            q = self.query(ctx)
            self.role_calls[q.role].append(q)
            answer = getattr(self, q.role)(q)
            ids = (self.chat.ids(answer) + [self.chat.eos_id])[:max_new]
            ids_out.append(ids)
            logp_out.append(role_logp(len(ids)))
        return ids_out, logp_out

    def score(self, seqs):
        self.score_calls.append([list(s) for s in seqs])
        if self.scores is None:
            return super().score(seqs)
        return [self.scores(s) for s in seqs]


def sample(policy, tasks, group_size, mistakes, then=None):
    """B x G genuine rollouts whose turns are scripted: optimal, except trajectory i plays mistakes[i] = {turn: kind}.
    Afterwards the policy plays `then` ({turn: kind}, for any row; default: optimal) and its records are cleared."""
    policy.plan = plan(per_row=mistakes)
    trajs = rti.rollout(policy, tasks, group_size)
    for t, m in zip(
        trajs, mistakes
    ):  # wall hits and early finishes fail; the optimal path succeeds
        assert t.reward == (0.0 if m else 1.0)
    policy.plan = plan(every=then or {})
    policy.reset_records()
    return trajs


def run(policy, trajs, config):
    out, counts = intervene.intervene_batch(policy, trajs, config, policy.make_env)
    stats = evaluate.intervention_rates(counts)
    assert (
        stats["corrections_accepted"] + stats["corrections_rejected"] == stats["steps_flagged"]
    )  # Table 6's
    return out, stats


def cfg(**kw) -> RTIConfig:
    kw.setdefault(
        "ppl_gate", False
    )  # the untrained tiny model's PPL is far above any sensible ppl_max
    return RTIConfig(**kw)


def snapshot(trajs):
    return copy.deepcopy(
        [
            (
                t.ids,
                t.loss_mask,
                t.source,
                t.sample_logp,
                t.actions,
                t.turns,
                t.observations,
                t.reward,
                t.rubric,
                t.intervention,
            )
            for t in trajs
        ]
    )


def span(t, k) -> range:
    return range(*t.turns[k])


def assert_unchanged(out, trajs, rows):
    for i in rows:
        assert out[i] is trajs[i]


# ----------------------------------------------------------------------------- 1. trigger and selection


def test_group_with_a_success_is_not_intervened_on(tiny):
    policy = ScriptedPolicy(tiny)
    mistakes = [
        {},
        {1: "wall"},
        {0: "wall"},
        {2: "finish"},  # group 0: one success among failures
        {1: "wall"},
        {0: "wall"},
        {2: "wall"},
        {1: "finish"},
    ]  # group 1: every trajectory fails
    trajs = sample(policy, [T_MID, T_SHORT], 4, mistakes)
    assert [t.group for t in trajs] == [0] * 4 + [1] * 4
    before = snapshot(trajs)
    out, stats = run(policy, trajs, cfg())
    assert stats["groups"] == 2 and stats["groups_triggered"] == 1 and stats["trigger_rate"] == 0.5
    assert stats["intervened"] == 2  # default: half of the triggered group
    assert_unchanged(out, trajs, [0, 1, 2, 3, 6, 7])
    assert (
        [out[i].reward for i in (4, 5)] == [1.0, 1.0]
        and out[4].intervention
        and out[5].intervention
    )
    assert all(
        q.task is T_SHORT for q in policy.role_calls["corrector"]
    )  # group 0 was never replayed
    assert snapshot(trajs) == before  # the sampled trajectories are not modified


@pytest.mark.parametrize("per_group,corrected", [(1, [4]), (3, [4, 5, 6]), (4, [4, 5, 6, 7])])
def test_only_the_first_intervene_per_group_failures_are_corrected(tiny, per_group, corrected):
    policy = ScriptedPolicy(tiny)
    mistakes = [
        {},
        {1: "wall"},
        {0: "wall"},
        {2: "finish"},
        {1: "wall"},
        {0: "wall"},
        {2: "wall"},
        {1: "finish"},
    ]
    trajs = sample(policy, [T_MID, T_SHORT], 4, mistakes)
    out, stats = run(policy, trajs, cfg(intervene_per_group=per_group))
    assert stats["intervened"] == len(corrected) == stats["corrected_successes"]
    for i in range(8):
        if i in corrected:
            assert out[i] is not trajs[i] and out[i].reward == 1.0 and out[i].group == 1
        else:
            assert out[i] is trajs[i]


def test_no_triggered_group_returns_the_batch_untouched(tiny):
    policy = ScriptedPolicy(tiny)
    trajs = sample(policy, [T_MID, T_SHORT], 2, [{}, {1: "wall"}, {0: "wall"}, {}])
    out, stats = run(policy, trajs, cfg())
    assert out == trajs and all(a is b for a, b in zip(out, trajs))
    assert stats["groups"] == 2 and stats["groups_triggered"] == 0 and stats["intervened"] == 0
    assert stats["trigger_rate"] == 0.0
    assert policy.sessions == 0 and not any(policy.role_calls.values()) and not policy.score_calls


# ----------------------------------------------------------------------------- 2. the validator's first flag


@pytest.mark.parametrize("k1,k2", [(0, 2), (1, 3), (3, 4)])
def test_validator_flags_exactly_the_first_wrong_step(tiny, k1, k2):
    policy = ScriptedPolicy(
        tiny, corrector=lambda q: wrong_action(q.env, "wall")
    )  # every rewrite is rejected
    trajs = sample(policy, [T_MID], 2, [{k1: "wall", k2: "wall"}, {0: "finish"}])
    orig = trajs[0]
    out, stats = run(policy, trajs, cfg(intervene_per_group=1, corrector_sees="hint"))
    assert stats["steps_checked"] == k1 + 1 and stats["steps_flagged"] == 1
    assert (
        stats["corrections_rejected"] == 1 and stats["correction_attempts"] == 3 and out[0] is orig
    )
    env = envs.run_actions(orig.task, orig.actions[:k1])
    reason = env.check_step(orig.actions[k1]).reason
    assert reason.startswith("wall") and reason.endswith(env.hint())
    calls = policy.role_calls["corrector"]
    assert len(calls) == 3
    for (
        q
    ) in calls:  # the corrector saw the episode up to the flagged step plus the validator's reason
        assert q.actions == orig.actions[:k1] and q.hint == reason
        block = f"<hint> {reason} </hint>"  # the reason already ends with the hint: stated once
        if k1 == 0:
            assert q.ids == policy.chat.prompt_ids(orig.observations[0] + " " + block)
        else:
            assert q.ids == orig.ids[: orig.turns[k1 - 1][1]] + policy.chat.turn_ids(
                orig.observations[k1] + " " + block
            )


def test_replay_validates_trajectories_of_different_lengths_in_lockstep(tiny):
    policy = ScriptedPolicy(tiny, corrector=lambda q: "move")  # unknown action: always rejected
    trajs = sample(
        policy, [T_MID], 4, [{1: "wall", 3: "wall"}, {3: "wall"}, {0: "wall"}, {0: "wall"}]
    )
    out, stats = run(policy, trajs, cfg())
    assert stats["intervened"] == 2
    assert stats["steps_checked"] == (1 + 1) + (3 + 1) and stats["steps_flagged"] == 2
    assert sorted(len(q.actions) for q in policy.role_calls["corrector"]) == [1, 1, 1, 3, 3, 3]
    assert stats["corrections_rejected"] == 2 and stats["correction_attempts"] == 6 and out == trajs


# ----------------------------------------------------------------------------- 3. execution and continuation


def replay_tokens_match(policy, t):
    """Replaying t.actions in a fresh env reproduces the prompt and every observation embedded in t.ids."""
    chat = policy.chat
    env = envs.Navigation(t.task)
    assert t.ids[: t.turns[0][0]] == chat.prompt_ids(env.reset())
    assert len(t.turns) == len(t.actions)
    for k, action in enumerate(t.actions):
        assert chat.action_text(t.ids[slice(*t.turns[k])]) == action
        obs, done = env.step(action)
        if k + 1 < len(t.actions):
            assert not done and t.ids[t.turns[k][1] : t.turns[k + 1][0]] == chat.turn_ids(obs)
            assert t.observations[k + 1] == obs
        else:
            assert done and t.turns[k][1] == len(t.ids)
    result = env.score()
    assert t.reward == float(result.success) and t.rubric == result.items
    return env


@pytest.mark.parametrize("task,k", [(T_LONG, 0), (T_MID, 2), (T_LONG, 3)])
def test_rewrite_is_executed_and_the_policy_continues_from_the_new_state(tiny, task, k):
    def rewrite(q):
        # the last valid move: at T_LONG's start a move, where the policy would call the route
        # tool; valid but not justified by the context, so the validity post-check is the one used
        return [a for a in envs.MOVES if q.env.check_step(a).valid][-1]

    policy = ScriptedPolicy(tiny, corrector=rewrite)
    trajs = sample(policy, [task], 2, [{k: "wall"}, {0: "finish"}])
    orig = trajs[0]
    policy.check_logits = True
    out, stats = run(policy, trajs, cfg(intervene_per_group=1, verifier="valid"))
    t = out[0]
    assert (
        t is not orig and stats["corrections_accepted"] == 1 and stats["corrected_successes"] == 1
    )
    rewritten = rewrite(policy.role_calls["corrector"][0])
    assert t.actions[:k] == orig.actions[:k] and t.actions[k] == rewritten != orig.actions[k]
    assert t.ids[slice(*t.turns[k])] == policy.chat.ids(rewritten) + [policy.chat.eos_id]
    assert (
        t.ids[: orig.turns[k][0]] == orig.ids[: orig.turns[k][0]] and t.turns[:k] == orig.turns[:k]
    )
    # the rest is what the scripted policy sampled, each turn from the trajectory's own tokens so far
    assert len(policy.turn_calls) == len(t.actions) - k - 1
    for j, (ctx, ids, logp) in enumerate(policy.turn_calls):
        turn = k + 1 + j
        assert ctx == t.ids[: t.turns[turn][0]]
        assert ids == t.ids[slice(*t.turns[turn])] and logp == t.sample_logp[slice(*t.turns[turn])]
    env = envs.run_actions(orig.task, t.actions[: k + 1])
    expected = []
    while not env.done:
        expected.append(env.optimal_action())
        env.step(expected[-1])
    assert t.actions[k + 1 :] == expected
    if (task, k) == (
        T_LONG,
        0,
    ):  # a different first move: the whole rest differs from the optimal episode
        assert rewritten != envs.Navigation(
            task
        ).optimal_action() and t.actions != envs.optimal_actions(task)
    env = replay_tokens_match(policy, t)
    assert t.reward == 1.0 and env.wall_hits == 0


# ----------------------------------------------------------------------------- 4. the rubric verifier

BAD_REWRITES = {
    "wall": lambda q: wrong_action(q.env, "wall"),
    "extra words": lambda q: q.env.optimal_action() + " move",
    "hint word": lambda q: q.env.optimal_action() + " " + intervene.HINT_CLOSE,
    "no eos": lambda q: q.env.optimal_action(),  # cut at max_turn_tokens = 2: no closing eos
}


@pytest.mark.parametrize("kind", list(BAD_REWRITES))
@pytest.mark.parametrize("tries", [1, 3])
def test_rubric_verifier_rejects_a_bad_rewrite(tiny, kind, tries):
    policy = ScriptedPolicy(tiny, corrector=BAD_REWRITES[kind])
    trajs = sample(policy, [T_MID], 2, [{2: "wall"}, {0: "finish"}])
    if kind == "no eos":
        policy.max_turn_tokens = 2
    out, stats = run(policy, trajs, cfg(intervene_per_group=1, correction_tries=tries))
    assert out == trajs and out[0] is trajs[0]
    assert (
        stats["corrections_rejected"] == 1
        and stats["correction_attempts"] == stats["attempts_rejected"] == tries
        and stats.get("corrections_accepted", 0) == 0
    )
    assert len(policy.role_calls["corrector"]) == tries and stats["with_accepted"] == 0
    assert stats["accept_rate"] == 0.0 and policy.turn_calls == []


class PermissiveEnv:
    """An env whose step check passes anything: only the verifier's own integrity checks can reject."""

    def check_step(self, action):
        return envs.StepCheck(True)

    def justified(self, action):
        return True


@pytest.mark.parametrize(
    "words,eos,accepted",
    [
        ("move up", True, True),
        ("finish", True, True),
        ("move up </hint>", True, False),
        ("<hint> move up", True, False),
        ("move up", False, False),
        ("", True, True),
    ],
)
def test_rubric_verifier_integrity_checks(tiny, words, eos, accepted):
    policy = ScriptedPolicy(tiny)
    chat = policy.chat
    ids = chat.ids(words) + [chat.eos_id] * eos
    rewrite = intervene.Rewrite(ids, role_logp(len(ids)), chat.action_text(ids))
    verdict = intervene.RubricVerifier(policy).accept(
        [intervene.StepUnderReview(None, PermissiveEnv())], [rewrite]
    )
    assert verdict == [accepted]
    assert intervene.RubricVerifier(policy).accept(
        [intervene.StepUnderReview(None, PermissiveEnv())], [intervene.Rewrite([], [], "")]
    ) == [False]


@pytest.mark.parametrize("kind", list(BAD_REWRITES))
def test_without_verifier_a_bad_rewrite_is_executed(tiny, kind):
    policy = ScriptedPolicy(tiny, corrector=BAD_REWRITES[kind])
    trajs = sample(policy, [T_MID], 2, [{2: "wall"}, {0: "finish"}])
    orig, k = trajs[0], 2
    if kind == "no eos":
        policy.max_turn_tokens = 2
    out, stats = run(policy, trajs, cfg(intervene_per_group=1, verifier="none"))
    assert stats["corrections_accepted"] == 1 and stats.get("corrections_rejected", 0) == 0
    assert len(policy.role_calls["corrector"]) == 1 and stats["with_accepted"] == 1
    q = policy.role_calls["corrector"][0]
    rw_ids = (policy.chat.ids(BAD_REWRITES[kind](q)) + [policy.chat.eos_id])[
        : policy.max_turn_tokens
    ]
    env = envs.run_actions(orig.task, orig.actions[:k] + [policy.chat.action_text(rw_ids)])
    closing = [] if rw_ids[-1] == policy.chat.eos_id else [policy.chat.eos_id]
    # the next turn was sampled right after the executed rewrite and the env's answer to it
    assert policy.turn_calls[0][0] == orig.ids[
        : orig.turns[k][0]
    ] + rw_ids + closing + policy.chat.turn_ids(env.observations[-1])
    if (
        kind == "no eos"
    ):  # the move itself is right: the corrected trajectory succeeds and replaces the failure
        t = out[0]
        assert stats["corrected_successes"] == 1 and t.reward == 1.0
        s, e = t.turns[k]
        assert t.ids[s:e] == rw_ids + [policy.chat.eos_id] and e - s == 3
        assert t.source[s:e] == [INTERVENED, INTERVENED, POLICY] and t.loss_mask[s:e] == [1, 1, 0]
        replay_tokens_match(policy, t)
    elif (
        kind == "wall"
    ):  # the wall hit is executed: the episode fails and the group stays as sampled
        assert env.observations[-1].split()[0] == "error" and env.wall_hits == 1
        assert stats["corrected_successes"] == 0 and out[0] is orig
    else:  # an unknown action only costs a turn: the junk turn enters training as INTERVENED
        assert env.observations[-1].startswith("error unknown action")
        t = out[0]
        assert stats["corrected_successes"] == 1 and t.reward == 1.0
        assert t.actions[k] == policy.chat.action_text(rw_ids) != q.env.optimal_action()
        assert t.ids[slice(*t.turns[k])] == rw_ids and t.source[slice(*t.turns[k])] == [
            INTERVENED
        ] * len(rw_ids)
        replay_tokens_match(policy, t)


# ----------------------------------------------------------------------------- 5. the perplexity gate


def two_failed_groups(tiny, ppl_by_task, **kw):
    policy = ScriptedPolicy(tiny, **kw)
    policy.scores = lambda seq: [-math.log(ppl_by_task[policy.episode(seq)[0].task_id])] * len(seq)
    trajs = sample(
        policy, [T_MID, T_SHORT], 2, [{2: "wall"}, {0: "finish"}, {1: "wall"}, {0: "wall"}]
    )
    return policy, trajs


@pytest.mark.parametrize(
    "ppl_max,gate,kept",
    [(4.0, True, [0]), (1.5, True, []), (100.0, True, [0, 2]), (1.5, False, [0, 2])],
)
def test_ppl_gate_keeps_low_and_drops_high_perplexity(tiny, ppl_max, gate, kept):
    ppl = {T_MID.task_id: 2.0, T_SHORT.task_id: 8.0}
    policy, trajs = two_failed_groups(tiny, ppl)
    out, stats = run(policy, trajs, cfg(ppl_gate=gate, ppl_max=ppl_max))
    assert stats["corrected_successes"] == 2
    assert stats["gate_kept"] == len(kept) and stats["gate_dropped"] == 2 - len(kept)
    for i in (0, 2):
        if i in kept:
            assert out[i] is not trajs[i] and out[i].reward == 1.0
            assert out[i].intervention["ppl"] == pytest.approx(ppl[trajs[i].task.task_id])
        else:
            assert out[i] is trajs[i]
    assert_unchanged(out, trajs, [1, 3])
    kept_ppl = [ppl[trajs[i].task.task_id] for i in kept]
    dropped_ppl = [ppl[trajs[i].task.task_id] for i in (0, 2) if i not in kept]
    for key, xs in (("ppl_kept_mean", kept_ppl), ("ppl_dropped_mean", dropped_ppl)):
        assert math.isnan(stats[key]) if not xs else stats[key] == pytest.approx(sum(xs) / len(xs))
    if kept:
        assert stats["calls_corrected_mean"] == pytest.approx(
            sum(len(out[i].actions) for i in kept) / len(kept)
        )
        assert stats["calls_original_mean"] == pytest.approx(
            sum(len(trajs[i].actions) for i in kept) / len(kept)
        )


def test_ppl_is_the_perplexity_of_the_rewritten_tokens_without_the_hint(tiny):
    policy = ScriptedPolicy(tiny)
    trajs = sample(policy, [T_MID], 2, [{1: "wall"}, {0: "finish"}], then={3: "wall"})
    out, stats = run(policy, trajs, cfg(intervene_per_group=1, gate_scope="intervened"))
    t = out[0]
    assert t.intervention["corrections"] == 2
    assert policy.score_calls == [[t.ids]]  # the gate scored the training sequence itself ...
    hint_ids = set(policy.chat.ids(intervene.HINT_OPEN + " " + intervene.HINT_CLOSE))
    assert not hint_ids & set(t.ids)  # ... which holds no hint
    assert any(intervene.HINT_OPEN in q.text for q in policy.role_calls["corrector"])
    lp = Sampler.score(policy, [t.ids])[0]
    vals = [lp[p] for k in (1, 3) for p in span(t, k)]
    assert len(vals) == 2 * 3  # two rewritten turns of two words and an eos
    expected = math.exp(-sum(vals) / len(vals))
    assert expected > 1.5
    assert t.intervention["ppl"] == pytest.approx(expected, rel=1e-6)
    assert stats["ppl_kept_mean"] == pytest.approx(expected, rel=1e-6)
    # with the gate on, a threshold on either side of that value decides
    for ppl_max, keep in ((expected * 1.01, True), (expected * 0.99, False)):
        trajs2 = sample(policy, [T_MID], 2, [{1: "wall"}, {0: "finish"}], then={3: "wall"})
        out2, stats2 = run(
            policy,
            trajs2,
            cfg(intervene_per_group=1, ppl_gate=True, ppl_max=ppl_max, gate_scope="intervened"),
        )
        assert (out2[0] is not trajs2[0]) == keep and stats2["gate_kept"] == int(keep)


# ----------------------------------------------------------------------------- 6. the INTERVENED mark


def test_intervened_mark_covers_exactly_the_rewritten_tokens(tiny):
    policy = ScriptedPolicy(tiny)
    trajs = sample(policy, [T_MID], 2, [{1: "wall"}, {0: "finish"}], then={3: "wall"})
    out, stats = run(policy, trajs, cfg(intervene_per_group=1))
    t = out[0]
    assert stats["steps_flagged"] == 2 and stats["corrections_accepted"] == 2
    assert t.intervention["corrections"] == 2 and t.reward == 1.0
    assert len(t.ids) == len(t.source) == len(t.loss_mask) == len(t.sample_logp)
    rewritten = {p for k in (1, 3) for p in span(t, k)}
    agent = {p for k in range(len(t.turns)) for p in span(t, k)}
    for k in (1, 3):  # the corrector's answer and its log-probs, eos included
        s, e = t.turns[k]
        assert t.ids[e - 1] == policy.chat.eos_id and t.sample_logp[s:e] == role_logp(e - s)
        assert t.actions[k] == envs.run_actions(t.task, t.actions[:k]).optimal_action()
    for p in range(len(t.ids)):
        assert t.source[p] == (INTERVENED if p in rewritten else POLICY)
        assert t.loss_mask[p] == (1 if p in agent else 0)
        if p not in agent:
            assert t.sample_logp[p] == 0.0
    for k in set(range(len(t.turns))) - {
        1,
        3,
    }:  # policy turns keep the log-probs they were sampled with
        assert t.sample_logp[slice(*t.turns[k])] == turn_logp(k, len(span(t, k)))
    # the wall move the policy sampled at turn 3 was retracted and replaced by the rewrite
    assert policy.turn_calls[1][0] == t.ids[: t.turns[3][0]]
    wall_ids = policy.turn_calls[1][1]
    assert policy.chat.action_text(wall_ids) == wrong_action(
        envs.run_actions(t.task, t.actions[:3]), "wall"
    )
    assert t.ids[slice(*t.turns[3])] != wall_ids


def test_retracted_turn_leaves_the_cache_consistent(tiny):
    """After a continuation step is retracted and rewritten, later turns are sampled from exactly the new tokens."""
    policy = ScriptedPolicy(tiny)
    trajs = sample(policy, [T_LONG], 2, [{0: "wall"}, {0: "finish"}], then={2: "wall", 4: "wall"})
    policy.check_logits = True
    out, stats = run(policy, trajs, cfg(intervene_per_group=1))
    t = out[0]
    assert t.intervention["corrections"] == 3 and t.reward == 1.0
    turns = []
    for (
        ctx,
        _,
        _,
    ) in policy.turn_calls:  # every turn was sampled from the trajectory's tokens before it
        k = len(policy.episode(ctx)[1])
        assert ctx == t.ids[: t.turns[k][0]]
        turns.append(k)
    assert turns == list(
        range(1, len(t.turns))
    )  # turns 2 and 4 were sampled (a wall), retracted, rewritten
    replay_tokens_match(policy, t)


# ----------------------------------------------------------------------------- 7. LLM roles


@pytest.mark.parametrize("garbage", ["", "move up", "the valid", "not invalid", "the invalid wall"])
def test_llm_validator_garbage_flags_nothing(tiny, garbage):
    policy = ScriptedPolicy(tiny, validator=lambda q: garbage)
    trajs = sample(policy, [T_MID], 2, [{2: "wall"}, {0: "finish"}])
    out, stats = run(
        policy, trajs, cfg(validator="llm", intervene_per_group=1, corrector_sees="hint")
    )
    assert out == trajs and out[0] is trajs[0]
    assert stats.get("steps_flagged", 0) == 0 and stats["steps_checked"] == len(trajs[0].actions)
    assert policy.role_calls["corrector"] == [] and stats["with_accepted"] == 0
    asked = policy.role_calls[
        "validator"
    ]  # every step was put to the validator, in order, with its history
    assert [q.action for q in asked] == trajs[0].actions
    assert [q.actions for q in asked] == [
        trajs[0].actions[:k] for k in range(len(trajs[0].actions))
    ]


@pytest.mark.parametrize(
    "answer,reason",
    [
        ("invalid", "llm flagged"),
        ("invalid wall", "wall"),
        ("invalid detour move up", "detour move up"),
    ],
)
def test_llm_validator_invalid_flags_and_its_reason_reaches_the_corrector(tiny, answer, reason):
    k = 3
    policy = ScriptedPolicy(tiny, validator=lambda q: answer if len(q.actions) == k else "valid")
    trajs = sample(
        policy, [T_MID], 2, [{1: "wall"}, {0: "finish"}]
    )  # the real mistake is at 1: not flagged
    out, stats = run(
        policy, trajs, cfg(validator="llm", intervene_per_group=1, corrector_sees="hint")
    )
    assert stats["steps_flagged"] == 1
    q = policy.role_calls["corrector"][0]
    assert q.actions == trajs[0].actions[:k]
    assert q.hint == intervene.format_hint(reason, q.env.hint())[len("<hint> ") : -len(" </hint>")]
    assert reason in q.hint and q.env.hint() in q.hint
    assert (
        stats["corrections_accepted"] == 1 and stats["corrected_successes"] == 0
    )  # the wall hit at 1 stays
    assert out[0] is trajs[0]


@pytest.mark.parametrize(
    "answer,accepted",
    [
        ("accept", True),
        ("accept move up", True),
        ("reject", False),
        ("", False),
        ("valid", False),
        ("the accept", False),
    ],
)
def test_llm_verifier_accepts_only_accept(tiny, answer, accepted):
    policy = ScriptedPolicy(tiny, verifier=lambda q: answer)
    trajs = sample(policy, [T_MID], 2, [{2: "wall"}, {0: "finish"}])
    out, stats = run(policy, trajs, cfg(verifier="llm", intervene_per_group=1))
    asked = policy.role_calls["verifier"]
    assert asked and all(
        q.action == q.env.optimal_action() for q in asked
    )  # the rewrite, at the right state
    assert all(q.actions == trajs[0].actions[:2] for q in asked)
    if accepted:
        assert stats["corrections_accepted"] == 1 and stats.get("corrections_rejected", 0) == 0
        assert out[0] is not trajs[0] and out[0].reward == 1.0
    else:
        assert (
            stats["corrections_rejected"] == 1
            and stats["correction_attempts"] == 3
            and stats.get("corrections_accepted", 0) == 0
        )
        assert out[0] is trajs[0] and len(asked) == 3


@pytest.mark.parametrize(
    "answer,valid,reason",
    [
        ("valid", True, ""),
        ("", True, ""),
        ("move up", True, ""),
        ("not invalid", True, ""),
        ("invalidate x", True, ""),
        ("valid invalid", True, ""),
        ("invalid", False, "llm flagged"),
        ("  invalid  ", False, "llm flagged"),
        ("invalid wall move up hits a wall", False, "wall move up hits a wall"),
        ("invalid   detour\tmove  up", False, "detour move up"),
    ],
)
def test_parse_validator(answer, valid, reason):
    assert intervene.parse_validator(answer) == envs.StepCheck(valid, reason)


# ----------------------------------------------------------------------------- 8. statistics


def test_statistics_count_what_happened(tiny):
    def corrector(q):  # T_SHORT: a wall move first, then the right one; T_LONG: always a wall move
        if q.task is T_SHORT and q.attempt >= 1:
            return q.env.optimal_action()
        return wrong_action(q.env, "wall")

    policy = ScriptedPolicy(tiny, corrector=corrector)
    mistakes = [
        {},
        {0: "wall"},  # group 0: a success, not triggered
        {1: "wall"},
        {0: "wall"},  # group 1: row 2 flagged at 1, corrected on the 2nd try
        {2: "wall"},
        {0: "finish"},
    ]  # group 2: row 4 flagged at 2, every try rejected
    trajs = sample(policy, [T_MID, T_SHORT, T_LONG], 2, mistakes)
    out, stats = run(policy, trajs, cfg())
    expected = {
        "groups": 3,
        "groups_triggered": 2,
        "intervened": 2,
        "steps_checked": (2 + 3)
        + 3,  # replay: 2 steps of row 2, 3 of row 4; continuation: turns 2-4 of row 2
        "steps_flagged": 2,
        "corrections_accepted": 1,
        "corrections_rejected": 1,
        "correction_attempts": 2 + 3,
        "attempts_rejected": 1 + 3,  # row 2's first try, row 4's three
        "with_accepted": 1,
        "corrected_successes": 1,
        "gate_kept": 1,
        "gate_dropped": 0,
        "calls_corrected_mean": 5,
        "calls_original_mean": 6,
    }
    assert {k: stats[k] for k in expected} == expected
    assert stats["trigger_rate"] == pytest.approx(2 / 3) and stats["flag_rate"] == pytest.approx(
        2 / 8
    )
    assert (
        stats["accept_rate"] == pytest.approx(1 / 2) and stats["with_accepted_rate"] == 0.5
    )  # per flagged step
    assert stats["corrected_success_rate"] == 1.0 and "role_errors" not in stats
    assert (
        math.isnan(stats["ppl_dropped_mean"])
        and stats["ppl_kept_mean"] == out[2].intervention["ppl"]
    )
    assert_unchanged(out, trajs, [0, 1, 3, 4, 5])
    assert out[2].reward == 1.0 and len(out[2].actions) == 5
    assert len(policy.role_calls["corrector"]) == 2 + 2 + 1


# ----------------------------------------------------------------------------- 9. bad input


def raise_(*a, **k):
    raise RuntimeError("role broke")


@pytest.mark.parametrize(
    "where,patch",
    [
        (
            "corrector",
            lambda self, cases: [intervene.Rewrite([5, 3], [0.0, 0.0], "x")] * (len(cases) + 1),
        ),
        ("verifier", lambda self, cases, rewrites: []),
    ],
)
def test_a_wrong_number_of_answers_is_a_rejection_and_the_run_goes_on(
    tiny, monkeypatch, where, patch
):
    cls = intervene.SelfCorrector if where == "corrector" else intervene.RubricVerifier
    monkeypatch.setattr(cls, "rewrite" if where == "corrector" else "accept", patch)
    policy = ScriptedPolicy(tiny)
    trajs = sample(
        policy, [T_MID, T_SHORT], 2, [{2: "wall"}, {0: "finish"}, {1: "wall"}, {0: "wall"}]
    )
    out, stats = run(policy, trajs, cfg(correction_tries=2))
    assert out == trajs and all(a is b for a, b in zip(out, trajs))
    assert stats["role_errors"] == 2  # one failed call per try (both cases in one batch)
    assert (
        stats["corrections_rejected"] == 2
        and stats["correction_attempts"] == 2 * 2
        and stats.get("corrections_accepted", 0) == 0
    )
    assert stats["with_accepted"] == 0 and stats["steps_flagged"] == 2


@pytest.mark.parametrize("where", ["validator", "corrector", "verifier"])
def test_a_role_that_raises_stops_the_run(tiny, monkeypatch, where):
    """A bug in a role is not a rejection: it propagates, so no statistic hides it."""
    cls, method = {
        "validator": (intervene.RubricValidator, "check"),
        "corrector": (intervene.SelfCorrector, "rewrite"),
        "verifier": (intervene.RubricVerifier, "accept"),
    }[where]
    monkeypatch.setattr(cls, method, raise_)
    policy = ScriptedPolicy(tiny)
    trajs = sample(policy, [T_MID], 2, [{2: "wall"}, {0: "finish"}])
    with pytest.raises(RuntimeError, match="role broke"):
        run(policy, trajs, cfg(intervene_per_group=1))


def test_a_role_raising_inside_generate_stops_the_run(tiny):
    policy = ScriptedPolicy(tiny, corrector=raise_)
    trajs = sample(policy, [T_MID], 2, [{2: "wall"}, {0: "finish"}])
    with pytest.raises(RuntimeError, match="role broke"):
        run(policy, trajs, cfg(intervene_per_group=1))


def test_a_validator_with_a_wrong_number_of_answers_flags_nothing(tiny, monkeypatch):
    broken = lambda self, cases: [envs.StepCheck(False, "wall")] * (len(cases) + 1)  # noqa: E731
    monkeypatch.setattr(intervene.RubricValidator, "check", broken)
    policy = ScriptedPolicy(tiny)
    trajs = sample(policy, [T_MID], 2, [{2: "wall", 4: "wall"}, {0: "finish"}])
    out, stats = run(policy, trajs, cfg(intervene_per_group=1))
    assert out[0] is trajs[0] and stats.get("steps_flagged", 0) == 0
    assert stats["steps_checked"] == len(
        trajs[0].actions
    )  # every step was put to it; none was flagged
    assert stats["role_errors"] == len(
        trajs[0].actions
    )  # one failed call per step, none for "no steps"
    assert policy.role_calls["corrector"] == []


def test_replay_never_asks_the_validator_about_no_steps(tiny, monkeypatch):
    sizes, check = [], intervene.RubricValidator.check
    monkeypatch.setattr(
        intervene.RubricValidator,
        "check",
        lambda self, cases: sizes.append(len(cases)) or check(self, cases),
    )
    policy = ScriptedPolicy(tiny)
    trajs = sample(policy, [T_MID], 2, [{}, {}])
    for t in trajs:
        t.reward = 0.0
    run(policy, trajs, cfg(intervene_per_group=1))
    assert sizes == [1] * len(trajs[0].actions)


def test_a_failed_trajectory_with_nothing_to_correct_is_left_as_it_was(tiny):
    policy = ScriptedPolicy(tiny)
    trajs = sample(policy, [T_MID], 2, [{}, {}])
    for t in trajs:  # a reward the rubric validator cannot explain (e.g. from another scorer)
        t.reward = 0.0
    before = snapshot(trajs)
    out, stats = run(policy, trajs, cfg())
    assert all(a is b for a, b in zip(out, trajs)) and snapshot(out) == before
    assert stats["intervened"] == 1 and stats["steps_checked"] == len(trajs[0].actions)
    assert stats.get("steps_flagged", 0) == 0 and stats["with_accepted"] == 0
    assert policy.role_calls["corrector"] == [] and policy.score_calls == []


def test_unknown_role_names_are_refused():
    for field in ("validator", "corrector", "verifier"):
        with pytest.raises(ValueError, match=f"{field}: must be one of"):
            RTIConfig(**{field: "oracle"})


def test_config_fields_carry_their_help_and_choices():
    """The trainer's parser reads metadata["help"], metadata.get("choices") and the type string;
    __post_init__ checks the same choices."""
    fields = {f.name: f for f in dataclasses.fields(RTIConfig)}
    for name, f in fields.items():
        assert isinstance(f.metadata.get("help"), str) and f.metadata["help"].strip(), name
    choices = {name: f.metadata["choices"] for name, f in fields.items() if "choices" in f.metadata}
    assert choices == {
        "validator": ("rubric", "llm"),
        "corrector": ("self", "rule"),
        "corrector_sees": ("hint", "evidence"),
        "verifier": ("rubric", "valid", "llm", "none"),
        "group_mode": ("paired", "replace"),
        "gate_scope": intervene.GATE_SCOPES,
    }
    assert choices["validator"] == tuple(intervene.VALIDATORS)
    assert choices["corrector"] == tuple(intervene.CORRECTORS)
    assert choices["verifier"] == tuple(intervene.VERIFIERS)
    assert {name: f.type for name, f in fields.items()} == {
        "validator": "str",
        "corrector": "str",
        "corrector_sees": "str",
        "verifier": "str",
        "group_mode": "str",
        "intervene_per_group": "int",
        "ppl_gate": "bool",
        "ppl_max": "float",
        "gate_scope": "str",
        "correction_tries": "int",
        "max_corrections": "int",
    }
    for name, allowed in choices.items():
        assert getattr(RTIConfig(), name) in allowed
        for value in allowed:
            assert getattr(RTIConfig(**{name: value}), name) == value
        message = f"--{name.replace('_', '-')}: must be one of {tuple(allowed)}, got 'other'"
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            RTIConfig(**{name: "other"})


def test_config_from_trainer_flags():
    c = runtime.make_config(
        rti.Config, ppl_max=3.5, verifier="none", corrector="rule", max_corrections=2
    ).rti
    assert (c.ppl_max, c.verifier, c.corrector, c.max_corrections, c.validator) == (
        3.5,
        "none",
        "rule",
        2,
        "rubric",
    )


def test_empty_rewrite_without_verifier_does_not_crash(tiny):
    policy = ScriptedPolicy(tiny, corrector=lambda q: "")
    trajs = sample(policy, [T_MID], 2, [{2: "wall"}, {0: "finish"}])
    sample_turns = (
        policy.generate
    )  # the episodes' turns stay scripted; every role's answer is empty

    def generate(contexts, max_new=None, streams=None):
        if streams is not None:
            return sample_turns(contexts, max_new, streams)
        return [[] for _ in contexts], [[] for _ in contexts]

    policy.generate = generate
    out, stats = run(policy, trajs, cfg(intervene_per_group=1, verifier="none"))
    assert stats["corrections_accepted"] == 1 and stats["with_accepted"] == 1


# ----------------------------------------------------------------------------- 10. max_corrections, rule corrector


@pytest.mark.parametrize(
    "cap,accepted,checked,success",
    [
        (1, 1, 1, False),
        (2, 2, 2, False),
        (3, 3, 3, False),
        (4, 4, 1 + 3, True),
        (8, 4, 1 + 10, True),
    ],
)
def test_max_corrections_caps_corrections_per_trajectory(tiny, cap, accepted, checked, success):
    policy = ScriptedPolicy(tiny)
    # the original fails at 0; after each correction the policy hits a wall again at turns 1, 2, 3
    trajs = sample(
        policy, [T_LONG], 2, [{0: "wall"}, {0: "finish"}], then={1: "wall", 2: "wall", 3: "wall"}
    )
    out, stats = run(
        policy, trajs, cfg(corrector="rule", intervene_per_group=1, max_corrections=cap)
    )
    assert stats["corrections_accepted"] == accepted == stats["steps_flagged"]
    assert (
        stats["steps_checked"] == checked
    )  # reviewed steps only: 1 in replay, then while under the cap
    assert stats["corrected_successes"] == int(success) and (out[0] is not trajs[0]) == success
    if success:
        assert out[0].intervention["corrections"] == 4


def test_max_corrections_zero_corrects_nothing(tiny):
    policy = ScriptedPolicy(tiny)
    trajs = sample(policy, [T_MID], 2, [{2: "wall"}, {0: "finish"}])
    out, stats = run(policy, trajs, cfg(corrector="rule", intervene_per_group=1, max_corrections=0))
    assert stats.get("corrections_accepted", 0) == 0 and out[0] is trajs[0]


def test_rule_corrector_writes_the_optimal_action_with_log_prob_zero(tiny):
    policy = ScriptedPolicy(tiny, corrector=raise_)  # the self-corrector must not be asked
    trajs = sample(policy, [T_LONG], 2, [{1: "wall"}, {0: "finish"}], then={3: "wall"})
    out, stats = run(policy, trajs, cfg(corrector="rule", intervene_per_group=1))
    t = out[0]
    assert policy.role_calls["corrector"] == [] and "role_errors" not in stats
    assert t.intervention["corrections"] == 2 and t.reward == 1.0
    for k in (1, 3):
        s, e = t.turns[k]
        optimal = envs.run_actions(t.task, t.actions[:k]).optimal_action()
        assert t.actions[k] == optimal and t.ids[s:e] == policy.chat.ids(optimal) + [
            policy.chat.eos_id
        ]
        assert t.sample_logp[s:e] == [0.0] * (e - s) and t.source[s:e] == [INTERVENED] * (e - s)
    assert t.actions == envs.optimal_actions(T_LONG)
    replay_tokens_match(policy, t)


# ----------------------------------------------------------------------------- 11. format_hint


@pytest.mark.parametrize(
    "reason,hint,expected",
    [
        (
            "wall move up hits a wall ; next A 3 1 do route",
            "next A 3 1 do route",
            "<hint> wall move up hits a wall ; next A 3 1 do route </hint>",
        ),
        ("llm flagged", "next A 3 1 do route", "<hint> llm flagged ; next A 3 1 do route </hint>"),
        ("wall", "next finish do finish", "<hint> wall ; next finish do finish </hint>"),
        ("", "next B 0 2 do move left", "<hint> next B 0 2 do move left </hint>"),
        ("llm flagged", "", "<hint> llm flagged </hint>"),
    ],
)
def test_format_hint(reason, hint, expected):
    assert intervene.format_hint(reason, hint) == expected


def test_format_hint_on_the_env_reasons_states_the_hint_once():
    env = envs.Navigation(T_MID)
    for action in envs.ACTIONS:
        check = env.check_step(action)
        if not check.valid:
            block = intervene.format_hint(check.reason, env.hint())
            assert block == f"<hint> {check.reason} </hint>" and block.count(" do ") == 1


def test_run_totals_add_counts_and_take_means_over_the_run():
    a = evaluate.intervention_rates(
        dict(
            groups=4,
            groups_triggered=2,
            steps_checked=10,
            steps_flagged=4,
            corrections_accepted=3,
            corrections_rejected=1,
            intervened=4,
            with_accepted=3,
            corrected_successes=2,
            gate_kept=2,
            ppl_kept_sum=6.0,
            gate_dropped=1,
            ppl_dropped_sum=9.0,
            calls_corrected_sum=12,
            calls_original_sum=12,
        )
    )
    b = evaluate.intervention_rates(
        dict(
            groups=4,
            groups_triggered=1,
            steps_checked=2,
            steps_flagged=4,
            corrections_accepted=1,
            corrections_rejected=3,
            intervened=2,
            with_accepted=1,
            corrected_successes=1,
            gate_kept=1,
            ppl_kept_sum=6.0,
            calls_corrected_sum=9,
            calls_original_sum=10,
        )
    )
    assert (
        a["ppl_kept_mean"] == 3.0 and b["ppl_dropped_mean"] != b["ppl_dropped_mean"]
    )  # NaN: nothing dropped
    s = evaluate.run_totals([a, b, evaluate.intervention_rates(dict(groups=4, groups_triggered=0))])
    assert (s["groups"], s["groups_triggered"], s["gate_kept"], s["gate_dropped"]) == (12, 3, 3, 1)
    assert s["trigger_rate"] == pytest.approx(3 / 12) and s["accept_rate"] == pytest.approx(4 / 8)
    assert s["ppl_kept_mean"] == pytest.approx(4.0) and s["ppl_dropped_mean"] == pytest.approx(9.0)
    assert s["calls_corrected_mean"] == pytest.approx(7.0) and s[
        "calls_original_mean"
    ] == pytest.approx(22 / 3)
    assert s["corrected_success_rate"] == pytest.approx(3 / 4) and s["flag_rate"] == pytest.approx(
        8 / 12
    )
    assert (
        s["reject_rate"] == pytest.approx(4 / 8)
        and s["corrections_accepted"] + s["corrections_rejected"] == 8
    )
    text = evaluate.intervention_report(s)
    assert "triggered: 3 / 12 (25.0%)" in text and "kept 3 (mean PPL 4.00)" in text
    assert "corrections rejected by the verifier: 4 / 8 (50.0%); of every attempt:" in text
    s.update(attempts_rejected=5, correction_attempts=9)
    s = evaluate.intervention_rates(s)
    assert "of every attempt: 5 / 9 (55.6%)" in evaluate.intervention_report(s)


def test_the_report_gives_the_reweightings_figures_over_the_run():
    """Trained intervened tokens, their calibrated weights and the ratio clip, summed over steps
    (a step without intervened tokens adds its trained tokens only)."""
    steps = [
        dict(trained_tokens=100, intervened_tokens=10, intervened_weight_sum=11.0),
        dict(trained_tokens=300, intervened_tokens=0, intervened_weight_sum=0.0),
        dict(trained_tokens=100, intervened_tokens=30, intervened_weight_sum=27.0),
    ]
    for st, clipped in zip(steps, (1, 0, 3)):
        st.update(intervened_ratio_tokens=st["intervened_tokens"], intervened_clipped=clipped)
    s = evaluate.run_totals([evaluate.intervention_rates(st) for st in steps])
    assert s["intervened_token_share"] == pytest.approx(40 / 500)
    assert s["intervened_weight_mean"] == pytest.approx(38 / 40)
    assert s["intervened_clip_rate"] == pytest.approx(4 / 40)
    assert (
        "trained intervened tokens (the reweighting's): 40 / 500 (8.0%); calibrated weight mean "
        "0.95; ratio clip active on 10.0%" in evaluate.intervention_report(s)
    )


# ----------------------------------------------------------------------------- 9. paired groups (--group-mode paired)


def test_paired_mode_corrects_every_trajectory_keeps_the_originals_and_goes_on_after_a_rejection(
    tiny,
):
    """One triggered group of 4 on T_MID. Row 1's first flagged step (turn 0) gets only rejected rewrites, so its
    original wall move stands and the replay goes on to its next flagged step (turn 2), which is corrected; the wall
    hit at turn 0 still fails it. The other rows are corrected at their only mistake and succeed. The originals stay,
    the 3 successful corrections join the group (same `group`), and the advantages are taken over all 7."""

    def corrector(q):  # a wall move (rejected) for the first step of an episode, else the right one
        return wrong_action(q.env, "wall") if not q.actions else q.env.optimal_action()

    policy = ScriptedPolicy(tiny, corrector=corrector)
    trajs = sample(
        policy, [T_MID], 4, [{1: "wall"}, {0: "wall", 2: "wall"}, {2: "finish"}, {3: "wall"}]
    )
    out, stats = run(policy, trajs, cfg(group_mode="paired"))
    assert out[:4] == trajs and all(a is b for a, b in zip(out, trajs)) and len(out) == 4 + 3
    assert stats["intervened"] == 4 and stats["steps_flagged"] == 5
    assert (
        stats["corrections_accepted"],
        stats["corrections_rejected"],
        stats["correction_attempts"],
    ) == (4, 1, 4 + 3)
    assert (
        stats["with_accepted"] == 4
        and stats["corrected_successes"] == 3
        and stats["gate_kept"] == 3
    )
    corrected = out[4:]
    assert [t.group for t in corrected] == [0, 0, 0] and all(t.reward == 1.0 for t in corrected)
    assert corrected[0].actions[:2] == trajs[0].actions[:1] + [
        envs.run_actions(T_MID, trajs[0].actions[:1]).optimal_action()
    ]  # row 0, fixed at turn 1
    adv = loss_mod.advantages_by_group(
        torch.tensor([t.reward for t in out]), [t.group for t in out]
    )
    mean, std = (
        3 / 7,
        math.sqrt((4 * (3 / 7) ** 2 + 3 * (4 / 7) ** 2) / 6),
    )  # unbiased, as group_advantages
    assert adv.tolist() == pytest.approx([-mean / std] * 4 + [(1 - mean) / std] * 3, rel=1e-5)


@pytest.mark.parametrize("mode", ["paired", "replace"])
def test_gated_out_corrections_never_join_the_batch(tiny, mode):
    """Corrections of T_MID (PPL 2) pass the gate at 4, those of T_SHORT (PPL 8) do not. Paired: both failures of
    each group are corrected, the two T_MID corrections join group 0 and the originals all stay; replace: one per
    group is corrected, and only the kept one replaces its original."""
    policy, trajs = two_failed_groups(tiny, {T_MID.task_id: 2.0, T_SHORT.task_id: 8.0})
    out, stats = run(
        policy, trajs, cfg(ppl_gate=True, ppl_max=4.0, group_mode=mode, intervene_per_group=1)
    )
    if mode == "paired":
        assert (stats["intervened"], stats["gate_kept"], stats["gate_dropped"]) == (4, 2, 2)
        assert len(out) == 6 and out[:4] == trajs and [t.group for t in out[4:]] == [0, 0]
        assert all(t.task is T_MID and t.reward == 1.0 for t in out[4:])
    else:
        assert (stats["intervened"], stats["gate_kept"], stats["gate_dropped"]) == (2, 1, 1)
        assert (
            len(out) == 4
            and out[0] is not trajs[0]
            and out[0].reward == 1.0
            and out[1:] == trajs[1:]
        )


@pytest.mark.parametrize("scope", ["intervened", "agent", "trajectory"])
def test_gate_scope_picks_the_tokens_the_perplexity_is_over(tiny, scope):
    policy, trajs = two_failed_groups(tiny, {T_MID.task_id: 2.0, T_SHORT.task_id: 2.0})
    policy.scores = lambda seq: [
        -float(i % 3) for i in range(len(seq))
    ]  # a different log-prob at each position
    out, _ = run(policy, trajs, cfg(intervene_per_group=1, gate_scope=scope))
    t = out[0]
    pick = {
        "intervened": [s == INTERVENED and m for s, m in zip(t.source, t.loss_mask)],
        "agent": t.loss_mask,
        "trajectory": [i >= t.turns[0][0] for i in range(len(t.ids))],
    }[scope]
    vals = [-float(i % 3) for i, p in enumerate(pick) if p]
    assert t.intervention["ppl"] == pytest.approx(math.exp(-sum(vals) / len(vals)))


# ----------------------------------------------------------------------------- evidence and integrity


def copy_the_evidence(q) -> str:
    """A corrector that copies the first direction of the evidence's path when one is shown, as a
    policy shown what the grader knows may."""
    path = re.search(r"path (\w+)", q.hint)
    return f"move {path.group(1)}" if path else q.env.optimal_action()


def test_the_evidence_block_shows_the_path_and_not_the_action():
    env = envs.Navigation(T_LONG)
    env.reset()
    wrong = wrong_action(env, "wall")
    case = intervene.StepUnderReview(None, env, wrong, env.check_step(wrong).reason)
    hint = intervene.corrector_note(case, "hint")
    evidence = intervene.corrector_note(case, "evidence")
    assert hint.endswith("do route </hint>") and "path" not in hint
    assert f"path {' '.join(d.split()[1] for d in envs.optimal_actions(T_LONG)[1:2])}" in evidence
    assert "do route" not in evidence and evidence.startswith(f"<hint> wall {wrong}")


def test_the_post_check_rejects_a_copied_direction_and_accepts_what_the_context_justifies(tiny):
    """At the start no route is held: a shortest move is valid (the step check passes it) but the
    agent cannot know it; `route` is what its context shows. With a route held, its next move is
    justified."""
    policy = ScriptedPolicy(tiny)
    chat = policy.chat
    env = envs.Navigation(T_LONG)
    env.reset()
    leaked = env.shortest_moves()[0]
    case = intervene.StepUnderReview(None, env, wrong_action(env, "wall"))

    def verdicts(verifier, action):
        ids = chat.ids(action) + [chat.eos_id]
        rewrite = intervene.Rewrite(ids, role_logp(len(ids)), action)
        return verifier(policy).accept([case], [rewrite])[0]

    assert env.check_step(leaked).valid and intervene.rewrite_kind(env, leaked) == "leaked"
    assert not verdicts(intervene.RubricVerifier, leaked)
    assert verdicts(intervene.ValidityVerifier, leaked)  # validity alone lets it through
    assert verdicts(intervene.RubricVerifier, "route")
    env.step("route")
    assert verdicts(intervene.RubricVerifier, leaked)  # now the held route shows it
    assert intervene.rewrite_kind(env, leaked) == "justified"


@pytest.mark.parametrize("verifier,leaks_in", [("none", True), ("valid", True), ("rubric", False)])
def test_without_the_post_check_a_copied_direction_enters_the_trained_trajectory(
    tiny, verifier, leaks_in
):
    policy = ScriptedPolicy(tiny, corrector=copy_the_evidence)
    trajs = sample(policy, [T_LONG], 2, [{0: "wall"}, {0: "finish"}])
    config = cfg(intervene_per_group=1, corrector_sees="evidence", verifier=verifier)
    out, stats = run(policy, trajs, config)
    assert stats["rewrites_leaked"] >= 1  # the corrector copied the evidence
    if leaks_in:
        corrected = out[0]
        assert corrected is not trajs[0] and corrected.reward == 1.0
        first = corrected.turns[0]
        assert corrected.source[first[0]] == INTERVENED and corrected.actions[0] in envs.MOVES
        assert corrected.intervention["leaked"] >= 1
        assert stats["kept_leaked_turns"] >= 1 and stats["accepted_leaked"] >= 1
    else:
        # every rewrite copied the evidence: rejected, asked again, rejected; nothing enters
        assert stats.get("accepted_leaked", 0) == 0 and stats["corrections_rejected"] >= 1
        assert stats.get("kept_leaked_turns", 0) == 0 and out[0] is trajs[0]


# ----------------------------------------------------------------------------- a policy on plain `model.generate`


class GeneratePolicy:
    """intervene.Policy on plain transformers, as another trainer would write it: `model.generate` samples each turn
    and one forward pass scores. No KV session: every call encodes its contexts afresh and ignores the streams
    (sampling draws from torch's global generator)."""

    def __init__(self, model, tok, max_turn_tokens=4):
        self.model, self.tok, self.max_turn_tokens = model, tok, max_turn_tokens
        self.chat = Chat(tok)  # the chat template's token pieces
        self.make_env = envs.Navigation  # what rti.rollout asks besides

    @torch.no_grad()
    def generate(self, contexts, max_new=None, streams=None):
        ids_out, logp_out = [], []
        for ctx in contexts:
            out = self.model.generate(
                torch.tensor([ctx]),
                max_new_tokens=max_new or self.max_turn_tokens,
                do_sample=True,
                top_k=0,
                eos_token_id=self.chat.eos_id,
                pad_token_id=self.tok.pad_token_id,
                output_logits=True,
                return_dict_in_generate=True,
            )
            ids = out.sequences[0, len(ctx) :].tolist()
            ids_out.append(ids)
            logp_out.append(
                [torch.log_softmax(z[0], -1)[i].item() for z, i in zip(out.logits, ids)]
            )
        return ids_out, logp_out

    @torch.no_grad()
    def score(self, seqs):
        out = []
        for seq in seqs:
            logits = self.model(torch.tensor([seq])).logits[0, :-1]
            logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])
            out.append([0.0] + logp.squeeze(-1).tolist())
        return out


def test_the_whole_intervention_runs_on_a_policy_written_on_plain_generate():
    """Validate, correct, verify, continue and gate with GeneratePolicy on the committed warm start: the counters add
    up, every kept correction is a success whose corrected turns are INTERVENED tokens carrying the corrector's
    log-probs, and the policy's own turns after it come from the continuation."""
    torch.manual_seed(0)
    policy = GeneratePolicy(*load_model(rti.WARMSTART_DIR))
    tasks = envs.make_tasks("test", n=4)
    trajs = rti.rollout(policy, tasks, group_size=2, seed=0)
    cfg = RTIConfig(group_mode="paired", ppl_max=100.0)
    out, counts = intervene.intervene_batch(policy, trajs, cfg, envs.Navigation)
    s = {**dict.fromkeys(intervene.REWRITE_KINDS, 0), **evaluate.intervention_rates(counts)}
    s = collections.Counter(s)
    assert s["groups_triggered"] >= 1 and s["intervened"] == 2 * s["groups_triggered"]
    assert s["steps_flagged"] >= 1 and s["steps_flagged"] <= s["steps_checked"]
    assert s["corrections_accepted"] + s["corrections_rejected"] == s["steps_flagged"]
    attempts = s["rewrites_justified"] + s["rewrites_leaked"] + s["rewrites_invalid"]
    assert attempts == s["correction_attempts"] >= s["steps_flagged"]
    assert (
        s["accepted_leaked"] == s["accepted_invalid"] == 0
    )  # the post-check lets only justified steps in
    assert s["gate_kept"] + s["gate_dropped"] == s["corrected_successes"] <= s["with_accepted"] >= 1
    kept = out[len(trajs) :]  # paired: kept corrections join their group after the originals
    assert len(kept) == s["gate_kept"] >= 1 and "role_errors" not in counts
    for t in kept:
        assert (
            t.reward == 1.0
            and t.intervention["corrections"] >= 1
            and t.intervention["ppl"] <= cfg.ppl_max
        )
        sources = {s for s, m in zip(t.source, t.loss_mask) if m}
        assert sources == {POLICY, INTERVENED} or sources == {INTERVENED}
