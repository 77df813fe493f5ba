"""The memory plan of a run on GPUs, from its flags alone, before anything is loaded; optional
(extras/).

    python -m extras.scale plan --model-config Qwen3-8B-like --gpus 8 --gpu-mem 141 --context 16384

extras/scale.py's `plan` command prints it and exits non-zero when the run does not fit, with the
flags that would; `train` and `gpu-smoke` on a CUDA device check it (with the GPU's own memory)
before they load the model. Figures are per GPU, in GiB (2^30 bytes), for a Llama/Qwen-style
decoder (the presets below, or any config.json) and the run's flags. They are estimates of what
the code in this repository allocates, written out term by term so that each can be checked:

- resident: weights, gradients (kept from one update to the next rollout: rti.update zeroes them
  before its backward, not after its step) and AdamW's two states. Full fine-tuning in bf16 keeps
  fp32 master weights (FSDP2 on one process, extras/scale.py); --no-master-weights keeps bf16
  weights and bf16 states. LoRA trains fp32 adapters beside frozen base weights. FSDP shards all
  of it across the GPUs, and gathers the full weights in the compute dtype while the policy
  samples (fsdp.gathered), and the root (embeddings, head, final norm) with up to four layers
  at a time in the update (the layer computed, the next prefetched, backward's recompute).
- rollout: every row of a training batch (batch_tasks / GPUs x group_size) is decoded at once, in
  one KV cache (policy.DecodeSession): 2 (keys, values) x layers x KV heads x head_dim x 2 bytes per
  token (144 KiB for Qwen3-8B), a buffer that doubles when full (so up to twice the context is
  allocated), plus the first forward pass, which feeds every row's prompt at once: one layer's MLP
  intermediates (3 x intermediate) and the residual stream (3 x hidden) per token, and the
  attention mask (rows x prompt^2, 1 byte, and again in the compute dtype inside SDPA).
- update: one micro-batch's forward and backward: the activations saved for backward (4 x hidden
  + 4 x intermediate + 3 x heads x head_dim + 4 x KV heads x head_dim per token and layer), or with
  gradient checkpointing each layer's input and one layer recomputed; the log-probs from the
  hidden states a chunk of positions at a time (policy.token_logprobs), against B x T x V x 12 bytes
  for the full-vocabulary form it replaced.
- evaluation: as many rows as fit what the rollout leaves (ScaleBackend.evaluate decodes that
  many episodes at once), at least --eval-samples.

10% of each GPU is kept back for the CUDA context, NCCL's buffers and the allocator's
fragmentation. Not counted: the holes a lockstep KV cache carries when rows grow unevenly, and the
intervention's LLM roles, which re-encode contexts of the same rows (no more rows than the
rollout).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from policy import LOGPROB_CHUNK, build_tiny_model, load_model

GIB = 2**30
KEPT_BACK = 0.10  # of each GPU's memory: CUDA context, NCCL buffers, fragmentation
LORA_PLAN_R = 16  # the LoRA rank the plan suggests when full fine-tuning does not fit

# the config.json of Qwen3's dense releases (the parameter counts match their model cards:
# 0.6B 0.60, 1.7B 1.72, 4B 4.02, 8B 8.19, 14B 14.77, 32B 32.76 billion)
QWEN3 = dict(
    vocab_size=151936,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
)
PRESETS = {
    "Qwen3-0.6B-like": dict(
        QWEN3,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        tie_word_embeddings=True,
    ),
    "Qwen3-1.7B-like": dict(
        QWEN3,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        tie_word_embeddings=True,
    ),
    "Qwen3-4B-like": dict(
        QWEN3,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        tie_word_embeddings=True,
    ),
    "Qwen3-8B-like": dict(
        QWEN3,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        tie_word_embeddings=False,
    ),
    "Qwen3-14B-like": dict(
        QWEN3,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=40,
        num_attention_heads=40,
        tie_word_embeddings=False,
    ),
    "Qwen3-32B-like": dict(
        QWEN3,
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        tie_word_embeddings=False,
    ),
}
QWEN3_8B = PRESETS["Qwen3-8B-like"]


@dataclass(frozen=True)
class Arch:
    """What the plan needs of a decoder's configuration."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    max_positions: int

    @classmethod
    def from_config(cls, c: dict) -> Arch:
        """From a Hugging Face config (a dict of config.json's keys); a multimodal model's text
        part."""
        c = c.get("text_config") or c
        heads = c["num_attention_heads"]
        return cls(
            vocab=c["vocab_size"],
            hidden=c["hidden_size"],
            intermediate=c["intermediate_size"],
            layers=c["num_hidden_layers"],
            heads=heads,
            kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            tied=bool(c.get("tie_word_embeddings", False)),
            max_positions=c.get("max_position_embeddings", 0),
        )

    def layer_params(self) -> int:
        """One decoder layer: the q, k, v, o projections, the SwiGLU MLP and its norms (two of
        width hidden, q_norm and k_norm of width head_dim)."""
        h = self.hidden
        attention = h * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attention + 3 * h * self.intermediate + 2 * h + 2 * self.head_dim

    def outer_params(self) -> int:
        """Embeddings, output head (unless tied) and final norm: FSDP's root."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def params(self) -> int:
        return self.layers * self.layer_params() + self.outer_params()

    def lora_params(self, r: int) -> int:
        """Rank-r adapters (A: r x in, B: out x r) on every linear layer of the decoder layers."""
        h = self.hidden
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        shapes = [(h, q), (h, kv), (h, kv), (q, h)] + [(h, self.intermediate)] * 2
        shapes.append((self.intermediate, h))
        return self.layers * sum(r * (i + o) for i, o in shapes)

    def kv_bytes(self, dtype_bytes: int) -> int:
        """KV cache bytes per token: keys and values of every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def train_activation_bytes(self, dtype_bytes: int) -> int:
        """Activations one layer saves for backward, per token (inputs of the norms and of every
        linear layer, the attention's q, k, v and output, the MLP's four intermediates)."""
        h = self.hidden
        attention = 3 * self.heads * self.head_dim + 4 * self.kv_heads * self.head_dim
        return (4 * h + 4 * self.intermediate + attention) * dtype_bytes

    def inference_activation_bytes(self, dtype_bytes: int) -> int:
        """One layer's largest transient without gradients, per token: the MLP's three
        intermediates at its product, and the residual stream."""
        return (3 * self.intermediate + 3 * self.hidden) * dtype_bytes


