"""Tests for navigation-keys (extras/navigation_keys.py, KeyNavigation): its splits and families, the oracle on every task,
the door and the key, the `find key` tool, what the context justifies and what leaks, bad actions,
the vocabulary (the audit's are in test_audit.py)."""

import random
from collections import deque
from dataclasses import asdict, fields

import pytest

import envs
import intervene
from envs import (
    ACTIONS,
    CARVED,
    RULES,
    Navigation,
    NavTask,
    make_tasks,
    optimal_actions,
    run_actions,
)
from extras import navigation_keys
from extras.navigation_keys import (
    KEY_ACTIONS,
    KEY_SPLITS,
    SHARE_SPLITS,
    KeyNavigation,
    KeyTask,
    make_key_tasks,
)

STEP = {"move up": (-1, 0), "move down": (1, 0), "move left": (0, -1), "move right": (0, 1)}
# a wall down column 2 with one gap, the door (1, 2); the key at (2, 0), off the way to A
GAP = dict(
    task_id="gap",
    height=3,
    width=5,
    walls=[[0, 2], [2, 2]],
    start=[1, 0],
    waypoints=[[1, 4]],
    max_turns=20,
)
DOOR = KeyTask(**GAP, doors=[[1, 2]], keys=[[2, 0]])


@pytest.fixture(scope="module")
def splits():
    return {name: make_key_tasks(name) for name in KEY_SPLITS}


@pytest.fixture(scope="module")
def val():
    return KeyNavigation.tasks("val")


def reachable(task, frm, closed):
    """Cells reachable from `frm` with the walls and the `closed` cells shut (independent BFS)."""
    shut = {tuple(c) for c in task.walls + closed}
    seen = {tuple(frm)}
    queue = deque(seen)
    while queue:
        r, c = queue.popleft()
        for dr, dc in STEP.values():
            n = (r + dr, c + dc)
            inside = 0 <= n[0] < task.height and 0 <= n[1] < task.width
            if inside and n not in shut and n not in seen:
                seen.add(n)
                queue.append(n)
    return seen


def words_ok(text, vocab):
    assert text and text == text.strip() and "  " not in text, repr(text)
    assert set(text.split(" ")) <= vocab, text


# ----------------------------------------------------------------------------- splits


def test_splits_are_deterministic_prefixes_with_the_spec_family_share(splits):
    a = make_key_tasks("test", n=40)
    assert [asdict(t) for t in a] == [asdict(t) for t in make_key_tasks("test", n=40)]
    assert [asdict(t) for t in a] == [asdict(t) for t in splits["test"][:40]]
    assert [asdict(t) for t in make_key_tasks("test", n=40, seed=99)] != [asdict(t) for t in a]
    assert a[7].task_id == "test-0007"
    for name, tasks in splits.items():
        spec = KEY_SPLITS[name]
        assert len(tasks) == spec.n
        keys = [t for t in tasks if t.family == "keys"]
        assert len(keys) == int(spec.n * spec.key_share)
        assert all(len(t.doors) == len(t.keys) == spec.doors for t in keys)
        assert all(not t.doors and not t.keys for t in tasks if t.family == "plain")
    # the share is the spec's, in every prefix: half of train (and of fit), a quarter of test
    assert KEY_SPLITS["train"].key_share == 0.5 and KEY_SPLITS["test"].key_share == 0.25
    for part in (slice(0, 4), slice(0, 500), slice(500, 600)):
        train = splits["train"][part]
        assert sum(t.family == "keys" for t in train) == len(train) // 2
    assert {t.family for t in splits["ood"]} == {"keys"}
    # the share overrides: another mix, still task i of its family depending on (seed, i) alone
    half = make_key_tasks("test", n=20, key_share=0.5)
    assert sum(t.family == "keys" for t in half) == 10
    assert [t.family for t in make_key_tasks("test", n=20, key_share=0.0)] == ["plain"] * 20
    with pytest.raises(ValueError, match="unknown split"):
        make_key_tasks("easy")
    with pytest.raises(ValueError, match="key_share"):
        make_key_tasks("test", n=1, key_share=1.5)


