"""The method comparison's report: its tables in markdown and CSV; optional (extras/).

extras/compare.py trains the runs and calls these functions on what they wrote: each run's
results (test metrics before and after, and per-task successes) and its metrics log, read as
`logs` {(method, seed): [one dict per step]}. The report is compare.md (the Table 3 rows, the
beyond-the-boundary shares, RTI - GRPO per seed, p@1 over training, what the update saw, what
the corrections write) and compare.csv (one row per run).
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import loss
from evaluate import COLUMNS, format_table

# the warm start's capability boundary: the test tasks it never solves in this many samples each
BOUNDARY_SAMPLES = 16


def per_step(rows: list[dict], key: str) -> dict[int, float]:
    """{step: value} of `key` in a metrics log, NaN values left out."""
    return {r["step"]: r[key] for r in rows if key in r and r[key] == r[key]}


def mean_std(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, (sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1)) ** 0.5


def has_grpo_and_rti(methods) -> bool:
    """Whether `methods` hold GRPO and RTI both: the report's gaps, mechanics and figures compare
    the two."""
    return {"GRPO", "RTI"} <= set(methods)


def methods_of(results: dict) -> list[str]:
    return list(dict.fromkeys(name for name, _ in results))  # in the order they were run


def boundary(
    results: dict, warm_tasks: list[list[bool]], seeds: list[int]
) -> tuple[int, dict[str, float]]:
    """The number of test tasks the warm-started policy never solves in its BOUNDARY_SAMPLES
    samples, and the share of them (%) each trained policy solves at least once in its evaluation
    samples (averaged over seeds)."""
    never = [i for i, s in enumerate(warm_tasks) if not any(s)]
    out = {}
    for name in methods_of(results):
        shares = [
            100.0 * sum(any(results[(name, s)]["after_tasks"][i]) for i in never) / len(never)
            for s in seeds
            if never
        ]
        out[name] = sum(shares) / len(shares) if shares else float("nan")
    return len(never), out


def is_family_p1(key: str) -> bool:
    """Whether a metrics key is a task family's test p@1 ("test/keys/p@1")."""
    return key.startswith("test/") and key.endswith("/p@1") and key.count("/") == 2


def family_keys(logs: dict) -> list[str]:
    """The metrics keys of each task family's test p@1 ("test/<family>/p@1") in `logs`, in order
    of first appearance; [] for an environment of one family."""
    keys = {}
    for rows in logs.values():
        for r in rows:
            keys.update({k: None for k in r if is_family_p1(k)})
    return list(keys)


def curve_table(
    logs: dict,
    seeds: list[int],
    start_p1: float | None,
    methods: list[str],
    key: str = "test/p@1",
) -> list[str]:
    """Test p@1 (or another metrics `key`, e.g. a family's) at every evaluation, mean over seeds
    (and each seed's RTI - GRPO gap), as markdown lines; step 0 is the warm start's `start_p1` (no
    step 0 if None); "-" where a run has no evaluation at a step (runs of different --steps or
    --eval-every)."""
    start = {} if start_p1 is None else {0: start_p1}
    p1 = {(name, s): {**start, **per_step(logs[(name, s)], key)} for name in methods for s in seeds}
    steps = sorted(set.union(*(set(v) for v in p1.values())))

    def cell(values: list[float | None], sign: str = "") -> str:
        return "-" if None in values else f"{sum(values) / len(values):{sign}.2f}"

    lines = [
        "| p@1 at step | " + " | ".join(map(str, steps)) + " |",
        "| --- |" + " --- |" * len(steps),
    ]
    for name in methods:
        cells = [cell([p1[(name, s)].get(t) for s in seeds]) for t in steps]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if has_grpo_and_rti(methods):
        for s in seeds:
            rti_p1, grpo_p1 = p1[("RTI", s)], p1[("GRPO", s)]
            gaps = [
                cell([rti_p1[t] - grpo_p1[t]] if t in rti_p1 and t in grpo_p1 else [None], "+")
                for t in steps
            ]
            lines.append(f"| RTI - GRPO, seed {s} | " + " | ".join(gaps) + " |")
    return lines


