"""RTI loss: group advantages, importance ratios, calibrated token weights, clipped surrogate,
aggregation. Pure tensor functions; imports torch only (no model, no env).

Shapes: B rows (trajectories) x T token positions. logp, old_logp, behavior_logp, ref_logp,
source, loss_mask are [B, T]; advantages [B] (one per row) or [B, T].
  loss_mask      1 on tokens the agent produced (trained), 0 on prompt / environment / padding.
  source         POLICY (0) or INTERVENED (1): who wrote the token (the policy or the corrector).
  old_logp       log pi_old of each token, scored by the policy WITHOUT the rubric in context.
  behavior_logp  log mu: the corrector's log-prob when it wrote the token (rubric in context).
Formulas marked "our reading" are not printed in the RTI paper (the README's method table lists
them).

What an update needs is `policy_loss` (built on `token_losses`); `loss_metrics` and
`combine_metrics` are bookkeeping a trainer may leave out. Shapes are checked on every call; the
values (NaN, inf, token codes) only with LossConfig(check_values=True), since each value check is
a device sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import torch
from torch import Tensor

POLICY = 0
INTERVENED = 1
IS_MODES = ("calibrated", "behavior", "luffy")
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
RATIO_LEVELS = ("token", "sequence")
LOG_RATIO_CLAMP = 20.0  # as verl: |log ratio| <= 20 keeps exp() finite, so backward never sees inf


def require(config, name: str, ok: bool, why: str) -> None:
    """Raise ValueError("--name: why, got VALUE") unless `ok`. How every config of the project
    checks a field: its message names the flag that sets it (each field is a flag of rti.py)."""
    if not ok:
        raise ValueError(f"--{name.replace('_', '-')}: {why}, got {getattr(config, name)!r}")


def require_choices(config) -> None:
    """require() of each field whose metadata names its choices."""
    for f in fields(config):
        choices = f.metadata.get("choices")
        if choices is not None:
            require(config, f.name, getattr(config, f.name) in choices, f"must be one of {choices}")


@dataclass
class LossConfig:
    """Flags of this file's functions, checked when built (validate)."""

    clip_low: float = field(
        default=0.2,
        metadata={"help": "eps_lo: the ratio is clipped below at 1 - clip_low (DAPO-style)"},
    )
    clip_high: float = field(
        default=0.28,
        metadata={"help": "eps_hi: the ratio is clipped above at 1 + clip_high (DAPO-style)"},
    )
    is_mode: str = field(
        default="calibrated",
        metadata={
            "help": "importance ratio of INTERVENED tokens: calibrated = pi / pi_old, anchored on"
            " the policy's own no-rubric prob (and weighted, see reweight); behavior = the naive"
            " pi / mu; luffy = LUFFY's p / (p + luffy_gamma), unclipped",
            "choices": IS_MODES,
        },
    )
    reweight: bool = field(
        default=True,
        metadata={
            "help": "calibrated token weights on INTERVENED tokens (is_mode calibrated); off ="
            ' the paper\'s "w/o reweight" ablation, every weight 1'
        },
    )
    w_min: float = field(
        default=0.2,
        metadata={"help": "lower clip of the token weights (our choice: the paper prints none)"},
    )
    w_max: float = field(
        default=3.0,
        metadata={"help": "upper clip of the token weights (our choice: the paper prints none)"},
    )
    luffy_gamma: float = field(
        default=0.1,
        metadata={"help": "gamma of is_mode luffy's shaping p / (p + gamma) (our choice)"},
    )
    kl_coef: float = field(
        default=0.0,
        metadata={
            "help": "weight of the k3 KL to the reference policy in the loss; 0 = no KL (rti.py "
            "loads no reference model and refuses > 0; extras/trl_rti.py takes TRL's beta)"
        },
    )
    agg: str = field(
        default="token-mean",
        metadata={
            "help": "how the per-token loss becomes a scalar: token-mean = the mean over all"
            " trained tokens; seq-mean-token-mean = the mean of the rows' means;"
            " seq-mean-token-sum-norm = the sum over B * max_len (Dr. GRPO)",
            "choices": AGG_MODES,
        },
    )
    ratio_level: str = field(
        default="token",
        metadata={
            "help": "token = one ratio per token (GRPO/PPO); sequence = one per row, the geometric"
            " mean of its token ratios (GSPO)",
            "choices": RATIO_LEVELS,
        },
    )
    max_len: int | None = field(
        default=None,
        metadata={"help": "normaliser of agg seq-mean-token-sum-norm; none = the batch's T"},
    )
    scale_advantages: bool = field(
        default=True,
        metadata={"help": "divide advantages by the group's std (GRPO); off = Dr. GRPO"},
    )
    check_values: bool = field(
        default=False,
        metadata={
            "help": "debugging: policy_loss raises on NaN or inf inputs and on bad mask or source "
            "codes (a device sync per call)"
        },
    )

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """require() every field (NaN fails every comparison, so it is rejected too)."""
        require_choices(self)
        require(self, "clip_low", 0 <= self.clip_low <= 1, "must be in [0, 1]")
        require(self, "clip_high", 0 <= self.clip_high < math.inf, "must be finite and >= 0")
        for name in ("reweight", "scale_advantages", "check_values"):
            require(self, name, isinstance(getattr(self, name), bool), "must be a bool")
        require(self, "w_min", 0 <= self.w_min < math.inf, "must be finite and >= 0")
        require(self, "w_max", self.w_max >= self.w_min, "must be >= --w-min (inf allowed)")
        require(self, "luffy_gamma", 0 < self.luffy_gamma < math.inf, "must be finite and > 0")
        require(self, "kl_coef", 0 <= self.kl_coef < math.inf, "must be finite and >= 0")
        require(self, "max_len", self.max_len is None or self.max_len >= 1, "must be none or >= 1")


