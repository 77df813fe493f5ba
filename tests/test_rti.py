"""rti.py: token bookkeeping, KV-cached batched decoding, warm start, training steps, resume, flags, smoke run."""

import copy
import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import envs
import intervene
import rti
import runtime
from extras import warmstart
from loss import POLICY, loss_metrics, policy_loss
from policy import (
    SDPA_SHARED_KV,
    Chat,
    DecodeSession,
    KVBuffer,
    Qwen3Config,
    Qwen3ForCausalLM,
    Sampler,
    build_tiny_tokenizer,
    load_model,
    pad_rows,
    token_logprobs,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    model, tok = load_model("tiny", seed=0)
    return model, tok


def make_policy(tiny, seed=0, **kw):
    model, tok = tiny
    return Sampler(model, tok, seed=seed, **kw)


def easy_tasks(n):
    return envs.make_tasks("easy")[:n]


def test_agent_tokens_and_only_agent_tokens_are_trained(tiny):
    policy = make_policy(tiny)
    chat = policy.chat
    for t in rti.rollout(policy, easy_tasks(3), 2):
        # rebuild the sequence from the environment alone: prompt, then per turn agent ids and observation ids
        env = envs.Navigation(t.task)
        expected_ids = chat.prompt_ids(env.reset())
        expected_mask = [0] * len(expected_ids)
        for k, (start, end) in enumerate(t.turns):
            agent = t.ids[start:end]
            trained = [m for m in t.loss_mask[start:end]]
            closed = agent[-1] == chat.eos_id
            assert closed, "every turn ends with eos"
            if trained[-1] == 0:  # turn cut at max_turn_tokens: eos appended, not trained
                assert len(agent) == policy.max_turn_tokens + 1 and chat.eos_id not in agent[:-1]
            expected_ids += agent
            expected_mask += [1] * (len(agent) - (trained[-1] == 0)) + [0] * (trained[-1] == 0)
            obs, done = env.step(t.actions[k])
            assert t.actions[k] == chat.action_text(agent)
            if not done:
                expected_ids += chat.turn_ids(obs)
                expected_mask += [0] * len(chat.turn_ids(obs))
        assert env.done
        assert t.ids == expected_ids
        assert t.loss_mask == expected_mask
        assert set(t.source) == {POLICY}
        assert t.reward == float(env.score().success)


def test_decoded_sequence_is_the_rendered_conversation(tiny):
    policy = make_policy(tiny, seed=1)
    tok = policy.tok
    for t in rti.rollout(policy, easy_tasks(2), 2):
        messages = []
        for k, (start, end) in enumerate(t.turns):
            messages.append({"role": "user", "content": t.observations[k]})
            agent = t.ids[start : end - 1]  # without the closing eos
            messages.append({"role": "assistant", "content": tok.decode(agent)})
        rendered = tok.apply_chat_template(messages, tokenize=False)
        # an empty agent turn renders as "<|assistant|>  <|im_end|>": equal up to runs of spaces, and equal ids
        assert " ".join(tok.decode(t.ids).split()) == " ".join(rendered.split())
        assert tok(rendered, add_special_tokens=False).input_ids == t.ids


def test_session_with_holes_matches_each_sequence_alone(tiny):
    model, tok = tiny
    rng = random.Random(0)
    seqs = [[rng.randrange(4, len(tok)) for _ in range(n)] for n in (5, 9, 3)]
    extra = [[rng.randrange(4, len(tok)) for _ in range(n)] for n in (2, 0, 6)]
    s = DecodeSession(model, seqs, tok.pad_token_id)
    s.feed([0, 2], [extra[0], extra[2]])
    for i in range(3):
        full = torch.tensor([seqs[i] + extra[i]])
        with torch.no_grad():
            ref = model(input_ids=full).logits[0, -1]
        assert torch.allclose(s.last_logits[i], ref, atol=1e-4)


def test_sessions_compute_transformers_sdpa_bit_for_bit(tiny):
    """load_model gives a model SDPA_SHARED_KV: a fed chunk reads the KV heads in place (SDPA's
    enable_gqa) where transformers' SDPA copies each once per query head, and the first chunks,
    left-aligned in an empty cache, run without a mask. The logits are plain SDPA's with the
    padding mask, bit for bit, so sampling is unchanged."""
    model, tok = tiny
    assert model.config._attn_implementation == SDPA_SHARED_KV
    plain = copy.deepcopy(model)
    plain.set_attn_implementation("sdpa")
    rng = random.Random(0)
    seqs = [[rng.randrange(6, len(tok)) for _ in range(n)] for n in (5, 40, 3)]
    extra = [[rng.randrange(6, len(tok)) for _ in range(n)] for n in (12, 0, 6)]
    ours, theirs = (DecodeSession(m, seqs, tok.pad_token_id) for m in (model, plain))
    ids = pad_rows(seqs, tok.pad_token_id, torch.long, "cpu")
    mask = (pad_rows(seqs, -1, torch.long, "cpu") >= 0).long()
    with torch.no_grad():
        masked = plain(input_ids=ids, attention_mask=mask).logits
    last = [len(s) - 1 for s in seqs]
    assert torch.equal(ours.last_logits, masked[range(3), last])
    for chunks in ([extra[0], [], extra[2]], [[7], [8], [9]]):  # a chunk with holes, a decode
        for s in (ours, theirs):
            s.feed([0, 1, 2], chunks)
        assert torch.equal(ours.last_logits, theirs.last_logits)


def test_keep_packs_out_holes(tiny):
    """Rows fed in turn leave holes where the other row was fed; keep() packs each row's real tokens to the left, so
    the cache is as wide as the longest row, and both rows still compute exactly what they would alone."""
    model, tok = tiny
    seqs, extra = [[5, 6, 7], [8, 9, 10]], [[11, 12, 13], [14, 15]]
    s = DecodeSession(model, seqs, tok.pad_token_id)
    s.feed([0], [extra[0]])
    s.feed([1], [extra[1]])
    assert s.mask.shape == (2, 8)
    s.keep([0, 1])
    assert s.mask.tolist() == [[1] * 6, [1] * 5 + [0]] and s.real_slots == [
        list(range(6)),
        list(range(5)),
    ]
    assert all(layer.keys.shape[2] == 6 for layer in s.cache.layers)
    s.feed([0, 1], [[16], [17, 18]])
    for row in (0, 1):
        with torch.no_grad():
            ref = model(
                input_ids=torch.tensor([seqs[row] + extra[row] + [[16], [17, 18]][row]])
            ).logits[0, -1]
        assert torch.allclose(s.last_logits[row], ref, atol=1e-4)


def test_keep_on_a_sliding_window_model_drops_rows_only():
    """A sliding-window layer keeps only its last columns, so keep() must not gather columns there: it drops rows."""
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=40,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=0,
        )
    ).eval()
    s = DecodeSession(model, [[5, 6, 7, 8, 9, 10], [11, 12]], 0)
    s.feed([1], [[13, 14, 15]])
    keys, logits = [layer.keys[1:].clone() for layer in s.cache.layers], s.last_logits[1].clone()
    width = s.mask.shape[1]
    s.keep([1])
    assert all(torch.equal(layer.keys, k) for layer, k in zip(s.cache.layers, keys)) and all(
        s.cache.is_sliding
    )
    assert s.mask.shape == (1, width) and torch.equal(s.last_logits[0], logits)
    s.feed([0], [[16]])  # decoding goes on


