"""The policy: the model and its tokenizer, the chat rendering, and the sampler the trainer and
intervene.py use (batched turns through KV-cached decoding, token log-probs).

    model, tok = load_model("tiny")          # or a local Hugging Face directory
    policy = Sampler(model, tok)             # intervene.Policy: chat, generate, score
    ids, logps = policy.generate([policy.chat.prompt_ids("visit A 2 2 then finish ...")])

Read in this order: `load_model` (what the policy is), `Chat` (a multi-turn episode as token ids),
`Sampler` (what the trainer calls), `token_logprobs` (scoring, the plain form and the chunked one
for large vocabularies), then the decoding engine behind `Sampler.generate`: `sample_token` and
`DecodeSession`, N rows decoded in lockstep through one KV cache kept across an episode's turns.
Nothing here knows RL: rti.py trains the policy, intervene.py asks it to correct itself.
"""

from __future__ import annotations

import warnings
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.utils.checkpoint import checkpoint
from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    DynamicLayer,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

import envs
import intervene

# ----------------------------------------------------------------------------- model and tokenizer

SPECIAL = ["<pad>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>", "<|im_end|>"]
# compact: a turn costs 2 marker tokens plus the agent's eos (14 tokens a Navigation turn)
TINY_TEMPLATE = (
    "{% for m in messages %}{% if not loop.first %} {% endif %}"
    "<|{{ m['role'] }}|> {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %} <|im_end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %} <|assistant|>{% endif %}"
)


def load_model(
    path_or_tiny: str, seed: int = 0, dtype: torch.dtype = torch.float32, env: str = "navigation"
):
    """(model, tokenizer). `tiny` builds both from scratch: a word-level tokenizer over the words
    of `env` and of intervene's prompts, with a chat template, and build_tiny_model. A directory
    loads any local Hugging Face causal LM (nothing is downloaded). A model on transformers' SDPA
    attention gets sdpa_shared_kv: the same values, faster in decoding sessions on the CPU."""
    if path_or_tiny == "tiny":
        tok = build_tiny_tokenizer(env)
        model = build_tiny_model(len(tok), seed).to(dtype)
    elif not Path(path_or_tiny).is_dir():
        raise FileNotFoundError(
            f"model directory {path_or_tiny!r} not found (nothing is downloaded)"
        )
    else:
        tok = AutoTokenizer.from_pretrained(path_or_tiny, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            path_or_tiny, local_files_only=True, dtype=dtype
        )
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
    if model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(SDPA_SHARED_KV)
    return model, tok


def build_tiny_tokenizer(env: str = "navigation") -> PreTrainedTokenizerFast:
    """A word-level tokenizer: one id per word of SPECIAL, the env's vocabulary and intervene's
    prompt words, in that order (the committed checkpoints depend on it)."""
    vocab = {}
    for word in SPECIAL + envs.env_class(env).vocabulary() + intervene.PROMPT_WORDS:
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        chat_template=TINY_TEMPLATE,
    )