def group_advantages(
    rewards: Tensor, group_size: int, eps: float = 1e-6, scale: bool = True
) -> Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps) over the group g of trajectory i (GRPO);
    scale=False gives A_i = r_i - mean_g (Dr. GRPO). std_g is the UNBIASED std (Bessel, n-1),
    as torch.std, TRL and verl. A zero-spread group (all rewards equal, or group_size 1) gives
    exactly 0 for all its members: it teaches nothing.

    rewards [N], N = num_groups * group_size, laid out group by group. Example, G=4:
      rewards [1, 0, 0, 0, 0, 0, 0, 0] -> mean .25, std .5 | zero spread
      A       [1.5, -.5, -.5, -.5, 0, 0, 0, 0]             (eps=0)
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards has {rewards.numel()} entries, not a multiple of group_size={group_size}"
        )
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contains NaN or inf")
    r = rewards.detach().view(-1, group_size)
    if not r.is_floating_point():
        r = r.float()
    adv = r - r.mean(-1, keepdim=True)
    if scale and group_size > 1:
        adv = adv / (r.std(-1, keepdim=True) + eps)
    zero_spread = r.amax(-1, keepdim=True) == r.amin(-1, keepdim=True)
    return torch.where(zero_spread, torch.zeros_like(adv), adv).view(-1)


def group_rows(group_ids: list) -> dict:
    """Group id -> the rows of that group, groups in order of first appearance:
    [0, 1, 0] -> {0: [0, 2], 1: [1]}."""
    rows: dict = {}
    for i, g in enumerate(group_ids):
        rows.setdefault(g, []).append(i)
    return rows


def advantages_by_group(rewards: Tensor, group_ids: list, scale: bool = True) -> Tensor:
    """group_advantages for groups of any size: rows with the same id form a group, wherever they
    are (paired RTI enlarges a triggered group with its corrections). Example: ids
    [0, 0, 0, 0, 1, 1], rewards [0, 0, 1, 1, 1, 1] -> group 0 as group_advantages(rewards[:4], 4),
    group 1 zero spread: A [-.866, -.866, .866, .866, 0, 0]."""
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    adv = torch.zeros_like(rewards, dtype=dtype)
    for rows in group_rows(group_ids).values():
        adv[rows] = group_advantages(rewards[rows], len(rows), scale=scale)
    return adv


