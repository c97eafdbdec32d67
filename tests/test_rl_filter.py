"""Online difficulty filtering and the learning-rate schedule: seeded, reproducible, async or not."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from test_rl_loop import GradedCalculator, weights

from flywheel.agent import Harness, Limits
from flywheel.checkpoints import load_student
from flywheel.config import RLConfig
from flywheel.envs.calculator import CalculatorEnv
from flywheel.train.rl.learner import learning_rate
from flywheel.train.rl.loop import train_rl
from flywheel.train.rl.source import filtered_work, saturated_tasks

TASKS = list(itertools.islice(CalculatorEnv().generate_tasks(1), 30))


def rows_of(outcomes: dict[str, list[list[bool]]]) -> list[dict]:
    """Rollout rows: outcomes[task] is that task's groups in step order, each the pass of its samples."""
    rows = []
    for index, (task, groups) in enumerate(outcomes.items()):
        for step, group in enumerate(groups):
            rows += [{"step": step, "group": index, "task_id": task, "passed": p, "dropped": False} for p in group]
    return rows


def test_saturated_tasks_are_those_whose_recent_groups_had_no_signal():
    rows = rows_of({"easy": [[True, True]], "hard": [[False, False]], "mixed": [[True, False]],
                    "learnt": [[True, False], [True, True]], "recovered": [[True, True], [False, True]]})
    assert saturated_tasks(rows, before_step=5, window=1) == {"easy", "hard", "learnt"}
    assert saturated_tasks(rows, before_step=5, window=2) == set()  # one group is not two
    assert saturated_tasks(rows, before_step=1, window=1) == {"easy", "hard", "recovered"}  # step 1 not yet seen


def test_filtered_draws_are_seeded_distinct_and_favour_tasks_with_signal():
    cfg = RLConfig(tasks_per_step=10, difficulty_filter=True, filter_weight=0.05, max_staleness=0, seed=4)
    saturated = {t.task_id: [[True, True]] for t in TASKS[:20]}  # two thirds of the tasks gave no signal
    rows = rows_of(saturated | {t.task_id: [[True, False]] for t in TASKS[20:]})
    draws = [filtered_work(TASKS, cfg, step, rows) for step in range(1, 41)]
    assert draws[0] == filtered_work(TASKS, cfg, 1, rows), "equal rows and step must draw equal tasks"
    assert all(len({t.task_id for t in d.tasks}) == 10 for d in draws)
    counts = Counter(t.task_id in saturated for d in draws for t in d.tasks)
    assert counts[False] > 4 * counts[True], counts  # unfiltered, the saturated would be drawn twice as often
    unfiltered = cfg.model_copy(update={"filter_weight": 1.0})
    plain = Counter(t.task_id in saturated for step in range(1, 41)
                    for t in filtered_work(TASKS, unfiltered, step, rows).tasks)
    assert plain[True] > plain[False], plain
    with pytest.raises(ValueError, match="tasks_per_step 40 is more than the 30 train tasks"):
        filtered_work(TASKS, cfg.model_copy(update={"tasks_per_step": 40}), 0, rows)


def test_learning_rate_schedules():
    constant = RLConfig(steps=10, lr=1e-3)
    assert [learning_rate(constant, s) for s in range(10)] == [1e-3] * 10
    cosine = RLConfig(steps=11, lr=1e-3, lr_schedule="cosine", warmup_steps=1, min_lr_ratio=0.1)
    rates = [learning_rate(cosine, s) for s in range(11)]
    assert rates[0] == pytest.approx(5e-4) and rates[1] == pytest.approx(1e-3)
    assert rates[-1] == pytest.approx(1e-4) and all(a >= b for a, b in zip(rates[1:], rates[2:], strict=False))
    linear = RLConfig(steps=5, lr=1e-3, lr_schedule="linear")
    assert [learning_rate(linear, s) for s in range(5)] == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4, 0.0])


CFG = RLConfig(steps=4, tasks_per_step=3, group_size=3, minibatch_size=8, lr=1e-3, max_new_tokens=16, seed=3,
               checkpoint_every=0, difficulty_filter=True, filter_weight=0.0, lr_schedule="cosine")


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_filtered_run_is_reproducible_and_an_actor_process_gives_the_in_process_run(tiny_student, tmp_path,
                                                                                        staleness):
    cfg = CFG.model_copy(update={"max_staleness": staleness})
    seen = []
    local, _ = train_rl(tiny_student, Harness(GradedCalculator(), Limits(max_turns=1)), TASKS[:8],
                        cfg.model_copy(update={"actors": 0}), tmp_path / "local",
                        on_step=lambda step, m: seen.append(m["lr"]))
    again, _ = train_rl(tiny_student, Harness(GradedCalculator(), Limits(max_turns=1)), TASKS[:8],
                        cfg.model_copy(update={"actors": 0}), tmp_path / "again")
    remote, _ = train_rl(tiny_student, Harness(GradedCalculator(), Limits(max_turns=1)), TASKS[:8],
                         cfg.model_copy(update={"actors": 1}), tmp_path / "remote")
    assert local == again
    assert [{k: v for k, v in r.items()} for r in local] == remote
    for name in ("again", "remote"):
        a, b = weights(load_student(tmp_path / "local")[0]), weights(load_student(tmp_path / name)[0])
        assert all(torch.equal(a[k], b[k]) for k in a), name
    assert seen == pytest.approx([learning_rate(cfg, s) for s in range(cfg.steps)]) and seen[-1] < seen[0]
    # filter_weight 0: a task whose group was saturated is not drawn again while others remain
    for step in range(staleness + 1, cfg.steps):
        known = [r for r in local if r["step"] < step - staleness]
        saturated = saturated_tasks(known, step - staleness, 1)
        drawn = {r["task_id"] for r in local if r["step"] == step}
        assert not (drawn & saturated) or len(TASKS[:8]) - len(saturated) < cfg.tasks_per_step
