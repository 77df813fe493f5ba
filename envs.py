"""Environments for RTI: the `Env` interface and a toy multi-waypoint Navigation task with a map tool.

The policy is a tiny word-level language model, so every text produced here (first message, observations, step-check
reasons, hints, rubric text, the actions themselves) is words from `Navigation.vocabulary()` separated by single
spaces. Garbage actions are never echoed back.

    >>> task = NavTask("demo", 3, 3, walls=[[1, 1]], start=[0, 0], waypoints=[[2, 2], [0, 2]], max_turns=12)
    >>> env = Navigation(task)
    >>> env.reset()
    'visit A 2 2 then B 0 2 then finish . grid 3 3 . pos 0 0 next A 2 2 blocked up left'
    >>> env.check_step("move left").reason       # no route held: the fix is the tool, not the hidden direction
    'wall move left leaves the grid ; next A 2 2 do route'
    >>> env.step("route")
    ('route down down right right . pos 0 0 next A 2 2 blocked up left', False)
    >>> env.step("move down")
    ('route down right right . pos 1 0 next A 2 2 blocked left right', False)
    >>> env.check_step("move up").reason
    'detour move up leaves the route ; next A 2 2 do move down'

Coordinates are (row, col) with row 0 at the top; "up" decreases the row. `python envs.py` prints a sample task, its
render and the split table; `python envs.py audit` the undecidable flagged steps (0) and the baselines' p@1.

`ENVS` at the end of the file is the one plug-in point between this core and the optional `extras/` folder: an env
name maps to a class, or to "module:Class" imported on first use (the tau2-bench domains of extras/tau2.py).
"""

from __future__ import annotations

import abc
import importlib
import random
from collections import deque
from dataclasses import dataclass, replace

ACTIONS = (
    "move up",
    "move down",
    "move left",
    "move right",
    "route",
    "finish",
)  # fixed tool-call text
MOVES = {"move up": (-1, 0), "move down": (1, 0), "move left": (0, -1), "move right": (0, 1)}
LABELS = "ABCDEF"  # waypoint labels, in visiting order
MAX_NUMBER = 99  # numbers 0..99 are words (coordinates, grid size, turn limit)
RUBRIC_ITEMS = ("waypoints_in_order", "finished_at_goal", "no_wall_hits", "within_turn_limit")
RULES = (
    "unknown",
    "wall",
    "detour",
    "repeat",
    "early",
    "stop",
    "over",
)  # first word of a step-check reason


@dataclass(frozen=True)
class StepCheck:
    """Verdict on a proposed action. `reason` is "" when valid; otherwise it starts with the rule name (one of RULES)
    and ends with the hint, e.g. 'wall move up hits a wall ; next A 3 1 do route'."""

    valid: bool
    reason: str = ""


@dataclass
class RubricResult:
    """Ordered rubric item name -> passed; `success` iff all pass, `fraction` the share that pass."""

    items: dict[str, bool]

    @property
    def success(self) -> bool:
        return all(self.items.values())

    @property
    def fraction(self) -> float:
        return sum(self.items.values()) / len(self.items) if self.items else 0.0


class Env(abc.ABC):
    """One episode of one task: `env = Navigation(task); first_message = env.reset()`.

    Attributes after reset(): `done` (bool), `turns` (actions taken), `actions` (their raw text), `observations` (the
    texts step() returned). Replayable: same task + same actions give the same observations."""

    done: bool
    turns: int
    actions: list[str]
    observation_role: str | None = (
        None  # chat role of the latest observation: None = the template's default (tool
    )
    # or user message); tau2 airline / retail set "user" for a user's reply

    @abc.abstractmethod
    def reset(self) -> str:
        """(Re)start the episode; return the first user message."""

    @abc.abstractmethod
    def step(self, action: str) -> tuple[str, bool]:
        """Execute an action; return (observation, done). Never raises on any string."""

    @abc.abstractmethod
    def score(self) -> RubricResult:
        """Score the (finished or unfinished) episode against the rubric."""

    @abc.abstractmethod
    def check_step(self, action: str) -> StepCheck:
        """Check a proposed action in the current state without executing it."""

    @abc.abstractmethod
    def rubric_text(self) -> str:
        """The rubric as text, for prompts."""

    @abc.abstractmethod
    def hint(self) -> str:
        """A short rubric hint for a corrector in the current state."""

    @abc.abstractmethod
    def optimal_action(self) -> str:
        """The right action the hint names, one the agent's context determines (the rule corrector writes it)."""

    @classmethod
    @abc.abstractmethod
    def vocabulary(cls) -> list[str]:
        """Every word any text of this env can contain."""

    @classmethod
    @abc.abstractmethod
    def splits(cls) -> list[str]:
        """The names of the task splits."""

    @classmethod
    @abc.abstractmethod
    def tasks(cls, split: str) -> list:
        """The tasks of a split (ValueError naming the known splits for an unknown one)."""

    @classmethod
    def make(cls, task, user=None) -> "Env":
        """A fresh environment for `task`; `user` plays the user in envs that have one (None: the env's default)."""
        return cls(task)

    @classmethod
    def make_user(cls, user_model: str, sampler):
        """The user of this env's episodes from --user-model ('' = the policy's own model); None: no user."""
        return None


