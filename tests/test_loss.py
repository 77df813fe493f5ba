"""Tests for loss.py: hand-computed values, a plain-loop reference, gradients, edge cases."""

import dataclasses
import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from loss import (
    AGG_MODES,
    INTERVENED,
    IS_MODES,
    POLICY,
    RATIO_LEVELS,
    LossConfig,
    advantages_by_group,
    aggregate,
    combine_metrics,
    group_advantages,
    group_rows,
    importance_ratios,
    loss_metrics,
    policy_loss,
    token_losses,
    token_weights,
)

ROOT = Path(__file__).resolve().parent.parent
LN = math.log
CHECKED = LossConfig(check_values=True)  # the value checks, off by default


def loss_and_metrics(*args, **kwargs):
    """(policy_loss, loss_metrics) of the same inputs."""
    return policy_loss(*args, **kwargs), loss_metrics(*args, **kwargs)


def t(rows, **kw):
    return torch.tensor(rows, dtype=torch.float64, **kw)


def leaf(x):
    return x.clone().detach().requires_grad_(True)


# ---------------------------------------------------------------- group_advantages
def test_group_advantages_hand_values():
    r = t([1, 0, 0, 0, 1, 1, 0, 0])
    # group 1: mean .25, unbiased std sqrt(.75/3) = .5; group 2: mean .5, std sqrt(1/3)
    s3 = 0.5 / math.sqrt(1 / 3)
    expect = [1.5, -0.5, -0.5, -0.5, s3, s3, -s3, -s3]
    assert group_advantages(r, 4, eps=0.0).tolist() == pytest.approx(expect, rel=1e-12)
    assert group_advantages(r, 4).tolist() == pytest.approx(expect, rel=1e-5)  # eps 1e-6
    unscaled = [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]
    assert group_advantages(r, 4, scale=False).tolist() == pytest.approx(unscaled, abs=1e-15)