def build_tiny_model(vocab_size: int, seed: int = 0) -> Qwen3ForCausalLM:
    """A 0.8M-parameter Qwen3: hidden 128, 4 layers, 4 heads, 2 KV heads, head_dim 32, 2,048
    positions, tied embeddings; weights drawn from `seed`."""
    torch.manual_seed(seed)
    config = Qwen3Config(
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
    return Qwen3ForCausalLM(config)


# ----------------------------------------------------------------------------- chat rendering


class Chat:
    """Token ids of the pieces of a multi-turn chat, rendered through the tokenizer's own chat
    template (token-in, token-out).

    A training sequence is prompt_ids(first message) + [agent ids ... eos] +
    turn_ids(observation) + [agent ...] ... The agent's ids are kept exactly as sampled; only
    prompt and observation text is tokenized. Here an observation is a user message and an action
    is the turn's text (the tiny model); extras/chat_tools.py's ToolChat renders templates that
    take tools (Qwen3): actions as tool calls, observations as tool messages."""

    MARK = "\x00MSG\x00"
    REPLY = "\x00REPLY\x00"

    def __init__(self, tok, env: str = "navigation"):
        self.tok = tok
        self.env_cls = envs.env_class(env)
        self.eos_id = tok.eos_token_id
        first_message = self.render([{"role": "user", "content": self.MARK}])
        self.prompt_pre, self.prompt_post = first_message.split(self.MARK)
        self.turn_pre, self.turn_post = self.after_turn("user")

    def render(self, messages: list[dict]) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def after_turn(self, role: str) -> list[str]:
        """The template's text after an agent turn's eos, around the next `role` message.

        Past turns are never re-rendered, so a template that renders history differently (Qwen3
        drops past turns' empty think blocks) still gives the tokens the model saw."""
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
        """Ids after the agent's eos: the next observation (`role`: the env's observation_role),
        then the assistant header."""
        return self.ids(self.turn_pre + content + self.turn_post)

    def text(self, agent_ids: list[int]) -> str:
        """An agent turn as text, without its eos and special tokens."""
        ids = [i for i in agent_ids if i != self.eos_id]
        return self.tok.decode(ids, skip_special_tokens=True).strip()

    def action_text(self, agent_ids: list[int]) -> str:
        """The env action a turn performs (its text here; ToolChat parses its tool call)."""
        return self.text(agent_ids)

    def action_ids(self, action: str) -> list[int]:
        """Ids of a turn (without eos) that performs `action`."""
        return self.ids(action)


# ----------------------------------------------------------------------------- the sampler


class Sampler:
    """The policy as the trainer and intervene.py use it (intervene.Policy): the network `model`,
    its `chat` pieces, one agent turn per token context (`generate`) and log-prob scoring
    (`score`). The KV cache is an optimisation behind `generate`: an episode's stream
    (intervene.Stream) keeps its decoding session between turns, so each turn feeds only the
    tokens that are new to it."""

    def __init__(
        self,
        model,
        tok,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_turn_tokens: int = 4,
        seed: int = 0,
        micro_batch: int = 8,
        env: str = "navigation",
        user=None,
        chat: Chat | None = None,
    ):
        self.model = model
        self.tok = tok
        self.chat = chat or Chat(tok, env)
        self.user = user  # plays the user in envs that have one (Env.make_user)
        self.temperature = temperature
        self.top_p = top_p
        self.max_turn_tokens = max_turn_tokens
        self.micro_batch = micro_batch
        self.device = next(model.parameters()).device
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self.generated_tokens = 0  # every token this policy sampled, in any role: a compute figure

    def make_env(self, task) -> envs.Env:
        """A fresh environment for `task` (with its user, if the env has one)."""
        return self.chat.env_cls.make(task, self.user)

    def generate(
        self,
        contexts: list[list[int]],
        max_new: int | None = None,
        streams: list[intervene.Stream] | None = None,
    ) -> tuple[list[list[int]], list[list[float]]]:
        """One agent turn (token ids, log-probs at the sampling temperature) after each context.

        With `streams` (an episode's turns, intervene.play), context i continues stream i: its
        decoding session, kept in the stream, feeds only what is new since its last turn (or
        takes that turn back first, when the context replaced it), and its sampling goes on from
        the stream's seed. Without, each context is a one-off (the roles' prompts), sampled on
        streams drawn from self.gen."""
        if not contexts:
            return [], []
        if streams is None:
            session = self.session(contexts)
        else:
            session = self.stream_session(contexts, streams)
        return self.sample_turn(session, list(range(len(contexts))), max_new)

    def stream_session(self, contexts: list[list[int]], streams: list) -> DecodeSession:
        """The decoding session of `streams`, holding `contexts` in rows 0..n-1: the one the streams
        share, brought up to date (DecodeSession.follow), or a new one over the contexts."""
        session = streams[0].state
        if session is None or any(s.state is not session for s in streams):
            seeds = [s.seed for s in streams]
            session = self.session(contexts, None if None in seeds else seeds)
            session.keys = [id(s) for s in streams]
            for s in streams:
                s.state = session
            return session
        row_of = {key: row for row, key in enumerate(session.keys)}
        rows = [row_of[id(s)] for s in streams]
        session.follow(rows, contexts)
        session.keys = [session.keys[r] for r in rows]
        return session

    def session(self, prefixes: list[list[int]], seeds: list[int] | None = None) -> DecodeSession:
        """A decoding session; row i samples from stream `seeds[i]` (default: drawn from self.gen)."""
        if seeds is None:
            seeds = torch.randint(
                2**62, (len(prefixes),), generator=self.gen, device=self.gen.device
            ).tolist()
        return DecodeSession(self.model, prefixes, self.tok.pad_token_id, seeds)

    def sample_turn(self, session: DecodeSession, rows: list[int], max_new: int | None = None):
        """One agent turn for each row of `session` in `rows`: (token ids, log-probs)."""
        ids, logps = session.sample_turn(
            rows, max_new or self.max_turn_tokens, self.chat.eos_id, self.temperature, self.top_p
        )
        self.generated_tokens += sum(map(len, ids))
        return ids, logps

    @torch.no_grad()
    def score(self, seqs: list[list[int]]) -> list[list[float]]:
        """log pi(y_t | y_<t) at the sampling temperature of every token (0.0 for the first)."""
        out = []
        for i in range(0, len(seqs), self.micro_batch):
            batch = seqs[i : i + self.micro_batch]
            logp = token_logprobs(
                self.model, batch, self.tok.pad_token_id, self.temperature, self.device
            )
            out += [logp[j, : len(s)].tolist() for j, s in enumerate(batch)]
        return out


# ----------------------------------------------------------------------------- token log-probs


def pad_rows(rows: list[list], fill, dtype, device) -> torch.Tensor:
    """[N, T] tensor of right-padded rows, T = the longest row."""
    width = max(map(len, rows), default=0)
    padded = [list(r) + [fill] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=dtype, device=device).reshape(len(rows), width)


def token_logprobs(
    model, seqs: list[list[int]], pad_id: int, temperature: float, device, chunk=None
) -> torch.Tensor:
    """[B, T] log-probs of each token given the ones before it, at the sampling temperature T, of
    the right-padded sequences (column 0 and padded positions are 0):

        log pi(y_t | y_<t) = z_t[y_t] / T - logsumexp(z_t / T),   z_t = the logits after y_<t

    The plain form: the model's logits of every position, B x T x V x 8 bytes (12 with backward:
    111 GiB for 8 rows of 8k tokens at Qwen3's 151,936-token vocabulary). A batch whose logits
    exceed `chunk` (default LOGPROB_CHUNK) is scored by chunked_token_logprobs instead, the same
    values in a few chunks of memory.

    No attention mask: under causal attention a real token never sees the pads after it, so the
    pads (whatever their id) change nothing, and SDPA can run its faster causal kernel."""
    ids = pad_rows(seqs, pad_id, torch.long, device)
    lengths = torch.tensor([len(s) for s in seqs], device=device)
    # needed[b, t]: token t + 1 of row b is real, so its log-prob given tokens 0..t is wanted
    needed = torch.arange(1, ids.shape[1], device=device) < lengths[:, None]
    if ids.numel() * model.config.vocab_size > (chunk or LOGPROB_CHUNK):
        return chunked_token_logprobs(model, ids, needed, temperature, chunk or LOGPROB_CHUNK)
    logits = model(input_ids=ids, use_cache=False).logits
    return logprobs_from_logits(logits, ids, needed, temperature)


def logprobs_from_logits(logits, ids: torch.Tensor, needed: torch.Tensor, temperature: float):
    """token_logprobs from the logits of every position [B, T, V] of the padded `ids`; `needed`
    [B, T - 1] marks the positions to score."""
    logits = logits[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return F.pad(torch.where(needed, logp, 0.0), (1, 0))


# logits per chunk of chunked_token_logprobs (positions x vocabulary): 32 MB in fp32, 55 positions
# of Qwen3's 151,936-token vocabulary, every position of the tiny model's batches
LOGPROB_CHUNK = 2**23


def chunked_token_logprobs(
    model, ids: torch.Tensor, needed: torch.Tensor, temperature: float, chunk=LOGPROB_CHUNK
) -> torch.Tensor:
    """token_logprobs of the padded `ids` with no full-vocabulary tensor of the batch: a hook takes
    the output head's input (the final hidden states) and leaves the head the last position only;
    chunked_logprobs then applies the head to the real positions `chunk` logits at a time.
    Memory: a few chunks (x 4 bytes).

    The model's own logits of the last position must equal the head's: a model that changes its
    logits after the head (Gemma's soft-capping, a logit scale) fails this check and is scored
    from its full logits instead (the plain form, with a warning; `model._rti_full_logits`)."""
    head = model.get_output_embeddings()
    if head is None or getattr(model, "_rti_full_logits", False):
        logits = model(input_ids=ids, use_cache=False).logits
        return logprobs_from_logits(logits, ids, needed, temperature)
    inputs = []
    hook = head.register_forward_pre_hook(partial(keep_head_input, inputs))
    try:
        out = model(input_ids=ids, use_cache=False)
    finally:
        hook.remove()
    if not head_gives_logits(head, inputs, out.logits, ids.shape):
        warnings.warn(
            f"{type(model).__name__} changes its logits after the output head: its log-probs "
            "come from its full logits (B x T x V in memory)",
            stacklevel=2,
        )
        model._rti_full_logits = True
        logits = model(input_ids=ids, use_cache=False).logits
        return logprobs_from_logits(logits, ids, needed, temperature)
    hidden = inputs[0][:, :-1][needed]
    values = chunked_logprobs(head, hidden, ids[:, 1:][needed], temperature, chunk)
    logp = torch.zeros(needed.shape, dtype=values.dtype, device=ids.device)
    return F.pad(logp.masked_scatter(needed, values), (1, 0))


def keep_head_input(inputs: list, head, args: tuple) -> tuple:
    """Forward pre-hook of the output head: keep its input [B, T, H] in `inputs`, and pass the
    head the last position only (its logits are token_logprobs' check)."""
    inputs.append(args[0])
    return (args[0][:, -1:],) + args[1:]


@torch.no_grad()
def head_gives_logits(head, inputs: list, logits: torch.Tensor, shape) -> bool:
    """Whether the head's input was caught once, at every position of the batch, and the model's
    logits of the last position are the head's output, bit for bit."""
    if len(inputs) != 1 or inputs[0].shape[:2] != shape or logits.shape[1] != 1:
        return False
    return torch.equal(logits.float(), head(inputs[0][:, -1:]).float())


def chunked_logprobs(
    head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, chunk=LOGPROB_CHUNK
) -> torch.Tensor:
    """[N] log-probs of targets [N] after hidden states [N, H], at temperature T, a slice of
    max(1, chunk // V) rows at a time (V: the vocabulary, the head's output size):

        log pi(y | h) = z_y / T - logsumexp(z / T),   z = head(h)

    With gradients on, each slice runs under activation checkpointing, so backward too holds one
    slice's logits at a time (it computes them again: one more head forward)."""
    rows = max(1, chunk // head.weight.shape[0])
    grad = torch.is_grad_enabled() and hidden.requires_grad
    out = []
    # one slice at least: with no position to score the result still depends on the model (an
    # empty micro-batch's backward must reach every layer, for FSDP's collectives)
    for start in range(0, max(1, hidden.shape[0]), rows):
        part = (head, hidden[start : start + rows], targets[start : start + rows], temperature)
        if grad:
            out.append(checkpoint(slice_logprobs, *part, use_reentrant=False))
        else:
            out.append(slice_logprobs(*part))
    return torch.cat(out)


def slice_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    """One slice of chunked_logprobs: log_softmax of the fp32 logits over the vocabulary, at the
    targets (a temperature of 1 divides nothing: the same values, one copy fewer)."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)


# ----------------------------------------------------------------------------- sampling and KV-cached decoding


def sample_token(
    logits: torch.Tensor, temperature: float, top_p: float, gens: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample row i from softmax(logits_i / T), optionally nucleus-filtered, with its own
    generator gens[i]; return the ids and log pi(id) at temperature T.

    Gumbel-max: id = argmax_v log p_v + g_v, g_v = -log(-log u_v), u_v uniform. One generator per
    row makes a row's sample independent of which other rows share the batch."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    kept = logp
    if top_p < 1.0:
        probs, order = logp.exp().sort(dim=-1, descending=True)
        outside = probs.cumsum(-1) - probs >= top_p  # mass before the token already reaches top_p
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, outside)
        kept = logp.masked_fill(drop, float("-inf"))
    uniform = torch.stack(
        [torch.rand(logp.shape[-1], generator=g, device=g.device) for g in gens]
    ).to(logp.device)
    gumbel = -torch.log(-torch.log(uniform.clamp(1e-20, 1 - 1e-7)))
    ids = (kept + gumbel).argmax(-1)
    return ids, logp.gather(-1, ids[:, None]).squeeze(-1)


def sdpa_shared_kv(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, except on the CPU for several query tokens under a mask (a
    decoding session's fed chunks): there grouped-query attention reads each KV head where it is
    (SDPA's enable_gqa) instead of copying it once per query head first (transformers' repeat_kv,
    which copies the whole cache at every layer). The same values bit for bit (tests check)."""
    plain = (
        query.device.type != "cpu"
        or getattr(module, "num_key_value_groups", 1) == 1
        or query.shape[2] == 1  # one query token: transformers packs the heads already
        or attention_mask is None  # transformers uses enable_gqa already
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
    )
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=kwargs.get("dropout", 0.0),
        scale=kwargs.get("scaling"),
        enable_gqa=True,
    )
    return out.transpose(1, 2).contiguous(), None


SDPA_SHARED_KV = "sdpa_shared_kv"
AttentionInterface.register(SDPA_SHARED_KV, sdpa_shared_kv)
AttentionMaskInterface.register(SDPA_SHARED_KV, sdpa_mask)  # SDPA's masks, as for "sdpa"


class KVBuffer(DynamicLayer):
    """One layer's KV cache in a preallocated buffer that doubles when full: a fed token is
    written in place, where transformers' DynamicLayer copies the whole cache (torch.cat) at
    every forward. `keys` and `values` are views of the filled part, as DynamicLayer's."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.set(key_states[:, :, :0], value_states[:, :, :0])
        end = self.keys.shape[-2] + key_states.shape[-2]
        if end > self.key_buffer.shape[-2]:
            self.set(self.keys, self.values, capacity=2 * end)
        start = self.keys.shape[-2]
        self.key_buffer[:, :, start:end] = key_states
        self.value_buffer[:, :, start:end] = value_states
        self.keys = self.key_buffer[:, :, :end]
        self.values = self.value_buffer[:, :, :end]
        return self.keys, self.values

    def set(self, keys, values, capacity: int = 0) -> None:
        """Hold `keys` and `values` ([rows, heads, slots, head_dim]) in a new buffer with room for
        `capacity` slots (at least twice theirs)."""
        rows, heads, slots, head_dim = keys.shape
        capacity = self.room(slots, capacity)
        self.key_buffer = keys.new_empty(rows, heads, capacity, head_dim)
        self.value_buffer = values.new_empty(rows, heads, capacity, head_dim)
        self.key_buffer[:, :, :slots] = keys
        self.value_buffer[:, :, :slots] = values
        self.keys = self.key_buffer[:, :, :slots]
        self.values = self.value_buffer[:, :, :slots]

    @staticmethod
    def room(slots: int, capacity: int = 0) -> int:
        """The slots of a new buffer that is to hold `slots`: `capacity`, and at least twice
        `slots` and 64 (so appends rarely copy)."""
        return max(capacity, 2 * slots, 64)

    def pack(self, rows: torch.Tensor, columns: torch.Tensor) -> None:
        """Keep rows `rows` of the cache, renumbered, row i holding its slots columns[i] in its
        first columns: one gather from the old buffer into the new one."""
        _, heads, capacity, head_dim = self.key_buffer.shape
        n, slots = columns.shape
        # the (row, head, slot) cells to keep, in the old buffer seen as [cells, head_dim]
        head = torch.arange(heads, device=rows.device)
        cells = (
            (rows[:, None, None] * heads + head[:, None]) * capacity + columns[:, None, :]
        ).flatten()

        def packed(buffer: torch.Tensor) -> torch.Tensor:
            out = buffer.new_empty(n, heads, self.room(slots), head_dim)
            out[:, :, :slots] = buffer.view(-1, head_dim)[cells].view(n, heads, slots, head_dim)
            return out

        self.key_buffer = packed(self.key_buffer)
        self.value_buffer = packed(self.value_buffer)
        self.keys = self.key_buffer[:, :, :slots]
        self.values = self.value_buffer[:, :, :slots]


class DecodeSession:
    """N rows decoded in lockstep through one KV cache that is kept across turns.

    Rows grow independently: a call that feeds tokens to some rows pads the others with masked
    slots (holes), and position ids count only real tokens, so each row computes exactly what it
    would alone (tests check this), but for a sliding-window layer, whose window counts holes too.
    The last token of a sampled turn is not fed at once: it waits (`pending`) and goes in with
    the next chunk, which saves one forward pass a turn. `keep` drops finished rows and packs out
    holes; `retract` takes a row's latest turn back (to replace it); `follow` does both and feeds
    what is new, for an episode's next turn (Sampler.generate)."""

    def __init__(
        self, model, prefixes: list[list[int]], pad_id: int, seeds: list[int] | None = None
    ):
        self.model = model
        self.pad_id = pad_id
        self.n = len(prefixes)
        device = next(model.parameters()).device
        if seeds is None:
            seeds = range(self.n)
        # one sampling stream per row
        self.gens = [torch.Generator(device=device).manual_seed(int(s) % 2**63) for s in seeds]
        self.cache = DynamicCache(config=model.config)
        if not any(self.cache.is_sliding):
            self.cache.layers = [KVBuffer() for _ in self.cache.layers]
        self.mask = torch.zeros(self.n, 0, dtype=torch.long, device=device)
        # real tokens per row
        self.length = torch.zeros(self.n, dtype=torch.long, device=device)
        self.last_logits = torch.zeros(self.n, model.config.vocab_size, device=device)
        # the cache slot of each real token, per row
        self.real_slots: list[list[int]] = [[] for _ in range(self.n)]
        # the last token of each row's latest turn, until the next feed takes it in
        self.pending: list[list[int]] = [[] for _ in range(self.n)]
        # next-token logits before the latest turn, per row (for retract)
        self.saved_logits: dict[int, torch.Tensor] = {}
        # every token of each row, fed or pending, and where its latest turn starts in it
        self.tokens: list[list[int]] = [[] for _ in range(self.n)]
        self.turn_start = [0] * self.n
        self.feed(list(range(self.n)), prefixes)

    @torch.no_grad()
    def feed(self, rows: list[int], chunks: list[list[int]]) -> None:
        """Append chunks[i] (after the row's pending token, if any) to row rows[i] in one forward
        pass; those rows' next-token logits are updated."""
        device = self.mask.device
        start = self.mask.shape[1]
        chunk_of = [[] for _ in range(self.n)]  # what each row is fed
        for r, chunk in zip(rows, chunks):
            chunk_of[r] = self.pending[r] + list(chunk)
            self.tokens[r] += list(chunk)
            self.pending[r] = []
            self.real_slots[r].extend(range(start, start + len(chunk_of[r])))
        if not any(chunk_of):
            return
        # each chunk left-aligned, trailing pads are holes
        ids = pad_rows(chunk_of, self.pad_id, torch.long, device)
        lengths = torch.tensor([len(c) for c in chunk_of], device=device)
        new_mask = (torch.arange(ids.shape[1], device=device) < lengths[:, None]).long()
        positions = self.length[:, None] + (new_mask.cumsum(-1) - 1).clamp(min=0)
        self.mask = torch.cat([self.mask, new_mask], 1)
        fed = lengths > 0
        last = lengths[fed] - 1
        # only the columns whose logits are used: all of them is GBs at a 150k vocabulary
        columns = torch.unique(last)
        # the first chunks fill an empty cache left-aligned: under causal attention no real token
        # sees the pads after it, so no mask is needed, and SDPA runs its causal kernel
        out = self.model(
            input_ids=ids,
            attention_mask=self.mask if start else None,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=columns,
        )
        self.last_logits[fed] = out.logits[fed, torch.searchsorted(columns, last)].float()
        self.length += lengths

    @torch.no_grad()
    def sample_turn(
        self, rows: list[int], max_new: int, eos_id: int, temperature: float, top_p: float
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Sample one agent turn (up to max_new tokens, stopping at eos) for each row in `rows`;
        each turn's last token is left pending."""
        waiting = [r for r in rows if self.pending[r]]
        self.feed(waiting, [[] for _ in waiting])  # a pending token must be in before sampling
        ids_out = [[] for _ in rows]
        logp_out = [[] for _ in rows]
        live = list(range(len(rows)))
        self.saved_logits = {r: self.last_logits[r].clone() for r in rows}  # for retract
        for r in rows:
            self.turn_start[r] = len(self.tokens[r])
        while live:
            live_rows = [rows[i] for i in live]
            tokens, logps = sample_token(
                self.last_logits[live_rows], temperature, top_p, [self.gens[r] for r in live_rows]
            )
            for i, token, logp in zip(live, tokens.tolist(), logps.tolist()):
                ids_out[i].append(token)
                logp_out[i].append(logp)
            going = [i for i in live if ids_out[i][-1] != eos_id and len(ids_out[i]) < max_new]
            for i in set(live) - set(going):
                self.pending[rows[i]] = [ids_out[i][-1]]
                self.tokens[rows[i]].append(ids_out[i][-1])
            self.feed([rows[i] for i in going], [[ids_out[i][-1]] for i in going])
            live = going
        return ids_out, logp_out

    @torch.no_grad()
    def keep(self, rows: list[int]) -> None:
        """Keep only `rows`, renumbered: row rows[i] becomes row i, its real tokens packed to the
        left of the cache (their keys carry their positions already), so finished episodes and
        holes stop costing compute and memory."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        real = [self.real_slots[r] for r in rows]
        if any(self.cache.is_sliding):
            # a sliding-window layer keeps its last columns only: drop rows, keep the holes
            self.mask = self.mask[idx]
            for layer in self.cache.layers:
                layer.keys = layer.keys[idx]
                layer.values = layer.values[idx]
        else:
            # columns[i, j]: the cache slot of row i's j-th real token, -1 past its end
            columns = pad_rows(real, -1, torch.long, idx.device)
            self.mask = (columns >= 0).long()
            columns = columns.clamp(min=0)
            real = [list(range(len(slots))) for slots in real]
            for layer in self.cache.layers:
                layer.pack(idx, columns)
        self.real_slots = real
        self.tokens = [self.tokens[r] for r in rows]
        self.turn_start = [self.turn_start[r] for r in rows]
        self.length = self.length[idx]
        self.last_logits = self.last_logits[idx]
        self.gens = [self.gens[r] for r in rows]
        self.pending = [self.pending[r] for r in rows]
        self.n = len(rows)
        self.saved_logits = {
            i: self.saved_logits[r] for i, r in enumerate(rows) if r in self.saved_logits
        }

    @torch.no_grad()
    def retract(self, row: int, n_tokens: int) -> None:
        """Take back the row's latest turn of n_tokens: its pending last token is dropped and the
        others are masked out (they become holes); its next-token logits return to what they were
        before the turn."""
        n_fed = n_tokens - len(self.pending[row])
        self.pending[row] = []
        del self.tokens[row][len(self.tokens[row]) - n_tokens :]
        kept = len(self.real_slots[row]) - n_fed
        slots = self.real_slots[row][kept:]
        del self.real_slots[row][kept:]
        self.mask[row, slots] = 0
        self.length[row] -= n_fed
        self.last_logits[row] = self.saved_logits[row]

    def follow(self, rows: list[int], contexts: list[list[int]]) -> None:
        """Make rows[i] hold contexts[i], as row i: a context extends what its row holds, or
        replaces the row's latest turn (which is taken back first: retract); then the rows not
        named leave (keep) and what is new goes in, in one forward pass (feed)."""
        for row, context in zip(rows, contexts):
            held = self.tokens[row]
            if context[: len(held)] == held:
                continue
            start = self.turn_start[row]
            if context[:start] != held[:start]:
                raise ValueError(
                    f"row {row}: a context must extend what the row holds, or replace its latest "
                    "turn only"
                )
            self.retract(row, len(held) - start)
        if rows != list(range(self.n)):
            self.keep(rows)
        new = [context[len(self.tokens[i]) :] for i, context in enumerate(contexts)]
        self.feed(list(range(self.n)), new)
