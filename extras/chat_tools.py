"""Chat templates that take tools (Qwen3, Hermes): actions as tool calls, observations as tool
messages; optional (extras/).

`ToolChat` replaces policy.Chat when the tokenizer's chat template takes tools (extras/scale.py picks
it for a real model): the env's actions are passed as tools with its system prompt (tau2:
instructions and the domain policy), as the env's tool adapter gives them (`NavigationTools`
here; an env class with `tools()`, like extras/tau2.py's, is its own adapter), an observation
comes back as a tool message (a tau2 user's reply as a user message), and a turn's action is its
parsed tool call: `<tool_call>{"name": "move", "arguments": {"direction": "up"}}</tool_call>` is
the action `move up`. A turn with no call, a truncated or malformed call, an unknown tool or
argument, or two calls is an `invalid tool call: ...` action, which the env answers with an error
observation. `thinking` is passed to the template as enable_thinking (Qwen3's switch).

`NavigationTools` is the one description of Navigation's tools: extras/trl_rti.py's TRL
environment takes its tools' docstrings from it.
"""

from __future__ import annotations

import json
import re

from envs import ACTIONS, MOVES, env_class
from rti import Chat


class NavigationTools:
    """Navigation's actions as three tools: move(direction: up|down|left|right), route() and
    finish()."""

    messages_allowed = False  # every turn must be a call (tau2 airline / retail agents may talk)

    @staticmethod
    def system_prompt() -> str:
        return ""

    @staticmethod
    def tools() -> list[dict]:
        """ACTIONS as OpenAI-style function tools, for `tokenizer.apply_chat_template(...,
        tools=...)`."""

        def tool(name, description, properties):
            return {
                "type": "function",
                "function": {
                    "name": name,
                    "description": description,
                    "parameters": {
                        "type": "object",
                        "properties": properties,
                        "required": sorted(properties),
                    },
                },
            }

        directions = [a.split()[1] for a in MOVES]
        direction = {"type": "string", "enum": directions, "description": "up decreases the row"}
        return [
            tool("move", "Move one cell on the grid.", {"direction": direction}),
            tool(
                "route",
                "Show a shortest path to the next target; it stays in view while you follow it.",
                {},
            ),
            tool("finish", "End the episode; call it on the last waypoint.", {}),
        ]

    @staticmethod
    def docstring(name: str) -> str:
        """Tool `name` as the Google-style docstring of a Python function, from which transformers'
        get_json_schema (and so TRL's `environment_factory`) reads the description and parameters
        that tools() gives."""
        function = next(
            t["function"] for t in NavigationTools.tools() if t["function"]["name"] == name
        )
        lines = [function["description"]]
        properties = function["parameters"]["properties"]
        if properties:
            lines += ["", "Args:"]
            for arg, schema in properties.items():
                choices = f" (choices: {json.dumps(schema['enum'])})" if "enum" in schema else ""
                lines.append(f"    {arg}: {schema['description']}{choices}")
        lines += ["", "Returns:", "    The observation that follows the action."]
        return "\n".join(lines)

    @staticmethod
    def action_from_call(name, arguments) -> str | None:
        """The action a tool call performs, or None when it names no action.

        >>> calls = (("move", {"direction": "up"}), ("route", {}), ("finish", {}))
        >>> [NavigationTools.action_from_call(*c) for c in calls]
        ['move up', 'route', 'finish']
        >>> NavigationTools.action_from_call("move", {"direction": "north"}) is None
        True
        """
        if not isinstance(arguments, dict):
            return None
        if name in ("route", "finish") and not arguments:
            return name
        action = f"move {arguments.get('direction')}"
        if name == "move" and set(arguments) == {"direction"} and action in MOVES:
            return action
        return None

    @staticmethod
    def call_from_action(action: str) -> dict:
        """Inverse of action_from_call for the actions in ACTIONS: 'move up' -> {'name': 'move',
        'arguments': {'direction': 'up'}}."""
        if action not in ACTIONS:
            raise ValueError(f"{action!r} is not one of {ACTIONS}")
        name, *arg = action.split()
        return {"name": name, "arguments": {"direction": arg[0]} if arg else {}}


