"""The support desk's hard slice: several requests on different orders in one message (5-12 tool calls), read
back from the message alone, solved by the oracle through the harness, scored by the same rubric, dry-run clean."""

from __future__ import annotations

import collections
import json
from itertools import islice
from pathlib import Path

import pytest
import yaml

from flywheel.agent import Harness, Limits
from flywheel.config import PipelineConfig
from flywheel.dryrun import dry_run
from flywheel.envs import EnvironmentLoadError, get_environment
from flywheel.envs.support import make_env
from flywheel.envs.support.tasks import (
    HARD_CALLS,
    SLICES,
    parse_request,
    parse_requests,
    task_from_text,
    tool_calls_needed,
)
from flywheel.policies.null import NullPolicy
from flywheel.policies.oracle import OraclePolicy

REPO = Path(__file__).resolve().parent.parent
HARD_FRACTION = 0.3
MAX_TURNS = HARD_CALLS[1] + 1  # every call is a turn, and so is the answer


@pytest.fixture(scope="module")
def env():
    return get_environment("support", args={"hard_fraction": HARD_FRACTION})


@pytest.fixture(scope="module")
def tasks(env):
    return list(islice(env.generate_tasks(0), 700))


@pytest.fixture(scope="module")
def hard(tasks):
    found = [t for t in tasks if t.slice == "hard"]
    assert len(found) >= 200
    return found[:200]


@pytest.fixture(scope="module")
def oracle_episodes(env, hard):
    return Harness(env, Limits(max_turns=MAX_TURNS)).run(OraclePolicy(env), hard)


def _calls(messages: list[dict]) -> int:
    return sum(len(m.get("tool_calls") or []) for m in messages)


def _answer(task) -> dict:
    return json.loads(task.answer)


def _replace_answer(messages: list[dict], text: str) -> list[dict]:
    return messages[:-1] + [{"role": "assistant", "content": text}]


def test_the_oracle_solves_every_hard_task_through_the_harness_and_doing_nothing_scores_zero(env, hard,
                                                                                              oracle_episodes):
    assert all(e.reward == 1.0 and e.passed and e.stop == "answer" for e in oracle_episodes), \
        next(e.messages for e in oracle_episodes if not e.passed)
    assert all(e.breakdown == {"resolved": 1.0, "db_matches": 1.0, "policy_kept": 1.0, "facts_stated": 1.0}
               for e in oracle_episodes)
    null = Harness(env, Limits(max_turns=MAX_TURNS)).run(NullPolicy(), hard)
    assert all(e.reward == 0.0 for e in null)


def test_every_hard_episode_takes_five_to_twelve_tool_calls(oracle_episodes):
    calls = collections.Counter(_calls(e.messages) for e in oracle_episodes)
    assert min(calls) >= HARD_CALLS[0] == 5 and max(calls) <= HARD_CALLS[1] == 12, calls
    assert len(calls) >= 3, calls  # a spread, not one length
    assert all(_calls(e.messages) == tool_calls_needed(_answer(e.task)) for e in oracle_episodes)


def test_hard_tasks_mix_allowed_and_refused_requests(hard):
    parts = [p for t in hard for p in _answer(t)["parts"]]
    assert {len(_answer(t)["parts"]) for t in hard} <= {2, 3, 4}
    assert {p["reason"] for p in parts if p["outcome"] == "refuse"} == {"not_owner", "status", "same_speed"}
    assert {p["outcome"] for p in parts} == {"do", "lookup", "refuse", "confirm"}
    mixed = [t for t in hard if _answer(t)["writes"] and any(p["outcome"] == "refuse" for p in _answer(t)["parts"])]
    assert len(mixed) > len(hard) / 3
    for task in hard:  # one request per order, and the plan's writes and facts are its parts' in order
        answer = _answer(task)
        assert len({p["order_id"] for p in answer["parts"]}) == len(answer["parts"])
        assert answer["writes"] == [w for p in answer["parts"] for w in p["writes"]]
        assert answer["facts"] == [f for p in answer["parts"] for f in p["facts"]]


def test_a_hard_task_round_trips_through_its_first_message(env, hard, oracle_episodes):
    for task in hard:
        again = task_from_text(task.prompt[1]["content"], 0)
        assert (again.task_id, again.answer, again.slice, again.prompt) == (task.task_id, task.answer, "hard",
                                                                            task.prompt)
    # a recorded conversation: another system prompt, null contents beside calls
    messages = oracle_episodes[0].messages
    recorded = [{"role": "system", "content": "You are a helpful agent."}] + [
        {**m, "content": None} if m.get("tool_calls") else m for m in messages[1:]]
    found = env.task_from_messages(recorded)
    assert found.task_id == oracle_episodes[0].task.task_id and env.score(found, recorded).passed


def test_the_example_message_is_read_request_by_request():
    text = ("Hi! leo.ray@mail.com here. Order W7013 arrived damaged. And can you check order W6351? "
            "Also, I'd like express shipping for order W4198. I confirm.")
    requests = parse_requests(text)
    assert [(r.order_id, r.kind, r.confirmed, r.speed, r.problem) for r in requests] == [
        ("W7013", "transfer", True, None, "damaged"), ("W6351", "lookup", True, None, None),
        ("W4198", "modify", True, "express", None)]


def test_messages_naming_one_order_read_as_they_always_did(tasks):
    for task in [t for t in tasks if t.slice != "hard"][:100]:
        text = task.prompt[1]["content"]
        assert parse_requests(text) == [parse_request(text)]
    # several orders that cannot be read one by one (an order named with no intent, one order asked two things)
    for text in ["Hi! ana.lee@mail.com here. Please cancel order W1234. The receipt says W5678.",
                 "Hi! ana.lee@mail.com here. Cancel W1234. Where is W1234? Refund W5678."]:
        assert parse_requests(text) == [parse_request(text)]