def test_advantages_by_group_equal_group_advantages_wherever_the_rows_are():
    r = t([1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    fixed = group_advantages(r, 4)
    assert torch.equal(advantages_by_group(r, [0] * 4 + [1] * 4), fixed)
    order = [0, 4, 1, 5, 2, 6, 3, 7]  # the same two groups, rows interleaved
    assert torch.equal(advantages_by_group(r[order], [i // 4 for i in order]), fixed[order])
    assert group_rows(["b", "a", "b"]) == {"b": [0, 2], "a": [1]}


def test_group_advantages_zero_spread_is_exactly_zero():
    r = t([0.1, 0.1, 0.1, 1.0, 0.0, 0.0, 0.3, 0.3, 0.3])
    a = group_advantages(r, 3)
    assert torch.equal(a[:3], torch.zeros(3, dtype=a.dtype))
    assert torch.equal(a[6:], torch.zeros(3, dtype=a.dtype))
    assert a[3] > 0 and torch.isfinite(a).all()
    assert torch.equal(group_advantages(t([1.0, 0.0]), 1), torch.zeros(2, dtype=torch.float64))
    assert torch.equal(
        group_advantages(torch.tensor([1, 1, 0, 0]), 2), torch.zeros(4)
    )  # int rewards


def test_group_advantages_bad_input():
    with pytest.raises(ValueError, match="not a multiple of group_size=4"):
        group_advantages(t([1, 0, 0]), 4)
    with pytest.raises(ValueError, match="rewards must be 1-D"):
        group_advantages(t([[1, 0]]), 2)
    with pytest.raises(ValueError, match="rewards contains NaN"):
        group_advantages(t([1, float("nan")]), 2)


# ---------------------------------------------------------------- token_weights
def test_token_weights_mean_one_bounds_ones_detached():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(3, 8, generator=g, dtype=torch.float64) - 2
    beh = (old + 3 * torch.randn(3, 8, generator=g, dtype=torch.float64)).requires_grad_(True)
    inter = torch.rand(3, 8, generator=g) < 0.5
    inter[2] = False  # a row with no intervened token
    w_free = token_weights(beh, old, inter, 0.0, math.inf)  # unclipped form
    for i in range(2):
        assert w_free[i][inter[i]].mean().item() == pytest.approx(1.0, abs=1e-12)
    w = token_weights(beh, old, inter, 0.2, 3.0)
    assert not w.requires_grad and w.grad_fn is None
    assert torch.equal(w[~inter], torch.ones_like(w[~inter]))
    assert (w[inter] >= 0.2).all() and (w[inter] <= 3.0).all()
    assert (w_free[inter] > 3.0).any() or (w_free[inter] < 0.2).any()  # the clip had work to do
    # huge shifts stay finite (log-space mean)
    w_big = token_weights(
        t([[500.0, 0.0, -500.0]]),
        t([[0.0, 0.0, 0.0]]),
        torch.ones(1, 3, dtype=torch.bool),
        0,
        math.inf,
    )
    assert w_big.flatten().tolist() == pytest.approx([3.0, 0.0, 0.0])


def test_token_weights_hand_values():
    old = t([[LN(0.5), LN(0.4), LN(0.3)]])
    beh = old + t([[0.0, LN(1.0), LN(3.0)]])  # exp(delta) on I = [1, 3], mean 2
    w = token_weights(beh, old, torch.tensor([[False, True, True]]), 0.2, 3.0)
    assert w.flatten().tolist() == pytest.approx([1.0, 0.5, 1.5], rel=1e-12)
    w = token_weights(beh, old, torch.tensor([[False, True, True]]), 0.6, 1.2)
    assert w.flatten().tolist() == pytest.approx([1.0, 0.6, 1.2], rel=1e-12)


# ---------------------------------------------------------------- hand-computed losses
def _calibrated_case():
    old = t([[LN(0.5), LN(0.4), LN(0.3)]])
    logp = leaf(old + t([[LN(1.5), LN(1.0), LN(0.9)]]))  # rho = [1.5, 1.0, 0.9]
    beh = old + t([[0.0, 0.0, LN(3.0)]])  # weights on I: [0.5, 1.5]
    return logp, old, beh, torch.tensor([[POLICY, INTERVENED, INTERVENED]])


def test_calibrated_hand_value_and_grad():
    logp, old, beh, src = _calibrated_case()
    loss, m = loss_and_metrics(logp, old, t([1.0]), torch.ones(1, 3), src, beh)
    # loss_t = [-1.28 (clipped), -0.5 * 1.0, -1.5 * 0.9]
    assert loss.item() == pytest.approx((-1.28 - 0.5 - 1.35) / 3, rel=1e-12)
    loss.backward()  # d/dlogp of -w rho A / 3: clipped token gets 0
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, -0.5 / 3, -1.35 / 3], rel=1e-12)
    assert m["clip_frac"] == pytest.approx(1 / 3)
    assert m["weight_mean"] == pytest.approx(1.0) and m["weight_max"] == pytest.approx(1.5)
    assert m["intervened_frac"] == pytest.approx(2 / 3)
    assert m["ratio_min"] == pytest.approx(0.9) and m["ratio_max"] == pytest.approx(1.5)


def test_calibrated_without_reweight_hand_value():
    logp, old, beh, src = _calibrated_case()
    loss, m = loss_and_metrics(
        logp, old, t([1.0]), torch.ones(1, 3), src, beh, config=LossConfig(reweight=False)
    )
    assert loss.item() == pytest.approx((-1.28 - 1.0 - 0.9) / 3, rel=1e-12)
    assert m["weight_mean"] == 1.0


def test_behavior_mode_hand_value():
    old = t([[LN(0.4), LN(0.3), LN(0.2)]])
    logp = leaf(t([[LN(0.2), LN(0.2), LN(0.6)]]))
    beh = t([[0.0, LN(0.8), LN(0.5)]])
    # rho = [0.5 (policy, vs old), 0.25 (naive, vs mu), 1.2 (naive)], A = -1:
    # -min(-rho, -clip(rho)) = [0.8, 0.8, 1.2]
    cfg = LossConfig(is_mode="behavior")
    loss, m = loss_and_metrics(
        logp,
        old,
        t([-1.0]),
        torch.ones(1, 3),
        torch.tensor([[POLICY, INTERVENED, INTERVENED]]),
        beh,
        config=cfg,
    )
    assert loss.item() == pytest.approx(2.8 / 3, rel=1e-12)
    assert m["clip_frac"] == pytest.approx(2 / 3)
    assert m["naive_ratio_out_of_clip"] == pytest.approx(0.5)
    assert m["weight_mean"] == 1.0  # weights apply only in calibrated mode
    loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, 0.0, 1.2 / 3], rel=1e-12)


def test_behavior_mode_reproduces_naive_ratio():
    g = torch.Generator().manual_seed(1)
    old, logp, beh = (torch.randn(3, 6, generator=g, dtype=torch.float64) - 1 for _ in range(3))
    src = (torch.rand(3, 6, generator=g) < 0.5).long()
    rho = importance_ratios(logp, old, src, beh, LossConfig(is_mode="behavior"))
    expect = torch.where(src == INTERVENED, torch.exp(logp - beh), torch.exp(logp - old))
    assert torch.allclose(rho, expect, rtol=1e-12)
    assert (src == INTERVENED).any() and (src == POLICY).any()


def test_luffy_hand_value_and_grad():
    logp = leaf(t([[LN(0.5), LN(0.4)]]))
    old = t([[LN(0.5), LN(0.9)]])  # policy rho = 1; old ignored for luffy token
    cfg = LossConfig(is_mode="luffy", luffy_gamma=0.1)
    loss, m = loss_and_metrics(
        logp, old, t([2.0]), torch.ones(1, 2), torch.tensor([[POLICY, INTERVENED]]), config=cfg
    )
    # f = .4 / (.4 + .1) = .8; loss_t = [-2, -1.6]; df/dlogp = p g / (p + g)^2 = .04 / .25 = .16
    assert loss.item() == pytest.approx(-1.8, rel=1e-12)
    loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-1.0, -2 * 0.16 / 2], rel=1e-12)
    assert (
        m["ratio_min"] == m["ratio_max"] == pytest.approx(1.0)
    )  # f is not a ratio: not logged as one


