"""The support desk's multi_turn mode: a scripted customer who holds details back, confirms and changes their mind."""

from __future__ import annotations

import collections
import json
from itertools import islice

import pytest

from flywheel.agent import Harness, Limits
from flywheel.contract import STOP
from flywheel.envs import get_environment
from flywheel.envs.support.multi_turn import SLICES, customer
from flywheel.envs.support.tasks import _directory, parse_request
from flywheel.policies.base import Completion
from flywheel.policies.null import NullPolicy
from flywheel.policies.oracle import OraclePolicy

LIMITS = Limits(max_turns=10, max_error_turns=1)


@pytest.fixture(scope="module")
def env():
    return get_environment("support", args={"mode": "multi_turn"})


@pytest.fixture(scope="module")
def tasks(env):
    return list(islice(env.generate_tasks(0), 180))


@pytest.fixture(scope="module")
def solved(env, tasks):
    return Harness(env, LIMITS).run(OraclePolicy(env), tasks)


def _of(episodes, slice_: str):
    return [e for e in episodes if e.task.slice == slice_]


def _user_lines(messages: list[dict]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "user"]


def test_the_oracle_asks_and_solves_every_slice_and_the_customer_ends_each_conversation(solved):
    assert {e.task.slice for e in solved} == set(SLICES)
    failed = [(e.task.slice, e.breakdown) for e in solved if not e.passed]
    assert not failed, failed
    assert all(e.stop == "answer" for e in solved), collections.Counter(e.stop for e in solved)
    # a withholding task is a conversation: the customer spoke after the first message
    for slice_ in ("ask_email", "ask_order", "confirm", "changes_mind"):
        assert all(len(_user_lines(e.messages)) >= 2 for e in _of(solved, slice_)), slice_
    assert all(len(_user_lines(e.messages)) == 1 for e in _of(solved, "lookup"))


def test_the_first_message_leaves_out_what_the_customer_gives_when_asked(solved):
    email_task = _of(solved, "ask_email")[0]
    email = email_task.task.data["withheld"]["email"]
    opening, *later = _user_lines(email_task.messages)
    assert email not in opening and any(email in line for line in later)
    order_task = _of(solved, "ask_order")[0]
    order = order_task.task.data["withheld"]["order"]
    opening, *later = _user_lines(order_task.messages)
    assert order not in opening and any(order in line for line in later)


def test_the_customer_stops_when_asked_nothing_it_can_give(env, tasks):
    task = next(t for t in tasks if t.slice == "ask_email")
    opening = [*task.prompt, {"role": "assistant", "content": "Your order is on its way."}]
    assert customer(task, opening) == STOP
    asked = [*task.prompt, {"role": "assistant", "content": "Please tell me your email."}]
    reply = env.user_turn(task, asked)
    assert reply == {"role": "user", "content": f"It's {task.data['withheld']['email']}"}
    # asked again for what it already gave, the customer has nothing more to say
    assert env.user_turn(task, [*asked, reply, {"role": "assistant", "content": "And your email?"}]) is None


def test_the_null_policy_scores_zero(env, tasks):
    episodes = Harness(env, LIMITS).run(NullPolicy(), tasks)
    assert not any(e.passed for e in episodes) and max(e.reward for e in episodes) == 0.0


def _answered_instead(completion: Completion) -> Completion:
    """The oracle's message, or a closing answer where it asks the customer something."""
    text = completion.message.get("content") or ""
    if "Please tell me" in text or "Please confirm" in text:
        return Completion(message={"role": "assistant", "content": "All done, thank you."}, token_ids=[])
    return completion


class NeverAsks(OraclePolicy):
    """The oracle, except that where it would ask the customer something it answers instead."""

    name = "never-asks"

    def generate(self, conversations, tools, sampling, states=None):
        return [_answered_instead(c) for c in super().generate(conversations, tools, sampling, states=states)]


