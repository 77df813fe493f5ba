"""The method comparison's figures, the paper's Figures 5, 6 and 7; optional (extras/).

extras/compare.py draws them after its runs, with matplotlib (pip install -r
requirements-plots.txt; without it the report is text only): fig6_training_curves.png and
fig5_correction_ppl.png from the runs' metrics logs, fig7_weighted_ratio.png from one intervened
batch of the warm start.
"""

from __future__ import annotations

import math

import torch

import loss
import rti
import runtime
from extras.compare_report import eval_points, per_step


def pyplot():
    """matplotlib's pyplot on a file backend (ImportError when matplotlib is missing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def percent(rows: list[dict], key: str) -> dict[int, float]:
    """per_step of a rate, in percent."""
    return {k: 100 * v for k, v in per_step(rows, key).items()}


def band(ax, runs: list[dict[int, float]], label: str, style: str = "-", smooth: int = 1) -> None:
    """Mean over runs (seeds) of a `smooth`-step moving average at each step, and their min-max
    spread; a run with no value in a window (the gate dropped nothing then) sits that step out."""
    steps = sorted(set().union(*runs))
    if not steps:
        return
    cols = []
    for i in range(len(steps)):
        window = steps[max(0, i - smooth + 1) : i + 1]
        vals = [[r[t] for t in window if t in r] for r in runs]
        cols.append([sum(v) / len(v) for v in vals if v])
    (line,) = ax.plot(steps, [sum(c) / len(c) for c in cols], style, label=label)
    ax.fill_between(
        steps, [min(c) for c in cols], [max(c) for c in cols], color=line.get_color(), alpha=0.15
    )


def plot_curves(
    logs: dict, out, seeds: list[int], start_p1: float | None = None, split: str = "test"
) -> None:
    """fig6 (the paper's Figure 6): train success and test p@1 against step, GRPO vs RTI, mean over
    seeds with their spread, p@1 on `split` from the warm start's `start_p1` at step 0, and the
    share of RTI's groups that triggered an intervention; fig5 (Figure 5): perplexity of the
    corrections the gate kept vs dropped over training. `logs`: {(method, seed): metrics log}."""
    plt = pyplot()
    fig, (train_ax, test_ax, trigger_ax) = plt.subplots(1, 3, figsize=(14, 3.6))
    for name in ("GRPO", "RTI"):
        runs = [logs[(name, s)] for s in seeds]
        sampled = [percent(r, "train_success") for r in runs]
        band(train_ax, sampled, f"{name} (sampled)", smooth=4)
        if name == "RTI":
            after = [percent(r, "train_success_after_rti") for r in runs]
            band(train_ax, after, "RTI (after intervention)", "--", smooth=4)
            triggered = [percent(r, "rti/trigger_rate") for r in runs]
            band(trigger_ax, triggered, "RTI", smooth=4)
        start = {0: start_p1} if start_p1 is not None else {}
        band(test_ax, [{**start, **per_step(r, "test/p@1")} for r in runs], name, "o-")
    train_ax.set(xlabel="step", ylabel="train success (%)", title="training rollouts (4-step mean)")
    test_ax.set(
        xlabel="step",
        ylabel=f"{split} p@1",
        title=f"{split} split (mean, spread over {len(seeds)} seeds)",
    )
    trigger_ax.set(
        xlabel="step",
        ylabel="groups triggered (%)",
        title="groups with no success: intervened (4-step mean)",
    )
    train_ax.legend()
    test_ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fig6_training_curves.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for key, label in (
        ("rti/ppl_kept_mean", "kept by the gate"),
        ("rti/ppl_dropped_mean", "dropped by the gate"),
    ):
        band(ax, [per_step(logs[("RTI", s)], key) for s in seeds], label, "o-", smooth=4)
    ax.set(
        xlabel="step",
        ylabel="PPL (agent tokens)",
        title="corrections: gate decisions (RTI, 4-step mean)",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fig5_correction_ppl.png", dpi=120)
    plt.close(fig)


def plot_compute(logs: dict, out, seeds: list[int], methods, split: str = "test") -> None:
    """fig8: test p@1 against the compute spent: sampled episodes (RTI's continuations and a
    teacher's included), tokens generated (by the policy or a teacher), and training minutes; one
    line per run, a colour per method, so that RTI's extra work per step is visible. `logs`:
    {(method, seed): metrics log}."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    labels = ("sampled episodes", "generated tokens", "training minutes")
    for k, name in enumerate(methods):
        colour = f"C{k}"
        for s in seeds:
            points = eval_points(logs[(name, s)])
            for field, ax in zip(("episodes", "tokens", "minutes"), axes):
                xs = [getattr(p, field) for p in points]
                ax.plot(
                    xs,
                    [p.p1 for p in points],
                    "o-",
                    color=colour,
                    ms=3,
                    lw=1,
                    label=name if s == seeds[0] else None,
                )
    for ax, label in zip(axes, labels):
        ax.set(xlabel=label, ylabel=f"{split} p@1")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"p@1 against compute, one line per run ({len(seeds)} seeds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "fig8_compute.png", dpi=120)
    plt.close(fig)


def plot_heatmap(policy, trajs: list, png) -> None:
    """fig7 (the paper's Figure 7): the calibrated weighted ratio rho_t * w_t on the agent tokens
    of one intervened trajectory of `trajs` (compare.warm_batch's) as a second mini-batch would see
    it (`--mini-batches 2`): pi_old scored, then one AdamW step of `policy` on the rest of its
    batch, then rho_t = pi / pi_old. Beside it, the naive ratio pi_old / mu on the intervened
    tokens."""
    plt = pyplot()
    from matplotlib.colors import TwoSlopeNorm

    model = policy.model
    tok = policy.tok
    cfg = runtime.make_config(rti.Config, mini_batches=1)  # one update: the first of the two steps
    j = next(
        (j for j, t in enumerate(trajs) if t.intervention and loss.INTERVENED in t.source), None
    )
    if j is None:
        print("fig7 not drawn: the batch has no intervened trajectory")
        return
    traj = trajs[j]
    old = torch.tensor(policy.score([traj.ids]))
    adv = loss.advantages_by_group(
        torch.tensor([t.reward for t in trajs]), [t.group for t in trajs]
    )
    rest = [k for k in range(len(trajs)) if k != j and adv[k] != 0]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    rti.update(policy, opt, [trajs[k] for k in rest], adv[rest], cfg)
    rho = torch.exp(torch.tensor(policy.score([traj.ids])) - old)[0]
    beh = torch.tensor([traj.sample_logp])
    src = torch.tensor([traj.source])
    mask = torch.tensor([traj.loss_mask])
    w = loss.token_weights(beh, old, (src == loss.INTERVENED) & (mask > 0))[0]
    naive = torch.exp(old - beh)[0]
    naive_on_intervened = torch.where(src[0] == loss.INTERVENED, naive, torch.ones_like(naive))
    idx = [i for i, m in enumerate(traj.loss_mask) if m][:96]
    words = tok.convert_ids_to_tokens([traj.ids[i] for i in idx])
    cols = 12
    n_rows = math.ceil(len(idx) / cols)
    fig, axes = plt.subplots(2, 1, figsize=(cols * 0.9, n_rows * 0.9 + 1.5))
    panels = [
        (rho * w, "weighted ratio rho*w at a second mini-batch step (rho = pi / pi_old)"),
        (naive_on_intervened, "naive ratio pi_old / mu (intervened tokens)"),
    ]
    for ax, (vals, title) in zip(axes, panels):
        grid = torch.full((n_rows, cols), float("nan"))
        for k, i in enumerate(idx):
            grid[k // cols, k % cols] = vals[i]
        # white at ratio 1
        norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=max(2.0, float(vals[idx].max())))
        im = ax.imshow(grid.numpy(), cmap="coolwarm", norm=norm)
        for k, i in enumerate(idx):
            mark = "*" if traj.source[i] == loss.INTERVENED else ""
            word = mark + words[k].replace("<|im_end|>", "eos")
            ax.text(k % cols, k // cols, word, ha="center", va="center", fontsize=6)
        ax.set_title(title, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
        fig.colorbar(im, ax=ax, fraction=0.02)
    fig.suptitle(
        f"agent tokens of one corrected trajectory (* = intervened); policy-token rho in "
        f"[{float(rho[idx].min()):.3f}, {float(rho[idx].max()):.3f}]",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
