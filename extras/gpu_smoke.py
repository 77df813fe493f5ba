"""The GPU smoke test: RTI training steps of a random Qwen3-8B on one GPU; optional (extras/).

    python -m extras.scale gpu-smoke [--lora-r 16]   # two RTI steps; any flag of extras.scale

It answers "does an 8B model train with this loop on this GPU, and in how much memory" before a
real run is set up: nothing is downloaded (the model is built from Qwen3-8B's configuration with
random weights), and the figures it prints (parameters, peak memory, the time of each step) are
those of the flags given. Not part of CI.
"""

from __future__ import annotations

import dataclasses
import json
import time

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

import envs
import rti

# Qwen3-8B's config.json
QWEN3_8B = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
# the values the gpu-smoke command gives the flags left at their training defaults
SMOKE = dict(
    device="cuda",
    dtype="bf16",
    gradient_checkpointing=True,
    batch_tasks=4,
    group_size=4,
    micro_batch=4,
)


def gpu_smoke(cfg, backend_class, arch: dict = QWEN3_8B, steps: int = 2, log=print) -> dict:
    """`steps` RTI training steps of a randomly initialised model of architecture `arch` (Qwen3-8B
    by default) under the flags `cfg` (an extras.scale.ScaleConfig) on a `backend_class`
    (extras.scale.ScaleBackend). Logs and returns the parameter count, peak memory and the time of
    each step (the first includes CUDA warm-up and AdamW's state allocation).

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
    backend = backend_class(cfg)
    _, tok = rti.load_model("tiny")
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
    }
    model, _ = backend.prepare(model, tok, "navigation")
    figures["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    sampler = rti.Sampler(
        model, tok, cfg.temperature, cfg.top_p, cfg.max_turn_tokens, cfg.seed, cfg.micro_batch
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    tasks = envs.make_tasks("easy")[: cfg.batch_tasks]
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
    if cuda:
        figures["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        figures["gpu"] = torch.cuda.get_device_name(backend.device)
    log(json.dumps(figures, indent=1))
    return figures
