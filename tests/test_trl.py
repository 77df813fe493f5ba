"""extras/trl_rti.py inside TRL 1.16: stock GRPOTrainer on NavigationToolEnv, RTIGRPOTrainer, the
loss mapping.

Skipped without trl. Tiny sizes, one thread."""

import math
import os

import pytest
import torch

pytest.importorskip(
    "trl",
    reason="TRL integration tests need trl: pip install -r requirements-trl.txt "
    "(pip install trl==1.16.0)",
)
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import envs  # noqa: E402
import evaluate  # noqa: E402
from extras import trl_rti  # noqa: E402   (core names come through trl_rti's "core names" block)
from loss import INTERVENED, POLICY  # noqa: E402

G = 4


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def warm():
    return trl_rti.load_model(trl_rti.WARMSTART)


def params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def changed(before, model):
    return any(not torch.equal(before[k], v) for k, v in model.named_parameters())


# ----------------------------------------------------------------------------- tool-call adapter


def test_tool_template_renders_what_our_rollout_feeds_the_model():
    """TRL builds a tool episode as prompt + sampled ids + the suffix of each tool message; with
    TOOL_TEMPLATE these are exactly the ids policy.Chat gives our rollout, so the tiny model sees its
    training format in TRL too."""
    from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

    model, tok = warm()
    ttok = trl_rti.tool_tokenizer(tok)
    chat = trl_rti.Sampler(model, tok).chat
    assert supports_tool_calling(ttok) and is_chat_template_prefix_preserving(ttok)
    env = envs.Navigation(envs.make_tasks("train")[0])
    first = env.reset()
    prompt = ttok.apply_chat_template(
        [{"role": "user", "content": "" + first}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert prompt == chat.prompt_ids(first)
    obs, _ = env.step("move up")
    call = [{"type": "function", "function": trl_rti.NavigationTools.call_from_action("move up")}]
    msgs = [
        {"role": "user", "content": first},
        {"role": "assistant", "content": "", "tool_calls": call},
    ]
    before = ttok.apply_chat_template(msgs, tokenize=True, return_dict=False)
    full = ttok.apply_chat_template(
        msgs + [{"role": "tool", "name": "move", "content": obs}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert before == prompt + chat.action_ids("move up") + [chat.eos_id]
    assert full[len(before) :] == chat.turn_ids(obs)


def test_parser_reads_actions_as_tool_calls_and_stops_after_the_episode():
    _, tok = warm()
    ttok = trl_rti.tool_tokenizer(tok)
    ids = ttok("move left <|im_end|>", add_special_tokens=False).input_ids
    prefix = ttok(
        "<|user|> pos 1 1 next A 2 2 blocked none <|assistant|>", add_special_tokens=False
    ).input_ids
    got = ttok.parse_response(ids, prefix=prefix)
    assert got["tool_calls"] == [
        {"type": "function", "function": {"name": "move", "arguments": {"direction": "left"}}}
    ]
    assert ttok.parse_response(ttok("finish <|im_end|>").input_ids, prefix=prefix)["tool_calls"][0][
        "function"
    ] == {"name": "finish", "arguments": {}}
    assert "tool_calls" not in ttok.parse_response(
        ttok("move move <|im_end|>").input_ids, prefix=prefix
    )
    over = ttok("<|user|> episode over pos 2 2 next finish blocked none <|assistant|>").input_ids
    assert "tool_calls" not in ttok.parse_response(ids, prefix=over)


def test_env_tools_are_described_once_by_navigation_tools():
    """TRL reads each tool's schema from its docstring; NavigationTools writes them, so TRL's tools
    and ToolChat's are one description."""
    from transformers.utils import get_json_schema

    env = trl_rti.NavigationToolEnv()
    for tool in trl_rti.NavigationTools.tools():
        ours = tool["function"]
        theirs = get_json_schema(getattr(env, ours["name"]))["function"]
        assert theirs["description"] == ours["description"]
        assert theirs["parameters"]["properties"] == ours["parameters"]["properties"]
        assert theirs["parameters"].get("required", []) == ours["parameters"]["required"]


def test_env_tools_step_the_task_and_reward_is_the_rubric():
    task = envs.make_tasks("train")[0]
    row = trl_rti.navigation_dataset([task])[0]
    env = trl_rti.NavigationToolEnv()
    assert env.reset(**row) == envs.Navigation(task).reset()
    for action in envs.optimal_actions(task):
        obs = env.move(action.split()[1]) if action.startswith("move") else getattr(env, action)()
    assert (
        obs.startswith("episode over")
        and env.get_reward() == 1.0
        and "route" in envs.optimal_actions(task)
    )
    env.reset(**row)
    assert env.move("north").startswith("error unknown action")
    env.finish()
    assert env.get_reward() == 0.0


# ----------------------------------------------------------------------------- stock GRPOTrainer


def test_stock_grpo_trainer_trains_on_the_navigation_env(tmp_path):
    model, tok = warm()
    before = params(model)
    # tasks the warm start solves at times
    data = trl_rti.navigation_dataset(envs.make_tasks("easy")[:4])
    trainer = trl_rti.GRPOTrainer(
        model=model,
        processing_class=trl_rti.tool_tokenizer(tok),
        train_dataset=data,
        environment_factory=trl_rti.NavigationToolEnv,
        args=trl_rti.trl_args(
            str(tmp_path),
            2,
            2,
            G,
            max_completion_length=1024,
            generation_kwargs={"max_new_tokens": 4},
        ),
    )
    trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r]
    assert len(logs) == 2 and all(math.isfinite(r["loss"]) for r in logs)
    # multi-turn episodes, not one-shot answers
    assert all(r["tools/call_frequency"] > 3 for r in logs)
    assert any(r["rewards/NavigationToolEnv/mean"] > 0 for r in logs)
    assert any(r["frac_reward_zero_std"] < 1 for r in logs)
    assert changed(before, model)


# ----------------------------------------------------------------------------- RTIGRPOTrainer


def failing_tasks(n, seed):
    """n train tasks whose G episodes all fail under the warm start at the trainer's first rollout
    seed."""
    model, tok = warm()
    tasks = envs.make_tasks("train")[:48]
    trajs = trl_rti.rollout(trl_rti.Sampler(model, tok), tasks, G, trl_rti.rollout_seed(seed, 0))
    bad = [t for i, t in enumerate(tasks) if not any(x.reward for x in trajs[i * G : (i + 1) * G])]
    assert len(bad) >= n
    return bad[:n]


@pytest.fixture(scope="module")
def rti_run(tmp_path_factory):
    """One optimizer step of RTIGRPOTrainer on 2 all-failing groups; two micro-batches (gradient
    accumulation 2), so TRL shuffles the generation batch and splits it. Records what _compute_loss
    received."""
    torch.set_num_threads(1)
    tasks = failing_tasks(2, seed=0)
    model, tok = warm()
    before = params(model)
    seen = []

    class Recording(trl_rti.RTIGRPOTrainer):
        def _compute_loss(self, model, inputs):
            seen.append({k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
            return super()._compute_loss(model, inputs)

    args = trl_rti.trl_args(
        str(tmp_path_factory.mktemp("rti")), 1, 1, G, gradient_accumulation_steps=2
    )
    trainer = Recording(
        model=model,
        processing_class=tok,
        train_dataset=trl_rti.navigation_dataset(tasks),
        args=args,
    )
    trainer.train()
    return trainer, seen, before, model


@pytest.mark.slow
def test_rti_trainer_intervened_tokens_reach_the_loss(rti_run):
    trainer, seen, before, model = rti_run
    stats = trainer.rti_stats[0]
    assert stats["groups_triggered"] == stats["groups"] == 2 and stats["gate_kept"] > 0
    assert any(INTERVENED in t.source for t in trainer.rti_trajs)
    log = next(r for r in trainer.state.log_history if "loss" in r)
    assert log["rti/intervened_frac"] > 0 and math.isfinite(log["loss"])
    assert log["rti/success_before"] == 0 and log["reward"] > 0
    assert changed(before, model)
    # the report's reweighting figures come from the loss, where they are made
    totals = evaluate.run_totals(trainer.rti_stats)
    assert 0 < totals["intervened_tokens"] < totals["trained_tokens"]
    assert (
        "trained intervened tokens (the reweighting's): 0 / 0"
        not in evaluate.intervention_report(totals)
    )


@pytest.mark.slow
def test_rti_trainer_per_token_tensors_stay_aligned_after_shuffle_and_split(rti_run):
    trainer, seen, _, _ = rti_run
    trajs = trainer.rti_trajs
    assert len(seen) == 2 and sum(len(b["advantages"]) for b in seen) == len(trajs)
    order = []
    for b in seen:
        for i in range(len(b["advantages"])):
            p = b["prompt_ids"][i][b["prompt_mask"][i].bool()].tolist()
            n = int(b["completion_mask"][i].sum())
            ids = p + b["completion_ids"][i, :n].tolist()
            match = [j for j, t in enumerate(trajs) if t.ids == ids and j not in order]
            assert match, "a row of the loss batch is no trajectory of the rollout"
            j = match[0]
            order.append(j)
            t = trajs[j]
            c = len(p)
            assert b["rti_source"][i, :n].tolist() == t.source[c:]
            assert torch.allclose(b["rti_behavior_logps"][i, :n], torch.tensor(t.sample_logp[c:]))
            assert b["tool_mask"][i, :n].tolist() == t.loss_mask[c:]
            assert (b["rti_source"][i, n:] == POLICY).all() and (b["tool_mask"][i, n:] == 0).all()
    # all rows, shuffled
    assert sorted(order) == list(range(len(trajs))) and order != list(range(len(trajs)))
    assert any((b["rti_source"] == INTERVENED).any() for b in seen)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_loss_equals_trl_loss_on_policy_tokens(loss_type, tmp_path):
    """With every token POLICY, loss.policy_loss under the loss_type mapping and TRL's accumulation
    scaling gives TRL's own loss and gradient (old log-probs perturbed so ratios and clipping are
    not trivial)."""
    model, tok = warm()
    args = trl_rti.trl_args(
        str(tmp_path),
        1,
        2,
        G,
        loss_type=loss_type,
        epsilon_high=0.28,
        gradient_accumulation_steps=2,
        max_completion_length=256,
    )
    data = trl_rti.navigation_dataset(envs.make_tasks("train")[:2])
    trainer = trl_rti.RTIGRPOTrainer(
        model=model, processing_class=tok, train_dataset=data, args=args, rti_config=None
    )
    rows = [data[i] for i in range(2) for _ in range(G)]
    batch = trainer._generate_and_score_completions(rows)
    assert (batch["rti_source"] == POLICY).all()
    mask = batch["completion_mask"] * batch["tool_mask"]
    batch["advantages"] = torch.linspace(-1.5, 1.5, len(rows))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        lp = trainer._get_per_token_logps_and_entropies(
            model, ids, attn, ids.size(1) - batch["prompt_ids"].size(1)
        )[0]
    batch["old_per_token_logps"] = lp + 0.3 * torch.randn(lp.shape, generator=g) * mask
    # one micro-batch
    half = {k: (v[:G] if torch.is_tensor(v) and v.dim() else v) for k, v in batch.items()}
    model.train()
    trainer.current_gradient_accumulation_steps = 2  # what Trainer's loop sets for this window
    ours = trainer._compute_loss(model, half)
    ours.backward()
    g_ours = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    theirs = trl_rti.GRPOTrainer._compute_loss(trainer, model, half)
    theirs.backward()
    assert torch.allclose(ours, theirs, atol=1e-6, rtol=1e-5), (ours.item(), theirs.item())
    for a, b in zip(g_ours, (p.grad for p in model.parameters())):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
