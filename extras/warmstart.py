"""The supervised warm start of the tiny Navigation policy; optional (extras/): its result is committed.

    python -m extras.warmstart           # rebuild checkpoints/warmstart (the demo's starting point)

The tiny model learns from optimal trajectories of the `easy` split: next-token loss on the agent's actions plus an
auxiliary loss on observation tokens (with actions alone a from-scratch model stalls), and in `ws_hint_frac` of turns
the same `<hint> ... </hint>` block a self-corrector sees, right before the action, so that the policy learns from
the start to follow a hint. RL itself (rti.py) trains agent tokens only.
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

import envs
import intervene
import rti


@dataclass
class WarmStartConfig(rti.Config):
    """rti.Config (model, seed, threads, grad_clip, progress) plus the warm start's flags."""
    ws_split: str = "easy"
    ws_steps: int = 1500
    ws_batch: int = 32
    ws_lr: float = 3e-3
    ws_hint_frac: float = 0.3           # share of teacher turns with the corrector's hint block before the action
    ws_obs_weight: float = 1.0          # auxiliary next-token loss on observation tokens
    ws_out: str = rti.WARMSTART_DIR

    def validate(self) -> None:
        def need(ok, name, why):
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')}: {why}, got {getattr(self, name)!r}")
        need(self.ws_split in envs.SPLITS, "ws_split", f"must be a Navigation split: {list(envs.SPLITS)}")
        need(self.ws_steps >= 1 and self.ws_batch >= 1, "ws_steps", "ws_steps and ws_batch must be >= 1")
        need(self.ws_lr > 0, "ws_lr", "must be > 0")
        need(0 <= self.ws_hint_frac <= 1, "ws_hint_frac", "must be in [0, 1]")
        super().validate()


def teacher_sequence(chat: rti.Chat, task, rng: random.Random, hint_frac: float, obs_weight: float):
    """Token ids and per-token loss weights of the optimal episode for `task`.

    Agent tokens weigh 1, observation tokens `obs_weight` (an auxiliary loss: with actions alone a from-scratch model
    stalls), hint tokens 0. A share `hint_frac` of turns carries the hint block a self-corrector will see
    (intervene.format_hint) at the end of the user message before the action, so the policy learns to use it.
    """
    env = envs.Navigation(task)
    content, ids, weights = env.reset(), [], []
    n_post = len(chat.ids(chat.turn_post))
    for t, action in enumerate(envs.optimal_actions(task)):
        piece = chat.prompt_ids if t == 0 else chat.turn_ids
        plain = piece(content)
        w = [obs_weight] * len(plain)
        if rng.random() < hint_frac:
            reason = env.check_step(rng.choice([a for a in envs.ACTIONS if not env.check_step(a).valid])).reason
            hinted = piece(content + " " + intervene.format_hint(reason, env.hint()))
            n_hint = len(hinted) - len(plain)
            w = [obs_weight] * len(hinted)
            w[len(hinted) - n_post - n_hint:len(hinted) - n_post] = [0.0] * n_hint
            plain = hinted
        agent = chat.action_ids(action) + [chat.eos_id]
        ids += plain + agent
        weights += w + [1.0] * len(agent)
        content, done = env.step(action)
        if done:
            break
    weights[0] = 0.0
    return ids, weights


def warmstart(cfg: WarmStartConfig, log=print):
    """Supervised warm start on optimal `easy` trajectories: weighted next-token cross-entropy
    sum_t w_t CE_t / sum_t w_t (teacher_sequence's weights); saves model + tokenizer to cfg.ws_out."""
    model, tok = rti.load_model(cfg.model, cfg.seed)
    chat, tasks, rng = rti.Chat(tok), envs.make_tasks(cfg.ws_split), random.Random(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.ws_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (
        1 + math.cos(math.pi * min(s, cfg.ws_steps) / max(1, cfg.ws_steps))))   # 50 warm-up steps, then cosine
    model.train()
    t0, losses, batches = time.time(), [], []
    bar = tqdm(range(cfg.ws_steps), desc="warm start", disable=not cfg.progress, file=sys.stderr)
    for step in bar:
        if not batches:   # draw 8 batches at once and group similar lengths: less padding, same data
            pool = sorted((teacher_sequence(chat, rng.choice(tasks), rng, cfg.ws_hint_frac, cfg.ws_obs_weight)
                           for _ in range(8 * cfg.ws_batch)), key=lambda b: len(b[0]))
            batches = [pool[i:i + cfg.ws_batch] for i in range(0, len(pool), cfg.ws_batch)]
            rng.shuffle(batches)
        batch = batches.pop()
        ids = rti.pad_rows([b[0] for b in batch], tok.pad_token_id, torch.long, model.device)
        mask = rti.pad_rows([[1] * len(b[0]) for b in batch], 0, torch.long, model.device)
        w = rti.pad_rows([b[1] for b in batch], 0.0, torch.float32, model.device)[:, 1:].reshape(-1)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
        loss = (ce * w).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 20 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
    model.save_pretrained(cfg.ws_out)
    tok.save_pretrained(cfg.ws_out)
    info = {"steps": cfg.ws_steps, "seconds": round(time.time() - t0, 1), "first_loss": (losses or [math.nan])[0],
            "last_loss": float(np.mean(losses[-20:] or [math.nan])), "config": dataclasses.asdict(cfg)}
    (Path(cfg.ws_out) / "warmstart.json").write_text(json.dumps(info, indent=1))
    log(f"warm start: {cfg.ws_steps} steps in {info['seconds']} s, loss {info['first_loss']:.3f} -> "
        f"{info['last_loss']:.3f}, saved to {cfg.ws_out}")
    return model, tok, losses


def main(argv=None) -> None:
    _, _, cfg = rti.parse_args(argv, WarmStartConfig, ("warmstart",), prog="-m extras.warmstart")
    torch.set_num_threads(cfg.threads)
    warmstart(cfg)


if __name__ == "__main__":
    main()
