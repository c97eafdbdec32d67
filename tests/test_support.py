"""The support desk: its tools, per-episode databases, the rubric, the oracle through the harness, the slices."""

from __future__ import annotations

import collections
import json
from itertools import islice

import pytest

from flywheel.agent import Harness, Limits
from flywheel.envs import ToolError, get_environment
from flywheel.envs.support import db as database
from flywheel.envs.support.tasks import SLICES, task_from_text
from flywheel.policies.oracle import OraclePolicy


@pytest.fixture(scope="module")
def env():
    return get_environment("support")


@pytest.fixture(scope="module")
def tasks(env):
    return list(islice(env.generate_tasks(0), 300))


def _first(tasks, slice_: str):
    return next(t for t in tasks if t.slice == slice_)


def _call(name: str, **arguments) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c_{name}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def _oracle_messages(env, task) -> list[dict]:
    (episode,) = Harness(env, Limits(max_turns=6)).run(OraclePolicy(env), [task])
    assert episode.passed, episode.messages
    return episode.messages


def _score(env, task, messages):
    """Score a conversation as the harness would after replaying its calls in a fresh database."""
    return env.score(task, messages)


def test_tools_read_and_write_the_episode_database(env):
    state = env.start(next(iter(env.generate_tasks(0))))
    try:
        user = state.execute("SELECT user_id, email FROM users ORDER BY user_id").fetchone()
        found = json.loads(env.call_tool("find_user", {"email": user[1].upper()}, state))
        assert found == {"user_id": user[0]}
        orders = json.loads(env.call_tool("list_orders", {"user_id": user[0]}, state))["orders"]
        pending = state.execute("SELECT order_id, total_cents, payment FROM orders WHERE status = 'pending' "
                                "LIMIT 1").fetchone()
        order = json.loads(env.call_tool("get_order", {"order_id": pending[0]}, state))
        assert order["status"] == "pending" and order["total"] == database.money(pending[1])
        cancelled = json.loads(env.call_tool("cancel_order", {"order_id": pending[0]}, state))
        assert cancelled == {"status": "cancelled", "refund": database.money(pending[1]), "to": pending[2]}
        assert state.execute("SELECT amount_cents FROM refunds WHERE order_id = ?", (pending[0],)).fetchone() == \
            (pending[1],)
        with pytest.raises(ToolError, match="already cancelled"):
            env.call_tool("cancel_order", {"order_id": pending[0]}, state)
        with pytest.raises(ToolError, match="no order"):
            env.call_tool("get_order", {"order_id": "W0000"}, state)
        with pytest.raises(ToolError, match="no user"):
            env.call_tool("find_user", {"email": "nobody@mail.com"}, state)
        with pytest.raises(ToolError):  # not one of the schema's enum values: checked before the call
            env.call_tool("change_shipping", {"order_id": orders[0], "speed": "teleport"}, state)
    finally:
        env.finish(state)


def test_schemas_are_generated_from_the_tools(env):
    schemas = {t["function"]["name"]: t["function"] for t in env.tools()}
    assert list(schemas) == ["find_user", "list_orders", "get_order", "cancel_order", "change_shipping",
                             "refund_order", "transfer_to_human"]
    speed = schemas["change_shipping"]["parameters"]["properties"]["speed"]
    assert speed["enum"] == ["standard", "express"]
    assert "state" not in schemas["get_order"]["parameters"]["properties"]


def test_the_database_is_the_same_for_a_seed_and_differs_between_seeds():
    assert database.snapshot(database.fresh(0)) == database.snapshot(database.build(0))
    assert database.snapshot(database.fresh(0)) != database.snapshot(database.fresh(1))


