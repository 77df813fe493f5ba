"""The paper's other baselines (extras/gspo.py, aepo.py, luffy.py, opd.py, teacher.py): their loss
terms against hand values and plain loops, LUFFY's mixing, AEPO's branching, one training step
each."""

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import envs
import rti
import runtime
from extras import aepo, compare, gspo, luffy, opd, teacher
from loss import INTERVENED, POLICY, LossConfig, policy_loss, token_losses
from policy import Sampler, load_model

ROOT = Path(__file__).resolve().parent.parent
HAS_TEACHER = (ROOT / teacher.TEACHER_DIR / "config.json").is_file()
# two small grids with few turns, which the warm start solves in 5 of 8 and 1 of 8 samples: its
# groups have a reward spread, and an untrained model's episodes end soon too
TASKS = [
    envs.NavTask("e", 3, 3, walls=[], start=[0, 0], waypoints=[[2, 2], [0, 2]], max_turns=7),
    envs.NavTask("f", 3, 3, walls=[[0, 1]], start=[0, 0], waypoints=[[0, 2]], max_turns=7),
]


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("tiny", seed=0)


def leaf(rows):
    return torch.tensor(rows, dtype=torch.float64, requires_grad=True)


# ----------------------------------------------------------------------------- OPD


def test_opd_advantages_hand_values_and_plain_loop():
    adv = opd.opd_advantages([[0, -0.1, -2]], [[0, -0.5, -1]], [[0, 1, 1]])
    assert adv[0].tolist() == pytest.approx([0, 0.4, -1])
    # rows of different lengths: padded with 0, agent tokens only
    teacher_logp = [[0.0, -0.3, -1.2, -0.1], [0.0, -2.0]]
    sample_logp = [[0.0, -0.9, -0.2, -0.4], [0.0, -0.5]]
    mask = [[0, 1, 0, 1], [0, 1]]
    adv = opd.opd_advantages(teacher_logp, sample_logp, mask)
    expected = torch.zeros(2, 4)
    for i, row in enumerate(mask):
        for j, m in enumerate(row):
            if m:
                expected[i, j] = teacher_logp[i][j] - sample_logp[i][j]
    assert torch.allclose(adv, expected)


def test_opd_gradient_is_the_reverse_kl_gradient():
    """The policy-gradient form is exact in expectation: summing each token's PG-loss gradient,
    weighted by the student's probability of sampling it, gives grad KL(pi || teacher), the
    reverse KL over the whole vocabulary (one position, 5 tokens)."""
    torch.manual_seed(0)
    logits = torch.randn(5, dtype=torch.float64, requires_grad=True)
    teacher_logp = torch.log_softmax(torch.randn(5, dtype=torch.float64), -1)
    logp_all = torch.log_softmax(logits, -1)
    expected = torch.autograd.grad((logp_all.exp() * (logp_all - teacher_logp)).sum(), logits)[0]
    total = torch.zeros(5, dtype=torch.float64)
    for y in range(5):
        logp_y = torch.log_softmax(logits, -1)[y].reshape(1, 1)
        old = logp_y.detach()
        adv = opd.opd_advantages([[teacher_logp[y].item()]], [[old.item()]], [[1]])
        loss = policy_loss(logp_y, old, adv.double(), torch.ones(1, 1))
        total += logp_all[y].exp().detach() * torch.autograd.grad(loss, logits)[0]
    assert torch.allclose(total, expected, atol=1e-12)


# ----------------------------------------------------------------------------- AEPO: the update


def test_aepo_keeps_a_rescaled_gradient_on_tokens_clipped_above():
    """Tokens [A > 0 rho 1.5 (clipped above), A > 0 rho 1.1, A < 0 rho 0.5 (clipped below)]: the
    values are PPO's; the first token's gradient is -(1 + clip_high) A / n instead of 0; the
    others' are PPO's."""
    old = torch.zeros(1, 3, dtype=torch.float64)
    rho = [1.5, 1.1, 0.5]
    adv = torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3)
    cfg = LossConfig()
    lp_aepo, lp_ppo = leaf([[math.log(r) for r in rho]]), leaf([[math.log(r) for r in rho]])
    aepo_loss = aepo.aepo_loss(logp=lp_aepo, old_logp=old, advantages=adv, loss_mask=mask)
    ppo_loss = policy_loss(lp_ppo, old, adv, mask, config=cfg)
    assert aepo_loss.item() == pytest.approx(ppo_loss.item())
    assert aepo_loss.item() == pytest.approx(-(1.28 + 1.1 - 0.8) / 3)
    aepo_loss.backward()
    ppo_loss.backward()
    assert lp_aepo.grad[0].tolist() == pytest.approx([-1.28 / 3, -1.1 / 3, 0.0])
    assert lp_ppo.grad[0].tolist() == pytest.approx([0.0, -1.1 / 3, 0.0])


