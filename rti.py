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
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
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
    threads: int = 1                    # torch CPU threads; 1 measured fastest for the tiny model on 2 cores
    # tasks and sampling
    train_split: str = "train"
    test_split: str = "test"
    batch_tasks: int = 8                # B tasks per step
    group_size: int = 8                 # G trajectories per task
    temperature: float = 1.0
    top_p: float = 1.0
    max_turn_tokens: int = 4            # new tokens per agent turn
    # optimisation
    method: str = "rti"                 # "grpo" | "rti"
    steps: int = 30
    lr: float = 1e-4
    weight_decay: float = 0.0
    updates_per_batch: int = 1
    micro_batch: int = 64               # trajectories per forward/backward
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
    eval_tasks: int = 150               # first N tasks of the test split
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

    def validate(self) -> None:
        """Raise ValueError naming the flag for any bad value."""
        def bad(flag, msg):
            raise ValueError(f"--{flag.replace('_', '-')}: {msg}")
        if self.group_size < 2:
            bad("group_size", f"must be >= 2 for group advantages, got {self.group_size}")
        for name in ("batch_tasks", "max_turn_tokens", "updates_per_batch", "micro_batch", "eval_samples",
                     "ws_batch", "correction_tries", "threads", "save_every", "steps", "ws_steps", "eval_every",
                     "eval_tasks", "max_corrections"):
            low = 0 if name in ("steps", "ws_steps", "eval_every", "eval_tasks", "max_corrections") else 1
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
        for name in ("train_split", "test_split", "ws_split"):
            if getattr(self, name) not in envs.SPLITS:
                bad(name, f"unknown split {getattr(self, name)!r}; known: {sorted(envs.SPLITS)}")
        self.loss_config()  # loss.py validates its own fields

    def loss_config(self) -> rl_loss.LossConfig:
        try:
            return rl_loss.LossConfig(
                clip_low=self.clip_low, clip_high=self.clip_high, is_mode=self.is_mode, reweight=self.reweight,
                w_min=self.w_min, w_max=self.w_max, kl_coef=self.kl_coef, agg=self.agg, ratio_level=self.ratio_level)
        except ValueError as e:
            raise ValueError(f"loss flag: {e}") from None


def parse_args(argv=None) -> tuple[str, Config]:
    p = argparse.ArgumentParser(description="RTI: Rollout-Time Intervention for agentic RL (toy Navigation).",
                                usage="python rti.py [train | warmstart] [--flag VALUE ...]  (--help lists them)")
    p.add_argument("command", nargs="?", default="train", choices=("train", "warmstart"))
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


def load_model(path_or_tiny: str, seed: int = 0):
    """`tiny` builds model + tokenizer from scratch; a directory loads any local Hugging Face causal LM (no download)."""
    if path_or_tiny == "tiny":
        import intervene
        tok = build_tiny_tokenizer(envs.Navigation.vocabulary() + intervene.PROMPT_WORDS)
        return build_tiny_model(len(tok), seed), tok
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not Path(path_or_tiny).is_dir():
        raise FileNotFoundError(f"model directory {path_or_tiny!r} not found (nothing is downloaded)")
    tok = AutoTokenizer.from_pretrained(path_or_tiny, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path_or_tiny, local_files_only=True, dtype=torch.float32)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


# ----------------------------------------------------------------------------- chat rendering (token-in, token-out)

