"""extras/scale.py and what it plugs in (chat_tools.py, lora.py, fsdp.py, plan.py, gpu_smoke.py):
tool calls with a Qwen3 chat template, bf16 with fp32 master weights / gradient checkpointing /
LoRA, the memory plan, the GPU smoke test's code path with long episodes, flags the machine cannot
serve, and FSDP2 on 2 CPU processes (gloo) against 1 process on the same global batch.

`python -m torch.distributed.run --standalone --nproc_per_node 2 tests/test_scale.py OUT` is the
2-process worker that test_fsdp_two_processes_match_one_process launches.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import envs  # noqa: E402
import intervene  # noqa: E402
import rti  # noqa: E402
import runtime  # noqa: E402
from extras import fsdp, gpu_smoke, plan, scale  # noqa: E402
from extras.chat_tools import (  # noqa: E402
    NavigationTools,
    ToolChat,
    format_tool_call,
    parse_tool_call,
)
from policy import Chat, Sampler, build_tiny_model, load_model, token_logprobs  # noqa: E402

# Qwen3-8B's chat template (tokenizer_config.json of the hybrid-thinking Qwen3 release): tools in
# the system message, tool results as <tool_response> blocks in a user turn, enable_thinking=False
# closes an empty think block.
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""


def qwen3_style_tokenizer():
    """A small byte-level BPE (trained here on the env's texts) with Qwen3's special tokens and
    chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    added = [
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
    ]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    task = envs.make_tasks("easy", n=1)[0]
    corpus = [
        QWEN3_CHAT_TEMPLATE,
        json.dumps(NavigationTools.tools()),
        envs.Navigation(task).reset(),
        " ".join(envs.Navigation.vocabulary()),
    ] + [format_tool_call(a) for a in envs.ACTIONS]
    backend.train_from_iterator(
        corpus * 3,
        trainers.BpeTrainer(
            vocab_size=700,
            special_tokens=special,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=QWEN3_CHAT_TEMPLATE,
    )


@pytest.fixture(scope="module")
def qwen_tok():
    torch.set_num_threads(1)
    return qwen3_style_tokenizer()


# ----------------------------------------------------------------------------- tool-call parsing

CALL = '<tool_call>\n{"name": "move", "arguments": {"direction": "up"}}\n</tool_call>'


@pytest.mark.parametrize(
    "text,action",
    [
        (CALL, "move up"),
        ('<tool_call>{"name": "finish", "arguments": {}}</tool_call>', "finish"),
        ('<tool_call>{"name": "finish"}</tool_call>', "finish"),
        ('<tool_call>{"name": "route", "arguments": {}}</tool_call>', "route"),
        ('<tool_call>{"name": "route", "arguments": {"to": "A"}}</tool_call>', "unknown tool"),
        (
            '<tool_call>{"name": "move", "arguments": "{\\"direction\\": \\"left\\"}"}</tool_call>',
            "move left",
        ),
        ("I will go up now.\n" + CALL + "\nDone.", "move up"),  # text around one call
        # a think block is skipped
        ("<think>\nmaybe <tool_call> down?\n</think>\n\n" + CALL, "move up"),
        (
            '<tool_call>{"name": "move", "arguments": {"direction": "up"}</tool_call>',
            "malformed JSON",
        ),
        ('<tool_call>["move", "up"]</tool_call>', "not a JSON object"),
        ('<tool_call>{"name": "jump", "arguments": {}}</tool_call>', "unknown tool"),
        (
            '<tool_call>{"name": "move", "arguments": {"direction": "north"}}</tool_call>',
            "unknown tool or arguments",
        ),
        (
            '<tool_call>{"name": "move", "arguments": {"direction": "up", "steps": 2}}</tool_call>',
            "unknown tool",
        ),
        ('<tool_call>{"name": "finish", "arguments": {"now": true}}</tool_call>', "unknown tool"),
        ('<tool_call>{"name": "mo', "unterminated <tool_call>"),  # cut off at max_turn_tokens
        ("move up", "no <tool_call> block"),  # plain text is not a call
        ("", "no <tool_call> block"),
        (CALL + CALL, "2 calls in one turn"),
    ],
)
def test_parse_tool_call(text, action):
    got = parse_tool_call(text)
    if action in envs.ACTIONS:
        assert got == action
    else:
        assert got.startswith("invalid tool call: ") and action in got
        env = envs.Navigation(envs.make_tasks("easy", n=1)[0])
        env.reset()
        obs, done = env.step(got)  # the env answers with an error observation, never raises
        assert obs.startswith("error unknown action") and not done
        assert not env.check_step(got).valid


def test_chat_tools_docstring_examples():
    import doctest

    from extras import chat_tools

    assert doctest.testmod(chat_tools).failed == 0


def test_every_action_round_trips_through_its_tool_call():
    for action in envs.ACTIONS:
        assert parse_tool_call(format_tool_call(action)) == action
    names = {t["function"]["name"] for t in NavigationTools.tools()}
    assert names == {a.split()[0] for a in envs.ACTIONS}


# ----------------------------------------------------------------------------- Qwen3's template


def render(tok, messages, thinking=False):
    return tok.apply_chat_template(
        messages,
        tools=NavigationTools.tools(),
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=thinking,
    )


def test_qwen3_chat_pieces_are_the_templates_and_prefix_stable(qwen_tok):
    tok = qwen_tok
    chat = ToolChat(tok)
    assert chat.tools == NavigationTools.tools()
    task = envs.make_tasks("easy", n=1)[0]
    env = envs.Navigation(task)
    first = env.reset()
    prompt = render(tok, [{"role": "user", "content": first}])
    assert chat.prompt_ids(first) == chat.ids(prompt)
    assert "<tools>" in prompt and '"name": "move"' in prompt
    assert '"enum": ["up", "down", "left", "right"]' in prompt
    # thinking off by default
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # a two-turn episode built from the pieces, as rollout builds it
    ids = chat.prompt_ids(first)
    for action in envs.optimal_actions(task)[:2]:
        agent = chat.action_ids(action) + [chat.eos_id]
        assert chat.action_text(agent) == action
        obs, _ = env.step(action)
        ids += agent + chat.turn_ids(obs)
        # what follows the agent's eos is exactly what the template writes after an assistant
        # turn and a tool result
        full = render(
            tok,
            [
                {"role": "user", "content": first},
                {"role": "assistant", "content": "REPLY"},
                {"role": "tool", "content": obs},
            ],
        )
        assert tok.decode(chat.turn_ids(obs)) == full.split("REPLY<|im_end|>", 1)[1]
        assert f"<tool_response>\n{obs}\n</tool_response>" in tok.decode(chat.turn_ids(obs))
    text = tok.decode(ids)
    assert chat.ids(text) == ids  # tokenizing the pieces one by one = tokenizing the whole text
    assert [text.count(t) - prompt.count(t) for t in ("<tool_call>", "<tool_response>")] == [2, 2]


def test_thinking_flag_reaches_the_template(qwen_tok):
    chat = ToolChat(qwen_tok, thinking=True)
    assert chat.prompt_post.endswith("<|im_start|>assistant\n")
    assert chat.turn_post.endswith("<|im_start|>assistant\n")
    turn = chat.ids(
        "<think>\nA is up and to the left.\n</think>\n\n" + format_tool_call("move left")
    )
    assert chat.action_text(turn + [chat.eos_id]) == "move left"


def test_tiny_chat_keeps_plain_text_actions():
    _, tok = load_model("tiny")
    chat = Chat(tok)
    backend = scale.ScaleBackend(runtime.make_config(scale.ScaleConfig))
    assert type(backend.prepare(build_tiny_model(len(tok)), tok, "navigation")[1]) is Chat
    assert chat.action_ids("move up") == chat.ids("move up")
    assert chat.action_text(chat.ids("move up") + [chat.eos_id]) == "move up"


@pytest.mark.slow
def test_rti_step_with_a_qwen3_template_model(qwen_tok):
    """A random model's turns are malformed calls (error observations); rule corrections are tool
    calls, succeed and are trained on."""
    model = build_tiny_model(len(qwen_tok), seed=0)
    model.config.eos_token_id = qwen_tok.eos_token_id
    model.config.pad_token_id = qwen_tok.pad_token_id
    policy = Sampler(
        model, qwen_tok, temperature=1.0, max_turn_tokens=24, seed=0, chat=ToolChat(qwen_tok)
    )
    cfg = runtime.make_config(
        rti.Config,
        init="",
        method="rti",
        corrector="rule",
        max_corrections=100,
        ppl_gate=False,
        intervene_per_group=1,
        group_size=2,
        batch_tasks=2,
        lr=1e-3,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    m = rti.train_step(policy, opt, envs.make_tasks("easy", n=2), cfg)
    assert m["train_success"] == 0 and m["train_success_after_rti"] > 0 and math.isfinite(m["loss"])
    trajs = rti.rollout(policy, envs.make_tasks("easy", n=1), 1)
    assert all(a.startswith("invalid tool call") for a in trajs[0].actions)
    assert all(o.startswith("error unknown action") for o in trajs[0].observations[1:])
    rewrite = intervene.RuleCorrector(policy).rewrite(
        [intervene.StepUnderReview(trajs[0], envs.Navigation(trajs[0].task))]
    )[0]
    assert qwen_tok.decode(rewrite.agent_ids).startswith('<tool_call>\n{"name": ')


def test_model_path_loads_a_local_model_with_its_template_and_flags(qwen_tok, tmp_path):
    model = build_tiny_model(len(qwen_tok), seed=0)
    model.save_pretrained(tmp_path / "m")
    qwen_tok.save_pretrained(tmp_path / "m")
    _, _, cfg = runtime.parse_args(
        [
            "--model",
            str(tmp_path / "m"),
            "--dtype",
            "bf16",
            "--attn-implementation",
            "eager",
            "--thinking",
        ],
        scale.ScaleConfig,
        ("train",),
    )
    policy = rti.init_policy(cfg, scale.ScaleBackend(cfg))
    # thinking on: no empty block
    assert policy.chat.tools and policy.chat.prompt_post.endswith("assistant\n")
    assert policy.model.config._attn_implementation == "eager"
    # bf16 full fine-tuning: fp32 master weights (FSDP2 on one process)
    assert fsdp.is_sharded(policy.model)
    assert {p.dtype for p in policy.model.parameters()} == {torch.float32}


# ----------------------------------------------------------------------------- bf16 / ckpt / LoRA


def small_cfg(tmp_path, **kw):
    base = dict(
        init="",
        train_split="easy",
        batch_tasks=2,
        group_size=4,
        steps=1,
        eval_tasks=0,
        progress=False,
        out=str(tmp_path / "run"),
        lr=1e-3,
        method="rti",
        corrector="rule",
        max_corrections=100,
        ppl_gate=False,
        intervene_per_group=2,
    )
    base.update(kw)
    return runtime.make_config(scale.ScaleConfig, **base)


def one_step(cfg):
    torch.manual_seed(0)
    backend = scale.ScaleBackend(cfg)
    policy = rti.init_policy(cfg, backend)
    trainable = {
        n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad
    }
    opt = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=cfg.lr)
    m = rti.train_step(policy, opt, envs.make_tasks("easy", n=2), cfg, backend=backend)
    return policy, m, trainable


def changed(policy, before):
    now = dict(policy.model.named_parameters())
    return {n for n, p in before.items() if not torch.equal(p, now[n].detach())}


def moved_share(before: dict, model) -> float:
    """The share of weight elements that a step changed (sharded weights compared whole)."""
    moved = total = 0
    for n, p in model.named_parameters():
        if n in before:
            now, was = p.detach(), before[n]
            if isinstance(now, DTensor):
                now, was = now.full_tensor(), was.full_tensor()
            moved += int((now != was).sum())
            total += now.numel()
    return moved / total


@pytest.mark.parametrize("master", [pytest.param(True, marks=pytest.mark.slow), False])
def test_bf16_full_fine_tuning_keeps_fp32_master_weights(tmp_path, master):
    """With master weights (the default) the weights, gradients and AdamW states are fp32 and the
    forward runs in bf16; an lr of 1e-5 moves nearly every weight. With --no-master-weights the
    weights are bf16, and bf16's rounding loses the same step for most of them (all but the
    smallest)."""
    cfg = small_cfg(tmp_path, dtype="bf16", master_weights=master, lr=1e-5)
    policy, m, before = one_step(cfg)
    assert math.isfinite(m["loss"]) and m["trained_rows"] == 8
    weights = list(policy.model.parameters())
    if master:
        assert fsdp.is_sharded(policy.model)
        assert {p.dtype for p in weights} == {torch.float32}
        assert {p.grad.dtype for p in weights if p.grad is not None} == {torch.float32}
        assert moved_share(before, policy.model) > 0.9
        computed = []
        hook = policy.model.model.layers[0].mlp.register_forward_hook(
            lambda module, args, out: computed.append(out.dtype)
        )
        token_logprobs(policy.model, [[1, 2, 3]], 0, 1.0, "cpu")
        hook.remove()
        assert computed == [torch.bfloat16]
    else:
        assert not fsdp.is_sharded(policy.model)
        assert {p.dtype for p in weights} == {torch.bfloat16}
        assert moved_share(before, policy.model) < 0.25


def test_gradient_checkpointing_changes_nothing_but_memory(tmp_path):
    plain, m_plain, _ = one_step(small_cfg(tmp_path))
    ckpt, m_ckpt, before = one_step(small_cfg(tmp_path, gradient_checkpointing=True))
    assert ckpt.model.is_activation_checkpointing and not plain.model.is_activation_checkpointing
    assert changed(ckpt, before)
    assert m_ckpt["loss"] == pytest.approx(m_plain["loss"], abs=1e-6)
    for p, q in zip(plain.model.parameters(), ckpt.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


@pytest.mark.skipif(
    importlib.util.find_spec("peft") is None,
    reason="LoRA needs the optional package peft: pip install -r requirements-lora.txt",
)
def test_lora_bf16_checkpointing_step_trains_only_adapters(tmp_path):
    policy, m, before = one_step(
        small_cfg(tmp_path, lora_r=4, dtype="bf16", gradient_checkpointing=True)
    )
    assert before and all("lora_" in n for n in before)
    assert {p.dtype for p in before.values()} == {torch.float32}  # adapters fp32, base weights bf16
    base = [p for n, p in policy.model.named_parameters() if "lora_" not in n]
    assert {p.dtype for p in base} == {torch.bfloat16} and not any(p.requires_grad for p in base)
    assert math.isfinite(m["loss"])
    assert {n for n in changed(policy, before) if "lora_B" in n}  # B starts at 0: it moved
    scale.ScaleBackend(small_cfg(tmp_path, lora_r=4)).save_model(policy, tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").exists()


def qwen3_params(a: dict) -> int:
    """Parameters of a Qwen3 decoder from its config: per layer the q, k, v, o projections, the
    SwiGLU MLP and four norms (two of width hidden, q_norm and k_norm of width head_dim);
    embeddings and head (tied or not); final norm."""
    h = a["hidden_size"]
    d = a["head_dim"]
    attention = h * d * (2 * a["num_attention_heads"] + 2 * a["num_key_value_heads"])
    layer = attention + 3 * h * a["intermediate_size"] + 2 * h + 2 * d
    return (
        a["num_hidden_layers"] * layer
        + a["vocab_size"] * h * (1 if a["tie_word_embeddings"] else 2)
        + h
    )


def test_gpu_smoke_code_path_runs_on_cpu_with_a_tiny_architecture(tmp_path):
    arch = dict(
        gpu_smoke.QWEN3_8B,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=1000,
    )
    fig = gpu_smoke.gpu_smoke(
        small_cfg(tmp_path, dtype="bf16", gradient_checkpointing=True, batch_tasks=1),
        scale.ScaleBackend,
        arch=arch,
        steps=1,
        log=runtime.silent,
    )
    assert fig["params"] == qwen3_params(arch) == 202_176
    assert math.isfinite(fig["steps"][0]["loss"])


def test_gpu_smoke_makes_episodes_of_the_context(tmp_path):
    """--context 1024: a long first message and long turns make the longest episode about 1,024
    tokens (Qwen3-8B's default run asks 8,192 on a GPU)."""
    arch = dict(
        gpu_smoke.QWEN3_8B,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=500,
    )
    cfg = small_cfg(tmp_path, batch_tasks=1, context=1024, mini_batches=1)
    fig = gpu_smoke.gpu_smoke(cfg, scale.ScaleBackend, arch=arch, steps=1, log=runtime.silent)
    assert fig["first_message_tokens"] > 400 and fig["turn_tokens"] > 4
    assert 900 <= fig["longest_episode_tokens"] <= 1024
    assert fig["plan_peak_gib"] > 0 and fig["steps"][0]["trained_rows"] == 4, fig


# ----------------------------------------------------------------------------- the memory plan


def test_presets_have_their_model_cards_parameter_counts():
    billions = {
        name: round(plan.Arch.from_config(c).params() / 1e9, 2) for name, c in plan.PRESETS.items()
    }
    assert billions == {
        "Qwen3-0.6B-like": 0.6,
        "Qwen3-1.7B-like": 1.72,
        "Qwen3-4B-like": 4.02,
        "Qwen3-8B-like": 8.19,
        "Qwen3-14B-like": 14.77,
        "Qwen3-32B-like": 32.76,
    }
    qwen3_8b = plan.Arch.from_config(plan.QWEN3_8B)
    assert qwen3_8b.params() == qwen3_params(plan.QWEN3_8B)
    assert qwen3_8b.kv_bytes(2) == 144 * 1024  # 144 KiB a token in bf16


def plan_run(capsys, *flags):
    """(exit status, stdout, stderr) of `python -m extras.scale plan FLAGS`."""
    try:
        scale.main(["plan", "--model-config", "Qwen3-8B-like", "--gpu-mem", "141", *flags])
    except SystemExit as e:  # sys.exit(message) or argparse's exit 2
        out = capsys.readouterr()
        if isinstance(e.code, str):
            return 1, out.out, e.code
        return e.code, out.out, out.err
    return 0, capsys.readouterr().out, ""


def test_plan_of_a_lora_run_on_one_h200(capsys):
    flags = ["--dtype", "bf16", "--lora-r", "16", "--gradient-checkpointing", "--context", "8192"]
    code, out, _ = plan_run(capsys, *flags, "--batch-tasks", "4")
    assert code == 0 and out.rstrip().endswith("fits")
    # 4 tasks x 8 samples of 8,192 tokens: 36 GiB of keys and values, up to twice allocated
    assert "| rollout KV cache | 72.0 |" in out
    assert "32 rows x 8192 tokens x 144 KiB" in out
    assert "the full-vocabulary form took 111.3 GiB" in out  # 8 rows of 8k, as the issue measured
    for part in ("weights", "gradients", "AdamW states", "update activations", "update log-probs"):
        assert f"| {part} |" in out
    # 8 tasks: 64 rows, whose first forward pass and KV cache do not fit
    code, _, err = plan_run(capsys, *flags)
    assert code and "the rollout needs 220.1 GiB" in err and "--batch-tasks 4" in err


def test_lora_without_peft_plans_but_does_not_train(capsys, monkeypatch):
    """A plan needs no adapter: without peft `plan --lora-r 16` plans; `train --lora-r 8` stops with
    one line naming the install command."""
    monkeypatch.setattr(importlib.util, "find_spec", no_peft)
    flags = ["--dtype", "bf16", "--lora-r", "16", "--gradient-checkpointing", "--context", "8192"]
    code, out, _ = plan_run(capsys, *flags, "--batch-tasks", "4")
    assert code == 0 and "| weights |" in out
    with pytest.raises(SystemExit) as stop:
        scale.main(["train", "--lora-r", "8", "--init", "", "--out", "/tmp/unused"])
    assert "pip install -r requirements-lora.txt" in str(stop.value)


def test_plan_refuses_full_fine_tuning_of_8b_on_one_gpu_and_names_flags_that_fit(capsys):
    code, _, err = plan_run(
        capsys, "--dtype", "bf16", "--gradient-checkpointing", "--context", "8192"
    )
    assert code and "plan: the run does not fit 1 GPU(s) of 141 GiB" in err
    assert "fp32 master weights" in err and "flags that fit:" in err and "--lora-r 16" in err


def test_plan_of_8_gpus_shards_and_splits_the_batch(capsys):
    code, out, _ = plan_run(
        capsys, "--gpus", "8", "--dtype", "bf16", "--gradient-checkpointing", "--context", "16384"
    )
    assert code == 0 and "FSDP2, full fine-tuning" in out
    assert "| weights | 3.8 | fp32 shards, 1/8 each |" in out  # 8.19B x 4 bytes / 8
    assert "training rollout: 8 rows" in out


@pytest.mark.parametrize(
    "flags,expect",
    [
        (["--gpus", "8", "--batch-tasks", "4"], "--batch-tasks: 4 tasks do not split"),
        (["--model-config", "Qwen9-1T"], "--model-config: 'Qwen9-1T' is neither a preset"),
        (["--gpu-mem", "0"], "--gpu-mem: the memory of one GPU in GiB is needed"),
    ],
)
def test_plan_says_which_flag_is_wrong(capsys, flags, expect, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = plan_run(capsys, *flags)
    assert code and expect in err


def test_plan_reads_a_model_directory_and_sizes_evaluation(tmp_path, capsys):
    """A config.json is all the plan reads; evaluation decodes as many episodes as fit, in whole
    tasks, and --decode-tokens caps them."""
    _, tok = load_model("tiny")
    build_tiny_model(len(tok)).save_pretrained(tmp_path / "m")
    cfg = small_cfg(tmp_path, model_config=str(tmp_path / "m"), context=2048, eval_tasks=100)
    tiny = plan.check(cfg, 1, 40.0)
    assert tiny.fits and tiny.rows_fit > 400 and tiny.eval_rows == 400  # 100 tasks x 4 samples
    backend = scale.ScaleBackend(small_cfg(tmp_path, context=2048, decode_tokens=2048 * 10))
    assert backend.decode_rows(4) == 8  # 10 rows fit: two tasks of 4 samples
    assert scale.ScaleBackend(small_cfg(tmp_path)).decode_rows(4) == 256  # rti's default


# ----------------------------------------------------------------------------- flags refused

FIND_SPEC = importlib.util.find_spec


def no_peft(name, *a, **kw):
    return None if name == "peft" else FIND_SPEC(name, *a, **kw)


@pytest.mark.parametrize(
    "flags,env,patch,expect",
    [
        (["--dtype", "fp16"], {}, {}, "--dtype"),
        (["--device", "cuda"], {}, {"is_available": False}, "install a CUDA build"),
        (
            ["--device", "cuda", "--dtype", "bf16"],
            {},
            {"is_available": True, "is_bf16_supported": False},
            "--dtype: this GPU has no bf16",
        ),
        (["--fsdp"], {}, {}, "torchrun --nproc_per_node"),
        ([], {"WORLD_SIZE": "2"}, {}, "add --fsdp"),
        (["--fsdp", "--batch-tasks", "3"], {"WORLD_SIZE": "2"}, {}, "--batch-tasks"),
        (["--attn-implementation", "flash_attention_2"], {}, {}, "pip install flash-attn"),
        (["--kl-coef", "0.1"], {}, {}, "--kl-coef: the KL penalty needs a reference model"),
        (["--context", "-1"], {}, {}, "--context: must be >= 0"),
    ],
)
def test_flags_the_machine_cannot_serve_say_what_to_change(
    flags, env, patch, expect, monkeypatch, capsys
):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for name in ("is_available", "is_bf16_supported"):
        if name in patch:
            monkeypatch.setattr(torch.cuda, name, lambda *a, v=patch[name], **k: v)
    if patch.get("no_peft"):
        monkeypatch.setattr(importlib.util, "find_spec", no_peft)
    if "flash_attention_2" in flags and FIND_SPEC("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    with pytest.raises(SystemExit):
        runtime.parse_args(flags, scale.ScaleConfig, ("train",))
    assert expect in capsys.readouterr().err


# ----------------------------------------------------------------------------- FSDP2 on 2 processes

# Near-greedy sampling makes both runs sample the same trajectories although their batches have
# different shapes; rule corrections give each group a reward spread, so the loss and the update
# are not trivial. A micro-batch of 3 rows splits the 8 trained rows 3+3+2 in one process and 3+1
# per rank in two. With more than one mini-batch each process would shuffle its own rows: other
# parts than one process's.
FLAGS = [
    "--init",
    "",
    "--train-split",
    "easy",
    "--steps",
    "2",
    "--batch-tasks",
    "2",
    "--group-size",
    "4",
    "--eval-tasks",
    "0",
    "--no-progress",
    "--method",
    "rti",
    "--corrector",
    "rule",
    "--no-ppl-gate",
    "--intervene-per-group",
    "1",
    "--max-corrections",
    "100",
    "--temperature",
    "1.0",
    "--lr",
    "1e-3",
    "--micro-batch",
    "3",
    "--save-every",
    "1",
    "--threads",
    "1",
    "--mini-batches",
    "1",
]


def fsdp_worker(out: str) -> None:
    """Under torchrun: 2 steps straight (with gradient checkpointing, which must change nothing),
    then 1 step and a resume from its sharded checkpoint to step 2."""
    import torch.distributed as dist

    for extra in (
        ["--out", f"{out}/straight", "--gradient-checkpointing"],
        ["--out", f"{out}/resumed", "--steps", "1"],
        ["--out", f"{out}/resumed", "--resume"],
    ):
        _, _, cfg = runtime.parse_args(FLAGS + ["--fsdp"] + extra, scale.ScaleConfig, ("train",))
        rti.train(cfg, log=runtime.silent, backend=scale.ScaleBackend(cfg))
    dist.destroy_process_group()


def losses(path):
    """(loss, grad norm before clipping) per step: AdamW and clipping hide a wrong gradient scale,
    the norm shows it."""
    return [(m["loss"], m["grad_norm"]) for m in map(json.loads, open(path))]


@pytest.mark.slow
def test_fsdp_two_processes_match_one_process(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            __file__,
            str(tmp_path / "two"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    _, _, cfg = runtime.parse_args(FLAGS + ["--out", str(tmp_path / "one")], rti.Config)
    one = rti.train(cfg, log=runtime.silent)
    ref = losses(tmp_path / "one" / "metrics.jsonl")
    # a real update
    assert len(ref) == 2 and all(abs(loss) > 1e-3 and norm > 1 for loss, norm in ref)
    for run in ("straight", "resumed"):
        two = losses(tmp_path / "two" / run / "metrics.jsonl")
        assert [x for step in two for x in step] == pytest.approx(
            [x for step in ref for x in step], rel=1e-4
        )
    assert sorted(p.name for p in (tmp_path / "two" / "resumed" / "ckpt").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "rng-0.pt",
        "rng-1.pt",
    ]
    # AdamW moves every weight with a non-negligible gradient by about lr per step; where a gradient
    # is near Adam's eps, float noise between batch shapes shows, so the tolerance is a small share
    # of the distance travelled
    from safetensors.torch import load_file

    init = build_tiny_model(one["sampler"].model.config.vocab_size).state_dict()
    final = one["sampler"].model.state_dict()
    travelled = cfg.lr * cfg.steps
    for run in ("straight", "resumed"):
        two = load_file(tmp_path / "two" / run / "model" / "model.safetensors")
        assert set(two) <= set(final) and "model.embed_tokens.weight" in two
        for k, v in two.items():
            assert (final[k] - init[k]).abs().max() > travelled / 2, k  # it moved ...
            same_place = torch.allclose(v, final[k], rtol=0, atol=0.025 * travelled)
            assert same_place, k  # ... to the same place


def test_the_processes_metrics_add_counts_and_sums_and_join_the_loss_figures_by_tokens():
    """A step's metrics of two processes: integer counts and sums (the gate's PPL sums) add up,
    the loss's figures are joined by the tokens each is over (a process without intervened tokens
    does not pull weight_mean to its empty default 1.0), other numbers are averaged."""
    a = {"sampled_episodes": 32, "rti/ppl_kept_sum": 2.5, "train_success": 0.5, "weight_mean": 1.5}
    b = {"sampled_episodes": 32, "rti/ppl_kept_sum": 1.5, "train_success": 0.25, "weight_mean": 1.0}
    a.update({"tokens/intervened": 10, "tokens/trained": 100, "clip_frac": 0.1})
    b.update({"tokens/intervened": 0, "tokens/trained": 300, "clip_frac": 0.2})
    out = fsdp.combine_metrics([a, b])
    assert out["sampled_episodes"] == 64 and out["rti/ppl_kept_sum"] == pytest.approx(4.0)
    assert out["train_success"] == pytest.approx(0.375)
    assert out["weight_mean"] == 1.5 and out["tokens/intervened"] == 10
    assert out["clip_frac"] == pytest.approx((0.1 * 100 + 0.2 * 300) / 400)


if __name__ == "__main__":
    torch.set_num_threads(1)
    fsdp_worker(sys.argv[1])
