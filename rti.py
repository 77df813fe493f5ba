"""Rollout-Time Intervention (RTI) trainer: policy, batched multi-turn sampling, warm start, GRPO/RTI loop.

    python rti.py                      # the demo: tiny Qwen3, warm start (cached), RTI training, before/after table
    python rti.py warmstart            # (re)build the warm-start checkpoint the demo and the comparison reuse
    python rti.py --method grpo --steps 40 --out runs/grpo
    python rti.py --help               # every Config field is a flag

Data flows one way: envs (tasks, rubric) -> rollout here -> intervene.py (RTI) -> loss.py -> AdamW.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import random
import re
import sys
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import envs
import evaluate
import loss as rl_loss
from loss import INTERVENED, POLICY

WARMSTART_DIR = "checkpoints/warmstart"


# ----------------------------------------------------------------------------- config

@dataclass
class Config:
    """Every field is a command-line flag (`--field-name`); booleans also have `--no-field-name`."""
    # model
    model: str = "tiny"                 # "tiny" (built from a config) or a local Hugging Face model directory
    init: str = WARMSTART_DIR           # starting weights for training ("" = the model as built/loaded)
    seed: int = 0
    threads: int = 2                    # torch CPU threads (2 measured faster than 1 here for these batch sizes)
    # tasks and sampling
    env: str = "navigation"             # "navigation" | "tau2-telecom" | "tau2-airline" | "tau2-retail" (envs.ENVS)
    user_model: str = ""                # tau2 airline/retail user: "" = the policy model, "scripted", or a directory
    train_split: str = "train"
    test_split: str = "test"
    batch_tasks: int = 16               # B tasks per step
    group_size: int = 8                 # G trajectories per task
    temperature: float = 1.0
    top_p: float = 1.0
    max_turn_tokens: int = 4            # new tokens per agent turn
    # optimisation
    method: str = "rti"                 # "grpo" | "rti"
    steps: int = 12
    lr: float = 1e-4                    # 3e-4 and 1e-3 degraded the tiny policy within a step (measured)
    weight_decay: float = 0.0
    updates_per_batch: int = 1
    warmup_steps: int = 0               # linear learning-rate warm-up over the first N steps
    micro_batch: int = 64               # trajectories per forward/backward; the micro-batches of a batch accumulate
                                        # their gradients into one optimizer step (gradient accumulation)
    grad_clip: float = 1.0
    # loss (loss.py)
    clip_low: float = 0.2
    clip_high: float = 0.28
    is_mode: str = "calibrated"
    reweight: bool = True
    w_min: float = 0.2
    w_max: float = 3.0
    kl_coef: float = 0.0
    agg: str = "token-mean"
    ratio_level: str = "token"
    scale_advantages: bool = True
    # RTI (intervene.py)
    validator: str = "rubric"           # "rubric" | "llm"
    corrector: str = "self"             # "self" | "rule"
    verifier: str = "rubric"            # "rubric" | "llm"
    verify: bool = True                 # --no-verify: accept every rewrite (ablation)
    ppl_gate: bool = True               # --no-ppl-gate (ablation)
    ppl_max: float = 4.0
    correction_tries: int = 3
    max_corrections: int = 8            # per trajectory
    intervene_per_group: int = 0        # failed trajectories corrected per triggered group; 0 = half (our choice: a
                                        # group whose corrections all succeed would have no spread again)
    # evaluation, logging, checkpoints
    eval_every: int = 10
    eval_samples: int = 4
    eval_tasks: int = 100               # first N tasks of the test split (the comparison uses all 150)
    eval_before: bool = True            # evaluate the starting policy too (the comparison does it once, not per run)
    out: str = "runs/demo"
    resume: bool = False
    save_every: int = 10
    progress: bool = True
    # warm start (python rti.py warmstart)
    ws_split: str = "easy"
    ws_steps: int = 1500
    ws_batch: int = 32
    ws_lr: float = 3e-3
    ws_hint_frac: float = 0.3           # share of teacher turns with the rubric hint before the action
    ws_obs_weight: float = 1.0          # auxiliary next-token loss on observation tokens
    ws_out: str = WARMSTART_DIR
    # scale: GPUs and several GPUs (README "Scaling to 8B"); the defaults keep the tiny CPU demo as it is
    device: str = "cpu"                 # "cpu" | "cuda" | "cuda:N" | "auto" (cuda when available); under torchrun
                                        # "cuda" is each process's cuda:LOCAL_RANK
    dtype: str = "fp32"                 # "fp32" | "bf16": compute dtype; the weights too, except FSDP's fp32 master
                                        # shards and LoRA's fp32 adapters
    gradient_checkpointing: bool = False   # recompute each decoder layer's activations in backward (non-reentrant)
    lora_r: int = 0                     # > 0: train rank-r LoRA adapters on every linear layer (pip install peft)
    lora_alpha: float = 32.0
    attn_implementation: str = ""       # "" = the model's default (sdpa); "eager" | "sdpa" | "flash_attention_2"
    thinking: bool = False              # thinking mode of chat templates that have one (Qwen3's enable_thinking)
    fsdp: bool = False                  # shard the model with FSDP2 across `torchrun --nproc_per_node N rti.py ...`

    def validate(self) -> None:
        """Raise ValueError naming the flag for any bad value."""
        def bad(flag, msg):
            raise ValueError(f"--{flag.replace('_', '-')}: {msg}")
        if self.group_size < 2:
            bad("group_size", f"must be >= 2 for group advantages, got {self.group_size}")
        for name in ("batch_tasks", "max_turn_tokens", "updates_per_batch", "micro_batch", "eval_samples",
                     "ws_batch", "correction_tries", "threads", "save_every", "steps", "ws_steps", "eval_every",
                     "eval_tasks", "max_corrections", "warmup_steps"):
            low = 0 if name in ("steps", "ws_steps", "eval_every", "eval_tasks", "max_corrections",
                                "warmup_steps") else 1
            if getattr(self, name) < low:
                bad(name, f"must be >= {low}, got {getattr(self, name)}")
        if not 0 < self.clip_low < 1:
            bad("clip_low", f"must be in (0, 1), got {self.clip_low}")
        if not 0 < self.clip_high:
            bad("clip_high", f"must be > 0, got {self.clip_high}")
        if self.temperature <= 0:
            bad("temperature", f"must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        for name in ("lr", "ws_lr"):
            if getattr(self, name) <= 0:
                bad(name, f"must be > 0, got {getattr(self, name)}")
        if not 0 <= self.ws_hint_frac <= 1:
            bad("ws_hint_frac", f"must be in [0, 1], got {self.ws_hint_frac}")
        if not 0 <= self.intervene_per_group <= self.group_size:
            bad("intervene_per_group", f"must be in [0, group size {self.group_size}], got {self.intervene_per_group}")
        if self.ppl_max <= 1:
            bad("ppl_max", f"must be > 1 (a perplexity), got {self.ppl_max}")
        choices = {"method": ("grpo", "rti"), "validator": ("rubric", "llm"), "corrector": ("self", "rule"),
                   "verifier": ("rubric", "llm", "none")}
        for name, ok in choices.items():
            if getattr(self, name) not in ok:
                bad(name, f"must be one of {ok}, got {getattr(self, name)!r}")
        if self.model != "tiny" and not Path(self.model).is_dir():
            bad("model", f"{self.model!r} is neither 'tiny' nor a local model directory (nothing is downloaded)")
        if self.env not in envs.ENVS:
            bad("env", f"must be one of {list(envs.ENVS)}, got {self.env!r}")
        try:
            splits = envs.env_splits(self.env)
        except ImportError as e:
            bad("env", str(e))
        for name in ("train_split", "test_split", "ws_split"):
            known = envs.SPLITS if name == "ws_split" else splits
            if getattr(self, name) not in known:
                bad(name, f"unknown split {getattr(self, name)!r} of {self.env if name != 'ws_split' else 'navigation'}"
                          f"; known: {sorted(known)}")
        if self.env != "navigation" and self.model == "tiny" and self.init:
            bad("init", f"the tiny warm start is a Navigation model; with --env {self.env} pass --init '' (a random "
                        "tiny model, a plumbing check) or --model PATH (a local chat model)")
        if self.user_model not in ("", "scripted") and not Path(self.user_model).is_dir():
            bad("user_model", f"{self.user_model!r} is neither '', 'scripted' nor a local model directory")
        self.loss_config()  # loss.py validates its own fields
        self.validate_scale()

    def validate_scale(self) -> None:
        """Refuse a scale flag this machine cannot serve, saying what to install or change (ValueError)."""
        def bad(flag, msg):
            raise ValueError(f"--{flag.replace('_', '-')}: {msg}")
        if self.dtype not in ("fp32", "bf16"):
            bad("dtype", f"must be fp32 or bf16, got {self.dtype!r}")
        if self.lora_r < 0 or self.lora_alpha <= 0:
            bad("lora_r/lora_alpha", "lora_r must be >= 0 (0 = full fine-tune) and lora_alpha > 0")
        if not re.fullmatch(r"cpu|auto|cuda(:\d+)?", self.device):
            bad("device", f"must be cpu, cuda, cuda:N or auto, got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            bad("device", f"CUDA is not available to this torch ({torch.__version__}): install a CUDA build of torch "
                          "on a machine with an NVIDIA GPU, or use --device cpu")
        if self.dtype == "bf16" and resolve_device(self.device).type == "cuda" and not torch.cuda.is_bf16_supported():
            bad("dtype", "this GPU has no bf16 (it needs compute capability 8.0, Ampere or newer): use --dtype fp32")
        if self.lora_r and importlib.util.find_spec("peft") is None:
            bad("lora_r", "LoRA needs the optional package peft: pip install peft (or train all weights: --lora-r 0)")
        if self.attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
            bad("attn_implementation", "flash_attention_2 needs: pip install flash-attn (or use sdpa)")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if self.fsdp and "WORLD_SIZE" not in os.environ:
            bad("fsdp", "FSDP needs a process group and there is none: launch with "
                        "`torchrun --nproc_per_node N rti.py --fsdp ...`, or drop --fsdp")
        if world > 1 and not self.fsdp:
            bad("fsdp", f"started as {world} processes without --fsdp: add --fsdp (otherwise every process trains its "
                        "own copy of the model)")
        if self.batch_tasks % world:
            bad("batch_tasks", f"{self.batch_tasks} tasks do not split evenly across {world} processes")

    def loss_config(self) -> rl_loss.LossConfig:
        try:
            return rl_loss.LossConfig(
                clip_low=self.clip_low, clip_high=self.clip_high, is_mode=self.is_mode, reweight=self.reweight,
                w_min=self.w_min, w_max=self.w_max, kl_coef=self.kl_coef, agg=self.agg, ratio_level=self.ratio_level)
        except ValueError as e:
            raise ValueError(f"loss flag: {e}") from None


def parse_args(argv=None) -> tuple[str, Config]:
    p = argparse.ArgumentParser(description="RTI: Rollout-Time Intervention for agentic RL (toy Navigation).",
                                usage="python rti.py [train | warmstart | gpu-smoke] [--flag VALUE ...]  (--help lists them)")
    p.add_argument("command", nargs="?", default="train", choices=("train", "warmstart", "gpu-smoke"))
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            typ = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            p.add_argument(flag, type=typ, default=f.default, metavar=typ.__name__.upper())
    args = vars(p.parse_args(argv))
    command = args.pop("command")
    cfg = Config(**args)
    try:
        cfg.validate()
    except ValueError as e:
        p.error(str(e))
    return command, cfg


# ----------------------------------------------------------------------------- model and tokenizer

SPECIAL = ["<pad>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>", "<|im_end|>"]
TINY_TEMPLATE = (   # compact: a turn costs 2 marker tokens plus the agent's eos (14 tokens a Navigation turn)
    "{% for m in messages %}{% if not loop.first %} {% endif %}<|{{ m['role'] }}|> {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %} <|im_end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %} <|assistant|>{% endif %}")


def build_tiny_tokenizer(words):
    """Word-level tokenizer over `words` (whitespace split), wrapped as a PreTrainedTokenizerFast with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {}
    for w in SPECIAL + list(words):
        vocab.setdefault(w, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                   eos_token="<|im_end|>", chat_template=TINY_TEMPLATE)