def test_aggregate_hand_values():
    L = t([[1, 2, 3], [4, 5, 6]])
    m = t([[1, 1, 0], [1, 0, 0]])
    assert aggregate(L, m, "token-mean").item() == pytest.approx(7 / 3)
    assert aggregate(L, m, "seq-mean-token-mean").item() == pytest.approx(2.75)
    assert aggregate(L, m, "seq-mean-token-sum-norm").item() == pytest.approx(7 / 6)
    assert aggregate(L, m, "seq-mean-token-sum-norm", max_len=7).item() == pytest.approx(0.5)
    m_empty = t([[1, 1, 0], [0, 0, 0]])  # an empty row contributes nothing
    assert aggregate(L, m_empty, "token-mean").item() == pytest.approx(1.5)
    assert aggregate(L, m_empty, "seq-mean-token-mean").item() == pytest.approx(1.5)
    assert aggregate(L, m_empty, "seq-mean-token-sum-norm").item() == pytest.approx(0.5)


@pytest.mark.parametrize(
    "agg,expect",
    [("token-mean", -4 / 3), ("seq-mean-token-mean", -1.5), ("seq-mean-token-sum-norm", -4 / 6)],
)
def test_policy_loss_each_aggregation_hand_value(agg, expect):
    old = t([[-1.0, -2.0, -3.0], [-0.5, -0.1, -9.0]])
    m = t([[1, 1, 0], [1, 0, 0]])  # rho = 1: loss_t = -A = [[-1, -1], [-2]]
    loss, _ = loss_and_metrics(leaf(old), old, t([1.0, 2.0]), m, config=LossConfig(agg=agg))
    assert loss.item() == pytest.approx(expect, rel=1e-12)


