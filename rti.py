"""Rollout-Time Intervention (RTI) trainer: config, model, batched multi-turn sampling, warm start, GRPO/RTI loop.

    python rti.py                      # the demo: tiny Qwen3, warm start (cached), RTI training, before/after table
    python rti.py eval runs/demo/model # pass@1..4 and pass^1..4 of a saved model on the test split
    python rti.py --help               # every Config field is a flag

Data flows one way: envs (tasks, rubric) -> rollout here -> intervene.py (RTI) -> loss.py -> AdamW. GPUs, LoRA and
FSDP2 (extras/scale.py) plug in through `Backend`, the one object the loop asks where the model runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import time
import zlib
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers
from tqdm.auto import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import envs
import evaluate
import intervene
from intervene import RTIConfig
from loss import POLICY, LossConfig, advantages_by_group, group_rows, policy_loss

WARMSTART_DIR = "checkpoints/warmstart"


# ----------------------------------------------------------------------------- config and flags


@dataclass
class Config:
    """Every field is a flag (`--field-name`; booleans also `--no-field-name`), and so is every field of the nested
    `loss` (loss.py: clip, is-mode, weights, aggregation) and `rti` (intervene.py: roles, gate) configs."""

    model: str = "tiny"  # "tiny" (built from a config) or a local Hugging Face model directory
    init: str = WARMSTART_DIR  # starting weights of the tiny model ("" = as built)
    seed: int = 0
    threads: int = 2  # torch CPU threads
    env: str = "navigation"  # a name in envs.ENVS
    user_model: str = (
        ""  # envs with a user: "" = the policy model, "scripted", or a model directory
    )
    train_split: str = "train"
    test_split: str = "test"
    batch_tasks: int = 8  # B tasks a step
    group_size: int = 8  # G trajectories a task
    temperature: float = 1.0
    top_p: float = 1.0
    max_turn_tokens: int = 4  # new tokens per agent turn
    method: str = "rti"  # "grpo" | "rti"
    steps: int = 8
    lr: float = 1e-4
    weight_decay: float = 0.0
    updates_per_batch: int = 1  # epochs over each rollout batch
    mini_batches: int = (
        4  # optimizer steps per epoch, on shuffled parts of the batch (chosen on val)
    )
    warmup_steps: int = 0  # linear learning-rate warm-up over the first N steps
    micro_batch: int = 8  # rows per forward/backward (gradients accumulate); memory ~ rows x T^2
    grad_clip: float = 1.0
    eval_every: int = 10
    eval_samples: int = 4
    eval_tasks: int = 100  # first N tasks of the test split (0: no evaluation)
    eval_before: bool = True  # evaluate the starting policy too
    out: str = "runs/demo"
    resume: bool = False
    save_every: int = 10
    progress: bool = True
    loss: LossConfig = field(default_factory=LossConfig)
    rti: RTIConfig = field(default_factory=RTIConfig)

    def validate(self) -> None:
        """Raise ValueError("--flag: why") for a bad value (LossConfig and RTIConfig check their fields when built)."""

        def need(ok, name, why):
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')}: {why}, got {getattr(self, name)!r}")

        need(self.group_size >= 2, "group_size", "must be >= 2 for group advantages")
        for name in (
            "batch_tasks",
            "max_turn_tokens",
            "updates_per_batch",
            "mini_batches",
            "micro_batch",
            "eval_samples",
            "threads",
            "save_every",
        ):
            need(getattr(self, name) >= 1, name, "must be >= 1")
        for name in ("steps", "eval_every", "eval_tasks", "warmup_steps"):
            need(getattr(self, name) >= 0, name, "must be >= 0")
        for name in ("temperature", "lr", "grad_clip"):
            need(getattr(self, name) > 0, name, "must be > 0")
        need(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(self.method in ("grpo", "rti"), "method", "must be grpo or rti")
        need(
            self.rti.intervene_per_group <= self.group_size,
            "group_size",
            "must be >= --intervene-per-group",
        )
        need(
            self.model == "tiny" or Path(self.model).is_dir(),
            "model",
            "must be 'tiny' or a local model directory",
        )
        try:
            splits = envs.env_class(self.env).splits()
        except (ImportError, ValueError) as e:
            raise ValueError(f"--env: {e}") from None
        for name in ("train_split", "test_split"):
            need(getattr(self, name) in splits, name, f"must be a split of {self.env}: {splits}")
        need(
            self.env == "navigation" or self.model != "tiny" or not self.init,
            "init",
            "the tiny warm start is a Navigation model: pass --init '' (a random tiny model) or --model PATH",
        )
        need(
            self.user_model in ("", "scripted") or Path(self.user_model).is_dir(),
            "user_model",
            "must be '', 'scripted' or a local model directory",
        )


def flag_fields(cls) -> list[tuple[str | None, dataclasses.Field]]:
    """(name of the nested config or None, field) for every flag of a config class."""
    nested = lambda f: dataclasses.is_dataclass(f.default_factory)  # noqa: E731
    return [
        (f.name, g) if nested(f) else (None, f)
        for f in dataclasses.fields(cls)
        for g in (dataclasses.fields(f.default_factory) if nested(f) else [f])
    ]


def make_config(cls=Config, **flags):
    """A config from flat flag names, as the command line gives them: make_config(ppl_max=3, lr=1e-4)."""
    owner = {f.name: parent for parent, f in flag_fields(cls)}
    if set(flags) - set(owner):
        raise TypeError(f"unknown config fields {sorted(set(flags) - set(owner))}")
    parts = {
        p: f.default_factory(**{k: v for k, v in flags.items() if owner[k] == p})
        for p, f in ((f.name, f) for f in dataclasses.fields(cls))
        if p in owner.values()
    }
    return cls(**{k: v for k, v in flags.items() if owner[k] is None}, **parts)


def parse_args(argv=None, cls=Config, commands=("train", "eval"), prog="rti.py"):
    """(command, model directory given after it or None, validated config) from the command line; a bad flag exits
    naming it. The directory, if any, becomes --model (a model to evaluate)."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="RTI: Rollout-Time Intervention for agentic RL.",
        usage=f"python {prog} [{' | '.join(commands)}] [MODEL_DIR] [--flag VALUE ...]",
    )
    p.add_argument("command", nargs="?", default=commands[0], choices=commands)
    p.add_argument("path", nargs="?", help="eval: the model directory to evaluate")
    types = {
        "int": int,
        "float": float,
        "str": str,
        "int | None": lambda s: None if s == "none" else int(s),
    }
    for _, f in flag_fields(cls):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            p.add_argument(
                flag, type=types[f.type], default=f.default, metavar=f.type.split()[0].upper()
            )
    args = vars(p.parse_args(argv))
    command, path = args.pop("command"), args.pop("path")
    if path:
        args.update(model=path, init="")
    try:
        cfg = make_config(cls, **args)
        cfg.validate()
    except ValueError as e:  # LossConfig and RTIConfig say "field: why"
        name, why = str(e).split(":", 1)
        p.error(f"{name if name.startswith('--') else '--' + name.replace('_', '-')}:{why}")
    return command, path, cfg