def build_tiny_model(vocab_size: int, seed: int = 0):
    """A 0.8M-parameter Qwen3 (DESIGN.md section 7): hidden 128, 4 layers, 4 heads, 2 KV heads, head_dim 32."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                      tie_word_embeddings=True, pad_token_id=0, eos_token_id=SPECIAL.index("<|im_end|>"))
    return Qwen3ForCausalLM(cfg)


def load_model(path_or_tiny: str, seed: int = 0, dtype: torch.dtype = torch.float32, env: str = "navigation"):
    """`tiny` builds model + tokenizer (over the words of `env`) from scratch; a directory loads any local Hugging Face
    causal LM (no download)."""
    if path_or_tiny == "tiny":
        import intervene
        tok = build_tiny_tokenizer(envs.env_class(env).vocabulary() + intervene.PROMPT_WORDS)
        return build_tiny_model(len(tok), seed).to(dtype), tok
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not Path(path_or_tiny).is_dir():
        raise FileNotFoundError(f"model directory {path_or_tiny!r} not found (nothing is downloaded)")
    tok = AutoTokenizer.from_pretrained(path_or_tiny, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path_or_tiny, local_files_only=True, dtype=dtype)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


# ----------------------------------------------------------------------------- scale: device, dtype, LoRA, FSDP2

def resolve_device(name: str) -> torch.device:
    """`auto` is cuda when there is one, else cpu; under torchrun a bare `cuda` is this process's cuda:LOCAL_RANK."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and "LOCAL_RANK" in os.environ:
        name = f"cuda:{os.environ['LOCAL_RANK']}"
    return torch.device(name)


def weight_dtype(cfg: Config) -> torch.dtype:
    """The dtype the weights are stored in: --dtype, except under FSDP, which keeps fp32 master shards and computes in
    bf16 (MixedPrecisionPolicy): AdamW updates of ~lr * 1 are below bf16's resolution for weights of order 1."""
    return torch.bfloat16 if cfg.dtype == "bf16" and not cfg.fsdp else torch.float32


def prepare_model(model, cfg: Config):
    """Apply the scale flags to a loaded model: attention kernel, dtype, gradient checkpointing, LoRA, device, FSDP2."""
    if cfg.attn_implementation:
        model.set_attn_implementation(cfg.attn_implementation)
    model.to(weight_dtype(cfg))
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora_r:
        model = add_lora(model, cfg)
    if cfg.fsdp:
        shard_model(model, cfg)     # fully_shard moves each layer's shard to this rank's device, one layer at a time
    else:
        model.to(resolve_device(cfg.device))
    return model


def add_lora(model, cfg: Config):
    """Rank-r LoRA adapters (peft, an optional dependency) on every linear layer but the output head; only they train.
    peft keeps the adapters in fp32 when the base weights are bf16."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ImportError("--lora-r needs the optional package peft: pip install peft") from None
    model = get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    if cfg.gradient_checkpointing:
        model.enable_input_require_grads()   # the frozen embeddings' output requires grad, so checkpointed blocks
    return model                             # always see a grad-requiring input and the adapters get gradients


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def init_distributed(cfg: Config) -> None:
    """With --fsdp under torchrun: join the process group (nccl for GPUs, gloo for CPUs), once per process."""
    if not cfg.fsdp or dist.is_initialized():
        return
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def all_reduce(x: float, op: str = "sum") -> float:
    """Sum (or max) of a number over the ranks; the number itself in one process."""
    if world_size() == 1:
        return x
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([float(x)], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.item()


def gather_objects(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank; [obj] in one process."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def reduce_metrics(metrics: dict) -> dict:
    """One metrics dict for the global batch: integer counts are summed over ranks, other numbers averaged (NaN ones
    skipped). Every rank holds the same number of whole groups, so means of per-rank means are global means; ratios
    of counts (flag rate, accept rate) are averaged over ranks, an approximation the counts themselves let one redo."""
    parts = gather_objects(metrics)
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


def rank_tasks(tasks: list) -> list:
    """This rank's share of a batch of tasks: whole groups, so group advantages need no communication."""
    per = len(tasks) // world_size()
    return tasks[rank() * per:(rank() + 1) * per]


