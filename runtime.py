"""What a training run needs around the algorithm: its settings (`RunConfig`, which rti.Config
extends), its command line, built from the config dataclasses, its metrics log, its progress and
the checkpoints that resume it.

    cfg = make_config(rti.Config, lr=1e-4, ppl_max=1.3)      # flat flag names, nested configs
    command, path, cfg = parse_args(argv, rti.Config)      # the same from a command line

A config is a dataclass whose fields carry their help text (and choices) in their metadata and
check themselves in validate() (loss.require); a field that is itself a dataclass (rti.Config's
`loss`, `rti`) nests its fields as flags of their own. Nothing here knows RL.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import envs
from loss import require, require_choices

# the demo's warm start: its corrector, shown the grader's evidence, copies the path in part of
# its rewrites (python -m extras.warmstart rebuilds it)
WARMSTART_DIR = "checkpoints/warmstart-evidence"


@dataclass
class RunConfig:
    """A run's settings around the algorithm: the model and where it starts, the seed, the env
    and its splits, the evaluations, the run folder (rti.Config adds the algorithm's). Every field
    is a flag; validate() checks them (loss.require), not on construction: some checks look at
    the disk."""

    FLAG_GROUP = "run"  # the title of its flags in --help (not a field: no annotation)
    model: str = field(
        default="tiny",
        metadata={
            "help": "'tiny' builds the 0.8M-parameter Qwen3 of policy.py; a directory loads a "
            "local Hugging Face causal LM (nothing is downloaded)"
        },
    )
    init: str = field(
        default=WARMSTART_DIR,
        metadata={"help": "starting weights of the tiny model ('' = random, as built)"},
    )
    seed: int = field(
        default=0,
        metadata={
            "help": "seeds the task order, every episode's sampling stream and a random model"
        },
    )
    threads: int = field(default=2, metadata={"help": "torch CPU threads"})
    env: str = field(
        default="navigation",
        metadata={"help": "the environment (envs.ENVS)", "choices": tuple(envs.ENVS)},
    )
    user_model: str = field(
        default="",
        metadata={
            "help": "who plays the user in envs that have one: '' = the policy model, 'scripted', "
            "or a local model directory"
        },
    )
    train_split: str = field(
        default="train",
        metadata={
            "help": "split the training tasks come from (Navigation: 'fit' leaves 'val' out)"
        },
    )
    test_split: str = field(
        default="test",
        metadata={
            "help": "split the evaluations run on (Navigation: 'val' while choosing settings)"
        },
    )
    eval_every: int = field(
        default=10, metadata={"help": "evaluate every N steps (0: only before and after)"}
    )
    eval_samples: int = field(default=4, metadata={"help": "samples per evaluation task"})
    eval_tasks: int = field(
        default=100,
        metadata={"help": "evaluate on the first N tasks of --test-split (0: no evaluation)"},
    )
    ood_split: str = field(
        default="",
        metadata={
            "help": "a split evaluated before and after training as --test-split is, for tasks "
            "unlike training's (navigation-keys: 'ood'); '' = none"
        },
    )
    eval_before: bool = field(default=True, metadata={"help": "evaluate the starting policy too"})
    out: str = field(
        default="runs/demo",
        metadata={"help": "run directory: metrics.jsonl, results.json, ckpt.pt, model/"},
    )
    resume: bool = field(
        default=False, metadata={"help": "continue the run in --out from its checkpoint"}
    )
    save_every: int = field(
        default=10, metadata={"help": "write the checkpoint every N steps and at the end"}
    )
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})

    def validate(self) -> None:
        """require() every field of the run (the message names the flag)."""
        for name in ("eval_samples", "threads", "save_every"):
            require(self, name, getattr(self, name) >= 1, "must be >= 1")
        for name in ("eval_every", "eval_tasks"):
            require(self, name, getattr(self, name) >= 0, "must be >= 0")
        require_choices(self)
        require(
            self,
            "model",
            self.model == "tiny" or (Path(self.model) / "config.json").is_file(),
            "must be 'tiny' or a local Hugging Face model directory (one with a config.json)",
        )
        try:
            splits = envs.env_class(self.env).splits()
        except ImportError as e:
            raise ValueError(f"--env: {e}") from None
        for name in ("train_split", "test_split"):
            require(
                self,
                name,
                getattr(self, name) in splits,
                f"must be a split of {self.env}: {splits}",
            )
        require(
            self,
            "ood_split",
            self.ood_split in ["", *splits],
            f"must be '' or a split of {self.env}: {splits}",
        )
        tiny_init = self.model == "tiny" and self.init
        require(
            self,
            "init",
            not tiny_init or (Path(self.init) / "config.json").is_file(),
            "holds no checkpoint (the warm start: python -m extras.warmstart)",
        )
        missing = unknown_words(self.init, envs.env_class(self.env)) if tiny_init else []
        require(
            self,
            "init",
            not missing,
            f"its tokenizer lacks words of --env {self.env} ({' '.join(missing[:5])} ...): pass "
            f"a warm start built for it (python -m extras.warmstart --env {self.env} --ws-out DIR), "
            "--init '' (a random tiny model) or --model PATH",
        )
        require(
            self,
            "out",
            can_make_folder(self.out),
            "cannot be a run folder here (a file is in the way, or no permission to write)",
        )
        require(
            self,
            "user_model",
            self.user_model in ("", "scripted") or Path(self.user_model).is_dir(),
            "must be '', 'scripted' or a local model directory",
        )


# ----------------------------------------------------------------------------- the command line

FLAG_TYPES = {
    "int": int,
    "float": float,
    "str": str,
    "int | None": lambda s: None if s == "none" else int(s),
}


def flag_fields(cls) -> list[tuple[str | None, dataclasses.Field]]:
    """(name of the nested config or None, field) for every flag of a config class."""
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory):
            out += [(f.name, nested) for nested in dataclasses.fields(f.default_factory)]
        else:
            out.append((None, f))
    return out


def flag_name(field_name: str) -> str:
    """The command-line flag of a config field: lr_warmup -> --lr-warmup."""
    return "--" + field_name.replace("_", "-")


def unknown_flags(argv: list[str], cls) -> list[str]:
    """The words of argv before any `--` that are written as a flag (--name or --name=value) but
    are none of cls's flags (a bool field's --no-name included) nor --help."""
    known = {"--help"}
    for _, f in flag_fields(cls):
        known.add(flag_name(f.name))
        if f.type in ("bool", bool):
            known.add(flag_name("no_" + f.name))
    words = argv[: argv.index("--")] if "--" in argv else argv
    return [w for w in words if w.startswith("--") and w.partition("=")[0] not in known]


def make_config(cls, **flags):
    """A config of class `cls` from flat flag names, as the command line gives them:
    make_config(rti.Config, ppl_max=3, lr=1e-4) sets rti.ppl_max and lr."""
    owner = {f.name: parent for parent, f in flag_fields(cls)}
    unknown = set(flags) - set(owner)
    if unknown:
        raise TypeError(f"unknown config fields {sorted(unknown)}")
    nested = {}
    for f in dataclasses.fields(cls):
        if f.name in owner.values():
            own_flags = {k: v for k, v in flags.items() if owner[k] == f.name}
            nested[f.name] = f.default_factory(**own_flags)
    top = {k: v for k, v in flags.items() if owner[k] is None}
    return cls(**top, **nested)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Prints each flag's default after its help text, an empty string as ''."""

    def _get_help_string(self, action):
        if action.default == "" and "%(default)" not in (action.help or ""):
            return f"{action.help} (default: '')"
        return super()._get_help_string(action)


