"""RTI inside TRL 1.16: Navigation as a TRL `environment_factory`, and
`RTIGRPOTrainer(GRPOTrainer)`; optional (extras/).

    pip install -r requirements-trl.txt   # trl==1.16.0: accelerate, datasets; transformers >= 5.2
    python -m extras.trl_rti train --steps 10 --tasks 4 --group-size 8   # RTI trainer, prints stats
    python -m extras.trl_rti stock --steps 2          # stock GRPOTrainer + NavigationToolEnv

Two ways to use this repository from TRL:

1. `NavigationToolEnv` + stock `GRPOTrainer(environment_factory=NavigationToolEnv)`: TRL's own
   tool loop plays the episodes (tools `move(direction)`, `route()` and `finish()`, described
   once, in extras/chat_tools.py's NavigationTools), `get_reward()` is our rubric (1 iff every
   item passes). Dataset rows carry the task as JSON (`navigation_dataset`). No RTI: plain GRPO in
   TRL.
2. `RTIGRPOTrainer`: generation is ours (`rti.rollout`: lockstep episodes, KV cache kept across
   turns) followed by the intervention (`intervene.intervene_batch`) on TRL's model; per-token
   `rti_source` and `rti_behavior_logps` ride in TRL's batch (right-padded like `completion_ids`,
   so TRL's shuffle and split keep them aligned) and the loss is `loss.policy_loss` (TRL's
   `loss_type` mapped to our `agg`, TRL's gradient-accumulation scaling kept).

Limits, and why (read in trl/trainer/grpo_trainer.py and trl/chat_template_utils.py of the 1.16.0
wheel):
- TRL's tool loop needs a chat template that renders tool calls and tool messages
  (`supports_tool_calling`, a sentinel check) and a tokenizer whose `parse_response` turns a
  completion into `tool_calls`; its own parsers (`add_response_schema`) only know real model
  families. The tiny model writes plain-text actions (`move up`) with a word-level tokenizer, so
  `tool_tokenizer` gives it (a) `TOOL_TEMPLATE`: a call renders as `move up`, a tool message as
  the user turn the model was trained on, tool schemas are not rendered (the tiny model has no
  words for JSON); an argument other than `direction` renders as `key value`, which TRL's
  sentinel check needs; and (b) `ActionTokenizer.parse_response`: exactly one action of
  `envs.ACTIONS` is a tool call, anything else is text.
- TRL ends an episode only on a turn without a tool call; it cannot see the environment's
  `done`. So the parser also reads a turn that follows an observation saying `episode over` /
  `out of turns` as text: that one extra sampled turn ends TRL's loop (it stays in the
  completion; our rollout never samples it).
- A turn that is no valid action ends TRL's episode (unfinished: reward 0); in our rollout it
  costs a turn and the episode goes on (`error unknown action`). A real model with a real
  tool-call template needs neither adapter.
- `RTIGRPOTrainer` scores with our rubric inside its rollout; TRL's reward functions are not
  called (GRPOTrainer requires one, `rubric_reward` is a stand-in). Advantages are
  `loss.group_advantages` (eps 1e-6; TRL uses 1e-4); `scale_rewards="batch"`,
  `num_iterations > 1` with vLLM, multimodal inputs and loss types other than grpo, bnpo,
  dr_grpo, dapo are refused. Nothing here is distribution-specific beyond TRL's own gathers, but
  only single-process runs are tested.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import warnings
from dataclasses import asdict

import torch
from transformers import PreTrainedTokenizerFast

import envs
import evaluate
import intervene
import rti
import runtime
from extras.chat_tools import NavigationTools
from loss import POLICY, LossConfig, group_advantages, loss_metrics, policy_loss
from policy import Sampler, load_model

INSTALL = "pip install -r requirements-trl.txt   (trl==1.16.0)"
try:
    from trl import GRPOConfig, GRPOTrainer
except ImportError as e:  # say how to get it
    raise ImportError(f"extras.trl_rti needs TRL: {INSTALL}") from e
# TRL 1.16 calls transformers' checkpointing API by the names transformers 5 deprecated
# (gradient_checkpointing..., a FutureWarning at each call); this project calls the new names
warnings.filterwarnings("ignore", r"`(is_)?gradient_checkpointing\w*` is deprecated", FutureWarning)

# ----------------------------------------------------------------------------- core names
# The only place this file names the core modules' API (policy.Sampler and load_model come in
# by their import above).
RTIConfig = intervene.RTIConfig
rollout = rti.rollout
Trajectory = rti.Trajectory
update = rti.update  # update(sampler, opt, trajs, advantages, train_config(...))
WARMSTART = rti.WARMSTART_DIR


def train_config(**flags):
    """rti.Config from flat flags (micro_batch, agg, clip_high, lr, ...)."""
    return runtime.make_config(rti.Config, **flags)


def run_intervention(sampler, trajs, cfg):
    """(the batch after RTI, its statistics with the rates of the paper's Table 6)."""
    trajs, counts = intervene.intervene_batch(sampler, trajs, cfg, sampler.make_env)
    return trajs, evaluate.intervention_rates(counts)


# ----------------------------------------------------------------------------- data


def navigation_dataset(tasks):
    """A `datasets.Dataset` of Navigation tasks: `prompt` (an empty user message;
    `NavigationToolEnv.reset` appends the first observation to it, as TRL does with any
    environment) and `task` (the NavTask as JSON)."""
    from datasets import Dataset

    prompt = [{"role": "user", "content": ""}]
    return Dataset.from_list([{"prompt": prompt, "task": json.dumps(asdict(t))} for t in tasks])


def task_of(row) -> envs.NavTask:
    return envs.NavTask(**json.loads(row["task"]))


# ----------------------------------------------------------------------------- TRL environment


class NavigationToolEnv:
    """Navigation for TRL's `environment_factory`: `reset(**row)` starts the row's task and returns
    its first observation; the public methods `move`, `route` and `finish` become the tools, with
    the schemas TRL reads from their docstrings (NavigationTools.docstring); `get_reward` is our
    rubric's verdict."""

    def __init__(self):
        self.env = None

    def reset(self, task: str, **row) -> str:
        self.env = envs.Navigation(envs.NavTask(**json.loads(task)))
        return self.env.reset()

    def move(self, direction: str) -> str:
        return self.env.step(f"move {direction}")[0]

    move.__doc__ = NavigationTools.docstring("move")

    def route(self) -> str:
        return self.env.step("route")[0]

    route.__doc__ = NavigationTools.docstring("route")

    def finish(self) -> str:
        return self.env.step("finish")[0]

    finish.__doc__ = NavigationTools.docstring("finish")

    def get_reward(self) -> float:
        """1.0 iff every rubric item passes (envs.Navigation.score); 0.0 for an episode that never
        started."""
        return float(self.env.score().success) if self.env is not None else 0.0


# ----------------------------------------------------------------------------- tiny model's calls

TOOL_TEMPLATE = (
    "{%- for m in messages -%}{%- if not loop.first %} {% endif -%}"
    "<|{{ 'user' if m['role'] == 'tool' else m['role'] }}|> {{ m['content'] }}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- for c in (m['tool_calls'] if m['tool_calls'] is defined and m['tool_calls'] else []) -%}"
    "{%- set f = c['function'] if c['function'] is defined else c -%}"
    "{%- if m['content'] or not loop.first %} {% endif -%}{{ f['name'] }}"
    "{%- for k, v in (f['arguments'].items() if f['arguments'] is mapping else []) -%}"
    "{%- if k != 'direction' %} {{ k }}{% endif %} {{ v }}{%- endfor -%}"
    "{%- endfor %} <|im_end|>{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt %} <|assistant|>{% endif -%}"
)
EPISODE_OVER = ("episode over", "out of turns")  # what Navigation says once an episode is done


class ActionTokenizer(PreTrainedTokenizerFast):
    """The tiny word-level tokenizer with a tool-call parser: one action of envs.ACTIONS is a tool
    call."""

    # TRL calls parse_response only when a response_template is set (else it tries its own, which
    # fails on an unknown template); this minimal, valid one is never used by our parse_response.
    TEMPLATE = {
        "start_anchor": "<|assistant|>",
        "fields": {"content": {"close_pattern": r"<\|im_end\|>"}},
    }

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.response_template = dict(self.TEMPLATE)

    def parse_response(self, response, schema=None, *, prefix=None, tools=None) -> dict:
        if isinstance(response, str):
            text = response
        else:
            text = self.decode(response, skip_special_tokens=True)
        text = " ".join(text.split())
        context = prefix if isinstance(prefix, str) else self.decode(prefix or [])
        last_user_turn = context.rsplit("<|user|>", 1)[-1]
        if text in envs.ACTIONS and not any(s in last_user_turn for s in EPISODE_OVER):
            call = {"type": "function", "function": NavigationTools.call_from_action(text)}
            return {"role": "assistant", "content": "", "tool_calls": [call]}
        return {"role": "assistant", "content": text}


def tool_tokenizer(tok) -> ActionTokenizer:
    """The same vocabulary and special tokens as `tok`, with TOOL_TEMPLATE and the action
    parser."""
    return ActionTokenizer(
        tokenizer_object=tok.backend_tokenizer,
        pad_token=tok.pad_token,
        unk_token=tok.unk_token,
        eos_token=tok.eos_token,
        chat_template=TOOL_TEMPLATE,
    )


# ----------------------------------------------------------------------------- the RTI trainer

# TRL loss_type -> our LossConfig.agg (dapo: token-mean, renormalised in _compute_loss)
AGG = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "dapo": "token-mean",
}
# RTIGRPOTrainer's intervention unless told otherwise (None there: plain GRPO)
DEFAULT_RTI = RTIConfig()