def test_keep_drops_rows_and_their_hole_columns(tiny):
    """After keep(), the kept rows compute exactly what they would alone, and columns only dropped rows used are gone."""
    model, tok = tiny
    rng = random.Random(1)
    seqs = [[rng.randrange(4, len(tok)) for _ in range(n)] for n in (4, 11, 6)]
    s = DecodeSession(model, seqs, tok.pad_token_id, seeds=[10, 11, 12])
    s.feed([0, 1, 2], [[7], [8, 9, 10, 11, 12], [13]])
    assert s.mask.shape == (3, 16)  # 11 prefix columns + 5 for the second feed
    s.keep([2, 0])  # row 1, the longest, leaves; row 2 becomes row 0
    assert s.mask.shape == (2, 7) and s.n == 2  # row 2's 6 + 1 columns; row 0's lie among them
    assert [len(r) for r in s.real_slots] == [7, 5]
    s.feed([0, 1], [[14, 15], [16]])
    for row, full in ((0, seqs[2] + [13, 14, 15]), (1, seqs[0] + [7, 16])):
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([full])).logits[0, -1]
        assert torch.allclose(s.last_logits[row], ref, atol=1e-4)
    assert torch.equal(s.length, torch.tensor([9, 6]))
    # the sampling streams moved with their rows
    g = torch.Generator().manual_seed(12)
    assert torch.equal(torch.rand(3, generator=s.gens[0]), torch.rand(3, generator=g))


def test_retract_restores_the_state_before_a_turn(tiny):
    model, tok = tiny
    policy = make_policy(tiny, seed=3)
    prefix = [[5, 6, 7, 8], [9, 10]]
    s = policy.session(prefix)
    before = s.last_logits.clone()
    ids, _ = policy.sample_turn(s, [0, 1])
    s.retract(0, len(ids[0]))
    assert torch.allclose(s.last_logits[0], before[0])
    s.feed([0], [[11, 12]])
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([prefix[0] + [11, 12]])).logits[0, -1]
    assert torch.allclose(s.last_logits[0], ref, atol=1e-4)