def declared_by(cls, name: str) -> type:
    """The class of cls's MRO that declares field `name` (a subclass's own fields are its)."""
    return next(c for c in reversed(cls.__mro__) if name in vars(c).get("__annotations__", {}))


def source_file(cls) -> str:
    """The file that defines a class, from the repository root ('extras/scale.py'), also when its
    module runs as __main__."""
    path = Path(sys.modules[cls.__module__].__file__).resolve()
    root = Path(__file__).resolve().parent
    return str(path.relative_to(root)) if path.is_relative_to(root) else path.name


def build_parser(
    cls, commands=("train", "eval"), prog="rti.py", defaults: dict | None = None
) -> argparse.ArgumentParser:
    """The command line of a config class: a flag per field, with the help text and choices of
    the field's metadata, grouped by the config class that declares it (its FLAG_GROUP, or name);
    the description is the first line of the docstring of the module that defines `cls`.
    `defaults` (flat field names) replace the fields' own defaults: a command's settings, such as
    a baseline's of extras/ (its flags still override them)."""
    module = sys.modules[cls.__module__]
    p = argparse.ArgumentParser(
        prog=prog,
        description=(module.__doc__ or "").strip().split("\n")[0],
        usage=f"python {prog} [{' | '.join(commands)}] [MODEL_DIR] [--flag VALUE ...]",
        formatter_class=HelpFormatter,
        allow_abbrev=False,  # the flags as written: a prefix of one is an unknown flag
    )
    p.add_argument("command", nargs="?", default=commands[0], choices=commands, help="what to run")
    p.add_argument("path", nargs="?", help="a model directory, for the commands that read one")
    groups = {}
    for parent, f in flag_fields(cls):
        if parent is not None:
            nested = {g.name: g for g in dataclasses.fields(cls)}[parent].default_factory
            title = f"{parent} ({source_file(nested)})"
        else:
            owner = declared_by(cls, f.name)
            title = f"{vars(owner).get('FLAG_GROUP', owner.__name__)} ({source_file(owner)})"
        if title not in groups:
            groups[title] = p.add_argument_group(title)
        flag = flag_name(f.name)
        help_text = f.metadata.get("help", "")
        if f.type in ("bool", bool):
            groups[title].add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
            )
        else:
            groups[title].add_argument(
                flag,
                type=FLAG_TYPES[f.type],
                default=f.default,
                choices=f.metadata.get("choices"),
                metavar=f.type.split()[0].upper() if "choices" not in f.metadata else None,
                help=help_text,
            )
    p.set_defaults(**(defaults or {}))
    return p


