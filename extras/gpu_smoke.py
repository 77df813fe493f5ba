"""The GPU smoke test: RTI training steps of a random Qwen3-8B on one GPU; optional (extras/).

    python -m extras.scale gpu-smoke                 # two RTI steps, LoRA, episodes of 8k tokens
    python -m extras.scale gpu-smoke --context 16384 --lora-r 0 --no-master-weights

It answers "does an 8B model train with this loop on this GPU, and in how much memory" before a
real run is set up: nothing is downloaded (the model is built from Qwen3-8B's configuration with
random weights), episodes are as long as --context (a long first message, as tau2's system prompt
and tool schemas, then turns of many tokens), and the figures it prints (parameters, the longest
episode, the memory plan's peak beside the measured one, the time of each step) are those of the
flags given. The plan is checked first: a run that cannot fit is refused before the model is
built. Not part of CI (tests run its code path on the CPU with a tiny architecture).
"""

from __future__ import annotations

import dataclasses
import json
import time

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

import envs
import rti
from extras import plan
from extras.plan import QWEN3_8B
from policy import Chat, Sampler, load_model

# the values the gpu-smoke command gives the flags left at their training defaults: LoRA, as the
# memory plan says for Qwen3-8B on one GPU (full fine-tuning with fp32 master weights and AdamW
# states takes 16 bytes a parameter, 122 GiB, before the gathered bf16 weights)
SMOKE = dict(
    device="cuda",
    dtype="bf16",
    gradient_checkpointing=True,
    lora_r=16,
    batch_tasks=4,
    group_size=4,
    micro_batch=4,
    context=8192,
)
FILLER = "grid"  # a word of the tiny vocabulary: one token
OBSERVATION_TOKENS = 16  # about, in the tiny vocabulary, with the turn's chat pieces


class LongPromptChat(Chat):
    """policy.Chat whose first message starts with `filler` extra tokens, as a long system prompt
    would."""

    def __init__(self, tok, filler: int, env: str = "navigation"):
        super().__init__(tok, env)
        self.filler = filler

    def prompt_ids(self, content: str) -> list[int]:
        return super().prompt_ids(" ".join([FILLER] * self.filler + [content]))


class MeasuredSampler(Sampler):
    """policy.Sampler that remembers the longest row it decoded (tokens in the KV cache)."""

    longest = 0

    def sample_turn(self, session, rows, max_new=None):
        ids, logps = super().sample_turn(session, rows, max_new)
        self.longest = max(self.longest, int(session.length.max()) + 1)  # + the pending token
        return ids, logps


def episode_shape(cfg, tasks: list, prompt: int) -> tuple[int, int]:
    """(filler tokens, tokens a turn) that make the longest task's episode about --context
    tokens after a first message of `prompt` tokens: half of the rest a long first message, half
    turns of a random model (which runs every turn to its last token and never finishes; each
    turn's observation adds about 16 tokens); with little room, --max-turn-tokens turns and less
    filler."""
    if not cfg.context:
        return 0, cfg.max_turn_tokens
    turns = max(t.max_turns for t in tasks)
    room = cfg.context - prompt
    filler = room // 2
    per_turn = (room - filler) // turns - OBSERVATION_TOKENS
    if per_turn < cfg.max_turn_tokens:
        per_turn = cfg.max_turn_tokens
        filler = max(0, room - turns * (per_turn + OBSERVATION_TOKENS))
    return filler, per_turn


def gpu_smoke(cfg, backend_class, arch: dict = QWEN3_8B, steps: int = 2, log=print) -> dict:
    """`steps` RTI training steps of a randomly initialised model of architecture `arch` (Qwen3-8B
    by default) under the flags `cfg` (an extras.scale.ScaleConfig) on a `backend_class`
    (extras.scale.ScaleBackend), with episodes of about --context tokens (episode_shape). Logs and
    returns the parameter count, the longest episode, the memory plan's peak and (on a GPU) the
    measured one, and the time of each step (the first includes CUDA warm-up and AdamW's state
    allocation). On a GPU, a run the plan says cannot fit raises ValueError before the model is
    built.

    The tokenizer is the tiny word-level one (its few hundred ids are ids of the 8B vocabulary
    too) and a random model never succeeds, so the steps use the rule corrector without the PPL
    gate: corrections give each group a spread."""
    cfg = dataclasses.replace(
        cfg,
        init="",
        train_split="easy",
        method="rti",
        rti=dataclasses.replace(cfg.rti, corrector="rule", ppl_gate=False, max_corrections=100),
    )
    cfg.validate()
    tasks = envs.make_tasks("easy")[: cfg.batch_tasks]
    _, tok = load_model("tiny")
    prompt = len(Chat(tok).prompt_ids(envs.Navigation(tasks[0]).reset()))
    filler, turn_tokens = episode_shape(cfg, tasks, prompt)
    cfg = dataclasses.replace(cfg, max_turn_tokens=turn_tokens, prompt_tokens=filler + prompt)
    backend = backend_class(cfg)
    if backend.device.type == "cuda":
        run_plan = plan.check(cfg, 1, backend.gpu_gib(), plan.Arch.from_config(arch))
    else:
        run_plan = plan.memory_plan(cfg, plan.Arch.from_config(arch), 1, cfg.gpu_mem)
    torch.manual_seed(cfg.seed)
    config = Qwen3Config(**arch, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    with torch.device(backend.device):
        model = AutoModelForCausalLM.from_config(config, dtype=backend.dtype)
    figures = {
        "params": sum(p.numel() for p in model.parameters()),
        "device": str(backend.device),
        "dtype": cfg.dtype,
        "gradient_checkpointing": cfg.gradient_checkpointing,
        "lora_r": cfg.lora_r,
        "rows": cfg.batch_tasks * cfg.group_size,
        "micro_batch": cfg.micro_batch,
        "context": cfg.context,
        "first_message_tokens": filler + prompt,
        "turn_tokens": turn_tokens,
        # the phases a smoke step runs (it does not evaluate)
        "plan_peak_gib": round(
            max(run_plan.phases[k] for k in ("rollout", "scoring", "update")) / plan.GIB, 2
        ),
    }
    model, _ = backend.prepare(model, tok, "navigation")
    figures["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    sampler = MeasuredSampler(
        model,
        tok,
        cfg.temperature,
        cfg.top_p,
        cfg.max_turn_tokens,
        cfg.seed,
        cfg.micro_batch,
        chat=LongPromptChat(tok, filler),
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    cuda = backend.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    figures["steps"] = []
    for _ in range(steps):
        t0 = time.time()
        m = rti.train_step(sampler, opt, tasks, cfg, backend=backend)
        if cuda:
            torch.cuda.synchronize()
        figures["steps"].append(
            {
                "seconds": round(time.time() - t0, 2),
                "loss": m.get("loss"),
                "trained_rows": m["trained_rows"],
                **{k: round(v, 2) for k, v in m.items() if k.startswith("time/")},
            }
        )
    figures["longest_episode_tokens"] = sampler.longest
    if cuda:
        figures["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        figures["gpu"] = torch.cuda.get_device_name(backend.device)
    log(json.dumps(figures, indent=1))
    return figures