def test_kl_hand_value():
    logp, ref = t([[LN(0.5)]]), t([[LN(0.25)]])
    cfg = LossConfig(kl_coef=0.1)
    loss, m = loss_and_metrics(
        leaf(logp), logp, t([0.0]), torch.ones(1, 1), ref_logp=ref, config=cfg
    )
    kl = 0.5 + LN(2) - 1  # exp(-ln 2) - (-ln 2) - 1
    assert loss.item() == pytest.approx(0.1 * kl, rel=1e-12)
    assert m["ref_kl"] == pytest.approx(kl, rel=1e-12)


def test_gspo_hand_value_and_grad():
    old = t([[-1.0, -2.0]])
    cfg = LossConfig(ratio_level="sequence")
    logp = leaf(old + t([[LN(2.0), 0.0]]))  # s = exp(ln2 / 2) = sqrt 2
    loss, m = loss_and_metrics(logp, old, t([-1.0]), torch.ones(1, 2), config=cfg)
    assert loss.item() == pytest.approx(math.sqrt(2), rel=1e-12)  # -min(-1.414, -1.28)
    loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([math.sqrt(2) / 2] * 2, rel=1e-12)
    assert m["ratio_min"] == m["ratio_max"] == pytest.approx(math.sqrt(2))
    logp = leaf(old + t([[LN(2.0), 0.0]]))
    loss, _ = loss_and_metrics(logp, old, t([1.0]), torch.ones(1, 2), config=cfg)
    loss.backward()
    assert loss.item() == pytest.approx(-1.28) and logp.grad.abs().sum() == 0


def test_clip_frac_counts_only_the_active_side():
    old = torch.log(torch.tensor([[0.5, 0.4, 0.3]]))  # float32, as a trainer would pass
    logp = old + torch.log(torch.tensor([[0.5, 1.5, 1.1]]))
    for a in (1.0, -1.0):  # A > 0: only 1.5 clipped; A < 0: only 0.5
        _, m = loss_and_metrics(logp, old, torch.tensor([a]), torch.ones(1, 3))
        assert m["clip_frac"] == pytest.approx(1 / 3)
        assert m["ratio_mean"] == pytest.approx(3.1 / 3, rel=1e-6)


# ---------------------------------------------------------------- plain-loop reference
def loop_loss(logp, old, adv, mask, src, beh, ref, cfg):
    """Token by token, python floats for constants, torch scalars where gradient flows."""
    B, T = logp.shape
    lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
    rows = []
    for i in range(B):
        tr = [k for k in range(T) if mask[i, k] > 0]
        inter = [k for k in tr if src[i, k] == INTERVENED]
        w = {k: 1.0 for k in tr}
        if cfg.is_mode == "calibrated" and cfg.reweight and inter:
            e = {k: math.exp(beh[i, k].item() - old[i, k].item()) for k in inter}
            avg = sum(e.values()) / len(e)
            w.update({k: min(max(e[k] / avg, cfg.w_min), cfg.w_max) for k in inter})

        anchor = {
            k: beh[i, k].item() if (cfg.is_mode == "behavior" and k in inter) else old[i, k].item()
            for k in tr
        }
        if tr:
            s = math.exp(sum(logp[i, k].item() - anchor[k] for k in tr) / len(tr))
        row = []
        for k in tr:
            a = adv[i, k].item() if adv.dim() == 2 else adv[i].item()
            if cfg.is_mode == "luffy" and k in inter:
                p = torch.exp(logp[i, k])
                term = -(p / (p + cfg.luffy_gamma)) * a
            else:
                if cfg.ratio_level == "token":
                    rho = torch.exp(logp[i, k] - anchor[k])
                else:
                    rho = s * torch.exp(logp[i, k] - logp[i, k].detach())
                r = rho.item()
                if lo <= r <= hi or r * a <= min(max(r, lo), hi) * a:
                    surr = rho * a
                else:
                    surr = min(max(r, lo), hi) * a + 0 * logp[i, k]
                term = -w[k] * surr
            if cfg.kl_coef > 0:
                d = ref[i, k] - logp[i, k]
                term = term + cfg.kl_coef * (torch.exp(d) - d - 1)
            row.append(term)
        rows.append(row)
    n_tok = sum(len(r) for r in rows)
    if cfg.agg == "token-mean":
        return sum(sum(r) for r in rows) / max(n_tok, 1)
    if cfg.agg == "seq-mean-token-mean":
        means = [sum(r) / len(r) for r in rows if r]
        return sum(means) / len(means)
    return sum(sum(r) for r in rows if r) / (B * (cfg.max_len or T))


