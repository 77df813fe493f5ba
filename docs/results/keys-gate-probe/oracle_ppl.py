"""Run from the repository:

    python docs/results/keys-gate-probe/oracle_ppl.py MODEL_DIR [MODEL_DIR ...]

Would RTI's perplexity gate keep a keys episode that a corrector knowing `find key` (a teacher)
made succeed? For each of val's keys tasks, the oracle's episode (env.optimal_action every turn,
route's answers followed) is scored by the policy, as intervene.intervened_ppl scores a corrected
success (no note in the context). Printed per model: the agent-scope perplexity of the oracle's
keys episodes and of its plain episodes (val's first 25 plain tasks), the share at most the gate's
ppl_max, and the mean log-prob of the `find key` turn's tokens."""

import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository
import envs
import intervene
from policy import Chat, Sampler, load_model

torch.set_num_threads(1)
PPL_MAX = intervene.RTIConfig().ppl_max


def oracle_episode(chat: Chat, task) -> tuple[list[int], list[bool], list[bool]]:
    """(ids, agent-token mask, find-key-turn mask) of the oracle's episode of `task`."""
    env = envs.env_class("navigation-keys")(task)
    content = env.reset()
    ids, agent, find = [], [], []
    while not env.done:
        piece = chat.prompt_ids if env.turns == 0 else chat.turn_ids
        plain = piece(content)
        action = env.optimal_action()
        turn = chat.action_ids(action) + [chat.eos_id]
        ids += plain + turn
        agent += [False] * len(plain) + [True] * len(turn)
        find += [False] * len(plain) + [action == "find key"] * len(turn)
        content = env.step(action)[0]
    return ids, agent, find


for model_dir in sys.argv[1:]:
    model, tok = load_model(model_dir)
    if tok.unk_token_id in tok("find key door locked").input_ids:
        print(f"{model_dir}: its tokenizer lacks the keys words (not built for navigation-keys)")
        continue
    policy = Sampler(model, tok, seed=0, env="navigation-keys")
    chat = policy.chat
    tasks = envs.env_tasks("navigation-keys", "val")
    for family in ("plain", "keys"):
        chosen = [t for t in tasks if t.family == family][:25]
        episodes = [oracle_episode(chat, t) for t in chosen]
        scores = policy.score([ids for ids, _, _ in episodes])
        ppls, find_lp = [], []
        for (ids, agent, find), lp in zip(episodes, scores):
            vals = [v for v, a in zip(lp, agent) if a]
            ppls.append(math.exp(-sum(vals) / len(vals)))
            find_lp += [v for v, f in zip(lp, find) if f]
        kept = sum(p <= PPL_MAX for p in ppls)
        line = (
            f"{model_dir} {family}: {len(ppls)} oracle episodes, agent-scope ppl median "
            f"{statistics.median(ppls):.3f} (min {min(ppls):.3f}, max {max(ppls):.3f}), "
            f"{kept} at most ppl_max {PPL_MAX}"
        )
        if find_lp:
            line += (
                f"; find-key turn tokens: mean log-prob {statistics.mean(find_lp):.2f} "
                f"over {len(find_lp)} tokens"
            )
        print(line, flush=True)
