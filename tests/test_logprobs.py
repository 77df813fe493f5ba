"""policy.token_logprobs without full-vocabulary tensors: the chunked form against the plain one
(values, gradients, peak memory at Qwen3's 151,936-token vocabulary), the tiny model's one-chunk
path bit for bit, a model whose logits are not its head's, an empty micro-batch.

`python tests/test_logprobs.py FORM OUT` is the worker that test_peak_memory_a_tenth_of_the_plain
_form runs once per form, each in a process of its own: peak memory is the growth of the process's
peak resident set (VmHWM, reset before the call through /proc/self/clear_refs, Linux) during one
forward and backward. It sees every allocation, torch's included (tracemalloc sees none of them);
a process of its own keeps one form's memory from hiding the other's peak; and a fixed malloc
mmap threshold (MALLOC_MMAP_THRESHOLD_) gives every block over 128 KiB back to the system when it
is freed, so the resident set follows the live tensors (glibc's default threshold rises to 32 MiB
after a free, and freed chunks below it then stay resident: the chunked form's peak read twice
its real size).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from policy import build_tiny_model, load_model, pad_rows, token_logprobs  # noqa: E402

VOCAB = 151_936  # Qwen3's


def random_qwen3(vocab=VOCAB, tied=False, seed=0) -> Qwen3ForCausalLM:
    """A one-layer Qwen3 of hidden size 64 with a real-sized vocabulary: the head's logits are
    everything that costs memory."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=tied,
        pad_token_id=0,
    )
    return Qwen3ForCausalLM(config)