def is_fsdp(model) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


def shard_model(model, cfg: Config) -> None:
    """FSDP2: fully_shard every decoder layer (the classes in the model's `_no_split_modules`), then the root
    (embeddings, final norm, head). With --dtype bf16 the fp32 shards are all-gathered and computed in bf16, and
    gradients are reduced in fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(resolve_device(cfg.device).type, (world_size(),))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg.dtype == "bf16"
          else MixedPrecisionPolicy())
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"--fsdp: found no decoder layers to shard in {type(model).__name__} (_no_split_modules)")
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    set_training_resharding(model)


def set_training_resharding(model) -> None:
    """FSDP2's training default: layers free their gathered weights after forward; the root keeps them (its
    backward runs first)."""
    model.set_reshard_after_forward(True)
    model.set_reshard_after_forward(False, recurse=False)


@contextmanager
def full_params(model):
    """Hold FSDP2's parameters gathered for a stretch of inference: rollout, RTI, scoring, evaluation. No-op
    without FSDP.

    Why: ranks sample different numbers of turns and corrections, so they run different numbers of forward passes.
    With sharded weights every forward all-gathers, and a rank that stops early leaves the others waiting forever.
    Here every rank all-gathers every FSDP module once (the same collectives in the same order everywhere), turns
    resharding off, runs any number of purely local forwards, and reshards at the end (torchtune's GRPO recipe does
    the same: reshard_after_forward=False during generation). The alternatives cost more: a second, unsharded copy of
    the model for inference, or dummy forwards so that every rank runs as many as the slowest. The price: the full
    weights in the compute dtype while inside (16 GB for Qwen3-8B in bf16). Nested uses gather once.
    """
    if not is_fsdp(model) or getattr(model, "_rti_gathered", False):
        yield
        return
    from torch.distributed.fsdp import FSDPModule
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


# ----------------------------------------------------------------------------- chat rendering (token-in, token-out)

class Chat:
    """Token ids of the pieces of a multi-turn chat, rendered through the tokenizer's own chat template.

    A training sequence is: prompt_ids(first message) + [agent ids ... <eos>] + turn_ids(observation) + [agent ...] ...
    The agent's ids are kept exactly as sampled; only prompt and observation text is tokenized.
    A chat template that takes tools (a real model such as Qwen3) gets the env's actions as tools and the env's system
    prompt (tau2: instructions and the domain policy), its observations come back as tool messages (a tau2 user's
    replies as user messages) and a turn's action is its parsed tool call; the tiny template has no tools, and a
    turn's text is the action itself. `thinking` is passed to the template as enable_thinking (Qwen3's switch).
    """

    def __init__(self, tok, thinking: bool = False, env: str = "navigation"):
        self.tok = tok
        self.env_cls = envs.env_class(env)
        self.eos_id = tok.eos_token_id
        eos = tok.eos_token
        self.tools = self.env_cls.tools() if "tools" in (tok.chat_template or "") else None
        system = self.env_cls.system_prompt() if self.tools else ""
        head = [{"role": "system", "content": system}] if system else []
        kwargs = {"enable_thinking": thinking, **({"tools": self.tools} if self.tools else {})}
        mark, reply = "\x00MSG\x00", "\x00REPLY\x00"
        render = lambda msgs: tok.apply_chat_template(head + msgs, tokenize=False, add_generation_prompt=True,
                                                      **kwargs)
        first = render([{"role": "user", "content": mark}])
        self.prompt_pre, self.prompt_post = first.split(mark)

        def after_turn(role):
            turn = render([{"role": "user", "content": "x"}, {"role": "assistant", "content": reply},
                           {"role": role, "content": mark}])
            # The agent's turn ends with its sampled eos; what follows is what the template writes after it. Earlier
            # turns are never re-rendered, so a template that renders history differently (Qwen3 drops the empty
            # think block of past turns) still gives the tokens the model saw when it sampled.
            end = turn.find(eos, turn.find(reply))
            if reply not in turn or end < 0:
                raise ValueError(f"chat template does not close an assistant turn with the eos token {eos!r}")
            return turn[end + len(eos):].split(mark)
        self.turn_pre, self.turn_post = after_turn("tool" if self.tools else "user")
        self.user_turn = after_turn("user") if self.tools else (self.turn_pre, self.turn_post)   # a user's reply

    def ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False).input_ids

    def prompt_ids(self, content: str) -> list[int]:
        return self.ids(self.prompt_pre + content + self.prompt_post)

    def turn_ids(self, content: str, role: str | None = None) -> list[int]:
        """Ids that follow the agent's eos: the next observation (role "user": a user's message) and the assistant
        header."""
        pre, post = self.user_turn if role == "user" else (self.turn_pre, self.turn_post)
        return self.ids(pre + content + post)

    def text(self, agent_ids: list[int]) -> str:
        """An agent turn as text, without its eos and special tokens."""
        return self.tok.decode([i for i in agent_ids if i != self.eos_id], skip_special_tokens=True).strip()

    def action_text(self, agent_ids: list[int]) -> str:
        """The env action a turn spells: its text (tiny model), or its parsed tool call (a template with tools)."""
        return parse_tool_call(self.text(agent_ids), self.env_cls) if self.tools else self.text(agent_ids)

    def action_ids(self, action: str) -> list[int]:
        """Ids of a turn (without eos) that performs `action`: the action text, or the tool call for it."""
        return self.ids(format_tool_call(action, self.env_cls) if self.tools else action)


TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def format_tool_call(action: str, env_cls=envs.Navigation) -> str:
    """'move up' -> '<tool_call>\\n{"name": "move", "arguments": {"direction": "up"}}\\n</tool_call>' (as Qwen3); an
    action that is no call (a message to a tau2 user) is written as it is."""
    call = env_cls.call_from_action(action)
    return action if call is None else f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def parse_tool_call(text: str, env_cls=envs.Navigation) -> str:
    """The env action of an agent turn written as a Qwen3 / Hermes tool call, `<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>`. Exactly one complete call of a known tool with valid arguments gives its action ('move up');
    anything else (no call, a truncated one, bad JSON, an unknown tool or argument, two calls) gives 'invalid tool
    call: <why>', which the env answers with an error observation. Never raises. Text around the call, a think block
    included, is ignored; `arguments` may also be a JSON string (some models write it so). With an env whose agent
    may talk (`messages_allowed`: tau2 airline, retail), a turn without any tool call is a message: its text."""
    body = text.split("</think>")[-1]
    calls = TOOL_CALL.findall(body)
    if not calls and "<tool_call>" not in body and body.strip() and env_cls.messages_allowed:
        return body.strip()
    if len(calls) != 1:
        why = (f"{len(calls)} calls in one turn" if calls else
               "unterminated <tool_call>" if "<tool_call>" in body else "no <tool_call> block")
        return f"invalid tool call: {why}"
    try:
        call = json.loads(calls[0])
        args = call.get("arguments", {}) if isinstance(call, dict) else None
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        return "invalid tool call: malformed JSON"
    if args is None:
        return "invalid tool call: not a JSON object"
    action = env_cls.action_from_call(call.get("name"), args)
    return action or f"invalid tool call: unknown tool or arguments {json.dumps(call)[:80]}"


# ----------------------------------------------------------------------------- batched decoding with a kept KV cache

def sample_token(logits: torch.Tensor, temperature: float, top_p: float, gens: list[torch.Generator]):
    """Sample row i from softmax(logits_i / T), optionally nucleus-filtered, with its own generator gens[i]
    (Gumbel-max: argmax_v log p_v + g_v, g_v = -log(-log u_v)); return ids and log pi(id) at temperature T.
    One generator per row makes a row's sample independent of which other rows share the batch."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    keep = logp
    if top_p < 1.0:
        sp, si = logp.exp().sort(dim=-1, descending=True)
        drop = torch.zeros_like(sp, dtype=torch.bool).scatter(-1, si, sp.cumsum(-1) - sp >= top_p)
        keep = logp.masked_fill(drop, float("-inf"))
    u = torch.stack([torch.rand(logp.shape[-1], generator=g, device=g.device) for g in gens]).to(logp.device)
    ids = (keep - torch.log(-torch.log(u.clamp(1e-20, 1 - 1e-7)))).argmax(-1)
    return ids, logp.gather(-1, ids[:, None]).squeeze(-1)


