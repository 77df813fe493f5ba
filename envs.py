"""RTI's environments: the `Env` interface and a toy multi-waypoint Navigation task with a map tool.

The policy is a tiny word-level language model, so every text produced here (first message,
observations, step-check reasons, hints, rubric text, the actions themselves) is words from
`Navigation.vocabulary()` separated by single spaces. Garbage actions are never echoed back.

    >>> task = NavTask("demo", height=3, width=3, walls=[[1, 1]], start=[0, 0],
    ...                waypoints=[[2, 2], [0, 2]], max_turns=12)
    >>> env = Navigation(task)
    >>> env.reset()
    'visit A 2 2 then B 0 2 then finish . grid 3 3 . pos 0 0 next A 2 2 blocked up left'

A step check's reason names the rule an action breaks and ends with the hint. With no route held the
hint is the `route` tool, not the hidden direction; with one held, the route's next move:

    >>> env.check_step("move left").reason
    'wall move left leaves the grid ; next A 2 2 do route'
    >>> env.step("route")
    ('route down down right right . pos 0 0 next A 2 2 blocked up left', False)
    >>> env.step("move down")
    ('route down right right . pos 1 0 next A 2 2 blocked left right', False)
    >>> env.check_step("move up").reason
    'detour move up leaves the route ; next A 2 2 do move down'

Coordinates are (row, col) with row 0 at the top; "up" decreases the row. The oracle's path (each
leg: `route`, then follow it) on this grid: '#' wall, 'S' start, 'A' and 'B' waypoints, '*' path:

    >>> print(render(task, optimal_actions(task)))
      0 1 2
    0 S . B
    1 * # *
    2 * * A

`python envs.py` prints a sample task, its render and the split table. The audit (does every hint
name an action the agent's context shows? how far do learning-free walkers get?) is in
extras/audit.py: `python -m extras.audit [--env navigation-keys]`. "navigation-keys"
(extras/navigation_keys.py) is Navigation plus a task family beyond the warm start's skills: a
locked door on the way and a key that only the `find key` tool locates.

`ENVS` at the end of the file is the one plug-in point between this core and the optional `extras/`
folder: an env name maps to a class, or to "module:Class" imported on first use (the tau2-bench
domains of extras/tau2.py).
"""

from __future__ import annotations

import abc
import importlib
import random
import string
from collections import deque
from dataclasses import dataclass, replace
from typing import ClassVar

# the tool calls, as the agent writes them
ACTIONS = ("move up", "move down", "move left", "move right", "route", "finish")
MOVES = {"move up": (-1, 0), "move down": (1, 0), "move left": (0, -1), "move right": (0, 1)}
LABELS = "ABCDEF"  # waypoint labels, in visiting order
MAX_NUMBER = 99  # numbers 0..99 are words (coordinates, grid size, turn limit)
RUBRIC_ITEMS = ("waypoints_in_order", "finished_at_goal", "no_wall_hits", "within_turn_limit")
# the first word of a step-check reason: the rule the action breaks
RULES = ("unknown", "wall", "detour", "repeat", "early", "stop", "over")
# task i of a split drawn with `seed` uses random.Random(seed * SEED_STRIDE + i): a distinct
# stream per (seed, index), so task i does not depend on the split's size
SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class StepCheck:
    """Verdict on a proposed action. `reason` is "" when valid; otherwise it starts with the rule
    (one of RULES) and ends with the hint, e.g. 'wall move up hits a wall ; next A 3 1 do route'."""

    valid: bool
    reason: str = ""


@dataclass
class RubricResult:
    """Ordered rubric item name -> passed; `success` iff all pass, `fraction` the share passed."""

    items: dict[str, bool]

    @property
    def success(self) -> bool:
        return all(self.items.values())

    @property
    def fraction(self) -> float:
        if not self.items:
            return 0.0
        return sum(self.items.values()) / len(self.items)