def test_carved_splits_are_train_slices_and_splits_do_not_overlap(splits, val, monkeypatch):
    assert KeyNavigation.splits() == ["train", "test", "ood", "fit", "val", *SHARE_SPLITS]
    assert envs.env_class("navigation-keys") is KeyNavigation
    # val: train's tasks 500-599 drawn at test's share (a quarter), whatever train's
    at_test_share = make_key_tasks("train", key_share=KEY_SPLITS["test"].key_share)
    assert [asdict(t) for t in val] == [asdict(t) for t in at_test_share[CARVED["val"][1]]]
    assert sum(t.family == "keys" for t in val) == len(val) // 4
    monkeypatch.setattr(navigation_keys, "make_key_tasks", lambda split: splits[split])
    assert KeyNavigation.tasks("fit") == splits["train"][CARVED["fit"][1]]
    assert KeyNavigation.tasks("ood") == splits["ood"]

    def key(t):
        return str({k: v for k, v in asdict(t).items() if k != "task_id"})

    seen = [{key(t) for t in tasks} for tasks in splits.values()]
    assert not seen[0] & seen[1] and not seen[0] & seen[2] and not seen[1] & seen[2]


def test_share_splits_are_train_at_their_share_and_keep_val_out(splits, val):
    train = splits["train"]
    fit = train[CARVED["fit"][1]]
    val = {str(asdict(t)) for t in val}
    assert not {str(asdict(t)) for t in fit} & val
    for share in (0.1, 0.25):
        tasks = KeyNavigation.tasks(f"train-share-{share}")
        assert KeyNavigation.tasks(f"fit-share-{share}") == tasks[CARVED["fit"][1]]
        assert [t.task_id for t in tasks] == [t.task_id for t in train]
        assert sum(t.family == "keys" for t in tasks) == int(len(train) * share)
        # a task keeps its draw when the share keeps its family: only the mix changes
        same = [(a, b) for a, b in zip(tasks, train) if a.family == b.family]
        assert same and all(asdict(a) == asdict(b) for a, b in same)
        assert not {str(asdict(t)) for t in tasks[CARVED["fit"][1]]} & val
        for t in tasks:
            assert run_actions(t, optimal_actions(t)).score().success, t.task_id


def test_oracle_solves_every_task_of_every_split(splits):
    for name, tasks in splits.items():
        spec = KEY_SPLITS[name]
        for t in tasks:
            acts = optimal_actions(t)
            assert run_actions(t, acts).score().success, t.task_id
            assert t.max_turns == len(acts) + spec.slack <= spec.turn_cap
            assert acts.count("find key") == len(t.doors), t.task_id


def test_every_door_cuts_a_waypoint_off_and_every_key_is_reachable(splits):
    for t in splits["test"] + splits["ood"]:
        points = [t.start] + t.waypoints
        for door in t.doors:
            legs = zip(points, points[1:])
            assert any(tuple(b) not in reachable(t, a, [door]) for a, b in legs), t.task_id
        start_part = reachable(t, t.start, t.doors)
        assert all(tuple(k) in start_part for k in t.keys)


# ------------------------------------------------------------------------ door, key, tool


def test_the_door_blocks_without_the_key_and_opens_with_it():
    env = KeyNavigation(DOOR)
    env.reset()
    env.step("move right")
    obs, _ = env.step("move right")  # into the locked door: a wall hit, no move
    assert obs == "error hit door pos 1 1 next A 1 4 blocked right"
    assert env.pos == (1, 1) and env.wall_hits == 1
    assert env.check_step("move right").reason.startswith("wall move right hits a locked door")
    env.step("move left")
    obs, _ = env.step("move down")  # onto the key: picked up
    assert obs.startswith("got key pos 2 0") and env.held == {0}
    for a in ("move up", "move right", "move right", "move right", "move right"):
        assert env.check_step(a).valid
        env.step(a)
    assert env.pos == (1, 4) and env.visited == 1
    env.step("finish")
    assert env.score().items["waypoints_in_order"] and not env.score().success  # the wall hit
    # the oracle fetches the key first and passes the door cleanly
    assert run_actions(DOOR, optimal_actions(DOOR)).score().success