def row_generators(seeds, device) -> list[torch.Generator]:
    return [torch.Generator(device=device).manual_seed(int(s) % 2**63) for s in seeds]


class DecodeSession:
    """N rows decoded in lockstep through one KV cache that is kept across turns.

    Rows grow independently: a call that feeds tokens to some rows pads the others with masked slots (holes), and
    position ids count only real tokens, so each row computes exactly what it would alone (tests check this).
    `retract` masks a row's latest tokens out again, which lets intervene.py replace a sampled turn.
    """

    def __init__(self, model, prefixes: list[list[int]], pad_id: int, seeds: list[int] | None = None):
        from transformers import DynamicCache
        self.model, self.pad_id, self.n = model, pad_id, len(prefixes)
        dev = next(model.parameters()).device
        self.gens = row_generators(range(self.n) if seeds is None else seeds, dev)   # one sampling stream per row
        self.cache = DynamicCache(config=model.config)
        self.mask = torch.zeros(self.n, 0, dtype=torch.long, device=dev)
        self.length = torch.zeros(self.n, dtype=torch.long, device=dev)       # real tokens per row
        self.last_logits = torch.zeros(self.n, model.config.vocab_size, device=dev)
        self.real_slots: list[list[int]] = [[] for _ in range(self.n)]       # cache slot of each real token
        self.saved_logits: dict[int, torch.Tensor] = {}                      # next-token logits before a turn
        self.feed(list(range(self.n)), prefixes)

    @torch.no_grad()
    def feed(self, rows: list[int], chunks: list[list[int]]) -> None:
        """Append chunks[i] to row rows[i] (one forward pass); the next-token logits of those rows are updated."""
        rows_chunks = [(r, c) for r, c in zip(rows, chunks) if len(c) > 0]
        if not rows_chunks:
            return
        width = max(len(c) for _, c in rows_chunks)
        dev = self.mask.device
        ids = torch.full((self.n, width), self.pad_id, dtype=torch.long, device=dev)
        new_mask = torch.zeros(self.n, width, dtype=torch.long, device=dev)
        start = self.mask.shape[1]
        for r, c in rows_chunks:      # left-align each chunk; trailing pads are holes
            ids[r, :len(c)] = torch.tensor(c, device=dev)
            new_mask[r, :len(c)] = 1
            self.real_slots[r].extend(range(start, start + len(c)))
        pos = self.length[:, None] + (new_mask.cumsum(-1) - 1).clamp(min=0)
        self.mask = torch.cat([self.mask, new_mask], 1)
        lens = new_mask.sum(-1)
        has = lens > 0
        last = lens[has] - 1
        keep = torch.unique(last)   # only the columns whose logits are used: all of them is GBs at a 150k vocabulary
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=pos, cache=self.cache, use_cache=True,
                         logits_to_keep=keep)
        self.last_logits[has] = out.logits[has, torch.searchsorted(keep, last)].float()
        self.length += lens

    @torch.no_grad()
    def sample_turn(self, rows: list[int], max_new: int, eos_id: int, temperature: float,
                    top_p: float) -> tuple[list[list[int]], list[list[float]]]:
        """Sample one agent turn (up to max_new tokens, stopping at eos) for each row in `rows`."""
        ids_out = [[] for _ in rows]
        logp_out = [[] for _ in rows]
        live = list(range(len(rows)))
        self.saved_logits = {r: self.last_logits[r].clone() for r in rows}   # for retract
        for _ in range(max_new):
            if not live:
                break
            logits = self.last_logits[[rows[i] for i in live]]
            tok, lp = sample_token(logits, temperature, top_p, [self.gens[rows[i]] for i in live])
            for j, i in enumerate(live):
                ids_out[i].append(int(tok[j]))
                logp_out[i].append(float(lp[j]))
            done = [i for i in live if ids_out[i][-1] == eos_id or len(ids_out[i]) == max_new]
            self.feed([rows[i] for i in live], [[ids_out[i][-1]] for i in live])
            live = [i for i in live if i not in done]
        return ids_out, logp_out

    @torch.no_grad()
    def keep(self, rows: list[int]) -> None:
        """Keep only `rows`, renumbered: row rows[i] becomes row i. Cache columns that are holes in every kept row
        go too, so finished episodes stop costing compute and memory (their slots rode along as holes before)."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        mask = self.mask[idx]
        used = mask.any(0)
        cols = used.nonzero().squeeze(-1)
        if any(self.cache.is_sliding):   # a sliding-window layer counts its columns: drop rows only
            cols, used = torch.arange(mask.shape[1], device=idx.device), torch.ones_like(used)
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[idx][:, :, cols], layer.values[idx][:, :, cols]
        new_slot = (used.long().cumsum(0) - 1).tolist()
        self.real_slots = [[new_slot[c] for c in self.real_slots[r]] for r in rows]
        self.mask, self.length, self.last_logits = mask[:, cols], self.length[idx], self.last_logits[idx]
        self.gens = [self.gens[r] for r in rows]
        self.saved_logits = {i: self.saved_logits[r] for i, r in enumerate(rows) if r in self.saved_logits}
        self.n = len(rows)

    @torch.no_grad()
    def retract(self, row: int, n_tokens: int) -> None:
        """Mask out the row's last n_tokens (they become holes); its next-token logits return to before them."""
        slots = self.real_slots[row][len(self.real_slots[row]) - n_tokens:]
        del self.real_slots[row][len(self.real_slots[row]) - n_tokens:]
        self.mask[row, slots] = 0
        self.length[row] -= n_tokens
        self.last_logits[row] = self.saved_logits[row]


# ----------------------------------------------------------------------------- the policy object handed to intervene.py

class Policy:
    """What intervene.py and evaluate.py need from a model: chat pieces, batched sampling, log-prob scoring."""

    def __init__(self, model, tok, temperature=1.0, top_p=1.0, max_turn_tokens=4, seed=0, micro_batch=64,
                 thinking=False, env="navigation", user=None):
        self.model, self.tok, self.chat = model, tok, Chat(tok, thinking, env)
        self.user = user      # plays the user of tau2 airline / retail episodes (envs.make_env); None: env default
        self.temperature, self.top_p, self.max_turn_tokens = temperature, top_p, max_turn_tokens
        self.micro_batch = micro_batch
        self.device = next(model.parameters()).device
        self.gen = torch.Generator(device=self.device).manual_seed(seed)

    def session(self, prefixes: list[list[int]], seeds: list[int] | None = None) -> DecodeSession:
        """A decoding session; row i samples from its own stream `seeds[i]` (default: drawn from self.gen)."""
        if seeds is None:
            seeds = torch.randint(2**62, (len(prefixes),), generator=self.gen, device=self.gen.device).tolist()
        return DecodeSession(self.model, prefixes, self.tok.pad_token_id, seeds)

    def sample_turn(self, session: DecodeSession, rows: list[int], max_new: int | None = None):
        return session.sample_turn(rows, max_new or self.max_turn_tokens, self.chat.eos_id, self.temperature,
                                   self.top_p)

    def generate(self, contexts: list[list[int]], max_new: int | None = None):
        """One agent turn for each context, re-encoding the context (for corrector and LLM roles)."""
        if not contexts:
            return [], []
        s = self.session(contexts)
        return self.sample_turn(s, list(range(len(contexts))), max_new)

    @torch.no_grad()
    def score(self, seqs: list[list[int]]) -> list[list[float]]:
        """log pi(y_t | y_<t) at the sampling temperature for every token (0.0 for the first)."""
        out = []
        for i in range(0, len(seqs), self.micro_batch):
            chunk = seqs[i:i + self.micro_batch]
            ids, mask = pad_right(chunk, self.tok.pad_token_id, self.device)
            lp = token_logprobs(self.model, ids, mask, self.temperature)
            out += [lp[j, :len(s)].tolist() for j, s in enumerate(chunk)]
        return out


