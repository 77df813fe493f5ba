"""AEPO (Agentic Entropy-Balanced Policy Optimization; Dong et al., 2025) as a baseline of the
comparison, the parts that apply to a multi-turn tool environment; optional (extras/).

    python -m extras.aepo                               # rti.py's loop with AEPO's rollout and loss
    python -m extras.aepo --aepo-entropy-advantage 0    # any rti.py flag too; 0 turns a part off

Entropy-balanced rollout (`AEPO.rollout`): each task's --group-size episodes are global samples
(from the first message) and branches (the prefix of a global sample up to a tool step, then
sampled anew from there). Every turn after the first answers a tool result, so every later turn
is a tool step. H(turn) is the mean entropy of the distributions its tokens were sampled from
(`token_entropies`, at the sampling temperature).
  1. entropy pre-monitoring: the task's first global sample gives H_root, its first turn's
     entropy, and H_tool, the mean over its later turns; the task gets
     m = round(G sigmoid(beta (H_root - H_tool))) global samples, 1 <= m <= G (`global_samples`)
     and G - m branches.
  2. branching at tool steps, with a penalty on consecutive high-entropy branching: walking the
     global samples turn by turn, as an online lockstep rollout would, turn k of sample i is a
     branch point while branches are left iff
         P = (alpha + gamma (H_k - H_root,i)) (1 - min(1, lambda l)) > tau
     with l the branches sample i took at the turns just before k (`branch_points`). Branch
     budget left over goes to more global samples.
  Every episode samples on stream episode_seed(seed, task, j), j its place in the group, and the
  branch points are a function of the global samples alone: the batch is reproducible from its
  seed, and a task's group does not depend on the other tasks of the batch.

Entropy-balanced update:
  3. entropy-aware advantages (`entropy_advantages`): A_t = A_i (1 + a z_t), A_i the group's
     z-score of the reward, z_t the z-score of token t's entropy among the group's agent tokens
     (our reading: the high-entropy tokens of a trajectory that taught something weigh more).
  4. stop-gradient on the high-entropy clip term (`aepo_token_losses`): a token clipped above
     (A > 0, rho > 1 + clip_high; the rising, low-probability, high-entropy ones) keeps the
     clipped value (1 + clip_high) A but its gradient too, rescaled: the term is
     (1 + clip_high) rho / sg(rho) A, gradient (1 + clip_high) A grad log pi, where PPO's is 0.

Left out: branches of branches (one level of the tree: the budget is G per task, and a tiny
Navigation group of 8 leaves little room for a deeper one); ARPO's branching within a turn's
tokens (a turn is a few tokens here); the paper's own hyper-parameters for web agents (ours are
the defaults below, for this toy). The formulas of 2 and 3 are our reading of the paper's text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

import intervene
import rti
import runtime
from loss import LossConfig, aggregate, loss_metrics, require, token_losses
from policy import pad_rows

PROG = "-m extras.aepo"


@dataclass
class AEPOConfig(rti.Config):
    """rti.Config plus AEPO's rollout and update settings (our choices for the toy)."""

    FLAG_GROUP = "AEPO"
    method: str = field(
        default="aepo",
        metadata={
            "help": "aepo: GRPO with AEPO's entropy-balanced rollout and update",
            "choices": ("aepo",),
        },
    )
    aepo_beta: float = field(
        default=1.0,
        metadata={
            "help": "pre-monitoring: beta of m = G sigmoid(beta (H_root - H_tool)) global samples"
        },
    )
    aepo_branch_base: float = field(
        default=0.5, metadata={"help": "branching: alpha, the base of the branch score P"}
    )
    aepo_branch_entropy: float = field(
        default=1.0,
        metadata={"help": "branching: gamma, the weight of the entropy rise H_k - H_root in P"},
    )
    aepo_branch_threshold: float = field(
        default=0.5, metadata={"help": "branching: tau, a tool step is branched at iff P > tau"}
    )
    aepo_branch_penalty: float = field(
        default=0.5,
        metadata={
            "help": "branching: lambda, P is scaled by 1 - min(1, lambda l) after l consecutive "
            "branches of the same sample (0: no penalty)"
        },
    )
    aepo_entropy_advantage: float = field(
        default=0.3,
        metadata={"help": "a of the entropy-aware advantage A_t = A (1 + a z(H_t)); 0 = off"},
    )
    aepo_keep_clipped_gradient: bool = field(
        default=True,
        metadata={
            "help": "stop-gradient on the clip term above: tokens clipped at 1 + clip_high keep "
            "a rescaled gradient (off: PPO's clip)"
        },
    )

    def validate(self) -> None:
        super().validate()
        require(self, "aepo_beta", self.aepo_beta >= 0, "must be >= 0")
        require(self, "aepo_branch_penalty", self.aepo_branch_penalty >= 0, "must be >= 0")
        a = self.aepo_entropy_advantage
        require(self, "aepo_entropy_advantage", 0 <= a < math.inf, "must be finite and >= 0")
        for name in ("aepo_branch_base", "aepo_branch_entropy", "aepo_branch_threshold"):
            require(self, name, math.isfinite(getattr(self, name)), "must be finite")


