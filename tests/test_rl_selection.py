"""rl.keep_best: early stopping on a validation sample of train tasks, with real optimiser steps on the tiny
student (the calculator with a graded rubric, so an untrained model's versions differ)."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_rl_loop import CFG, GradedCalculator, weights

from flywheel.agent import Harness, Limits
from flywheel.checkpoints import load_student
from flywheel.envs.calculator import CalculatorEnv
from flywheel.train.rl.loop import train_rl
from flywheel.train.rl.selection import VALIDATION_PASS, VALIDATION_REWARD, Selection, validation_split

TASKS = list(itertools.islice(CalculatorEnv().generate_tasks(1), 16))
KEEP = CFG.model_copy(update={"steps": 4, "tasks_per_step": 4, "lr": 2e-2, "keep_best": True,
                              "validate_every": 1, "validate_tasks": 6})


def ranked(checks: list[dict]) -> dict:
    """The check keep_best must pick: most passed, then the higher mean reward, then the earlier version."""
    return max(checks, key=lambda c: (c[VALIDATION_PASS], c[VALIDATION_REWARD], -c["version"]))


def test_the_validation_sample_is_set_aside_from_the_tasks_rl_draws():
    validation, rest = validation_split(TASKS, KEEP)
    assert [t.task_id for t in validation] == [t.task_id for t in TASKS if t in validation]  # their order
    assert {t.task_id for t in validation} == {t.task_id for t in sorted(TASKS, key=lambda t: t.task_id)[:6]}
    assert rest == [t for t in TASKS if t not in validation]
    assert validation_split(TASKS, CFG) == ([], TASKS)  # keep_best off: every task trains
    # at most half the tasks: RL keeps the rest to learn from (a default of 24 on a user's 20 train tasks)
    validation, rest = validation_split(TASKS, KEEP.model_copy(update={"validate_tasks": 16}))
    assert len(validation) == len(rest) == len(TASKS) // 2
    with pytest.raises(ValueError, match=r"only 1: add train tasks or set rl.keep_best: false"):
        validation_split(TASKS[:1], KEEP)


def test_the_output_is_the_best_validated_version_and_learning_is_unchanged(tiny_student, tmp_path):
    seen = []
    rows, summary = train_rl(tiny_student, Harness(GradedCalculator(), Limits(max_turns=1)), TASKS, KEEP,
                             tmp_path / "best", on_step=lambda step, m: seen.append(m))
    # every version was validated (validate_every 1); the step metrics carry each check
    passes = [m[VALIDATION_PASS] for m in seen]
    assert len(passes) == KEEP.steps and all(0.0 <= p <= 1.0 for p in passes)
    assert summary["validation_tasks"] == 6 and 0 <= summary["best_version"] <= KEEP.steps

    # Validating draws no random numbers and trains on nothing: the rollouts are a plain run's on the other tasks
    _, rest = validation_split(TASKS, KEEP)
    plain_cfg = KEEP.model_copy(update={"keep_best": False})
    plain, _ = train_rl(tiny_student, Harness(GradedCalculator(), Limits(max_turns=1)), rest, plain_cfg,
                        tmp_path / "last")
    assert rows == plain
    assert not {r["task_id"] for r in rows} & {t.task_id for t in TASKS if t not in rest}

    # The weights saved are exactly those of the version chosen: a plain run stopped there (the learning rate
    # is constant, so stopping early changes no earlier step), or the start itself for version 0
    best = summary["best_version"]
    if best == 0:
        expected = weights(load_student(tiny_student)[0])
    else:
        train_rl(tiny_student, Harness(GradedCalculator(), Limits(max_turns=1)), rest,
                 plain_cfg.model_copy(update={"steps": best}), tmp_path / "stopped")
        expected = weights(load_student(tmp_path / "stopped")[0])
    kept = weights(load_student(tmp_path / "best")[0])
    assert all(torch.equal(kept[k], expected[k]) for k in kept)
    # and it is the best of the checks: version 0's (the summary's first) and each step's
    checks = [{"version": 0, VALIDATION_PASS: summary[f"{VALIDATION_PASS}_first"],
               VALIDATION_REWARD: summary[f"{VALIDATION_REWARD}_first"]}]
    checks += [{"version": m["policy_version"], VALIDATION_PASS: m[VALIDATION_PASS],
                VALIDATION_REWARD: m[VALIDATION_REWARD]} for m in seen]
    assert ranked(checks)["version"] == best
    assert seen[-1]["best_version"] == best


def test_a_run_stopped_after_a_checkpoint_resumes_to_the_same_choice(tiny_student, tmp_path):
    cfg = KEEP.model_copy(update={"checkpoint_every": 2})
    whole, summary = train_rl(tiny_student, Harness(GradedCalculator(), Limits(max_turns=1)), TASKS, cfg,
                              tmp_path / "whole")

    def stop(step: int, metrics: dict) -> None:
        if step == 1:  # after the step-2 checkpoint is written
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_rl(tiny_student, Harness(GradedCalculator(), Limits(max_turns=1)), TASKS, cfg, tmp_path / "again" / "rl",
                 on_step=stop)
    rows, resumed = train_rl(tiny_student, Harness(GradedCalculator(), Limits(max_turns=1)), TASKS, cfg,
                             tmp_path / "again" / "rl")
    assert resumed["resumed_from_step"] == 2
    assert rows == whole
    assert {k: resumed[k] for k in ("best_version", "validation_pass_best", "validation_pass_first",
                                    "validation_pass_last")} == \
        {k: summary[k] for k in ("best_version", "validation_pass_best", "validation_pass_first",
                                 "validation_pass_last")}
    a, b = weights(load_student(tmp_path / "whole")[0]), weights(load_student(tmp_path / "again" / "rl")[0])
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_validation_runs_under_the_environments_tool_timeout_and_token_budget(slow_tool_harness, tool_caller):
    tasks = list(slow_tool_harness.env.generate_tasks(0))
    check = Selection(slow_tool_harness, tasks, KEEP).check(0, tool_caller, torch.nn.Linear(1, 1))
    assert check["best_version"] == 0 and tool_caller.turns == 2  # cut by the 10-token budget, not the 8 turns
    counters = slow_tool_harness.env.counters
    assert counters["tool_timeouts"] == 2 * len(tasks) and counters["conversations_cut"] == len(tasks)