class Chat:
    """Token ids of the pieces of a multi-turn chat, rendered through the tokenizer's own chat template.

    A training sequence is: prompt_ids(first message) + [agent ids ... <eos>] + turn_ids(observation) + [agent ...] ...
    The agent's ids are kept exactly as sampled; only prompt and observation text is tokenized.
    """

    def __init__(self, tok):
        self.tok = tok
        self.eos_id = tok.eos_token_id
        eos = tok.eos_token
        mark = "\x00MSG\x00"
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        render = lambda msgs: tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        first = render([{"role": "user", "content": mark}])
        self.prompt_pre, self.prompt_post = first.split(mark)
        rendered_base = tok.apply_chat_template(base, tokenize=False)
        turn = render(base + [{"role": "user", "content": mark}])
        end = rendered_base.rindex(eos) + len(eos)      # the agent's turn ends with its sampled eos
        if not turn.startswith(rendered_base[:end]):
            raise ValueError("chat template does not render turns as a prefix-stable sequence")
        self.turn_pre, self.turn_post = turn[end:].split(mark)

    def ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False).input_ids

    def prompt_ids(self, content: str) -> list[int]:
        return self.ids(self.prompt_pre + content + self.prompt_post)

    def turn_ids(self, content: str) -> list[int]:
        """Ids that follow the agent's eos: the next user message and the assistant header."""
        return self.ids(self.turn_pre + content + self.turn_post)

    def action_text(self, agent_ids: list[int]) -> str:
        return self.tok.decode([i for i in agent_ids if i != self.eos_id], skip_special_tokens=True).strip()


# ----------------------------------------------------------------------------- batched decoding with a kept KV cache