def test_a_turns_last_token_goes_in_with_the_next_chunk(tiny):
    """sample_turn leaves each turn's last token pending; the next feed takes it in with the
    observation, one forward pass for both, and the logits are those of the whole sequence."""
    model, _ = tiny
    policy = make_policy(tiny, seed=4)
    prefix = [5, 6, 7, 8]
    s = policy.session([prefix])
    forwards = []
    hook = model.register_forward_hook(lambda *args: forwards.append(1))
    ids, _ = policy.sample_turn(s, [0])
    assert s.pending == [[ids[0][-1]]] and int(s.length[0]) == len(prefix) + len(ids[0]) - 1
    assert len(forwards) == len(ids[0]) - 1  # every sampled token but the last was fed
    s.feed([0], [[11, 12]])
    hook.remove()
    assert len(forwards) == len(ids[0]) and s.pending == [[]]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([prefix + ids[0] + [11, 12]])).logits[0, -1]
    assert torch.allclose(s.last_logits[0], ref, atol=1e-4)


def test_the_kv_buffer_grows_in_place_and_keeps_what_it_held(tiny):
    """KVBuffer writes each fed token into a preallocated buffer that doubles when full; past the
    first growth the logits are still those of the whole sequence."""
    model, _ = tiny
    rng = random.Random(2)
    seq = [rng.randrange(4, 30) for _ in range(30)]
    s = DecodeSession(model, [seq], 0)
    layer = s.cache.layers[0]
    assert isinstance(layer, KVBuffer) and layer.key_buffer.shape[2] == 64
    for _ in range(40):
        token = rng.randrange(4, 30)
        seq.append(token)
        s.feed([0], [[token]])
    assert layer.keys.shape[2] == 70 and layer.key_buffer.shape[2] >= 70
    assert layer.keys.data_ptr() == layer.key_buffer.data_ptr()  # a view, not a copy
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([seq])).logits[0, -1]
    assert torch.allclose(s.last_logits[0], ref, atol=1e-4)


def test_sampling_logprobs_equal_rescoring(tiny):
    """The KV-cached sampler's log-probs are the full-sequence log-probs at the same temperature."""
    policy = make_policy(tiny, seed=2, temperature=0.7)
    trajs = rti.rollout(policy, easy_tasks(2), 3)
    scored = policy.score([t.ids for t in trajs])
    for t, lp in zip(trajs, scored):
        for i, m in enumerate(t.loss_mask):
            if m:
                assert abs(t.sample_logp[i] - lp[i]) < 1e-3


def test_padding_changes_no_real_tokens_logprob(tiny):
    """token_logprobs runs without an attention mask: scoring rows of unequal length together, whatever the pad id
    (here one of the rows' own tokens), gives each row's log-probs alone."""
    model, _ = tiny
    seqs = [[5, 9, 7, 11, 6, 8, 12], [5, 9, 8], [5, 10, 7, 7, 9]]
    alone = [token_logprobs(model, [s], 0, 0.7, "cpu")[0] for s in seqs]
    for pad_id in (0, 7):
        together = token_logprobs(model, seqs, pad_id, 0.7, "cpu")
        for row, s, lp in zip(together, seqs, alone):
            assert torch.allclose(row[: len(s)], lp, atol=1e-5)


def test_same_seed_same_trajectories(tiny):
    a = rti.rollout(make_policy(tiny, seed=5), easy_tasks(2), 2)
    b = rti.rollout(make_policy(tiny, seed=5), easy_tasks(2), 2)
    assert [t.ids for t in a] == [t.ids for t in b]


def test_batched_equals_one_at_a_time(tiny):
    """Lockstep batching changes nothing about what one episode samples: each episode has its own stream."""
    policy = make_policy(tiny, seed=0, temperature=1.0)
    tasks = easy_tasks(3)
    batched = rti.rollout(policy, tasks, 2, seed=7)
    single = [t for task in tasks for t in rti.rollout(policy, [task], 2, seed=7)]
    assert [t.ids for t in batched] == [t.ids for t in single]
    other = rti.rollout(policy, tasks, 2, seed=8)
    assert [t.ids for t in other] != [t.ids for t in batched]


def test_teacher_shown_evidence_copies_the_path_or_calls_the_tool(tiny):
    """With every hint block showing evidence, the teacher copies the path's first move where it
    holds no route (copy_frac 1) or calls the tool (copy_frac 0); its episodes still succeed."""
    chat = Chat(tiny[1])
    for task in easy_tasks(4):
        for copy_frac, first in ((1.0, "move"), (0.0, "route")):
            ids, _ = warmstart.teacher_sequence(
                chat, task, random.Random(0), 1.0, 1.0, 0.0, evidence_frac=1.0, copy_frac=copy_frac
            )
            text = chat.tok.decode(ids)
            assert " path " in text and " do route " not in text
            actions = teacher_actions_of(chat, ids)
            assert actions[0].split()[0] == first
            assert envs.run_actions(task, actions).score().success