def token_weights(
    behavior_logp: Tensor,
    old_logp: Tensor,
    intervened_mask: Tensor,
    w_min: float = 0.2,
    w_max: float = 3.0,
) -> Tensor:
    """Calibrated token weights (our reading), detached, [B, T]:
      delta_t = log mu_t - log pi_old_t
      w_t = clip(exp(delta_t) / mean_{s in I_i} exp(delta_s), w_min, w_max)  for t in I_i
      w_t = 1                                                                  elsewhere
    I_i = the intervened tokens of row i (pass source == INTERVENED and loss_mask). Tokens the
    rubric-conditioned corrector made much likelier than the policy would (large shift) are
    the ones that changed the trajectory's direction: they get more weight. The mean is taken
    in log space: w_t = exp(delta_t - logsumexp_I(delta) + log |I|), safe for any delta.
    Rows with no intervened token are all ones. Example (w_min .2, w_max 3):
      exp(delta) on I = [1, 3] -> mean 2 -> w = [0.5, 1.5]; on policy tokens w = 1.
    """
    with torch.no_grad():
        inter = intervened_mask.bool()
        delta = torch.where(inter, behavior_logp - old_logp, torch.full_like(old_logp, -math.inf))
        n = inter.sum(-1, keepdim=True)
        lse = torch.logsumexp(delta, -1, keepdim=True)
        lse = torch.where(n > 0, lse, torch.zeros_like(lse))  # empty rows: no -inf - -inf
        w = torch.exp(delta - lse + torch.log(n.clamp(min=1).to(delta.dtype))).clamp(w_min, w_max)
        return torch.where(inter, w, torch.ones_like(w))


def importance_ratios(
    logp: Tensor,
    old_logp: Tensor,
    source: Tensor | None = None,
    behavior_logp: Tensor | None = None,
    config: LossConfig | None = None,
    loss_mask: Tensor | None = None,
) -> Tensor:
    """Per-token ratio rho_t used in the surrogate, [B, T] (token weights NOT included).
      anchor_t = log mu_t      if is_mode == "behavior" and t is INTERVENED  (naive ratio pi/mu)
               = log pi_old_t  otherwise (policy tokens; "calibrated" intervened tokens, our
                 reading: anchored on the policy's own no-rubric prob, so rho_t starts at 1)
      l_t = clamp(logp_t - anchor_t, -20, 20)
      token level:     rho_t = exp(l_t)
      sequence (GSPO): s_i = exp(sum_t m_t l_t / sum_t m_t)  (m = loss_mask)
                       rho_t = sg(s_i) * exp(logp_t - sg(logp_t))
                       (value s_i for every token of row i, gradient per token)
      is_mode "luffy", INTERVENED tokens: rho_t := f_t = p_t / (p_t + gamma), p_t = exp(logp_t),
                       computed as sigmoid(logp_t - log gamma); the surrogate uses it unclipped.
    source None = all POLICY; behavior_logp None = zeros (a deterministic corrector, log mu = 0);
    config None = LossConfig(); loss_mask None = all trained (only the sequence level uses it).
    """
    config = LossConfig() if config is None else config
    inter = torch.zeros_like(logp, dtype=torch.bool) if source is None else source == INTERVENED
    anchor = old_logp.detach()
    if config.is_mode == "behavior":
        beh = torch.zeros_like(logp) if behavior_logp is None else behavior_logp.detach()
        anchor = torch.where(inter, beh, anchor)
    log_ratio = (logp - anchor).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if config.ratio_level == "token":
        rho = torch.exp(log_ratio)
    else:
        m = torch.ones_like(logp) if loss_mask is None else loss_mask.to(logp.dtype)
        row_sum = torch.where(m != 0, log_ratio, 0.0).sum(-1, keepdim=True)
        log_s = row_sum / m.sum(-1, keepdim=True).clamp(min=1)
        rho = torch.exp(log_s.detach() + (logp - logp.detach()))  # value exactly s_i
    if config.is_mode == "luffy":
        rho = torch.where(inter, torch.sigmoid(logp - math.log(config.luffy_gamma)), rho)
    return rho