def pad_rows(rows: list[list], fill, dtype, device) -> torch.Tensor:
    """[N, T] tensor of right-padded rows, T = the longest row."""
    out = torch.full((len(rows), max(len(r) for r in rows)), fill, dtype=dtype, device=device)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=dtype, device=device)
    return out


def pad_right(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and their attention mask (by position, never by pad id)."""
    return (pad_rows(seqs, pad_id, torch.long, device),
            pad_rows([[1] * len(s) for s in seqs], 0, torch.long, device))


def token_logprobs(model, ids: torch.Tensor, mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, T] log-probs of ids[:, t] given ids[:, :t] at the given temperature; column 0 is 0."""
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return F.pad(lp, (1, 0))


# ----------------------------------------------------------------------------- trajectories and rollout

@dataclass
class Trajectory:
    """One episode as the exact token sequence the model saw, with per-token bookkeeping."""
    task: object
    group: int
    ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)      # 1 on agent tokens, 0 on prompt and environment tokens
    source: list[int] = field(default_factory=list)         # POLICY or INTERVENED per token
    sample_logp: list[float] = field(default_factory=list)  # log-prob when sampled (policy) / written (corrector)
    actions: list[str] = field(default_factory=list)
    turns: list[tuple[int, int]] = field(default_factory=list)   # (start, end) of each agent turn in ids
    observations: list[str] = field(default_factory=list)   # observations[i] is the user content before turn i
    reward: float = 0.0
    rubric: dict = field(default_factory=dict)
    intervention: dict | None = None
    seed: int | None = None                                 # the sampling stream of this episode

    def truncated(self, k: int) -> "Trajectory":
        """A copy of the episode before agent turn k (ends with the user message that turn k answered)."""
        end = self.turns[k][0] if k < len(self.turns) else len(self.ids)
        return Trajectory(task=self.task, group=self.group, ids=self.ids[:end], loss_mask=self.loss_mask[:end],
                          source=self.source[:end], sample_logp=self.sample_logp[:end], actions=self.actions[:k],
                          turns=self.turns[:k], observations=self.observations[:k + 1], seed=self.seed)

    def add(self, ids, loss_mask, source, logp):
        self.ids += ids
        self.loss_mask += [loss_mask] * len(ids)
        self.source += [source] * len(ids)
        self.sample_logp += logp if logp is not None else [0.0] * len(ids)

    def add_turn(self, agent_ids, logp, source, eos_id):
        """Append an agent turn; a turn cut off before eos is closed with a (non-trained) eos."""
        start = len(self.ids)
        self.add(agent_ids, 1, source, logp)
        if not agent_ids or agent_ids[-1] != eos_id:
            self.add([eos_id], 0, POLICY, None)
        self.turns.append((start, len(self.ids)))

    def step(self, chat: "Chat", env, agent_ids, logp, source=POLICY) -> list[int] | None:
        """Record an agent turn and execute its action in `env`. Returns the tokens that follow the turn in the
        model's context (a closing eos if the turn was cut off, then the observation), or None when the episode
        ended (then reward and rubric are set)."""
        self.add_turn(agent_ids, logp, source, chat.eos_id)
        self.actions.append(chat.action_text(agent_ids))
        obs, done = env.step(self.actions[-1])
        if done:
            result = env.score()
            self.reward, self.rubric = float(result.success), dict(result.items)
            return None
        self.observations.append(obs)
        chunk = chat.turn_ids(obs, env.observation_role)
        self.add(chunk, 0, POLICY, None)
        return ([chat.eos_id] if agent_ids[-1:] != [chat.eos_id] else []) + chunk


def episode_seed(seed: int, task_id: str, j: int) -> int:
    """The sampling stream of sample j of a task: a function of (seed, task, j) alone, so an episode samples the same
    tokens whatever else shares its batch, on one process or split across several."""
    return zlib.crc32(f"{seed}/{task_id}/{j}".encode())   # 32 bits: torch's CPU generator seeds from the low 32


def start_episodes(policy: Policy, tasks: list, group_size: int, seed: int | None = None):
    """B tasks x G fresh environments and trajectories that hold the prompt."""
    if seed is None:
        seed = int(torch.randint(2**62, (1,), generator=policy.gen, device=policy.gen.device))
    envs_, trajs = [], []
    for g, task in enumerate(tasks):
        for j in range(group_size):
            env = envs.make_env(task, policy.user)
            first = env.reset()
            t = Trajectory(task=task, group=g, observations=[first], seed=episode_seed(seed, task.task_id, j))
            t.add(policy.chat.prompt_ids(first), 0, POLICY, None)
            envs_.append(env)
            trajs.append(t)
    return envs_, trajs


def rollout(policy: Policy, tasks: list, group_size: int, seed: int | None = None) -> list[Trajectory]:
    """Sample B x G multi-turn episodes in lockstep: one batched decoding pass per turn for all live episodes.

    The KV cache is kept across turns, so each turn feeds only the new observation tokens. Each episode samples
    from its own stream (episode_seed); `seed` None draws one from policy.gen.
    """
    policy.model.eval()
    env_list, trajs = start_episodes(policy, tasks, group_size, seed)
    session = policy.session([t.ids for t in trajs], [t.seed for t in trajs])
    live = list(range(len(trajs)))     # live[i]: the episode in session row i
    while live:
        rows = list(range(len(live)))
        ids, logps = policy.sample_turn(session, rows)
        chunks = [trajs[e].step(policy.chat, env_list[e], a_ids, a_lp) for e, a_ids, a_lp in zip(live, ids, logps)]
        going = [i for i in rows if chunks[i] is not None]
        if len(going) < len(rows):
            session.keep(going)        # finished episodes leave the batch
        live = [live[i] for i in going]
        session.feed(list(range(len(live))), [chunks[i] for i in going])
    return trajs


