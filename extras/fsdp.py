"""FSDP2 across the processes of torchrun, for rti.py's loop; optional (extras/).

    torchrun --nproc_per_node 8 -m extras.scale train --fsdp --model /models/Qwen3-8B ...

extras/scale.py's ScaleBackend calls these functions when --fsdp is on. Every process takes
`batch_tasks / N` whole groups of each batch (group advantages need no communication), samples
and intervenes on them, and all processes then run the same number of micro-batch
forward/backward passes; token counts are summed across processes so that the loss and its
gradient are those of one process on the global batch.

Without torchrun (--dtype bf16 full fine-tuning on one process) the same sharding runs on a group
of one process: FSDP2 then keeps the fp32 master weights, the fp32 gradients and AdamW's fp32
states, and computes in bf16 (extras/scale.py).

Rollout is the classic FSDP trap: processes sample different numbers of turns and corrections, so
with sharded weights their per-forward all-gathers would deadlock. `gathered` all-gathers each
layer once on every process and turns resharding off for the whole rollout + RTI + scoring
stretch (torchtune's GRPO recipe does the same).
"""

from __future__ import annotations

import math
import os
import shutil
from contextlib import contextmanager
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
from torch.distributed.tensor import DTensor

import loss

# ----------------------------------------------------------------------------- processes


def join_process_group(device: torch.device) -> None:
    """Join torchrun's process group, once: nccl between GPUs (this process on `device`), gloo
    between CPUs. Without torchrun (no WORLD_SIZE): a group of this process alone."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def all_reduce(x: float, op: str = "sum") -> float:
    """x summed (op "sum") or maxed (op "max") over the processes, in float64."""
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    t = torch.tensor([float(x)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.item()


def all_gather(obj) -> list:
    """[obj of process 0, obj of process 1, ...] on every process (any picklable object)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def combine_metrics(parts: list[dict]) -> dict:
    """The processes' metrics of a step as one dict: the loss's figures joined by the tokens each
    is over (loss.combine_metrics), integer counts and sums (names ending in _sum, as the gate's
    PPL sums) added up, other numbers averaged (NaN ones skipped). Every process holds the same
    number of whole groups, so means of per-process means are global means; ratios of counts
    (flag rate, accept rate) are averaged, an approximation the counts themselves let one redo."""
    over_tokens = {k for figures in loss.COMBINED_OVER.values() for k in figures}
    out = loss.combine_metrics(
        [{k: v for k, v in p.items() if k in over_tokens or k.startswith("tokens/")} for p in parts]
    )
    for k in dict.fromkeys(k for p in parts for k in p):
        if k in out:
            continue
        vals = [p[k] for p in parts if k in p]
        finite = [v for v in vals if not math.isnan(float(v))]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
            out[k] = sum(vals)
        elif k.endswith("_sum"):
            out[k] = float(sum(finite))
        else:
            out[k] = sum(map(float, finite)) / len(finite) if finite else float("nan")
    return out


# ----------------------------------------------------------------------------- sharding


def is_sharded(model) -> bool:
    return isinstance(model, FSDPModule)


def shard_model(model, device: torch.device, world: int, dtype: str) -> None:
    """fully_shard every decoder layer (the classes in the model's `_no_split_modules`), then the
    root (embeddings, final norm, head); each process keeps its shard on `device`. Shards are
    fp32 whatever the weights loaded in: each module's weights become fp32 just before it is
    sharded, so the whole model never exists in fp32 at once. With dtype "bf16" the fp32 shards
    are all-gathered and computed in bf16, and gradients are reduced in fp32."""
    mesh = init_device_mesh(device.type, (world,))
    if dtype == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"--fsdp: found no decoder layers to shard in {type(model).__name__} "
            "(_no_split_modules)"
        )
    for layer in layers:
        to_fp32(layer)
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    to_fp32(model)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    set_training_resharding(model)


def to_fp32(module) -> None:
    """The module's floating-point weights that are not sharded yet, in fp32, one at a time (a
    tied weight once)."""
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != torch.float32 and not isinstance(p, DTensor):
            p.data = p.data.float()


def set_training_resharding(model) -> None:
    """FSDP2's training default: layers free their gathered weights after forward; the root keeps
    them (its backward runs first)."""
    model.set_reshard_after_forward(True)
    model.set_reshard_after_forward(False, recurse=False)


@contextmanager
def gathered(model):
    """Hold a sharded model's parameters gathered for a stretch of inference (rollout, RTI,
    scoring, evaluation). Every process all-gathers every FSDP module once (the same collectives
    in the same order everywhere), turns resharding off, runs any number of purely local forwards,
    and reshards at the end. The price: the full weights in the compute dtype while inside (16 GB
    for Qwen3-8B in bf16). Nested uses gather once; an unsharded model is left as it is."""
    if not is_sharded(model) or getattr(model, "_rti_gathered", False):
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


# ----------------------------------------------------------------------------- checkpoints


def save_sharded(path: Path, model, opt, state: dict, rank: int) -> None:
    """A torch.distributed.checkpoint directory at `path`: every process writes its model and
    optimizer shards plus its own `state` (RNG states: rng-RANK.pt), beside the previous checkpoint
    and then moved over it."""
    model_state, optim_state = get_state_dict(model, opt)
    tmp = path.with_name(path.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp))
    torch.save(state, tmp / f"rng-{rank}.pt")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    dist.barrier()


def load_sharded(path: Path, model, opt, rank: int) -> dict:
    """Restore the model and optimizer shards that save_sharded wrote; return this process's
    state."""
    if not (path / f"rng-{rank}.pt").exists():
        raise FileNotFoundError(f"--resume: no sharded checkpoint for process {rank} in {path}")
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return torch.load(path / f"rng-{rank}.pt", weights_only=False)


def full_state_dict(model) -> dict:
    """The whole model's weights gathered on the CPU (every process takes part), for
    save_pretrained; a head tied to the embedding is left out, as save_pretrained expects."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    unique = dict(model.named_parameters())  # a tied head appears once here
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - unique.keys()
    return {k: v for k, v in state.items() if k not in tied}