def teacher_actions_of(chat, ids: list[int]) -> list[str]:
    turns = chat.tok.decode(ids).split("<|assistant|>")[1:]
    return [" ".join(turn.split("<|im_end|>")[0].split()) for turn in turns]


def test_the_demo_warm_start_is_what_extras_warmstart_builds_by_default():
    """rti.py's default --init is the committed warm start that `python -m extras.warmstart`
    rebuilds with its defaults: a default changed without a rebuild fails here."""
    recorded = json.loads((Path(rti.WARMSTART_DIR) / "warmstart.json").read_text())["config"]
    defaults = dataclasses.asdict(warmstart.WarmStartConfig())
    flags = {k: v for k, v in defaults.items() if k.startswith("ws_")}
    assert {k: recorded[k] for k in flags} == flags
    assert rti.Config().init == rti.WARMSTART_DIR == flags["ws_out"]


def test_in_the_demo_regime_the_corrector_leaks_and_the_post_check_rejects_it():
    """From the demo's warm start with the default RTIConfig, the corrector is shown the grader's
    evidence and copies a hidden direction in some rewrites: the rubric verifier accepts none of
    them (and rejects attempts), while without a post-check (--verifier none) they are accepted."""
    model, tok = load_model(rti.WARMSTART_DIR)
    policy = Sampler(model, tok, seed=0)
    trajs = rti.rollout(policy, envs.make_tasks("train")[:4], 8, seed=0)
    assert intervene.RTIConfig().corrector_sees == "evidence"
    stats = {
        verifier: intervene.intervene_batch(
            policy, trajs, intervene.RTIConfig(verifier=verifier), policy.make_env
        )[1]
        for verifier in ("rubric", "none")
    }
    assert stats["rubric"]["rewrites_leaked"] > 0 and stats["rubric"]["attempts_rejected"] > 0
    assert stats["rubric"].get("accepted_leaked", 0) == 0
    assert stats["none"]["accepted_leaked"] > 0


@pytest.mark.slow
def test_warm_start_lowers_its_loss(tmp_path):
    cfg = runtime.make_config(
        warmstart.WarmStartConfig,
        ws_steps=40,
        ws_batch=8,
        ws_out=str(tmp_path / "ws"),
        progress=False,
    )
    _, _, losses = warmstart.warmstart(cfg, log=lambda *a: None)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert (tmp_path / "ws" / "config.json").exists()


def test_teacher_sequence_hint_tokens_are_not_trained(tiny):
    chat = Chat(tiny[1])
    task = easy_tasks(1)[0]
    ids, w = warmstart.teacher_sequence(
        chat, task, random.Random(0), hint_frac=1.0, obs_weight=0.5, route_frac=0.0
    )
    text = chat.tok.convert_ids_to_tokens(ids)
    inside = False
    for tok, wt in zip(text, w):
        if tok == "<hint>":
            inside = True
        if inside:
            assert wt == 0.0
        if tok == "</hint>":
            inside = False
    assert text.count("<hint>") == len(
        envs.optimal_actions(task)
    )  # and it does what each hint says
    assert 1.0 in w and 0.5 in w


def teacher_actions(chat, task, route_frac: float) -> list[str]:
    """The actions of the warm-start teacher's episode of `task` (no hints)."""
    ids, _ = warmstart.teacher_sequence(chat, task, random.Random(0), 0.0, 1.0, route_frac)
    return teacher_actions_of(chat, ids)


def test_teacher_routes_the_share_of_legs_it_is_told_and_always_succeeds(tiny):
    chat = Chat(tiny[1])
    for task in easy_tasks(8):
        oracle = teacher_actions(chat, task, route_frac=1.0)
        walker = teacher_actions(chat, task, route_frac=0.0)
        assert oracle == envs.optimal_actions(task)  # every leg: route, then follow it
        # shortest moves only
        assert "route" not in walker and envs.run_actions(task, walker).score().success
        assert len(walker) == len(oracle) - len(task.waypoints)


def small_cfg(tmp_path, **kw):
    base = dict(
        init="",
        train_split="easy",
        batch_tasks=2,
        group_size=4,
        steps=1,
        eval_tasks=0,
        progress=False,
        out=str(tmp_path / "run"),
        lr=1e-3,
        save_every=1,
        mini_batches=1,
    )
    base.update(kw)
    return runtime.make_config(rti.Config, **base)


