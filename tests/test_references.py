"""The arms an eval scores beside the students: the null policy, a reference over the OpenAI protocol (whole, and
dying midway), and episodes whose simulated user failed (left out, counted)."""

from __future__ import annotations

import itertools

import pandas as pd
import pytest

from flywheel.agent import Harness, Limits
from flywheel.config import ReferenceConfig
from flywheel.contract import UserError
from flywheel.envs.calculator import CalculatorEnv
from flywheel.evaluate.arms import null_arm, reference_arm, score_arm
from flywheel.evaluate.report import reference_line, reference_shares
from flywheel.evaluate.runner import NoHeldoutError, evaluate_policy, require_heldout
from flywheel.policies.oracle import OraclePolicy

ENV = CalculatorEnv()
TASKS = list(itertools.islice(ENV.generate_tasks(3), 20))
LIMITS = Limits(max_turns=4, tool_timeout_s=2.0)
HARNESS = Harness(ENV, LIMITS)


def _reference(server, **kw) -> ReferenceConfig:
    return ReferenceConfig(name="prod", model="oracle", base_url=server.url, price_input_per_mtok=1.0,
                           price_output_per_mtok=4.0, cache=None, **kw)


def test_the_null_policy_answers_nothing_and_costs_nothing():
    scored = score_arm(null_arm(), HARNESS, TASKS, samples=3)  # deterministic: one greedy episode per task
    assert len(scored.rows) == len(TASKS) and {r["sample"] for r in scored.rows} == {0}
    assert all(r["reward"] == 0.0 and not r["passed"] and r["tokens"] == 0 and r["cost_usd"] == 0.0
               for r in scored.rows)


def test_a_reference_is_scored_with_its_token_cost_and_the_candidates_shares(openai_server, tmp_path):
    scored = score_arm(reference_arm(_reference(openai_server), tmp_path), HARNESS, TASKS)
    assert scored.unanswered == 0 and len(scored.rows) == len(TASKS) and all(r["passed"] for r in scored.rows)
    assert all(r["cost_usd"] > 0 and r["model"] == "prod" for r in scored.rows)
    # a candidate passing half the tasks at a tenth of the reference's cost per task
    cost = sum(r["cost_usd"] for r in scored.rows) / len(TASKS)
    candidate = [{**r, "model": "rl", "passed": i % 2 == 0, "reward": float(i % 2 == 0), "cost_usd": cost / 10}
                 for i, r in enumerate(scored.rows)]
    shares = reference_shares(pd.DataFrame(scored.rows + candidate), "rl", "prod")
    assert shares["pass_rate"] == 1.0 and shares["pass_share"] == 0.5
    assert shares["cost_share"] == pytest.approx(0.1) and not shares["incomplete"]
    assert reference_line("prod", shares).startswith("reference 'prod': pass rate 1.000; the candidate reaches "
                                                     "50.0% of it at 10.0% of its cost per task ($")


def test_a_reference_that_dies_midway_is_incomplete_with_the_count(openai_server, tmp_path):
    """Four tasks at a time (its concurrency): the first four answered (8 requests), then the endpoint drops
    every connection; past its retry and breaker the rest are unanswered, and nothing raises."""
    openai_server.down_after = 10
    ref = _reference(openai_server, concurrency=4, max_retries=1, breaker_failures=2, timeout_s=5)
    scored = score_arm(reference_arm(ref, tmp_path), HARNESS, TASKS)
    assert len(scored.rows) == 4 and scored.unanswered == 16
    assert "TeacherError" in scored.failure and "looks down" in scored.failure
    shares = reference_shares(pd.DataFrame(scored.rows), "rl", "prod", scored.unanswered, scored.failure)
    assert shares["incomplete"] and shares["tasks"] == 4 and shares["unanswered"] == 16
    assert "INCOMPLETE: 16 task(s) unanswered" in reference_line("prod", shares)
    # a key that is not set: nothing answered, nothing raised
    unset = score_arm(reference_arm(_reference(openai_server, api_key_env="NO_SUCH_KEY_SET"), tmp_path), HARNESS,
                      TASKS)
    assert unset.rows == [] and unset.unanswered == len(TASKS) and "NO_SUCH_KEY_SET" in unset.failure


class FailingUsers(CalculatorEnv):
    """The calculator whose simulated user fails after the agent's answer on every other task."""

    def user_turn(self, task, messages, state=None):
        if TASKS.index(task) % 2:
            raise UserError("the user simulator's endpoint failed")
        return None


def test_episodes_of_a_failed_simulated_user_are_left_out_and_counted():
    env = FailingUsers()
    scored = evaluate_policy(OraclePolicy(env), Harness(env, LIMITS), TASKS, "rl")
    assert scored.user_errors == 10 and len(scored.rows) == 10
    assert {r["task_id"] for r in scored.rows} == {t.task_id for t in TASKS[::2]}
    assert all(r["passed"] for r in scored.rows)


def test_no_held_out_task_is_an_error_naming_the_pipeline(tmp_path):
    require_heldout("demo", ["train", "heldout"], tmp_path / "tasks.parquet")
    with pytest.raises(NoHeldoutError, match=r"^pipeline 'demo' has no held-out tasks to evaluate on: .*tasks.parquet "
                                             r"holds 2 task\(s\), none in split 'heldout'; raise "
                                             r"environment.heldout_tasks"):
        require_heldout("demo", ["train", "train"], tmp_path / "tasks.parquet")
