"""Environments for RTI: the `Env` interface and a toy multi-waypoint Navigation task.

The policy is a tiny word-level language model, so every text produced here (first message,
observations, step-check reasons, hints, rubric text, the actions themselves) is words from
`Navigation.vocabulary()` separated by single spaces. Garbage actions are never echoed back.

    >>> task = NavTask("demo", 3, 3, walls=[[1, 1]], start=[0, 0], waypoints=[[2, 2], [0, 2]], max_turns=12)
    >>> env = Navigation(task)
    >>> env.reset()
    'visit A 2 2 then B 0 2 then finish . grid 3 3 . pos 0 0 next A 2 2 blocked up left'
    >>> env.step("move right")
    ('pos 0 1 next A 2 2 blocked up down', False)
    >>> env.check_step("move left").reason
    'detour move left is not on a shortest path ; next A 2 2 dir right'
    >>> env.step("move up")
    ('error off grid pos 0 1 next A 2 2 blocked up down', False)
    >>> print(render(task, optimal_actions(task)))
      0 1 2
    0 S . B
    1 * # *
    2 * * A

Coordinates are (row, col) with row 0 at the top; "up" decreases the row.
Run `python envs.py` to print a sample task, its render and the split statistics.

`ENVS` at the end of the file is the one plug-in point between this core and the optional `extras/` folder: an env
name maps to a class, or to "module:Class" imported on first use (the tau2-bench domains of extras/tau2.py).
"""
from __future__ import annotations

import abc
import importlib
import json
import random
from collections import deque
from dataclasses import asdict, dataclass, fields, replace

ACTIONS = ("move up", "move down", "move left", "move right", "finish")  # fixed tool-call text
MOVES = {"move up": (-1, 0), "move down": (1, 0), "move left": (0, -1), "move right": (0, 1)}
LABELS = "ABCDEF"                  # waypoint labels, in visiting order
MAX_NUMBER = 99                    # numbers 0..99 are words (coordinates, grid size, turn limit)
RUBRIC_ITEMS = ("waypoints_in_order", "finished_at_goal", "no_wall_hits", "within_turn_limit")
RULES = ("unknown", "wall", "detour", "early", "stop", "over")  # first word of a step-check reason


@dataclass(frozen=True)
class StepCheck:
    """Verdict on a proposed action. `reason` is "" when valid; otherwise it starts with the rule
    name (one of RULES) and ends with the hint, e.g. 'wall move up hits a wall ; next A 3 1 dir down'."""
    valid: bool
    reason: str = ""


@dataclass
class RubricResult:
    """Ordered rubric item name -> passed.

    >>> r = RubricResult({"a": True, "b": False}); (r.success, r.fraction)
    (False, 0.5)
    """
    items: dict[str, bool]

    @property
    def success(self) -> bool:
        return all(self.items.values())

    @property
    def fraction(self) -> float:
        return sum(self.items.values()) / len(self.items) if self.items else 0.0


class Env(abc.ABC):
    """One episode of one task: `env = Navigation(task); first_message = env.reset()`.

    Attributes after reset(): `done` (bool), `turns` (actions taken), `actions` (their raw text),
    `observations` (the texts step() returned). Replayable: same task + same actions give the
    same observations."""
    done: bool
    turns: int
    actions: list[str]
    observation_role: str | None = None   # chat role of the latest observation: None = the template's default (tool
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
        """An action on a shortest path in the current state."""

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
    """One grid: walls, a start and waypoints A, B, ... to visit in order. JSON-serialisable
    (`asdict(task)`); cells are [row, col] lists. Validated on construction (ValueError)."""
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
        need(isinstance(self.walls, list) and all(map(_is_cell, self.walls)), "walls must be a list of [row, col]")
        need(_is_cell(self.start), "start must be [row, col]")
        need(isinstance(self.waypoints, list) and 1 <= len(self.waypoints) <= len(LABELS)
             and all(map(_is_cell, self.waypoints)), f"waypoints must be a list of 1..{len(LABELS)} [row, col]")
        self.walls, self.start = [list(w) for w in self.walls], list(self.start)
        self.waypoints = [list(w) for w in self.waypoints]
        points = [self.start] + self.waypoints
        for cell in self.walls + points:
            need(0 <= cell[0] < self.height and 0 <= cell[1] < self.width,
                 f"cell {cell} is outside the {self.height}x{self.width} grid")
        need(not any(p in self.walls for p in points), "start or a waypoint is on a wall")
        need(len({tuple(p) for p in points}) == len(points), "start and waypoints must be distinct cells")
        for a, b in zip(points, points[1:]):
            need(tuple(a) in bfs_distances(self, b), f"waypoint {b} is unreachable from {a}")

    @classmethod
    def from_dict(cls, d: dict) -> NavTask:
        if not isinstance(d, dict):
            raise ValueError("row must be a JSON object")
        names = [f.name for f in fields(cls)]
        missing, extra = [n for n in names if n not in d], [k for k in d if k not in names]
        if missing or extra:
            raise ValueError(f"missing fields {missing} unknown fields {extra}")
        return cls(**d)