# ----------------------------------------------------------------------------- tasks


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_cell(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) == 2 and all(_is_int(v) for v in x)


@dataclass
class NavTask:
    """One grid: walls, a start and waypoints A, B, ... to visit in order; JSON-serialisable (`asdict(task)`), cells
    are [row, col] lists. Validated on construction (ValueError)."""

    task_id: str
    height: int
    width: int
    walls: list[list[int]]
    start: list[int]
    waypoints: list[list[int]]
    max_turns: int

    def __post_init__(self):
        def need(ok, msg):
            if not ok:
                raise ValueError(msg)

        need(isinstance(self.task_id, str), "task_id must be a string")
        for name in ("height", "width", "max_turns"):
            v = getattr(self, name)
            need(_is_int(v) and 1 <= v <= MAX_NUMBER, f"{name} must be an int in 1..{MAX_NUMBER}")
        need(
            isinstance(self.walls, list) and all(map(_is_cell, self.walls)),
            "walls must be a list of [row, col]",
        )
        need(_is_cell(self.start), "start must be [row, col]")
        need(
            isinstance(self.waypoints, list)
            and 1 <= len(self.waypoints) <= len(LABELS)
            and all(map(_is_cell, self.waypoints)),
            f"waypoints must be a list of 1..{len(LABELS)} [row, col]",
        )
        self.walls, self.start = [list(w) for w in self.walls], list(self.start)
        self.waypoints = [list(w) for w in self.waypoints]
        points = [self.start] + self.waypoints
        for cell in self.walls + points:
            need(
                0 <= cell[0] < self.height and 0 <= cell[1] < self.width,
                f"cell {cell} is outside the {self.height}x{self.width} grid",
            )
        need(not any(p in self.walls for p in points), "start or a waypoint is on a wall")
        need(
            len({tuple(p) for p in points}) == len(points),
            "start and waypoints must be distinct cells",
        )
        for a, b in zip(points, points[1:]):
            need(tuple(a) in bfs_distances(self, b), f"waypoint {b} is unreachable from {a}")


def bfs_distances(task: NavTask, goal) -> dict[tuple[int, int], int]:
    """Shortest move count from every reachable cell to `goal` (walls and edges block)."""
    walls = {tuple(w) for w in task.walls}
    goal = tuple(goal)
    dist, queue = {goal: 0}, deque([goal])
    while queue:
        r, c = queue.popleft()
        for dr, dc in MOVES.values():
            n = (r + dr, c + dc)
            if (
                0 <= n[0] < task.height
                and 0 <= n[1] < task.width
                and n not in walls
                and n not in dist
            ):
                dist[n] = dist[(r, c)] + 1
                queue.append(n)
    return dist


def optimal_actions(task: NavTask) -> list[str]:
    """The oracle's episode: each leg `route` then its moves (ties broken in ACTIONS order), then "finish"."""
    env = Navigation(replace(task, max_turns=MAX_NUMBER))  # the task's own limit must not cut it
    while not env.done:
        env.step(env.optimal_action())
    return env.actions