def parse_args(argv, cls, commands=("train", "eval"), prog="rti.py", defaults=None):
    """(command, model directory given after it or None, validated config) from the command
    line; a bad flag exits naming it (each config's validate() words its errors as the flag).
    The directory, if any, becomes --model (a model to evaluate). `defaults`: build_parser's."""
    p = build_parser(cls, commands, prog, defaults)
    argv = sys.argv[1:] if argv is None else list(argv)
    unknown = unknown_flags(argv, cls)
    if unknown:  # named here: argparse would read the word after one as the command, and name it
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    args = vars(p.parse_args(argv))
    command = args.pop("command")
    path = args.pop("path")
    if path:
        args.update(model=path, init="")
    try:
        cfg = make_config(cls, **args)
        cfg.validate()
    except ValueError as e:
        p.error(str(e))
    return command, path, cfg


def unknown_words(folder: str, env_cls) -> list[str]:
    """The words of the env's vocabulary that the tiny model saved in `folder` has no token for
    (its word-level tokenizer.json; every word when there is none)."""
    path = Path(folder) / "tokenizer.json"
    vocab = json.loads(path.read_text())["model"].get("vocab", {}) if path.is_file() else {}
    return [w for w in env_cls.vocabulary() if w not in vocab]


def can_make_folder(path: str) -> bool:
    """Whether `path` is a folder, or one could be made there: its nearest existing ancestor is a
    folder this process may write in."""
    target = Path(path).absolute()
    if target.is_dir():
        return os.access(target, os.W_OK)
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    return not target.exists() and parent.is_dir() and os.access(parent, os.W_OK)


# ----------------------------------------------------------------------------- progress, the log, checkpoints