def load_arch(name: str, model: str = "tiny") -> Arch:
    """--model-config: a preset name, a directory holding config.json, a config.json; '' = the
    configuration of --model (the tiny model's, or its directory's). Reads no weights."""
    if name in PRESETS:
        return Arch.from_config(PRESETS[name])
    if not name and model == "tiny":
        return Arch.from_config(tiny_config())
    path = Path(name or model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"--model-config: {name!r} is neither a preset ({', '.join(PRESETS)}) nor a "
            "config.json or a directory holding one"
        )
    return Arch.from_config(json.loads(path.read_text()))


def tiny_config() -> dict:
    """policy.build_tiny_model's configuration."""
    _, tok = load_model("tiny")
    return build_tiny_model(len(tok)).config.to_dict()


@dataclass
class Plan:
    """A run's memory per GPU: the parts (name, bytes, what), the phases' peaks, the rows one
    decoding batch can hold, and whether the run fits."""

    arch: Arch
    gpus: int
    gpu_gib: float
    context: int
    prompt: int
    mode: str
    parts: list[tuple[str, float, str]]
    phases: dict[str, float]
    usable: float
    train_rows: int
    rows_fit: int
    eval_rows: int
    problems: list[str]

    @property
    def fits(self) -> bool:
        return not self.problems