def test_aepo_token_losses_match_a_plain_loop():
    torch.manual_seed(1)
    logp = leaf(torch.randn(3, 5).mul(0.5).sub(1).tolist())
    old = (logp.detach() + torch.randn(3, 5, dtype=torch.float64) * 0.4).clamp(max=0)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    source = torch.tensor([[0, 1, 0, 1, 0], [0, 0, 0, 1, 0], [1, 0, 0, 0, 0]])
    beh = old - 0.3
    cfg = LossConfig(clip_high=0.1)
    terms = aepo.aepo_token_losses(logp, old, adv, mask, source, beh, config=cfg)
    w = token_losses(logp, old, adv, mask, source, beh, config=cfg).w
    terms.sum().backward()
    for i in range(3):
        for j in range(5):
            x = logp.detach()[i, j].clone().requires_grad_(True)
            if not mask[i, j]:  # not trained: aggregate leaves it out, no gradient reaches it
                assert logp.grad[i, j].item() == 0.0
                continue
            rho = torch.exp(x - old[i, j])
            a = adv[i]
            if a > 0 and rho > 1 + cfg.clip_high:
                term = -w[i, j] * (1 + cfg.clip_high) * rho / rho.detach() * a
            else:
                term = -w[i, j] * torch.minimum(rho * a, rho.clamp(0.8, 1.1) * a)
            (grad,) = torch.autograd.grad(term, x)
            assert terms[i, j].item() == pytest.approx(term.item())
            assert logp.grad[i, j].item() == pytest.approx(grad.item())


def test_entropy_advantages_hand_values_and_plain_loop():
    cfg = runtime.make_config(aepo.AEPOConfig, aepo_entropy_advantage=0.5)
    out = aepo.entropy_advantages(
        torch.tensor([1.0, -1.0]), [[0, 1, 3], [0, 2]], [[0, 1, 1], [0, 1]], [0, 0], cfg, eps=0
    )
    assert out.flatten().tolist() == pytest.approx([0, 0.5, 1.5, 0, -1, 0])
    # two groups, a row of another group between: z-scores within each group's agent tokens
    h = [[0.0, 0.3, 0.9, 0.1], [0.0, 1.2], [0.0, 0.5, 0.7, 0.2]]
    mask = [[0, 1, 1, 1], [0, 1], [0, 1, 0, 1]]
    row = torch.tensor([0.8, -2.0, -0.6])
    out = aepo.entropy_advantages(row, h, mask, [0, 1, 0], cfg)
    group0 = [h[i][j] for i in (0, 2) for j in range(len(h[i])) if mask[i][j]]
    mean = sum(group0) / len(group0)
    std = math.sqrt(sum((v - mean) ** 2 for v in group0) / (len(group0) - 1))
    for i in (0, 2):
        for j in range(4):
            z = (h[i][j] - mean) / (std + 1e-6)
            want = row[i].item() * (1 + 0.5 * z) if mask[i][j] else 0.0
            assert out[i, j].item() == pytest.approx(want, abs=1e-6)
    # a group with one agent token: z 0, the row's advantage
    assert out[1].tolist() == pytest.approx([0.0, -2.0, 0.0, 0.0])


def test_token_entropies_match_each_prefix_alone(tiny):
    model, tok = tiny
    policy = Sampler(model, tok, temperature=0.7, micro_batch=2)
    seqs = [[3, 10, 11, 12], [3, 20], [3, 7, 8]]
    out = aepo.token_entropies(policy, seqs)
    for seq, h in zip(seqs, out):
        assert len(h) == len(seq) and h[0] == 0.0
        for t in range(1, len(seq)):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([seq[:t]])).logits[0, -1] / 0.7
            p = torch.softmax(logits.double(), -1)
            assert h[t] == pytest.approx(-(p * p.log()).sum().item(), rel=1e-4)


# ----------------------------------------------------------------------------- AEPO: the rollout


def test_global_samples_from_pre_monitoring():
    assert aepo.global_samples([1.0, 0.5, 0.3], 8, 1.0) == 5  # sigmoid(.6) = .646
    assert aepo.global_samples([1.0], 8, 1.0) == 4  # no tool step: sigmoid(0)
    assert aepo.global_samples([0.0, 9.0], 8, 5.0) == 1  # at least one
    assert aepo.global_samples([9.0, 0.0], 8, 5.0) == 8