# (row label, method, metrics key, scale): what the update saw, step by step
MECHANICS = [
    ("train success, sampled (%)", "GRPO", "train_success", 100),
    ("train success, sampled (%)", "RTI", "train_success", 100),
    ("train success after intervention (%)", "RTI", "train_success_after_rti", 100),
    ("groups whose every sampled episode failed (%)", "GRPO", "groups_all_failed", 100),
    ("groups whose every sampled episode failed (%)", "RTI", "groups_all_failed", 100),
    ("groups triggered (%)", "RTI", "rti/trigger_rate", 100),
    ("trained rows a step", "GRPO", "trained_rows", 1),
    ("trained rows a step", "RTI", "trained_rows", 1),
    ("intervened share of trained tokens (%)", "RTI", "intervened_frac", 100),
    ("intervened ratio, mean of step means", "RTI", "intervened/ratio_mean", 1),
    ("intervened ratio, mean of step maxima", "RTI", "intervened/ratio_max", 1),
    ("intervened tokens clipped (%)", "RTI", "intervened/clip_frac", 100),
    ("policy tokens clipped (%)", "GRPO", "policy/clip_frac", 100),
    ("policy tokens clipped (%)", "RTI", "policy/clip_frac", 100),
    ("token weight, mean of step maxima", "RTI", "weight_max", 1),
]


def mechanics_table(logs: dict, seeds: list[int], block: int = 8) -> list[str]:
    """MECHANICS' metrics averaged over each block of `block` steps and over seeds, plus GRPO's
    sampled train success per seed, as markdown lines. A step without the metric sits out, and so
    does a step with no intervened token from the intervened tokens' ratios and the token weights
    (the loss gives such a step ratio 1 and weight 1)."""
    last = max(r["step"] for rows in logs.values() for r in rows)
    blocks = [(a, min(a + block - 1, last)) for a in range(1, last + 1, block)]

    def cell(runs: list[dict[int, float]], scale: float, lo: int, hi: int) -> str:
        vals = [v for r in runs for t, v in r.items() if lo <= t <= hi]
        return f"{scale * sum(vals) / len(vals):.2f}" if vals else "-"

    def values(rows: list[dict], key: str) -> dict[int, float]:
        intervened_only = key.startswith(("intervened/", "weight_"))
        frac = per_step(rows, "intervened_frac")
        return {
            t: v
            for t, v in per_step(rows, key).items()
            if not intervened_only or frac.get(t, 0) > 0
        }

    specs = [
        (f"{name} {label}", [values(logs[(name, s)], key) for s in seeds], scale)
        for label, name, key, scale in MECHANICS
    ]
    for s in seeds:
        label = f"GRPO train success, sampled (%), seed {s}"
        specs.append((label, [per_step(logs[("GRPO", s)], "train_success")], 100))
    lines = [
        "| steps | " + " | ".join(f"{a}-{b}" for a, b in blocks) + " |",
        "| --- |" + " --- |" * len(blocks),
    ]
    for label, runs, scale in specs:
        lines.append(
            f"| {label} | " + " | ".join(cell(runs, scale, a, b) for a, b in blocks) + " |"
        )
    return lines


def training_minutes(logs: dict, seeds: list[int], methods) -> str:
    """Each method's training time a run (the sum of its step times, evaluations left out), mean
    over seeds, as a report line."""
    mins = {
        name: sum(sum(r.get("time/step", 0) for r in logs[(name, s)]) for s in seeds)
        / len(seeds)
        / 60
        for name in methods
    }
    return (
        "Training time a run (sum of step times, mean over seeds; evaluations not counted): "
        + ", ".join(f"{name} {m:.1f} min" for name, m in mins.items())
    )


