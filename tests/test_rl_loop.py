"""A real, short synchronous RL run in the learner's process (actors: 0): the tiny model, the calculator
harness, real optimiser steps; and how episodes become training segments."""

from __future__ import annotations

import itertools

import pytest
import torch

from flywheel.agent import Harness, Limits
from flywheel.checkpoints import load_student
from flywheel.config import RLConfig, TinyModelConfig
from flywheel.contract import Score
from flywheel.envs.calculator import CalculatorEnv
from flywheel.metrics import RL_SKIPPED_SHARE, RL_UPDATES
from flywheel.policies.oracle import OraclePolicy
from flywheel.policies.toolcalls import render_tool_call
from flywheel.train.rl.batch import advantages_of, collate, encode_episode, make_groups, samples_of
from flywheel.train.rl.learner import learn_on_batch
from flywheel.train.rl.loop import no_update_warning, train_rl
from flywheel.train.tiny import build_tiny_student, environment_corpus

ROW_KEYS = {"step", "policy_version", "behaviour_version", "task_id", "group", "sample", "reward",
            "advantage", "tokens", "passed", "dropped", "split"}
METRIC_KEYS = {"reward_mean", "reward_std", "pass_rate", "skipped_groups", "loss", "clip_fraction",
               "ratio_mean", "tokens_per_s", "step_time_s", "policy_version", "dropped_groups", "staleness_0",
               "is_weight_mean", "is_weight_max", "kl_behaviour", "learner_idle_fraction", "actor_idle_fraction",
               "split_rollouts", "skipped_group_share"}


class GradedCalculator(CalculatorEnv):
    """The calculator with a graded rubric: a random model never solves a sum, so the exact-answer rubric
    would give every group equal rewards and nothing to learn. Reward: the share of digits in the answer."""

    def score(self, task, messages, state=None):
        text = messages[-1].get("content") or "" if messages[-1]["role"] == "assistant" else ""
        reward = sum(c.isdigit() for c in text) / max(len(text), 1)
        return Score(reward=reward, passed=reward > 0.5)


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    """A randomly initialised tiny student (the same build as the demo's, smaller)."""
    env = CalculatorEnv()
    return build_tiny_student(environment_corpus(env, 100, 0),
                              TinyModelConfig(hidden_size=32, layers=1, heads=2, vocab_size=300),
                              tmp_path_factory.mktemp("student"))


@pytest.fixture(scope="module")
def tasks():
    return list(itertools.islice(CalculatorEnv().generate_tasks(1), 12))