def evaluate_policy(policy: Policy, tasks: list, n: int, seed: int = 1234, chunk: int = 256,
                    per_task: bool = False):
    """pass@k / pass^k of the policy on `tasks` with n samples each (evaluate.summarize), without touching the
    training RNG stream. per_task=True also returns the successes, one list of n booleans per task."""
    successes = []
    per_chunk = max(1, chunk // n)
    for i in range(0, len(tasks), per_chunk):
        trajs = rollout(policy, tasks[i:i + per_chunk], n, seed)
        for g in range(len(tasks[i:i + per_chunk])):
            successes.append([t.reward > 0 for t in trajs[g * n:(g + 1) * n]])
    summary = evaluate.summarize(successes, k_max=min(4, n))
    return (summary, successes) if per_task else summary


# ----------------------------------------------------------------------------- warm start (supervised)

def teacher_sequence(chat: Chat, task, rng: random.Random, hint_frac: float, obs_weight: float):
    """Token ids and per-token loss weights of the optimal episode for `task`.

    Agent tokens weigh 1, observation tokens `obs_weight` (the auxiliary loss of DESIGN.md section 7), hint tokens 0.
    A share `hint_frac` of turns carries, at the end of the user message before the action, the hint block a
    self-corrector will see (intervene.format_hint), so the policy learns to use it from the start.
    """
    import intervene
    env = envs.Navigation(task)
    content = env.reset()
    ids, weights = [], []
    n_post = len(chat.ids(chat.turn_post))
    for t, action in enumerate(envs.optimal_actions(task)):
        piece = chat.prompt_ids if t == 0 else chat.turn_ids
        plain = piece(content)
        if rng.random() < hint_frac:
            wrong = [a for a in envs.ACTIONS if not env.check_step(a).valid]
            reason = env.check_step(rng.choice(wrong)).reason
            hinted = piece(content + " " + intervene.format_hint(reason, env.hint()))
            n_hint = len(hinted) - len(plain)
            w = [obs_weight] * len(hinted)
            w[len(hinted) - n_post - n_hint:len(hinted) - n_post] = [0.0] * n_hint
            plain = hinted
        else:
            w = [obs_weight] * len(plain)
        ids += plain
        weights += w
        agent = chat.action_ids(action) + [chat.eos_id]
        ids += agent
        weights += [1.0] * len(agent)
        content, done = env.step(action)
        if done:
            break
    weights[0] = 0.0
    return ids, weights


def warmstart_loss(model, batch_ids, batch_w, pad_id) -> torch.Tensor:
    """Weighted next-token cross-entropy: sum_t w_t * CE_t / sum_t w_t."""
    device = next(model.parameters()).device
    ids, mask = pad_right(batch_ids, pad_id, device)
    w = pad_rows(batch_w, 0.0, torch.float32, device)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    w = w[:, 1:].reshape(-1)
    return (ce * w).sum() / w.sum()


def warmstart(cfg: Config, log=print):
    """Supervised warm start on optimal `easy` trajectories; saves model + tokenizer to cfg.ws_out."""
    model, tok = load_model(cfg.model, cfg.seed)
    chat = Chat(tok)
    tasks = envs.make_tasks(cfg.ws_split)
    rng = random.Random(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.ws_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, cfg.ws_steps) / max(1, cfg.ws_steps))))
    model.train()
    t0, losses = time.time(), []
    bar = progress(range(cfg.ws_steps), cfg.progress, "warm start")
    batches = []
    for step in bar:
        if not batches:   # draw 8 batches at once and group similar lengths: less padding, same data
            pool = sorted((teacher_sequence(chat, rng.choice(tasks), rng, cfg.ws_hint_frac, cfg.ws_obs_weight)
                           for _ in range(8 * cfg.ws_batch)), key=lambda b: len(b[0]))
            batches = [pool[i:i + cfg.ws_batch] for i in range(0, len(pool), cfg.ws_batch)]
            rng.shuffle(batches)
        batch = batches.pop()
        loss = warmstart_loss(model, [b[0] for b in batch], [b[1] for b in batch], tok.pad_token_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if hasattr(bar, "set_postfix") and step % 20 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
    Path(cfg.ws_out).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(cfg.ws_out)
    tok.save_pretrained(cfg.ws_out)
    info = {"steps": cfg.ws_steps, "seconds": round(time.time() - t0, 1), "first_loss": losses[0] if losses else None,
            "last_loss": float(np.mean(losses[-20:])) if losses else None, "config": dataclasses.asdict(cfg)}
    (Path(cfg.ws_out) / "warmstart.json").write_text(json.dumps(info, indent=1))
    log(f"warm start: {cfg.ws_steps} steps in {info['seconds']} s, loss {info['first_loss']:.3f} -> "
        f"{info['last_loss']:.3f}, saved to {cfg.ws_out}")
    return model, tok, losses


# ----------------------------------------------------------------------------- RL training

def progress(it, enabled: bool, desc: str):
    if not enabled:
        return it
    from tqdm.auto import tqdm
    return tqdm(it, desc=desc, dynamic_ncols=True, file=sys.stderr)


def collate(trajs: list[Trajectory], old_logp: list[list[float]] | None, pad_id: int, device) -> dict:
    """Right-padded [N, T] tensors of one batch of trajectories (attention mask by position, never by pad id);
    "old_logp" is None when old_logp is."""
    ids, attn = pad_right([t.ids for t in trajs], pad_id, device)
    tensor = lambda rows, dtype=torch.float32: pad_rows(rows, 0, dtype, device)   # noqa: E731
    return {"ids": ids, "attn": attn, "loss_mask": tensor([t.loss_mask for t in trajs]),
            "source": tensor([t.source for t in trajs], torch.long),
            "behavior_logp": tensor([t.sample_logp for t in trajs]),
            "old_logp": None if old_logp is None else tensor(old_logp)}


def update(policy: Policy, opt, trajs: list[Trajectory], advantages: torch.Tensor, cfg: Config) -> dict:
    """Old log-probs by one scoring pass at the sampling temperature (with one update per batch, the update's own
    forward pass gives the same numbers, detached: no extra pass), then `updates_per_batch` AdamW steps on
    loss.policy_loss.

    Micro-batches of `micro_batch` rows accumulate into one step, each weighted by its share of the batch's tokens
    (token-mean) or rows, so they add up to the whole batch's loss. Under FSDP the batch is the global one: shares
    use global counts, every rank runs as many micro-batches as the busiest (empty ones where it has none), and the
    loss is scaled by the world size because FSDP averages gradients over ranks. Metric `loss` is the batch's loss.
    """
    model, lcfg = policy.model, cfg.loss_config()
    old = None                           # one update per batch: pi_old is the policy being updated, whose
    if cfg.updates_per_batch > 1:        # log-probs are the update's own forward pass (detached)
        with full_params(model):
            old = policy.score([t.ids for t in trajs])
    model.train()
    metrics = []
    n_tok = all_reduce(sum(sum(t.loss_mask) for t in trajs))
    n_rows = all_reduce(len(trajs))
    n_micro = int(all_reduce(math.ceil(len(trajs) / cfg.micro_batch), "max"))
    empty = Trajectory(task=None, group=-1, ids=[policy.tok.pad_token_id], loss_mask=[0], source=[POLICY],
                       sample_logp=[0.0])
    total = 0.0
    for _ in range(cfg.updates_per_batch):
        opt.zero_grad(set_to_none=True)
        for i in range(0, n_micro * cfg.micro_batch, cfg.micro_batch):
            rows = trajs[i:i + cfg.micro_batch]
            adv = (advantages[i:i + cfg.micro_batch] if rows else torch.zeros(1)).to(policy.device)
            mb = collate(rows or [empty], None if old is None else old[i:i + cfg.micro_batch] or [[0.0]],
                         policy.tok.pad_token_id, policy.device)
            logp = token_logprobs(model, mb["ids"], mb["attn"], policy.temperature)
            old_logp = logp.detach() if old is None else mb["old_logp"]
            loss, m = rl_loss.policy_loss(logp, old_logp, adv, mb["loss_mask"], source=mb["source"],
                                          behavior_logp=mb["behavior_logp"], config=lcfg)
            share = (mb["loss_mask"].sum().item() / max(1, n_tok) if cfg.agg == "token-mean"
                     else len(rows) / max(1, n_rows))
            (loss * share * world_size()).backward()
            total += loss.item() * share / cfg.updates_per_batch
            if rows:
                metrics.append({"loss": loss.item(), **m})
        m_grad = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
    out = {k: float(np.mean([m[k] for m in metrics])) for k in (metrics[0] if metrics else ())}
    out["loss"] = all_reduce(total)
    out["grad_norm"] = float(m_grad.full_tensor() if hasattr(m_grad, "full_tensor") else m_grad)
    return out


def train_step(policy: Policy, opt, tasks: list, cfg: Config, seed: int | None = None) -> dict:
    """Sample -> (RTI) -> rewards -> group advantages -> update. Returns the step's metrics. `seed` fixes the
    episodes' sampling streams (rollout); the trainer passes one derived from --seed and the step."""
    import intervene
    t0 = time.time()
    with full_params(policy.model):   # under FSDP: ranks run different numbers of forwards from here to t2
        trajs = rollout(policy, tasks, cfg.group_size, seed)
        t1 = time.time()
        metrics = {"train_success": float(np.mean([t.reward for t in trajs])),
                   "turns": float(np.mean([len(t.actions) for t in trajs]))}
        if cfg.method == "rti":
            trajs, stats = intervene.intervene(policy, trajs, intervene.RTIConfig.from_config(cfg))
            metrics.update({f"rti/{k}": v for k, v in stats.items()})
    t2 = time.time()
    rewards = torch.tensor([t.reward for t in trajs])
    adv = rl_loss.group_advantages(rewards, cfg.group_size, scale=cfg.scale_advantages)
    metrics["train_success_after_rti"] = float(rewards.mean())
    metrics["groups_with_spread"] = float((rewards.view(-1, cfg.group_size).std(-1) > 0).float().mean())
    keep = [i for i in range(len(trajs)) if adv[i] != 0]   # zero-advantage rows add nothing but cost
    if all_reduce(len(keep)):                                # under FSDP every rank joins the update
        metrics.update(update(policy, opt, [trajs[i] for i in keep], adv[keep], cfg))
    metrics.update({"time/rollout": t1 - t0, "time/intervene": t2 - t1, "time/update": time.time() - t2,
                    "trained_rows": len(keep)})
    return reduce_metrics(metrics)


def init_policy(cfg: Config, log=print) -> Policy:
    """The model to train: the tiny model from the warm-start checkpoint (built first if missing), or --model PATH."""
    if cfg.model == "tiny" and cfg.init:
        if not (Path(cfg.init) / "config.json").exists():
            if cfg.init != cfg.ws_out:
                raise FileNotFoundError(f"--init {cfg.init!r} holds no checkpoint")
            if world_size() > 1:
                raise FileNotFoundError(f"no warm-start checkpoint in {cfg.init}: build it first, in one process "
                                        "(python rti.py warmstart)")
            log(f"no warm-start checkpoint in {cfg.init}: building it first (python rti.py warmstart; "
                f"{cfg.ws_steps} steps, a few minutes on 2 CPU cores)")
            warmstart(cfg, log)
        model, tok = load_model(cfg.init, dtype=weight_dtype(cfg))
    else:
        model, tok = load_model(cfg.model, cfg.seed, weight_dtype(cfg), cfg.env)
    model = prepare_model(model, cfg)
    policy = Policy(model, tok, cfg.temperature, cfg.top_p, cfg.max_turn_tokens, cfg.seed + rank(), cfg.micro_batch,
                    cfg.thinking, cfg.env)
    policy.user = make_user(cfg, policy)
    return policy


# ----------------------------------------------------------------------------- the user of tau2 airline and retail

class ModelUser:
    """tau2's user simulator played in-process by a local chat model, for envs.Tau2Env: it gets the task's user
    scenario (which the agent never sees) and short rules for a simulated user (ours, not tau2's user-simulator
    prompt), and decodes greedily, so replaying an episode (intervene.py) gets the same replies. Roles are flipped:
    the agent's messages are its user turns."""
    RULES = ("You are playing a customer who contacts a customer service agent. Follow the scenario below. Write only "
             "the customer's next message, short and natural. Do not make up information the scenario does not give; "
             "reveal information only when the agent asks for it. When the task is done, or the agent transfers you "
             f"to a human, or you want to end the conversation, reply with {envs.USER_STOP}.\n<scenario>\n{{scenario}}"
             "\n</scenario>")

    def __init__(self, model, tok, max_new: int = 256):
        self.model, self.tok, self.max_new = model, tok, max_new

    @torch.no_grad()
    def say(self, task, turns: list[dict]) -> str:
        msgs = [{"role": "system", "content": self.RULES.format(scenario=task.task.user_scenario)}] + turns
        text = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
        dev = next(self.model.parameters()).device
        ids = torch.tensor([self.tok(text, add_special_tokens=False).input_ids], device=dev)
        was_training = self.model.training
        self.model.eval()
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.max_new,
                                  do_sample=False, pad_token_id=self.tok.pad_token_id)
        self.model.train(was_training)
        reply = self.tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split("</think>")[-1].strip()
        return reply or envs.USER_STOP

    def opening(self, task) -> str:
        return self.say(task, [{"role": "user", "content": envs.GREETING}])

    def reply(self, task, messages: list) -> str:
        flip = {"assistant": "user", "user": "assistant"}
        turns = [{"role": flip[m.role], "content": m.content} for m in messages
                 if m.role in flip and getattr(m, "content", None)]
        return self.say(task, turns)