class Env(abc.ABC):
    """One episode of one task, driven by the trainer (rti.py) and the RTI pipeline (intervene.py).

    `env = Navigation(task); first_message = env.reset()`. Attributes after reset(): `done` (bool),
    `turns` (actions taken), `actions` (their raw text), `observations` (the texts step()
    returned). Replayable: the same task and actions give the same observations, so the pipeline
    can rebuild the state before any step of an episode."""

    done: bool
    turns: int
    actions: list[str]
    # the chat role of the latest observation, for the chat template: None is the template's
    # default (a tool or user message); tau2's airline and retail set "user" for a user's reply
    observation_role: str | None = None

    @abc.abstractmethod
    def reset(self) -> str:
        """(Re)start the episode; return the first user message, which a rollout starts from."""

    @abc.abstractmethod
    def step(self, action: str) -> tuple[str, bool]:
        """Execute an action; return (observation, done). Never raises: a policy writes anything."""

    @abc.abstractmethod
    def score(self) -> RubricResult:
        """Score the episode, finished or not, against the rubric; `success` is the RL reward."""

    @abc.abstractmethod
    def check_step(self, action: str) -> StepCheck:
        """Check an action without executing it: the rubric validator, which flags steps to fix."""

    @abc.abstractmethod
    def rubric_text(self) -> str:
        """The rubric as text, for the prompts of the LLM validator and verifier."""

    @abc.abstractmethod
    def hint(self) -> str:
        """A short hint for the current state, shown to the policy when it corrects itself."""

    @abc.abstractmethod
    def optimal_action(self) -> str:
        """The right action the hint names, one the agent's context shows: the rule corrector's."""

    def evidence(self) -> str:
        """What the grader knows in the current state, shown to a corrector instead of the hint
        under --corrector-sees evidence (default: the hint, for an env that hides nothing)."""
        return self.hint()

    def justified(self, action: str) -> bool:
        """Whether the agent's own context supports the action, the verifier's integrity check:
        a valid action may still copy what only the grader knows (default: valid is justified)."""
        return self.check_step(action).valid

    @classmethod
    @abc.abstractmethod
    def vocabulary(cls) -> list[str]:
        """Every word a text of this env can contain: the tiny model's tokens, numbered in order."""

    @classmethod
    @abc.abstractmethod
    def splits(cls) -> list[str]:
        """The names of the task splits, which the config checks its split flags against."""

    @classmethod
    @abc.abstractmethod
    def tasks(cls, split: str) -> list:
        """The tasks of a split, to train or evaluate on (unknown: ValueError naming the splits)."""

    @classmethod
    def make(cls, task, user=None) -> Env:
        """A fresh env for `task`, one per rollout; `user` plays the user where the env has one."""
        return cls(task)

    @classmethod
    def make_user(cls, user_model: str, sampler):
        """The user of the episodes, from --user-model ('' = the policy's model); None: no user."""
        return None


# ----------------------------------------------------------------------------- tasks


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_cell(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) == 2 and all(_is_int(v) for v in x)


@dataclass
class NavTask:
    """One grid: walls, a start and waypoints A, B, ... to visit in order; JSON-serialisable
    (`asdict(task)`), cells are [row, col] lists. Validated on construction (ValueError)."""

    task_id: str
    height: int
    width: int
    walls: list[list[int]]
    start: list[int]
    waypoints: list[list[int]]
    max_turns: int
    ENV: ClassVar[str] = "navigation"  # the env (ENVS) that plays the task: envs.player

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
        self.walls = [list(w) for w in self.walls]
        self.start = list(self.start)
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


def _moved(pos, action: str) -> tuple[int, int]:
    """The cell one move (a key of MOVES) away from `pos`, on the grid or not."""
    dr, dc = MOVES[action]
    return (pos[0] + dr, pos[1] + dc)


def bfs_distances(task: NavTask, goal, blocked=()) -> dict[tuple[int, int], int]:
    """Shortest move count from every reachable cell to `goal` (walls, edges and the cells of
    `blocked`, e.g. locked doors, block)."""
    walls = {tuple(w) for w in task.walls} | {tuple(b) for b in blocked}
    goal = tuple(goal)
    dist = {goal: 0}
    queue = deque([goal])
    while queue:
        cell = queue.popleft()
        for move in MOVES:
            n = _moved(cell, move)
            inside = 0 <= n[0] < task.height and 0 <= n[1] < task.width
            if inside and n not in walls and n not in dist:
                dist[n] = dist[cell] + 1
                queue.append(n)
    return dist


