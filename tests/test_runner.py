"""The eval runner: greedy plus k seeded samples per task, with the cost and latency the gate can limit."""

from __future__ import annotations

from itertools import islice

from flywheel.agent import Harness, Limits
from flywheel.envs.calculator import CalculatorEnv
from flywheel.evaluate.runner import evaluate_model


def test_greedy_then_k_seeded_samples_per_task(tiny_student):
    env = CalculatorEnv()
    tasks = list(islice(env.generate_tasks(7), 3))
    harness = Harness(env, Limits(max_turns=2, tool_timeout_s=1.0))
    kwargs = {"batch_size": 4, "samples": 2, "temperature": 1.0, "seed": 3}
    rows = evaluate_model(tiny_student, harness, tasks, "rl", **kwargs).rows
    assert sorted((r["task_id"], r["sample"]) for r in rows) == sorted((t.task_id, s) for t in tasks
                                                                       for s in range(3))
    assert all(r["tokens"] > 0 and r["latency_s"] >= 0 for r in rows)
    again = evaluate_model(tiny_student, harness, tasks, "champion", **kwargs).rows
    key = lambda r: (r["task_id"], r["sample"])  # noqa: E731
    assert [r["reward"] for r in sorted(rows, key=key)] == [r["reward"] for r in sorted(again, key=key)], \
        "the same checkpoint with the same seeds scores the same"