def make_user(cfg: Config, policy: Policy):
    """The user of tau2 airline / retail episodes (--user-model); None for the other envs."""
    if cfg.env not in ("tau2-airline", "tau2-retail"):
        return None
    if cfg.user_model == "scripted":
        return envs.ScriptedUser()
    if not cfg.user_model:
        return ModelUser(policy.model, policy.tok)
    model, tok = load_model(cfg.user_model, dtype=weight_dtype(cfg))
    return ModelUser(model.to(policy.device), tok)


def save_checkpoint(path: Path, policy: Policy, opt, step: int, task_rng: random.Random, cfg: Config) -> None:
    """Model, optimizer, step and RNG states in one file; under FSDP, sharded (save_sharded)."""
    rng = {"step": step, "task_rng": task_rng.getstate(), "sample_rng": policy.gen.get_state(),
           "torch_rng": torch.get_rng_state(), "config": dataclasses.asdict(cfg)}
    if is_fsdp(policy.model):
        return save_sharded(path.with_suffix(""), policy, opt, rng)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": policy.model.state_dict(), "optimizer": opt.state_dict(), **rng}, tmp)
    os.replace(tmp, path)


def save_sharded(path: Path, policy: Policy, opt, rng: dict) -> None:
    """A torch.distributed.checkpoint directory: every rank writes its model and optimizer shards, plus its own
    RNG states (rng-RANK.pt); written beside and then moved over the previous checkpoint."""
    import shutil
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_state, optim_state = get_state_dict(policy.model, opt)
    tmp = path.with_name(path.name + ".tmp")
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp))
    torch.save(rng, tmp / f"rng-{rank()}.pt")
    dist.barrier()
    if rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    dist.barrier()


