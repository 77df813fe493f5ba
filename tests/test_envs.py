"""Tests for envs.py: splits, the route tool, rubric, step checks, robustness, run_actions, task
validation, vocabulary, render (the audit's are in test_audit.py)."""

import doctest
import json
import random
import re
from collections import deque
from dataclasses import asdict

import pytest

import envs
from envs import (
    ACTIONS,
    RUBRIC_ITEMS,
    RULES,
    SPLITS,
    Navigation,
    NavTask,
    make_tasks,
    optimal_actions,
    render,
    run_actions,
)

STEP = {"move up": (-1, 0), "move down": (1, 0), "move left": (0, -1), "move right": (0, 1)}
REVERSE = {
    "move up": "move down",
    "move down": "move up",
    "move left": "move right",
    "move right": "move left",
}


@pytest.fixture(scope="module")
def splits():
    return {name: make_tasks(name) for name in SPLITS}


def ref_dist(task, goal):
    """Independent BFS (not envs.bfs_distances): moves from each cell to `goal`."""
    walls = {tuple(w) for w in task.walls}
    dist = {tuple(goal): 0}
    q = deque([tuple(goal)])
    while q:
        r, c = q.popleft()
        for dr, dc in STEP.values():
            n = (r + dr, c + dc)
            if (
                0 <= n[0] < task.height
                and 0 <= n[1] < task.width
                and n not in walls
                and n not in dist
            ):
                dist[n] = dist[(r, c)] + 1
                q.append(n)
    return dist


def free(task, pos, a):
    r, c = pos[0] + STEP[a][0], pos[1] + STEP[a][1]
    return 0 <= r < task.height and 0 <= c < task.width and [r, c] not in task.walls


def positions(task, actions):
    """Positions before each action, computed without envs (actions assumed legal)."""
    pos = tuple(task.start)
    out = []
    for a in actions:
        out.append(pos)
        if a in STEP and free(task, pos, a):
            pos = (pos[0] + STEP[a][0], pos[1] + STEP[a][1])
    return out


def items(task, actions):
    return run_actions(task, actions).score().items


ALL_PASS = dict.fromkeys(RUBRIC_ITEMS, True)


# ----------------------------------------------------------------------------- splits


def test_same_seed_same_tasks_and_prefix():
    a, b = make_tasks("test"), make_tasks("test")
    assert [asdict(t) for t in a] == [asdict(t) for t in b]
    assert [asdict(t) for t in make_tasks("test", n=10)] == [asdict(t) for t in a[:10]]
    assert [asdict(t) for t in make_tasks("test", n=10, seed=99)] != [asdict(t) for t in a[:10]]
    assert a[7].task_id == "test-0007"
    with pytest.raises(ValueError):
        make_tasks("nope")


def test_train_and_test_do_not_overlap(splits):
    def key(t):
        return json.dumps({k: v for k, v in asdict(t).items() if k != "task_id"})

    assert not {key(t) for t in splits["train"]} & {key(t) for t in splits["test"]}


def test_every_task_solvable_and_optimal_passes(splits):
    for name, tasks in splits.items():
        spec = SPLITS[name]
        assert len(tasks) == spec.n
        for t in tasks:
            assert (t.height, t.width) == (spec.height, spec.width)
            assert spec.k_min <= len(t.waypoints) <= spec.k_max
            assert len(t.walls) == round(spec.density * t.height * t.width)
            points = [t.start] + t.waypoints
            legs = [ref_dist(t, b).get(tuple(a)) for a, b in zip(points, points[1:])]
            assert None not in legs, t.task_id
            acts = optimal_actions(t)
            assert acts.count("route") == len(legs) and acts[0] == "route" and acts[-1] == "finish"
            # one route a leg, shortest moves, then finish
            assert len(acts) == sum(legs) + len(legs) + 1
            assert t.max_turns == len(acts) + spec.slack <= spec.turn_cap
            assert items(t, acts) == ALL_PASS, t.task_id


