"""The oracle teacher, perfect and imperfect: seeded mistakes the rubric rejects, only in the slices named."""

from __future__ import annotations

import itertools

import pytest

from flywheel.agent import Harness, Limits
from flywheel.config import TeacherConfig
from flywheel.envs.calculator import CalculatorEnv
from flywheel.policies.base import Sampling
from flywheel.policies.oracle import OraclePolicy, wrong_answer

ENV = CalculatorEnv(big_fraction=0.3)
TASKS = list(itertools.islice(ENV.generate_tasks(0), 400))


def passed(policy, samples: int = 1) -> list[bool]:
    return [e.passed for e in Harness(ENV, Limits(max_turns=4)).run(policy, TASKS, samples=samples,
                                                                    sampling=Sampling())]


def test_a_perfect_oracle_solves_every_task():
    assert all(passed(OraclePolicy(ENV)))


def test_error_rate_is_seeded_and_rejected_by_the_rubric():
    first = passed(OraclePolicy(ENV, error_rate=0.3, error_seed=1))
    assert first == passed(OraclePolicy(ENV, error_rate=0.3, error_seed=1)), "a rerun makes other mistakes"
    assert first != passed(OraclePolicy(ENV, error_rate=0.3, error_seed=2))
    assert 0.2 < 1 - sum(first) / len(first) < 0.4
    # the samples of one task err independently: some tasks keep a correct sample
    two = passed(OraclePolicy(ENV, error_rate=0.5), samples=2)
    per_task = [two[i:i + 2] for i in range(0, len(two), 2)]
    assert any(a != b for a, b in per_task)


def test_errors_only_in_the_slices_named():
    results = passed(OraclePolicy(ENV, error_rate=1.0, error_slices=["big"]))
    assert {t.slice for t in TASKS} == {"add", "mul", "mixed", "big"}
    for task, ok in zip(TASKS, results, strict=True):
        assert ok == (task.slice != "big"), task


def test_wrong_answer_changes_the_last_number():
    assert wrong_answer("The answer is 41.") == "The answer is 42."
    assert wrong_answer("The answer is -7.") == "The answer is -8."  # the magnitude one more
    assert wrong_answer("no number") == "I am not sure."


def test_only_the_oracle_takes_an_error_rate():
    assert TeacherConfig(policy="oracle", error_rate=0.2).error_rate == 0.2
    with pytest.raises(ValueError, match="error_rate and error_slices make the oracle imperfect"):
        TeacherConfig(policy="openai", model="m", error_rate=0.2)
    with pytest.raises(ValueError):
        TeacherConfig(error_rate=1.5)
