"""rti.py on GPUs: devices and bf16, gradient checkpointing, LoRA, FSDP2, a memory plan; optional
(extras/).

    python -m extras.scale plan --model-config Qwen3-8B-like --gpus 8 --gpu-mem 141 --context 8192
    python -m extras.scale train --model /models/Qwen3-8B --device cuda --dtype bf16 --lora-r 16 ...
    torchrun --nproc_per_node 8 -m extras.scale train --fsdp --model /models/Qwen3-8B ...
    python -m extras.scale eval MODEL_DIR --device cuda --dtype bf16   # pass@k on a GPU
    python -m extras.scale gpu-smoke [--lora-r 16]   # two RTI steps of a random Qwen3-8B

`ScaleConfig` adds the scale flags to rti.Config, and `ScaleBackend` plugs them into rti's loop
through rti.Backend (the loop's one question: where does the model run). The mechanisms live in
their own files: extras/lora.py (the adapters), extras/fsdp.py (sharding across torchrun
processes, and fp32 master weights on one), extras/plan.py (the memory plan, checked before
loading), extras/chat_tools.py (a real chat model's template with tools) and extras/gpu_smoke.py
(the smoke test this command runs).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

import evaluate
import rti
import runtime
from extras import fsdp, plan
from extras.chat_tools import ToolChat, takes_tools
from extras.gpu_smoke import SMOKE, gpu_smoke
from extras.lora import PEFT_INSTALL, add_lora
from loss import require, require_choices
from policy import Chat

PROG = "-m extras.scale"
COMMANDS = ("train", "eval", "gpu-smoke", "plan")
DTYPES = ("fp32", "bf16")


@dataclass
class ScaleConfig(rti.Config):
    """rti.Config plus the flags of this file; every field is a flag."""

    device: str = field(
        default="cpu",
        metadata={
            "help": "cpu, cuda, cuda:N or auto (cuda when there is one); under torchrun a bare "
            "cuda is each process's cuda:LOCAL_RANK"
        },
    )
    dtype: str = field(
        default="fp32",
        metadata={
            "help": "compute dtype; the trained weights stay fp32 (FSDP's shards, fp32 master "
            "weights on one process, LoRA's adapters) unless --no-master-weights",
            "choices": DTYPES,
        },
    )
    master_weights: bool = field(
        default=True,
        metadata={
            "help": "bf16 full fine-tuning on one process keeps fp32 master weights and fp32 "
            "AdamW states (FSDP2 on a group of one: 16 bytes a parameter, bf16 compute); "
            "--no-master-weights: bf16 weights and states (8 bytes a parameter; an AdamW step "
            "smaller than half of bf16's spacing, 0.2-0.4%% of the weight, is lost)"
        },
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata={"help": "recompute each decoder layer's activations in backward (non-reentrant)"},
    )
    lora_r: int = field(
        default=0,
        metadata={
            "help": "> 0: train rank-r LoRA adapters on every linear layer but the head, and "
            f"nothing else ({PEFT_INSTALL}); 0: train all weights"
        },
    )
    lora_alpha: float = field(
        default=32.0,
        metadata={"help": "LoRA scaling: the adapters' product is scaled by alpha / r"},
    )
    attn_implementation: str = field(
        default="",
        metadata={
            "help": "attention kernel as transformers names it: '' = the model's default (sdpa), "
            "eager, sdpa, flash_attention_2 (pip install flash-attn), ..."
        },
    )
    thinking: bool = field(
        default=False,
        metadata={
            "help": "thinking mode of chat templates that have one (Qwen3's enable_thinking)"
        },
    )
    fsdp: bool = field(
        default=False,
        metadata={"help": "shard the model with FSDP2 across `torchrun --nproc_per_node N`"},
    )
    context: int = field(
        default=0,
        metadata={
            "help": "tokens of the longest episode the run plans for (prompt included): the "
            "memory plan's unit; > 0 also checks the plan before loading on a CUDA device and "
            "sizes evaluation's decoding batches; 0: no check (plan: the model's positions)"
        },
    )
    prompt_tokens: int = field(
        default=0,
        metadata={
            "help": "memory plan: tokens of an episode's first message, which the rollout's first "
            "forward pass feeds for every row at once (tau2-telecom's system prompt and tools: "
            "about 10k); 0: --context"
        },
    )
    decode_tokens: int = field(
        default=0,
        metadata={
            "help": "token budget of one decoding batch, rows x --context: evaluation decodes "
            "decode_tokens // context episodes at once; 0: as many as the memory plan leaves "
            "room for with --context, else 256 episodes (rti.evaluate_policy's default)"
        },
    )
    model_config: str = field(
        default="",
        metadata={
            "help": "memory plan: the architecture, a preset ("
            + ", ".join(plan.PRESETS)
            + ") or a config.json (or its directory); '' = --model's"
        },
    )
    gpus: int = field(
        default=0,
        metadata={"help": "memory plan: GPUs (FSDP2 when > 1); 0: torchrun's processes, or 1"},
    )
    gpu_mem: float = field(
        default=0.0,
        metadata={
            "help": "memory plan: GiB of one GPU (141 for an H200, 80 for an H100); 0: the "
            "CUDA device's own"
        },
    )

    def validate(self) -> None:
        """rti.Config's checks, then refuse a scale flag this machine cannot serve, saying what to
        install or change (loss.require, as every config)."""
        super().validate()
        require_choices(self)
        require(
            self,
            "device",
            bool(re.fullmatch(r"cpu|auto|cuda(:\d+)?", self.device)),
            "must be cpu, cuda, cuda:N or auto",
        )
        require(
            self,
            "device",
            not self.device.startswith("cuda") or torch.cuda.is_available(),
            f"CUDA is not available to this torch ({torch.__version__}): install a CUDA build of "
            "torch on a machine with an NVIDIA GPU, or use --device cpu",
        )
        require(
            self,
            "dtype",
            self.dtype != "bf16"
            or resolve_device(self.device).type != "cuda"
            or torch.cuda.is_bf16_supported(),
            "this GPU has no bf16 (it needs compute capability 8.0, Ampere or newer): "
            "use --dtype fp32",
        )
        require(self, "lora_r", self.lora_r >= 0, "must be >= 0 (0 = full fine-tune)")
        require(self, "lora_alpha", self.lora_alpha > 0, "must be > 0")
        require(
            self,
            "attn_implementation",
            self.attn_implementation != "flash_attention_2"
            or importlib.util.find_spec("flash_attn"),
            "flash_attention_2 needs: pip install flash-attn (or use sdpa)",
        )
        for name in ("context", "prompt_tokens", "decode_tokens", "gpus", "gpu_mem"):
            require(self, name, getattr(self, name) >= 0, "must be >= 0")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        require(
            self,
            "fsdp",
            not self.fsdp or "WORLD_SIZE" in os.environ,
            "FSDP needs a process group and there is none: launch with "
            "`torchrun --nproc_per_node N -m extras.scale train --fsdp ...`, or drop --fsdp",
        )
        require(
            self,
            "fsdp",
            world == 1 or self.fsdp,
            f"started as {world} processes without --fsdp: add --fsdp (otherwise "
            "every process trains its own copy of the model)",
        )
        require(
            self,
            "batch_tasks",
            self.batch_tasks % world == 0,
            f"must split evenly across the {world} processes",
        )


def resolve_device(name: str) -> torch.device:
    """`auto` is cuda when there is one, else cpu; under torchrun a bare `cuda` is this process's
    cuda:LOCAL_RANK."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and "LOCAL_RANK" in os.environ:
        name = f"cuda:{os.environ['LOCAL_RANK']}"
    return torch.device(name)