def _random_batch(seed, B=4, T=5):
    g = torch.Generator().manual_seed(seed)

    def rn():
        return torch.randn(B, T, generator=g, dtype=torch.float64)

    old = -1.5 + 0.5 * rn()
    logp = (old + 0.3 * rn()).clamp(max=-0.01)
    beh = (old + 1.5 * rn()).clamp(max=0.0)
    ref = old + 0.2 * rn()
    src = (torch.rand(B, T, generator=g) < 0.5).long()
    mask = (torch.rand(B, T, generator=g) < 0.8).double()
    mask[1] = 0.0  # an empty row
    mask[0, 0] = 1.0
    src[0, 0] = INTERVENED
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return logp, old, adv, mask, src, beh, ref


CONFIGS = [
    LossConfig(is_mode=mo, agg=ag, ratio_level=lv, reweight=rw, kl_coef=kl, max_len=ml)
    for mo, ag, lv, rw in itertools.product(
        ("calibrated", "behavior", "luffy"),
        ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
        ("token", "sequence"),
        (True, False),
    )
    for kl, ml in [((0.05, 8) if ag == "seq-mean-token-sum-norm" and rw else (0.0, None))]
]


@pytest.mark.parametrize("seed", [0, 1])
def test_vectorised_equals_loop(seed):
    logp0, old, adv, mask, src, beh, ref = _random_batch(seed)
    for cfg in CONFIGS:
        for a in (adv, adv[:, None] * torch.linspace(0.5, 1.5, 5, dtype=torch.float64)):
            lv, ll = leaf(logp0), leaf(logp0)
            loss, _ = loss_and_metrics(lv, old, a, mask, src, beh, ref, cfg)
            ref_loss = loop_loss(ll, old, a, mask, src, beh, ref, cfg)
            (gv,) = torch.autograd.grad(loss, lv)
            (gl,) = torch.autograd.grad(ref_loss, ll)
            assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-9, abs=1e-12), cfg
            assert torch.allclose(gv, gl, rtol=1e-9, atol=1e-12), cfg


def test_loop_reference_sees_clipping_and_weights():
    """Guard that the random batch exercises the clip and the weight clip (else the loop test is weak)."""
    logp, old, adv, mask, src, beh, ref = _random_batch(0)
    _, m = loss_and_metrics(
        logp, old, adv, mask, src, beh, config=LossConfig(clip_low=0.1, clip_high=0.1)
    )
    assert m["clip_frac"] > 0 and m["weight_max"] > 1.0
    _, m = loss_and_metrics(logp, old, adv, mask, src, beh)
    assert m["clip_frac"] > 0


# ---------------------------------------------------------------- gradients and invariants
@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(),
        LossConfig(is_mode="luffy", ratio_level="sequence"),
        LossConfig(is_mode="behavior", agg="seq-mean-token-mean", kl_coef=0.1),
    ],
)
def test_masked_tokens_get_exactly_zero_grad(cfg):
    logp, old, adv, mask, src, beh, ref = _random_batch(3)
    logp = logp.clone()
    logp[mask == 0] = -math.inf  # -inf is allowed where loss_mask is 0
    old[mask == 0] = -math.inf
    lv = leaf(logp)
    loss, m = loss_and_metrics(lv, old, adv, mask.bool(), src, beh, ref, cfg)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lv.grad).all()
    assert torch.equal(lv.grad[mask == 0], torch.zeros_like(lv.grad[mask == 0]))
    assert (lv.grad[mask != 0] != 0).any()
    assert all(math.isfinite(v) for v in m.values())
    # the per-token loss is 0 where a token is not trained, as TokenLosses says
    terms = token_losses(lv.detach(), old, adv, mask.bool(), src, beh, ref, cfg)
    assert torch.equal(terms.loss[mask == 0], torch.zeros_like(terms.loss[mask == 0]))
    assert (terms.loss[mask != 0] != 0).any()