def rewritten_actions(trajs: list) -> Counter:
    """The actions the corrector wrote (the turns whose tokens are INTERVENED) in the intervened
    trajectories of a batch, by action word: `route` (the tool call), `move` (back onto the held
    route), `finish`."""
    return Counter(
        a.split()[0] if a.split() else "(empty)"
        for t in trajs
        if t.intervention
        for (start, _), a in zip(t.turns, t.actions)
        if t.source[start] == loss.INTERVENED
    )


def corrections_written(batch: list, source: str) -> str:
    """What the corrections teach, as a report line: rewritten_actions of the corrections RTI kept
    in an intervened `batch` of 8 samples a task, sampled from the model `source`."""
    words = rewritten_actions(batch)
    n = sum(words.values())
    kept = sum(1 for t in batch if t.intervention)
    shares = ", ".join(f"{w} {c} ({100 * c / max(1, n):.1f}%)" for w, c in words.most_common())
    return (
        f"What the corrections write (`compare_report.corrections_written`): on "
        f"{len({t.group for t in batch})} train tasks x 8 from {source}, RTI keeps {kept} "
        f"corrected trajectories with {n} rewritten turns: " + shares
    )


class EvalPoint(NamedTuple):
    """One evaluation of a run and the compute spent before it, the teacher's included (the
    teacher-guided baselines log theirs as "total/teacher/..."): `episodes` sampled by the policy
    (RTI's continuations included) and by the teacher, `tokens` generated by either, `scored`
    tokens the teacher scored without generating them (OPD), `minutes` of training, `p1` test p@1.
    """

    step: int
    episodes: int
    tokens: int
    minutes: float
    p1: float
    teacher_episodes: int
    teacher_tokens: int
    scored: int


def eval_points(rows: list[dict]) -> list[EvalPoint]:
    """Every evaluation of a metrics log that records compute (runtime.Progress), with the compute
    spent before it: the x-axes of a comparison at matched compute. Evaluations without a training
    row at their step (step 0) are left out."""
    totals = {r["step"]: r for r in rows if "total/episodes" in r}
    points = []
    for r in rows:
        if "test/p@1" in r and r["step"] in totals:
            t = totals[r["step"]]
            teacher_episodes = t.get("total/teacher/episodes", 0)
            teacher_tokens = t.get("total/teacher/generated_tokens", 0)
            point = EvalPoint(
                step=r["step"],
                episodes=t["total/episodes"] + teacher_episodes,
                tokens=t["total/generated_tokens"] + teacher_tokens,
                minutes=t["time/train_total"] / 60,
                p1=r["test/p@1"],
                teacher_episodes=teacher_episodes,
                teacher_tokens=teacher_tokens,
                scored=t.get("total/teacher/scored_tokens", 0),
            )
            points.append(point)
    return points


def within(run: list[EvalPoint], budget: float, spent) -> EvalPoint | None:
    """The run's last evaluation with spent(point) <= budget, None if none."""
    points = [p for p in run if spent(p) <= budget]
    return points[-1] if points else None


def matched(run: list[EvalPoint], budget: float, spent) -> str:
    """p@1 (step) of the run's last evaluation with spent(point) <= budget, "-" if none."""
    point = within(run, budget, spent)
    return f"{point.p1:.2f} ({point.step})" if point else "-"


def episode_budget(points: dict, methods, seed: int) -> int:
    """The seed's smallest final count of sampled episodes (the teacher's included) over
    `methods`: the budget "at equal episodes" reads every run at. `points`: {(method, seed):
    eval_points of its log}."""
    return min(points[(name, seed)][-1].episodes for name in methods)