# env name -> its tools; other envs' classes are their own adapter
TOOL_ADAPTERS = {"navigation": NavigationTools}


def tool_adapter(env: str):
    return TOOL_ADAPTERS.get(env) or env_class(env)


class ToolChat(Chat):
    """policy.Chat for a template that takes tools; the token bookkeeping (token-in, token-out) is
    the same."""

    def __init__(self, tok, env: str = "navigation", thinking: bool = False):
        # render() needs these two before Chat's constructor renders
        self.adapter = tool_adapter(env)
        self.thinking = thinking
        self.tools = self.adapter.tools()
        super().__init__(tok, env)
        self.turn_pre, self.turn_post = self.after_turn("tool")
        self.user_turn = self.after_turn("user")  # a user's reply (tau2 airline, retail)

    def render(self, messages: list[dict]) -> str:
        system = self.adapter.system_prompt()
        head = [{"role": "system", "content": system}] if system else []
        return self.tok.apply_chat_template(
            head + messages,
            tokenize=False,
            add_generation_prompt=True,
            tools=self.tools,
            enable_thinking=self.thinking,
        )

    def turn_ids(self, content: str, role: str | None = None) -> list[int]:
        """The next observation as a tool message (role "user": a user's message) and the
        assistant header."""
        pre, post = self.user_turn if role == "user" else (self.turn_pre, self.turn_post)
        return self.ids(pre + content + post)

    def action_text(self, agent_ids: list[int]) -> str:
        """The env action of the turn's tool call (parse_tool_call)."""
        return parse_tool_call(self.text(agent_ids), self.adapter)

    def action_ids(self, action: str) -> list[int]:
        """Ids of a turn (without eos) that performs `action`: its tool call."""
        return self.ids(format_tool_call(action, self.adapter))


def takes_tools(tok) -> bool:
    """Whether the tokenizer's chat template renders tools."""
    return "tools" in (tok.chat_template or "")


TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def format_tool_call(action: str, env_cls=NavigationTools) -> str:
    """An action as the turn that performs it: its tool call as Qwen3 writes it,
    'move up' -> '<tool_call>\\n{"name": "move", "arguments": {"direction": "up"}}\\n</tool_call>',
    and an action that is no call (a message to a tau2 user) as it is."""
    call = env_cls.call_from_action(action)
    return action if call is None else f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def parse_tool_call(text: str, env_cls=NavigationTools) -> str:
    """The env action of an agent turn written as a Qwen3 / Hermes tool call, `<tool_call>{"name":
    ..., "arguments": {...}}</tool_call>`.

    Exactly one complete call of a known tool with valid arguments gives its action ('move up');
    anything else (no call, a truncated one, bad JSON, an unknown tool or argument, two calls)
    gives 'invalid tool call: <why>', which the env answers with an error observation. Never
    raises. Text around the call, a think block included, is ignored; `arguments` may also be a
    JSON string (some models write it so). With an env whose agent may talk (`messages_allowed`:
    tau2 airline, retail), a turn without any tool call is a message: its text."""
    body = text.split("</think>")[-1]
    calls = TOOL_CALL.findall(body)
    if not calls and "<tool_call>" not in body and body.strip() and env_cls.messages_allowed:
        return body.strip()
    if len(calls) != 1:
        if calls:
            why = f"{len(calls)} calls in one turn"
        elif "<tool_call>" in body:
            why = "unterminated <tool_call>"
        else:
            why = "no <tool_call> block"
        return f"invalid tool call: {why}"
    try:
        call = json.loads(calls[0])
        args = call.get("arguments", {}) if isinstance(call, dict) else None
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        return "invalid tool call: malformed JSON"
    if args is None:
        return "invalid tool call: not a JSON object"
    action = env_cls.action_from_call(call.get("name"), args)
    return action or f"invalid tool call: unknown tool or arguments {json.dumps(call)[:80]}"