def memory_plan(cfg, arch: Arch, gpus: int, gpu_gib: float) -> Plan:
    """The plan of run `cfg` (an extras.scale.ScaleConfig) on `gpus` GPUs of `gpu_gib` GiB each."""
    context = cfg.context or arch.max_positions
    prompt = min(cfg.prompt_tokens or context, context)
    cdt = 2 if cfg.dtype == "bf16" else 4
    p = arch.params()
    p_train = arch.lora_params(cfg.lora_r) if cfg.lora_r else p
    fsdp = gpus > 1 or cfg.fsdp
    master = cfg.dtype == "bf16" and not cfg.lora_r and cfg.master_weights and not fsdp
    sharded = fsdp or master
    n = gpus if fsdp else 1
    parts = []
    if sharded:
        what = "fp32 master weights" if master else f"fp32 shards, 1/{n} each"
        parts.append(("weights", 4 * p / n, what))
        parts.append(("gradients", 4 * p_train / n, "fp32"))
        parts.append(("AdamW states", 8 * p_train / n, "fp32 m and v"))
    elif cfg.lora_r:
        parts.append(("weights", cdt * p + 4 * p_train, f"base in {cfg.dtype}, fp32 adapters"))
        parts.append(("gradients", 4 * p_train, f"adapters only ({p_train / 1e6:.0f}M)"))
        parts.append(("AdamW states", 8 * p_train, "adapters only"))
    else:
        parts.append(("weights", cdt * p, cfg.dtype))
        parts.append(("gradients", cdt * p, cfg.dtype))
        parts.append(("AdamW states", 2 * cdt * p, cfg.dtype))
    resident = sum(b for _, b, _ in parts)
    gathered = cdt * p if sharded else 0
    if sharded:
        parts.append(("gathered weights", gathered, "the whole model while sampling"))
    usable = (1 - KEPT_BACK) * gpu_gib * GIB

    kv_row = 2 * context * arch.kv_bytes(cdt)
    prefill_row = prompt * arch.inference_activation_bytes(cdt) + prompt**2 * (1 + cdt)
    decode_row = kv_row + prefill_row + 16 * arch.vocab  # + next-token logits and sampling
    room = usable - resident - gathered
    rows_fit = max(0, int(room // decode_row))
    if cfg.decode_tokens:
        rows_fit = min(rows_fit, cfg.decode_tokens // context)
    train_rows = cfg.batch_tasks // n * cfg.group_size
    parts.append(
        (
            "rollout KV cache",
            train_rows * kv_row,
            f"{train_rows} rows x {context} tokens x {arch.kv_bytes(cdt) / 1024:.0f} KiB, "
            "up to twice (the buffer doubles)",
        )
    )
    parts.append(
        (
            "rollout first forward",
            train_rows * prefill_row,
            f"{train_rows} prompts of {prompt} tokens at once",
        )
    )

    tokens = cfg.micro_batch * context
    if cfg.gradient_checkpointing:
        act = tokens * (arch.layers * arch.hidden * cdt + 2 * arch.train_activation_bytes(cdt))
        how = "gradient checkpointing: layer inputs + one layer"
    else:
        act = tokens * arch.layers * arch.train_activation_bytes(cdt)
        how = "every layer's, no gradient checkpointing"
    parts.append(("update activations", act, f"{cfg.micro_batch} rows x {context} tokens, {how}"))
    logprobs = 16 * LOGPROB_CHUNK + tokens * arch.hidden * (cdt + 4)
    plain = 12 * tokens * arch.vocab
    parts.append(
        (
            "update log-probs",
            logprobs,
            f"chunked; the full-vocabulary form took {plain / GIB:.1f} GiB",
        )
    )
    unsharded = cdt * (arch.outer_params() + 4 * arch.layer_params()) if sharded else 0
    score = cfg.micro_batch * context * arch.inference_activation_bytes(cdt) + logprobs
    eval_rows = 0
    if cfg.eval_tasks:
        eval_rows = min(
            math.ceil(cfg.eval_tasks / n) * cfg.eval_samples,
            rows_fit // cfg.eval_samples * cfg.eval_samples,
        )
    phases = {
        "rollout": resident + gathered + train_rows * decode_row,
        "scoring": resident + gathered + score,
        "update": resident + unsharded + act + logprobs,
        "evaluation": resident + gathered + eval_rows * decode_row,
    }
    problems = []
    for phase, peak in phases.items():
        if peak > usable:
            problems.append(f"the {phase} needs {peak / GIB:.1f} GiB")
    if cfg.eval_tasks and rows_fit < cfg.eval_samples:
        problems.append(f"evaluation cannot decode the {cfg.eval_samples} samples of one task")
    mode = "FSDP2" if fsdp else "one GPU"
    mode += ", LoRA" if cfg.lora_r else ", full fine-tuning"
    if master:
        mode += " with fp32 master weights"
    return Plan(
        arch=arch,
        gpus=gpus,
        gpu_gib=gpu_gib,
        context=context,
        prompt=prompt,
        mode=mode,
        parts=parts,
        phases=phases,
        usable=usable,
        train_rows=train_rows,
        rows_fit=rows_fit,
        eval_rows=eval_rows,
        problems=problems,
    )


def format_plan(plan: Plan, flags: str) -> str:
    """The plan as a markdown table and a verdict."""
    a = plan.arch
    lines = [
        f"memory plan: {a.layers} layers, hidden {a.hidden}, vocabulary {a.vocab}, "
        f"{a.params() / 1e9:.2f}B parameters; {plan.gpus} GPU(s) of {plan.gpu_gib:g} GiB "
        f"({plan.usable / GIB:.1f} GiB usable: {KEPT_BACK:.0%} kept back); {plan.mode}",
        f"flags: {flags}",
        "",
        "| per GPU | GiB | what |",
        "| --- | ---: | --- |",
    ]
    lines += [f"| {name} | {b / GIB:.1f} | {what} |" for name, b, what in plan.parts]
    lines += [f"| peak: {name} | {b / GIB:.1f} | |" for name, b in plan.phases.items()]
    lines.append("")
    lines.append(
        f"one decoding batch holds {plan.rows_fit} rows of {plan.context} tokens "
        f"(training rollout: {plan.train_rows} rows; evaluation decodes {plan.eval_rows} at once)"
    )
    if plan.fits:
        lines.append("fits")
    else:
        lines.append("does not fit: " + "; ".join(plan.problems))
    return "\n".join(lines)


def plan_flags(cfg) -> str:
    """The flags a plan depends on, as a command line would give them."""
    out = [
        f"--dtype {cfg.dtype}",
        f"--batch-tasks {cfg.batch_tasks}",
        f"--group-size {cfg.group_size}",
        f"--micro-batch {cfg.micro_batch}",
        f"--context {cfg.context}",
    ]
    if cfg.prompt_tokens:
        out.append(f"--prompt-tokens {cfg.prompt_tokens}")
    if cfg.lora_r:
        out.append(f"--lora-r {cfg.lora_r}")
    if cfg.gradient_checkpointing:
        out.append("--gradient-checkpointing")
    if not cfg.master_weights:
        out.append("--no-master-weights")
    return " ".join(out)


def alternatives(cfg, gpus: int):
    """Runs close to `cfg`, fewest and smallest changes first: gradient checkpointing, bf16, a
    smaller micro-batch, LoRA, fewer tasks a step."""
    lora = [cfg.lora_r] + ([LORA_PLAN_R] if not cfg.lora_r else [])
    micro = sorted({cfg.micro_batch >> k for k in range(8)} - {0}, reverse=True)
    tasks = [t for t in sorted({cfg.batch_tasks >> k for k in range(8)}, reverse=True) if t]
    tasks = [t for t in tasks if t % gpus == 0]
    candidates = []
    for r in lora:
        for b in tasks:
            for m in micro:
                changes = {
                    "gradient_checkpointing": True,
                    "dtype": "bf16",
                    "micro_batch": m,
                    "lora_r": r,
                    "batch_tasks": b,
                }
                candidates.append(dataclasses.replace(cfg, **changes))
    return candidates


def fitting_flags(cfg, arch: Arch, gpus: int, gpu_gib: float) -> str | None:
    """The flags of the first alternative run that fits, or None."""
    for alt in alternatives(cfg, gpus):
        if memory_plan(alt, arch, gpus, gpu_gib).fits:
            return plan_flags(alt)
    return None


def check(cfg, gpus: int, gpu_gib: float, arch: Arch | None = None) -> Plan:
    """The run's plan (for `arch`, else --model-config's); ValueError("--flag: ...") when a flag
    is wrong or the run does not fit (the message names flags that do)."""
    if cfg.context < 0 or cfg.prompt_tokens < 0 or cfg.decode_tokens < 0:
        raise ValueError("--context, --prompt-tokens and --decode-tokens must be >= 0")
    if gpu_gib <= 0:
        raise ValueError(
            "--gpu-mem: the memory of one GPU in GiB is needed here (141 for an H200, 80 for an "
            "H100 80GB): no CUDA device to ask"
        )
    if cfg.batch_tasks % gpus:
        raise ValueError(f"--batch-tasks: {cfg.batch_tasks} tasks do not split across {gpus} GPUs")
    arch = arch or load_arch(cfg.model_config, cfg.model)
    plan = memory_plan(cfg, arch, gpus, gpu_gib)
    if not plan.fits:
        fix = fitting_flags(cfg, arch, gpus, gpu_gib)
        advice = (
            f"flags that fit: {fix}" if fix else "nothing close fits: more GPUs, or less --context"
        )
        raise ValueError(
            f"the run does not fit {gpus} GPU(s) of {gpu_gib:g} GiB: "
            + "; ".join(plan.problems)
            + f" (of {plan.usable / GIB:.1f} usable); {advice}\n\n"
            + format_plan(plan, plan_flags(cfg))
        )
    return plan


def plan_gpus(cfg) -> int:
    """--gpus, or the processes torchrun started, or 1."""
    return cfg.gpus or int(os.environ.get("WORLD_SIZE", "1"))