def aggregate(
    loss_mat: Tensor, loss_mask: Tensor, mode: str = "token-mean", max_len: int | None = None
) -> Tensor:
    """Reduce a [B, T] per-token loss to a scalar (verl's agg_loss). m = loss_mask, L = loss_mat.
      token-mean:              sum_it m L / sum_it m
      seq-mean-token-mean:     mean over rows with sum_t m > 0 of (sum_t m L / sum_t m)
      seq-mean-token-sum-norm: sum_it m L / (B * max_len), max_len default T (Dr. GRPO; B counts
                               every row: the normaliser is a constant by design)
    Rows with no trained token contribute nothing; a batch with none gives 0 (keeping grad_fn).
    Example: L = [[1, 2, 3], [4, 5, 6]], m = [[1, 1, 0], [1, 0, 0]]:
      token-mean 7/3, seq-mean-token-mean (1.5 + 4)/2 = 2.75, seq-mean-token-sum-norm 7/6.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; valid choices: {AGG_MODES}")
    if loss_mat.shape != loss_mask.shape:
        raise ValueError(
            f"loss_mat has shape {tuple(loss_mat.shape)} "
            f"but loss_mask has shape {tuple(loss_mask.shape)}"
        )
    m = loss_mask.to(loss_mat.dtype)
    # where, not only the product: inf / NaN at masked positions never leak
    masked = torch.where(m != 0, loss_mat * m, torch.zeros_like(loss_mat))
    if mode == "token-mean":
        return masked.sum() / m.sum().clamp(min=1)
    if mode == "seq-mean-token-mean":
        n = m.sum(-1)
        row_mean = masked.sum(-1) / n.clamp(min=1)
        return (row_mean * (n > 0)).sum() / (n > 0).sum().clamp(min=1)
    if max_len is None:
        max_len = loss_mat.shape[-1]
    return masked.sum() / (loss_mat.shape[0] * max_len)


def check_shapes(logp, old_logp, advantages, loss_mask, source, behavior_logp, ref_logp, config):
    """Raise ValueError naming the input whose shape (or type) does not fit token_losses."""
    if not isinstance(config, LossConfig):
        raise ValueError(f"config must be a LossConfig, got {type(config).__name__}")
    if logp.dim() != 2:
        raise ValueError(f"logp must be 2-D [B, T], got shape {tuple(logp.shape)}")
    same_shape = {
        "old_logp": old_logp,
        "loss_mask": loss_mask,
        "source": source,
        "behavior_logp": behavior_logp,
        "ref_logp": ref_logp,
    }
    for name, t in same_shape.items():
        if t is not None and t.shape != logp.shape:
            raise ValueError(
                f"logp has shape {tuple(logp.shape)} but {name} has shape {tuple(t.shape)}"
            )
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)} but logp has shape "
            f"{tuple(logp.shape)}; expected {tuple(logp.shape[:1])} or {tuple(logp.shape)}"
        )
    if config.kl_coef > 0 and ref_logp is None:
        raise ValueError(f"ref_logp is required when kl_coef > 0 (kl_coef={config.kl_coef})")


def check_values(logp, old_logp, advantages, loss_mask, source, behavior_logp, ref_logp):
    """Raise ValueError naming the input whose values do not fit token_losses: a mask that is not
    0/1, a source code that is neither POLICY nor INTERVENED, NaN or inf advantages, NaN or +inf
    log-probs, or -inf at a trained position (-inf is fine where loss_mask is 0)."""
    if not ((loss_mask == 0) | (loss_mask == 1)).all():
        raise ValueError("loss_mask must hold only 0 and 1 (or bool)")
    if source is not None and not ((source == POLICY) | (source == INTERVENED)).all():
        raise ValueError(f"source must hold only POLICY={POLICY} and INTERVENED={INTERVENED}")
    if not torch.isfinite(advantages).all():
        raise ValueError("advantages contains NaN or inf")
    trained = loss_mask != 0
    log_probs = {
        "logp": logp,
        "old_logp": old_logp,
        "behavior_logp": behavior_logp,
        "ref_logp": ref_logp,
    }
    for name, t in log_probs.items():
        if t is None:
            continue
        if torch.isnan(t).any() or (t == math.inf).any():
            raise ValueError(f"{name} contains NaN or +inf")
        if (trained & (t == -math.inf)).any():
            raise ValueError(f"{name} contains -inf at a trained position (loss_mask = 1)")


class TokenLosses(NamedTuple):
    """token_losses' per-token tensors [B, T]: the loss, and what it is made of (0 or 1 where not
    trained), for the metrics."""

    loss: Tensor  # loss_t, 0 where not trained
    rho: Tensor  # the ratio (f_t on luffy tokens)
    w: Tensor  # the token weights
    adv: Tensor  # the advantage of each token
    logp: Tensor  # log pi_theta, pi_old and mu, 0 where not trained
    old: Tensor
    beh: Tensor
    ref_kl: Tensor | None  # k3 KL to the reference (None without ref_logp)
    trained: Tensor  # bool: loss_mask
    inter: Tensor  # bool: trained INTERVENED tokens


def token_losses(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    source: Tensor | None = None,
    behavior_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    config: LossConfig | None = None,
) -> TokenLosses:
    """The clipped surrogate with calibrated importance weights, per token:
      loss_t = -w_t * min(rho_t A, clip(rho_t, 1 - clip_low, 1 + clip_high) A)
               (rho_t, f_t from importance_ratios; w_t from token_weights on INTERVENED tokens
               when is_mode is "calibrated" and reweight, else 1. w_t > 0 sits outside the min:
               the clip decision is made on rho_t alone, w_t scales the token's update; this is
               our reading of the weighted ratio rho~ = rho * w)
      loss_t = -f_t A                    INTERVENED tokens under is_mode "luffy" (no clip, w = 1)
      loss_t += kl_coef * (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)   k3 KL, when kl_coef > 0
    Example, 1x3, A = 1, source [P, I, I], rho [1.5, 1.0, 0.9], exp(delta) on I [1, 3]:
      w [1, .5, 1.5]; loss_t [-1.28, -0.5, -1.35].
    Inputs: see the module docstring; config None = LossConfig(). Shapes are checked
    (check_shapes), values with config.check_values (check_values). Masked positions are replaced
    by 0 before any arithmetic, so their logp gradient is exactly 0 and -inf there is harmless.
    old/behavior/ref/advantages are detached."""
    config = LossConfig() if config is None else config
    check_shapes(logp, old_logp, advantages, loss_mask, source, behavior_logp, ref_logp, config)
    if config.check_values:
        check_values(logp, old_logp, advantages, loss_mask, source, behavior_logp, ref_logp)
    trained = loss_mask != 0
    zeros = torch.zeros_like(logp)

    def clean(t: Tensor) -> Tensor:  # detached, in logp's dtype, 0 at masked positions
        return torch.where(trained, t.detach().to(logp.dtype), zeros)

    logp = torch.where(trained, logp, zeros)  # grad 0 at masked positions, no NaN from -inf there
    old = clean(old_logp)
    beh = zeros if behavior_logp is None else clean(behavior_logp)
    src = torch.full_like(logp, POLICY, dtype=torch.long) if source is None else source.long()
    inter = (src == INTERVENED) & trained
    adv = advantages.detach().to(logp.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1).expand_as(logp)

    rho = importance_ratios(logp, old, src, beh, config, loss_mask=trained)
    if config.is_mode == "calibrated" and config.reweight:
        w = token_weights(beh, old, inter, config.w_min, config.w_max)
    else:
        w = torch.ones_like(logp)
    rho_clip = rho.clamp(1 - config.clip_low, 1 + config.clip_high)
    loss = -w * torch.minimum(rho * adv, rho_clip * adv)
    luffy = inter & (config.is_mode == "luffy")
    loss = torch.where(luffy, -rho * adv, loss)
    ref_kl = None
    if ref_logp is not None:
        d = (clean(ref_logp) - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ref_kl = torch.exp(d) - d - 1
        if config.kl_coef > 0:
            loss = loss + config.kl_coef * ref_kl
    loss = torch.where(trained, loss, zeros)
    return TokenLosses(loss, rho, w, adv, logp, old, beh, ref_kl, trained, inter)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    source: Tensor | None = None,
    behavior_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    config: LossConfig | None = None,
) -> Tensor:
    """The scalar an update backpropagates: aggregate(token_losses(...).loss, loss_mask,
    config.agg, config.max_len). Example: token_losses' 1x3 example under token-mean, -1.0433."""
    config = LossConfig() if config is None else config
    terms = token_losses(
        logp, old_logp, advantages, loss_mask, source, behavior_logp, ref_logp, config
    )
    return aggregate(terms.loss, terms.trained, config.agg, config.max_len)