def test_branch_points_walk_turn_by_turn_and_penalise_consecutive_branches():
    cfg = runtime.make_config(aepo.AEPOConfig)  # alpha .5, gamma 1, tau .5, lambda .5
    h = [[1.0, 1.2, 1.3, 1.0], [1.0, 0.9, 1.6]]
    # turn 1: sample 0 rises .2 (P .7), sample 1 falls (P .4); turn 2: sample 0 rises .3 after a
    # branch (P .8 x .5), sample 1 rises .6 (P 1.1); turn 3: sample 0 rises 0 (P .5, not > .5)
    assert aepo.branch_points(h, 5, cfg) == [(0, 1), (1, 2)]
    assert aepo.branch_points(h, 1, cfg) == [(0, 1)]
    assert aepo.branch_points(h, 0, cfg) == []
    # three high-entropy tool steps in a row: the third is out (P x (1 - min(1, 2 x .5)) = 0)
    assert aepo.branch_points([[0.0, 1.0, 1.0, 1.0]], 5, cfg) == [(0, 1), (0, 2)]
    no_penalty = runtime.make_config(aepo.AEPOConfig, aepo_branch_penalty=0.0)
    assert aepo.branch_points([[0.0, 1.0, 1.0, 1.0]], 5, no_penalty) == [(0, 1), (0, 2), (0, 3)]


def aepo_rollout(tiny, tasks, seed=7):
    model, tok = tiny
    policy = Sampler(model, tok, seed=0)
    cfg = runtime.make_config(aepo.AEPOConfig, group_size=4, aepo_branch_threshold=0.45)
    method = aepo.AEPO()
    trajs = method.rollout(policy, tasks, cfg, seed)
    return trajs, method.metrics()


def test_aepo_rollout_keeps_groups_and_is_reproducible_from_its_seed(tiny):
    tasks = TASKS
    trajs, counts = aepo_rollout(tiny, tasks)
    assert [t.group for t in trajs] == [0] * 4 + [1] * 4
    assert counts["aepo/branches"] > 0 and counts["aepo/global_samples"] + counts[
        "aepo/branches"
    ] == len(trajs)
    # a branch is a global sample of its group up to a tool step (turn >= 1), then its own
    sharing = [
        t
        for t in trajs
        if len(t.turns) > 1
        and any(u is not t and u.ids[: t.turns[1][0]] == t.ids[: t.turns[1][0]] for u in trajs)
    ]
    assert len(sharing) >= counts["aepo/branches"]
    # the same seed gives the same episodes, and a task's group does not depend on the other
    # tasks of its batch
    alone, _ = aepo_rollout(tiny, tasks[1:])
    assert [t.ids for t in alone] == [t.ids for t in trajs[4:]]
    other, _ = aepo_rollout(tiny, tasks, seed=8)
    assert [t.ids for t in other] != [t.ids for t in trajs]


# ----------------------------------------------------------------------------- LUFFY


def episode(group, reward, sources=(POLICY,), logp=-0.5):
    """A short episode: prompt tokens (untrained), agent tokens, an observation (untrained)."""
    t = rti.Trajectory(task=None, group=group, reward=reward)
    t.add([1, 2], 0, POLICY)
    t.add([3, 4], 1, sources[0], [logp, logp])
    t.add([5], 0, POLICY)
    return t


def test_luffy_mixing_keeps_group_sizes_and_marks_teacher_tokens():
    student = [episode(g, r) for g, r in ((0, 0), (0, 0), (0, 1), (1, 0), (1, 0), (1, 0))]
    demos = [episode(0, 0, logp=-0.1), episode(0, 1, logp=-0.2), episode(1, 0), episode(2, 1)]
    mixed = luffy.mix_teacher(student, demos)
    assert [t.group for t in mixed] == [0, 0, 0, 1, 1, 1]  # sizes and order kept
    assert mixed[:2] == student[:2] and mixed[3:] == student[3:]  # group 1: no success
    demo = mixed[2]
    assert demo is demos[1] and demo.reward == 1 and demo.intervention == {"teacher": True}
    assert demo.source == [POLICY, POLICY, INTERVENED, INTERVENED, POLICY]
    assert demo.sample_logp[2:4] == [-0.2, -0.2]  # the teacher's log-probs: behaviour's
    assert all(s == POLICY for t in student for s in t.source)


# ----------------------------------------------------------------------------- one step each


def small(cls, tmp_path, **kw):
    base = dict(
        train_split="easy",
        batch_tasks=2,
        group_size=4,
        steps=1,
        eval_tasks=0,
        progress=False,
        out=str(tmp_path / "run"),
        save_every=1,
    )
    return runtime.make_config(cls, **{**base, **kw})


def one_step(cfg, method):
    """train_step of `method` on the first two easy tasks: (metrics, whether the weights moved)."""
    cfg.validate()
    policy = rti.init_policy(cfg, rti.Backend())
    before = copy.deepcopy(policy.model.state_dict())
    opt = torch.optim.AdamW(policy.model.parameters(), lr=cfg.lr)
    metrics = rti.train_step(policy, opt, TASKS, cfg, 3, method=method)
    moved = any(not torch.equal(before[k], v) for k, v in policy.model.state_dict().items())
    return metrics, moved