# ----------------------------------------------------------------------------- model and tokenizer

SPECIAL = ["<pad>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>", "<|im_end|>"]
TINY_TEMPLATE = (  # compact: a turn costs 2 marker tokens plus the agent's eos (14 tokens a Navigation turn)
    "{% for m in messages %}{% if not loop.first %} {% endif %}<|{{ m['role'] }}|> {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %} <|im_end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %} <|assistant|>{% endif %}"
)


def load_model(
    path_or_tiny: str, seed: int = 0, dtype: torch.dtype = torch.float32, env: str = "navigation"
):
    """(model, tokenizer). `tiny` builds them from scratch: a word-level tokenizer over the words of `env` and of
    intervene's prompts, with a chat template, and a 0.8M-parameter Qwen3 (hidden 128, 4 layers, 4 heads, 2 KV heads,
    head_dim 32, 2,048 positions). A directory loads any local Hugging Face causal LM (nothing is downloaded)."""
    if path_or_tiny == "tiny":
        vocab = {}
        for w in SPECIAL + envs.env_class(env).vocabulary() + intervene.PROMPT_WORDS:
            vocab.setdefault(w, len(vocab))
        backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            pad_token="<pad>",
            unk_token="<unk>",
            eos_token="<|im_end|>",
            chat_template=TINY_TEMPLATE,
        )
        return build_tiny_model(len(tok), seed).to(dtype), tok
    if not Path(path_or_tiny).is_dir():
        raise FileNotFoundError(
            f"model directory {path_or_tiny!r} not found (nothing is downloaded)"
        )
    tok = AutoTokenizer.from_pretrained(path_or_tiny, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path_or_tiny, local_files_only=True, dtype=dtype)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def build_tiny_model(vocab_size: int, seed: int = 0):
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=vocab_size,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
            pad_token_id=0,
            eos_token_id=SPECIAL.index("<|im_end|>"),
        )
    )


# ----------------------------------------------------------------------------- chat rendering (token-in, token-out)


class Chat:
    """Token ids of the pieces of a multi-turn chat, rendered through the tokenizer's own chat template.

    A training sequence is prompt_ids(first message) + [agent ids ... <eos>] + turn_ids(observation) + [agent ...] ...
    The agent's ids are kept exactly as sampled; only prompt and observation text is tokenized. Here an observation
    is a user message and an action is the turn's text (the tiny model); extras/chat_tools.py's ToolChat renders
    templates that take tools (Qwen3): actions as tool calls, observations as tool messages."""

    MARK, REPLY = "\x00MSG\x00", "\x00REPLY\x00"

    def __init__(self, tok, env: str = "navigation"):
        self.tok, self.env_cls, self.eos_id = tok, envs.env_class(env), tok.eos_token_id
        self.prompt_pre, self.prompt_post = self.render(
            [{"role": "user", "content": self.MARK}]
        ).split(self.MARK)
        self.turn_pre, self.turn_post = self.after_turn("user")

    def render(self, messages: list[dict]) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def after_turn(self, role: str) -> list[str]:
        """The template's text after an agent turn's eos, around the next `role` message. Past turns are never
        re-rendered, so a template that renders history differently (Qwen3 drops past turns' empty think blocks)
        still gives the tokens the model saw when it sampled."""
        eos = self.tok.eos_token
        turn = self.render(
            [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": self.REPLY},
                {"role": role, "content": self.MARK},
            ]
        )
        end = turn.find(eos, turn.find(self.REPLY))
        if self.REPLY not in turn or end < 0:
            raise ValueError(
                f"chat template does not close an assistant turn with the eos token {eos!r}"
            )
        return turn[end + len(eos) :].split(self.MARK)

    def ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False).input_ids

    def prompt_ids(self, content: str) -> list[int]:
        return self.ids(self.prompt_pre + content + self.prompt_post)

    def turn_ids(self, content: str, role: str | None = None) -> list[int]:
        """Ids after the agent's eos: the next observation (`role`: the env's observation_role), assistant header."""
        return self.ids(self.turn_pre + content + self.turn_post)

    def text(self, agent_ids: list[int]) -> str:
        """An agent turn as text, without its eos and special tokens."""
        return self.tok.decode(
            [i for i in agent_ids if i != self.eos_id], skip_special_tokens=True
        ).strip()

    def action_text(self, agent_ids: list[int]) -> str:
        """The env action a turn performs (its text here; ToolChat parses its tool call)."""
        return self.text(agent_ids)

    def action_ids(self, action: str) -> list[int]:
        """Ids of a turn (without eos) that performs `action`."""
        return self.ids(action)


