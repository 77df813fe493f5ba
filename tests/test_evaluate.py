"""Tests for evaluate.py: pass@k / pass^k against brute force, the paper's averages, summarize, table."""

from itertools import combinations

import pytest

import evaluate
from evaluate import format_table, mean_over_k, pass_at_k, pass_hat_k, summarize


def brute(n, c, k):
    """Share of k-subsets of n samples (c successes) with any / all successes."""
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets), sum(all(s) for s in subsets) / len(subsets)


def test_pass_at_k_and_pass_hat_k_match_brute_force():
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                any_, all_ = brute(n, c, k)
                assert pass_at_k(n, c, k) == pytest.approx(any_, abs=1e-12), (n, c, k)
                assert pass_hat_k(n, c, k) == pytest.approx(all_, abs=1e-12), (n, c, k)


def test_paper_averages():
    # Table 3, GRPO on Navigation (Qwen3-8B); Table 1 reports avg p@k 40.00 and avg p^k 29.00.
    assert f"{mean_over_k([35.33, 40.00, 41.33, 43.33]):.2f}" == "40.00"
    assert f"{mean_over_k([35.33, 29.33, 26.67, 24.67]):.2f}" == "29.00"
    # RTI row: 57.33 61.33 64.67 66.00 / 57.33 48.00 42.00 39.33 (not printed in Table 1's excerpt)
    assert f"{mean_over_k([57.33, 61.33, 64.67, 66.00]):.2f}" == "62.33"


def test_summarize_small_example():
    # 3 tasks, n = 4: c = 4, 2, 0.
    s = summarize([[True] * 4, [True, False, True, False], [False] * 4])
    expect_at = [(1 + 2 / 4) / 3, (1 + 5 / 6) / 3, (1 + 1) / 3, (1 + 1) / 3]  # pass@1..4 by hand
    expect_hat = [(1 + 2 / 4) / 3, (1 + 1 / 6) / 3, 1 / 3, 1 / 3]  # pass^1..4 by hand
    for k in range(1, 5):
        assert s[f"pass@{k}"] == pytest.approx(100 * expect_at[k - 1])
        assert s[f"pass^{k}"] == pytest.approx(100 * expect_hat[k - 1])
    assert s["p@1"] == s["pass@1"] == pytest.approx(50.0)
    assert s["avg_p@k"] == pytest.approx(100 * sum(expect_at) / 4)
    assert s["avg_p^k"] == pytest.approx(100 * sum(expect_hat) / 4)
    assert set(s) == {f"pass@{k}" for k in range(1, 5)} | {f"pass^{k}" for k in range(1, 5)} | {
        "p@1",
        "avg_p@k",
        "avg_p^k",
    }


def test_summarize_k_max_and_more_samples():
    s = summarize([[True, False, False, False, False, False]], k_max=2)
    assert set(s) == {"pass@1", "pass@2", "pass^1", "pass^2", "p@1", "avg_p@k", "avg_p^k"}
    assert s["pass@2"] == pytest.approx(100 * (1 - 10 / 15))
    assert s["pass^2"] == 0.0


@pytest.mark.parametrize(
    "data, k_max",
    [
        ([], 4),  # no tasks
        ([[True, False, True]], 4),  # n < k_max
        ([[True] * 4, [True] * 5], 4),  # different n
        ([[True] * 4], 0),  # k_max < 1
    ],
)
def test_summarize_bad_input(data, k_max):
    with pytest.raises(ValueError):
        summarize(data, k_max=k_max)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_bad_input(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)
    with pytest.raises(ValueError):
        pass_hat_k(n, c, k)


def test_format_table():
    rows = {
        "GRPO": summarize([[True, False, False, False]] * 3),
        "RTI": {"p@1": 57.333, "avg_p@k": 62.3333},
    }
    lines = format_table(rows).splitlines()
    head = [h.strip() for h in lines[0].strip("|").split("|")]
    assert head == ["method", "p@1", "avg p@k", "avg p^k"] + [f"pass@{k}" for k in range(1, 5)] + [
        f"pass^{k}" for k in range(1, 5)
    ]
    assert lines[1].count("---") == len(head)
    grpo = [x.strip() for x in lines[2].strip("|").split("|")]
    assert grpo[:2] == ["GRPO", "25.00"] and grpo[head.index("pass@4")] == "100.00"
    assert grpo[head.index("pass^2")] == "0.00"
    rti = [x.strip() for x in lines[3].strip("|").split("|")]
    assert rti[:4] == ["RTI", "57.33", "62.33", "-"]


def test_docstring_examples():
    import doctest

    assert doctest.testmod(evaluate).failed == 0


def test_summarize_by_groups_tasks_in_order_of_first_appearance():
    """Each group's figures are summarize() of its own tasks: the 'keys' tasks solve 1 of 2 and 0 of
    2 samples (p@1 25), the 'plain' one 2 of 2 (100)."""
    successes = [[True, False], [True, True], [False, False]]
    out = evaluate.summarize_by(["keys", "plain", "keys"], successes, k_max=2)
    assert list(out) == ["keys", "plain"]
    assert out["keys"] == summarize([[True, False], [False, False]], k_max=2)
    assert out["keys"]["p@1"] == 25.0 and out["plain"]["p@1"] == 100.0
    with pytest.raises(ValueError):
        evaluate.summarize_by(["keys"], successes)  # a group for every task
