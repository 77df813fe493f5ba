"""GSPO (Group Sequence Policy Optimization; Zheng et al., 2025) as a baseline of the comparison;
optional (extras/).

    python -m extras.gspo                       # rti.py's loop with GSPO's settings (SETTINGS)
    python -m extras.gspo --clip-high 1e-3      # any rti.py flag, these included, overrides them

GSPO is GRPO with one importance ratio per sequence, the geometric mean of its token ratios,
s_i = exp(mean_t log(pi / pi_old)), clipped as a whole (loss.importance_ratios, --ratio-level
sequence), each sequence weighted alike (--agg seq-mean-token-mean: the objective is a mean over
the group's sequences). A sequence ratio stays much closer to 1 than token ratios do, so its clip
range is far smaller than PPO's: GSPO's paper uses 3e-4 below and 4e-4 above; ten times that
(3e-3 / 4e-3) is the range chosen on val here, as is its learning rate, rti.py's 1e-4
(docs/RESULTS.md, section 15). Nothing else changes, so GSPO is rti.py's loop and loss with these
defaults. The ratio and the clip act from the second of --mini-batches on (rti.update).
"""

from __future__ import annotations

import rti
import runtime

SETTINGS = {
    "method": "grpo",
    "ratio_level": "sequence",
    "agg": "seq-mean-token-mean",
    "clip_low": 3e-3,
    "clip_high": 4e-3,
}

PROG = "-m extras.gspo"
# the config class of this command (extras.compare checks a run's flags with it and SETTINGS)
CONFIG = rti.Config


def build_parser():
    return runtime.build_parser(CONFIG, prog=PROG, defaults=SETTINGS)


def main(argv=None) -> None:
    rti.main(argv, CONFIG, prog=PROG, defaults=SETTINGS)


if __name__ == "__main__":
    main()