# ----------------------------------------------------------------------------- batched decoding with a kept KV cache


def sample_token(
    logits: torch.Tensor, temperature: float, top_p: float, gens: list[torch.Generator]
):
    """Sample row i from softmax(logits_i / T), optionally nucleus-filtered, with its own generator gens[i]
    (Gumbel-max: argmax_v log p_v + g_v, g_v = -log(-log u_v)); return ids and log pi(id) at temperature T.
    One generator per row makes a row's sample independent of which other rows share the batch."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    keep = logp
    if top_p < 1.0:
        sp, si = logp.exp().sort(dim=-1, descending=True)
        drop = torch.zeros_like(sp, dtype=torch.bool).scatter(-1, si, sp.cumsum(-1) - sp >= top_p)
        keep = logp.masked_fill(drop, float("-inf"))
    u = torch.stack([torch.rand(logp.shape[-1], generator=g, device=g.device) for g in gens]).to(
        logp.device
    )
    ids = (keep - torch.log(-torch.log(u.clamp(1e-20, 1 - 1e-7)))).argmax(-1)
    return ids, logp.gather(-1, ids[:, None]).squeeze(-1)


class DecodeSession:
    """N rows decoded in lockstep through one KV cache that is kept across turns.

    Rows grow independently: a call that feeds tokens to some rows pads the others with masked slots (holes), and
    position ids count only real tokens, so each row computes exactly what it would alone (tests check this), but
    for a sliding-window layer, whose window counts holes too. `keep` drops finished rows and packs out holes;
    `retract` masks a row's latest tokens out (to replace a turn)."""

    def __init__(
        self, model, prefixes: list[list[int]], pad_id: int, seeds: list[int] | None = None
    ):
        self.model, self.pad_id, self.n = model, pad_id, len(prefixes)
        dev = next(model.parameters()).device
        self.gens = [
            torch.Generator(device=dev).manual_seed(int(s) % 2**63)  # one sampling stream per row
            for s in (range(self.n) if seeds is None else seeds)
        ]
        self.cache = DynamicCache(config=model.config)
        self.mask = torch.zeros(self.n, 0, dtype=torch.long, device=dev)
        self.length = torch.zeros(self.n, dtype=torch.long, device=dev)  # real tokens per row
        self.last_logits = torch.zeros(self.n, model.config.vocab_size, device=dev)
        self.real_slots: list[list[int]] = [
            [] for _ in range(self.n)
        ]  # cache slot of each real token
        self.saved_logits: dict[int, torch.Tensor] = {}  # next-token logits before a turn
        self.feed(list(range(self.n)), prefixes)

    @torch.no_grad()
    def feed(self, rows: list[int], chunks: list[list[int]]) -> None:
        """Append chunks[i] to row rows[i] (one forward pass); the next-token logits of those rows are updated."""
        rows_chunks = [(r, c) for r, c in zip(rows, chunks) if len(c) > 0]
        if not rows_chunks:
            return
        dev, width, start = (
            self.mask.device,
            max(len(c) for _, c in rows_chunks),
            self.mask.shape[1],
        )
        ids = torch.full((self.n, width), self.pad_id, dtype=torch.long, device=dev)
        new_mask = torch.zeros(self.n, width, dtype=torch.long, device=dev)
        for r, c in rows_chunks:  # left-align each chunk; trailing pads are holes
            ids[r, : len(c)] = torch.tensor(c, device=dev)
            new_mask[r, : len(c)] = 1
            self.real_slots[r].extend(range(start, start + len(c)))
        pos = self.length[:, None] + (new_mask.cumsum(-1) - 1).clamp(min=0)
        self.mask = torch.cat([self.mask, new_mask], 1)
        lens = new_mask.sum(-1)
        has, last = lens > 0, lens[lens > 0] - 1
        keep = torch.unique(
            last
        )  # only the columns whose logits are used: all of them is GBs at a 150k vocabulary
        out = self.model(
            input_ids=ids,
            attention_mask=self.mask,
            position_ids=pos,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        self.last_logits[has] = out.logits[has, torch.searchsorted(keep, last)].float()
        self.length += lens

    @torch.no_grad()
    def sample_turn(
        self, rows: list[int], max_new: int, eos_id: int, temperature: float, top_p: float
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Sample one agent turn (up to max_new tokens, stopping at eos) for each row in `rows`."""
        ids_out, logp_out = [[] for _ in rows], [[] for _ in rows]
        live = list(range(len(rows)))
        self.saved_logits = {r: self.last_logits[r].clone() for r in rows}  # for retract
        while live:
            tok, lp = sample_token(
                self.last_logits[[rows[i] for i in live]],
                temperature,
                top_p,
                [self.gens[rows[i]] for i in live],
            )
            for j, i in enumerate(live):
                ids_out[i].append(int(tok[j]))
                logp_out[i].append(float(lp[j]))
            self.feed([rows[i] for i in live], [[ids_out[i][-1]] for i in live])
            live = [i for i in live if ids_out[i][-1] != eos_id and len(ids_out[i]) < max_new]
        return ids_out, logp_out

    @torch.no_grad()
    def keep(self, rows: list[int]) -> None:
        """Keep only `rows`, renumbered: row rows[i] becomes row i, its real tokens packed to the left of the cache
        (their keys carry their positions already), so finished episodes and holes stop costing compute and memory."""
        idx, real = (
            torch.tensor(rows, dtype=torch.long, device=self.mask.device),
            [self.real_slots[r] for r in rows],
        )
        if any(
            self.cache.is_sliding
        ):  # a sliding-window layer keeps its last columns only: drop rows only
            self.mask, cols = self.mask[idx], None
        else:  # cols[i, j]: the slot of row i's j-th real token, -1 past its end
            cols = pad_rows(real, -1, torch.long, idx.device)
            self.mask, cols, real = (
                (cols >= 0).long(),
                cols.clamp(min=0),
                [list(range(len(s))) for s in real],
            )
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[idx], layer.values[idx]
            if cols is not None:
                at = cols[:, None, :, None].expand(
                    -1, layer.keys.shape[1], -1, layer.keys.shape[-1]
                )
                layer.keys, layer.values = layer.keys.gather(2, at), layer.values.gather(2, at)
        self.real_slots, self.length, self.last_logits = (
            real,
            self.length[idx],
            self.last_logits[idx],
        )
        self.gens, self.n = [self.gens[r] for r in rows], len(rows)
        self.saved_logits = {
            i: self.saved_logits[r] for i, r in enumerate(rows) if r in self.saved_logits
        }

    @torch.no_grad()
    def retract(self, row: int, n_tokens: int) -> None:
        """Mask out the row's last n_tokens (they become holes); its next-token logits return to before them."""
        slots = self.real_slots[row][len(self.real_slots[row]) - n_tokens :]
        del self.real_slots[row][len(self.real_slots[row]) - n_tokens :]
        self.mask[row, slots] = 0
        self.length[row] -= n_tokens
        self.last_logits[row] = self.saved_logits[row]


def pad_rows(rows: list[list], fill, dtype, device) -> torch.Tensor:
    """[N, T] tensor of right-padded rows, T = the longest row."""
    out = torch.full((len(rows), max(map(len, rows), default=0)), fill, dtype=dtype, device=device)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=dtype, device=device)
    return out


def token_logprobs(
    model, seqs: list[list[int]], pad_id: int, temperature: float, device
) -> torch.Tensor:
    """[B, T] log-probs of each token given the ones before it, at the sampling temperature (column 0 is 0), of the
    right-padded sequences. No attention mask: under causal attention a real token never sees the pads after it,
    so the pads (whatever their id) change nothing, and SDPA can run its faster causal kernel."""
    ids = pad_rows(seqs, pad_id, torch.long, device)
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float() / temperature
    return F.pad(torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))