def seed_everything(seed: int, threads: int) -> None:
    """Python's, NumPy's and torch's global generators, and torch's CPU threads."""
    torch.set_num_threads(threads)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def silent(*args, **kwargs) -> None:
    """The log of a process other than the first."""


@dataclass
class Progress:
    """What a run has done so far, kept in its checkpoint: the steps taken, each step's
    intervention counts (for the run's statistics) and the compute spent."""

    step: int = 0
    rti_steps: list[dict] = field(default_factory=list)
    episodes: int = 0  # rollout episodes and RTI's continuations of corrected ones
    generated_tokens: int = 0  # tokens the policy sampled, in every role
    train_seconds: float = 0.0  # time in training steps, evaluations left out
    rollout_seconds: float = 0.0  # the parts of it: sampling,
    intervene_seconds: float = 0.0  # RTI's intervention,
    update_seconds: float = 0.0  # and the update
    eval_seconds: float = 0.0  # time in evaluations
    # a teacher's compute (the teacher-guided baselines of extras/): its "teacher/..." metrics
    teacher: dict = field(default_factory=dict)

    def add(self, metrics: dict) -> None:
        """Count a finished step (train_step's metrics, with "step" and "time/step")."""
        self.step = metrics["step"]
        self.rti_steps.append({k[4:]: v for k, v in metrics.items() if k.startswith("rti/")})
        self.episodes += metrics["sampled_episodes"] + metrics["continued_episodes"]
        self.generated_tokens += metrics["generated_tokens"]
        self.train_seconds += metrics["time/step"]
        self.rollout_seconds += metrics["time/rollout"]
        self.intervene_seconds += metrics["time/intervene"]
        self.update_seconds += metrics["time/update"]
        for key, value in metrics.items():
            if key.startswith("teacher/"):
                self.teacher[key] = self.teacher.get(key, 0) + value

    def totals(self) -> dict:
        """The compute so far, as metrics: the x-axes of a comparison at matched compute (with a
        teacher, its episodes and tokens: "total/teacher/episodes", ...)."""
        return {
            "total/episodes": self.episodes,
            "total/generated_tokens": self.generated_tokens,
            "time/train_total": self.train_seconds,
            **{f"total/{key}": value for key, value in self.teacher.items()},
        }


def truncate_metrics(path: Path | None, last_step: int) -> None:
    """Keep the metrics log's rows up to `last_step` (a fresh run keeps none)."""
    if path is None:
        return
    rows = path.read_text().splitlines() if last_step and path.exists() else []
    kept = [row for row in rows if json.loads(row)["step"] <= last_step]
    path.write_text("".join(row + "\n" for row in kept))


def append_metrics(path: Path | None, row: dict) -> None:
    """One JSON row of metrics.jsonl (None: this process does not log)."""
    if path is None:
        return
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def log_test(path: Path | None, step: int, summary: dict, split: str = "test") -> None:
    """An evaluation's row of metrics.jsonl: the metrics on the test split (or "ood") at `step`."""
    append_metrics(path, {"step": step, **{f"{split}/{k}": v for k, v in summary.items()}})


def save_checkpoint(backend, path, sampler, opt, task_rng, progress: Progress, cfg) -> None:
    """Everything --resume needs to continue the run as if it had never stopped: weights,
    optimizer, the progress, and the task order's and the sampling generators' states."""
    state = {
        "progress": dataclasses.asdict(progress),
        "task_rng": task_rng.getstate(),
        "sample_rng": sampler.gen.get_state(),
        "torch_rng": torch.get_rng_state(),
        "config": dataclasses.asdict(cfg),
    }
    backend.save_checkpoint(path, sampler, opt, state)


def load_checkpoint(backend, path, sampler, opt, task_rng) -> Progress:
    """Restore what save_checkpoint wrote; return the run's progress."""
    state = backend.load_checkpoint(path, sampler, opt)
    task_rng.setstate(state["task_rng"])
    sampler.gen.set_state(state["sample_rng"])
    torch.set_rng_state(state["torch_rng"])
    return Progress(**state["progress"])