@dataclass(frozen=True)
class SplitSpec:
    """How a split is generated: grid size, wall density, waypoint count range, size, seed, and the turn slack added
    to the oracle's action count (optimal moves, one `route` a leg, finish) to give max_turns."""

    height: int
    width: int
    density: float
    k_min: int
    k_max: int
    n: int
    seed: int
    slack: int = 2
    turn_cap: int = (
        48  # tasks whose max_turns would exceed it are redrawn: an episode fits 2,048 positions
    )


SPLITS = {  # easy: the warm start's; train / test: the hard distribution RL trains and is tested on
    "easy": SplitSpec(9, 9, 0.10, 1, 4, n=2000, seed=1),
    "train": SplitSpec(9, 9, 0.45, 4, 4, n=600, seed=2),
    "test": SplitSpec(9, 9, 0.45, 4, 4, n=150, seed=3),
}

CARVED = {
    "fit": ("train", slice(0, 500)),
    "val": ("train", slice(500, 600)),
}  # validation carved from train


def generate_task(spec: SplitSpec, rng: random.Random, task_id: str) -> NavTask:
    """Draw round(density * cells) walls, a start and K waypoints on free cells; redraw until every leg start -> A ->
    B -> ... is reachable (NavTask validates that)."""
    cells = [(r, c) for r in range(spec.height) for c in range(spec.width)]
    while True:
        k = rng.randint(spec.k_min, spec.k_max)
        walls = set(rng.sample(cells, round(spec.density * len(cells))))
        if len(free := [x for x in cells if x not in walls]) < k + 1:
            continue
        points = [list(p) for p in rng.sample(free, k + 1)]
        try:
            task = NavTask(
                task_id,
                spec.height,
                spec.width,
                [list(w) for w in sorted(walls)],
                points[0],
                points[1:],
                MAX_NUMBER,
            )
        except ValueError:  # some leg unreachable
            continue
        task.max_turns = len(optimal_actions(task)) + spec.slack
        if task.max_turns <= spec.turn_cap:
            return task