def optimal_actions(task: NavTask) -> list[str]:
    """The oracle's episode: each leg `route`, then the route's moves (ties broken in ACTIONS
    order); then `finish`. The task is played by its own env (player(task)), so the oracle of a
    family with more tools (extras/navigation_keys.py) takes them too."""
    env = player(task)(replace(task, max_turns=MAX_NUMBER))  # the task's own limit must not cut it
    while not env.done:
        env.step(env.optimal_action())
    return env.actions


@dataclass(frozen=True)
class SplitSpec:
    """How a split is generated: grid size, wall density, waypoint count range, size, seed, and the
    turn slack added to the oracle's action count (optimal moves, one `route` a leg, finish) to give
    max_turns."""

    height: int
    width: int
    density: float
    k_min: int
    k_max: int
    n: int
    seed: int
    slack: int = 2
    # tasks whose max_turns would exceed it are redrawn: an episode fits 2,048 positions
    turn_cap: int = 48


SPLITS = {  # easy: the warm start's; train / test: the hard distribution RL trains and is tested on
    "easy": SplitSpec(9, 9, 0.10, 1, 4, n=2000, seed=1),
    "train": SplitSpec(9, 9, 0.45, 4, 4, n=600, seed=2),
    "test": SplitSpec(9, 9, 0.45, 4, 4, n=150, seed=3),
}
# validation carved from train: split name -> (source split, its slice)
CARVED = {"fit": ("train", slice(0, 500)), "val": ("train", slice(500, 600))}


def generate_task(spec: SplitSpec, rng: random.Random, task_id: str) -> NavTask:
    """Draw round(density * cells) walls, a start and K waypoints on free cells; redraw until every
    leg start -> A -> B -> ... is reachable (NavTask validates that)."""
    cells = [(r, c) for r in range(spec.height) for c in range(spec.width)]
    while True:
        k = rng.randint(spec.k_min, spec.k_max)
        walls = set(rng.sample(cells, round(spec.density * len(cells))))
        free = [x for x in cells if x not in walls]
        if len(free) < k + 1:
            continue
        points = [list(p) for p in rng.sample(free, k + 1)]
        wall_list = [list(w) for w in sorted(walls)]
        try:
            task = NavTask(
                task_id, spec.height, spec.width, wall_list, points[0], points[1:], MAX_NUMBER
            )
        except ValueError:  # some leg unreachable
            continue
        task.max_turns = len(optimal_actions(task)) + spec.slack
        if task.max_turns <= spec.turn_cap:
            return task