@torch.no_grad()
def loss_metrics(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    source: Tensor | None = None,
    behavior_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    config: LossConfig | None = None,
) -> dict[str, float]:
    """policy_loss's figures (python floats) for the same inputs, from token_losses' tensors (rho
    the ratios, w the weights, trained and inter the trained and trained INTERVENED tokens):
      clip_frac        trained tokens with a clipped surrogate whose clip is active for the sign
                       of A (A > 0 and rho > 1 + clip_high, or A < 0 and rho < 1 - clip_low),
                       over the trained tokens
      ratio_min/mean/max  rho over tokens with a clipped surrogate (not luffy ones); 1.0 if none
      naive_ratio_out_of_clip  share of trained INTERVENED tokens whose naive ratio
                       exp(logp - log mu) lies outside [1 - clip_low, 1 + clip_high]; 0.0 if none
      weight_mean/max  w_t on trained INTERVENED tokens; 1.0 if none
      approx_kl        k3 estimate of KL(pi_old || pi_theta): mean of exp(l) - 1 - l,
                       l = logp - old_logp; 0.0 if no trained token
      ref_kl           mean k3 to the reference; 0.0 without ref_logp
      intervened_frac  share of the trained tokens that are INTERVENED
      policy/..., intervened/...  ratio_mean/min/max (1.0 if none) and clip_frac over the tokens
                       of that source with a clipped surrogate
      tokens/...       how many tokens each of the figures above is over (ints), so that
                       combine_metrics can join micro-batches into the batch's figures
    Each figure is a device sync: a trainer that logs none can leave this function out."""
    config = LossConfig() if config is None else config
    t = token_losses(logp, old_logp, advantages, loss_mask, source, behavior_logp, ref_logp, config)
    rho, trained, inter = t.rho, t.trained, t.inter
    luffy = inter & (config.is_mode == "luffy")
    ratio_tok = trained & ~luffy  # tokens with a clipped surrogate
    clip_hi = (t.adv > 0) & (rho > 1 + config.clip_high)
    clip_lo = (t.adv < 0) & (rho < 1 - config.clip_low)
    clipped = clip_hi | clip_lo
    naive = t.logp - t.beh  # log of the naive ratio pi_theta / mu
    log_lo = math.log(1 - config.clip_low) if config.clip_low < 1 else -math.inf
    outside = (naive < log_lo) | (naive > math.log(1 + config.clip_high))
    lr = (t.logp - t.old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    metrics = {
        "clip_frac": _share(clipped & ratio_tok, trained),
        "ratio_min": _min_over(rho, ratio_tok, 1.0),
        "ratio_mean": _mean_over(rho, ratio_tok, 1.0),
        "ratio_max": _max_over(rho, ratio_tok, 1.0),
        "naive_ratio_out_of_clip": _mean_over(outside.double(), inter, 0.0),
        "weight_mean": _mean_over(t.w, inter, 1.0),
        "weight_max": _max_over(t.w, inter, 1.0),
        "approx_kl": _mean_over(torch.exp(lr) - 1 - lr, trained, 0.0),
        "ref_kl": 0.0 if t.ref_kl is None else _mean_over(t.ref_kl, trained, 0.0),
        "intervened_frac": _share(inter, trained),
    }
    for name, sel in (("policy", ratio_tok & ~inter), ("intervened", ratio_tok & inter)):
        metrics[f"{name}/ratio_mean"] = _mean_over(rho, sel, 1.0)
        metrics[f"{name}/ratio_min"] = _min_over(rho, sel, 1.0)
        metrics[f"{name}/ratio_max"] = _max_over(rho, sel, 1.0)
        metrics[f"{name}/clip_frac"] = _share(clipped & sel, sel)
        metrics[f"tokens/{name}_ratio"] = int(sel.sum())
    metrics["tokens/trained"] = int(trained.sum())
    metrics["tokens/ratio"] = int(ratio_tok.sum())
    metrics["tokens/intervened"] = int(inter.sum())
    return metrics


# the tokens each figure of loss_metrics is taken over: "mean" figures are means (and shares) over
# them, "min" and "max" extremes, and the "tokens/..." counts add up
COMBINED_OVER = {
    "mean": {
        "clip_frac": "tokens/trained",
        "approx_kl": "tokens/trained",
        "ref_kl": "tokens/trained",
        "intervened_frac": "tokens/trained",
        "ratio_mean": "tokens/ratio",
        "naive_ratio_out_of_clip": "tokens/intervened",
        "weight_mean": "tokens/intervened",
        "policy/ratio_mean": "tokens/policy_ratio",
        "policy/clip_frac": "tokens/policy_ratio",
        "intervened/ratio_mean": "tokens/intervened_ratio",
        "intervened/clip_frac": "tokens/intervened_ratio",
    },
    "min": {
        "ratio_min": "tokens/ratio",
        "policy/ratio_min": "tokens/policy_ratio",
        "intervened/ratio_min": "tokens/intervened_ratio",
    },
    "max": {
        "ratio_max": "tokens/ratio",
        "weight_max": "tokens/intervened",
        "policy/ratio_max": "tokens/policy_ratio",
        "intervened/ratio_max": "tokens/intervened_ratio",
    },
}


def combine_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of loss_metrics over several micro-batches as those of one batch: a mean
    weighted by the tokens it is over, an extreme over the parts that have such tokens (a part
    without any holds only its empty default), counts summed; any other figure (a loss) is the
    plain mean of the parts. A figure over tokens no part has keeps its empty default."""
    out = {}
    for key in dict.fromkeys(k for part in parts for k in part):
        have = [part for part in parts if key in part]
        values = [part[key] for part in have]
        kind = next((kind for kind, over in COMBINED_OVER.items() if key in over), None)
        if key.startswith("tokens/"):
            out[key] = sum(values)
        elif kind is None:
            out[key] = sum(values) / len(values)
        else:
            counts = [part[COMBINED_OVER[kind][key]] for part in have]
            counted = [(v, n) for v, n in zip(values, counts) if n > 0]
            if not counted:
                out[key] = values[0]
            elif kind == "mean":
                out[key] = sum(v * n for v, n in counted) / sum(n for _, n in counted)
            else:
                out[key] = (min if kind == "min" else max)(v for v, _ in counted)
    return out


def _mean_over(x: Tensor, sel: Tensor, empty: float) -> float:
    """Mean of x at the positions sel; `empty` when sel selects none."""
    return x[sel].mean().item() if sel.any() else empty


def _min_over(x: Tensor, sel: Tensor, empty: float) -> float:
    """Smallest x at the positions sel; `empty` when sel selects none."""
    return x[sel].min().item() if sel.any() else empty


def _max_over(x: Tensor, sel: Tensor, empty: float) -> float:
    """Largest x at the positions sel; `empty` when sel selects none."""
    return x[sel].max().item() if sel.any() else empty


def _share(hit: Tensor, among: Tensor) -> float:
    """Count of hit over count of among (at least 1)."""
    return hit.sum().item() / max(1, among.sum().item())