def rollout_seed(seed: int, step: int, rank: int = 0) -> int:
    """The rollout seed of an optimizer step. Each episode samples from a stream fixed by (this
    seed, task, sample index) alone (rti.episode_seed), so a task's G episodes are the same
    whatever else is in the batch."""
    return seed * envs.SEED_STRIDE + step * 7919 + rank


def rubric_reward(completions, **kwargs):
    """Stand-in reward source (GRPOTrainer requires one). RTIGRPOTrainer never calls it: its
    rollout scores each episode with the Navigation rubric."""
    raise RuntimeError(
        "RTIGRPOTrainer scores episodes in its rollout; this reward function is never called"
    )


class RTIGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose generation is our batched, KV-cached multi-turn rollout plus RTI, and whose
    loss is loss.policy_loss with per-token source and behaviour log-probs.

    Rows of the train dataset must hold `task` (NavTask JSON, see navigation_dataset).
    `rti_config` sets the intervention (None: plain GRPO on our rollout); `loss_config` the loss
    flags that TRL has no name for (is_mode, reweight, w_min/w_max); clip, agg and kl_coef come
    from TRL's args. `max_turn_tokens` caps an agent turn. After each generation, `self.rti_stats`
    gets the intervention statistics of that batch.
    """

    def __init__(
        self,
        *args,
        rti_config: RTIConfig | None = DEFAULT_RTI,
        loss_config: LossConfig | None = None,
        max_turn_tokens: int = 4,
        reward_funcs=None,
        **kwargs,
    ):
        super().__init__(*args, reward_funcs=reward_funcs or [rubric_reward], **kwargs)
        if self.loss_type not in AGG:
            raise ValueError(
                f"RTIGRPOTrainer: loss_type {self.loss_type!r} has no counterpart in loss.py; "
                f"use one of {sorted(AGG)}"
            )
        if self.scale_rewards == "batch" or self.use_vllm or self.tools:
            raise ValueError(
                "RTIGRPOTrainer: scale_rewards='batch', vLLM and TRL tools are not supported"
            )
        if rti_config is not None and rti_config.group_mode != "replace":
            raise ValueError(
                "RTIGRPOTrainer: TRL's batch holds G completions a prompt, so corrections must "
                "replace their originals: RTIConfig(group_mode='replace')"
            )
        base = loss_config or LossConfig()
        self.rti_loss_config = LossConfig(
            clip_low=self.epsilon_low,
            clip_high=self.epsilon_high,
            is_mode=base.is_mode,
            reweight=base.reweight,
            w_min=base.w_min,
            w_max=base.w_max,
            kl_coef=self.beta,
            agg=AGG[self.loss_type],
            max_len=self.max_completion_length if self.loss_type == "dr_grpo" else None,
        )
        self.rti_config = rti_config
        self.max_turn_tokens = max_turn_tokens
        self.rti_stats: list[dict] = []
        self.rti_trajs: list = []

    def sampler(self):
        """Our sampler around TRL's (unwrapped) model, at TRL's temperature and top_p."""
        model = self.accelerator.unwrap_model(self.model)
        return Sampler(
            model,
            self._tokenizer,
            temperature=self.temperature,
            top_p=self.top_p or 1.0,
            max_turn_tokens=self.max_turn_tokens,
            seed=self.args.seed,
        )

    @torch.no_grad()
    def _generate_and_score_completions(self, inputs: list[dict]) -> dict:
        device = self.accelerator.device
        mode = "train" if self.model.training else "eval"
        G = self.num_generations if mode == "train" else self.num_generations_eval
        groups = [inputs[i : i + G] for i in range(0, len(inputs), G)]
        if any(len({r["task"] for r in g}) != 1 or len(g) != G for g in groups):
            raise ValueError(
                "RTIGRPOTrainer: a generation batch must hold each task G times in a row"
            )
        tasks = [task_of(g[0]) for g in groups]
        sampler = self.sampler()
        seed = rollout_seed(self.args.seed, self.state.global_step, self.accelerator.process_index)
        t0 = time.perf_counter()
        trajs = rollout(sampler, tasks, G, seed)
        t1 = time.perf_counter()
        success_before = sum(t.reward for t in trajs) / len(trajs)
        if self.rti_config is not None:
            trajs, stats = run_intervention(sampler, trajs, self.rti_config)
            self.rti_stats.append(stats)
            for k, v in stats.items():
                if isinstance(v, (int, float)) and not math.isnan(v):
                    self._metrics[mode][f"rti/{k}"].append(float(v))
        self.model.train(mode == "train")  # rollout put the model in eval mode
        self.rti_trajs = trajs  # the batch as trained, in rollout order (tests, debugging)
        t2 = time.perf_counter()

        out = self.collate(sampler, trajs, device)
        rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        advantages = group_advantages(rewards, G, scale=self.scale_rewards != "none")
        out["advantages"] = advantages.to(device)
        mask = out["completion_mask"] * out["tool_mask"]
        out["num_items_in_batch"] = self.accelerator.gather(mask.sum()).sum()
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        attn = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        C = out["completion_ids"].size(1)
        # as in TRL: when generation is not aligned with optimizer steps, the samples may come
        # from an older model, so their log-probs are kept (else the loss takes the current ones)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self.args.gradient_accumulation_steps % generate_every:
            logps = self._get_per_token_logps_and_entropies(self.model, ids, attn, C)[0]
            out["old_per_token_logps"] = logps
        if self.beta != 0.0:
            ref = self.ref_model if self.ref_model is not None else self.model
            logps = self._get_per_token_logps_and_entropies(ref, ids, attn, C)[0]
            out["ref_per_token_logps"] = logps
        m = self._metrics[mode]
        m["reward"].append(rewards.mean().item())
        m["rti/success_before"].append(success_before)
        m["frac_reward_zero_std"].append((rewards.view(-1, G).std(-1) == 0).float().mean().item())
        m["completions/mean_length"].append(out["tool_mask"].sum(-1).float().mean().item())
        m["time/rollout"].append(t1 - t0)
        m["time/intervene"].append(t2 - t1)
        return out

    def collate(self, sampler, trajs, device) -> dict:
        """TRL's batch layout: prompt left-padded, completion right-padded; tool_mask = our
        loss_mask (agent tokens), rti_source / rti_behavior_logps per completion token (0 on
        padding)."""
        pad = self._tokenizer.pad_token_id
        cut = [len(sampler.chat.prompt_ids(t.observations[0])) for t in trajs]
        assert all(
            t.ids[:c] == sampler.chat.prompt_ids(t.observations[0]) for t, c in zip(trajs, cut)
        )
        P = max(cut)
        C = max(len(t.ids) - c for t, c in zip(trajs, cut))
        out = {
            "prompt_ids": torch.full((len(trajs), P), pad, dtype=torch.long),
            "prompt_mask": torch.zeros(len(trajs), P, dtype=torch.long),
            "completion_ids": torch.full((len(trajs), C), pad, dtype=torch.long),
            "completion_mask": torch.zeros(len(trajs), C, dtype=torch.long),
            "tool_mask": torch.zeros(len(trajs), C, dtype=torch.long),
            "rti_source": torch.full((len(trajs), C), POLICY, dtype=torch.long),
            "rti_behavior_logps": torch.zeros(len(trajs), C),
        }
        for i, (t, c) in enumerate(zip(trajs, cut)):
            n = len(t.ids) - c
            out["prompt_ids"][i, P - c :] = torch.tensor(t.ids[:c])
            out["prompt_mask"][i, P - c :] = 1
            out["completion_ids"][i, :n] = torch.tensor(t.ids[c:])
            out["completion_mask"][i, :n] = 1
            out["tool_mask"][i, :n] = torch.tensor(t.loss_mask[c:])
            out["rti_source"][i, :n] = torch.tensor(t.source[c:])
            out["rti_behavior_logps"][i, :n] = torch.tensor(t.sample_logp[c:])
        return {k: v.to(device) for k, v in out.items()}

    def _compute_loss(self, model, inputs):
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        C = inputs["completion_ids"].size(1)
        logp = self._get_per_token_logps_and_entropies(model, ids, attn, C)[0]
        mask = inputs["completion_mask"] * inputs["tool_mask"]
        old = inputs.get("old_per_token_logps")
        loss_inputs = dict(
            logp=logp,
            old_logp=logp.detach() if old is None else old,
            advantages=inputs["advantages"],
            loss_mask=mask,
            source=inputs["rti_source"],
            behavior_logp=inputs["rti_behavior_logps"],
            ref_logp=inputs.get("ref_per_token_logps"),
            config=self.rti_loss_config,
        )
        loss = policy_loss(**loss_inputs)
        metrics = loss_metrics(**loss_inputs)
        mode = "train" if self.model.training else "eval"
        accum = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if self.loss_type == "dapo":  # TRL: token sum / tokens of the whole accumulated batch
            norm = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                norm = norm * accum / self.args.steps_per_generation
            loss = loss * mask.sum().clamp(min=1.0) / norm
        else:  # grpo, bnpo, dr_grpo: a per-micro-batch mean, divided by the accumulation
            loss = loss / accum
        for k, v in metrics.items():
            self._metrics[mode][f"rti/{k}"].append(v)
        if self.rti_config is not None and mode == "train":  # the report's reweighting figures
            self.rti_stats.append(evaluate.reweighting_counts(metrics))
        return loss


# ----------------------------------------------------------------------------- command line


def trl_args(out: str, steps: int, tasks: int, group_size: int, **kw) -> GRPOConfig:
    """A small CPU GRPOConfig: one generation batch of `tasks` x `group_size` rows per optimizer
    step; `kw` overrides any of its fields."""
    base = dict(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=tasks * group_size,
        num_generations=group_size,
        learning_rate=1e-4,
        temperature=1.0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        bf16=False,
    )
    return GRPOConfig(**{**base, **kw})


# the log rows' figures the command prints, step by step
PRINTED = (
    "step",
    "loss",
    "reward",
    "rti/success_before",
    "rti/intervened_frac",
    "frac_reward_zero_std",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m extras.trl_rti",
        description="RTI inside TRL 1.16 on toy Navigation (tiny warm-start model).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "command",
        choices=("train", "stock"),
        help="train: RTIGRPOTrainer; stock: GRPOTrainer + NavigationToolEnv",
    )
    p.add_argument("--steps", type=int, default=10, help="optimizer steps")
    p.add_argument(
        "--tasks", type=int, default=4, help="tasks per step (each sampled --group-size times)"
    )
    p.add_argument("--group-size", type=int, default=8, help="G: episodes sampled per task")
    p.add_argument("--model", default=WARMSTART, help="the model directory to train")
    p.add_argument(
        "--split",
        default="train",
        choices=tuple(envs.SPLITS),
        help="Navigation split the tasks come from, in order",
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--out", default="runs/trl_rti", help="TRL's output directory")
    p.add_argument(
        "--no-rti", action="store_true", help="train: plain GRPO on our rollout (no intervention)"
    )
    return p


def main(argv=None) -> None:
    a = build_parser().parse_args(argv)
    torch.set_num_threads(a.threads)
    model, tok = load_model(a.model)
    data = navigation_dataset(envs.make_tasks(a.split)[: a.tasks * a.steps])
    t0 = time.time()
    if a.command == "train":
        trainer = RTIGRPOTrainer(
            model=model,
            processing_class=tok,
            train_dataset=data,
            args=trl_args(a.out, a.steps, a.tasks, a.group_size),
            rti_config=None if a.no_rti else RTIConfig(),
        )
    else:
        args = trl_args(
            a.out,
            a.steps,
            a.tasks,
            a.group_size,
            max_completion_length=1024,
            generation_kwargs={"max_new_tokens": 4},
        )
        trainer = GRPOTrainer(
            model=model,
            processing_class=tool_tokenizer(tok),
            train_dataset=data,
            environment_factory=NavigationToolEnv,
            args=args,
        )
    trainer.train()
    for row in trainer.state.log_history:
        print(
            {
                k: round(row[k], 4) if isinstance(row[k], float) else row[k]
                for k in PRINTED
                if k in row
            }
        )
    if a.command == "train" and trainer.rti_stats:
        print("interventions over the run:")
        print(evaluate.intervention_report(evaluate.run_totals(trainer.rti_stats)))
    print(
        f"wall time {time.time() - t0:.1f} s for {a.steps} steps of {a.tasks} tasks "
        f"x {a.group_size}"
    )


if __name__ == "__main__":
    main()