# ----------------------------------------------------------------------------- entropies


@torch.no_grad()
def token_entropies(policy, seqs: list[list[int]]) -> list[list[float]]:
    """H_t of the distribution each token was sampled from, at the sampling temperature (0.0 for
    the first token; Sampler.score's alignment):
        H_t = -sum_v p_v log p_v,  p = softmax(z_{t-1} / T)
    From the full logits, B x T x V: the toy's vocabulary is small (a large one would want
    policy.py's chunked scoring)."""
    out = []
    for i in range(0, len(seqs), policy.micro_batch):
        batch = seqs[i : i + policy.micro_batch]
        ids = pad_rows(batch, policy.tok.pad_token_id, torch.long, policy.device)
        logits = policy.model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        logp = torch.log_softmax(logits / policy.temperature, -1)
        h = torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0))
        out += [h[j, : len(s)].tolist() for j, s in enumerate(batch)]
    return out


def turn_entropies(traj: rti.Trajectory, entropies: list[float]) -> list[float]:
    """H of each agent turn: the mean of its trained tokens' entropies (0.0 for a turn with none)."""
    out = []
    for start, end in traj.turns:
        h = [entropies[t] for t in range(start, end) if traj.loss_mask[t]]
        out.append(float(np.mean(h)) if h else 0.0)
    return out


# ----------------------------------------------------------------------------- the rollout


def global_samples(turn_h: list[float], group_size: int, beta: float) -> int:
    """Entropy pre-monitoring: m = round(G sigmoid(beta (H_root - H_tool))), 1 <= m <= G, from the
    turn entropies of one episode: H_root its first turn's, H_tool the mean of the others' (H_root
    when there are none). Example: H [1.0, 0.5, 0.3], G 8, beta 1: sigmoid(0.6) = .646 -> m 5."""
    h_root = turn_h[0]
    h_tool = float(np.mean(turn_h[1:])) if len(turn_h) > 1 else h_root
    m = round(group_size / (1 + math.exp(-beta * (h_root - h_tool))))
    return min(group_size, max(1, m))


def branch_score(rise: float, streak: int, cfg: AEPOConfig) -> float:
    """P = (alpha + gamma rise) (1 - min(1, lambda streak)): the branch score of a tool step whose
    entropy is `rise` above its sample's first turn, after `streak` consecutive branches."""
    penalty = min(1.0, cfg.aepo_branch_penalty * streak)
    return (cfg.aepo_branch_base + cfg.aepo_branch_entropy * rise) * (1 - penalty)


