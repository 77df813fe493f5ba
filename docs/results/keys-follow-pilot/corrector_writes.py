"""Run from the repository:

    python docs/results/keys-follow-pilot/corrector_writes.py MODEL_DIR [evidence|hint]

What the self-corrector writes on val's keys tasks, from a model dir: a rollout of the keys
tasks x 8, intervened with the default RTIConfig (and --corrector-sees hint), rewrites counted."""

import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository
import envs
import intervene
import rti
from policy import Sampler, load_model

torch.set_num_threads(1)
model_dir = sys.argv[1]
sees = sys.argv[2] if len(sys.argv) > 2 else "evidence"
model, tok = load_model(model_dir)
policy = Sampler(model, tok, seed=0, env="navigation-keys")
tasks = [t for t in envs.env_tasks("navigation-keys", "val") if t.family == "keys"]
trajs = rti.rollout(policy, tasks, 8, 0)
written = collections.Counter()
orig = intervene.SelfCorrector.rewrite


def rec(self, cases):
    out = orig(self, cases)
    for c, r in zip(cases, out):
        state = "after-door" if c.env.optimal_action() == "find key" else "other"
        written[(state, r.action)] += 1
    return out


intervene.SelfCorrector.rewrite = rec
cfg = intervene.RTIConfig(corrector_sees=sees)
batch, stats = intervene.intervene_batch(policy, trajs, cfg, policy.make_env)
print(
    "episodes calling find key",
    sum("find key" in t.actions for t in trajs),
    "successes calling it",
    sum("find key" in t.actions and t.reward > 0 for t in trajs),
)
print(model_dir, sees, "success", sum(t.reward > 0 for t in trajs), "/", len(trajs))
for k, v in sorted(written.items()):
    print(k, v)
print({k: v for k, v in stats.items() if not isinstance(v, list)})