def make_tasks(split: str, n: int | None = None, seed: int | None = None) -> list[NavTask]:
    """The fixed, seeded split (`n` and `seed` override SPLITS). Ids look like 'test-0007'. Task i
    depends only on (seed, i), so a smaller n gives a prefix of the full split."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {list(SPLITS)}")
    spec = SPLITS[split]
    if n is None:
        n = spec.n
    if seed is None:
        seed = spec.seed
    return [
        generate_task(spec, random.Random(seed * SEED_STRIDE + i), f"{split}-{i:04d}")
        for i in range(n)
    ]


# ----------------------------------------------------------------------------- the texts
# Every text Navigation writes is one of these str.format templates, filled with labels, numbers,
# move directions and actions. Navigation.vocabulary() gathers its words from them, so a word added
# to a text is a word of the model. Their order is the order of the tiny model's token ids
# (policy.load_model numbers the vocabulary in order; the committed checkpoints depend on it): add new
# texts at the end.

FIRST_MESSAGE = "visit {plan} then finish . grid {height} {width} . {state}"
PLAN_STEP = "{label} {cell}"  # one waypoint of the plan; the plan joins them with " then "
# what the agent sees: it closes the first message and every observation
STATE = "{held}pos {cell} next {target} blocked {blocked}"
HELD_ROUTE = "route {directions} . "  # opens the state while a route is held
NOTHING_BLOCKED = "none"
# an observation opens with what the action did (nothing for a move or `route` that worked)
OUTCOMES = {
    "wall": "error hit wall ",
    "grid": "error off grid ",
    "unknown": "error unknown action ",
    "finish": "episode over ",
    "over": "error episode over ",  # an action after the end: not a turn, not recorded
}
OUT_OF_TURNS = " . out of turns"  # closes the observation of the last turn allowed
TARGETS = {  # what is next, in the state and the hint
    "waypoint": "{label} {cell}",
    "finish": "finish",
    "return": "finish at {label} {cell}",  # all waypoints visited, but the agent left the last one
}
HINT = "next {target} do {action}"
RUBRIC = (
    "rubric visit {plan} in order ; finish at {label} ; never move into a wall or off the grid ;"
    " finish within {max_turns} turns"
)
REASON = "{why} ; {hint}"  # a refused step: why (its first word is the rule), then the hint
# what the grader knows: the rest of a shortest path to the target (Navigation.evidence)
EVIDENCE = "next {target} path {directions}"
WHY = {  # why check_step refuses an action
    "over": "over the episode is over",
    "unknown": "unknown action is not a valid tool call",
    "off path": "detour {action} is not on a shortest path",
    "early": "early finish before visiting all waypoints",
    "early away": "early finish away from {label}",
    "stop": "stop {action} after visiting all waypoints",
    "off route": "detour {action} leaves the route",
    "grid": "wall {action} leaves the grid",
    "wall": "wall {action} hits a wall",
    "repeat": "repeat route is already held",
}
TEXTS = (
    FIRST_MESSAGE,
    PLAN_STEP,
    STATE,
    HELD_ROUTE,
    NOTHING_BLOCKED,
    *OUTCOMES.values(),
    OUT_OF_TURNS,
    *TARGETS.values(),
    HINT,
    RUBRIC,
    REASON,
    *WHY.values(),
    EVIDENCE,
)
SEPARATORS = (";", ".")  # the texts' punctuation: vocabulary() puts it after their words


def _literal_words(template: str) -> list[str]:
    """The words of a str.format template outside its {fields}."""
    return [w for literal, *_ in string.Formatter().parse(template) for w in literal.split()]


# ----------------------------------------------------------------------------- environment


def _cell_words(cell) -> str:
    return f"{cell[0]} {cell[1]}"


class Navigation(Env):
    """Visit waypoints A, B, ... in order, then `finish` on the last one; see the module docstring.

    The agent sees its position, the next target and which neighbours are blocked, never the map.
    The `route` tool (it costs a turn) returns a shortest path to the next target; its remainder
    opens every observation while the agent follows it, and is dropped when the agent leaves it or
    reaches the target. So a good move is always readable from the context: the route's next
    direction if one is held, else the tool itself.

    State besides the Env attributes: `pos`, `path` (positions: start, then after each turn),
    `visited` (waypoints reached), `route` (remaining directions held), `wall_hits`, `finished_at`
    (position at `finish`, or None)."""

    TOOL_CALLS = ACTIONS  # the tool calls of this env, as the agent writes them
    OUTCOME_TEXTS = OUTCOMES  # what an action did, by name (a subclass adds its own)
    WHY_TEXTS = WHY  # why check_step refuses an action, by name (a subclass adds its own)

    def __init__(self, task: NavTask):
        if not isinstance(self, player(task)):
            raise ValueError(
                f"task {task.task_id!r} is a {task.ENV} task: {type(self).__name__} would play it"
                f" without its rules; use --env {task.ENV} (envs.player(task) plays it)"
            )
        self.task = task
        self._walls = {tuple(w) for w in task.walls}
        self._points = [tuple(w) for w in task.waypoints]
        self._dist = {}  # goal cell -> BFS distance map, cached
        self.reset()

    # --- state helpers
    def goal(self) -> tuple[int, int]:
        """The cell to head for: the next unvisited waypoint, or the last one once all are."""
        return self._points[min(self.visited, len(self._points) - 1)]

    def blocked(self, pos, action: str) -> str:
        """'' if the move from `pos` is possible, else what stops it: 'wall' or 'grid'."""
        r, c = _moved(pos, action)
        if not (0 <= r < self.task.height and 0 <= c < self.task.width):
            return "grid"
        return "wall" if (r, c) in self._walls else ""

    def at_end(self) -> bool:
        """All waypoints visited and standing on the last one: only `finish` is left to do."""
        return self.visited == len(self._points) and self.pos == self._points[-1]

    def shortest_moves(self, pos=None) -> list[str]:
        """The moves (ACTIONS order) that start a shortest path to the goal from `pos` (or here)."""
        pos = pos or self.pos
        goal = self.goal()
        if goal not in self._dist:
            self._dist[goal] = bfs_distances(self.task, goal)
        dist = self._dist[goal]
        return [a for a in MOVES if dist.get(_moved(pos, a), -2) == dist[pos] - 1]

    def _route(self) -> list[str]:
        """Directions of the first shortest path (ACTIONS order) from here to the goal."""
        pos = self.pos
        directions = []
        while pos != self.goal():
            move = self.shortest_moves(pos)[0]
            pos = _moved(pos, move)
            directions.append(move.split()[1])
        return directions

    def _target(self) -> str:
        """What is next, for the state and the hint: a waypoint, finish, or back to the last one."""
        cell = _cell_words(self.goal())
        if self.visited < len(self._points):
            return TARGETS["waypoint"].format(label=LABELS[self.visited], cell=cell)
        if self.at_end():
            return TARGETS["finish"]
        return TARGETS["return"].format(label=LABELS[len(self._points) - 1], cell=cell)

    def _state(self) -> str:
        """What the agent sees after each step: the route it holds, where it is, what is next and
        which neighbours are blocked."""
        held = HELD_ROUTE.format(directions=" ".join(self.route)) if self.route else ""
        blocked = " ".join(a.split()[1] for a in MOVES if self.blocked(self.pos, a))
        return STATE.format(
            held=held,
            cell=_cell_words(self.pos),
            target=self._target(),
            blocked=blocked or NOTHING_BLOCKED,
        )

    def _plan(self) -> str:
        """The waypoints in visiting order, e.g. 'A 2 2 then B 0 2'."""
        return " then ".join(
            PLAN_STEP.format(label=LABELS[i], cell=_cell_words(p))
            for i, p in enumerate(self._points)
        )

    # --- Env API
    def reset(self) -> str:
        self.pos = tuple(self.task.start)
        self.visited = 0
        self.wall_hits = 0
        self.route = []
        self.done = False
        self.turns = 0
        self.finished_at = None
        self.actions = []
        self.observations = []
        self.path = [self.pos]
        return FIRST_MESSAGE.format(
            plan=self._plan(),
            height=self.task.height,
            width=self.task.width,
            state=self._state(),
        )

    def step(self, action: str) -> tuple[str, bool]:
        if self.done:
            return OUTCOMES["over"] + self._state(), True
        self.actions.append(action)
        self.turns += 1
        outcome = self._act(action.strip() if isinstance(action, str) else None)
        obs = outcome + self._state()
        if not self.done and self.turns >= self.task.max_turns:
            self.done = True
            obs += OUT_OF_TURNS
        self.observations.append(obs)
        self.path.append(self.pos)
        return obs, self.done

    def _act(self, a: str | None) -> str:
        """Execute action `a` (stripped); return what it did, as the observation's opening ('' for
        a move or `route` that worked). A subclass with tools of its own handles them here."""
        if a == "finish":
            self.done = True
            self.finished_at = self.pos
            return self.OUTCOME_TEXTS["finish"]
        if a == "route":
            self.route = self._route()
            return ""
        if a in MOVES:
            hit = self.blocked(self.pos, a)
            if hit:
                self.wall_hits += 1
                return self.OUTCOME_TEXTS[hit]
            self._move(a)
            return ""
        return self.OUTCOME_TEXTS["unknown"]

    def _move(self, move: str) -> None:
        """Take a possible move: following the held route shortens it, any other move drops it, and
        reaching the goal visits it (the route is spent)."""
        self.pos = _moved(self.pos, move)
        if self.route[:1] == [move.split()[1]]:
            self.route = self.route[1:]
        else:
            self.route = []
        if self.visited < len(self._points) and self.pos == self.goal():
            self.visited += 1
            self.route = []

    def score(self) -> RubricResult:
        finished = self.finished_at is not None
        return RubricResult(
            {
                "waypoints_in_order": self.visited == len(self._points),
                "finished_at_goal": finished and self.at_end(),
                "no_wall_hits": self.wall_hits == 0,
                "within_turn_limit": finished and self.turns <= self.task.max_turns,
            }
        )

    def optimal_action(self) -> str:
        """What the context shows: finish at the end, the held route's next move, else `route`."""
        if self.at_end():
            return "finish"
        if self.route:
            return f"move {self.route[0]}"
        return "route"

    def hint(self) -> str:
        """E.g. 'next A 3 1 do route', 'next A 3 1 do move down' (a route is held) or
        'next finish do finish'."""
        return HINT.format(target=self._target(), action=self.optimal_action())

    def evidence(self) -> str:
        """What the grader knows and the agent does not: the rest of a shortest path to the target
        (the route the tool would give), e.g. 'next A 3 1 path down down left'; at the end, the
        hint. A corrector that copies a direction from it while no route is held writes a step
        the agent's context cannot justify."""
        if self.at_end():
            return self.hint()
        return EVIDENCE.format(target=self._target(), directions=" ".join(self._route()))

    def justified(self, action: str) -> bool:
        """Valid, and shown by the context: `route` when none is held, the held route's next move,
        finish at the end. A move while no route is held is not justified, even on a shortest
        path: the agent cannot know it is one."""
        a = action.strip() if isinstance(action, str) else None
        return self.check_step(action).valid and (a not in MOVES or bool(self.route))

    def check_step(self, action: str) -> StepCheck:
        """Flags only what the agent's context shows to be wrong: the episode is over; an unknown
        action; a move into a wall or off the grid; a move off the route it holds, or, holding none,
        off every shortest path (detour; the fix is the tool, not the hidden direction); `route`
        while holding one (repeat); finish before the end (early); a move or `route` after the end
        (stop). The hint names optimal_action()."""
        a = action.strip() if isinstance(action, str) else None
        hit = self.blocked(self.pos, a) if a in MOVES else ""
        if self.done:
            why = WHY["over"]
        elif a not in self.TOOL_CALLS:
            why = WHY["unknown"]
        elif self.at_end():
            if a == "finish":
                return StepCheck(True)
            why = WHY["stop"].format(action=a)
        elif a == "finish":
            if self.visited < len(self._points):
                why = WHY["early"]
            else:
                why = WHY["early away"].format(label=LABELS[len(self._points) - 1])
        elif a not in MOVES:  # a tool: `route`, or a subclass's own
            why = self._tool_why(a)
            if why is None:
                return StepCheck(True)
        elif hit:
            why = self.WHY_TEXTS[hit].format(action=a)
        elif self.route:
            if a == f"move {self.route[0]}":
                return StepCheck(True)
            why = WHY["off route"].format(action=a)
        elif a in self.shortest_moves():
            return StepCheck(True)
        else:
            why = WHY["off path"].format(action=a)
        return StepCheck(False, REASON.format(why=why, hint=self.hint()))

    def _tool_why(self, a: str) -> str | None:
        """Why check_step refuses the tool call `a` here, or None when it is valid: `route` while a
        route is held is a repeat."""
        return WHY["repeat"] if self.route else None

    def rubric_text(self) -> str:
        return RUBRIC.format(
            plan=self._plan(),
            label=LABELS[len(self._points) - 1],
            max_turns=self.task.max_turns,
        )

    @classmethod
    def splits(cls) -> list[str]:
        return list(SPLITS) + list(CARVED)

    @classmethod
    def tasks(cls, split: str) -> list[NavTask]:
        """A split of SPLITS, or of CARVED (parts of train to choose settings on, never on test)."""
        if split in CARVED:
            source, part = CARVED[split]
            return make_tasks(source)[part]
        return make_tasks(split)

    @classmethod
    def vocabulary(cls) -> list[str]:
        """The words of ACTIONS and TEXTS in order of first use, then the separators, then the
        labels and numbers that fill the templates (the tiny model numbers its tokens in order)."""
        words = [w for text in ACTIONS + TEXTS for w in _literal_words(text)]
        words = [w for w in words if w not in SEPARATORS]
        numbers = [str(i) for i in range(MAX_NUMBER + 1)]
        return list(dict.fromkeys(words + list(SEPARATORS) + list(LABELS) + numbers))