class ScaleBackend(rti.Backend):
    """rti.Backend with the scale flags: device and dtype, attention kernel, gradient
    checkpointing, LoRA, a chat template with tools, the memory plan, and with --fsdp (or fp32
    master weights on one process) the process group, sharding, reductions across processes,
    gathered inference and sharded checkpoints (extras/fsdp.py).

    Sharded runs keep fp32 shards and compute in the --dtype (fsdp.shard_model): AdamW updates of
    about lr are below bf16's resolution. Their weights load in the --dtype (Qwen3's checkpoints
    are bf16: nothing is lost) and become fp32 layer by layer as they are sharded, so no process
    holds an fp32 copy of the whole model (8 processes loading Qwen3-8B held 262 GB of host memory
    in fp32; in bf16, 131 GB, and fp32 one layer at a time)."""

    def __init__(self, cfg: ScaleConfig):
        self.cfg = cfg
        if cfg.lora_r and not importlib.util.find_spec(
            "peft"
        ):  # a plan needs no adapter: not in validate
            raise ValueError(
                f"--lora-r: LoRA needs the optional package peft: {PEFT_INSTALL} "
                "(or train all weights: --lora-r 0)"
            )
        self.device = resolve_device(cfg.device)
        self.plan = None
        if self.device.type == "cuda" and cfg.context and (cfg.model_config or cfg.model != "tiny"):
            # before anything is loaded: ValueError naming flags that fit (the tiny model fits)
            self.plan = plan.check(cfg, plan.plan_gpus(cfg), self.gpu_gib())
        full_bf16 = cfg.dtype == "bf16" and not cfg.lora_r
        self.master = full_bf16 and cfg.master_weights and not cfg.fsdp
        self.sharded = cfg.fsdp or self.master
        if self.sharded:
            fsdp.join_process_group(self.device)
        if dist.is_initialized():
            self.rank = dist.get_rank()
            self.world = dist.get_world_size()
        self.dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32

    def gpu_gib(self) -> float:
        """--gpu-mem, or the CUDA device's memory in GiB."""
        if self.cfg.gpu_mem:
            return self.cfg.gpu_mem
        return torch.cuda.get_device_properties(self.device).total_memory / plan.GIB

    def prepare(self, model, tok, env: str) -> tuple:
        cfg = self.cfg
        if cfg.attn_implementation:
            model.set_attn_implementation(cfg.attn_implementation)
        if not self.sharded:
            model.to(self.dtype)
        if cfg.gradient_checkpointing:
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
        if cfg.lora_r:
            model = add_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.gradient_checkpointing)
        if self.sharded:
            # fp32 shards, layer by layer, each on this device
            fsdp.shard_model(model, self.device, self.world, cfg.dtype)
        else:
            model = model.to(self.device)
        if takes_tools(tok):
            return model, ToolChat(tok, env, cfg.thinking)
        return model, Chat(tok, env)

    def gathered(self, model):
        return fsdp.gathered(model)

    def all_reduce(self, x: float, op: str = "sum") -> float:
        if self.world == 1:
            return x
        return fsdp.all_reduce(x, op)

    def accumulation(self, total: float, micro_batches: list[list[int]]) -> tuple:
        """The global mini-batch across processes: its loss denominator (tokens or rows summed over
        the processes) over the world size, as FSDP averages the processes' gradients, and as many
        micro-batches here as the busiest process runs (empty ones, for the collectives)."""
        if self.world == 1:
            return total, micro_batches
        busiest = int(self.all_reduce(len(micro_batches), "max"))
        empty = [[] for _ in range(busiest - len(micro_batches))]
        return self.all_reduce(total) / self.world, micro_batches + empty

    def gather(self, obj) -> list:
        """[obj of process 0, obj of process 1, ...] on every process."""
        if self.world == 1:
            return [obj]
        return fsdp.all_gather(obj)

    def reduce_metrics(self, metrics: dict) -> dict:
        parts = self.gather(metrics)
        if len(parts) == 1:
            return metrics
        return fsdp.combine_metrics(parts)

    def my_tasks(self, tasks: list) -> list:
        per = len(tasks) // self.world
        return tasks[self.rank * per : (self.rank + 1) * per]

    def decode_rows(self, n: int) -> int:
        """Episodes one evaluation batch decodes at once: --decode-tokens // --context, or what
        the memory plan leaves room for, or rti's 256; whole tasks of n samples, one at least."""
        cfg = self.cfg
        if cfg.decode_tokens and cfg.context:
            rows = cfg.decode_tokens // cfg.context
        elif self.plan is not None:
            rows = self.plan.rows_fit
        else:
            rows = 256
        return max(n, rows // n * n)

    def evaluate(self, sampler, tasks: list, n: int, seed: int):
        """Every process samples its share of the tasks with the weights gathered, decode_rows
        episodes at a time; successes come back in order."""
        chunk = self.decode_rows(n)
        if self.world == 1:
            with self.gathered(sampler.model):
                return rti.evaluate_policy(sampler, tasks, n, seed=seed, chunk=chunk, per_task=True)
        per = math.ceil(len(tasks) / self.world)
        mine = tasks[self.rank * per : (self.rank + 1) * per]
        part = []
        with self.gathered(sampler.model):
            if mine:
                seed_here = seed + self.rank
                part = rti.evaluate_policy(
                    sampler, mine, n, seed=seed_here, chunk=chunk, per_task=True
                )[1]
        successes = [s for p in self.gather(part) for s in p]
        return evaluate.summarize(successes, k_max=min(4, n)), successes

    def save_checkpoint(self, path: Path, sampler, opt, state: dict) -> None:
        """Under FSDP a sharded checkpoint directory (fsdp.save_sharded) at `path` without its
        suffix."""
        if not fsdp.is_sharded(sampler.model):
            return super().save_checkpoint(path, sampler, opt, state)
        fsdp.save_sharded(path.with_suffix(""), sampler.model, opt, state, self.rank)

    def load_checkpoint(self, path: Path, sampler, opt) -> dict:
        if not fsdp.is_sharded(sampler.model):
            return super().load_checkpoint(path, sampler, opt)
        return fsdp.load_sharded(path.with_suffix(""), sampler.model, opt, self.rank)

    def save_model(self, sampler, path: Path) -> None:
        """save_pretrained (only the adapters, with LoRA); under FSDP process 0 writes the gathered
        state dict."""
        state = None
        if fsdp.is_sharded(sampler.model):
            state = fsdp.full_state_dict(sampler.model)
        if self.rank == 0:
            sampler.model.save_pretrained(path, state_dict=state)
            sampler.tok.save_pretrained(path)
        if self.world > 1:
            dist.barrier()


# ----------------------------------------------------------------------------- command line


def build_parser():
    return runtime.build_parser(ScaleConfig, COMMANDS, PROG)


def smoke(cfg: ScaleConfig) -> None:
    """The gpu-smoke command: gpu_smoke with SMOKE's values for the flags left at their training
    defaults."""
    defaults = runtime.make_config(ScaleConfig)
    unset = {k: v for k, v in SMOKE.items() if getattr(cfg, k) == getattr(defaults, k)}
    try:
        gpu_smoke(dataclasses.replace(cfg, **unset), ScaleBackend)
    except ValueError as e:
        sys.exit(f"gpu-smoke: {e}")


def print_plan(cfg: ScaleConfig) -> None:
    """The plan command: the memory plan of the run's flags (extras/plan.py), before anything is
    loaded; exit 1 when the run does not fit, naming flags that do."""
    gpus = plan.plan_gpus(cfg)
    gpu_gib = cfg.gpu_mem
    if not gpu_gib and torch.cuda.is_available():
        gpu_gib = torch.cuda.get_device_properties(0).total_memory / plan.GIB
    try:
        run_plan = plan.check(cfg, gpus, gpu_gib)
    except ValueError as e:
        sys.exit(f"plan: {e}")
    print(plan.format_plan(run_plan, plan.plan_flags(cfg)))


def main(argv=None) -> None:
    command, _, cfg = runtime.parse_args(argv, ScaleConfig, COMMANDS, prog=PROG)
    torch.set_num_threads(cfg.threads)
    if command == "plan":
        print_plan(cfg)
        return
    if command == "gpu-smoke":
        smoke(cfg)
        return
    t0 = time.time()
    try:
        backend = ScaleBackend(cfg)
    except ValueError as e:  # the memory plan says the run does not fit
        sys.exit(f"{command}: {e}")
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
