"""Run from the repository:

    python docs/results/keys-gate-probe/calls_find_key.py MODEL_DIR [MODEL_DIR ...]

How often a policy calls `find key` on its own: val's 25 keys tasks x 8 samples (rti.rollout,
seed 0), episodes that call it, and successes with and without it."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository
import envs
import rti
from policy import Sampler, load_model

torch.set_num_threads(1)
for model_dir in sys.argv[1:]:
    model, tok = load_model(model_dir)
    policy = Sampler(model, tok, seed=0, env="navigation-keys")
    tasks = [t for t in envs.env_tasks("navigation-keys", "val") if t.family == "keys"]
    trajs = rti.rollout(policy, tasks, 8, 0)
    calls = [t for t in trajs if "find key" in t.actions]
    wins = sum(t.reward > 0 for t in calls)
    other_wins = sum(t.reward > 0 for t in trajs if "find key" not in t.actions)
    print(
        f"{model_dir}: {len(calls)} of {len(trajs)} episodes call find key ({wins} succeed); "
        f"{other_wins} succeed without it",
        flush=True,
    )