def params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_several_updates_score_pi_old_like_the_on_policy_forward(tiny, tmp_path):
    """With --updates-per-batch > 1, pi_old comes from a separate scoring pass; with the weights held still (lr 0)
    every update then sees ratio 1 and the loss of the single on-policy update, which takes pi_old from its own
    forward pass. Uneven micro-batches (3 rows) check that the scored log-probs line up with their rows."""
    policy = make_policy(tiny, seed=1)
    trajs = rti.rollout(policy, easy_tasks(2), 4)
    adv = torch.linspace(-1.0, 1.0, len(trajs))
    out = {}
    for n in (1, 2):
        cfg = small_cfg(tmp_path, updates_per_batch=n, micro_batch=3)
        out[n] = rti.update(
            policy, torch.optim.SGD(policy.model.parameters(), lr=0.0), trajs, adv, cfg
        )
    assert out[1]["loss"] != 0.0
    assert out[2]["loss"] == pytest.approx(out[1]["loss"], abs=1e-6)
    assert out[2]["ratio_min"] == pytest.approx(1.0, abs=1e-4) and out[2][
        "ratio_max"
    ] == pytest.approx(1.0, abs=1e-4)


def test_one_training_step_changes_the_parameters(tmp_path):
    # an untrained model never succeeds; rule corrections on every step make some trajectories succeed
    cfg = small_cfg(
        tmp_path,
        method="rti",
        corrector="rule",
        max_corrections=100,
        ppl_gate=False,
        batch_tasks=2,
        group_size=4,
        intervene_per_group=2,
    )
    policy = rti.init_policy(cfg, rti.Backend())
    before = params(policy.model).clone()
    opt = torch.optim.AdamW(policy.model.parameters(), lr=cfg.lr)
    m = rti.train_step(policy, opt, envs.make_tasks("easy")[:2], cfg)
    assert m["train_success"] == 0.0 and m["train_success_after_rti"] > 0
    assert m["groups_all_failed"] == 1.0  # counted before the intervention
    assert m["rti/intervened"] == 4 and m["train_success_after_rti"] == 0.5
    assert m["trained_rows"] == 8
    assert not torch.equal(before, params(policy.model))
    # the reweighting's figures for the run's report: the update's counts over its micro-batches
    assert 0 < m["rti/intervened_tokens"] == m["tokens/intervened"] < m["rti/trained_tokens"]
    assert m["rti/intervened_weight_sum"] == pytest.approx(
        m["weight_mean"] * m["rti/intervened_tokens"]
    )


def read_metrics(path):
    return [json.loads(line) for line in open(path)]


def test_resume_gives_the_same_run(tmp_path):
    kw = dict(
        method="rti", steps=3, batch_tasks=2, group_size=2, train_split="easy", warmup_steps=3
    )
    straight = rti.train(small_cfg(tmp_path / "a", **kw), log=lambda *a: None)
    rti.train(small_cfg(tmp_path / "b", **{**kw, "steps": 2}), log=lambda *a: None)
    with open(
        tmp_path / "b" / "run" / "metrics.jsonl", "a"
    ) as f:  # a step logged after the last checkpoint
        f.write(json.dumps({"step": 3, "train_success": 0.5}) + "\n")
    resumed = rti.train(small_cfg(tmp_path / "b", **kw, resume=True), log=lambda *a: None)
    assert torch.allclose(
        params(straight["sampler"].model), params(resumed["sampler"].model), atol=1e-6
    )
    # totals count the steps before resume; NaN rates compare equal as text
    resumed_totals = json.dumps(resumed["interventions"], sort_keys=True)
    assert resumed_totals == json.dumps(straight["interventions"], sort_keys=True)
    ma = read_metrics(tmp_path / "a" / "run" / "metrics.jsonl")
    mb = read_metrics(tmp_path / "b" / "run" / "metrics.jsonl")
    assert [without_times(m) for m in ma] == [without_times(m) for m in mb]


def without_times(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith("time/")}


@pytest.mark.parametrize(
    "flags,name",
    [
        (["--group-size", "1"], "--group-size"),
        (["--clip-low", "1.5"], "--clip-low"),
        (["--model", "/no/such/dir"], "--model"),
        (["--method", "ppo"], "--method"),
        (["--temperature", "0"], "--temperature"),
        (["--agg", "mean"], "--agg"),
        (["--ppl-max", "1"], "--ppl-max"),
        (["--verifier", "oracle"], "--verifier"),
        (["--intervene-per-group", "9"], "--group-size"),
        (["--kl-coef", "0.1"], "--kl-coef: the KL penalty needs a reference model"),
        (["--model", "tests"], "--model: must be 'tiny' or a local Hugging Face model directory"),
        (["--init", "/no/such/dir"], "--init: holds no checkpoint (the warm start: python -m"),
        (["--out", "README.md/run"], "--out: cannot be a run folder here"),
        # an unknown flag is named, not the word after it (argparse would read it as the command)
        (["--no-such-flag", "2"], "unrecognized arguments: --no-such-flag"),
        (["--eval-ev", "4"], "unrecognized arguments: --eval-ev"),  # a prefix is not the flag
        (["--verbose=1"], "unrecognized arguments: --verbose=1"),
    ],
)
def test_bad_flags_stop_with_a_message_naming_the_flag(flags, name, capsys):
    with pytest.raises(SystemExit):
        runtime.parse_args(flags, rti.Config)
    assert name in capsys.readouterr().err


