"""Navigation with keys ("navigation-keys"): a task family beyond the warm start's skills, and an
out-of-distribution split; optional (extras/), reached through envs.ENVS.

    python -m extras.navigation_keys      # a keys task, its map and the split table
    python -m extras.audit --env navigation-keys

Some tasks (the "keys" family) have a locked door that cuts a waypoint off, and its key lies
elsewhere on the map; only the `find key` tool tells where. The agent must call it, fetch the key
and only then pass the door. The warm start learns on Navigation's easy split and never sees a
door, so on-policy exploration seldom finds the tool; the grader's evidence names the key's cell,
so a corrector that walks toward the key without the tool writes a step the agent could not have
known (the post-check rejects it), while a corrector that writes `find key` is justified.

Splits (KEY_SPLITS): train and test mix the family in at KeySplitSpec.key_share, train at a share
chosen on val (fit and val are carved from train, as Navigation's; val is drawn at test's share);
ood has two doors a task, a combination train never has.
Plain tasks play exactly as Navigation's, and Navigation's texts, splits and vocabulary are
untouched: this env's vocabulary extends Navigation's.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import ClassVar

from envs import (
    ACTIONS,
    CARVED,
    EVIDENCE,
    HELD_ROUTE,
    MAX_NUMBER,
    MOVES,
    NOTHING_BLOCKED,
    OUTCOMES,
    SEED_STRIDE,
    SEPARATORS,
    STATE,
    WHY,
    Navigation,
    NavTask,
    SplitSpec,
    _cell_words,
    _is_cell,
    _literal_words,
    _moved,
    bfs_distances,
    generate_task,
    optimal_actions,
    render,
)

# KeyNavigation ("navigation-keys") is Navigation plus a family of tasks that need a skill the
# warm start never shows: a locked door cuts a waypoint off, and only the `find key` tool tells
# where its key lies. Its texts are Navigation's plus these; their new words follow Navigation's
# in KeyNavigation.vocabulary(), so Navigation's texts and vocabulary stay as they are.

KEY_ACTIONS = ACTIONS + ("find key",)
# opens the state once the route tool has shown that a locked door blocks the way, until `find key`
LOCKED = "locked door {cell} . "
KEY_TARGET = "key {cell}"  # what is next, in the state and the hint, once `find key` named the key
KEY_OUTCOMES = {  # what an action did, as OUTCOMES
    "door": "error hit door ",
    "picked": "got key ",
    "nothing": "error no key to find ",
}
KEY_WHY = {  # why check_step refuses an action, as WHY (the first word is a rule of RULES)
    "door": "wall {action} hits a locked door",
    "find early": "early find key before a route shows a locked door",
    "find repeat": "repeat key is already found",
    "locked": "repeat route already shows a locked door",
}
KEY_TEXTS = (LOCKED, KEY_TARGET, *KEY_OUTCOMES.values(), *KEY_WHY.values())
MAX_DOORS = 3


@dataclass
class KeyTask(NavTask):
    """A NavTask with locked doors: door i is a wall until the agent holds key i, which it picks up
    by stepping on its cell. No doors: a plain task, which KeyNavigation plays as Navigation does.
    Validated on construction (ValueError): every key lies in the start's part of the grid with all
    doors locked, so the key a door needs can always be fetched, whatever doors the agent opened."""

    doors: list[list[int]] = field(default_factory=list)
    keys: list[list[int]] = field(default_factory=list)
    ENV: ClassVar[str] = "navigation-keys"  # the env that plays it (envs.player)

    def __post_init__(self):
        super().__post_init__()

        def need(ok, msg):
            if not ok:
                raise ValueError(msg)

        for name in ("doors", "keys"):
            cells = getattr(self, name)
            need(
                isinstance(cells, list) and len(cells) <= MAX_DOORS and all(map(_is_cell, cells)),
                f"{name} must be a list of at most {MAX_DOORS} [row, col]",
            )
        need(len(self.doors) == len(self.keys), "doors and keys must pair up: one key a door")
        self.doors = [list(d) for d in self.doors]
        self.keys = [list(k) for k in self.keys]
        for cell in self.doors + self.keys:
            need(
                0 <= cell[0] < self.height and 0 <= cell[1] < self.width,
                f"cell {cell} is outside the {self.height}x{self.width} grid",
            )
            need(cell not in self.walls, "a door or a key is on a wall")
        cells = [self.start] + self.waypoints + self.doors + self.keys
        need(
            len({tuple(c) for c in cells}) == len(cells),
            "start, waypoints, doors and keys must be distinct cells",
        )
        reach = bfs_distances(self, self.start, self.doors)
        need(all(tuple(k) in reach for k in self.keys), "a key is unreachable with doors locked")

    @property
    def family(self) -> str:
        """'keys' if the task has a door, else 'plain': results are reported per family."""
        return "keys" if self.doors else "plain"


@dataclass(frozen=True)
class KeySplitSpec(SplitSpec):
    """A SplitSpec of KeyNavigation: a share `key_share` of its tasks are of the keys family, each
    with `doors` doors, the rest plain."""

    key_share: float = 0.25
    doors: int = 1

    def __post_init__(self):
        if not 0 <= self.key_share <= 1:
            raise ValueError(f"key_share must be in [0, 1], got {self.key_share}")
        if not 1 <= self.doors <= min(MAX_DOORS, self.k_min):
            raise ValueError(f"doors must be in 1..{min(MAX_DOORS, self.k_min)}: one leg a door")


# train / test: Navigation's hard distribution with keys tasks mixed in. The warm start learns on
# Navigation's easy split (plain tasks, which KeyNavigation plays as Navigation does): never a door
KEY_SPLITS = {
    "train": KeySplitSpec(9, 9, 0.45, 4, 4, n=600, seed=12, key_share=0.5),
    "test": KeySplitSpec(9, 9, 0.45, 4, 4, n=200, seed=13),
    # out of distribution: two doors and two keys a task, a combination train never has
    "ood": KeySplitSpec(9, 9, 0.45, 4, 4, n=100, seed=14, key_share=1.0, doors=2),
}
# train and its fit drawn at another keys share ("fit-share-0.1", "train-share-0.1", ...): the
# trials of train's share on val (docs/RESULTS.md 13f), and a method's own share where its choice
# on val differs from train's (extras.compare --grpo-train-split)
SHARE_SPLITS = {
    f"{part}-share-{share}": (part, share) for share in (0.1, 0.25) for part in ("fit", "train")
}


def is_keys_task(i: int, key_share: float) -> bool:
    """Whether task i of a split is of the keys family: exactly floor(n * key_share) of any first n
    tasks are, spread evenly (with 0.25, tasks 3, 7, 11, ...); the 1e-9 absorbs float error."""
    return int((i + 1) * key_share + 1e-9) > int(i * key_share + 1e-9)


def _leg_cells(task: NavTask, frm, to) -> list[tuple[int, int]]:
    """The cells strictly between `frm` and `to` on the first shortest path (ACTIONS order)."""
    dist = bfs_distances(task, to)
    pos = tuple(frm)
    cells = []
    while dist[pos] > 1:
        pos = next(_moved(pos, a) for a in MOVES if dist.get(_moved(pos, a)) == dist[pos] - 1)
        cells.append(pos)
    return cells


def _add_doors(task: NavTask, doors: int, rng: random.Random) -> KeyTask | None:
    """`task` with `doors` doors, each on a cell that cuts a different leg's waypoint off from the
    leg's start (every path of that leg passes it), and their keys on random free cells reachable
    from the start with every door locked; None if some chosen leg has no such cell."""
    points = [tuple(p) for p in [task.start] + task.waypoints]
    door_cells = []
    for leg in rng.sample(range(len(points) - 1), doors):
        frm, to = points[leg], points[leg + 1]
        cuts = [
            c
            for c in _leg_cells(task, frm, to)
            if c not in points + door_cells and frm not in bfs_distances(task, to, [c])
        ]
        if not cuts:
            return None
        door_cells.append(rng.choice(cuts))
    reach = bfs_distances(task, task.start, door_cells)
    spots = [c for c in reach if c not in points and c not in door_cells]
    if len(spots) < doors:
        return None
    keys = rng.sample(spots, doors)
    return KeyTask(
        **asdict(task),
        doors=[list(d) for d in door_cells],
        keys=[list(k) for k in keys],
    )


def generate_key_task(spec: KeySplitSpec, rng: random.Random, task_id: str) -> KeyTask:
    """A keys task: a task of `spec` (generate_task, without its turn cap) with spec.doors doors
    (_add_doors); redrawn until the oracle needs every key (it calls `find key` once a door: it
    picks up no key on its way by chance) and max_turns fits spec.turn_cap."""
    while True:
        plain = generate_task(replace(spec, turn_cap=MAX_NUMBER), rng, task_id)
        task = _add_doors(plain, spec.doors, rng)
        if task is None:
            continue
        acts = optimal_actions(task)
        if acts.count("find key") != spec.doors or acts[-1] != "finish":
            continue
        task.max_turns = len(acts) + spec.slack
        if task.max_turns <= spec.turn_cap:
            return task


def make_key_tasks(
    split: str, n: int | None = None, seed: int | None = None, key_share: float | None = None
) -> list[KeyTask]:
    """The fixed, seeded split of KEY_SPLITS (`n`, `seed` and `key_share` override it), as
    make_tasks: ids like 'test-0007', task i depends only on (seed, i) and the share. Task i is a
    keys task if is_keys_task(i, key_share), else a plain one (no door)."""
    if split not in KEY_SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {list(KEY_SPLITS)}")
    spec = KEY_SPLITS[split]
    if key_share is not None:
        spec = replace(spec, key_share=key_share)
    if n is None:
        n = spec.n
    if seed is None:
        seed = spec.seed
    tasks = []
    for i in range(n):
        rng = random.Random(seed * SEED_STRIDE + i)
        task_id = f"{split}-{i:04d}"
        if is_keys_task(i, spec.key_share):
            tasks.append(generate_key_task(spec, rng, task_id))
        else:
            tasks.append(KeyTask(**asdict(generate_task(spec, rng, task_id))))
    return tasks


class KeyNavigation(Navigation):
    """Navigation with locked doors and the `find key` tool; registered as "navigation-keys".

    A locked door is a wall (the move is refused, 'error hit door', a wall hit) until the agent
    holds its key; stepping on a key's cell picks it up. The agent never sees where doors and keys
    are. When the next waypoint lies past a locked door, `route` gives no route but shows the door:
    the state opens with 'locked door R C . ' until the agent calls `find key`, which holds a route
    to the key (the target becomes 'key R C'). Picking a key up spends the route, and the next
    `route` leads to the waypoint through the door. So the context always shows a good action: the
    held route's next move, finish at the end, `find key` after a locked door, else `route`.

    The grader knows more: where a locked way's key lies, before any tool (heading()). Its
    evidence names the key and the path to it, and a move toward the key is on the grader's
    shortest path (check_step passes it), but the context justifies it only with a held route: a
    corrector that copies it before `find key` leaks. Plain tasks (no door) play as Navigation.

    State besides Navigation's: `held` (indices of the keys held), `told` (the locked door the
    route tool showed, until a key is picked up), `found` (whether `find key` named told's key).

    A door at (1, 2) in the only gap of a wall, its key at (2, 0):

    >>> task = KeyTask("door", 3, 5, walls=[[0, 2], [2, 2]], start=[1, 0], waypoints=[[1, 4]],
    ...                max_turns=12, doors=[[1, 2]], keys=[[2, 0]])
    >>> env = KeyNavigation(task)
    >>> env.reset()
    'visit A 1 4 then finish . grid 3 5 . pos 1 0 next A 1 4 blocked left'
    >>> env.evidence()
    'locked door 1 2 . next key 2 0 path down'
    >>> env.check_step("move down").valid, env.justified("move down")
    (True, False)
    >>> env.step("route")
    ('locked door 1 2 . pos 1 0 next A 1 4 blocked left', False)
    >>> env.step("find key")
    ('route down . pos 1 0 next key 2 0 blocked left', False)
    >>> env.step("move down")
    ('got key pos 2 0 next A 1 4 blocked down left', False)
    >>> env.step("route")
    ('route up right right right right . pos 2 0 next A 1 4 blocked down left', False)
    >>> print(render(task, optimal_actions(task)))
      0 1 2 3 4
    0 . . # . .
    1 S * d * A
    2 k . # . .
    """

    TOOL_CALLS = KEY_ACTIONS
    OUTCOME_TEXTS = {**OUTCOMES, **KEY_OUTCOMES}
    WHY_TEXTS = {**WHY, **KEY_WHY}

    def __init__(self, task: NavTask):
        self._doors = [tuple(d) for d in getattr(task, "doors", [])]
        self._keys = [tuple(k) for k in getattr(task, "keys", [])]
        self._key_dist = {}  # (goal, locked door cells) -> BFS distance map, cached
        super().__init__(task)

    # --- state helpers
    def locked(self) -> frozenset[tuple[int, int]]:
        """The cells of the doors whose key is not held."""
        return frozenset(d for i, d in enumerate(self._doors) if i not in self.held)

    def distances(self, goal, locked=None) -> dict[tuple[int, int], int]:
        """bfs_distances to `goal` with the `locked` door cells (default: those locked now) as
        walls."""
        locked = self.locked() if locked is None else frozenset(locked)
        if (goal, locked) not in self._key_dist:
            self._key_dist[(goal, locked)] = bfs_distances(self.task, goal, locked)
        return self._key_dist[(goal, locked)]

    def blocked(self, pos, action: str) -> str:
        """Navigation's 'wall' or 'grid', or 'door' for a locked door, else ''."""
        hit = super().blocked(pos, action)
        if not hit and _moved(pos, action) in self.locked():
            return "door"
        return hit

    def blocking_door(self) -> int | None:
        """None while the goal (the waypoint) is reachable with the locked doors shut; else the
        door to open first: the one the route tool showed, or, before that, the first locked door
        on the first shortest path with every door open."""
        goal = self.goal()
        if self.pos in self.distances(goal):
            return None
        if self.told is not None:
            return self.told
        doors = {d: i for i, d in enumerate(self._doors) if i not in self.held}
        dist = self.distances(goal, locked=())
        pos = self.pos
        while pos not in doors:  # every path from here to the goal passes a locked door
            pos = next(_moved(pos, a) for a in MOVES if dist.get(_moved(pos, a)) == dist[pos] - 1)
        return doors[pos]

    def heading(self) -> tuple[int, int]:
        """Where the grader's shortest path leads: the goal, or the key of the door blocking it."""
        door = self.blocking_door()
        return self.goal() if door is None else self._keys[door]

    def shortest_moves(self, pos=None) -> list[str]:
        """The moves (ACTIONS order) that start a shortest path from `pos` (or here) to heading(),
        past no locked door."""
        pos = pos or self.pos
        dist = self.distances(self.heading())
        return [a for a in MOVES if dist.get(_moved(pos, a), -2) == dist[pos] - 1]

    def _route(self) -> list[str]:
        """Directions of the first shortest path (ACTIONS order) from here to heading()."""
        goal = self.heading()
        dist = self.distances(goal)
        pos = self.pos
        directions = []
        while pos != goal:
            move = next(a for a in MOVES if dist.get(_moved(pos, a), -2) == dist[pos] - 1)
            pos = _moved(pos, move)
            directions.append(move.split()[1])
        return directions

    def _target(self) -> str:
        """What the agent knows is next: the found key, else Navigation's target."""
        if self.found:
            return KEY_TARGET.format(cell=_cell_words(self._keys[self.told]))
        return super()._target()

    def _state(self) -> str:
        """Navigation's state; while the route tool's locked door waits for `find key`, it opens
        with the door instead of a held route (the two never come together)."""
        if self.told is not None and not self.found:
            held = LOCKED.format(cell=_cell_words(self._doors[self.told]))
        elif self.route:
            held = HELD_ROUTE.format(directions=" ".join(self.route))
        else:
            held = ""
        blocked = " ".join(a.split()[1] for a in MOVES if self.blocked(self.pos, a))
        return STATE.format(
            held=held,
            cell=_cell_words(self.pos),
            target=self._target(),
            blocked=blocked or NOTHING_BLOCKED,
        )

    # --- Env API
    def reset(self) -> str:
        self.held = set()
        self.told = None
        self.found = False
        return super().reset()

    def _act(self, a: str | None) -> str:
        """Navigation's action, plus: `route` shows a locked door instead of a route when one
        blocks the way (and the key is not found yet), `find key` holds a route to its key, a move
        into a locked door is a wall hit ('error hit door': OUTCOME_TEXTS), and a move onto a key
        picks it up."""
        if a == "route" and not self.found and (door := self.blocking_door()) is not None:
            self.told = door
            self.route = []
            return ""
        if a == "find key":
            if self.told is None or self.found:
                return self.OUTCOME_TEXTS["nothing"]
            self.found = True
            self.route = self._route()
            return ""
        held = len(self.held)
        outcome = super()._act(a)
        return self.OUTCOME_TEXTS["picked"] if len(self.held) > held else outcome

    def _move(self, move: str) -> None:
        """Navigation's move; stepping on a key not held picks it up, which spends the route and
        forgets the locked door (the next `route` finds the way anew)."""
        super()._move(move)
        for i, key in enumerate(self._keys):
            if key == self.pos and i not in self.held:
                self.held.add(i)
                self.told = None
                self.found = False
                self.route = []

    def optimal_action(self) -> str:
        """What the context shows: finish at the end, the held route's next move, `find key` after
        the route tool showed a locked door, else `route`."""
        if self.at_end():
            return "finish"
        if self.route:
            return f"move {self.route[0]}"
        if self.told is not None and not self.found:
            return "find key"
        return "route"

    def evidence(self) -> str:
        """Navigation's evidence toward heading(): where a locked door blocks the way, the door,
        the key, the path to it and the tool the reference solution calls, e.g. 'locked door 3 4 .
        next key 5 6 path up up left do find key', known before any tool. A corrector that writes
        the tool is justified once the route tool has shown the door; one that copies a direction
        while no route is held writes a step the agent's context cannot justify (leaked)."""
        door = self.blocking_door()
        if self.at_end() or door is None:
            return super().evidence()
        key = KEY_TARGET.format(cell=_cell_words(self._keys[door]))
        path = EVIDENCE.format(target=key, directions=" ".join(self._route()))
        return LOCKED.format(cell=_cell_words(self._doors[door])) + path + " do find key"

    def _tool_why(self, a: str) -> str | None:
        """Navigation's, plus: `find key` is valid only after the route tool showed a locked door
        whose key is not found (else early or repeat), and `route` while that door waits for `find
        key` is a repeat. (check_step's other additions come through WHY_TEXTS, blocked() and
        shortest_moves(): a move into a locked door hits a wall, and a move without a held route
        is checked against the shortest path to heading(), the key's when a door blocks.)"""
        waiting = self.told is not None and not self.found
        if a == "find key":
            if waiting:
                return None
            return KEY_WHY["find repeat"] if self.found else KEY_WHY["find early"]
        if a == "route" and not self.route and waiting:
            return KEY_WHY["locked"]
        return super()._tool_why(a)

    @classmethod
    def splits(cls) -> list[str]:
        return list(KEY_SPLITS) + list(CARVED) + list(SHARE_SPLITS)

    @classmethod
    def tasks(cls, split: str) -> list[KeyTask]:
        """A split of KEY_SPLITS, of CARVED (fit and val, parts of this env's train) or of
        SHARE_SPLITS (train, or its fit, drawn at another key_share)."""
        if split in SHARE_SPLITS:
            part, share = SHARE_SPLITS[split]
            tasks = make_key_tasks("train", key_share=share)
            return tasks[CARVED["fit"][1]] if part == "fit" else tasks
        if split == "val":  # at test's share: a policy is judged on test's mix, whatever train's
            return make_key_tasks("train", key_share=KEY_SPLITS["test"].key_share)[CARVED["val"][1]]
        if split in CARVED:
            source, part = CARVED[split]
            return make_key_tasks(source)[part]
        return make_key_tasks(split)

    @classmethod
    def vocabulary(cls) -> list[str]:
        """Navigation's vocabulary (in its order), then the new words of KEY_ACTIONS and
        KEY_TEXTS in order of first use."""
        words = [w for text in KEY_ACTIONS + KEY_TEXTS for w in _literal_words(text)]
        words = [w for w in words if w not in SEPARATORS]
        return list(dict.fromkeys(super().vocabulary() + words))


def build_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="python -m extras.navigation_keys",
        description="navigation-keys: a keys task of the test split ('d' its door, 'k' the key) "
        "with the oracle's path, and the table of the task splits.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )


def main(argv=None) -> None:
    """python -m extras.navigation_keys: a keys task of the test split, its map with the oracle's
    path, and the table of the splits."""
    build_parser().parse_args(argv)
    task = next(t for t in make_key_tasks("test", n=8) if t.family == "keys")
    acts = optimal_actions(task)
    print(f"navigation-keys, a keys task ('d' its door, 'k' the key): {task.task_id}")
    print(render(task, acts))
    print(f"oracle: {' ; '.join(acts)}")
    print(
        "| split | grid | density | K | doors | key share | n | seed | slack | keys tasks"
        " | optimal actions mean plain / keys | max |"
    )
    for name, s in KEY_SPLITS.items():
        tasks = make_key_tasks(name)
        lens = {"plain": [], "keys": []}
        for t in tasks:
            lens[t.family].append(len(optimal_actions(t)))
        means = " / ".join(f"{sum(v) / len(v):.1f}" if v else "-" for v in lens.values())
        longest = max(lens["plain"] + lens["keys"])
        print(
            f"| {name} | {s.height}x{s.width} | {s.density} | {s.k_min}-{s.k_max} | {s.doors}"
            f" | {s.key_share} | {s.n} | {s.seed} | {s.slack} | {len(lens['keys'])} | {means}"
            f" | {longest} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
