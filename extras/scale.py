"""GPUs, LoRA, gradient checkpointing and FSDP2 for rti.py; optional (extras/).

    python -m extras.scale train --model /models/Qwen3-8B --device cuda --dtype bf16 --lora-r 16 ...
    torchrun --nproc_per_node 8 -m extras.scale train --fsdp --model /models/Qwen3-8B --device cuda --dtype bf16 ...
    python -m extras.scale eval MODEL_DIR --device cuda --dtype bf16 --max-turn-tokens 64   # pass@k on a GPU
    python -m extras.scale gpu-smoke [--lora-r 16]      # two RTI steps of a random Qwen3-8B on one GPU

`ScaleConfig` adds the scale flags to rti.Config, `ScaleBackend` plugs them into rti's loop through rti.Backend (the
loop's one question: where does the model run), and a real chat model's template with tools is rendered by
extras/chat_tools.py's ToolChat.

FSDP2: every process takes `batch_tasks / N` whole groups of each batch (group advantages need no communication),
samples and intervenes on them, and all processes then run the same number of micro-batch forward/backward passes;
token counts are summed across processes so that the loss and its gradient are those of one process on the global
batch. Rollout is the classic FSDP trap: processes sample different numbers of turns and corrections, so with sharded
weights their per-forward all-gathers would deadlock: `gathered` all-gathers each layer once on every process and
turns resharding off for the whole rollout + RTI + scoring stretch (torchtune's GRPO recipe does the same).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM, Qwen3Config

import envs
import evaluate
import rti
from extras.chat_tools import ToolChat, takes_tools


@dataclass
class ScaleConfig(rti.Config):
    """rti.Config plus the flags of this file; every field is a flag."""

    device: str = (
        "cpu"  # "cpu" | "cuda" | "cuda:N" | "auto" (cuda when there is one); under torchrun
    )
    # "cuda" is each process's cuda:LOCAL_RANK
    dtype: str = (
        "fp32"  # "fp32" | "bf16": compute dtype; the weights too, except FSDP's fp32 master
    )
    # shards and LoRA's fp32 adapters
    gradient_checkpointing: bool = (
        False  # recompute each decoder layer's activations in backward (non-reentrant)
    )
    lora_r: int = 0  # > 0: train rank-r LoRA adapters on every linear layer (pip install peft)
    lora_alpha: float = 32.0
    attn_implementation: str = (
        ""  # "" = the model's default (sdpa); "eager" | "sdpa" | "flash_attention_2"
    )
    thinking: bool = (
        False  # thinking mode of chat templates that have one (Qwen3's enable_thinking)
    )
    fsdp: bool = False  # shard the model with FSDP2 across `torchrun --nproc_per_node N`

    def validate(self) -> None:
        """rti.Config's checks, then refuse a scale flag this machine cannot serve, saying what to install or change."""
        super().validate()

        def need(ok, name, why):
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')}: {why}")

        need(
            bool(re.fullmatch(r"cpu|auto|cuda(:\d+)?", self.device)),
            "device",
            f"must be cpu, cuda, cuda:N or auto, got {self.device!r}",
        )
        need(
            not self.device.startswith("cuda") or torch.cuda.is_available(),
            "device",
            f"CUDA is not available to this torch ({torch.__version__}): install a CUDA build of torch on a machine "
            "with an NVIDIA GPU, or use --device cpu",
        )
        need(self.dtype in ("fp32", "bf16"), "dtype", f"must be fp32 or bf16, got {self.dtype!r}")
        need(
            self.dtype != "bf16"
            or resolve_device(self.device).type != "cuda"
            or torch.cuda.is_bf16_supported(),
            "dtype",
            "this GPU has no bf16 (it needs compute capability 8.0, Ampere or newer): use --dtype fp32",
        )
        need(
            self.lora_r >= 0 and self.lora_alpha > 0,
            "lora_r",
            "lora_r must be >= 0 (0 = full fine-tune) and lora_alpha > 0",
        )
        need(
            not self.lora_r or importlib.util.find_spec("peft"),
            "lora_r",
            "LoRA needs the optional package peft: "
            "pip install peft (or train all weights: --lora-r 0)",
        )
        need(
            self.attn_implementation != "flash_attention_2"
            or importlib.util.find_spec("flash_attn"),
            "attn_implementation",
            "flash_attention_2 needs: pip install flash-attn (or use sdpa)",
        )
        world = int(os.environ.get("WORLD_SIZE", "1"))
        need(
            not self.fsdp or "WORLD_SIZE" in os.environ,
            "fsdp",
            "FSDP needs a process group and there is none: "
            "launch with `torchrun --nproc_per_node N -m extras.scale train --fsdp ...`, or drop --fsdp",
        )
        need(
            world == 1 or self.fsdp,
            "fsdp",
            f"started as {world} processes without --fsdp: add --fsdp (otherwise "
            "every process trains its own copy of the model)",
        )
        need(
            self.batch_tasks % world == 0,
            "batch_tasks",
            f"{self.batch_tasks} tasks do not split evenly across {world} processes",
        )