def test_optimal_moves_break_ties_in_action_order(splits):
    for t in splits["test"][:30] + splits["easy"][:30]:
        acts = [a for a in optimal_actions(t) if a != "route"]
        pos = tuple(t.start)
        nxt = 0
        for a in acts[:-1]:
            d = ref_dist(t, t.waypoints[nxt])
            shortest = [
                b
                for b in ACTIONS[:4]
                if free(t, pos, b) and d[(pos[0] + STEP[b][0], pos[1] + STEP[b][1])] == d[pos] - 1
            ]
            assert a == shortest[0]
            pos = (pos[0] + STEP[a][0], pos[1] + STEP[a][1])
            nxt += list(pos) == t.waypoints[nxt]
        assert nxt == len(t.waypoints) and list(pos) == t.waypoints[-1]


# ----------------------------------------------------------------------------- the route tool


def held_route(obs):
    words = obs.split()
    return words[words.index("route") + 1 : words.index(".")] if "route" in words else []


def test_route_shows_a_shortest_path_and_its_remainder_until_left_or_reached(splits):
    for t in splits["test"][:30]:
        env = Navigation(t)
        route = held_route(env.step("route")[0])
        d = ref_dist(t, t.waypoints[0])
        # a turn, no move
        assert len(route) == d[tuple(t.start)] and env.turns == 1 and env.pos == tuple(t.start)
        pos = tuple(t.start)
        for k, direction in enumerate(route):  # each cell of it is one move closer
            step = STEP[f"move {direction}"]
            assert (
                free(t, pos, f"move {direction}")
                and d[(pos[0] + step[0], pos[1] + step[1])] == d[pos] - 1
            )
            pos = (pos[0] + step[0], pos[1] + step[1])
            obs = env.step(f"move {direction}")[0]
            assert held_route(obs) == route[k + 1 :]  # the remainder opens each observation
        # reached: dropped
        assert list(pos) == t.waypoints[0] and env.visited == 1 and not env.route
        # leaving the route drops it; a wall hit keeps it; calling it again is a repeat
        env = Navigation(t)
        route = held_route(env.step("route")[0])
        blocked = next((a for a in STEP if not free(t, env.pos, a)), None)
        if blocked:
            assert held_route(env.step(blocked)[0]) == route
        assert env.check_step("route").reason.startswith("repeat route is already held ;")
        other = next((a for a in STEP if free(t, env.pos, a) and a != f"move {route[0]}"), None)
        if other:
            assert env.check_step(other).reason.startswith(f"detour {other} leaves the route ;")
            assert held_route(env.step(other)[0]) == [] and env.check_step("route").valid


# ----------------------------------------------------------------------------- rubric


def find_wall_move(task, acts):
    for i, pos in enumerate(positions(task, acts)):
        for a in STEP:
            if not free(task, pos, a):
                return i, a
    raise AssertionError("no blocked neighbour on the path")


def test_wall_hit_fails_only_no_wall_hits(splits):
    for t in splits["test"][:20]:
        acts = optimal_actions(t)
        i, a = find_wall_move(t, acts)
        got = items(t, acts[:i] + [a] + acts[i:])
        assert got == {**ALL_PASS, "no_wall_hits": False}


def test_missing_finish_fails_finish_items(splits):
    for t in splits["test"][:20]:
        got = items(t, optimal_actions(t)[:-1])
        assert got == {**ALL_PASS, "finished_at_goal": False, "within_turn_limit": False}