def sample_token(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator):
    """Sample from softmax(logits / T), optionally nucleus-filtered; return ids and log pi(id) at temperature T."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    probs = logp.exp()
    if top_p < 1.0:
        sp, si = probs.sort(dim=-1, descending=True)
        keep = sp.cumsum(-1) - sp < top_p
        probs = torch.zeros_like(probs).scatter(-1, si, sp * keep)
    ids = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    return ids, logp.gather(-1, ids[:, None]).squeeze(-1)


class DecodeSession:
    """N rows decoded in lockstep through one KV cache that is kept across turns.

    Rows grow independently: a call that feeds tokens to some rows pads the others with masked slots (holes), and
    position ids count only real tokens, so each row computes exactly what it would alone (tests check this).
    `retract` masks a row's latest tokens out again, which lets intervene.py replace a sampled turn.
    """

    def __init__(self, model, prefixes: list[list[int]], pad_id: int):
        from transformers import DynamicCache
        self.model, self.pad_id, self.n = model, pad_id, len(prefixes)
        dev = next(model.parameters()).device
        self.cache = DynamicCache(config=model.config)
        self.mask = torch.zeros(self.n, 0, dtype=torch.long, device=dev)
        self.length = torch.zeros(self.n, dtype=torch.long, device=dev)       # real tokens per row
        self.last_logits = torch.zeros(self.n, model.config.vocab_size, device=dev)
        self.real_slots: list[list[int]] = [[] for _ in range(self.n)]       # cache slot of each real token
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
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=pos, cache=self.cache, use_cache=True)
        lens = new_mask.sum(-1)
        has = lens > 0
        self.last_logits[has] = out.logits[has, lens[has] - 1].float()
        self.length += lens

    @torch.no_grad()
    def sample_turn(self, rows: list[int], max_new: int, eos_id: int, temperature: float, top_p: float,
                    gen: torch.Generator) -> tuple[list[list[int]], list[list[float]]]:
        """Sample one agent turn (up to max_new tokens, stopping at eos) for each row in `rows`."""
        ids_out = [[] for _ in rows]
        logp_out = [[] for _ in rows]
        live = list(range(len(rows)))
        self.saved_logits = {r: self.last_logits[r].clone() for r in rows}   # for retract
        for _ in range(max_new):
            if not live:
                break
            logits = self.last_logits[[rows[i] for i in live]]
            tok, lp = sample_token(logits, temperature, top_p, gen)
            for j, i in enumerate(live):
                ids_out[i].append(int(tok[j]))
                logp_out[i].append(float(lp[j]))
            done = [i for i in live if ids_out[i][-1] == eos_id or len(ids_out[i]) == max_new]
            self.feed([rows[i] for i in live], [[ids_out[i][-1]] for i in live])
            live = [i for i in live if i not in done]
        return ids_out, logp_out

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

    def __init__(self, model, tok, temperature=1.0, top_p=1.0, max_turn_tokens=4, seed=0, micro_batch=64):
        self.model, self.tok, self.chat = model, tok, Chat(tok)
        self.temperature, self.top_p, self.max_turn_tokens = temperature, top_p, max_turn_tokens
        self.micro_batch = micro_batch
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.device = next(model.parameters()).device

    def session(self, prefixes: list[list[int]]) -> DecodeSession:
        return DecodeSession(self.model, prefixes, self.tok.pad_token_id)

    def sample_turn(self, session: DecodeSession, rows: list[int], max_new: int | None = None):
        return session.sample_turn(rows, max_new or self.max_turn_tokens, self.chat.eos_id, self.temperature,
                                   self.top_p, self.gen)

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


def pad_right(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, device=device)
        mask[i, :len(s)] = 1
    return ids, mask


def token_logprobs(model, ids: torch.Tensor, mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, T] log-probs of ids[:, t] given ids[:, :t] at the given temperature; column 0 is 0."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float() / temperature
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

    def truncated(self, k: int) -> "Trajectory":
        """A copy of the episode before agent turn k (ends with the user message that turn k answered)."""
        end = self.turns[k][0] if k < len(self.turns) else len(self.ids)
        return Trajectory(task=self.task, group=self.group, ids=self.ids[:end], loss_mask=self.loss_mask[:end],
                          source=self.source[:end], sample_logp=self.sample_logp[:end], actions=self.actions[:k],
                          turns=self.turns[:k], observations=self.observations[:k + 1])

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
        chunk = chat.turn_ids(obs)
        self.add(chunk, 0, POLICY, None)
        return ([chat.eos_id] if agent_ids[-1:] != [chat.eos_id] else []) + chunk


def start_episodes(policy: Policy, tasks: list, group_size: int):
    """B tasks x G fresh environments and trajectories that hold the prompt."""
    envs_, trajs = [], []
    for g, task in enumerate(tasks):
        for _ in range(group_size):
            env = envs.Navigation(task)
            first = env.reset()
            t = Trajectory(task=task, group=g, observations=[first])
            t.add(policy.chat.prompt_ids(first), 0, POLICY, None)
            envs_.append(env)
            trajs.append(t)
    return envs_, trajs


def rollout(policy: Policy, tasks: list, group_size: int) -> list[Trajectory]:
    """Sample B x G multi-turn episodes in lockstep: one batched decoding pass per turn for all live episodes.

    The KV cache is kept across turns, so each turn feeds only the new observation tokens.
    """
    policy.model.eval()
    env_list, trajs = start_episodes(policy, tasks, group_size)
    session = policy.session([t.ids for t in trajs])
    live = list(range(len(trajs)))
    while live:
        ids, logps = policy.sample_turn(session, live)
        chunks = [trajs[r].step(policy.chat, env_list[r], a_ids, a_lp) for r, a_ids, a_lp in zip(live, ids, logps)]
        live, chunks = [r for r, c in zip(live, chunks) if c is not None], [c for c in chunks if c is not None]
        session.feed(live, chunks)
    return trajs


def evaluate_policy(policy: Policy, tasks: list, n: int, seed: int = 1234, chunk: int = 256,
                    per_task: bool = False):
    """pass@k / pass^k of the policy on `tasks` with n samples each (evaluate.summarize), without touching the
    training RNG stream. per_task=True also returns the successes, one list of n booleans per task."""
    train_gen = policy.gen
    policy.gen = torch.Generator(device="cpu").manual_seed(seed)
    successes = []
    per_chunk = max(1, chunk // n)
    try:
        for i in range(0, len(tasks), per_chunk):
            trajs = rollout(policy, tasks[i:i + per_chunk], n)
            for g in range(len(tasks[i:i + per_chunk])):
                successes.append([t.reward > 0 for t in trajs[g * n:(g + 1) * n]])
    finally:
        policy.gen = train_gen
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
        agent = chat.ids(action) + [chat.eos_id]
        ids += agent
        weights += [1.0] * len(agent)
        content, done = env.step(action)
        if done:
            break
    weights[0] = 0.0
    return ids, weights


def warmstart_loss(model, batch_ids, batch_w, pad_id) -> torch.Tensor:
    """Weighted next-token cross-entropy: sum_t w_t * CE_t / sum_t w_t."""
    ids, mask = pad_right(batch_ids, pad_id, next(model.parameters()).device)
    w = torch.zeros(ids.shape)
    for i, ws in enumerate(batch_w):
        w[i, :len(ws)] = torch.tensor(ws)
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


def collate(trajs: list[Trajectory], old_logp: list[list[float]], pad_id: int, device) -> dict:
    """Right-padded [N, T] tensors of one batch of trajectories (attention mask by position, never by pad id)."""
    ids, attn = pad_right([t.ids for t in trajs], pad_id, device)

    def tensor(rows, dtype=torch.float32):
        out = torch.zeros(ids.shape, dtype=dtype, device=device)
        for i, v in enumerate(rows):
            out[i, :len(v)] = torch.tensor(v, dtype=dtype)
        return out
    return {"ids": ids, "attn": attn, "loss_mask": tensor([t.loss_mask for t in trajs]),
            "source": tensor([t.source for t in trajs], torch.long),
            "behavior_logp": tensor([t.sample_logp for t in trajs]), "old_logp": tensor(old_logp)}


def update(policy: Policy, opt, trajs: list[Trajectory], advantages: torch.Tensor, cfg: Config) -> dict:
    """Old log-probs by one scoring pass, then `updates_per_batch` AdamW steps on loss.policy_loss."""
    model, lcfg = policy.model, cfg.loss_config()
    old = policy.score([t.ids for t in trajs])
    model.train()
    metrics = []
    n_tok = sum(sum(t.loss_mask) for t in trajs)
    for _ in range(cfg.updates_per_batch):
        opt.zero_grad(set_to_none=True)
        for i in range(0, len(trajs), cfg.micro_batch):
            mb = collate(trajs[i:i + cfg.micro_batch], old[i:i + cfg.micro_batch], policy.tok.pad_token_id,
                         policy.device)
            logp = token_logprobs(model, mb["ids"], mb["attn"], policy.temperature)
            loss, m = rl_loss.policy_loss(logp, mb["old_logp"], advantages[i:i + cfg.micro_batch], mb["loss_mask"],
                                          source=mb["source"], behavior_logp=mb["behavior_logp"], config=lcfg)
            # micro-batches add up to the full-batch loss: weight by their share of tokens (token-mean) or rows
            share = (mb["loss_mask"].sum().item() / max(1, n_tok) if cfg.agg == "token-mean"
                     else len(mb["ids"]) / len(trajs))
            (loss * share).backward()
            metrics.append({"loss": loss.item(), **m})
        m_grad = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
    out = {k: float(np.mean([m[k] for m in metrics])) for k in metrics[0]}
    out["grad_norm"] = float(m_grad)
    return out


def train_step(policy: Policy, opt, tasks: list, cfg: Config) -> dict:
    """Sample -> (RTI) -> rewards -> group advantages -> update. Returns the step's metrics."""
    import intervene
    t0 = time.time()
    trajs = rollout(policy, tasks, cfg.group_size)
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
    if keep:
        metrics.update(update(policy, opt, [trajs[i] for i in keep], adv[keep], cfg))
    metrics.update({"time/rollout": t1 - t0, "time/intervene": t2 - t1, "time/update": time.time() - t2,
                    "trained_rows": len(keep)})
    return metrics