def make_tasks(split: str, n: int | None = None, seed: int | None = None) -> list[NavTask]:
    """The fixed, seeded split (`n` and `seed` override SPLITS). Ids look like 'test-0007'. Task i depends only on
    (seed, i), so a smaller n gives a prefix of the full split."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {list(SPLITS)}")
    spec = SPLITS[split]
    n, seed = spec.n if n is None else n, spec.seed if seed is None else seed
    return [
        generate_task(spec, random.Random(seed * 1_000_003 + i), f"{split}-{i:04d}")
        for i in range(n)
    ]


# ----------------------------------------------------------------------------- environment


def _cell_words(cell) -> str:
    return f"{cell[0]} {cell[1]}"


class Navigation(Env):
    """Visit waypoints A, B, ... in order, then `finish` on the last one; see the module docstring.

    The agent sees its position, the next target and which neighbours are blocked, never the map. The `route` tool
    (it costs a turn) returns a shortest path to the next target; its remainder opens every observation while the
    agent follows it, and is dropped when the agent leaves it or reaches the target. So a good move is always
    readable from the context: the route's next direction if one is held, else the tool itself.
    State besides the Env attributes: `pos`, `path` (positions: start, then after each turn), `visited` (waypoints
    reached), `route` (remaining directions held), `wall_hits`, `finished_at` (position at `finish`, or None)."""

    def __init__(self, task: NavTask):
        self.task = task
        self._walls, self._points = (
            {tuple(w) for w in task.walls},
            [tuple(w) for w in task.waypoints],
        )
        self._dist = {}  # goal cell -> BFS distance map, cached
        self.reset()

    # --- state helpers
    def _goal(self):
        """Cell to head for: the next unvisited waypoint, or the last one once all are visited."""
        return self._points[min(self.visited, len(self._points) - 1)]

    def _blocked(self, pos, action) -> str:
        """'' if the move is possible, else 'wall' or 'grid'."""
        r, c = pos[0] + MOVES[action][0], pos[1] + MOVES[action][1]
        return (
            "grid"
            if not (0 <= r < self.task.height and 0 <= c < self.task.width)
            else ("wall" if (r, c) in self._walls else "")
        )

    def _at_end(self) -> bool:
        return self.visited == len(self._points) and self.pos == self._points[-1]

    def shortest_moves(self, pos=None) -> list[str]:
        """The moves (ACTIONS order) that start a shortest path from `pos` (default: here) to the current target."""
        pos, goal = pos or self.pos, self._goal()
        if goal not in self._dist:
            self._dist[goal] = bfs_distances(self.task, goal)
        dist = self._dist[goal]
        return [
            a
            for a, (dr, dc) in MOVES.items()
            if dist.get((pos[0] + dr, pos[1] + dc), -2) == dist[pos] - 1
        ]

    def _route(self) -> list[str]:
        """Directions of the first shortest path (ACTIONS order) from here to the current target."""
        pos, dirs = self.pos, []
        while pos != self._goal():
            a = self.shortest_moves(pos)[0]
            pos, dirs = (pos[0] + MOVES[a][0], pos[1] + MOVES[a][1]), dirs + [a.split()[1]]
        return dirs

    def _target_words(self) -> str:
        if self.visited < len(self._points):
            return f"next {LABELS[self.visited]} {_cell_words(self._goal())}"
        if self._at_end():
            return "next finish"
        return f"next finish at {LABELS[len(self._points) - 1]} {_cell_words(self._goal())}"

    def _state_words(self) -> str:
        blocked = [a.split()[1] for a in MOVES if self._blocked(self.pos, a)]
        held = f"route {' '.join(self.route)} . " if self.route else ""
        return f"{held}pos {_cell_words(self.pos)} {self._target_words()} blocked {' '.join(blocked) or 'none'}"

    # --- Env API
    def reset(self) -> str:
        self.pos, self.visited, self.wall_hits, self.route = tuple(self.task.start), 0, 0, []
        self.done, self.turns, self.finished_at = False, 0, None
        self.actions, self.observations, self.path = [], [], [self.pos]
        plan = " then ".join(f"{LABELS[i]} {_cell_words(p)}" for i, p in enumerate(self._points))
        return (
            f"visit {plan} then finish . grid {self.task.height} {self.task.width} . "
            f"{self._state_words()}"
        )

    def step(self, action: str) -> tuple[str, bool]:
        if self.done:  # not a turn, not recorded
            return f"error episode over {self._state_words()}", True
        self.actions.append(action)
        self.turns += 1
        a, prefix = action.strip() if isinstance(action, str) else None, ""
        if a == "finish":
            self.done, self.finished_at = True, self.pos
            prefix = "episode over "
        elif a == "route":
            self.route = self._route()
        elif a in MOVES:
            hit = self._blocked(self.pos, a)
            if hit:
                self.wall_hits += 1
                prefix = "error hit wall " if hit == "wall" else "error off grid "
            else:
                self.pos = (self.pos[0] + MOVES[a][0], self.pos[1] + MOVES[a][1])
                self.route = (
                    self.route[1:] if self.route[:1] == [a.split()[1]] else []
                )  # followed, or left
                if self.visited < len(self._points) and self.pos == self._goal():
                    self.visited, self.route = self.visited + 1, []
        else:
            prefix = "error unknown action "
        obs = prefix + self._state_words()
        if not self.done and self.turns >= self.task.max_turns:
            self.done = True
            obs += " . out of turns"
        self.observations.append(obs)
        self.path.append(self.pos)
        return obs, self.done

    def score(self) -> RubricResult:
        finished = self.finished_at is not None
        return RubricResult(
            {
                "waypoints_in_order": self.visited == len(self._points),
                "finished_at_goal": finished and self._at_end(),
                "no_wall_hits": self.wall_hits == 0,
                "within_turn_limit": finished and self.turns <= self.task.max_turns,
            }
        )

    def optimal_action(self) -> str:
        """The action the context determines: finish at the end, the held route's next move, else `route`."""
        if self._at_end():
            return "finish"
        return f"move {self.route[0]}" if self.route else "route"

    def hint(self) -> str:
        """E.g. 'next A 3 1 do route', 'next A 3 1 do move down' (a route is held) or 'next finish do finish'."""
        return f"{self._target_words()} do {self.optimal_action()}"

    def check_step(self, action: str) -> StepCheck:
        """Flags only what the agent's context shows to be wrong: the episode is over; an unknown action; a move into a
        wall or off the grid; a move off the route it holds, or, holding none, off every shortest path (detour; the
        fix is the tool, not the hidden direction); `route` while holding one (repeat); finish before the end
        (early); a move or `route` after the end (stop). The hint names optimal_action()."""
        a = action.strip() if isinstance(action, str) else None
        if self.done:
            why = "over the episode is over"
        elif a not in ACTIONS:
            why = "unknown action is not a valid tool call"
        elif self._at_end():
            if a == "finish":
                return StepCheck(True)
            why = f"stop {a} after visiting all waypoints"
        elif a == "finish":
            why = (
                "early finish before visiting all waypoints"
                if self.visited < len(self._points)
                else f"early finish away from {LABELS[len(self._points) - 1]}"
            )
        elif a == "route":
            if not self.route:
                return StepCheck(True)
            why = "repeat route is already held"
        elif self._blocked(self.pos, a):
            why = f"wall {a} " + (
                "hits a wall" if self._blocked(self.pos, a) == "wall" else "leaves the grid"
            )
        elif self.route:
            if a == f"move {self.route[0]}":
                return StepCheck(True)
            why = f"detour {a} leaves the route"
        elif a in self.shortest_moves():
            return StepCheck(True)
        else:
            why = f"detour {a} is not on a shortest path"
        return StepCheck(False, f"{why} ; {self.hint()}")

    def rubric_text(self) -> str:
        plan = " then ".join(f"{LABELS[i]} {_cell_words(p)}" for i, p in enumerate(self._points))
        return (
            f"rubric visit {plan} in order ; finish at {LABELS[len(self._points) - 1]} ; "
            f"never move into a wall or off the grid ; finish within {self.task.max_turns} turns"
        )

    @classmethod
    def splits(cls) -> list[str]:
        return list(SPLITS) + list(CARVED)

    @classmethod
    def tasks(cls, split: str) -> list[NavTask]:
        """A split of SPLITS, or of CARVED (parts of train, to choose settings on without touching test)."""
        return (
            make_tasks(CARVED[split][0])[CARVED[split][1]] if split in CARVED else make_tasks(split)
        )

    @classmethod
    def vocabulary(cls) -> list[str]:
        words = (
            " ".join(ACTIONS) + " visit then grid pos next blocked none error hit wall off"
            " unknown action episode over out of turns at do rubric in order never into a or"
            " the within is not valid tool call detour on shortest path early before visiting"
            " all waypoints away from stop after leaves hits repeat already held ; ."
        ).split()
        words += list(LABELS) + [str(i) for i in range(MAX_NUMBER + 1)]
        return list(dict.fromkeys(words))  # ordered, no duplicates


