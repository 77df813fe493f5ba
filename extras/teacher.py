"""The teacher of the teacher-guided baselines (LUFFY: extras/luffy.py, OPD: extras/opd.py);
optional (extras/): its result is committed.

    python -m extras.teacher                  # build checkpoints/teacher, then its p@1 on val
    python -m extras.teacher report           # the p@1 on val of the committed one
    python -m extras.teacher --ws-steps 50 --ws-out /tmp/teacher   # a smaller one elsewhere

The teacher is the demo's policy made strong: the warm start (checkpoints/warmstart-evidence), the
same tiny model and tokenizer, trained further by behaviour cloning on the oracle's episodes of
`fit` (train without val), in which every leg starts with the `route` tool and follows the route
it returns. That is extras/warmstart.py's loop with its own settings (BUILD: --ws-route-frac 1, no
hint blocks), so the teacher solves most tasks of the distribution RL trains on by the tool call
the warm start seldom makes, the capability boundary RL has to cross. A run takes it as --teacher
(TeacherConfig) and loads it beside the policy (load_teacher).

The committed one (80 steps of 8 episodes, 71 s on one thread): p@1 95.75 on val (100 tasks x 4
samples), 96.88 on fit's first 8 tasks x 8, every leg started with `route` (its report.json); the
warm start it starts from scores 22.50 on test.

navigation-keys' teacher, checkpoints/teacher-keys, is the keys warm start trained the same way on
that env's own fit, keys tasks included (--ws-env-tasks: the teacher calls `find key` at a locked
door), 200 steps; a run there takes it as --teacher. Its report.json: 96.75 on val (plain 98.33,
keys 92.00). It was built at a5ab2b8, when fit mixed the family in at 0.25 (now 0.5; the same
command gives another teacher):

    python -m extras.teacher --model checkpoints/warmstart-keys-tool --env navigation-keys \
        --ws-env-tasks --ws-steps 200 --ws-out checkpoints/teacher-keys
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer

import rti
import runtime
from extras import warmstart
from loss import require
from policy import Sampler, build_tiny_tokenizer, load_model

TEACHER_DIR = "checkpoints/teacher"
PROG = "-m extras.teacher"
# extras/warmstart.py's flags that make the teacher (its flags override them); its report runs on
# val, the first 100 tasks x 4 samples
BUILD = {
    "model": rti.WARMSTART_DIR,
    "ws_split": "fit",
    "ws_route_frac": 1.0,
    "ws_hint_frac": 0.0,
    "ws_evidence_frac": 0.0,
    "ws_steps": 80,
    "ws_batch": 8,
    "ws_lr": 3e-3,
    "ws_out": TEACHER_DIR,
    "train_split": "fit",
    "test_split": "val",
    "eval_tasks": 100,
}


@dataclass
class TeacherConfig(rti.Config):
    """rti.Config plus the teacher a teacher-guided method learns from."""

    teacher: str = field(
        default=TEACHER_DIR,
        metadata={
            "help": "the teacher's model directory: a model with the policy's tokenizer "
            "(python -m extras.teacher builds the committed one)"
        },
    )

    def validate(self) -> None:
        super().validate()
        require(
            self,
            "teacher",
            (Path(self.teacher) / "config.json").is_file(),
            "holds no model (python -m extras.teacher builds one)",
        )
        policy_dir = self.init if self.model == "tiny" else self.model
        if policy_dir:
            policy_vocab = AutoTokenizer.from_pretrained(policy_dir, local_files_only=True)
        else:  # a random tiny model
            policy_vocab = build_tiny_tokenizer(self.env)
        teacher_vocab = AutoTokenizer.from_pretrained(self.teacher, local_files_only=True)
        require(
            self,
            "teacher",
            teacher_vocab.get_vocab() == policy_vocab.get_vocab(),
            f"its tokenizer is not the policy's ({policy_dir or 'the tiny one of --env'})",
        )


def load_teacher(cfg: TeacherConfig, policy: Sampler) -> Sampler:
    """The teacher (--teacher) as a Sampler beside `policy`: on its device, in its dtype, with its
    chat, sampling settings and user; frozen."""
    model, tok = load_model(cfg.teacher, cfg.seed, policy.model.dtype, cfg.env)
    model = model.to(policy.device).eval().requires_grad_(False)
    return Sampler(
        model,
        tok,
        temperature=policy.temperature,
        top_p=policy.top_p,
        max_turn_tokens=policy.max_turn_tokens,
        seed=cfg.seed,
        micro_batch=policy.micro_batch,
        user=policy.user,
        chat=policy.chat,
    )


def build_parser():
    return runtime.build_parser(warmstart.WarmStartConfig, warmstart.COMMANDS, PROG, BUILD)


def main(argv=None) -> dict:
    """Build the teacher (extras/warmstart.py with BUILD's flags), then report it on val and write
    the figures to --ws-out/report.json; `report` only reports."""
    argv = sys.argv[1:] if argv is None else argv
    command, path, cfg = runtime.parse_args(
        argv, warmstart.WarmStartConfig, warmstart.COMMANDS, PROG, BUILD
    )
    torch.set_num_threads(cfg.threads)
    if command != "report":
        warmstart.warmstart(cfg)
    figures = warmstart.report(cfg, path or cfg.ws_out)
    if command != "report":
        run = {"split": cfg.test_split, "tasks": cfg.eval_tasks, "samples": cfg.eval_samples}
        (Path(cfg.ws_out) / "report.json").write_text(json.dumps({**run, **figures}, indent=1))
    return figures


if __name__ == "__main__":
    main()