def bfs_distances(task: NavTask, goal) -> dict[tuple[int, int], int]:
    """Shortest move count from every reachable cell to `goal` (walls and edges block)."""
    walls = {tuple(w) for w in task.walls}
    goal = tuple(goal)
    dist, queue = {goal: 0}, deque([goal])
    while queue:
        r, c = queue.popleft()
        for dr, dc in MOVES.values():
            n = (r + dr, c + dc)
            if 0 <= n[0] < task.height and 0 <= n[1] < task.width and n not in walls and n not in dist:
                dist[n] = dist[(r, c)] + 1
                queue.append(n)
    return dist


def optimal_actions(task: NavTask) -> list[str]:
    """BFS shortest path through the waypoints in order, then "finish" (ties broken in ACTIONS order).

    >>> t = NavTask("t", 1, 3, [], [0, 0], [[0, 2]], 7); optimal_actions(t)
    ['move right', 'move right', 'finish']
    """
    env = Navigation(replace(task, max_turns=MAX_NUMBER))  # the task's own limit must not cut it
    while not env.done:
        env.step(env.optimal_action())
    return env.actions


@dataclass(frozen=True)
class SplitSpec:
    """How a split is generated: grid size, wall density, waypoint count range, size, seed, and
    the turn slack added to the optimal action count to give max_turns."""
    height: int
    width: int
    density: float
    k_min: int
    k_max: int
    n: int
    seed: int
    slack: int = 4


SPLITS = {  # easy: the warm start's; train / test: the hard distribution RL trains and is tested on
    "easy": SplitSpec(7, 7, 0.10, 1, 4, n=2000, seed=1),
    "train": SplitSpec(7, 7, 0.45, 4, 4, n=600, seed=2),
    "test": SplitSpec(7, 7, 0.45, 4, 4, n=150, seed=3),
}

CARVED = {"fit": ("train", slice(0, 500)), "val": ("train", slice(500, 600))}   # validation carved from train


def generate_task(spec: SplitSpec, rng: random.Random, task_id: str) -> NavTask:
    """Draw round(density * cells) walls, a start and K waypoints on free cells; redraw until
    every leg start -> A -> B -> ... is reachable (NavTask validates that)."""
    cells = [(r, c) for r in range(spec.height) for c in range(spec.width)]
    while True:
        k = rng.randint(spec.k_min, spec.k_max)
        walls = set(rng.sample(cells, round(spec.density * len(cells))))
        free = [x for x in cells if x not in walls]
        if len(free) < k + 1:
            continue
        points = [list(p) for p in rng.sample(free, k + 1)]
        try:
            task = NavTask(task_id, spec.height, spec.width, [list(w) for w in sorted(walls)],
                           points[0], points[1:], MAX_NUMBER)
        except ValueError:  # some leg unreachable
            continue
        task.max_turns = len(optimal_actions(task)) + spec.slack
        if task.max_turns <= MAX_NUMBER:
            return task