def run_actions(task: NavTask, actions: list[str]) -> Navigation:
    """A fresh episode of `task` with `actions` applied (those after the episode ends are ignored)."""
    env = Navigation(task)
    for a in actions:
        if not env.done:
            env.step(a)
    return env


def render(task: NavTask, path=None) -> str:
    """ASCII grid with row and column numbers: '#' wall, 'S' start, 'A'..'F' waypoints, '*' path
    cells, '.' free. `path` is a list of [row, col] positions or of actions (replayed from the start)."""
    if path and isinstance(path[0], str):
        path = run_actions(task, path).path
    grid = [["."] * task.width for _ in range(task.height)]
    for r, c in path or []:
        grid[r][c] = "*"
    for r, c in task.walls:
        grid[r][c] = "#"
    grid[task.start[0]][task.start[1]] = "S"
    for label, (r, c) in zip(LABELS, task.waypoints):
        grid[r][c] = label
    head = "  " + " ".join(str(c % 10) for c in range(task.width))
    return "\n".join([head] + [f"{r % 10} " + " ".join(row) for r, row in enumerate(grid)])


# ----------------------------------------------------------------------------- audit: baselines and what a context shows


def greedy_action(env: Navigation, rng: random.Random) -> str:
    """The learning-free walker (no tools, no map): finish at the end, else a random unblocked move that brings it
    closer (Manhattan) to its target, else a random unblocked move."""
    if env._at_end():
        return "finish"
    goal, free = env._goal(), [a for a in MOVES if not env._blocked(env.pos, a)]
    closer = [
        a
        for a in free
        if abs(goal[0] - env.pos[0] - MOVES[a][0]) + abs(goal[1] - env.pos[1] - MOVES[a][1])
        < abs(goal[0] - env.pos[0]) + abs(goal[1] - env.pos[1])
    ]
    return rng.choice(closer or free)