def test_a_newcomers_mistake_is_one_line_not_a_traceback(tmp_path):
    """`python rti.py --model DIR` on a folder without a model: one line naming the flag, exit 2."""
    out = subprocess.run(
        [sys.executable, "rti.py", "--model", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("rti.py: error: --model: must be 'tiny'")


def test_no_progress_silences_the_weight_loading_bar(capfd):
    cfg = runtime.make_config(rti.Config, progress=False)
    rti.init_policy(cfg, rti.Backend())
    assert "Loading weights" not in capfd.readouterr().err


def test_a_config_built_in_python_gets_the_command_lines_errors(tmp_path):
    """train() validates its config as the command line does: a bad value built with make_config
    stops before any work with the flag's message, not with an error deep in the loop."""
    with pytest.raises(ValueError, match="--save-every: must be >= 1"):
        rti.train(
            runtime.make_config(rti.Config, save_every=0, out=str(tmp_path)), log=runtime.silent
        )
    assert not any(tmp_path.iterdir())


def test_end_to_end_smoke(tmp_path, capsys):
    """A warm start of a few steps (python -m extras.warmstart), then `python rti.py` with RTI for two steps and a
    before/after evaluation, then `python rti.py eval` of the trained model."""
    ws = tmp_path / "ws"
    warmstart.main(["--ws-steps", "5", "--ws-batch", "4", "--ws-out", str(ws), "--no-progress"])
    rti.main(
        [
            "--init",
            str(ws),
            "--steps",
            "2",
            "--batch-tasks",
            "2",
            "--group-size",
            "2",
            "--eval-tasks",
            "3",
            "--eval-samples",
            "4",
            "--out",
            str(tmp_path / "run"),
            "--no-progress",
            "--train-split",
            "easy",
        ]
    )
    out = capsys.readouterr().out
    assert "warm start" in out and "p@1" in out
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 2]  # before, two steps, after
    assert "test/p@1" in rows[0] and "test/p@1" in rows[-1] and "interventions over the run" in out
    assert "rti/groups_triggered" in rows[1]
    assert (tmp_path / "run" / "model" / "config.json").exists()
    rti.main(["eval", str(tmp_path / "run" / "model"), "--eval-tasks", "2", "--no-progress"])
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| method | p@1 |") and table[2].startswith(
        f"| {tmp_path / 'run' / 'model'} |"
    )


def test_mini_batches_make_the_ratio_and_the_clip_act(tiny, tmp_path, monkeypatch):
    """--mini-batches 2: pi_old is scored once for the batch, the first step moves the policy, so the second
    mini-batch sees ratios != 1 (they are all exactly 1 in the first), some of them clipped, and a clipped token
    gets no gradient while the others do."""
    model, tok = tiny
    policy = Sampler(copy.deepcopy(model), tok, seed=4)
    trajs = rti.rollout(policy, easy_tasks(2), 4)
    adv = torch.tensor([1.0, -1.0] * 4)
    calls = []

    def recording_loss(logp, old_logp, advantages, loss_mask, **kw):
        calls.append(
            (logp.detach().clone(), old_logp.clone(), advantages.clone(), loss_mask.clone(), kw)
        )
        return policy_loss(logp, old_logp, advantages, loss_mask, **kw)

    monkeypatch.setattr(rti, "policy_loss", recording_loss)
    cfg = small_cfg(tmp_path, mini_batches=2, micro_batch=8)
    rti.update(
        policy, torch.optim.AdamW(policy.model.parameters(), lr=0.05), trajs, adv, cfg, seed=3
    )
    assert len(calls) == 2
    ratios = [torch.exp(lp - old)[m > 0] for lp, old, _, m, _ in calls]
    assert torch.allclose(
        ratios[0], torch.ones_like(ratios[0]), atol=1e-5
    )  # before any step: pi = pi_old
    assert (ratios[1] - 1).abs().max() > 0.3  # after one step: it acts
    lp, old, a, m, kw = calls[1]
    lp = lp.requires_grad_()
    policy_loss(lp, old, a, m, **kw).backward()
    metrics = loss_metrics(lp, old, a, m, **kw)
    rho, a_tok = torch.exp(lp.detach() - old), a[:, None].expand_as(lp)
    clipped = (m > 0) & (((a_tok > 0) & (rho > 1.28)) | ((a_tok < 0) & (rho < 0.8)))
    assert clipped.any() and metrics["clip_frac"] > 0
    assert (lp.grad[clipped] == 0).all() and (lp.grad[(m > 0) & ~clipped] != 0).all()


class ScriptedSampler:
    """A stand-in for the policy in sample_batch: it only counts the tokens 'generated'."""

    generated_tokens = 0