def test_finish_early_fails_waypoints_and_goal(splits):
    for t in splits["test"][:20]:
        acts = optimal_actions(t)
        got = items(t, acts[: len(acts) // 2] + ["finish"])
        assert got == {**ALL_PASS, "waypoints_in_order": False, "finished_at_goal": False}


def test_detours_within_slack_pass_and_past_max_turns_fail(splits):
    for t in splits["test"][:20]:
        acts = optimal_actions(t)
        a = next(a for a in STEP if free(t, t.start, a))
        slack = t.max_turns - len(acts)
        fits = [a, REVERSE[a]] * (slack // 2) + acts  # exactly max_turns turns
        assert items(t, fits) == ALL_PASS
        over = [a, REVERSE[a]] * (slack // 2 + 1) + acts  # 2 turns too many
        env = run_actions(t, over)
        assert (
            env.done and env.turns == t.max_turns and env.observations[-1].endswith("out of turns")
        )
        got = env.score().items
        assert got["within_turn_limit"] is False and got["finished_at_goal"] is False
        assert got["no_wall_hits"] is True


def test_malformed_action_is_not_a_wall_hit():
    t = NavTask("t", 1, 3, [], [0, 0], [[0, 2]], 9)
    env = run_actions(t, ["jump", "move right", "move right", "finish"])
    assert env.observations[0].startswith("error unknown action pos 0 0")
    assert env.score().items == ALL_PASS and env.turns == 4
    env = run_actions(t, ["move up", "move right", "move right", "finish"])
    assert env.observations[0].startswith("error off grid pos 0 0")
    assert env.score().items["no_wall_hits"] is False


# ----------------------------------------------------------------------------- step checks


def checks_along(task, actions):
    env = Navigation(task)
    out = []
    for a in actions:
        out.append(env.check_step(a))
        env.step(a)
    return out


def detour_moves(task, acts):
    """(index, move) pairs: a free move off every shortest path, tracked without envs."""
    pos = tuple(task.start)
    nxt = 0
    out = []
    for i, a in enumerate(acts[:-1]):
        if a == "route":
            continue
        d = ref_dist(task, task.waypoints[nxt])
        out += [
            (i, b)
            for b in STEP
            if free(task, pos, b) and d[(pos[0] + STEP[b][0], pos[1] + STEP[b][1])] != d[pos] - 1
        ]
        pos = (pos[0] + STEP[a][0], pos[1] + STEP[a][1])
        nxt += list(pos) == task.waypoints[nxt]
    return out


@pytest.mark.parametrize("kind", ["detour", "detour off the route", "wall"])
def test_step_check_flags_exactly_the_wrong_step(splits, kind):
    for t in splits["test"][:10]:
        acts = optimal_actions(t)
        if kind == "detour":  # no route held: the hint is the tool, not the hidden direction
            acts = [a for a in acts if a != "route"]
            cands = detour_moves(t, acts)
            i, b = cands[len(cands) // 2]
            script = acts[:i] + [b, REVERSE[b]] + acts[i:]
            rule = f"detour {b} is not on a shortest path ; next "
            assert checks_along(t, script)[i].reason.endswith(" do route")
        elif kind == "detour off the route":
            i, b = next((i, b) for i, b in detour_moves(t, acts) if acts[i] != "route")
            script = acts[:i] + [b, REVERSE[b]] + acts[i:]
            rule = f"detour {b} leaves the route ; next "
            assert checks_along(t, script)[i].reason.endswith(f" do {acts[i]}")
        else:
            i, b = find_wall_move(t, acts)
            script = acts[:i] + [b] + acts[i:]
            rule = f"wall {b} "
        res = checks_along(t, script)
        assert [k for k, r in enumerate(res) if not r.valid] == [i]
        assert res[i].reason.startswith(rule)
        assert all(r.reason == "" for k, r in enumerate(res) if k != i)


def test_step_check_rules():
    #   0 1 2
    # 0 S . .
    # 1 . . #
    # 2 A . B
    t = NavTask("t", 3, 3, [[1, 2]], [0, 0], [[2, 0], [2, 2]], 9)
    env = Navigation(t)
    assert env.check_step("move up").reason == "wall move up leaves the grid ; next A 2 0 do route"
    assert (
        env.check_step("move right").reason
        == "detour move right is not on a shortest path ; next A 2 0 do route"
    )
    assert (
        env.check_step("finish").reason
        == "early finish before visiting all waypoints ; next A 2 0 do route"
    )
    assert (
        env.check_step(" hop ").reason
        == "unknown action is not a valid tool call ; next A 2 0 do route"
    )
    assert (
        env.check_step("move down") == env.check_step(" move down\n") == env.check_step("move down")
    )
    assert (
        env.check_step("move down").valid
        and env.check_step("route").valid
        and env.hint() == "next A 2 0 do route"
    )
    assert env.step("route") == ("route down down . pos 0 0 next A 2 0 blocked up left", False)
    assert (
        env.check_step("move right").reason
        == "detour move right leaves the route ; next A 2 0 do move down"
    )
    assert (
        env.check_step("route").reason == "repeat route is already held ; next A 2 0 do move down"
    )
    for a in ("move down", "move down"):
        env.step(a)
    assert env.hint() == "next B 2 2 do route" and not env.route
    env.step("move right")  # no route, on a shortest path: fine
    assert (
        env.check_step("move up").reason
        == "detour move up is not on a shortest path ; next B 2 2 do route"
    )
    env.step("move right")
    assert (
        env.check_step("move up").reason
        == "stop move up after visiting all waypoints ; next finish do finish"
    )
    assert (
        env.check_step("route").reason
        == "stop route after visiting all waypoints ; next finish do finish"
    )
    assert env.check_step("finish").valid and env.optimal_action() == "finish"
    env.step("move left")  # wander off the goal: finishing there is early, coming back is the way
    assert env.hint() == "next finish at B 2 2 do route"
    assert (
        env.check_step("finish").reason
        == "early finish away from B ; next finish at B 2 2 do route"
    )
    assert env.step("route") == ("route right . pos 2 1 next finish at B 2 2 blocked down", False)
    assert env.step("move right") == ("pos 2 2 next finish blocked up down right", False)
    assert env.step("finish") == ("episode over pos 2 2 next finish blocked up down right", True)
    assert env.score().items == ALL_PASS and env.turns == 9
    assert env.check_step("finish").reason.startswith("over the episode is over ;")
    assert env.step("move up") == (
        "error episode over pos 2 2 next finish blocked up down right",
        True,
    )
    assert env.turns == 9 and len(env.actions) == 9
    away = ["move down", "move down", "move right", "move right", "move left", "finish"]
    assert items(t, away) == {**ALL_PASS, "finished_at_goal": False}


# ------------------------------------------------------------------------ robustness, run_actions

GARBAGE = [
    "",
    " ",
    "\n",
    "move",
    "move  up",
    "MOVE UP",
    "finish now",
    "move up finish",
    "ⓜove up",
    "移动",
    "\x00",
    "🙂" * 50,
    "x" * 10000,
    "move upp",
    "up",
    "<hint>",
    '{"tool": "move"}',
]


def random_action(rng):
    if rng.random() < 0.7:
        a = rng.choice(ACTIONS[:4] * 6 + ACTIONS[4:])
        return rng.choice([a, f" {a} ", f"{a}\n"]) if rng.random() < 0.1 else a
    if rng.random() < 0.5:
        return rng.choice(GARBAGE)
    return "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(rng.randrange(0, 30)))


def words_ok(text, vocab):
    assert text and text == text.strip() and "  " not in text, repr(text)
    bad = [w for w in text.split(" ") if w not in vocab]
    assert not bad, (bad, text)


# The tiny model numbers its tokens in vocabulary order (policy.load_model), and the committed
# checkpoints depend on it: the words of Navigation's texts, then the labels and numbers.
TEXT_WORDS = (
    "move up down left right route finish visit then grid pos next blocked none error hit wall off"
    " unknown action episode over out of turns at do rubric in order never into a or the within is"
    " not valid tool call detour on shortest path early before visiting all waypoints away from"
    " stop after leaves hits repeat already held ; ."
)


def test_vocabulary_is_the_words_of_the_texts_in_a_fixed_order():
    numbers = [str(i) for i in range(envs.MAX_NUMBER + 1)]
    assert Navigation.vocabulary() == TEXT_WORDS.split() + list(envs.LABELS) + numbers
    for text in envs.TEXTS:  # every word outside the {fields} of every template
        assert set(re.sub(r"\{\w+\}", " ", text).split()) <= set(TEXT_WORDS.split()), text
    assert {why.split()[0] for why in envs.WHY.values()} == set(RULES)


def test_random_episodes_never_raise_and_stay_in_vocabulary(splits):
    vocab = set(Navigation.vocabulary())
    assert len(vocab) == len(Navigation.vocabulary())
    assert {w for a in ACTIONS for w in a.split()} <= vocab
    rng = random.Random(0)
    tasks = (
        splits["test"][:40] + splits["easy"][:40] + [NavTask("t", 1, 2, [], [0, 0], [[0, 1]], 3)]
    )
    n_steps = 0
    for _ in range(300):
        t = rng.choice(tasks)
        env = Navigation(t)
        words_ok(env.reset(), vocab)
        words_ok(env.rubric_text(), vocab)
        while True:
            words_ok(env.hint(), vocab)
            assert env.optimal_action() in ACTIONS
            a = random_action(rng)
            for probe in (a, rng.choice(GARBAGE), *ACTIONS):
                r = env.check_step(probe)
                assert r.valid == (r.reason == "")
                if not r.valid:
                    words_ok(r.reason, vocab)
                    assert r.reason.split()[0] in RULES and " ; next " in r.reason
                    assert r.reason.endswith(env.hint())
            obs, done = env.step(a)
            n_steps += 1
            words_ok(obs, vocab)
            assert done == env.done
            if done:
                words_ok(env.step(rng.choice(GARBAGE))[0], vocab)
                break
        assert env.turns <= t.max_turns and env.turns == len(env.actions)
        s = env.score()
        assert list(s.items) == list(RUBRIC_ITEMS) and 0 <= s.fraction <= 1
    assert n_steps > 3000


def test_replay_is_deterministic(splits):
    rng = random.Random(1)
    for t in splits["test"][:30]:
        acts = [random_action(rng) for _ in range(rng.randrange(1, 60))]
        a, b = run_actions(t, acts), run_actions(t, acts)
        assert a.observations == b.observations and a.score() == b.score()
        first = a.reset()
        assert first == Navigation(t).reset() and a.turns == 0 and not a.done
        assert [a.step(x)[0] for x in b.actions] == b.observations


# ------------------------------------------------------------------------ task validation, render


def test_tasks_round_trip_through_json(splits):
    rows = [json.loads(json.dumps(asdict(t))) for t in splits["test"][:5]]
    assert [asdict(NavTask(**r)) for r in rows] == [asdict(t) for t in splits["test"][:5]]


@pytest.mark.parametrize(
    "change, why",
    [
        ({"height": "7"}, "height"),
        ({"max_turns": 0}, "max_turns"),
        ({"walls": [[0, 0, 1]]}, "walls"),
        ({"waypoints": [[9, 0]]}, "outside"),
        ({"start": [-1, 0]}, "outside"),
        ({"waypoints": [[1, 1]]}, "on a wall"),
        ({"waypoints": []}, "waypoints"),
        ({"waypoints": [[0, 0]]}, "distinct"),
        ({"walls": [[0, 1], [1, 0]]}, "unreachable"),
    ],
)
def test_bad_tasks_are_refused_with_the_reason(change, why):
    good = asdict(NavTask("g", 3, 3, [[1, 1]], [0, 0], [[2, 2]], 9))
    with pytest.raises(ValueError, match=why):
        NavTask(**{**good, **change})


def test_render_shows_walls_waypoints_and_path(splits):
    t = splits["test"][0]
    acts = optimal_actions(t)
    rows = [line.split(" ")[1:] for line in render(t, acts).splitlines()[1:]]
    assert len(rows) == t.height and all(len(r) == t.width for r in rows)
    for r in range(t.height):
        for c in range(t.width):
            want = "#" if [r, c] in t.walls else "S" if [r, c] == t.start else None
            if [r, c] in t.waypoints:
                want = "ABCDEF"[t.waypoints.index([r, c])]
            on_path = (r, c) in positions(t, acts)
            assert rows[r][c] == (want or ("*" if on_path else "."))
    assert "*" not in render(t)
    assert render(t, [list(p) for p in positions(t, acts)]) == render(t, acts)


def test_docstring_examples():
    assert doctest.testmod(envs).failed == 0


def test_evidence_is_the_route_the_tool_would_give_and_justified_needs_the_context():
    """evidence() shows the rest of a shortest path (the route the tool would return), in the env's
    words; justified() admits a move only when a held route shows it."""
    words = set(Navigation.vocabulary())
    for task in make_tasks("test", n=20):
        env = Navigation(task)
        env.reset()
        for action in optimal_actions(task):
            text = env.evidence()
            assert set(text.split()) <= words
            if env.at_end():
                assert text == env.hint() and env.justified("finish")
            elif not env.route:
                directions = text.split(" path ")[1].split()
                probe = Navigation(task)
                for a in env.actions:
                    probe.step(a)
                probe.step("route")
                assert directions == probe.route
                move = f"move {directions[0]}"
                assert env.check_step(move).valid and not env.justified(move)
                assert env.justified("route")
            else:
                assert env.justified(f"move {env.route[0]}") and not env.justified("route")
            env.step(action)
