"""LUFFY (Learning to reason Under oFF-policY guidance; Yan et al., 2025) as a baseline of the
comparison: a teacher's successful episodes mixed into the groups; optional (extras/).

    python -m extras.luffy                               # from the demo's warm start, its teacher
    python -m extras.luffy --luffy-teacher-tries 4       # any rti.py flag too

Each step the student samples --group-size episodes of every task (rti.rollout) and the teacher
(extras/teacher.py) --luffy-teacher-tries of its own; where one of the teacher's succeeds, it
replaces the group's last student episode (mix_teacher), so every group keeps its size and a task
the student always fails still has a success to learn from. The teacher's agent tokens are marked
INTERVENED, the off-policy tokens of loss.py, with the teacher's log-probs as their behaviour
log-probs; the advantages are GRPO's over the mixed group; and --is-mode luffy (the default here)
trains them with LUFFY's policy shaping, the unclipped ratio f = p / (p + gamma) of the student's
own probability p (loss.importance_ratios, --luffy-gamma), while the student's tokens keep the
clipped surrogate. The teacher's compute is logged as "teacher/episodes" and
"teacher/generated_tokens"; the student's replaced episodes still count in sampled_episodes.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import rti
import runtime
from extras.teacher import TeacherConfig, load_teacher
from loss import INTERVENED, require

PROG = "-m extras.luffy"


@dataclass
class LuffyConfig(TeacherConfig):
    """rti.Config plus the teacher (extras/teacher.py) and how often it tries a task."""

    FLAG_GROUP = "LUFFY"
    method: str = field(
        default="luffy",
        metadata={
            "help": "luffy: GRPO on groups holding a teacher's successful episode",
            "choices": ("luffy",),
        },
    )
    luffy_teacher_tries: int = field(
        default=2,
        metadata={
            "help": "the teacher's episodes of each task a step; the first that succeeds joins "
            "the group"
        },
    )

    def validate(self) -> None:
        super().validate()
        require(self, "luffy_teacher_tries", self.luffy_teacher_tries >= 1, "must be >= 1")


# the config class of this command and the defaults it sets on rti.py's; extras.compare checks a
# run's flags with them
CONFIG = LuffyConfig
SETTINGS = {"is_mode": "luffy"}


def off_policy(traj: rti.Trajectory, group: int) -> rti.Trajectory:
    """The teacher's episode as a member of `group`: its agent tokens marked INTERVENED (written
    by someone other than the policy; their sample_logp stays the teacher's), a record saying so."""
    traj.group = group
    traj.source = [INTERVENED if m else s for s, m in zip(traj.source, traj.loss_mask)]
    traj.intervention = {"teacher": True}
    return traj


def mix_teacher(trajs: list, demos: list) -> list:
    """The groups of `trajs` with the last episode of each group replaced by the first successful
    episode of `demos` of the same group (off_policy), where the teacher has one; group sizes and
    order are kept."""
    first_success = {}
    for demo in demos:
        if demo.reward > 0:
            first_success.setdefault(demo.group, demo)
    last = {t.group: i for i, t in enumerate(trajs)}
    out = list(trajs)
    for group, demo in first_success.items():
        if group in last:
            out[last[group]] = off_policy(demo, group)
    return out


class Luffy(rti.Method):
    """The student's groups with a teacher's success mixed in (mix_teacher)."""

    def __init__(self):
        self.teacher = None  # loaded beside the policy on first use
        self.counts = {"teacher/episodes": 0, "teacher/generated_tokens": 0}

    def rollout(self, policy, tasks, cfg: LuffyConfig, seed):
        if self.teacher is None:
            self.teacher = load_teacher(cfg, policy)
        trajs = rti.rollout(policy, tasks, cfg.group_size, seed)
        tokens = self.teacher.generated_tokens
        teacher_seed = None if seed is None else zlib.crc32(f"{seed}/teacher".encode())
        demos = rti.rollout(self.teacher, tasks, cfg.luffy_teacher_tries, teacher_seed)
        self.counts["teacher/episodes"] += len(demos)
        self.counts["teacher/generated_tokens"] += self.teacher.generated_tokens - tokens
        return mix_teacher(trajs, demos)

    def metrics(self) -> dict:
        counts, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        return counts


def build_parser():
    return runtime.build_parser(CONFIG, prog=PROG, defaults=SETTINGS)


def main(argv=None) -> None:
    rti.main(argv, CONFIG, Luffy, PROG, defaults=SETTINGS)


if __name__ == "__main__":
    main()
