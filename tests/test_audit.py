"""Tests for extras/audit.py: what a context shows, the undecidable flags, the two baselines."""

import doctest
import random

import pytest

from envs import Navigation, make_tasks
from extras import audit
from extras.audit import context_action, greedy_action, oracle_action, pass_at_1, undecidable_flags
from extras.navigation_keys import KeyNavigation, make_key_tasks


@pytest.fixture(scope="module")
def splits():
    return {name: make_tasks(name) for name in ("train", "test")}


def test_context_action_reads_the_latest_message_alone():
    assert context_action("route down left . pos 1 1 next A 2 0 blocked up") == "move down"
    assert (
        context_action("error hit wall route left . pos 1 1 next A 1 0 blocked up") == "move left"
    )
    assert context_action("pos 1 1 next A 2 0 blocked up") == "route"
    assert context_action("pos 2 0 next finish blocked down") == "finish"
    assert context_action("pos 2 1 next finish at B 2 2 blocked down") == "route"
    # navigation-keys: a locked door the route showed asks for the tool; a found key, its route
    assert context_action("locked door 3 4 . pos 1 1 next A 4 4 blocked up") == "find key"
    assert context_action("error hit door pos 1 1 next A 4 4 blocked right") == "route"
    assert context_action("route down . pos 1 0 next key 2 0 blocked left") == "move down"
    assert context_action("pos 1 1 next key 2 0 blocked right") == "route"
    assert context_action("got key pos 2 0 next A 1 4 blocked down") == "route"


def hidden_direction(env):
    """A hint that names the hidden shortest-path direction when no route is held."""
    if env.at_end():
        return "finish"
    if env.route:
        return f"move {env.route[0]}"
    return env.shortest_moves()[0]


def test_every_flagged_step_asks_for_an_action_the_context_shows(splits, monkeypatch):
    tasks = splits["train"][:60] + splits["test"][:60]
    bad, flagged = undecidable_flags(tasks)
    assert flagged > 500 and bad == 0
    # the check can fail: hints naming the hidden shortest-path direction (no route held) are caught
    monkeypatch.setattr(Navigation, "optimal_action", hidden_direction)
    bad, flagged = undecidable_flags(tasks)
    assert bad > 0.2 * flagged


def test_baselines_greedy_walker_and_oracle(splits):
    tasks = splits["test"][:40]
    assert pass_at_1(tasks, oracle_action, samples=1) == 100.0
    rng = random.Random(0)
    for t in tasks[:10]:  # the walker never uses the tool and never hits a wall
        env = Navigation(t)
        while not env.done:
            a = greedy_action(env, rng)
            assert a != "route" and env.check_step(a).reason[:4] != "wall"
            env.step(a)
    assert 0 < pass_at_1(tasks, greedy_action) < 60


def test_docstring_examples():
    assert doctest.testmod(audit).failed == 0


@pytest.fixture(scope="module")
def key_tasks():
    """The keys tasks of the first 80 of navigation-keys' test, and 20 of ood (two doors)."""
    test = [t for t in make_key_tasks("test", n=80) if t.family == "keys"]
    return test + make_key_tasks("ood", n=20)


KEYS_HINT = KeyNavigation.optimal_action


def door_too_soon(env):
    """A hint that names `find key` as soon as a door blocks, before the route tool showed it."""
    if not env.route and not env.found and env.blocking_door() is not None:
        return "find key"
    return KEYS_HINT(env)


def test_every_flagged_step_of_navigation_keys_asks_for_what_the_context_shows(
    key_tasks, monkeypatch
):
    bad, flagged = undecidable_flags(key_tasks)
    assert flagged > 200 and bad == 0
    # the check can fail: a hint naming the tool before the context shows the locked door
    monkeypatch.setattr(KeyNavigation, "optimal_action", door_too_soon)
    bad, flagged = undecidable_flags(key_tasks)
    assert bad > 0.1 * flagged


def test_on_keys_tasks_the_oracle_solves_all_and_the_greedy_walker_seldom(key_tasks):
    assert pass_at_1(key_tasks, oracle_action, samples=1) == 100.0
    assert pass_at_1(key_tasks, greedy_action) < 15


def test_the_table_of_navigation_keys_has_a_row_per_family(monkeypatch, capsys, key_tasks):
    monkeypatch.setattr(audit, "AUDITED", {"navigation-keys": ("test",)})
    mixed = key_tasks[:6] + make_key_tasks("test", n=3)  # tasks 0-2: plain
    monkeypatch.setattr(KeyNavigation, "tasks", classmethod(lambda cls, split: mixed))
    audit.main(["--env", "navigation-keys"])
    rows = [line.split(" | ")[0] for line in capsys.readouterr().out.splitlines()[1:]]
    assert rows == ["| test", "| test keys", "| test plain"]