def random_rows(lengths, vocab, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def plain_logprobs(model, seqs, pad_id, temperature):
    """The form token_logprobs replaced: logits of every position, an fp32 copy, a divided copy
    and a full-vocabulary log_softmax."""
    ids = pad_rows(seqs, pad_id, torch.long, "cpu")
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return F.pad(logp, (1, 0))


def real(seqs, width) -> torch.Tensor:
    """[B, T] 1.0 on real tokens but the first of each row (the positions that have a log-prob)."""
    mask = torch.zeros(len(seqs), width)
    for i, s in enumerate(seqs):
        mask[i, 1 : len(s)] = 1
    return mask


def values_and_grads(model, form, seqs, temperature, **kw):
    """The log-probs of `form` and the gradients of a weighted sum of them."""
    model.zero_grad(set_to_none=True)
    logp = form(model, seqs, 0, temperature, **kw)
    weights = torch.linspace(-1, 1, logp.shape[1])
    (logp * real(seqs, logp.shape[1]) * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logp.detach(), grads


def assert_same(got, want):
    """Log-probs within 1e-5; each gradient within 1e-4 of its largest element (a gradient sums
    over the vocabulary and the positions in another order, and fp32's rounding grows with the
    terms: about 1e-5 of the largest element for the tied embedding)."""
    (logp, grads), (ref_logp, ref_grads) = got, want
    assert logp.shape == ref_logp.shape
    assert torch.allclose(logp, ref_logp, atol=1e-5, rtol=0)
    for name, g in ref_grads.items():
        assert (grads[name] - g).abs().max() <= 1e-4 * g.abs().max(), name


@pytest.mark.parametrize("temperature,tied", [(1.0, False), (0.7, True)])
def test_chunked_values_and_gradients_match_the_plain_form(temperature, tied):
    """Slices of 7 positions (chunk = 7 x V) over rows of different lengths: padded positions 0,
    the others within 1e-5 of the plain form, and so are the gradients."""
    model = random_qwen3(tied=tied)
    seqs = random_rows([40, 23, 1, 31], VOCAB)
    chunked = values_and_grads(
        model, token_logprobs, seqs, temperature, device="cpu", chunk=7 * VOCAB
    )
    plain = values_and_grads(model, plain_logprobs, seqs, temperature)
    mask = real(seqs, 40)
    assert (chunked[0][mask == 0] == 0).all()  # column 0 and the pads
    assert_same((chunked[0], chunked[1]), (plain[0] * mask, plain[1]))


def test_no_grad_scoring_takes_the_same_values():
    model = random_qwen3()
    seqs = random_rows([30, 17], VOCAB, seed=1)
    with torch.no_grad():
        chunked = token_logprobs(model, seqs, 0, 1.0, "cpu", chunk=5 * VOCAB)
        plain = plain_logprobs(model, seqs, 0, 1.0) * real(seqs, 30)
    assert torch.allclose(chunked, plain, atol=1e-5, rtol=0)


def test_one_chunk_batch_is_the_plain_form_bit_for_bit():
    """The tiny model's batches fit one chunk: the same values and gradients as the plain form,
    bit for bit (the demo's digits stay)."""
    _, tok = load_model("tiny")
    model = build_tiny_model(len(tok), seed=3)
    seqs = random_rows([50, 12, 33], len(tok), seed=2)
    logp, grads = values_and_grads(model, token_logprobs, seqs, 0.9, device="cpu")
    ref_logp, ref_grads = values_and_grads(model, plain_logprobs, seqs, 0.9)
    assert torch.equal(logp, ref_logp * real(seqs, 50))
    assert all(torch.equal(grads[n], g) for n, g in ref_grads.items())


def test_empty_micro_batch_still_reaches_every_weight():
    """A process with no rows left runs a one-token row (rti.micro_batch_loss): its log-probs are
    empty of values but its backward runs through the model, as FSDP's collectives need."""
    model = random_qwen3()
    logp = token_logprobs(model, [[0]], 0, 1.0, "cpu", chunk=VOCAB)
    assert logp.shape == (1, 1) and logp.requires_grad
    logp.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_logits_changed_after_the_head_fall_back_to_the_full_logits():
    """Gemma 2 soft-caps its logits after the head: the chunked form cannot reproduce them, so
    the model is scored from its full logits, with a warning, and remembers it."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=0.5,
        pad_token_id=0,
    )
    model = Gemma2ForCausalLM(config)
    seqs = random_rows([20, 9], 300, seed=4)
    with pytest.warns(UserWarning, match="changes its logits after the output head"):
        logp = token_logprobs(model, seqs, 0, 1.0, "cpu", chunk=300)
    assert model._rti_full_logits
    with torch.no_grad():
        want = plain_logprobs(model, seqs, 0, 1.0) * real(seqs, 20)
    assert torch.allclose(logp.detach(), want, atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- peak memory

ROWS = [1024, 900]  # 2 rows of up to 1,024 tokens


def memory_worker(form: str, out: str) -> None:
    """One forward and backward of `form` (plain or chunked) on the random Qwen3 with Qwen3's
    vocabulary; writes the log-probs, the gradients and the growth of the peak resident set."""
    torch.set_num_threads(1)
    model = random_qwen3()
    seqs = random_rows(ROWS, VOCAB)
    weights = torch.linspace(-1, 1, max(ROWS))
    mask = real(seqs, max(ROWS))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set starts again from the current one
    before = rss_kib("VmRSS")
    if form == "plain":
        logp = plain_logprobs(model, seqs, 0, 1.0) * mask
    else:
        logp = token_logprobs(model, seqs, 0, 1.0, "cpu") * mask
    (logp * weights).sum().backward()
    peak = rss_kib("VmHWM") - before
    torch.save(
        {
            "logp": logp.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters()},
            "peak_bytes": peak * 1024,
        },
        out,
    )


def rss_kib(field: str) -> int:
    """A field of /proc/self/status (VmRSS: resident now; VmHWM: its peak), in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


@pytest.mark.slow
def test_peak_memory_a_tenth_of_the_plain_form(tmp_path):
    """2 rows of 1,024 and 900 tokens, vocabulary 151,936, forward and backward: the chunked
    form's peak is at most a tenth of the plain form's; values within 1e-5, gradients too."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "MALLOC_MMAP_THRESHOLD_": str(128 * 1024),
    }
    procs = {
        form: subprocess.Popen(
            [sys.executable, __file__, form, str(tmp_path / f"{form}.pt")],
            env=env,
            cwd=ROOT,
            stderr=subprocess.PIPE,
            text=True,
        )
        for form in ("plain", "chunked")
    }
    for form, proc in procs.items():
        err = proc.communicate(timeout=240)[1]
        assert proc.returncode == 0, f"{form}: {err[-3000:]}"
    plain, chunked = (torch.load(tmp_path / f"{f}.pt") for f in ("plain", "chunked"))
    figures = {
        f: round(r["peak_bytes"] / 2**20) for f, r in (("plain", plain), ("chunked", chunked))
    }
    diff = (chunked["logp"] - plain["logp"]).abs().max().item()
    print("peak MiB", json.dumps(figures), "max |logp diff|", f"{diff:.2e}")
    elements = (max(ROWS) - 1) * len(ROWS) * VOCAB
    assert plain["peak_bytes"] > 8 * elements  # the plain form's logits and their copies
    assert chunked["peak_bytes"] <= plain["peak_bytes"] / 10, figures
    assert_same((chunked["logp"], chunked["grads"]), (plain["logp"], plain["grads"]))


if __name__ == "__main__":
    memory_worker(sys.argv[1], sys.argv[2])