def load_checkpoint(path: Path, policy: Policy, opt, task_rng: random.Random) -> int:
    """Restore what save_checkpoint wrote (a file, or under FSDP the sharded directory); return its step."""
    if is_fsdp(policy.model):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        path = path.with_suffix("")
        if not (path / f"rng-{rank()}.pt").exists():
            raise FileNotFoundError(f"--resume: no sharded checkpoint for rank {rank()} in {path}")
        model_state, optim_state = get_state_dict(policy.model, opt)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(policy.model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        state = torch.load(path / f"rng-{rank()}.pt", weights_only=False)
    else:
        if not path.exists():
            raise FileNotFoundError(f"--resume: no checkpoint at {path}")
        state = torch.load(path, weights_only=False)
        policy.model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    task_rng.setstate(state["task_rng"])
    policy.gen.set_state(state["sample_rng"])
    torch.set_rng_state(state["torch_rng"])
    return state["step"]


def save_model(policy: Policy, path: Path) -> None:
    """save_pretrained of the model (only the adapters, with LoRA) and the tokenizer; under FSDP rank 0 writes the
    gathered full state dict."""
    state = None
    if is_fsdp(policy.model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        state = get_model_state_dict(policy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        unique = dict(policy.model.named_parameters())          # a head tied to the embedding appears once here
        tied = {n for n, _ in policy.model.named_parameters(remove_duplicate=False)} - unique.keys()
        state = {k: v for k, v in state.items() if k not in tied}
    if rank() == 0:
        policy.model.save_pretrained(path, state_dict=state)
        policy.tok.save_pretrained(path)
    if world_size() > 1:
        dist.barrier()


def evaluate_all(policy: Policy, tasks: list, n: int, seed: int, per_task: bool = False):
    """evaluate_policy; under FSDP every rank samples its share of the tasks with the weights gathered, and the
    successes are gathered back in task order."""
    if world_size() == 1:
        return evaluate_policy(policy, tasks, n, seed=seed, per_task=per_task)
    per = math.ceil(len(tasks) / world_size())
    mine = tasks[rank() * per:(rank() + 1) * per]
    with full_params(policy.model):
        part = evaluate_policy(policy, mine, n, seed=seed + rank(), per_task=True)[1] if mine else []
    successes = [s for p in gather_objects(part) for s in p]
    summary = evaluate.summarize(successes, k_max=min(4, n))
    return (summary, successes) if per_task else summary


def train(cfg: Config, log=print) -> dict:
    """The training loop; returns {"before": ..., "after": ...} test metrics (evaluate.summarize).
    With --fsdp under torchrun every rank runs it on its share of each batch; rank 0 logs and writes files."""
    init_distributed(cfg)
    torch.set_num_threads(cfg.threads)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    main_rank = rank() == 0
    log = log if main_rank else (lambda *a, **k: None)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    policy = init_policy(cfg, log)
    opt = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=cfg.weight_decay)
    train_tasks = envs.env_tasks(cfg.env, cfg.train_split)
    test_tasks = envs.env_tasks(cfg.env, cfg.test_split)[:cfg.eval_tasks]
    task_rng = random.Random(cfg.seed)
    step, ckpt = 0, out / "ckpt.pt"
    results = {}
    if cfg.resume:
        step = load_checkpoint(ckpt, policy, opt, task_rng)
        log(f"resumed from {ckpt} at step {step}")
    elif cfg.eval_tasks and cfg.eval_before:
        results["before"], results["before_tasks"] = evaluate_all(policy, test_tasks, cfg.eval_samples,
                                                                  seed=cfg.seed + 10_000, per_task=True)
        log(f"before training: test p@1 {results['before']['p@1']:.2f}")
    log_file = (out / "metrics.jsonl").open("a" if cfg.resume else "w") if main_rank else open(os.devnull, "w")
    if "before" in results:
        log_file.write(json.dumps({"step": 0, **{f"test/{k}": v for k, v in results["before"].items()}}) + "\n")
    bar = progress(range(step, cfg.steps), cfg.progress and main_rank, f"{cfg.method} training")
    rti_steps = []
    for step in bar:
        tasks = rank_tasks(task_rng.sample(train_tasks, cfg.batch_tasks))
        t0 = time.time()
        for group in opt.param_groups:   # a function of the step alone, so --resume needs no scheduler state
            group["lr"] = cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr
        m = train_step(policy, opt, tasks, cfg, seed=cfg.seed * 1_000_003 + step)
        m.update({"step": step + 1, "time/step": time.time() - t0})
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and cfg.eval_tasks and step + 1 < cfg.steps:
            m.update({f"test/{k}": v for k, v in
                      evaluate_all(policy, test_tasks, cfg.eval_samples, seed=cfg.seed + 10_000).items()})
        rti_steps.append({k[4:]: v for k, v in m.items() if k.startswith("rti/")})
        log_file.write(json.dumps(m) + "\n")
        log_file.flush()
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(success=f"{m['train_success']:.2f}", loss=f"{m.get('loss', 0):.3f}")
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            save_checkpoint(ckpt, policy, opt, step + 1, task_rng, cfg)
    if cfg.method == "rti":
        import intervene
        results["interventions"] = intervene.total(rti_steps)
    if cfg.eval_tasks:
        results["after"], results["after_tasks"] = evaluate_all(policy, test_tasks, cfg.eval_samples,
                                                                seed=cfg.seed + 10_000, per_task=True)
        log_file.write(json.dumps({"step": cfg.steps, **{f"test/{k}": v for k, v in results["after"].items()}}) + "\n")
        if main_rank:
            (out / "results.json").write_text(json.dumps({"config": dataclasses.asdict(cfg), **results}))
    log_file.close()
    save_model(policy, out / "model")
    results["policy"] = policy
    return results


# ----------------------------------------------------------------------------- GPU smoke test (python rti.py gpu-smoke)

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)   # Qwen3-8B's config.json
SMOKE = dict(device="cuda", dtype="bf16", gradient_checkpointing=True, batch_tasks=4, group_size=4, micro_batch=4)


def gpu_smoke(cfg: Config, arch: dict = QWEN3_8B, steps: int = 2, log=print) -> dict:
    """RTI training steps of a randomly initialised Qwen3-8B built from its configuration (nothing is downloaded):
    by default in bf16 with gradient checkpointing on one GPU. Logs and returns the parameter count, peak memory and
    the time of each step (the first includes CUDA warm-up and AdamW's state allocation). Not part of CI.

        python rti.py gpu-smoke                  # cuda, bf16, checkpointing, 4 tasks x 4 samples, micro-batch 4
        python rti.py gpu-smoke --lora-r 16      # the same with LoRA adapters

    On the command line, flags left at their training defaults take the values in SMOKE. The tokenizer is the tiny
    word-level one (its few hundred ids are ids of the 8B vocabulary too) and a random model never succeeds, so the
    steps use the rule corrector without the PPL gate, as the tests do: corrections give each group a reward spread.
    """
    cfg = dataclasses.replace(cfg, init="", train_split="easy", method="rti", corrector="rule", ppl_gate=False,
                              max_corrections=100)
    cfg.validate()
    from transformers import AutoModelForCausalLM, Qwen3Config
    device = resolve_device(cfg.device)
    _, tok = load_model("tiny")
    torch.manual_seed(cfg.seed)
    config = Qwen3Config(**arch, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=weight_dtype(cfg))
    figures = {"params": sum(p.numel() for p in model.parameters()), "device": str(device), "dtype": cfg.dtype,
               "gradient_checkpointing": cfg.gradient_checkpointing, "lora_r": cfg.lora_r,
               "rows": cfg.batch_tasks * cfg.group_size, "micro_batch": cfg.micro_batch}
    model = prepare_model(model, cfg)
    figures["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    policy = Policy(model, tok, cfg.temperature, cfg.top_p, cfg.max_turn_tokens, cfg.seed, cfg.micro_batch)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    tasks = envs.make_tasks("easy")[:cfg.batch_tasks]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    figures["steps"] = []
    for _ in range(steps):
        t0 = time.time()
        m = train_step(policy, opt, tasks, cfg)
        if cuda:
            torch.cuda.synchronize()
        figures["steps"].append({"seconds": round(time.time() - t0, 2), "loss": m.get("loss"),
                                 "trained_rows": m["trained_rows"],
                                 **{k: round(v, 2) for k, v in m.items() if k.startswith("time/")}})
    if cuda:
        figures["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        figures["gpu"] = torch.cuda.get_device_name(device)
    log(json.dumps(figures, indent=1))
    return figures


def main(argv=None) -> None:
    command, cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    if command == "warmstart":
        warmstart(cfg)
        return
    if command == "gpu-smoke":
        defaults = Config()
        try:
            gpu_smoke(dataclasses.replace(cfg, **{k: v for k, v in SMOKE.items()
                                                  if getattr(cfg, k) == getattr(defaults, k)}))
        except ValueError as e:
            sys.exit(f"gpu-smoke: {e}")
        return
    t0 = time.time()
    res = train(cfg)
    rows = {k: res[k] for k in ("before", "after") if k in res}
    if rows and rank() == 0:
        print(f"\n{cfg.method} on the {cfg.test_split} split ({cfg.eval_tasks} tasks x {cfg.eval_samples} samples):")
        print(evaluate.format_table({("warm start" if k == "before" else f"after {cfg.steps} steps"): v
                                     for k, v in rows.items()}))
    if rank() == 0:
        if "interventions" in res:
            import intervene
            print(f"\ninterventions over the run:\n{intervene.report(res['interventions'])}")
        print(f"wall time {time.time() - t0:.0f} s; metrics in {cfg.out}/metrics.jsonl, model in {cfg.out}/model")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