def test_find_key_only_after_the_route_showed_a_locked_door():
    env = KeyNavigation(DOOR)
    env.reset()
    assert env.optimal_action() == "route"
    assert env.check_step("find key").reason.startswith("early find key")
    obs, _ = env.step("find key")  # a turn, and nothing found
    assert obs.startswith("error no key to find ") and not env.found and env.turns == 1
    obs, _ = env.step("route")
    assert obs.startswith("locked door 1 2 . ") and env.route == [] and env.told == 0
    assert env.optimal_action() == "find key"
    assert env.check_step("route").reason.startswith("repeat route already shows")
    obs, _ = env.step("find key")
    assert obs == "route down . pos 1 0 next key 2 0 blocked left" and env.found
    assert env.check_step("find key").reason.startswith("repeat key is already found")
    env.step("move right")  # off the route to the key: the key stays known, `route` leads there
    assert env.hint() == "next key 2 0 do route"
    env.step("route")
    assert env.route == ["down", "left"]


def test_a_door_that_blocks_no_leg_asks_for_no_key():
    # the door closes a dead end, the key lies in it: the route to A never meets the door
    task = KeyTask(
        "dead end", 3, 3, [[0, 1], [2, 1]], [1, 0], [[1, 2]], 9, doors=[[0, 0]], keys=[[2, 0]]
    )
    env = KeyNavigation(task)
    env.reset()
    env.step("route")
    assert env.route == ["right", "right"] and env.told is None
    assert optimal_actions(task) == ["route", "move right", "move right", "finish"]


def test_the_oracle_fetches_two_keys_for_two_doors():
    # two gaps, two doors: A lies past the first, B past the second; both keys near the start
    task = KeyTask(
        "two doors",
        3,
        7,
        walls=[[0, 2], [2, 2], [0, 5], [2, 5]],
        start=[1, 1],
        waypoints=[[1, 3], [1, 6]],
        max_turns=40,
        doors=[[1, 2], [1, 5]],
        keys=[[0, 0], [2, 0]],
    )
    acts = optimal_actions(task)
    assert acts.count("find key") == 2 and acts.count("route") == 4
    assert run_actions(task, acts).score().success


# ------------------------------------------------------------------------ justified and leaked


def test_a_move_toward_the_key_before_the_tool_leaks_and_the_tool_call_is_justified(splits):
    """In every state of the oracle's episodes where a locked door blocks the way and no route is
    held, the evidence names the key and its path; its first move passes check_step but is not
    justified (rewrite_kind: leaked), while the action the context shows is justified."""
    leaks = 0
    for task in [t for t in splits["test"] if t.family == "keys"] + splits["ood"][:20]:
        env = KeyNavigation(task)
        env.reset()
        for action in optimal_actions(task):
            door = env.blocking_door()
            if door is not None and not env.route:
                key = task.keys[door]
                text = env.evidence()
                assert f"next key {key[0]} {key[1]} path " in text
                move = f"move {text.split(' path ')[1].split()[0]}"
                assert env.check_step(move).valid and not env.justified(move)
                assert intervene.rewrite_kind(env, move) == "leaked"
                shown = env.optimal_action()
                assert shown in ("route", "find key")
                assert intervene.rewrite_kind(env, shown) == "justified"
                if shown == "route":  # before the route showed the door, the tool call is early
                    assert intervene.rewrite_kind(env, "find key") == "invalid"
                leaks += 1
            env.step(action)
    assert leaks > 100