def branch_points(turn_h: list[list[float]], budget: int, cfg: AEPOConfig) -> list[tuple]:
    """(sample, turn) pairs to branch at, at most `budget`, from the turn entropies of a task's
    global samples: turn by turn (k = 1, 2, ...; every sample's turn k before any turn k + 1, as
    an online lockstep rollout meets them), turn k of sample i is taken iff
    branch_score(H_k - H_0, l_i) > tau, l_i the branches sample i took at the turns just before."""
    chosen = []
    streak = [0] * len(turn_h)
    for k in range(1, max(map(len, turn_h), default=0)):
        for i, h in enumerate(turn_h):
            if len(chosen) == budget:
                return chosen
            if k >= len(h):
                continue
            if branch_score(h[k] - h[0], streak[i], cfg) > cfg.aepo_branch_threshold:
                chosen.append((i, k))
                streak[i] += 1
            else:
                streak[i] = 0
    return chosen


def branch(policy, parent: rti.Trajectory, k: int, seed: int) -> tuple:
    """(episode, env) of a branch: `parent` before its turn k, its env replayed to that state,
    to go on on stream `seed`."""
    traj = parent.truncated(k)
    traj.seed = seed
    env = policy.make_env(parent.task)
    env.reset()
    for action in parent.actions[:k]:
        env.step(action)
    return traj, env


def play(policy, starts: list[tuple]) -> list[rti.Trajectory]:
    """Play (episode, env) pairs to their end in lockstep (intervene.play), each on its stream."""
    trajs = [traj for traj, _ in starts]
    streams = [intervene.Stream(t.seed) for t in trajs]
    intervene.play(policy, trajs, [env for _, env in starts], streams)
    return trajs


class AEPO(rti.Method):
    """AEPO's entropy-balanced rollout, advantages and loss."""

    def __init__(self):
        self.counts = {"aepo/global_samples": 0, "aepo/branches": 0}

    def rollout(self, policy, tasks, cfg: AEPOConfig, seed):
        """The module docstring's steps 1 and 2: G episodes of each task, groups in task order,
        global samples first, then branches, then the global samples of leftover budget."""
        policy.model.eval()
        if seed is None:
            seed = int(torch.randint(2**62, (1,), generator=policy.gen, device=policy.gen.device))
        group_size = cfg.group_size

        def start(g: int, j: int) -> tuple:  # global sample j of task g
            return rti.start_episode(
                policy, tasks[g], g, rti.episode_seed(seed, tasks[g].task_id, j)
            )

        def entropies(trajs) -> list[list[float]]:
            per_token = token_entropies(policy, [t.ids for t in trajs])
            return [turn_entropies(t, h) for t, h in zip(trajs, per_token)]

        first = play(policy, [start(g, 0) for g in range(len(tasks))])
        first_h = entropies(first)
        m = [global_samples(h, group_size, cfg.aepo_beta) for h in first_h]
        more = play(policy, [start(g, j) for g in range(len(tasks)) for j in range(1, m[g])])
        more_h = entropies(more)
        globals_of = [[first[g]] for g in range(len(tasks))]
        turn_h = [[first_h[g]] for g in range(len(tasks))]
        for t, h in zip(more, more_h):
            globals_of[t.group].append(t)
            turn_h[t.group].append(h)
        rest = []  # branches, then leftover global samples, task by task
        for g, task in enumerate(tasks):
            points = branch_points(turn_h[g], group_size - m[g], cfg)
            for j, (i, k) in enumerate(points, start=m[g]):
                seed_j = rti.episode_seed(seed, task.task_id, j)
                rest.append(branch(policy, globals_of[g][i], k, seed_j))
            rest += [start(g, j) for j in range(m[g] + len(points), group_size)]
            self.counts["aepo/global_samples"] += group_size - len(points)
            self.counts["aepo/branches"] += len(points)
        rest = play(policy, rest)
        groups = [globals_of[g] + [t for t in rest if t.group == g] for g in range(len(tasks))]
        return [t for group in groups for t in group]

    def advantages(self, policy, trajs, cfg: AEPOConfig) -> torch.Tensor:
        """Step 3: GRPO's group advantages made per token by the entropy's z-scores."""
        row = super().advantages(policy, trajs, cfg)
        if cfg.aepo_entropy_advantage == 0:
            return row
        entropies = token_entropies(policy, [t.ids for t in trajs])
        return entropy_advantages(
            row, entropies, [t.loss_mask for t in trajs], [t.group for t in trajs], cfg
        )

    def loss(self, inputs: dict, cfg: AEPOConfig) -> tuple[torch.Tensor, dict]:
        """Step 4: the clipped surrogate, tokens clipped above keeping a gradient."""
        if not cfg.aepo_keep_clipped_gradient:
            return super().loss(inputs, cfg)
        return aepo_loss(**inputs), loss_metrics(**inputs)

    def metrics(self) -> dict:
        counts, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        return counts