def test_episodes_in_one_batch_write_only_their_own_database(env, tasks):
    cancel = _first(tasks, "cancel")
    again = task_from_text(cancel.prompt[1]["content"].replace("I confirm.", "I confirm, thanks."), 0)
    assert again.task_id != cancel.task_id and json.loads(again.answer)["writes"] == \
        json.loads(cancel.answer)["writes"]
    # both cancel the same order in the same turn: a shared database would refuse the second ("already cancelled")
    episodes = Harness(env, Limits(max_turns=6)).run(OraclePolicy(env), [cancel, again], samples=2)
    assert [e.passed for e in episodes] == [True] * 4, [e.messages[-2:] for e in episodes]
    one, other = env.start(cancel), env.start(cancel)
    try:
        order_id = json.loads(cancel.answer)["order_id"]
        env.call_tool("cancel_order", {"order_id": order_id}, one)
        assert json.loads(env.call_tool("get_order", {"order_id": order_id}, other))["status"] == "pending"
    finally:
        env.finish(one)
        env.finish(other)


def test_the_oracle_solves_the_generated_tasks_through_the_harness(env, tasks):
    episodes = Harness(env, Limits(max_turns=6)).run(OraclePolicy(env), tasks)
    assert sum(e.passed for e in episodes) / len(episodes) >= 0.95
    calls = collections.Counter(sum(len(m.get("tool_calls") or []) for m in e.messages) for e in episodes)
    assert set(calls) <= {2, 3, 4} and calls[4] > 0
    assert all(set(e.breakdown) == {"resolved", "db_matches", "policy_kept", "facts_stated"} for e in episodes)


def test_slices_cover_every_kind_in_their_shares(tasks):
    shares = collections.Counter(t.slice for t in tasks)
    assert set(shares) == set(SLICES)
    for name, share in SLICES.items():
        assert abs(shares[name] / len(tasks) - share) < 0.08, (name, shares)
    for task in tasks:
        answer = json.loads(task.answer)
        assert bool(answer["writes"]) == (task.slice in ("cancel", "modify", "refund", "transfer")), answer
        assert task.prompt[0]["role"] == "system" and "policy" in task.prompt[0]["content"]


def test_right_state_and_facts_score_one_and_the_parts_are_in_the_breakdown(env, tasks):
    for slice_ in SLICES:
        task = _first(tasks, slice_)
        score = _score(env, task, _oracle_messages(env, task))
        assert score.reward == 1.0 and score.passed
        assert score.breakdown == {"resolved": 1.0, "db_matches": 1.0, "policy_kept": 1.0, "facts_stated": 1.0}


def test_a_wrong_write_scores_zero(env, tasks):
    task = _first(tasks, "modify")
    messages = _oracle_messages(env, task)
    wrong = list(messages)
    i = next(i for i, m in enumerate(wrong) if m.get("tool_calls") and
             m["tool_calls"][0]["function"]["name"] == "change_shipping")
    speed = json.loads(task.answer)["writes"][0][1]["speed"]
    other = next(o for o in database.SPEEDS if o != speed)
    wrong[i] = _call("change_shipping", order_id=json.loads(task.answer)["order_id"], speed=other)
    score = _score(env, task, wrong)
    assert score.reward == 0.0 and not score.passed
    assert score.breakdown["db_matches"] == 0.0 and score.breakdown["policy_kept"] == 0.0


def test_an_extra_write_scores_zero(env, tasks):
    task = _first(tasks, "cancel")
    messages = _oracle_messages(env, task)
    order_id = json.loads(task.answer)["order_id"]
    extra = messages[:-1] + [_call("transfer_to_human", order_id=order_id, reason="lost"),
                             {"role": "tool", "tool_call_id": "c_transfer_to_human", "content": "{}"}, messages[-1]]
    score = _score(env, task, extra)
    assert score.reward == 0.0 and score.breakdown["db_matches"] == 0.0
    assert score.breakdown["facts_stated"] == 1.0  # the answer still reads right: it does not save the episode