class Sampler:
    """The policy as the loop and intervene.py (its `Policy` protocol) use it: the network `model`, its chat pieces,
    batched sampling through KV-cached sessions and log-prob scoring."""

    def __init__(
        self,
        model,
        tok,
        temperature=1.0,
        top_p=1.0,
        max_turn_tokens=4,
        seed=0,
        micro_batch=8,
        env="navigation",
        user=None,
        chat: Chat | None = None,
    ):
        self.model, self.tok, self.chat = model, tok, chat or Chat(tok, env)
        self.user = user  # plays the user in envs that have one (Env.make_user)
        self.temperature, self.top_p, self.max_turn_tokens = temperature, top_p, max_turn_tokens
        self.micro_batch, self.device = micro_batch, next(model.parameters()).device
        self.gen = torch.Generator(device=self.device).manual_seed(seed)

    def make_env(self, task) -> envs.Env:
        """A fresh environment for `task` (with its user, if the env has one)."""
        return self.chat.env_cls.make(task, self.user)

    def session(self, prefixes: list[list[int]], seeds: list[int] | None = None) -> DecodeSession:
        """A decoding session; row i samples from its own stream `seeds[i]` (default: drawn from self.gen)."""
        if seeds is None:
            seeds = torch.randint(
                2**62, (len(prefixes),), generator=self.gen, device=self.gen.device
            ).tolist()
        return DecodeSession(self.model, prefixes, self.tok.pad_token_id, seeds)

    def sample_turn(self, session: DecodeSession, rows: list[int], max_new: int | None = None):
        return session.sample_turn(
            rows, max_new or self.max_turn_tokens, self.chat.eos_id, self.temperature, self.top_p
        )

    def generate(self, contexts: list[list[int]], max_new: int | None = None):
        """One agent turn for each context, re-encoding the context (corrector and LLM roles)."""
        return (
            self.sample_turn(self.session(contexts), list(range(len(contexts))), max_new)
            if contexts
            else ([], [])
        )

    @torch.no_grad()
    def score(self, seqs: list[list[int]]) -> list[list[float]]:
        """log pi(y_t | y_<t) at the sampling temperature for every token (0.0 for the first)."""
        out = []
        for i in range(0, len(seqs), self.micro_batch):
            lp = token_logprobs(
                self.model,
                seqs[i : i + self.micro_batch],
                self.tok.pad_token_id,
                self.temperature,
                self.device,
            )
            out += [lp[j, : len(s)].tolist() for j, s in enumerate(seqs[i : i + self.micro_batch])]
        return out