def test_ratio_exactly_one_at_first_step():
    logp, old, adv, mask, src, beh, _ = _random_batch(4)
    beh = (old + 5.0).clamp(max=0.0)  # corrector far off the policy
    rho = importance_ratios(old.clone(), old, src, beh, LossConfig(), loss_mask=mask)
    assert torch.equal(rho, torch.ones_like(rho))
    for level in ("token", "sequence"):
        _, m = loss_and_metrics(
            leaf(old), old, adv, mask, src, beh, config=LossConfig(ratio_level=level)
        )
        assert m["ratio_min"] == m["ratio_max"] == 1.0 and m["clip_frac"] == 0.0
        assert m["naive_ratio_out_of_clip"] == 1.0  # the naive ratio pi / mu would be clipped


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_gspo_equals_grpo_when_ratios_are_one(agg):
    _, old, adv, mask, src, beh, _ = _random_batch(5)
    out = []
    for level in ("token", "sequence"):
        lv = leaf(old)
        loss, _ = loss_and_metrics(
            lv, old, adv, mask, src, beh, config=LossConfig(agg=agg, ratio_level=level)
        )
        loss.backward()
        out.append((loss.detach(), lv.grad))
    assert torch.allclose(out[0][0], out[1][0], rtol=1e-12) and torch.allclose(
        out[0][1], out[1][1], rtol=1e-12
    )
    assert out[0][1].abs().sum() > 0


def test_behavior_logp_none_means_zeros():
    logp, old, adv, mask, src, _, _ = _random_batch(6)
    a, ma = loss_and_metrics(logp, old, adv, mask, src, None)
    b, mb = loss_and_metrics(logp, old, adv, mask, src, torch.zeros_like(old))
    assert a.item() == b.item() and ma == mb


# ---------------------------------------------------------------- edge cases
@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(agg=a, ratio_level=lv, is_mode=mo)
        for a in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
        for lv in ("token", "sequence")
        for mo in ("calibrated", "luffy")
    ],
)
def test_edge_cases_finite(cfg):
    logp, old, _, mask, src, beh, _ = _random_batch(7)
    adv = group_advantages(t([1, 1, 0, 0]), 2)  # zero-spread groups -> zero advantages
    cases = {
        "empty row + zero spread": (adv, mask, src),
        "no intervened tokens": (t([1.0, -1.0, 0.5, 2.0]), mask, torch.zeros_like(src)),
        "all masked": (t([1.0, -1.0, 0.5, 2.0]), torch.zeros_like(mask), src),
    }
    for name, (a, m, s) in cases.items():
        lv = leaf(logp)
        loss, met = loss_and_metrics(lv, old, a, m, s, beh, config=cfg)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lv.grad).all(), name
        assert all(math.isfinite(v) for v in met.values()), name
        if name == "all masked":
            assert loss.item() == 0.0 and loss.grad_fn is not None
            assert met["intervened_frac"] == 0.0 and met["weight_mean"] == 1.0
        if name == "no intervened tokens":
            assert met["naive_ratio_out_of_clip"] == 0.0 and met["weight_max"] == 1.0
        if name == "empty row + zero spread":
            assert torch.equal(lv.grad, torch.zeros_like(lv.grad))


# ---------------------------------------------------------------- bad input
def test_shape_mismatch_names_both_shapes():
    x = torch.zeros(2, 5)
    with pytest.raises(
        ValueError, match=r"logp has shape \(2, 5\) but old_logp has shape \(2, 4\)"
    ):
        policy_loss(x, torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"but source has shape \(5, 2\)"):
        policy_loss(
            x, x, torch.zeros(2), torch.ones(2, 5), source=torch.zeros(5, 2, dtype=torch.long)
        )
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\)"):
        policy_loss(x, x, torch.zeros(3), torch.ones(2, 5))
    with pytest.raises(
        ValueError, match=r"loss_mat has shape \(2, 5\) but loss_mask has shape \(2, 4\)"
    ):
        aggregate(x, torch.ones(2, 4))