def test_the_other_tasks_are_todays_stream_and_the_hard_share_is_hard_fraction(tasks):
    today = list(islice(get_environment("support").generate_tasks(0), 600))
    others = [t for t in tasks if t.slice != "hard"]
    assert [t.task_id for t in others] == [t.task_id for t in today[:len(others)]]
    assert not [t for t in today if t.slice == "hard"]
    shares = collections.Counter(t.slice for t in tasks)
    assert abs(shares["hard"] / len(tasks) - HARD_FRACTION) < 0.05, shares
    for name, share in SLICES.items():
        assert abs(shares[name] / len(tasks) - share * (1 - HARD_FRACTION)) < 0.06, (name, shares)
    again = list(islice(make_env(hard_fraction=HARD_FRACTION).generate_tasks(0), 100))
    assert [t.task_id for t in again] == [t.task_id for t in tasks[:100]]  # deterministic per seed


@pytest.mark.parametrize("bad", [1.0, -0.1, 1.5, "0.2", True, None])
def test_hard_fraction_is_checked(bad):
    with pytest.raises(ValueError, match=r"environment\.args\.hard_fraction"):
        make_env(hard_fraction=bad)
    with pytest.raises(EnvironmentLoadError, match=r"environment\.args\.hard_fraction"):
        get_environment("support", args={"hard_fraction": bad})


def test_hard_answers_are_scored_order_by_order(env, hard, oracle_episodes):
    by_task = {e.task.task_id: e.messages for e in oracle_episodes}
    # two orders the policy treats differently: with their ids swapped the answer states every fact, each
    # about the wrong order
    task = next(t for t in hard if _answer(t)["parts"][0]["outcome"] != _answer(t)["parts"][1]["outcome"])
    messages, parts = by_task[task.task_id], _answer(task)["parts"]
    first, second = parts[0]["order_id"], parts[1]["order_id"]
    reply = messages[-1]["content"]
    swapped = reply.replace(first, "@@").replace(second, first).replace("@@", second)
    assert env.score(task, _replace_answer(messages, reply)).passed
    score = env.score(task, _replace_answer(messages, swapped))
    assert score.breakdown["facts_stated"] < 1.0 and score.reward == 0.0
    # one part left out of the answer
    short = " ".join(p["reply"] for p in parts[:-1])
    assert env.score(task, _replace_answer(messages, short)).breakdown["facts_stated"] < 1.0


def test_a_missing_or_forbidden_write_in_a_hard_task_scores_zero(env, hard, oracle_episodes):
    by_task = {e.task.task_id: e.messages for e in oracle_episodes}
    task = next(t for t in hard if _answer(t)["writes"])
    messages = by_task[task.task_id]
    write = _answer(task)["writes"][0][0]
    # the first write's call and its result dropped: the answer still reads right, the database does not
    i = next(i for i, m in enumerate(messages) if (m.get("tool_calls") or [{}])[0].get("function", {}).get("name")
             == write)
    score = env.score(task, messages[:i] + messages[i + 2:])
    assert score.breakdown["db_matches"] == 0.0 and score.breakdown["facts_stated"] == 1.0 and score.reward == 0.0

    task = next(t for t in hard if any(p["outcome"] == "refuse" and p["kind"] in ("cancel", "refund")
                                       for p in _answer(t)["parts"]))
    part = next(p for p in _answer(task)["parts"] if p["outcome"] == "refuse" and p["kind"] in ("cancel", "refund"))
    name = {"cancel": "cancel_order", "refund": "refund_order"}[part["kind"]]
    messages = by_task[task.task_id]
    tried = messages[:-1] + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c_x", "type": "function",
             "function": {"name": name, "arguments": json.dumps({"order_id": part["order_id"]})}}]},
        {"role": "tool", "tool_call_id": "c_x", "content": "{}"}, messages[-1]]
    assert env.score(task, tried).breakdown["policy_kept"] == 0.0


def test_too_few_turns_cut_a_hard_episode_unresolved(env, hard):
    task = next(t for t in hard if tool_calls_needed(_answer(t)) == HARD_CALLS[0] + 1)
    before = env.counters.get("conversations_cut", 0)
    (cut,) = Harness(env, Limits(max_turns=6)).run(OraclePolicy(env), [task])  # the support pipeline's limit
    assert cut.stop == "max_turns" and cut.reward == 0.0 and _calls(cut.messages) == 6
    assert env.counters["conversations_cut"] == before + 1
    (whole,) = Harness(env, Limits(max_turns=7)).run(OraclePolicy(env), [task])  # its calls and the answer
    assert whole.stop == "answer" and whole.passed


def test_the_dry_run_with_hard_tasks_is_clean(env):
    small = yaml.safe_load((REPO / "tests" / "conftest.py").read_text().split('SMALL_PIPELINE = """')[1]
                           .split('"""')[0])["pipelines"]["small"]
    small["environment"] = {"name": "support", "args": {"hard_fraction": HARD_FRACTION}, "train_tasks": 80,
                            "heldout_tasks": 20, "max_turns": MAX_TURNS}
    cfg = PipelineConfig.model_validate(small)
    report = dry_run("support", cfg, Harness(env, Limits.from_config(cfg.environment)))
    slices = collections.Counter(e.task.slice for e in report.solver.episodes)
    assert slices["hard"] > 10, slices
    assert report.solver.passed == len(report.solver.episodes) == report.checked == 100
    assert report.null.mean_reward == 0.0 and not report.errors and not report.solver.tool_bugs
