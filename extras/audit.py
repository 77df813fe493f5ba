"""The audit of Navigation's step check, and two learning-free baselines; optional (extras/).

    python -m extras.audit    # a table: train, val and test
    python -m extras.audit --env navigation-keys    # train, val, test and ood, and per family

RTI trains on corrected steps, so a correction must teach something the agent can know. Over the
episodes of a noisy walker (each turn the hinted action, the greedy walker's, or any action), the
audit counts the flagged steps whose hinted action is not the one the agent's latest message shows
(`context_action` reads it from the words alone): such a step would be undecidable from the
context. It also places two baselines by p@1: the greedy walker, which uses no tool (4 samples a
task), and the oracle, which calls `route` at each leg and follows it (and, with keys, `find key`
where the route shows a locked door). Each task is played by envs.player(task): KeyNavigation for
the tasks of navigation-keys.
"""

from __future__ import annotations

import argparse
import random

from envs import MOVES, Navigation, NavTask, env_class, player


def greedy_action(env: Navigation, rng: random.Random) -> str:
    """The learning-free walker (no tools, no map): finish at the end, else a random unblocked move
    that brings it closer (Manhattan) to its target, else a random unblocked move."""
    if env.at_end():
        return "finish"
    goal = env.goal()
    free = [a for a in MOVES if not env.blocked(env.pos, a)]

    def distance(pos) -> int:
        return abs(goal[0] - pos[0]) + abs(goal[1] - pos[1])

    def after(move) -> tuple[int, int]:
        return (env.pos[0] + MOVES[move][0], env.pos[1] + MOVES[move][1])

    closer = [a for a in free if distance(after(a)) < distance(env.pos)]
    return rng.choice(closer or free)


def oracle_action(env: Navigation, rng: random.Random) -> str:
    """The oracle walker: the action the env's hint names (`route` at each leg, then follow it;
    `find key` where the route shows a locked door)."""
    return env.optimal_action()


def context_action(text: str) -> str:
    """The action an agent's latest message determines, read from its words alone: the held route's
    next move, finish when it says 'next finish' with nothing left to reach, `find key` when the
    route tool showed a locked door (navigation-keys), else the `route` tool.

    >>> context_action("route down left . pos 1 1 next A 2 0 blocked up")
    'move down'
    >>> context_action("pos 2 1 next finish at B 2 2 blocked down")
    'route'
    >>> context_action("locked door 3 4 . pos 2 1 next A 4 4 blocked down")
    'find key'
    """
    words = text.split()
    if "route" in words:
        return f"move {words[words.index('route') + 1]}"
    if "next finish" in text and "next finish at" not in text:
        return "finish"
    if "locked" in words:
        return "find key"
    return "route"


def pass_at_1(tasks: list[NavTask], walker, samples: int = 4, seed: int = 0) -> float:
    """Mean success (%) of `walker(env, rng) -> action` over `samples` episodes of each task."""
    rng = random.Random(seed)
    runs = [player(t)(t) for t in tasks for _ in range(samples)]
    for env in runs:
        while not env.done:
            env.step(walker(env, rng))
    return 100 * sum(env.score().success for env in runs) / len(runs)


def undecidable_flags(tasks: list[NavTask], seed: int = 0) -> tuple[int, int]:
    """(flagged steps whose hinted action is not what the agent's latest message shows, flagged
    steps) over episodes of a noisy walker: each turn the hinted action, the greedy walker's or any
    action, at random."""
    rng = random.Random(seed)
    bad = 0
    flagged = 0
    for task in tasks:
        env = player(task)(task)
        text = env.reset()
        while not env.done:
            # the candidates are drawn in this order (the greedy walker's and any action use rng)
            candidates = [
                env.optimal_action(),
                greedy_action(env, rng),
                rng.choice(env.TOOL_CALLS + ("jump",)),
            ]
            action = rng.choice(candidates)
            check = env.check_step(action)
            if not check.valid:
                flagged += 1
                hinted = check.reason.split(" do ")[-1]
                if hinted != context_action(text):
                    bad += 1
            text = env.step(action)[0]
    return bad, flagged


# the splits the table shows, per env the audit can read (context_action knows their texts)
AUDITED = {
    "navigation": ("train", "val", "test"),
    "navigation-keys": ("train", "val", "test", "ood"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m extras.audit",
        description="The undecidable flagged steps and the baselines' p@1 on the env's splits "
        "(train, val, test; navigation-keys also ood, and each split per family).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--env", default="navigation", choices=tuple(AUDITED), help="the environment to audit"
    )
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    print(
        "| split | flagged steps | undecidable | greedy walker p@1 | oracle (route + follow) p@1 |"
    )
    for name in AUDITED[args.env]:
        tasks = env_class(args.env).tasks(name)
        rows = {name: tasks}
        families = sorted({getattr(t, "family", "") for t in tasks})
        if len(families) > 1:  # a split that mixes families: a row for each too
            for family in families:
                rows[f"{name} {family}"] = [t for t in tasks if t.family == family]
        for label, part in rows.items():
            bad, flagged = undecidable_flags(part)
            share = 100 * bad / max(1, flagged)
            greedy = pass_at_1(part, greedy_action)
            oracle = pass_at_1(part, oracle_action, samples=1)
            print(f"| {label} | {flagged} | {bad} ({share:.1f}%) | {greedy:.2f} | {oracle:.2f} |")


if __name__ == "__main__":
    main()