@pytest.mark.parametrize("name", ["logp", "old_logp", "behavior_logp", "ref_logp"])
@pytest.mark.parametrize("bad", [float("nan"), math.inf])
def test_nan_or_inf_names_the_tensor(name, bad):
    args = {k: torch.full((2, 3), -1.0) for k in ("logp", "old_logp", "behavior_logp", "ref_logp")}
    args[name][1, 2] = bad
    with pytest.raises(ValueError, match=rf"^{name} contains NaN or \+inf"):
        policy_loss(
            args["logp"],
            args["old_logp"],
            torch.zeros(2),
            torch.ones(2, 3),
            behavior_logp=args["behavior_logp"],
            ref_logp=args["ref_logp"],
            config=CHECKED,
        )


def test_neg_inf_rejected_on_trained_token_and_other_bad_input():
    x = torch.full((1, 3), -1.0)
    bad_old = torch.tensor([[-1.0, -math.inf, -1.0]])
    with pytest.raises(ValueError, match="old_logp contains -inf at a trained position"):
        policy_loss(x, bad_old, torch.zeros(1), torch.ones(1, 3), config=CHECKED)
    with pytest.raises(ValueError, match="advantages contains NaN"):
        policy_loss(x, x, torch.tensor([math.nan]), torch.ones(1, 3), config=CHECKED)
    with pytest.raises(ValueError, match="ref_logp is required when kl_coef > 0"):
        policy_loss(x, x, torch.zeros(1), torch.ones(1, 3), config=LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="loss_mask must hold only 0 and 1"):
        policy_loss(x, x, torch.zeros(1), torch.full((1, 3), 0.5), config=CHECKED)
    with pytest.raises(ValueError, match="source must hold only"):
        source = torch.full((1, 3), 2)
        policy_loss(x, x, torch.zeros(1), torch.ones(1, 3), source=source, config=CHECKED)


def test_value_checks_are_off_by_default_and_cost_no_sync():
    """Without check_values a NaN passes through (no value check on the hot path: each is a device
    sync); the shape checks stay on."""
    x = torch.full((1, 3), -1.0)
    loss = policy_loss(x, x, torch.tensor([math.nan]), torch.ones(1, 3))
    assert math.isnan(loss.item())
    with pytest.raises(ValueError, match="but old_logp has shape"):
        policy_loss(x, torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 3))