def test_plain_tasks_play_exactly_as_navigation(splits):
    rng = random.Random(0)
    tasks = [t for t in splits["test"] if t.family == "plain"][:25] + make_tasks("easy", n=10)
    steps = 0
    for t in tasks:
        # Navigation plays NavTasks: a KeyTask, even without doors, is navigation-keys'
        a, b = (
            Navigation(NavTask(**{f.name: getattr(t, f.name) for f in fields(NavTask)})),
            KeyNavigation(t),
        )
        assert a.reset() == b.reset()
        while not a.done:
            for probe in ACTIONS + ("jump",):
                assert a.check_step(probe) == b.check_step(probe)
            assert (a.hint(), a.evidence()) == (b.hint(), b.evidence())
            assert a.optimal_action() == b.optimal_action()
            action = a.optimal_action() if rng.random() < 0.6 else rng.choice(ACTIONS)
            assert a.step(action) == b.step(action)
            steps += 1
        assert a.score() == b.score()
    assert steps > 300


def test_navigation_refuses_a_keys_task_it_would_play_without_doors(splits):
    task = next(t for t in splits["test"] if t.family == "keys")
    with pytest.raises(ValueError, match="is a navigation-keys task: Navigation would play it"):
        Navigation(task)
    KeyNavigation(make_tasks("easy", n=1)[0])  # and the other way round is Navigation's play


# ------------------------------------------------------------------------ robustness, vocabulary

GARBAGE = ["", "   ", "find", "find key now", "key", "FIND KEY", "move", None, 3, "route route"]


def test_bad_actions_give_an_error_observation_and_never_raise(splits):
    vocab = set(KeyNavigation.vocabulary())
    rng = random.Random(1)
    tasks = [t for t in splits["test"] if t.family == "keys"][:20] + splits["ood"][:20]
    steps = 0
    for t in tasks:
        env = KeyNavigation(t)
        words_ok(env.reset(), vocab)
        while not env.done:
            words_ok(env.hint(), vocab)
            words_ok(env.evidence(), vocab)
            assert env.optimal_action() in KEY_ACTIONS
            for probe in KEY_ACTIONS + tuple(GARBAGE):
                check = env.check_step(probe)
                assert check.valid == (check.reason == "")
                if not check.valid:
                    words_ok(check.reason, vocab)
                    assert check.reason.split()[0] in RULES
                    assert check.reason.endswith(" ; " + env.hint())
            pick = rng.random()
            if pick < 0.5:
                action = env.optimal_action()
            elif pick < 0.8:
                action = rng.choice(KEY_ACTIONS)
            else:
                action = rng.choice(GARBAGE)
            valid = env.check_step(action).valid
            obs, done = env.step(action)
            words_ok(obs, vocab)
            if action in GARBAGE:
                assert obs.startswith("error unknown action ")
            if valid:  # a valid action never errs
                assert not obs.startswith("error ")
            steps += 1
        words_ok(env.step("find key")[0], vocab)
        assert env.turns <= t.max_turns
    assert steps > 600


def test_vocabulary_extends_navigations_in_order():
    nav = Navigation.vocabulary()
    keys = KeyNavigation.vocabulary()
    assert keys[: len(nav)] == nav and len(set(keys)) == len(keys)
    assert keys[len(nav) :] == [
        "find",
        "key",
        "locked",
        "door",
        "got",
        "no",
        "to",
        "shows",
        "found",
    ]
    for text in navigation_keys.KEY_TEXTS:
        assert set(envs._literal_words(text)) <= set(keys), text
    assert {why.split()[0] for why in navigation_keys.KEY_WHY.values()} <= set(RULES)


@pytest.mark.parametrize(
    "change, why",
    [
        ({"doors": [[1, 2]], "keys": []}, "pair up"),
        ({"doors": [[0, 2]], "keys": [[2, 0]]}, "on a wall"),
        ({"doors": [[1, 2]], "keys": [[1, 4]]}, "distinct"),
        ({"doors": [[1, 2]], "keys": [[1, 3]]}, "unreachable with doors locked"),
        ({"doors": [[1, 2]], "keys": [[3, 0]]}, "outside"),
        ({"doors": [[1, 2], [0, 0], [0, 1], [2, 1]], "keys": [[2, 0]] * 4}, "at most"),
    ],
)
def test_bad_key_tasks_are_refused_with_the_reason(change, why):
    with pytest.raises(ValueError, match=why):
        KeyTask(**{**GAP, **change})