# ----------------------------------------------------------------------------- trajectories and rollout


@dataclass
class Trajectory:
    """One episode as the exact token sequence the model saw, with per-token bookkeeping."""

    task: object
    group: int
    ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(
        default_factory=list
    )  # 1 on agent tokens, 0 on prompt and environment tokens
    source: list[int] = field(default_factory=list)  # POLICY or INTERVENED per token
    sample_logp: list[float] = field(
        default_factory=list
    )  # log-prob when sampled (policy) / written (corrector)
    actions: list[str] = field(default_factory=list)
    turns: list[tuple[int, int]] = field(
        default_factory=list
    )  # (start, end) of each agent turn in ids
    observations: list[str] = field(
        default_factory=list
    )  # observations[i] is the user content before turn i
    reward: float = 0.0
    rubric: dict = field(default_factory=dict)
    intervention: dict | None = None
    seed: int | None = None  # the sampling stream of this episode

    def truncated(self, k: int) -> "Trajectory":
        """A copy of the episode before agent turn k (ends with the user message that turn k answered)."""
        end = self.turns[k][0] if k < len(self.turns) else len(self.ids)
        return Trajectory(
            task=self.task,
            group=self.group,
            ids=self.ids[:end],
            loss_mask=self.loss_mask[:end],
            source=self.source[:end],
            sample_logp=self.sample_logp[:end],
            actions=self.actions[:k],
            turns=self.turns[:k],
            observations=self.observations[: k + 1],
            seed=self.seed,
        )

    def add(self, ids, loss_mask, source, logp=None):
        self.ids += ids
        self.loss_mask += [loss_mask] * len(ids)
        self.source += [source] * len(ids)
        self.sample_logp += logp if logp is not None else [0.0] * len(ids)

    def step(self, chat: Chat, env, agent_ids, logp, source=POLICY) -> list[int] | None:
        """Record an agent turn (one cut off before eos is closed with a non-trained eos) and execute its action in
        `env`. Returns the tokens that follow the turn in the model's context (that eos, then the observation), or
        None when the episode ended (then reward and rubric are set)."""
        start = len(self.ids)
        self.add(agent_ids, 1, source, logp)
        closed = agent_ids[-1:] == [chat.eos_id]
        if not closed:
            self.add([chat.eos_id], 0, POLICY)
        self.turns.append((start, len(self.ids)))
        self.actions.append(chat.action_text(agent_ids))
        obs, done = env.step(self.actions[-1])
        if done:
            result = env.score()
            self.reward, self.rubric = float(result.success), dict(result.items)
            return None
        self.observations.append(obs)
        chunk = chat.turn_ids(obs, env.observation_role)
        self.add(chunk, 0, POLICY)
        return ([] if closed else [chat.eos_id]) + chunk


def episode_seed(seed: int, task_id: str, j: int) -> int:
    """The sampling stream of sample j of a task: a function of (seed, task, j) alone, so an episode samples the same
    tokens whatever else shares its batch, on one process or split across several."""
    return zlib.crc32(
        f"{seed}/{task_id}/{j}".encode()
    )  # 32 bits: torch's CPU generator seeds from the low 32


def rollout(
    sampler: Sampler, tasks: list, group_size: int, seed: int | None = None
) -> list[Trajectory]:
    """Sample B x G multi-turn episodes in lockstep: one batched decoding pass per turn for all live episodes.

    The KV cache is kept across turns, so each turn feeds only the new observation tokens. Each episode samples
    from its own stream (episode_seed); `seed` None draws one from sampler.gen."""
    sampler.model.eval()
    if seed is None:
        seed = int(torch.randint(2**62, (1,), generator=sampler.gen, device=sampler.gen.device))
    env_list, trajs = [], []
    for g, task in enumerate(tasks):
        for j in range(group_size):
            env_list.append(sampler.make_env(task))
            trajs.append(
                Trajectory(
                    task,
                    g,
                    observations=[env_list[-1].reset()],
                    seed=episode_seed(seed, task.task_id, j),
                )
            )
            trajs[-1].add(sampler.chat.prompt_ids(trajs[-1].observations[0]), 0, POLICY)
    session = sampler.session([t.ids for t in trajs], [t.seed for t in trajs])
    live = list(range(len(trajs)))  # live[i]: the episode in session row i
    while live:
        ids, logps = sampler.sample_turn(session, list(range(len(live))))
        chunks = [
            trajs[e].step(sampler.chat, env_list[e], a_ids, a_lp)
            for e, a_ids, a_lp in zip(live, ids, logps)
        ]
        going = [i for i, c in enumerate(chunks) if c is not None]
        if len(going) < len(live):
            session.keep(going)  # finished episodes leave the batch
        live = [live[i] for i in going]
        session.feed(list(range(len(live))), [chunks[i] for i in going])
    return trajs