def init_policy(cfg: Config, log=print) -> Policy:
    """The model to train: the tiny model from the warm-start checkpoint (built first if missing), or --model PATH."""
    if cfg.model == "tiny" and cfg.init:
        if not (Path(cfg.init) / "config.json").exists():
            if cfg.init != cfg.ws_out:
                raise FileNotFoundError(f"--init {cfg.init!r} holds no checkpoint")
            log(f"no warm-start checkpoint in {cfg.init}: building it first (python rti.py warmstart; "
                f"{cfg.ws_steps} steps, a few minutes on 2 CPU cores)")
            warmstart(cfg, log)
        model, tok = load_model(cfg.init)
    else:
        model, tok = load_model(cfg.model, cfg.seed)
    return Policy(model, tok, cfg.temperature, cfg.top_p, cfg.max_turn_tokens, cfg.seed, cfg.micro_batch)


def save_checkpoint(path: Path, policy: Policy, opt, step: int, task_rng: random.Random, cfg: Config) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": policy.model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                "task_rng": task_rng.getstate(), "sample_rng": policy.gen.get_state(),
                "torch_rng": torch.get_rng_state(), "config": dataclasses.asdict(cfg)}, tmp)
    os.replace(tmp, path)


def train(cfg: Config, log=print) -> dict:
    """The training loop; returns {"before": ..., "after": ...} test metrics (evaluate.summarize)."""
    torch.set_num_threads(cfg.threads)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    policy = init_policy(cfg, log)
    opt = torch.optim.AdamW(policy.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    train_tasks = envs.make_tasks(cfg.train_split)
    test_tasks = envs.make_tasks(cfg.test_split)[:cfg.eval_tasks]
    task_rng = random.Random(cfg.seed)
    step, ckpt = 0, out / "ckpt.pt"
    results = {}
    if cfg.resume:
        if not ckpt.exists():
            raise FileNotFoundError(f"--resume: no checkpoint at {ckpt}")
        state = torch.load(ckpt, weights_only=False)
        policy.model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        task_rng.setstate(state["task_rng"])
        policy.gen.set_state(state["sample_rng"])
        torch.set_rng_state(state["torch_rng"])
        log(f"resumed from {ckpt} at step {step}")
    elif cfg.eval_tasks:
        results["before"], results["before_tasks"] = evaluate_policy(policy, test_tasks, cfg.eval_samples,
                                                                     seed=cfg.seed + 10_000, per_task=True)
        log(f"before training: test p@1 {results['before']['p@1']:.2f}")
    log_file = (out / "metrics.jsonl").open("a" if cfg.resume else "w")
    if "before" in results:
        log_file.write(json.dumps({"step": 0, **{f"test/{k}": v for k, v in results["before"].items()}}) + "\n")
    bar = progress(range(step, cfg.steps), cfg.progress, f"{cfg.method} training")
    rti_steps = []
    for step in bar:
        tasks = task_rng.sample(train_tasks, cfg.batch_tasks)
        t0 = time.time()
        m = train_step(policy, opt, tasks, cfg)
        m.update({"step": step + 1, "time/step": time.time() - t0})
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and cfg.eval_tasks and step + 1 < cfg.steps:
            m.update({f"test/{k}": v for k, v in
                      evaluate_policy(policy, test_tasks, cfg.eval_samples, seed=cfg.seed + 10_000).items()})
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
        results["after"], results["after_tasks"] = evaluate_policy(policy, test_tasks, cfg.eval_samples,
                                                                   seed=cfg.seed + 10_000, per_task=True)
        log_file.write(json.dumps({"step": cfg.steps, **{f"test/{k}": v for k, v in results["after"].items()}}) + "\n")
        (out / "results.json").write_text(json.dumps({"config": dataclasses.asdict(cfg), **results}))
    log_file.close()
    policy.model.save_pretrained(out / "model")
    policy.tok.save_pretrained(out / "model")
    results["policy"] = policy
    return results


def main(argv=None) -> None:
    command, cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    if command == "warmstart":
        warmstart(cfg)
        return
    t0 = time.time()
    res = train(cfg)
    rows = {k: res[k] for k in ("before", "after") if k in res}
    if rows:
        print(f"\n{cfg.method} on the {cfg.test_split} split ({cfg.eval_tasks} tasks x {cfg.eval_samples} samples):")
        print(evaluate.format_table({("warm start" if k == "before" else f"after {cfg.steps} steps"): v
                                     for k, v in rows.items()}))
    if "interventions" in res:
        import intervene
        print(f"\ninterventions over the run:\n{intervene.report(res['interventions'])}")
    print(f"wall time {time.time() - t0:.0f} s; metrics in {cfg.out}/metrics.jsonl, model in {cfg.out}/model")


if __name__ == "__main__":
    main()