def scripted_rollout(rewards_by_round: list[list[list[float]]]):
    """A rollout whose r-th call returns groups with the given rewards (one task per group), so
    the test decides which rounds hold groups with a reward spread."""
    calls = iter(rewards_by_round)

    def fake_rollout(sampler, tasks, group_size, seed):
        trajs = []
        for group, rewards in enumerate(next(calls)):
            for reward in rewards:
                trajs.append(rti.Trajectory(task=tasks[group], group=group, reward=reward))
                sampler.generated_tokens += 5
        return trajs

    return fake_rollout


def test_dynamic_sampling_fills_the_batch_with_groups_that_have_a_spread(monkeypatch):
    spread, flat = [1.0, 0.0], [0.0, 0.0]
    rounds = [[flat, spread, flat], [flat, flat, flat], [spread, spread, spread]]
    monkeypatch.setattr(rti, "rollout", scripted_rollout(rounds))
    cfg = runtime.make_config(
        rti.Config, method="grpo", group_size=2, dynamic_sampling=True, max_sampling_rounds=4
    )
    draws = iter([["d", "e", "f"], ["g", "h", "i"]])
    trajs, metrics = rti.sample_batch(
        ScriptedSampler(), ["a", "b", "c"], cfg, 0, lambda: next(draws)
    )
    # round 1 gives one group with a spread, round 2 none, round 3 three: the batch takes 3
    assert metrics["sampling_rounds"] == 3 and metrics["batch_groups"] == 3
    assert [t.task for t in trajs] == ["b", "b", "g", "g", "h", "h"]
    assert [t.group for t in trajs] == [0, 0, 1, 1, 2, 2]  # groups of different rounds stay apart
    assert metrics["sampled_episodes"] == 18 and metrics["generated_tokens"] == 90
    # the groups in which every sampled episode failed: 2 + 3 + 0 of the 9 sampled
    assert metrics["groups_all_failed"] == 5 / 9


def test_dynamic_sampling_stops_at_its_cap_with_a_short_batch(monkeypatch):
    spread, flat = [1.0, 0.0], [0.0, 0.0]
    rounds = [[flat, flat], [spread, flat], [flat, flat]]
    monkeypatch.setattr(rti, "rollout", scripted_rollout(rounds))
    cfg = runtime.make_config(
        rti.Config, method="grpo", group_size=2, dynamic_sampling=True, max_sampling_rounds=2
    )
    trajs, metrics = rti.sample_batch(ScriptedSampler(), ["a", "b"], cfg, 0, lambda: ["c", "d"])
    assert metrics["sampling_rounds"] == 2 and metrics["sampled_episodes"] == 8
    assert metrics["batch_groups"] == 1 and [t.task for t in trajs] == ["c", "c"]


def test_without_dynamic_sampling_one_round_keeps_every_group(monkeypatch):
    flat = [0.0, 0.0]
    monkeypatch.setattr(rti, "rollout", scripted_rollout([[flat, flat]]))
    cfg = runtime.make_config(rti.Config, method="grpo", group_size=2)
    trajs, metrics = rti.sample_batch(ScriptedSampler(), ["a", "b"], cfg, 0)
    assert metrics["sampling_rounds"] == 1 and len(trajs) == 4 and metrics["batch_groups"] == 2


def test_a_mixed_family_split_reports_each_family_and_the_ood_split(tmp_path):
    """navigation-keys from a random tiny model of its vocabulary: the test split's figures come
    for each task family too ("keys/p@1", "plain/p@1"), and --ood-split is evaluated before and
    after training, in the results, the metrics log and the report's table."""
    cfg = small_cfg(
        tmp_path,
        env="navigation-keys",
        train_split="fit",
        eval_tasks=8,
        eval_samples=1,
        ood_split="ood",
        batch_tasks=1,
        group_size=2,
        max_turn_tokens=2,
    )
    res = rti.train(cfg, log=runtime.silent)
    families = {t.family for t in envs.env_tasks("navigation-keys", "test")[:8]}
    assert families == {"plain", "keys"}
    for key in ("before", "after"):
        assert {"p@1", "plain/p@1", "keys/p@1"} <= set(res[key])
        assert "p@1" in res[f"{key}_ood"] and "keys/p@1" not in res[f"{key}_ood"]  # one family
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows if "ood/p@1" in r] == [0, 1]
    table = rti.report(cfg, res, 1.0)
    assert "| warm start, keys tasks |" in table and "| after 1 steps, ood |" in table


def test_a_warm_start_without_the_envs_words_is_refused_naming_them(capsys):
    """The committed warm start's tokenizer has no `find`, `key`, ...: --env navigation-keys with
    it stops at the flag, naming the words and how to build a warm start for the env."""
    with pytest.raises(SystemExit):
        runtime.parse_args(["--env", "navigation-keys"], rti.Config)
    err = capsys.readouterr().err
    assert "--init: its tokenizer lacks words of --env navigation-keys (find" in err
    assert "python -m extras.warmstart --env navigation-keys" in err
    runtime.parse_args(["--env", "navigation-keys", "--init", ""], rti.Config)  # a random model