def context_action(text: str) -> str:
    """The action an agent's latest message determines, read from its words alone: the held route's next move,
    finish when it says 'next finish' with nothing left to reach, else the `route` tool."""
    words = text.split()
    if "route" in words:
        return f"move {words[words.index('route') + 1]}"
    return "finish" if "next finish" in text and "next finish at" not in text else "route"


def pass_at_1(tasks: list[NavTask], walker, samples: int = 4, seed: int = 0) -> float:
    """Mean success (%) of `walker(env, rng) -> action` over `samples` episodes of each task."""
    rng, runs = random.Random(seed), [Navigation(t) for t in tasks for _ in range(samples)]
    for env in runs:
        while not env.done:
            env.step(walker(env, rng))
    return 100 * sum(env.score().success for env in runs) / len(runs)


def undecidable_flags(tasks: list[NavTask], seed: int = 0) -> tuple[int, int]:
    """(flagged steps whose hinted action is not what the agent's latest message shows, flagged steps) over episodes
    of a noisy walker: each turn the hinted action, the greedy walker's or any action, at random."""
    rng, bad, flagged = random.Random(seed), 0, 0
    for env in map(Navigation, tasks):
        text = env.reset()
        while not env.done:
            action = rng.choice(
                [env.optimal_action(), greedy_action(env, rng), rng.choice(ACTIONS + ("jump",))]
            )
            check = env.check_step(action)
            if not check.valid:
                flagged += 1
                bad += check.reason.split(" do ")[-1] != context_action(text)
            text = env.step(action)[0]
    return bad, flagged


# ----------------------------------------------------------------------------- choosing an environment (plug-in point)

ENVS: dict[
    str, type[Env] | str
] = {  # name -> class, or "module:Class" of an optional env, imported on first use
    "navigation": Navigation,
    "tau2-telecom": "extras.tau2:Tau2Telecom",
    "tau2-airline": "extras.tau2:Tau2Airline",
    "tau2-retail": "extras.tau2:Tau2Retail",
}


def env_class(name: str) -> type[Env]:
    """The Env class registered under `name`; an optional one is imported here, the only place the core reaches
    extras/ (its import says what to install when a package is missing)."""
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}; choose from {list(ENVS)}")
    if isinstance(ENVS[name], str):
        module, cls = ENVS[name].split(":")
        ENVS[name] = getattr(importlib.import_module(module), cls)
    return ENVS[name]


def env_tasks(name: str, split: str) -> list:
    """The tasks of a split of an env."""
    return env_class(name).tasks(split)


if (
    __name__ == "__main__"
):  # python envs.py [audit]: a sample task and the split table, or the audit
    import sys

    if sys.argv[1:] == ["audit"]:
        print(
            "| split | flagged steps | undecidable | greedy walker p@1 | oracle (route + follow) p@1 |"
        )
        for name in ("train", "val", "test"):
            tasks = Navigation.tasks(name)
            (bad, flagged), oracle = (
                undecidable_flags(tasks),
                pass_at_1(tasks, lambda env, rng: env.optimal_action(), 1),
            )
            print(
                f"| {name} | {flagged} | {bad} ({100 * bad / max(1, flagged):.1f}%) | "
                f"{pass_at_1(tasks, greedy_action):.2f} | {oracle:.2f} |"
            )
        sys.exit()
    task = make_tasks("test", n=1)[0]
    env, acts = Navigation(task), optimal_actions(task)
    print(
        "first message: "
        + env.reset()
        + "".join(f"\naction: {a} | observation: {env.step(a)[0]}" for a in acts[:3])
    )
    print(
        f"hint: {env.hint()}\nrubric: {env.rubric_text()}\n{render(task, acts)}\noracle: {' ; '.join(acts)}"
    )
    print("| split | grid | density | K | n | seed | slack | optimal actions mean | max |")
    for name, s in SPLITS.items():
        lens = [len(optimal_actions(t)) for t in make_tasks(name)]
        print(
            f"| {name} | {s.height}x{s.width} | {s.density} | {s.k_min}-{s.k_max} | {s.n} | {s.seed} | {s.slack}"
            f" | {sum(lens) / len(lens):.1f} | {max(lens)} |"
        )
