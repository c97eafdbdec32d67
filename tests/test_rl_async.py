"""Asynchronous RL for real: actor processes, published weights, the staleness bound, resume after a kill."""

from __future__ import annotations

import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from test_rl_loop import GradedCalculator, weights

from flywheel.agent import Harness, Limits
from flywheel.checkpoints import load_student
from flywheel.config import RLConfig
from flywheel.data.schemas import Rollouts
from flywheel.envs.calculator import CalculatorEnv
from flywheel.train.rl.batch import Group, Rollout
from flywheel.train.rl.buffer import RolloutBuffer
from flywheel.train.rl.loop import train_rl


@pytest.fixture(scope="module")
def tasks():
    return list(itertools.islice(CalculatorEnv().generate_tasks(1), 50))


# A random tiny student, one short turn per episode: fast enough for real runs of tens of steps.
CFG = RLConfig(steps=3, tasks_per_step=3, group_size=3, minibatch_size=8, lr=1e-3, max_new_tokens=16, seed=3,
               checkpoint_every=0)


@pytest.mark.parametrize("staleness", [0, 1])
def test_an_actor_process_gives_the_in_process_run(tiny_student, tasks, tmp_path, staleness):
    """The same rollouts and the same weights whether the learner generates itself or an actor process does:
    at max_staleness 0 (the synchronous baseline) and at 1, where step s is made by exactly version s - 1."""
    in_process, _ = train_rl(tiny_student, Harness(GradedCalculator(), Limits(max_turns=1)), tasks,
                             CFG.model_copy(update={"actors": 0, "max_staleness": staleness}), tmp_path / "sync")
    actor, summary = train_rl(tiny_student, Harness(GradedCalculator(), Limits(max_turns=1)), tasks,
                              CFG.model_copy(update={"actors": 1, "max_staleness": staleness}), tmp_path / "async0")
    assert actor == in_process
    assert all(r["policy_version"] == r["step"] for r in actor)
    assert all(r["behaviour_version"] == max(r["step"] - staleness, 0) for r in actor)
    assert any(r["advantage"] is not None for r in actor)  # something was learned from
    a, b = weights(load_student(tmp_path / "sync")[0]), weights(load_student(tmp_path / "async0")[0])
    assert all(torch.equal(a[k], b[k]) for k in a)
    before = weights(load_student(tiny_student)[0])
    assert any(not torch.equal(a[k], before[k]) for k in a)
    assert summary["dropped_groups"] == 0 and summary["learner_idle_fraction"] > 0


def test_async_reward_rises_within_the_staleness_bound(tiny_student, tasks, tmp_path):
    """From a random student (reward ~0.01: the share of digits in its answer), 30 asynchronous steps."""
    cfg = CFG.model_copy(update={"steps": 30, "tasks_per_step": 8, "group_size": 4, "minibatch_size": 32,
                                 "lr": 1e-2, "seed": 0, "actors": 1, "max_staleness": 1})
    seen = []
    rows, summary = train_rl(tiny_student, Harness(GradedCalculator(), Limits(max_turns=1)), tasks, cfg,
                             tmp_path / "rl", on_step=lambda step, m: seen.append(m))
    table = Rollouts.validate(pd.DataFrame(rows, columns=list(Rollouts.to_schema().columns)))
    lag = table["policy_version"] - table["behaviour_version"]
    assert (lag[~table["dropped"]] <= cfg.max_staleness).all()
    assert (lag == table["step"].clip(upper=cfg.max_staleness)).all()  # exactly the bound, whatever the timing
    assert len(table) == cfg.steps * cfg.tasks_per_step * cfg.group_size
    for m in seen:
        assert sum(m[f"staleness_{k}"] for k in range(cfg.max_staleness + 1)) == m["groups"]
        assert m["dropped_groups"] == 0 and 0 < m["is_weight_max"] <= cfg.tis_cap
        assert 0 <= m["learner_idle_fraction"] <= 1 and 0 <= m["actor_idle_fraction"] <= 1
    rewards = [m["reward_mean"] for m in seen]
    early, late = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert late > early + 0.15 and late > 3 * early, rewards
    assert summary["reward_mean_last"] == rewards[-1]


class BrokenRubric(CalculatorEnv):
    """A rubric that fails inside the actor process."""

    def score(self, task, messages, state=None):
        raise ArithmeticError("rubric exploded")


def test_an_actor_failure_stops_the_run_with_its_traceback(tiny_student, tasks, tmp_path):
    cfg = CFG.model_copy(update={"actors": 1, "max_staleness": 1})
    with pytest.raises(RuntimeError, match="RL actor 0 failed") as failure:
        train_rl(tiny_student, Harness(BrokenRubric(), Limits(max_turns=1)), tasks, cfg, tmp_path / "rl")
    assert "ArithmeticError: rubric exploded" in str(failure.value)
    assert not (tmp_path / "rl").exists()