def resolve_device(name: str) -> torch.device:
    """`auto` is cuda when there is one, else cpu; under torchrun a bare `cuda` is this process's cuda:LOCAL_RANK."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(
        f"cuda:{os.environ['LOCAL_RANK']}"
        if name == "cuda" and "LOCAL_RANK" in os.environ
        else name
    )


class ScaleBackend(rti.Backend):
    """rti.Backend with the scale flags: attention kernel, gradient checkpointing, LoRA, a chat template with tools,
    and with --fsdp the process group, sharding, reductions, gathered inference and sharded checkpoints."""

    def __init__(self, cfg: ScaleConfig):
        super().__init__(cfg)
        self.device = resolve_device(cfg.device)
        self.dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
        if (
            cfg.fsdp and not dist.is_initialized()
        ):  # join the process group (nccl for GPUs, gloo for CPUs)
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        if dist.is_initialized():
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # FSDP keeps fp32 master shards and computes in bf16: AdamW updates of ~lr are below bf16's resolution
        self.dtype = torch.float32 if cfg.fsdp else self.dtype

    def prepare(self, model, tok, env: str) -> tuple:
        cfg = self.cfg
        if cfg.attn_implementation:
            model.set_attn_implementation(cfg.attn_implementation)
        model.to(self.dtype)
        if cfg.gradient_checkpointing:
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
        if cfg.lora_r:
            model = add_lora(model, cfg)
        if cfg.fsdp:
            shard_model(
                model, self.device, self.world, cfg.dtype
            )  # moves each layer's shard to this device
        else:
            model = model.to(self.device)
        return model, ToolChat(tok, env, cfg.thinking) if takes_tools(tok) else rti.Chat(tok, env)

    @contextmanager
    def gathered(self, model):
        """Hold FSDP2's parameters gathered for a stretch of inference (rollout, RTI, scoring, evaluation). Every
        process all-gathers every FSDP module once (the same collectives in the same order everywhere), turns
        resharding off, runs any number of purely local forwards, and reshards at the end. The price: the full
        weights in the compute dtype while inside (16 GB for Qwen3-8B in bf16). Nested uses gather once."""
        if not isinstance(model, FSDPModule) or getattr(model, "_rti_gathered", False):
            yield
            return
        modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for m in modules:
            m.unshard()
        model.set_reshard_after_forward(False)
        model._rti_gathered = True
        try:
            yield
        finally:
            model._rti_gathered = False
            set_training_resharding(model)
            for m in modules:
                m.reshard()

    def all_reduce(self, x: float, op: str = "sum") -> float:
        if self.world == 1:
            return x
        dev = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend() == "nccl"
            else torch.device("cpu")
        )
        t = torch.tensor([float(x)], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return t.item()

    def gather(self, obj) -> list:
        """[obj of process 0, obj of process 1, ...] on every process."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def reduce_metrics(self, metrics: dict) -> dict:
        """Integer counts are summed over processes, other numbers averaged (NaN ones skipped). Every process holds
        the same number of whole groups, so means of per-process means are global means; ratios of counts (flag
        rate, accept rate) are averaged, an approximation the counts themselves let one redo."""
        parts = self.gather(metrics)
        if len(parts) == 1:
            return metrics
        out = {}
        for k in dict.fromkeys(k for p in parts for k in p):
            vals = [p[k] for p in parts if k in p]
            if all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
                out[k] = sum(vals)
            else:
                finite = [float(v) for v in vals if not math.isnan(float(v))]
                out[k] = sum(finite) / len(finite) if finite else float("nan")
        return out

    def my_tasks(self, tasks: list) -> list:
        per = len(tasks) // self.world
        return tasks[self.rank * per : (self.rank + 1) * per]

    def evaluate(self, sampler, tasks: list, n: int, seed: int):
        """Every process samples its share of the tasks with the weights gathered; successes come back in order."""
        if self.world == 1:
            return super().evaluate(sampler, tasks, n, seed)
        per = math.ceil(len(tasks) / self.world)
        mine = tasks[self.rank * per : (self.rank + 1) * per]
        with self.gathered(sampler.model):
            part = (
                rti.evaluate_policy(sampler, mine, n, seed=seed + self.rank, per_task=True)[1]
                if mine
                else []
            )
        successes = [s for p in self.gather(part) for s in p]
        return evaluate.summarize(successes, k_max=min(4, n)), successes

    def save_checkpoint(self, path: Path, sampler, opt, state: dict) -> None:
        """Under FSDP a torch.distributed.checkpoint directory: every process writes its model and optimizer shards
        plus its own RNG states (rng-RANK.pt), beside the previous checkpoint and then moved over it."""
        if not isinstance(sampler.model, FSDPModule):
            return super().save_checkpoint(path, sampler, opt, state)
        path = path.with_suffix("")
        model_state, optim_state = get_state_dict(sampler.model, opt)
        tmp = path.with_name(path.name + ".tmp")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp))
        torch.save(state, tmp / f"rng-{self.rank}.pt")
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            os.replace(tmp, path)
        dist.barrier()

    def load_checkpoint(self, path: Path, sampler, opt) -> dict:
        if not isinstance(sampler.model, FSDPModule):
            return super().load_checkpoint(path, sampler, opt)
        path = path.with_suffix("")
        if not (path / f"rng-{self.rank}.pt").exists():
            raise FileNotFoundError(
                f"--resume: no sharded checkpoint for process {self.rank} in {path}"
            )
        model_state, optim_state = get_state_dict(sampler.model, opt)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(
            sampler.model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        return torch.load(path / f"rng-{self.rank}.pt", weights_only=False)

    def save_model(self, sampler, path: Path) -> None:
        """save_pretrained (only the adapters, with LoRA); under FSDP process 0 writes the gathered state dict."""
        state = None
        if isinstance(sampler.model, FSDPModule):
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state = get_model_state_dict(sampler.model, options=options)
            unique = dict(
                sampler.model.named_parameters()
            )  # a head tied to the embedding appears once here
            tied = {
                n for n, _ in sampler.model.named_parameters(remove_duplicate=False)
            } - unique.keys()
            state = {k: v for k, v in state.items() if k not in tied}
        if self.rank == 0:
            sampler.model.save_pretrained(path, state_dict=state)
            sampler.tok.save_pretrained(path)
        if self.world > 1:
            dist.barrier()


def add_lora(model, cfg: ScaleConfig):
    """Rank-r LoRA adapters (peft, an optional dependency) on every linear layer but the output head; only they train.
    peft keeps the adapters in fp32 when the base weights are bf16."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ImportError("--lora-r needs the optional package peft: pip install peft") from None
    model = get_peft_model(
        model,
        LoraConfig(
            r=cfg.lora_r,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=0.0,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        ),
    )
    if cfg.gradient_checkpointing:
        model.enable_input_require_grads()  # the frozen embeddings' output requires grad, so checkpointed blocks
    return model  # always see a grad-requiring input and the adapters get gradients


def shard_model(model, device: torch.device, world: int, dtype: str) -> None:
    """FSDP2: fully_shard every decoder layer (the classes in the model's `_no_split_modules`), then the root
    (embeddings, final norm, head). With bf16 the fp32 shards are all-gathered and computed in bf16, and gradients
    are reduced in fp32."""
    mesh = init_device_mesh(device.type, (world,))
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if dtype == "bf16"
        else MixedPrecisionPolicy()
    )
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"--fsdp: found no decoder layers to shard in {type(model).__name__} (_no_split_modules)"
        )
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    set_training_resharding(model)


def set_training_resharding(model) -> None:
    """FSDP2's training default: layers free their gathered weights after forward; the root keeps them (its
    backward runs first)."""
    model.set_reshard_after_forward(True)
    model.set_reshard_after_forward(False, recurse=False)


# ----------------------------------------------------------------------------- GPU smoke test

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
)  # Qwen3-8B's config.json
SMOKE = dict(
    device="cuda",
    dtype="bf16",
    gradient_checkpointing=True,
    batch_tasks=4,
    group_size=4,
    micro_batch=4,
)


def gpu_smoke(cfg: ScaleConfig, arch: dict = QWEN3_8B, steps: int = 2, log=print) -> dict:
    """RTI training steps of a randomly initialised Qwen3-8B built from its configuration (nothing is downloaded): by
    default in bf16 with gradient checkpointing on one GPU. Logs and returns the parameter count, peak memory and the
    time of each step (the first includes CUDA warm-up and AdamW's state allocation). Not part of CI.

    The tokenizer is the tiny word-level one (its few hundred ids are ids of the 8B vocabulary too) and a random model
    never succeeds, so the steps use the rule corrector without the PPL gate: corrections give each group a spread."""
    cfg = dataclasses.replace(
        cfg,
        init="",
        train_split="easy",
        method="rti",
        rti=dataclasses.replace(cfg.rti, corrector="rule", ppl_gate=False, max_corrections=100),
    )
    cfg.validate()
    backend = ScaleBackend(cfg)
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


def main(argv=None) -> None:
    command, _, cfg = rti.parse_args(
        argv, ScaleConfig, ("train", "eval", "gpu-smoke"), prog="-m extras.scale"
    )
    torch.set_num_threads(cfg.threads)
    if command == "gpu-smoke":  # flags left at their training defaults take the values in SMOKE
        defaults = rti.make_config(ScaleConfig)
        try:
            gpu_smoke(
                dataclasses.replace(
                    cfg,
                    **{k: v for k, v in SMOKE.items() if getattr(cfg, k) == getattr(defaults, k)},
                )
            )
        except ValueError as e:
            sys.exit(f"gpu-smoke: {e}")
        return
    t0 = time.time()
    backend = ScaleBackend(cfg)
    if command == "eval":  # python -m extras.scale eval MODEL_DIR --device cuda ...
        print(rti.eval_table(cfg, backend))
        return
    res = rti.train(cfg, backend=backend)
    if backend.rank == 0:
        print(rti.report(cfg, res, time.time() - t0))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