def player(task: NavTask) -> type[Navigation]:
    """The env class that plays `task`: the one its class names (NavTask.ENV, through ENVS)."""
    return env_class(task.ENV)


def run_actions(task: NavTask, actions: list[str]) -> Navigation:
    """A fresh episode of `task` (played by player(task)) with `actions` applied; any after the
    episode ends are ignored."""
    env = player(task)(task)
    for a in actions:
        if not env.done:
            env.step(a)
    return env


def render(task: NavTask, path=None) -> str:
    """ASCII grid with row and column numbers: '#' wall, 'S' start, 'A'..'F' waypoints, '*' path
    cells, '.' free; on a KeyTask 'd' its doors and 'k' their keys. `path` is a list of [row, col]
    positions or of actions (replayed from the start); the module docstring shows one."""
    if path and isinstance(path[0], str):
        path = run_actions(task, path).path
    grid = [["."] * task.width for _ in range(task.height)]
    for r, c in path or []:
        grid[r][c] = "*"
    for r, c in task.walls:
        grid[r][c] = "#"
    for r, c in getattr(task, "doors", []):
        grid[r][c] = "d"
    for r, c in getattr(task, "keys", []):
        grid[r][c] = "k"
    grid[task.start[0]][task.start[1]] = "S"
    for label, (r, c) in zip(LABELS, task.waypoints):
        grid[r][c] = label
    head = "  " + " ".join(str(c % 10) for c in range(task.width))
    return "\n".join([head] + [f"{r % 10} " + " ".join(row) for r, row in enumerate(grid)])