def test_a_policy_violation_scores_zero_even_when_the_tool_refused_it(env, tasks):
    confirm = _first(tasks, "confirm")  # a write the user did not confirm
    answer = json.loads(confirm.answer)
    messages = _oracle_messages(env, confirm)
    kind = answer["kind"]
    write = {"cancel": ("cancel_order", {}), "refund": ("refund_order", {}),
             "modify": ("change_shipping", {"speed": "express" if "express" in confirm.prompt[1]["content"]
                                            else "standard"})}[kind]
    unconfirmed = messages[:-1] + [_call(write[0], order_id=answer["order_id"], **write[1])]
    score = _score(env, confirm, unconfirmed + [messages[-1]])
    assert score.reward == 0.0 and score.breakdown["policy_kept"] == 0.0

    refuse = next(t for t in tasks if t.slice == "refuse" and json.loads(t.answer).get("reason") == "status"
                  and "cancelled" in json.loads(t.answer)["reply"])  # the tool itself refuses this write
    answer = json.loads(refuse.answer)
    messages = _oracle_messages(env, refuse)
    name = {"cancel": "cancel_order", "refund": "refund_order"}.get(answer["kind"])
    if name:
        tried = messages[:-1] + [_call(name, order_id=answer["order_id"]), messages[-1]]
        score = _score(env, refuse, tried)
        assert score.breakdown["db_matches"] == 1.0 and score.breakdown["policy_kept"] == 0.0
        assert score.reward == 0.0


def test_a_write_before_finding_the_user_is_a_violation(env, tasks):
    task = _first(tasks, "refund")
    messages = _oracle_messages(env, task)
    calls = [m for m in messages if m.get("tool_calls")]
    rushed = [*task.prompt, calls[-1], {"role": "assistant", "content": messages[-1]["content"]}]
    score = _score(env, task, rushed)
    assert score.breakdown["db_matches"] == 1.0 and score.breakdown["policy_kept"] == 0.0 and score.reward == 0.0


def test_missing_facts_score_zero(env, tasks):
    task = _first(tasks, "refund")
    messages = _oracle_messages(env, task)
    vague = messages[:-1] + [{"role": "assistant", "content": "Done, your refund is on its way."}]
    score = _score(env, task, vague)
    assert score.reward == 0.0 and 0.0 <= score.breakdown["facts_stated"] < 1.0
    assert score.breakdown["db_matches"] == 1.0


def test_a_recorded_conversation_is_verified(env, tasks):
    task = _first(tasks, "transfer")
    messages = _oracle_messages(env, task)
    # as a production log holds it: the agent's own system prompt, other call ids, null contents beside calls
    recorded = [{"role": "system", "content": "You are a helpful agent."}]
    for m in messages[1:]:
        m = dict(m)
        if m.get("tool_calls"):
            m["content"] = None
        recorded.append(m)
    found = env.task_from_messages(recorded)
    assert found is not None and found.task_id == task.task_id and found.answer == task.answer
    assert env.score(found, recorded).passed
    slipped = recorded[:-1] + [{"role": "assistant", "content": "A colleague will call you."}]
    assert not env.score(found, slipped).passed
    assert env.task_from_messages([{"role": "user", "content": "What is 2 + 2?"}]) is None
    assert env.task_from_messages([{"role": "user", "content": "Hi, I'm nobody@mail.com. Cancel W1234."}]) is None


def test_with_a_simulated_customer_the_desk_goes_on_until_the_customer_stops(tasks, openai_server):
    """`args: {user: {...}}`: a model plays the customer of each request after every answer (here the test
    server, which has nothing to add to the request and says ###STOP###); the oracle still resolves each."""
    env = get_environment("support", args={"user": {"model": "customer", "base_url": openai_server.url,
                                                    "cache": None}})
    episodes = Harness(env, Limits(max_turns=16)).run(OraclePolicy(env), tasks[:4])
    assert all(e.stop == "answer" and e.passed for e in episodes)
    assert env.counters["user_requests"] == env.counters["user_stops"] == 4 == openai_server.answers