def test_gspo_one_step(tmp_path):
    cfg = small(rti.Config, tmp_path, **gspo.SETTINGS)
    metrics, moved = one_step(cfg, rti.Method())
    assert cfg.loss.ratio_level == "sequence" and cfg.loss.clip_high == 4e-3
    assert metrics["trained_rows"] > 0 and moved


def test_aepo_one_step(tmp_path):
    cfg = small(aepo.AEPOConfig, tmp_path, aepo_branch_threshold=0.45, mini_batches=2)
    metrics, moved = one_step(cfg, aepo.AEPO())
    assert metrics["sampled_episodes"] == 8 and metrics["aepo/branches"] > 0
    # the second mini-batch clips some tokens, which keep a gradient
    assert metrics["trained_rows"] > 0 and metrics["clip_frac"] > 0 and moved


@pytest.mark.skipif(not HAS_TEACHER, reason="no checkpoints/teacher: python -m extras.teacher")
def test_opd_one_step_learns_from_every_token(tmp_path):
    cfg = small(opd.OPDConfig, tmp_path)
    metrics, moved = one_step(cfg, opd.OPD())
    assert metrics["trained_rows"] == 8 and moved
    assert metrics["teacher/scored_tokens"] > 0


@pytest.mark.skipif(not HAS_TEACHER, reason="no checkpoints/teacher: python -m extras.teacher")
def test_luffy_one_step_mixes_the_teachers_successes(tmp_path):
    cfg = small(luffy.LuffyConfig, tmp_path, **luffy.SETTINGS)
    metrics, moved = one_step(cfg, luffy.Luffy())
    assert metrics["teacher/episodes"] == 2 * cfg.luffy_teacher_tries
    assert metrics["teacher/generated_tokens"] > 0 and metrics["sampled_episodes"] == 8
    # the teacher's tokens are trained, with LUFFY's shaping (no ratio, no clip)
    assert metrics["tokens/intervened"] > 0 and metrics["intervened/ratio_mean"] == 1.0 and moved


@pytest.mark.skipif(not HAS_TEACHER, reason="no checkpoints/teacher: python -m extras.teacher")
def test_the_keys_teacher_fits_the_keys_warm_start_and_solves_the_family_by_its_tool(tmp_path):
    """checkpoints/teacher-keys (built on navigation-keys' own fit, --ws-env-tasks) has the keys
    warm start's tokenizer, so LUFFY and OPD take it there, and it solves keys tasks by calling
    `find key`, which the warm start never does on its own."""
    keys_dirs = {"teacher": "checkpoints/teacher-keys", "init": "checkpoints/warmstart-keys-tool"}
    cfg = small(opd.OPDConfig, tmp_path, env="navigation-keys", train_split="fit", **keys_dirs)
    cfg.validate()
    built = json.loads((ROOT / cfg.teacher / "warmstart.json").read_text())["config"]
    assert built["ws_env_tasks"] and built["env"] == "navigation-keys"
    policy = rti.init_policy(cfg, rti.Backend())
    tasks = [t for t in envs.env_tasks("navigation-keys", "val") if t.family == "keys"][:3]
    with torch.no_grad():
        taught = rti.rollout(teacher.load_teacher(cfg, policy), tasks, 2, seed=0)
        own = rti.rollout(policy, tasks, 2, seed=0)
    assert sum(t.reward for t in taught) >= 4
    assert all("find key" in t.actions for t in taught if t.reward)
    assert not any("find key" in t.actions for t in own)


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path):
    other = tmp_path / "other"
    model, tok = load_model("tiny", env="navigation-keys")
    model.save_pretrained(other)
    tok.save_pretrained(other)
    with pytest.raises(ValueError, match="--teacher: its tokenizer is not the policy's"):
        small(opd.OPDConfig, tmp_path, teacher=str(other)).validate()


@pytest.mark.slow
def test_quick_comparison_of_the_baselines(tmp_path):
    """`python -m extras.compare --quick --methods GSPO AEPO LUFFY OPD` runs each baseline's own
    command, writes their table, and the teacher-guided runs log the teacher's compute."""
    methods = ["GSPO", "AEPO", "LUFFY", "OPD"]
    command = ["-m", "extras.compare", "--quick", "--seeds", "0", "--methods", *methods]
    subprocess.run([sys.executable, *command, "--out", str(tmp_path)], cwd=ROOT, check=True)
    md = (tmp_path / "compare.md").read_text()
    assert all(f"| {name} |" in md for name in methods)
    for name, key in (("LUFFY", "total/teacher/episodes"), ("OPD", "total/teacher/scored_tokens")):
        rows = compare.read_jsonl(tmp_path / f"{compare.slug(name)}-s0" / "metrics.jsonl")
        assert max(row.get(key, 0) for row in rows) > 0