def make_tasks(split: str, n: int | None = None, seed: int | None = None) -> list[NavTask]:
    """The fixed, seeded split (`n` and `seed` override SPLITS). Ids look like 'test-0007'.
    Task i depends only on (seed, i), so a smaller n gives a prefix of the full split."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {list(SPLITS)}")
    spec = SPLITS[split]
    n = spec.n if n is None else n
    seed = spec.seed if seed is None else seed
    return [generate_task(spec, random.Random(seed * 1_000_003 + i), f"{split}-{i:04d}")
            for i in range(n)]


def save_tasks(tasks: list[NavTask], path) -> None:
    with open(path, "w") as f:
        for t in tasks:
            f.write(json.dumps(asdict(t)) + "\n")


def load_tasks(path) -> list[NavTask]:
    """Read JSONL tasks; a bad row raises ValueError naming the file and line number."""
    tasks = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                tasks.append(NavTask.from_dict(json.loads(line)))
            except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
                raise ValueError(f"{path}:{lineno}: bad task: {e}") from None
    return tasks


# ----------------------------------------------------------------------------- environment

def _cell_words(cell) -> str:
    return f"{cell[0]} {cell[1]}"


class Navigation(Env):
    """Visit waypoints A, B, ... in order, then `finish` on the last one. See the module docstring.
    State besides the Env attributes: `pos` (row, col), `path` (positions: start, then after each
    turn), `visited` (waypoints reached so far), `wall_hits`, `finished_at` (position at `finish`,
    or None)."""

    def __init__(self, task: NavTask):
        self.task = task
        self._walls = {tuple(w) for w in task.walls}
        self._points = [tuple(w) for w in task.waypoints]
        self._dist = {}  # goal cell -> BFS distance map, cached
        self.reset()

    # --- state helpers
    def _goal(self):
        """Cell to head for: the next unvisited waypoint, or the last one once all are visited."""
        return self._points[min(self.visited, len(self._points) - 1)]

    def _distances(self, goal):
        if goal not in self._dist:
            self._dist[goal] = bfs_distances(self.task, goal)
        return self._dist[goal]

    def _blocked(self, pos, action) -> str:
        """'' if the move is possible, else 'wall' or 'grid'."""
        r, c = pos[0] + MOVES[action][0], pos[1] + MOVES[action][1]
        if not (0 <= r < self.task.height and 0 <= c < self.task.width):
            return "grid"
        return "wall" if (r, c) in self._walls else ""

    def _all_visited(self) -> bool:
        return self.visited == len(self._points)

    def _target_words(self) -> str:
        if not self._all_visited():
            return f"next {LABELS[self.visited]} {_cell_words(self._goal())}"
        if self.pos == self._goal():
            return "next finish"
        return f"next finish at {LABELS[self.visited - 1]} {_cell_words(self._goal())}"

    def _state_words(self) -> str:
        blocked = [a.split()[1] for a in MOVES if self._blocked(self.pos, a)]
        return f"pos {_cell_words(self.pos)} {self._target_words()} blocked {' '.join(blocked) or 'none'}"

    # --- Env API
    def reset(self) -> str:
        self.pos, self.visited, self.wall_hits = tuple(self.task.start), 0, 0
        self.done, self.turns, self.finished_at = False, 0, None
        self.actions, self.observations, self.path = [], [], [self.pos]
        plan = " then ".join(f"{LABELS[i]} {_cell_words(p)}" for i, p in enumerate(self._points))
        return (f"visit {plan} then finish . grid {self.task.height} {self.task.width} . "
                f"{self._state_words()}")

    def step(self, action: str) -> tuple[str, bool]:
        if self.done:  # not a turn, not recorded
            return f"error episode over {self._state_words()}", True
        self.actions.append(action)
        self.turns += 1
        a = action.strip() if isinstance(action, str) else None
        prefix = ""
        if a == "finish":
            self.done, self.finished_at = True, self.pos
            prefix = "episode over "
        elif a in MOVES:
            hit = self._blocked(self.pos, a)
            if hit:
                self.wall_hits += 1
                prefix = "error hit wall " if hit == "wall" else "error off grid "
            else:
                self.pos = (self.pos[0] + MOVES[a][0], self.pos[1] + MOVES[a][1])
                if not self._all_visited() and self.pos == self._goal():
                    self.visited += 1
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
        return RubricResult({
            "waypoints_in_order": self._all_visited(),
            "finished_at_goal": finished and self._all_visited() and self.finished_at == self._points[-1],
            "no_wall_hits": self.wall_hits == 0,
            "within_turn_limit": finished and self.turns <= self.task.max_turns,
        })

    def optimal_action(self) -> str:
        """First action in ACTIONS order on a shortest path (finish once done at the goal)."""
        goal = self._goal()
        if self.pos == goal and self._all_visited():
            return "finish"
        dist = self._distances(goal)
        for a, (dr, dc) in MOVES.items():
            if dist.get((self.pos[0] + dr, self.pos[1] + dc), -2) == dist[self.pos] - 1:
                return a
        raise AssertionError("unreachable goal; tasks are validated as solvable")

    def hint(self) -> str:
        """E.g. 'next A 3 1 dir down', or 'next finish dir finish' when finishing is optimal."""
        return f"{self._target_words()} dir {self.optimal_action().split()[-1]}"

    def check_step(self, action: str) -> StepCheck:
        """Invalid if: unknown action; a move into a wall or off the grid; a move off every shortest
        path to the next waypoint (detour); finish before the goal (early); a move once all
        waypoints are visited and the agent stands on the last (stop); the episode is over."""
        a = action.strip() if isinstance(action, str) else None
        goal = self._goal()
        if self.done:
            why = "over the episode is over"
        elif a not in ACTIONS:
            why = "unknown action is not a valid tool call"
        elif a == "finish":
            if self._all_visited() and self.pos == goal:
                return StepCheck(True)
            why = ("early finish before visiting all waypoints" if not self._all_visited()
                   else f"early finish away from {LABELS[len(self._points) - 1]}")
        elif self._blocked(self.pos, a):
            why = f"wall {a} " + ("hits a wall" if self._blocked(self.pos, a) == "wall" else "leaves the grid")
        elif self._all_visited() and self.pos == goal:
            why = f"stop {a} after visiting all waypoints"
        else:
            dist = self._distances(goal)
            if dist[(self.pos[0] + MOVES[a][0], self.pos[1] + MOVES[a][1])] == dist[self.pos] - 1:
                return StepCheck(True)
            why = f"detour {a} is not on a shortest path"
        return StepCheck(False, f"{why} ; {self.hint()}")

    def rubric_text(self) -> str:
        plan = " then ".join(f"{LABELS[i]} {_cell_words(p)}" for i, p in enumerate(self._points))
        return (f"rubric visit {plan} in order ; finish at {LABELS[len(self._points) - 1]} ; "
                f"never move into a wall or off the grid ; finish within {self.task.max_turns} turns")

    @classmethod
    def splits(cls) -> list[str]:
        return list(SPLITS) + list(CARVED)

    @classmethod
    def tasks(cls, split: str) -> list[NavTask]:
        """A split of SPLITS, or of CARVED (parts of train, to choose settings on without touching test)."""
        return make_tasks(CARVED[split][0])[CARVED[split][1]] if split in CARVED else make_tasks(split)

    @classmethod
    def vocabulary(cls) -> list[str]:
        words = (" ".join(ACTIONS) + " visit then grid pos next blocked none error hit wall off"
                 " unknown action episode over out of turns at dir rubric in order never into a or"
                 " the within is not valid tool call detour on shortest path early before visiting"
                 " all waypoints away from stop after leaves hits ; .").split()
        words += list(LABELS) + [str(i) for i in range(MAX_NUMBER + 1)]
        return list(dict.fromkeys(words))  # ordered, no duplicates


def run_actions(task: NavTask, actions: list[str]) -> Navigation:
    """A fresh episode of `task` with `actions` applied (those after the episode ends are ignored)."""
    env = Navigation(task)
    for a in actions:
        if env.done:
            break
        env.step(a)
    return env


def render(task: NavTask, path=None) -> str:
    """ASCII grid with row and column numbers: '#' wall, 'S' start, 'A'..'F' waypoints, '*' path
    cells, '.' free. `path` is a list of [row, col] positions or of actions (replayed from the start)."""
    if path and isinstance(path[0], str):
        path = run_actions(task, path).path
    cells = [tuple(p) for p in path or []]
    grid = [["."] * task.width for _ in range(task.height)]
    for r, c in cells:
        grid[r][c] = "*"
    for r, c in task.walls:
        grid[r][c] = "#"
    grid[task.start[0]][task.start[1]] = "S"
    for label, (r, c) in zip(LABELS, task.waypoints):
        grid[r][c] = label
    head = "  " + " ".join(str(c % 10) for c in range(task.width))
    return "\n".join([head] + [f"{r % 10} " + " ".join(row) for r, row in enumerate(grid)])



# ----------------------------------------------------------------------------- choosing an environment (plug-in point)

ENVS: dict[str, type[Env] | str] = {   # name -> class, or "module:Class" of an optional env, imported on first use
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


if __name__ == "__main__":  # python envs.py: a sample task and the split statistics
    task = make_tasks("test", n=1)[0]
    env, acts = Navigation(task), optimal_actions(task)
    print("first message:", env.reset())
    for a in acts[:2]:
        print("action:", a, "| observation:", env.step(a)[0])
    print("hint:", env.hint())
    print("rubric:", env.rubric_text())
    print(render(task, acts))
    print("optimal actions:", " ; ".join(acts))
    print("vocabulary size:", len(Navigation.vocabulary()))
    print("| split | grid | density | K | n | seed | optimal actions mean | max |")
    for name, s in SPLITS.items():
        lens = [len(optimal_actions(t)) for t in make_tasks(name)]
        print(f"| {name} | {s.height}x{s.width} | {s.density} | {s.k_min}-{s.k_max} | {s.n} | {s.seed}"
              f" | {sum(lens) / len(lens):.1f} | {max(lens)} |")
