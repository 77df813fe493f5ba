"""The users the tau2 agents talk to (airline, retail): a local chat model, or a script; optional.

tau2-bench plays the user with an LLM simulator behind an API; here the user runs offline, in
this process. extras/tau2.py's Tau2Env asks its user for the conversation's opening
(`opening(task)`) and for a reply to every agent message (`reply(task, messages)`), with `task`
an extras.tau2.Tau2Task and `messages` the conversation so far as tau2 Message objects. A reply
that contains USER_STOP ends the conversation.
"""

from __future__ import annotations

import re

import torch

GREETING = "Hi! How can I help you today?"  # tau2's agent opens every conversation with a user so
USER_STOP = "###STOP###"  # a user reply containing it ends the conversation (tau2's user simulator)


class ModelUser:
    """tau2's user simulator played in-process by a local chat model: it gets the task's user
    scenario (which the agent never sees) and short rules for a simulated user (ours, not tau2's
    user-simulator prompt), and decodes greedily, so that replaying an episode (intervene.py) gets
    the same replies. Roles are flipped: the agent's messages are its user turns."""

    RULES = (
        "You are playing a customer who contacts a customer service agent. Follow the scenario "
        "below. Write only the customer's next message, short and natural. Do not make up "
        "information the scenario does not give; reveal information only when the agent asks for "
        "it. When the task is done, or the agent transfers you to a human, or you want to end the "
        f"conversation, reply with {USER_STOP}.\n<scenario>\n{{scenario}}\n</scenario>"
    )

    def __init__(self, model, tok, max_new: int = 256):
        self.model = model
        self.tok = tok
        self.max_new = max_new

    @torch.no_grad()
    def say(self, task, turns: list[dict]) -> str:
        """The user's next message after `turns` (chat messages, roles already flipped)."""
        system = {"role": "system", "content": self.RULES.format(scenario=task.task.user_scenario)}
        text = self.tok.apply_chat_template(
            [system] + turns, tokenize=False, add_generation_prompt=True, enable_thinking=False
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
        reply = self.tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        reply = reply.split("</think>")[-1].strip()
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


class ScriptedUser:
    """The lower-fidelity fallback for tau2's LLM user simulator, deterministic and offline.

    It opens with the scenario's known info and the request in the first person: the first
    paragraph of the reason for the call without its "If ..." sentences (never the later
    paragraphs, the task instructions or the unknown info: they script the user's behaviour),
    answers every agent message with `reply`, which confirms what the agent proposes, and ends the
    conversation after `max_replies` replies. It cannot answer questions, refuse, or follow the
    scenario's conditions: use an LLM user (rti.py --user-model) for scores comparable with
    tau2-bench."""

    def __init__(self, reply: str = "Yes, please go ahead.", max_replies: int = 10):
        self.reply_text = reply
        self.max_replies = max_replies

    def opening(self, task) -> str:
        ins = task.task.user_scenario.instructions
        if isinstance(ins, str):
            return first_person(ins.strip().split("\n\n")[0])
        sentences = re.split(r"(?<=[.!?])\s+", ins.reason_for_call.strip().split("\n\n")[0])
        request = " ".join(x for x in sentences if not x.lower().startswith("if "))
        return " ".join(first_person(x.strip()) for x in (ins.known_info, request) if x)

    def reply(self, task, messages: list) -> str:
        said = sum(getattr(m, "role", "") == "user" for m in messages)
        return USER_STOP if said > self.max_replies else self.reply_text


def first_person(text: str) -> str:
    """The scenario's second person as the user's first person (for the scripted user): 'you' is
    'I' as a subject (at a sentence start or after a conjunction) and 'me' otherwise.

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