CFG = RLConfig(steps=2, tasks_per_step=3, group_size=3, minibatch_size=4, epochs_per_batch=2, lr=1e-3, seed=3,
               actors=0, max_staleness=0, checkpoint_every=0)


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_rl_run_learns_logs_and_saves(student, tasks, tmp_path):
    seen = []
    rows, summary = train_rl(student, Harness(GradedCalculator(), Limits(max_turns=1)), tasks, CFG, tmp_path / "rl",
                             on_step=lambda step, m: seen.append((step, m)))
    assert len(rows) == CFG.steps * CFG.tasks_per_step * CFG.group_size
    assert all(set(r) == ROW_KEYS for r in rows)
    for step in range(CFG.steps):
        mine = [r for r in rows if r["step"] == step]
        assert {r["policy_version"] for r in mine} == {r["behaviour_version"] for r in mine} == {step}
        assert sorted({r["group"] for r in mine}) == list(range(CFG.tasks_per_step))
        assert all(r["tokens"] > 0 for r in mine)
        for group in range(CFG.tasks_per_step):
            members = [r for r in mine if r["group"] == group]
            assert [r["sample"] for r in members] == list(range(CFG.group_size))
            assert len({r["task_id"] for r in members}) == 1
            if members[0]["advantage"] is not None:
                assert sum(r["advantage"] for r in members) == pytest.approx(0.0, abs=1e-6)
    assert [step for step, _ in seen] == [0, 1]
    assert [m["policy_version"] for _, m in seen] == [1, 2]
    assert all(METRIC_KEYS <= set(m) for _, m in seen)
    for step, m in seen:  # the segments of groups with a signal, in minibatches, once per epoch
        signal = {r["group"] for r in rows if r["step"] == step and r["advantage"] is not None}
        assert len(signal) == m["groups"] - m["skipped_groups"]
        if signal:
            assert m["updates"] >= CFG.epochs_per_batch * -(-len(signal) * CFG.group_size // CFG.minibatch_size)
        assert m["staleness_0"] == CFG.tasks_per_step and m["dropped_groups"] == 0
    assert sum(m["skipped_groups"] for _, m in seen) < CFG.steps * CFG.tasks_per_step
    assert summary["policy_version"] == 2 and summary["episodes"] == len(rows)

    before, _ = load_student(student)
    after, tokenizer = load_student(tmp_path / "rl")
    changed = [k for k, v in weights(after).items() if not torch.equal(v, weights(before)[k])]
    assert changed, "RL steps left every weight unchanged"
    assert tokenizer.chat_template


def test_rerun_is_reproducible(student, tasks, tmp_path):
    cfg = CFG.model_copy(update={"steps": 1, "tasks_per_step": 2})
    first, _ = train_rl(student, Harness(GradedCalculator(), Limits(max_turns=1)), tasks, cfg, tmp_path / "a")
    second, _ = train_rl(student, Harness(GradedCalculator(), Limits(max_turns=1)), tasks, cfg, tmp_path / "b")
    assert first == second
    a, b = weights(load_student(tmp_path / "a")[0]), weights(load_student(tmp_path / "b")[0])
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_groups_without_signal_are_skipped_and_change_nothing(student, tasks, tmp_path):
    # The real exact-answer rubric: an untrained model fails every task, so every group is skipped.
    cfg = CFG.model_copy(update={"steps": 2})
    seen = []
    rows, summary = train_rl(student, Harness(CalculatorEnv(), Limits(max_turns=1)), tasks, cfg, tmp_path / "rl",
                             on_step=lambda step, m: seen.append(m))
    assert all(r["reward"] == 0.0 and r["advantage"] is None for r in rows)
    assert seen[0]["skipped_groups"] == cfg.tasks_per_step and seen[0]["updates"] == 0
    assert [m[RL_SKIPPED_SHARE] for m in seen] == [1.0, 1.0]  # per step: every group had equal rewards
    assert summary[RL_UPDATES] == 0 and summary[RL_SKIPPED_SHARE] == 1.0
    before, after = weights(load_student(student)[0]), weights(load_student(tmp_path / "rl")[0])
    assert all(torch.equal(before[k], after[k]) for k in before)
    # and it says so: the warning the rl stage puts in the run's summary (or fails with, if asked)
    assert no_update_warning(summary, student, tmp_path / "rl") == (
        "RL made 0 optimiser updates in 2 steps; 100% of its groups had equal rewards, so no signal: the RL model "
        "is the SFT model")


def test_an_output_identical_to_its_input_is_said(student, tmp_path):
    """Updates made, but the weights kept are the starting ones (e.g. keep_best chose version 0)."""
    import shutil

    shutil.copytree(student, tmp_path / "rl")
    assert no_update_warning({RL_UPDATES: 4, "steps": 2}, student, tmp_path / "rl") == (
        "RL's output weights are byte-identical to its input (the SFT checkpoint): RL changed nothing")
    model, tokenizer = load_student(student)
    with torch.no_grad():
        next(model.parameters()).add_(1e-3)
    from flywheel.checkpoints import save_student

    save_student(model, tokenizer, tmp_path / "moved")
    assert no_update_warning({RL_UPDATES: 4, "steps": 2}, student, tmp_path / "moved") == ""


def oracle_episodes(env, n_tasks: int, samples: int):
    """Oracle episodes with the token ids and logprobs an HF policy would return (the template's own tokens)."""
    episodes = Harness(env).run(OraclePolicy(env), list(itertools.islice(env.generate_tasks(5), n_tasks)),
                                samples=samples)
    for i, episode in enumerate(episodes):
        episode.reward = float(i % 2)
    return episodes


def as_sampled(episodes, tokenizer, tools: list[dict]):
    """The oracle's episodes as if a policy had generated them: exactly the tokens the template gives each turn."""
    from flywheel.train.encoding import encode_conversation

    for episode in episodes:
        ids, mask = encode_conversation(tokenizer, episode.messages, tools, 256)
        runs = [[]]
        for token, m, nxt in zip(ids, mask, [*mask[1:], 0], strict=True):
            if m:
                runs[-1].append(token)
                if not nxt:
                    runs.append([])
        for completion, run in zip(episode.completions, runs, strict=False):
            completion.token_ids, completion.logprobs = run, [-0.5] * len(run)
    return episodes


def test_an_episode_whose_user_failed_is_left_out_of_its_group(student):
    env = CalculatorEnv()
    _, tokenizer = load_student(student)
    episodes = as_sampled(oracle_episodes(env, 2, 2), tokenizer, env.tools())
    episodes[1].stop = "user_error"  # the first task's second sample: its simulated user failed
    episodes[2].stop = episodes[3].stop = "user_error"  # every sample of the second task
    groups = make_groups(episodes, 2, tokenizer, env.tools(), 256, step=0, version=0)
    assert [(g.index, len(g.rollouts)) for g in groups] == [(0, 1)]


def test_learner_starts_from_ratio_one_on_assistant_tokens_only(student):
    env = CalculatorEnv()
    model, tokenizer = load_student(student)
    episodes = as_sampled(oracle_episodes(env, 4, 2), tokenizer, env.tools())
    groups = make_groups(episodes, 2, tokenizer, env.tools(), 256, step=0, version=0)  # room: small tokenizer
    assert not any(r.split for g in groups for r in g.rollouts)
    samples = [s for g in groups for s in samples_of(g, advantages_of(g, "grpo"))]
    assert len(samples) == len(episodes)
    batch = collate(samples, tokenizer.pad_token_id)
    # Loss on exactly the assistant turns and their end tokens: never the prompt or a tool result.
    for sample, episode in zip(samples, episodes, strict=True):
        masked = tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m])
        expected = "".join((m.get("content") or "") + "".join(map(render_tool_call, m.get("tool_calls", [])))
                           + "<|im_end|>" for m in episode.messages if m["role"] == "assistant")
        assert masked == expected
        assert [b for b, m in zip(sample.behaviour_logprobs, sample.loss_mask, strict=True) if m] == \
            [-0.5] * sum(sample.loss_mask)
    assert groups[0].rollouts[0].tokens == sum(samples[0].loss_mask)
    # A negligible learning rate: every ratio must be 1, so old and new log-probs line up token for token.
    cfg = RLConfig(lr=1e-12, minibatch_size=3, epochs_per_batch=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    stats = learn_on_batch(model, optimizer, batch, cfg, torch.Generator().manual_seed(0))
    assert stats["ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert stats["clip_fraction"] == 0.0 and stats["updates"] == 2 * 3


def test_retokenised_differently_becomes_per_turn_segments(student):
    """Generated ids the template would not produce (a different tokenisation of the same text): each turn is
    trained as its own segment, the prompt as the policy saw it plus the generated ids, logprobs aligned."""
    env = CalculatorEnv()
    _, tokenizer = load_student(student)
    episode = oracle_episodes(env, 1, 1)[0]
    for k, completion in enumerate(episode.completions):
        text = completion.text or render_tool_call(completion.message["tool_calls"][0])
        # one token per character: never what the BPE template encoding gives
        ids = [tokenizer.convert_tokens_to_ids(c) for c in text if tokenizer.convert_tokens_to_ids(c) is not None]
        completion.token_ids = [*ids, tokenizer.eos_token_id]
        completion.logprobs = [-(k + 1.0)] * len(completion.token_ids)
    rollout = encode_episode(episode, tokenizer, env.tools(), 512)
    assert rollout.split and len(rollout.segments) == len(episode.completions)
    for k, (segment, completion) in enumerate(zip(rollout.segments, episode.completions, strict=True)):
        n = len(completion.token_ids)
        assert segment.input_ids[-n:] == completion.token_ids
        assert segment.loss_mask == [0] * (len(segment.input_ids) - n) + [1] * n
        assert segment.behaviour_logprobs[-n:] == [-(k + 1.0)] * n
        assert not any(segment.behaviour_logprobs[:-n])
    assert rollout.tokens == sum(len(c.token_ids) for c in episode.completions)


def test_groups_must_hold_one_task(student):
    env = CalculatorEnv()
    _, tokenizer = load_student(student)
    episodes = Harness(env).run(OraclePolicy(env), list(itertools.islice(env.generate_tasks(0), 3)))
    with pytest.raises(ValueError, match="do not split"):
        make_groups(episodes, 2, tokenizer, env.tools(), 128, 0, 0)
    with pytest.raises(ValueError, match="mixes tasks"):
        make_groups(episodes[:2], 2, tokenizer, env.tools(), 128, 0, 0)


@pytest.mark.parametrize("loss_type", ["dr_grpo", "dapo"])
def test_kl_to_the_starting_checkpoint_and_other_normalisations(student, tasks, tmp_path, loss_type):
    cfg = CFG.model_copy(update={"steps": 2, "kl_beta": 0.1, "loss_type": loss_type})
    seen = []
    train_rl(student, Harness(GradedCalculator(), Limits(max_turns=1)), tasks, cfg, tmp_path / "rl",
             on_step=lambda step, m: seen.append(m))
    trained = [m for m in seen if m["updates"]]
    # the first minibatch starts at the reference itself (KL 0); the updates move the policy away from it
    assert trained and all(0.0 < m["kl"] < 1.0 for m in trained)
    assert all("kl" not in m for m in seen if m["updates"] == 0)


def test_the_actors_rollout_runs_under_the_environments_tool_timeout_and_token_budget(slow_tool_harness,
                                                                                      tool_caller, tiny_student):
    """Each RL group is generated in the pipeline's harness: its tool timeout (not a fixed 2 s) and its token budget."""
    from transformers import AutoTokenizer

    from flywheel.train.rl.actor import rollout
    from flywheel.train.rl.source import Work

    tasks = list(slow_tool_harness.env.generate_tasks(0))
    cfg = RLConfig(group_size=2, tasks_per_step=len(tasks), max_new_tokens=5, max_length=128)
    groups = rollout(slow_tool_harness, tool_caller, AutoTokenizer.from_pretrained(str(tiny_student)),
                     Work(step=0, tasks=tasks, seed=0), cfg, version=0)
    episodes = len(tasks) * cfg.group_size
    assert tool_caller.turns == 2  # cut by the 10-token budget, not the 8 turns
    assert [r.tokens for g in groups for r in g.rollouts] == [10] * episodes
    counters = slow_tool_harness.env.counters
    assert counters["tool_timeouts"] == 2 * episodes and counters["conversations_cut"] == episodes
