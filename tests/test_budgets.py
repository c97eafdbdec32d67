"""The budgets every use of the harness shares: `environment.max_error_turns` ends an episode of malformed tool
calls in synthesis, RL rollouts, evaluate, the dry run and serving's loop alike; `rl.actors: auto`."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from flywheel.agent import Harness, load_harness
from flywheel.config import EnvironmentConfig, RLConfig, load_pipeline
from flywheel.policies.base import Sampling
from flywheel.policies.toolcalls import parse_completion

ROOT = Path(__file__).resolve().parents[1]
MALFORMED = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 +</tool_call>'
ERROR_TURNS = 2
MAX_TURNS = 6


class Malformed:
    """A policy that always writes a tool call that does not parse (as a sampled student at temperature 1 often
    does), read by the real parser; with a tokenizer, the token ids and log-probabilities RL encodes."""

    name = "malformed"

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.calls = 0

    def generate(self, conversations, tools, sampling, **_):
        self.calls += 1
        out = []
        for _ in conversations:
            completion = parse_completion(MALFORMED)
            if self.tokenizer is not None:
                completion.token_ids = self.tokenizer(MALFORMED, add_special_tokens=False)["input_ids"]
                completion.logprobs = [-1.0] * len(completion.token_ids)
            out.append(completion)
        return out


def harness_of(root: Path) -> Harness:
    """The harness the stages build: load_harness of an `environment:` section with max_error_turns."""
    return load_harness(EnvironmentConfig(name="calculator", max_turns=MAX_TURNS, max_error_turns=ERROR_TURNS), root)


def ended_by_errors(episodes, policy: Malformed, batches: int = 1) -> None:
    assert episodes and all(e.stop == "error_turns" and e.turns == ERROR_TURNS for e in episodes)
    assert all(c.error for e in episodes for c in e.completions)
    assert policy.calls == ERROR_TURNS * batches  # not MAX_TURNS: the episodes were ended, not cut


@pytest.fixture
def tasks():
    from flywheel.envs.calculator import CalculatorEnv

    return list(itertools.islice(CalculatorEnv().generate_tasks(3), 3))


def test_synthesis_ends_a_malformed_teachers_episodes(tmp_path, tasks):
    # tasks/synthesize.py: the stage's harness (StageContext.harness: load_harness of the pipeline's section),
    # the teacher run over chunks of tasks with samples_per_task and the synthesize section's sampling
    from flywheel.synthesis import select_targets

    teacher = Malformed()
    episodes = harness_of(tmp_path).run(teacher, tasks, samples=2,
                                        sampling=Sampling(temperature=0.0, max_new_tokens=512, seed=0))
    ended_by_errors(episodes, teacher)
    assert select_targets(episodes, best_only=False) == set()  # nothing of it becomes an SFT target


def test_rl_rollouts_end_a_malformed_students_episodes(tmp_path, tasks, tiny_student):
    # flywheel/train/rl/actor.py rollout: what an actor process and the learner's own process (actors: 0) run
    from transformers import AutoTokenizer

    from flywheel.train.rl.actor import rollout
    from flywheel.train.rl.source import Work

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_student))
    student = Malformed(tokenizer)
    cfg = RLConfig(group_size=2, max_new_tokens=32, max_length=512)
    groups = rollout(harness_of(tmp_path), student, tokenizer, Work(0, tasks, 7), cfg, version=0)
    assert student.calls == ERROR_TURNS and len(groups) == len(tasks)
    assert all(r.reward == 0.0 and r.tokens > 0 for g in groups for r in g.rollouts)


def test_evaluate_ends_a_malformed_policys_episodes(tmp_path, tasks):
    from flywheel.evaluate.runner import evaluate_policy

    policy = Malformed()
    scored = evaluate_policy(policy, harness_of(tmp_path), tasks, "malformed", samples=1)
    ended_by_errors(scored.episodes, policy, batches=2)  # the greedy episodes, then the sampled ones
    assert len(scored.rows) == 2 * len(tasks) and not any(r["passed"] for r in scored.rows)


def test_the_dry_run_ends_a_malformed_policys_episodes(tmp_path, tasks):
    from flywheel.dryrun import _run

    policy = Malformed()
    run = _run(harness_of(tmp_path), policy, "malformed", tasks, {t.task_id: t.task_id for t in tasks})
    ended_by_errors(run.episodes, policy, batches=len(tasks))  # the dry run runs each task alone
    assert not run.errors


def test_servings_loop_ends_a_malformed_policys_episodes(tmp_path, tasks):
    # flywheel/serving/loop.py: the harness of the pipeline's pipelines.yaml, the agent run greedily
    from flywheel.serving.loop import round_harness

    (tmp_path / "pipelines.yaml").write_text(
        "pipelines:\n  p:\n    environment:\n      name: calculator\n"
        f"      max_turns: {MAX_TURNS}\n      max_error_turns: {ERROR_TURNS}\n"
        + "".join(f"    {key}: {{}}\n" for key in ("student", "teacher", "collect", "synthesize", "sft", "rl",
                                                  "evaluate", "gate")))
    harness = round_harness("p", tmp_path)
    policy = Malformed()
    ended_by_errors(harness.run(policy, tasks, sampling=Sampling(temperature=0.0, max_new_tokens=64)), policy)


def test_the_pipelines_set_the_budgets_and_auto_actors():
    for name in ("demo", "support", "rl-lift", "smol", "support-smol", "support-mt", "replay"):
        cfg = load_pipeline(name, ROOT / "pipelines.yaml")
        assert cfg.environment.max_error_turns == 1, name  # a malformed call ends the episode, as TRL's
        assert cfg.rl.actors == "auto", name
        if name != "replay":  # replay's recorded conversations have no oracle to size a budget on
            assert cfg.environment.max_episode_tokens, name


def test_auto_actors_spare_a_core_or_none(monkeypatch):
    import os

    from flywheel.train.rl.generation import actors_for

    assert RLConfig().actors == "auto"
    assert actors_for(RLConfig(actors=3)) == 3
    assert actors_for(RLConfig(max_staleness=0)) == 0  # an actor could only wait for each version
    assert actors_for(RLConfig(actor_devices=["cpu", "cpu"])) == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert actors_for(RLConfig(max_staleness=1)) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert actors_for(RLConfig(max_staleness=1)) == 0  # two cores: no core to spare for an actor
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert actors_for(RLConfig(max_staleness=1)) == 0
    with pytest.raises(ValueError, match="actors"):
        RLConfig(actors="some")