def test_a_student_that_never_asks_fails_the_withholding_tasks(env, tasks, solved):
    episodes = Harness(env, LIMITS).run(NeverAsks(env), tasks)
    for slice_ in ("ask_email", "ask_order", "confirm", "changes_mind"):
        assert not any(e.passed for e in _of(episodes, slice_)), slice_
    assert all(e.passed for e in episodes if e.task.slice in ("lookup", "refuse"))


def test_using_a_detail_before_the_customer_gave_it_fails_on_asked(env, solved):
    """The right final state and answer are not enough: a guessed order id, or a write before the customer
    confirmed, fails `asked` (the order asked and the confirmation cut out of the oracle's conversation)."""
    episode = next(e for e in _of(solved, "ask_order") if e.task.data["writes"])
    order = episode.task.data["withheld"]["order"]
    kept = [m for m in episode.messages if not (m["role"] == "user" and order in m["content"])
            and "Please tell me" not in (m.get("content") or "")]
    score = env.score(episode.task, kept)
    assert score.breakdown["db_matches"] == score.breakdown["facts_stated"] == 1.0
    assert score.breakdown["asked"] == 0.0 and not score.passed
    episode = _of(solved, "confirm")[0]
    kept = [m for m in episode.messages if "confirm" not in (m.get("content") or "").lower()]
    score = env.score(episode.task, kept)
    assert score.breakdown["db_matches"] == 1.0 and score.breakdown["asked"] == 0.0 and not score.passed


def test_a_customer_who_changes_their_mind_is_scored_on_the_final_wish(env, solved):
    for episode in _of(solved, "changes_mind"):
        data = episode.task.data
        assert data["mind"] in _user_lines(episode.messages)
        given_up = parse_request(episode.task.prompt[-1]["content"])  # what the opening asked
        assert given_up.kind != data["kind"]
        # an agent that does what the opening asked once the customer says "I confirm" writes the wrong thing
        oid = data["order_id"]
        name, arguments = {"cancel": ("cancel_order", {"order_id": oid}),
                           "modify": ("change_shipping", {"order_id": oid, "speed": given_up.speed}),
                           "refund": ("refund_order", {"order_id": oid})}[given_up.kind]
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c_0", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}
        wrote = [*episode.messages[:-1], call, {"role": "tool", "tool_call_id": "c_0", "content": "{}"},
                 episode.messages[-1]]
        assert env.score(episode.task, episode.messages).passed
        assert not env.score(episode.task, wrote).passed


def test_the_conversations_are_the_same_every_run(env, tasks, solved):
    again = get_environment("support", args={"mode": "multi_turn"})
    assert [t.task_id for t in islice(again.generate_tasks(0), len(tasks))] == [t.task_id for t in tasks]
    rerun = Harness(again, LIMITS).run(OraclePolicy(again), tasks[:30])
    assert [e.messages for e in rerun] == [e.messages for e in solved[:30]]


def test_the_default_mode_is_unchanged_and_a_bad_mode_is_named():
    single = next(iter(get_environment("support").generate_tasks(0)))
    assert "Missing email" not in single.prompt[0]["content"]
    with pytest.raises(ValueError, match="mode must be one of single_turn, multi_turn"):
        get_environment("support", args={"mode": "chatty"})


def test_a_recorded_conversation_is_read_back_as_the_task_it_was(env, solved):
    """A task is its first message: a recorded conversation (another system prompt, as a log holds it) gives the
    same task back, of every slice, and scores as it did; a customer with several orders who names none is no
    task (which order they mean is theirs to say)."""
    for slice_ in SLICES:
        episode = _of(solved, slice_)[0]
        recorded = [{"role": "system", "content": "You are a helpful agent."}, *episode.messages[1:]]
        found = env.task_from_messages(recorded)
        assert found is not None and (found.task_id, found.answer) == (episode.task.task_id, episode.task.answer)
        assert env.score(found, recorded).passed
    users, orders = _directory(0)
    owned = collections.Counter(row[1] for row in orders.values())
    for email, user_id in sorted(users.items()):
        vague = env.task_from_messages([{"role": "user", "content": f"Hi! {email} here. Please cancel my order."}])
        assert (vague is None) == (owned[user_id] > 1), email
        assert vague is None or vague.slice == "ask_order"
