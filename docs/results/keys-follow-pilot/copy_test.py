"""Run from the repository:

    python docs/results/keys-follow-pilot/copy_test.py MODEL_DIR [all|findkey]

Does a model copy the random phrase its note names? Teacher sequences with a followed phrase in
their first turn, cut before the phrase; the model samples the rest of the turn."""

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository
import envs
from extras import warmstart
from policy import Sampler, load_model

torch.set_num_threads(1)
model, tok = load_model(sys.argv[1])
sampler = Sampler(
    model,
    tok,
    seed=0,
    env="navigation-keys",
    temperature=float(sys.argv[3]) if len(sys.argv) > 3 else 1.0,
)
chat = sampler.chat
env_cls = envs.env_class("navigation-keys")
words = tuple(w for w in env_cls.vocabulary() if w not in envs.SEPARATORS)
banned = frozenset(env_cls.TOOL_CALLS)
if len(sys.argv) > 2 and sys.argv[2] == "findkey":
    words, banned = ("find", "key"), frozenset()
tasks = envs.make_tasks("easy")[:300]
ctxs, want = [], []
for i, task in enumerate(tasks):
    rng = random.Random(i)
    ids, w = warmstart.teacher_sequence(
        chat,
        task,
        rng,
        1.0,
        1.0,
        0.0,
        evidence_frac=0.5,
        follow_frac=1.0,
        words=words,
        banned=banned,
    )
    text = tok.convert_ids_to_tokens(ids)
    close = text.index("</hint>")
    start = text.index("<|assistant|>", close) + 1
    end = text.index(chat.tok.eos_token, start)
    phrase = " ".join(text[start:end])
    if len(sys.argv) > 2 and sys.argv[2] == "findkey" and phrase != "find key":
        continue
    ctxs.append(ids[:start])
    want.append(phrase)
out, _ = sampler.generate(ctxs)
got = [chat.action_text(o) for o in out]
print(sys.argv[1:], "copied", sum(g == w for g, w in zip(got, want)), "/", len(want))
for g, w in list(zip(got, want))[:8]:
    print(repr(w), "->", repr(g))