def compute_table(logs: dict, seeds: list[int], methods) -> list[str]:
    """Per seed and method: the compute a run spent, the teacher's counted with the policy's
    (episodes sampled, RTI's continuations and the teacher's included; tokens generated, by the
    policy in every role or by the teacher; tokens the teacher scored; training minutes) and its
    p@1 at the end, at equal episodes and at equal tokens. "Equal" is the last evaluation within
    the seed's smallest final count over methods; the tokens there are those generated plus those
    the teacher scored (a forward pass each). Empty when the logs record no compute (runs of older
    code)."""
    points = {run: eval_points(rows) for run, rows in logs.items()}
    if not all(points.get((name, s)) for name in methods for s in seeds):
        return []

    def tokens(p: EvalPoint) -> int:
        return p.tokens + p.scored

    lines = [
        "| seed | method | episodes (teacher's) | generated tokens (teacher's) | tokens the teacher "
        "scored | training min | p@1 at the end | p@1 at equal episodes (step) | p@1 at equal "
        "tokens (step) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in seeds:
        budget = episode_budget(points, methods, s)
        token_budget = min(tokens(points[(name, s)][-1]) for name in methods)
        for name in methods:
            run = points[(name, s)]
            end = run[-1]
            at_episodes = matched(run, budget, lambda p: p.episodes)
            at_tokens = matched(run, token_budget, tokens)
            lines.append(
                f"| {s} | {name} | {end.episodes:,} ({end.teacher_episodes:,}) | {end.tokens:,} "
                f"({end.teacher_tokens:,}) | {end.scored:,} | {end.minutes:.1f} | {end.p1:.2f} | "
                f"{at_episodes} | {at_tokens} |"
            )
    return lines


def family_table(logs: dict, seeds: list[int], methods) -> list[str]:
    """Each task family's test p@1 per method at equal sampled episodes (compute_table's reading:
    the last evaluation within the seed's episode_budget), mean over seeds with each seed's and
    its step in brackets; [] when the logs have one family or record no compute. split_table
    gives the families at the end."""
    points = {run: eval_points(rows) for run, rows in logs.items()}
    families = family_keys(logs)
    if not families or not all(points.get((name, s)) for name in methods for s in seeds):
        return []
    titles = [f"test, {key.split('/')[1]}, at equal episodes" for key in families]
    lines = ["| method | " + " | ".join(titles) + " |", "|" + " --- |" * (len(titles) + 1)]
    budgets = {s: episode_budget(points, methods, s) for s in seeds}
    for name in methods:
        at = [within(points[(name, s)], budgets[s], lambda p: p.episodes) for s in seeds]
        cells = []
        for key in families:
            if None in at:
                cells.append("-")
                continue
            xs = [per_step(logs[(name, s)], key)[p.step] for s, p in zip(seeds, at)]
            each = ", ".join(f"{x:.2f} at {p.step}" for x, p in zip(xs, at))
            cells.append(f"{mean_std(xs)[0]:.2f} ({each})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def family_report(logs: dict, seeds: list[int], methods) -> list[str]:
    """For an environment of several task families, markdown lines after the overall p@1 curve:
    each family's curve (curve_table) and its p@1 at equal episodes (family_table); [] for one
    family."""
    lines = []
    for key in family_keys(logs):
        family = key.split("/")[1]
        curve = curve_table(logs, seeds, None, methods, key)
        lines += ["", f"p@1 on the {family} tasks over training, mean over seeds:", "", *curve]
    equal = family_table(logs, seeds, methods)
    if equal:
        lines += ["", "p@1 per task family at equal sampled episodes:", "", *equal]
    return lines


def split_table(results: dict, seeds: list[int]) -> list[str]:
    """Every method's final p@1 on the test split, on each task family of it and on the OOD split
    (--ood-split), mean over seeds with each seed's in brackets; [] when the runs have neither
    families nor an OOD split."""
    first = next(iter(results.values()))
    columns = [("after", "p@1", "test")]
    columns += [("after", k, f"test, {k.split('/')[0]}") for k in first["after"] if "/p@1" in k]
    columns += [("after_ood", "p@1", "ood")] if "after_ood" in first else []
    if len(columns) == 1:
        return []
    lines = [
        "| method | " + " | ".join(title for *_, title in columns) + " |",
        "|" + " --- |" * (len(columns) + 1),
    ]
    for name in methods_of(results):
        cells = []
        for part, key, _ in columns:
            values = [results[(name, s)][part][key] for s in seeds]
            each = ", ".join(f"{v:.2f}" for v in values)
            cells.append(f"{mean_std(values)[0]:.2f} ({each})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def split_section(results: dict, seeds: list[int]) -> list[str]:
    """split_table with its title, as report lines; [] when it is empty."""
    table = split_table(results, seeds)
    title = "p@1 after training by split and task family, mean (seeds):"
    return ["", title, "", *table] if table else []


def write_report(
    results: dict,
    warm: tuple,
    seeds: list[int],
    out,
    wall: float,
    command: str,
    curves: list[str] = (),
    mechanics: list[str] = (),
    split: str = "test",
    compute: list[str] = (),
) -> None:
    """compare.md and compare.csv under `out`, and the report printed. `results`: {(method, seed):
    the run's results.json}; `warm`: the warm start's (summary, per-task successes) on `split`, the
    runs' --test-split; `curves` and `mechanics`: lines of curve_table and mechanics_table, if
    given; `compute`: compute_table's lines; `wall`: seconds this invocation took; `command`: the
    command line that reproduces it."""
    keys = [k for k, _ in COLUMNS]
    warm_summary, warm_tasks = warm
    rows = {f"warm start ({BOUNDARY_SAMPLES} samples)": warm_summary}
    spread = {}
    csv = ["method,seed," + ",".join(keys)]
    for name in methods_of(results):
        per_seed = [results[(name, s)]["after"] for s in seeds]
        rows[name] = {k: mean_std([r[k] for r in per_seed])[0] for k in keys}
        spread[name] = mean_std([r["p@1"] for r in per_seed])[1]
        for s, r in zip(seeds, per_seed):
            csv.append(f"{name},{s}," + ",".join(f"{r[k]:.2f}" for k in keys))
    n_never, never = boundary(results, warm_tasks, seeds)
    lines = [
        f"Command: `{command}` ({len(seeds)} seeds; this invocation {wall / 60:.1f} min, a resumed "
        f"one counts only its own part)",
        "",
        format_table(rows),
        "",
        f"Beyond the boundary: {n_never} of {len(warm_tasks)} {split} tasks are never solved by "
        f"the warm start in {BOUNDARY_SAMPLES} samples; the last column is the share of them a "
        f"trained policy solves in its evaluation samples (mean over seeds).",
        "",
        "| method | p@1 std over seeds | solves never-solved tasks (%) |",
        "| --- | --- | --- |",
    ]
    for name in methods_of(results):
        std = f"{spread[name]:.2f}" if len(seeds) > 1 else "-"
        lines.append(f"| {name} | {std} | {never[name]:.1f} |")
    lines += split_section(results, seeds)
    gap = []
    if has_grpo_and_rti(methods_of(results)):
        gap = [
            results[("RTI", s)]["after"]["p@1"] - results[("GRPO", s)]["after"]["p@1"]
            for s in seeds
        ]
    if gap:
        lines += [
            "",
            f"RTI minus GRPO p@1 per seed: {', '.join(f'{g:+.2f}' for g in gap)} "
            f"(mean {sum(gap) / len(gap):+.2f})",
        ]
    if curves:
        lines += [
            "",
            f"p@1 on {split} over training, mean over seeds (step 0: the warm start, "
            f"{BOUNDARY_SAMPLES} samples a task; then the runs' 4):",
            "",
            *curves,
        ]
    if compute:
        lines += [
            "",
            f"Compute per run, a teacher's counted with the policy's, and p@1 on {split} at the "
            "end, at equal sampled episodes and at equal tokens (generated, or scored by the "
            "teacher): the last evaluation within the seed's smallest count over methods:",
            "",
            *compute,
        ]
    if mechanics:
        lines += [
            "",
            "What the update saw, mean over seeds and over each block of steps:",
            "",
            *mechanics,
        ]
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    (out / "compare.csv").write_text("\n".join(csv) + "\n")
    print("\n".join(lines))
