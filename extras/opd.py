"""On-policy distillation (OPD) as a baseline of the comparison: the student samples, a teacher
scores every token; optional (extras/).

    python -m extras.opd                              # from the demo's warm start, its teacher
    python -m extras.opd --teacher DIR --steps 48     # any rti.py flag too

The loss is the per-token reverse KL to the teacher, KL(pi_theta || pi_teacher), in its
policy-gradient form (as Agarwal et al.'s GKD on student samples and Thinking Machines' on-policy
distillation): each agent token t of a student episode gets the dense advantage

    A_t = log pi_teacher(y_t | y_<t) - log pi_old(y_t | y_<t)

(pi_old: the student's log-prob when it sampled y_t; the teacher scores at the same temperature),
and the update is rti.py's clipped surrogate on it (loss.token_losses takes advantages per
token). At ratio 1 its gradient -sum_t A_t grad log pi(y_t) is, in expectation over the student's
samples, the gradient of the reverse KL (tests/test_baselines.py checks it exactly on a small
vocabulary). The reward is not used: the teacher's judgement of every token is the whole signal.
The teacher's compute is logged as "teacher/scored_tokens" (every token of every sequence it
scores, one forward pass).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import rti
import runtime
from extras.teacher import TeacherConfig, load_teacher
from policy import pad_rows

PROG = "-m extras.opd"


@dataclass
class OPDConfig(TeacherConfig):
    """rti.Config plus the teacher (extras/teacher.py)."""

    FLAG_GROUP = "OPD"
    method: str = field(
        default="opd",
        metadata={
            "help": "opd: the student learns from the teacher's log-probs of its own tokens",
            "choices": ("opd",),
        },
    )


def opd_advantages(
    teacher_logp: list[list[float]], sample_logp: list[list[float]], loss_mask: list[list[int]]
) -> torch.Tensor:
    """[N, T] per-token advantages, T the longest row: A_t = teacher_logp_t - sample_logp_t on
    agent tokens (loss_mask 1), 0 elsewhere and past a row's end. Example: teacher [0, -0.1, -2],
    student [0, -0.5, -1], mask [0, 1, 1] -> [0, 0.4, -1]."""
    teacher = pad_rows(teacher_logp, 0.0, torch.float32, "cpu")
    student = pad_rows(sample_logp, 0.0, torch.float32, "cpu")
    mask = pad_rows(loss_mask, 0, torch.float32, "cpu")
    return torch.where(mask > 0, teacher - student, 0.0)


class OPD(rti.Method):
    """The student's own rollout; advantages from the teacher's scores (opd_advantages)."""

    def __init__(self):
        self.teacher = None  # loaded beside the policy on first use
        self.scored = 0

    def advantages(self, policy, trajs, cfg: OPDConfig) -> torch.Tensor:
        if self.teacher is None:
            self.teacher = load_teacher(cfg, policy)
        seqs = [t.ids for t in trajs]
        teacher_logp = self.teacher.score(seqs)
        self.scored += sum(map(len, seqs))
        return opd_advantages(
            teacher_logp, [t.sample_logp for t in trajs], [t.loss_mask for t in trajs]
        )

    def metrics(self) -> dict:
        scored, self.scored = self.scored, 0
        return {"teacher/scored_tokens": scored}


# the config class of this command and the defaults it sets on rti.py's (none: its config's);
# extras.compare checks a run's flags with them
CONFIG = OPDConfig
SETTINGS = None


def build_parser():
    return runtime.build_parser(CONFIG, prog=PROG, defaults=SETTINGS)


def main(argv=None) -> None:
    rti.main(argv, CONFIG, OPD, PROG, defaults=SETTINGS)


if __name__ == "__main__":
    main()