def _group(step: int, index: int, version: int) -> Group:
    return Group(step, index, version, [Rollout("t", 0, 0.0, False, [])])


def test_groups_past_the_bound_are_dropped_where_consumed():
    """The second check: whatever reaches the learner too old is counted, not trained on; early steps wait."""
    q = queue.Queue()
    for group in (_group(3, 1, 2), _group(4, 0, 3), _group(3, 0, 1), _group(3, 2, 2)):
        q.put(group)
    buffer = RolloutBuffer(q, max_staleness=1, check=lambda: None)
    fresh, stale, _ = buffer.take(3, 3, version=3)
    assert [g.index for g in fresh] == [1, 2] and [g.index for g in stale] == [0]
    assert [g.step for g in buffer.stash[4]] == [4]


SCRIPT = """
import itertools, json, sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from test_rl_loop import GradedCalculator
from flywheel.agent import Harness, Limits
from flywheel.config import RLConfig
from flywheel.envs.calculator import CalculatorEnv
from flywheel.train.rl.loop import train_rl

if __name__ == "__main__":
    tasks = list(itertools.islice(CalculatorEnv().generate_tasks(1), 50))
    cfg = RLConfig.model_validate_json({cfg!r})
    rows, summary = train_rl(Path({student!r}), Harness(GradedCalculator(), Limits(max_turns=1)), tasks, cfg,
                             Path({out!r}))
    Path({result!r}).write_text(json.dumps({{"rows": rows, "summary": summary}}))
"""


@pytest.mark.slow
def test_killed_run_resumes_from_its_last_checkpoint(tiny_student, tasks, tmp_path):
    cfg = CFG.model_copy(update={"steps": 8, "tasks_per_step": 6, "actors": 1, "max_staleness": 1,
                                 "checkpoint_every": 1})
    script = tmp_path / "run_rl.py"
    result = tmp_path / "result.json"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent), cfg=cfg.model_dump_json(),
                                    student=str(tiny_student), out=str(tmp_path / "models" / "rl"),
                                    result=str(result)))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    checkpoints = tmp_path / "models" / "rl-checkpoints"
    run = subprocess.Popen([sys.executable, str(script)], env=env, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not any(int(p.name.split("-")[1]) >= 2 for p in checkpoints.glob("step-*")):
            assert run.poll() is None, run.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "no checkpoint after 120 s"
            time.sleep(0.02)
    finally:
        os.killpg(run.pid, signal.SIGKILL)  # the learner and its actor, mid-run
        run.wait()
    assert not result.exists() and not (tmp_path / "models" / "rl").exists()

    finished = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180)
    assert finished.returncode == 0, finished.stderr[-2000:]
    resumed = json.loads(result.read_text())
    assert resumed["summary"]["resumed_from_step"] >= 2
    assert not checkpoints.exists()  # a finished run leaves no checkpoints behind

    # Exactly the run that was never interrupted (which version makes a step is fixed): rows and weights.
    whole, _ = train_rl(tiny_student, Harness(GradedCalculator(), Limits(max_turns=1)), tasks,
                        cfg.model_copy(update={"actors": 0}), tmp_path / "whole",
                        checkpoint_dir=tmp_path / "whole-checkpoints")
    assert resumed["rows"] == whole
    a, b = weights(load_student(tmp_path / "models" / "rl")[0]), weights(load_student(tmp_path / "whole")[0])
    assert all(torch.equal(a[k], b[k]) for k in a)


class CountingCalculator(GradedCalculator):
    """Counts each episode it scores, as a tool's error would be: in whichever process scores it."""

    def score(self, task, messages, state=None):
        self.count("scored")
        return super().score(task, messages, state)


def test_the_actors_environment_counts_reach_the_stages_environment(tiny_student, tasks, tmp_path):
    """Tool errors, timeouts, ... counted by an actor process's copy of the environment are added to the
    learner's (the one the stage logs as env.<counter>), exactly as an in-process run counts them."""
    cfg = CFG.model_copy(update={"max_staleness": 1})
    in_process, in_actors = CountingCalculator(), CountingCalculator()
    train_rl(tiny_student, Harness(in_process, Limits(max_turns=1)), tasks, cfg.model_copy(update={"actors": 0}),
             tmp_path / "sync")
    train_rl(tiny_student, Harness(in_actors, Limits(max_turns=1)), tasks, cfg.model_copy(update={"actors": 1}),
             tmp_path / "async")
    rollouts = cfg.steps * cfg.tasks_per_step * cfg.group_size
    assert in_process.counters["scored"] == rollouts
    assert in_actors.counters == in_process.counters