# ----------------------------------------------------------------------------- the update


def entropy_advantages(
    row_advantages: torch.Tensor,
    entropies: list[list[float]],
    loss_mask: list[list[int]],
    group_ids: list,
    cfg: AEPOConfig,
    eps: float = 1e-6,
) -> torch.Tensor:
    """[N, T] entropy-aware advantages, T the longest row: A_t = A_i (1 + a z_t) on agent tokens,
    z_t = (H_t - mean_g H) / (std_g H + eps) over the agent tokens of row i's group g (unbiased
    std; 0 for a group of one token), 0 elsewhere. Example, one group, A [1, -1], agent-token
    entropies [[1, 3], [2]], a .5: mean 2, std 1, z [[-1, 1], [0]] -> [[.5, 1.5], [-1]]."""
    h = pad_rows(entropies, 0.0, torch.float32, "cpu")
    mask = pad_rows(loss_mask, 0, torch.float32, "cpu") > 0
    z = torch.zeros_like(h)
    for rows in rti.group_rows(group_ids).values():
        sel = torch.zeros_like(mask)
        sel[rows] = mask[rows]
        values = h[sel]
        if values.numel() > 1:
            z[sel] = (values - values.mean()) / (values.std() + eps)
    a = row_advantages.to(torch.float32)[:, None]
    return torch.where(mask, a * (1 + cfg.aepo_entropy_advantage * z), 0.0)


def aepo_token_losses(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    source: torch.Tensor | None = None,
    behavior_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    config: LossConfig | None = None,
) -> torch.Tensor:
    """[B, T] per-token losses: loss.token_losses', except on the tokens clipped above (trained,
    A_t > 0, rho_t > 1 + clip_high, not a luffy token), where the term is
        -w_t (1 + clip_high) rho_t / sg(rho_t) A_t
    the same value, and the gradient -w_t (1 + clip_high) A_t grad log pi_t instead of 0 (a
    sequence-level rho's gradient is rho grad log pi_t too). Example: A 1, rho 1.5, clip_high .28:
    loss -1.28 either way, d loss / d log pi -1.28 (PPO: 0)."""
    config = LossConfig() if config is None else config
    t = token_losses(logp, old_logp, advantages, loss_mask, source, behavior_logp, ref_logp, config)
    luffy = t.inter & (config.is_mode == "luffy")
    above = t.trained & ~luffy & (t.adv > 0) & (t.rho.detach() > 1 + config.clip_high)
    kept = -t.w * (1 + config.clip_high) * (t.rho / t.rho.detach()) * t.adv
    return torch.where(above, kept, t.loss)


def aepo_loss(**inputs) -> torch.Tensor:
    """The scalar of aepo_token_losses (loss.policy_loss's inputs), aggregated as policy_loss."""
    config = inputs.get("config") or LossConfig()
    terms = aepo_token_losses(**inputs)
    return aggregate(terms, inputs["loss_mask"] != 0, config.agg, config.max_len)


# the config class of this command and the defaults it sets on rti.py's (none: its config's);
# extras.compare checks a run's flags with them
CONFIG = AEPOConfig
SETTINGS = None


def build_parser():
    return runtime.build_parser(CONFIG, prog=PROG, defaults=SETTINGS)


def main(argv=None) -> None:
    rti.main(argv, CONFIG, AEPO, PROG, defaults=SETTINGS)


if __name__ == "__main__":
    main()