def evaluate_policy(
    sampler: Sampler,
    tasks: list,
    n: int,
    seed: int = 1234,
    chunk: int = 256,
    per_task: bool = False,
):
    """pass@k / pass^k of the policy on `tasks` with n samples each (evaluate.summarize), on streams of their own.
    per_task=True also returns the successes, one list of n booleans per task."""
    successes, per_chunk = [], max(1, chunk // n)
    for i in range(0, len(tasks), per_chunk):
        trajs = rollout(sampler, tasks[i : i + per_chunk], n, seed)
        successes += [[t.reward > 0 for t in trajs[g : g + n]] for g in range(0, len(trajs), n)]
    summary = evaluate.summarize(successes, k_max=min(4, n))
    return (summary, successes) if per_task else summary


# ----------------------------------------------------------------------------- where the model runs (the plug-in)


class Backend:
    """One process, fp32 on the CPU. The loop asks only this object where the model runs, so extras/scale.py plugs
    in GPUs, bf16, LoRA, gradient checkpointing, chat templates with tools and FSDP2 across torchrun processes by
    subclassing it. With one process: `gathered(model)` (a context holding the full weights for a stretch of
    inference) does nothing, `all_reduce(x, op)` and `reduce_metrics(metrics)` return their input, and `my_tasks(tasks)`
    (this process's share of a batch, whole groups) is the whole batch."""

    rank, world, device, dtype = 0, 1, torch.device("cpu"), torch.float32
    gathered = staticmethod(lambda model: nullcontext())
    all_reduce = staticmethod(lambda x, op="sum": x)
    reduce_metrics = staticmethod(lambda metrics: metrics)
    my_tasks = staticmethod(lambda tasks: tasks)

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def prepare(self, model, tok, env: str) -> tuple:
        """The loaded model ready to train, and the Chat that renders its turns."""
        return model.to(self.device, self.dtype), Chat(tok, env)

    def evaluate(self, sampler: Sampler, tasks: list, n: int, seed: int):
        return evaluate_policy(sampler, tasks, n, seed=seed, per_task=True)

    def save_checkpoint(self, path: Path, sampler: Sampler, opt, state: dict) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save(
            {"model": sampler.model.state_dict(), "optimizer": opt.state_dict(), **state}, tmp
        )
        os.replace(tmp, path)

    def load_checkpoint(self, path: Path, sampler: Sampler, opt) -> dict:
        if not path.exists():
            raise FileNotFoundError(f"--resume: no checkpoint at {path}")
        state = torch.load(path, weights_only=False)
        sampler.model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        return state

    def save_model(self, sampler: Sampler, path: Path) -> None:
        sampler.model.save_pretrained(path)
        sampler.tok.save_pretrained(path)


# ----------------------------------------------------------------------------- RL training


def update(
    sampler: Sampler,
    opt,
    trajs: list[Trajectory],
    advantages: torch.Tensor,
    cfg: Config,
    backend: Backend | None = None,
    seed: int = 0,
) -> dict:
    """PPO-style updates on one rollout batch: pi_old's log-probs by one scoring pass at the sampling temperature,
    then `updates_per_batch` epochs, each of `mini_batches` AdamW steps on shuffled parts of the batch (verl's
    ppo_mini_batch_size, TRL's steps_per_generation), so that from the second step on the ratio and the clip act.
    With a single step per batch pi_old is the policy being updated: its log-probs are that step's own forward pass
    (detached), and every ratio is 1.

    Micro-batches of `micro_batch` rows accumulate into one step, each weighted by its share of the part's tokens
    (token-mean) or rows, so they add up to the part's loss. With several processes the part is the global one:
    shares use global counts, every process runs as many micro-batches as the busiest (empty ones where it has
    none), and the loss is scaled by the world size, as FSDP averages gradients. Metric `loss` is the mean of the
    steps' losses; the others are means over micro-batches."""
    backend, model = backend or Backend(cfg), sampler.model
    old, steps = None, cfg.updates_per_batch * cfg.mini_batches
    if steps > 1:
        with backend.gathered(model):
            old = sampler.score([t.ids for t in trajs])
    model.train()
    empty = Trajectory(
        None, -1, ids=[sampler.tok.pad_token_id], loss_mask=[0], source=[POLICY], sample_logp=[0.0]
    )
    metrics, batch_loss, order, rng = [], 0.0, list(range(len(trajs))), random.Random(seed)
    pad = lambda rows, dtype=torch.float32: pad_rows(rows, 0, dtype, sampler.device)  # noqa: E731
    for _ in range(cfg.updates_per_batch):
        if cfg.mini_batches > 1:
            rng.shuffle(order)
        for part in np.array_split(order, cfg.mini_batches):
            part = sorted(
                part.tolist(), key=lambda r: len(trajs[r].ids)
            )  # alike lengths: less padding
            n_tok = backend.all_reduce(sum(sum(trajs[r].loss_mask) for r in part))
            n_rows = backend.all_reduce(len(part))
            n_micro = int(backend.all_reduce(-(-len(part) // cfg.micro_batch), "max"))
            opt.zero_grad(set_to_none=True)
            for i in range(0, n_micro * cfg.micro_batch, cfg.micro_batch):
                idx = part[i : i + cfg.micro_batch]
                rows = [trajs[r] for r in idx] or [empty]
                adv = (advantages[idx] if idx else torch.zeros(1)).to(sampler.device)
                logp = token_logprobs(
                    model,
                    [t.ids for t in rows],
                    sampler.tok.pad_token_id,
                    sampler.temperature,
                    sampler.device,
                )
                mask = pad([t.loss_mask for t in rows])
                old_logp = logp.detach() if old is None else pad([old[r] for r in idx] or [[0.0]])
                loss, m = policy_loss(
                    logp,
                    old_logp,
                    adv,
                    mask,
                    source=pad([t.source for t in rows], torch.long),
                    behavior_logp=pad([t.sample_logp for t in rows]),
                    config=cfg.loss,
                )
                share = (
                    mask.sum().item() / max(1, n_tok)
                    if cfg.loss.agg == "token-mean"
                    else len(idx) / max(1, n_rows)
                )
                (loss * share * backend.world).backward()
                batch_loss += loss.item() * share / steps
                if idx:
                    metrics.append({"loss": loss.item(), **m})
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
    out = {k: float(np.mean([m[k] for m in metrics])) for k in (metrics[0] if metrics else ())}
    out["loss"] = backend.all_reduce(batch_loss)
    out["grad_norm"] = float(
        grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    )
    return out


def train_step(
    sampler: Sampler,
    opt,
    tasks: list,
    cfg: Config,
    seed: int | None = None,
    backend: Backend | None = None,
) -> dict:
    """Sample -> (RTI) -> rewards -> group advantages -> update. Returns the step's metrics. `seed` fixes the
    episodes' sampling streams (rollout) and the mini-batch shuffle; the trainer derives it from --seed and the step.
    Groups may differ in size (paired RTI adds corrections to their group): advantages are taken group by group."""
    backend = backend or Backend(cfg)
    t0 = time.time()
    with backend.gathered(
        sampler.model
    ):  # processes run different numbers of forwards from here to t2
        trajs = rollout(sampler, tasks, cfg.group_size, seed)
        t1 = time.time()
        metrics = {
            "train_success": float(np.mean([t.reward for t in trajs])),
            "turns": float(np.mean([len(t.actions) for t in trajs])),
        }
        if cfg.method == "rti":
            trajs, counts = intervene.intervene_batch(sampler, trajs, cfg.rti, sampler.make_env)
            metrics.update({f"rti/{k}": v for k, v in evaluate.intervention_rates(counts).items()})
    t2 = time.time()
    rewards, group_ids = torch.tensor([t.reward for t in trajs]), [t.group for t in trajs]
    adv = advantages_by_group(rewards, group_ids, scale=cfg.loss.scale_advantages)
    metrics["train_success_after_rti"] = float(rewards.mean())
    metrics["groups_with_spread"] = float(
        np.mean(
            [len({trajs[i].reward for i in rows}) > 1 for rows in group_rows(group_ids).values()]
        )
    )
    keep = [i for i in range(len(trajs)) if adv[i] != 0]  # zero-advantage rows add nothing but cost
    if backend.all_reduce(len(keep)):  # with several processes every one joins the update
        metrics.update(
            update(sampler, opt, [trajs[i] for i in keep], adv[keep], cfg, backend, seed or 0)
        )
    metrics.update(
        {
            "time/rollout": t1 - t0,
            "time/intervene": t2 - t1,
            "time/update": time.time() - t2,
            "trained_rows": len(keep),
        }
    )
    return backend.reduce_metrics(metrics)


def init_sampler(cfg: Config, backend: Backend) -> Sampler:
    """The model to train: the tiny model from --init (the committed warm start by default), or --model PATH."""
    tiny_init = cfg.model == "tiny" and cfg.init
    if tiny_init and not (Path(cfg.init) / "config.json").exists():
        raise FileNotFoundError(
            f"--init {cfg.init!r} holds no checkpoint (the warm start: python -m extras.warmstart)"
        )
    model, tok = load_model(cfg.init if tiny_init else cfg.model, cfg.seed, backend.dtype, cfg.env)
    model, chat = backend.prepare(model, tok, cfg.env)
    sampler = Sampler(
        model,
        tok,
        cfg.temperature,
        cfg.top_p,
        cfg.max_turn_tokens,
        cfg.seed + backend.rank,
        cfg.micro_batch,
        cfg.env,
        chat=chat,
    )
    sampler.user = envs.env_class(cfg.env).make_user(cfg.user_model, sampler)
    return sampler


def train(cfg: Config, log=print, backend: Backend | None = None) -> dict:
    """The training loop; returns the test metrics {"before", "after"} (evaluate.summarize), the run's intervention
    statistics and the sampler. With several processes each runs it on its share of every batch; process 0 logs."""
    backend = backend or Backend(cfg)
    torch.set_num_threads(cfg.threads)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    main_process, out = backend.rank == 0, Path(cfg.out)
    log = log if main_process else (lambda *a, **k: None)
    out.mkdir(parents=True, exist_ok=True)
    sampler = init_sampler(cfg, backend)
    opt = torch.optim.AdamW(
        [p for p in sampler.model.parameters() if p.requires_grad],
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
    )
    train_tasks = envs.env_tasks(cfg.env, cfg.train_split)
    test_tasks = envs.env_tasks(cfg.env, cfg.test_split)[: cfg.eval_tasks]
    task_rng, step, ckpt, results, rti_steps = random.Random(cfg.seed), 0, out / "ckpt.pt", {}, []
    test = lambda: backend.evaluate(sampler, test_tasks, cfg.eval_samples, cfg.seed + 10_000)  # noqa: E731
    if cfg.resume:
        state = backend.load_checkpoint(ckpt, sampler, opt)
        task_rng.setstate(state["task_rng"])
        sampler.gen.set_state(state["sample_rng"])
        torch.set_rng_state(state["torch_rng"])
        step, rti_steps = state["step"], state.get("rti_steps", [])
        log(f"resumed from {ckpt} at step {step}")
        if main_process:  # the log's rows past the checkpoint will come again
            logged = (out / "metrics.jsonl").read_text().splitlines()
            (out / "metrics.jsonl").write_text(
                "".join(r + "\n" for r in logged if json.loads(r)["step"] <= step)
            )
    elif cfg.eval_tasks and cfg.eval_before:
        results["before"], results["before_tasks"] = test()
        log(f"before training: test p@1 {results['before']['p@1']:.2f}")
    log_file = (
        (out / "metrics.jsonl").open("a" if cfg.resume else "w")
        if main_process
        else open(os.devnull, "w")
    )
    if "before" in results:
        log_file.write(
            json.dumps({"step": 0, **{f"test/{k}": v for k, v in results["before"].items()}}) + "\n"
        )
    bar = tqdm(
        range(step, cfg.steps),
        desc=f"{cfg.method} training",
        disable=not (cfg.progress and main_process),
        file=sys.stderr,
    )
    for step in bar:
        tasks = backend.my_tasks(task_rng.sample(train_tasks, cfg.batch_tasks))
        t0 = time.time()
        for (
            group
        ) in opt.param_groups:  # a function of the step alone, so --resume needs no scheduler state
            group["lr"] = (
                cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr
            )
        m = train_step(sampler, opt, tasks, cfg, seed=cfg.seed * 1_000_003 + step, backend=backend)
        m.update({"step": step + 1, "time/step": time.time() - t0})
        if (
            cfg.eval_every
            and (step + 1) % cfg.eval_every == 0
            and cfg.eval_tasks
            and step + 1 < cfg.steps
        ):
            m.update({f"test/{k}": v for k, v in test()[0].items()})
        rti_steps.append({k[4:]: v for k, v in m.items() if k.startswith("rti/")})
        log_file.write(json.dumps(m) + "\n")
        log_file.flush()
        bar.set_postfix(success=f"{m['train_success']:.2f}", loss=f"{m.get('loss', 0):.3f}")
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            backend.save_checkpoint(
                ckpt,
                sampler,
                opt,
                {
                    "step": step + 1,
                    "task_rng": task_rng.getstate(),
                    "sample_rng": sampler.gen.get_state(),
                    "torch_rng": torch.get_rng_state(),
                    "rti_steps": rti_steps,
                    "config": dataclasses.asdict(cfg),
                },
            )
    if cfg.method == "rti":
        results["interventions"] = evaluate.run_totals(rti_steps)
    if cfg.eval_tasks:
        results["after"], results["after_tasks"] = test()
        log_file.write(
            json.dumps({"step": cfg.steps, **{f"test/{k}": v for k, v in results["after"].items()}})
            + "\n"
        )
        if main_process:
            (out / "results.json").write_text(
                json.dumps({"config": dataclasses.asdict(cfg), **results})
            )
    log_file.close()
    backend.save_model(sampler, out / "model")
    return {**results, "sampler": sampler}


def report(cfg: Config, res: dict, seconds: float) -> str:
    """The demo's printout: the before/after table and the run's intervention statistics."""
    rows = {
        ("warm start" if k == "before" else f"after {cfg.steps} steps"): res[k]
        for k in ("before", "after")
        if k in res
    }
    lines = (
        [
            f"\n{cfg.method} on the {cfg.test_split} split ({cfg.eval_tasks} tasks x {cfg.eval_samples} samples):",
            evaluate.format_table(rows),
        ]
        if rows
        else []
    )
    if "interventions" in res:
        lines.append(
            f"\ninterventions over the run:\n{evaluate.intervention_report(res['interventions'])}"
        )
    return "\n".join(
        lines
        + [
            f"wall time {seconds:.0f} s; metrics in {cfg.out}/metrics.jsonl, model in "
            f"{cfg.out}/model"
        ]
    )


def eval_table(cfg: Config, backend: Backend) -> str:
    """pass@1..4 and pass^1..4 of --model on the first --eval-tasks tasks of --test-split, as a table."""
    sampler = init_sampler(cfg, backend)
    tasks = envs.env_tasks(cfg.env, cfg.test_split)[: cfg.eval_tasks]
    return evaluate.format_table(
        {cfg.model: evaluate_policy(sampler, tasks, cfg.eval_samples, seed=cfg.seed)}
    )


def main(argv=None) -> None:
    command, _, cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    t0 = time.time()
    if (
        command == "eval"
    ):  # python rti.py eval MODEL_DIR [--env ... --test-split ... --eval-tasks N ...]
        print(eval_table(cfg, Backend(cfg)))
    else:
        print(report(cfg, train(cfg), time.time() - t0))


if __name__ == "__main__":
    main()