@pytest.mark.parametrize("sees", ["hint", "evidence"])
def test_teacher_writes_the_random_phrase_its_note_names(tiny, sees):
    """ws_follow_frac: the note's 'do' names a phrase that is no tool call, the teacher writes
    exactly it (trained), the env answers an unknown action and the teacher goes on to succeed;
    with the phrase's words taken from 'wall' and 'hit', a banned 'wall hit' is never drawn."""
    chat = Chat(tiny[1])
    task = easy_tasks(1)[0]
    for seed in range(5):
        ids, w = warmstart.teacher_sequence(
            chat,
            task,
            random.Random(seed),
            hint_frac=1.0,
            obs_weight=0.5,
            route_frac=0.0,
            evidence_frac=1.0 if sees == "evidence" else 0.0,
            follow_frac=0.5,
            words=("wall", "hit"),
            banned=frozenset({"wall hit"}),
        )
        text = chat.tok.convert_ids_to_tokens(ids)
        actions = teacher_actions_of(chat, ids)
        followed = [a for a in actions if a not in envs.ACTIONS]
        assert followed and all(set(a.split()) <= {"wall", "hit"} != a for a in followed)
        assert "wall hit" not in followed and actions[-1] == "finish"
        assert text.count("unknown") == len(followed)  # 'error unknown action' each
        for start in [i for i, t in enumerate(text) if t == "<hint>"]:
            close = text.index("</hint>", start)
            written = [t for t, wt in zip(text[close:], w[close:]) if wt == 1.0]
            action = written[: written.index(chat.tok.eos_token)]
            if " ".join(action) in envs.ACTIONS:
                continue
            assert text[close - len(action) - 1 : close] == ["do", *action]
            target = close - text[close::-1].index("next")  # the note's last 'next ...'
            shown = sees == "evidence" and text[target + 1] != "finish"  # the end: no path
            assert ("path" in text[target:close]) == shown


def test_teacher_writes_the_new_tool_its_note_names_with_follow_tools(capsys):
    """ws_follow_tools: the phrase a note names is the tool navigation-keys adds ('find key'),
    which the teacher writes after 'do' (plain Navigation answers it as an unknown action); an env
    that adds no tool is refused naming the flag."""
    chat = Chat(build_tiny_tokenizer("navigation-keys"), "navigation-keys")
    phrases = warmstart.new_tool_calls("navigation-keys")
    assert phrases == ("find key",)
    ids, _ = warmstart.teacher_sequence(
        chat,
        easy_tasks(1)[0],
        random.Random(0),
        hint_frac=1.0,
        obs_weight=0.5,
        route_frac=0.0,
        follow_frac=0.5,
        words=("wall", "hit"),
        phrases=phrases,
    )
    actions = teacher_actions_of(chat, ids)
    followed = [a for a in actions if a not in envs.ACTIONS]
    assert followed and set(followed) == {"find key"} and actions[-1] == "finish"
    text = " ".join(chat.tok.convert_ids_to_tokens(ids))
    assert text.count("do find key </hint>") == len(followed)
    with pytest.raises(SystemExit):
        warmstart.main(["--ws-follow-tools", "--ws-follow-frac", "0.5", "--ws-steps", "1"])
    assert "--ws-follow-tools: --env navigation has no tool call" in capsys.readouterr().err


def test_the_teacher_plays_a_keys_task_by_its_tool_and_ws_env_tasks_draws_the_family(capsys):
    """teacher_sequence plays a task by its own env (envs.player): on a keys task, every leg routed
    (route_frac 1), it is the oracle's episode (route, then `find key` at the locked door, the route
    to the key, route again); a walker (route_frac 0) never calls the tool. --ws-env-tasks draws
    from --env's split, and is refused with a split that env lacks."""
    chat = Chat(build_tiny_tokenizer("navigation-keys"), "navigation-keys")
    keys = [t for t in envs.env_tasks("navigation-keys", "val")[:12] if t.family == "keys"]
    assert keys
    for task in keys:
        routed = teacher_actions(chat, task, route_frac=1.0)
        assert routed == envs.optimal_actions(task) and routed.count("find key") == len(task.doors)
        assert routed.count("route") == len(task.waypoints) + len(task.doors)
        walker = teacher_actions(chat, task, route_frac=0.0)
        assert "find key" not in walker and "route" not in walker
    with pytest.raises(SystemExit):
        warmstart.main(["--env", "navigation-keys", "--ws-env-tasks", "--ws-steps", "1"])
    err = capsys.readouterr().err
    assert "--ws-split: with --ws-env-tasks, must be a split of --env navigation-keys" in err