def test_loss_py_imports_and_runs_with_torch_alone():
    """loss.py copies into another trainer with torch as its only dependency: in a fresh interpreter where numpy,
    transformers and the project's other modules cannot be imported, it imports and computes a loss and its
    metrics."""
    code = """
import sys
for name in ("numpy", "transformers", "tokenizers", "envs", "intervene", "policy", "rti", "runtime", "evaluate"):
    sys.modules[name] = None
import torch, loss
x = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
value = loss.policy_loss(x, x.detach(), torch.tensor([1.0]), torch.ones(1, 3))
value.backward()
figures = loss.loss_metrics(x, x.detach(), torch.tensor([1.0]), torch.ones(1, 3))
print(round(value.item(), 4), figures["tokens/trained"], x.grad.tolist())
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == [
        "-1.0",
        "3",
        "[[-0.3333333432674408,",
        "-0.3333333432674408,",
        "-0.3333333432674408]]",
    ]


@pytest.mark.parametrize(
    "field,value,pattern",
    [
        (
            "is_mode",
            "naive",
            r"--is-mode: must be one of \('calibrated', 'behavior', 'luffy'\), got 'naive'",
        ),
        ("agg", "mean", r"--agg: must be one of \('token-mean'.*got 'mean'"),
        ("ratio_level", "seq", r"--ratio-level: must be one of \('token', 'sequence'\), got 'seq'"),
        ("clip_low", -0.1, r"--clip-low: must be in \[0, 1\], got -0.1"),
        ("clip_high", float("nan"), r"--clip-high: .*got nan"),
        ("w_max", 0.1, r"--w-max: must be >= --w-min .*got 0.1"),
        ("luffy_gamma", 0.0, r"--luffy-gamma: .*got 0.0"),
        ("kl_coef", -1.0, r"--kl-coef: .*got -1.0"),
        ("reweight", 1, r"--reweight: must be a bool, got 1"),
        ("scale_advantages", "yes", r"--scale-advantages: must be a bool, got 'yes'"),
        ("max_len", 0, r"--max-len: .*got 0"),
    ],
)
def test_config_validation(field, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        LossConfig(**{field: value})


def test_config_fields_carry_their_help_and_choices():
    """The trainer's parser reads metadata["help"], metadata.get("choices") and the type string."""
    fields = {f.name: f for f in dataclasses.fields(LossConfig)}
    for name, f in fields.items():
        assert isinstance(f.metadata.get("help"), str) and f.metadata["help"].strip(), name
    assert {
        name: f.metadata.get("choices") for name, f in fields.items() if f.metadata.get("choices")
    } == {
        "is_mode": IS_MODES,
        "agg": AGG_MODES,
        "ratio_level": RATIO_LEVELS,
    }
    assert {name: f.type for name, f in fields.items()} == {
        "clip_low": "float",
        "clip_high": "float",
        "is_mode": "str",
        "reweight": "bool",
        "w_min": "float",
        "w_max": "float",
        "luffy_gamma": "float",
        "kl_coef": "float",
        "agg": "str",
        "ratio_level": "str",
        "max_len": "int | None",
        "scale_advantages": "bool",
        "check_values": "bool",
    }
    for name in ("is_mode", "agg", "ratio_level"):
        assert getattr(LossConfig(), name) in fields[name].metadata["choices"]
        for value in fields[name].metadata["choices"]:
            assert getattr(LossConfig(**{name: value}), name) == value
        with pytest.raises(ValueError, match=f"^--{name.replace('_', '-')}: must be one of"):
            LossConfig(**{name: "other"})


def test_aggregate_unknown_mode_lists_choices():
    with pytest.raises(
        ValueError, match=r"unknown aggregation mode 'sum'; valid choices: \('token-mean'"
    ):
        aggregate(torch.zeros(1, 2), torch.ones(1, 2), "sum")


def test_combined_micro_batch_metrics_are_the_whole_batchs():
    """Micro-batches' metrics joined by combine_metrics equal the metrics of the batch they
    split: means weighted by the tokens they are over, so a part without intervened tokens (whose
    weight_mean is the empty default 1.0) does not dilute the intervened tokens' figures, extremes
    over the parts that have such tokens, counts summed. Token weights off: with them on, the
    calibrated weights are normalised over the batch (`token_weights`), so they differ by part."""
    logp, old, adv, mask, src, beh, ref = _random_batch(3, B=6, T=7)
    src[3:] = POLICY  # rows 3-5: policy tokens only
    mask[5] = 0.0  # and an empty row
    cfg = LossConfig(reweight=False)
    parts = [slice(0, 3), slice(3, 5), slice(5, 6)]
    whole = loss_metrics(logp, old, adv, mask, src, beh, ref, cfg)
    split = [
        loss_metrics(*(x[p] for x in (logp, old, adv, mask, src, beh, ref)), cfg) for p in parts
    ]
    assert split[1]["tokens/intervened"] == 0 and split[1]["weight_mean"] == 1.0
    assert split[1]["naive_ratio_out_of_clip"] == 0.0 < split[0]["naive_ratio_out_of_clip"]
    combined = combine_metrics(split)
    assert combined.keys() == whole.keys()
    for key, value in whole.items():
        assert combined[key] == pytest.approx(value, rel=1e-12), key
    assert combined["tokens/trained"] == int(mask.sum())
    # a figure that is not over tokens (the trainer's per-part loss) is a plain mean
    assert combine_metrics([{"loss": 1.0}, {"loss": 3.0}]) == {"loss": 2.0}
