"""Metrics as in the paper: pass@k, pass^k and their averages over k = 1..4; the intervention
statistics of its Table 6 (from intervene.intervene_batch's counts).

With n samples per task of which c succeed:

    >>> round(pass_at_k(4, 1, 2), 4), round(pass_hat_k(4, 3, 2), 4)
    (0.5, 0.5)
    >>> s = summarize([[True, True, False, False], [False] * 4])
    >>> s["pass@1"], s["pass@4"], round(s["pass^2"], 2)
    (25.0, 50.0, 8.33)
"""

from __future__ import annotations

import math
from math import comb

K_MAX = 4  # the paper reports k = 1..4 with n = 4 samples per task
# (metric key, column head): Table 1's columns, then Table 3's
COLUMNS = (
    (("p@1", "p@1"), ("avg_p@k", "avg p@k"), ("avg_p^k", "avg p^k"))
    + tuple((f"pass@{k}", f"pass@{k}") for k in range(1, K_MAX + 1))
    + tuple((f"pass^{k}", f"pass^{k}") for k in range(1, K_MAX + 1))
)


def _check(n: int, c: int, k: int) -> None:
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chance that at least one of k samples drawn without replacement from the n succeeds:
    pass@k = 1 - C(n - c, k) / C(n, k)."""
    _check(n, c, k)
    return 1.0 - comb(n - c, k) / comb(n, k)


def pass_hat_k(n: int, c: int, k: int) -> float:
    """Chance that all k samples drawn without replacement from the n succeed ("pass^k"):
    pass^k = C(c, k) / C(n, k)."""
    _check(n, c, k)
    return comb(c, k) / comb(n, k)


def mean_over_k(values: list[float]) -> float:
    """avg p@k = mean of pass@1..pass@k_max (likewise avg p^k from pass^1..pass^k_max).

    >>> round(mean_over_k([35.33, 40.00, 41.33, 43.33]), 2)   # GRPO Navigation, Table 1
    40.0
    """
    if not values:
        raise ValueError("need at least one value")
    return sum(values) / len(values)


def summarize(successes: list[list[bool]], k_max: int = K_MAX) -> dict[str, float]:
    """Metrics in percent, averaged over tasks. successes[task] = the n sample outcomes (n >= k_max,
    the same n for every task). Keys: pass@1..pass@k_max, pass^1..pass^k_max, p@1 (= pass@1),
    avg_p@k, avg_p^k."""
    if not successes:
        raise ValueError("no tasks to summarize")
    n = len(successes[0])
    sizes = sorted({len(s) for s in successes})
    if len(sizes) > 1:
        raise ValueError(f"every task needs the same number of samples; got {sizes}")
    if not 1 <= k_max <= n:
        raise ValueError(f"need 1 <= k_max <= n samples per task; got k_max={k_max} n={n}")
    counts = [sum(bool(x) for x in s) for s in successes]
    out = {}
    for name, fn in (("pass@", pass_at_k), ("pass^", pass_hat_k)):
        for k in range(1, k_max + 1):
            out[f"{name}{k}"] = 100.0 * sum(fn(n, c, k) for c in counts) / len(counts)
    out["p@1"] = out["pass@1"]
    out["avg_p@k"] = mean_over_k([out[f"pass@{k}"] for k in range(1, k_max + 1)])
    out["avg_p^k"] = mean_over_k([out[f"pass^{k}"] for k in range(1, k_max + 1)])
    return out


def summarize_by(groups: list[str], successes: list[list[bool]], k_max: int = K_MAX) -> dict:
    """summarize() of each group's tasks, groups[i] naming task i's (e.g. its family), in order of
    first appearance: {"plain": {...}, "keys": {...}}."""
    parts: dict[str, list] = {}
    for group, task_successes in zip(groups, successes, strict=True):
        parts.setdefault(group, []).append(task_successes)
    return {group: summarize(part, k_max) for group, part in parts.items()}


def format_table(rows: dict[str, dict[str, float]]) -> str:
    """Markdown table, one row per method, in the paper's column order (p@1, avg p@k, avg p^k,
    then pass@1..4, pass^1..4); only columns some row has; 2 decimals, '-' where missing.

    >>> print(format_table({"GRPO": {"p@1": 35.333, "avg_p@k": 40.0}}))
    | method | p@1 | avg p@k |
    | --- | --- | --- |
    | GRPO | 35.33 | 40.00 |
    """
    cols = [(key, head) for key, head in COLUMNS if any(key in r for r in rows.values())]
    lines = [
        "| method | " + " | ".join(h for _, h in cols) + " |",
        "| --- | " + " | ".join("---" for _ in cols) + " |",
    ]
    for method, r in rows.items():
        cells = [f"{r[key]:.2f}" if key in r else "-" for key, _ in cols]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- Table 6

RATES = {
    "trigger_rate": ("groups_triggered", "groups"),
    "flag_rate": ("steps_flagged", "steps_checked"),
    "accept_rate": ("corrections_accepted", "steps_flagged"),
    "reject_rate": ("corrections_rejected", "steps_flagged"),
    "attempt_reject_rate": ("attempts_rejected", "correction_attempts"),
    "with_accepted_rate": ("with_accepted", "intervened"),
    "corrected_success_rate": ("corrected_successes", "with_accepted"),
    "ppl_kept_mean": ("ppl_kept_sum", "gate_kept"),
    "ppl_dropped_mean": ("ppl_dropped_sum", "gate_dropped"),
    "calls_corrected_mean": ("calls_corrected_sum", "gate_kept"),
    "calls_original_mean": ("calls_original_sum", "gate_kept"),
    "leaked_rewrite_rate": ("rewrites_leaked", "correction_attempts"),
    "leaked_accepted_rate": ("accepted_leaked", "corrections_accepted"),
    "kept_leaked_rate": ("kept_leaked_turns", "kept_corrected_turns"),
    "ppl_kept_leaky_mean": ("ppl_kept_leaky_sum", "gate_kept_leaky"),
    "ppl_dropped_leaky_mean": ("ppl_dropped_leaky_sum", "gate_dropped_leaky"),
    "intervened_token_share": ("intervened_tokens", "trained_tokens"),
    "intervened_weight_mean": ("intervened_weight_sum", "intervened_tokens"),
    "intervened_clip_rate": ("intervened_clipped", "intervened_ratio_tokens"),
}


def reweighting_counts(loss_figures: dict) -> dict:
    """The reweighting's counts of an update (the trained and intervened tokens, the weights' sum,
    the clipped intervened ratios), from the loss's figures (loss.loss_metrics, or several joined by
    loss.combine_metrics), so that a run's totals add them up beside the intervention's counts."""
    intervened = loss_figures["tokens/intervened"]
    ratio_tokens = loss_figures["tokens/intervened_ratio"]
    return {
        "trained_tokens": loss_figures["tokens/trained"],
        "intervened_tokens": intervened,
        "intervened_weight_sum": loss_figures["weight_mean"] * intervened,
        "intervened_ratio_tokens": ratio_tokens,
        "intervened_clipped": round(loss_figures["intervened/clip_frac"] * ratio_tokens),
    }


def intervention_rates(counts: dict) -> dict:
    """The counts plus the rates and means of RATES, name -> (numerator, denominator): the figures
    of the paper's Table 6 (NaN where the denominator is 0). Counts the step lacks are 0; rates in
    `counts` are taken again."""
    out = {k: 0 for pair in RATES.values() for k in pair}
    out.update({k: v for k, v in counts.items() if k not in RATES})
    for name, (num, den) in RATES.items():
        out[name] = out[num] / out[den] if out[den] else float("nan")
    return out


def run_totals(steps: list[dict]) -> dict:
    """The statistics of a whole run from its steps' summaries: counts and sums add up, rates are
    taken again."""
    total: dict = {}
    for st in steps:
        for k, v in st.items():
            if k not in RATES:
                total[k] = total.get(k, 0) + v
    return intervention_rates(total)


def intervention_report(s: dict) -> str:
    """The run's statistics in the rows of the paper's Table 6, then the gate's, the rewrites'
    kinds and the reweighting's."""
    return "\n".join(
        [
            f"rollout groups with intervention triggered: {_count(s, 'groups_triggered')} / "
            f"{_count(s, 'groups')} ({_percent(s, 'trigger_rate')})",
            f"rollout steps flagged as invalid by the validator: {_count(s, 'steps_flagged')} / "
            f"{_count(s, 'steps_checked')} ({_percent(s, 'flag_rate')})",
            f"corrections accepted by the verifier: {_count(s, 'corrections_accepted')} / "
            f"{_count(s, 'steps_flagged')} ({_percent(s, 'accept_rate')})",
            f"corrections rejected by the verifier: {_count(s, 'corrections_rejected')} / "
            f"{_count(s, 'steps_flagged')} ({_percent(s, 'reject_rate')}); of every attempt: "
            f"{_count(s, 'attempts_rejected')} / {_count(s, 'correction_attempts')} "
            f"({_percent(s, 'attempt_reject_rate')})",
            "intervened trajectories with >= 1 accepted correction: "
            f"{_count(s, 'with_accepted')} / {_count(s, 'intervened')} "
            f"({_percent(s, 'with_accepted_rate')}); "
            f"of those successful: {_count(s, 'corrected_successes')} "
            f"({_percent(s, 'corrected_success_rate')})",
            "avg. tool calls per trajectory (corrected vs. original, kept ones): "
            f"{_number(s, 'calls_corrected_mean')} vs. {_number(s, 'calls_original_mean')}",
            f"perplexity gate: kept {_count(s, 'gate_kept')} "
            f"(mean PPL {_number(s, 'ppl_kept_mean')}), dropped {_count(s, 'gate_dropped')} "
            f"(mean PPL {_number(s, 'ppl_dropped_mean')})",
            "rewrites by kind, every attempt: "
            f"justified {_count(s, 'rewrites_justified')}, leaked {_count(s, 'rewrites_leaked')} "
            f"({_percent(s, 'leaked_rewrite_rate')}), invalid {_count(s, 'rewrites_invalid')}; "
            f"accepted: justified {_count(s, 'accepted_justified')}, "
            f"leaked {_count(s, 'accepted_leaked')}, invalid {_count(s, 'accepted_invalid')}",
            "corrected trajectories holding a leaked step (copied from the evidence): "
            f"kept {_count(s, 'gate_kept_leaky')} (mean PPL {_number(s, 'ppl_kept_leaky_mean')}), "
            f"dropped {_count(s, 'gate_dropped_leaky')} "
            f"(mean PPL {_number(s, 'ppl_dropped_leaky_mean')}); leaked steps in the kept ones: "
            f"{_count(s, 'kept_leaked_turns')} / {_count(s, 'kept_corrected_turns')} corrected "
            f"steps ({_percent(s, 'kept_leaked_rate')})",
            "trained intervened tokens (the reweighting's): "
            f"{_count(s, 'intervened_tokens')} / {_count(s, 'trained_tokens')} "
            f"({_percent(s, 'intervened_token_share')}); calibrated weight mean "
            f"{_number(s, 'intervened_weight_mean')}; ratio clip active on "
            f"{_percent(s, 'intervened_clip_rate')}",
        ]
    )


def _count(stats: dict, key: str):
    """A count of the report; 0 when the run has none."""
    return stats.get(key, 0)


def _percent(stats: dict, key: str) -> str:
    """A rate of the report as a percentage; n/a where it is NaN (a zero denominator)."""
    rate = stats[key]
    return "n/a" if math.isnan(rate) else f"{100 * rate:.1f}%"


def _number(stats: dict, key: str) -> str:
    """A mean of the report with 2 decimals; n/a where it is NaN (a zero denominator)."""
    mean = stats[key]
    return "n/a" if math.isnan(mean) else f"{mean:.2f}"