# ----------------------------------------------------------------------------- the env registry

# name -> Env class, or "module:Class" of an optional env, imported on first use by env_class()
ENVS: dict[str, type[Env] | str] = {
    "navigation": Navigation,
    "navigation-keys": "extras.navigation_keys:KeyNavigation",
    "tau2-telecom": "extras.tau2:Tau2Telecom",
    "tau2-airline": "extras.tau2:Tau2Airline",
    "tau2-retail": "extras.tau2:Tau2Retail",
}


def env_class(name: str) -> type[Env]:
    """The Env class registered under `name`; an optional one is imported here, the only place the
    core reaches extras/ (its import says what to install when a package is missing)."""
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}; choose from {list(ENVS)}")
    if isinstance(ENVS[name], str):
        module, cls = ENVS[name].split(":")
        ENVS[name] = getattr(importlib.import_module(module), cls)
    return ENVS[name]


def env_tasks(name: str, split: str) -> list:
    """The tasks of a split of an env."""
    return env_class(name).tasks(split)


if __name__ == "__main__":  # python envs.py: a sample task, its render and the split table
    import argparse
    import sys

    if sys.argv[1:] == ["audit"]:
        sys.exit("the audit moved to extras/: python -m extras.audit")
    argparse.ArgumentParser(
        prog="python envs.py",
        description="Navigation: a sample test task (first message, three steps, hint, rubric, "
        "its map with the oracle's path) and the table of the task splits.",
    ).parse_args()
    task = make_tasks("test", n=1)[0]
    env = Navigation(task)
    acts = optimal_actions(task)
    print(f"first message: {env.reset()}")
    for a in acts[:3]:
        print(f"action: {a} | observation: {env.step(a)[0]}")
    print(f"hint: {env.hint()}")
    print(f"rubric: {env.rubric_text()}")
    print(render(task, acts))
    print(f"oracle: {' ; '.join(acts)}")
    print("| split | grid | density | K | n | seed | slack | optimal actions mean | max |")
    for name, s in SPLITS.items():
        lens = [len(optimal_actions(t)) for t in make_tasks(name)]
        print(
            f"| {name} | {s.height}x{s.width} | {s.density} | {s.k_min}-{s.k_max} | {s.n}"
            f" | {s.seed} | {s.slack} | {sum(lens) / len(lens):.1f} | {max(lens)} |"
        )
