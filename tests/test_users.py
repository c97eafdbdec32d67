"""User simulators (flywheel/envs/users.py): a scripted SDK user, and the LLM user against the test OpenAI server."""

from __future__ import annotations

import json
import pickle
import re
import socket

import pytest

from flywheel.agent import Harness, Limits
from flywheel.config import UserConfig
from flywheel.envs.sdk import STOP, Env, Reward, Task, ToolError, UserError
from flywheel.envs.users import LLMUser, visible_conversation
from flywheel.policies.oracle import OraclePolicy

ORDERS = {"O-1001": "shipped", "O-2002": "delayed"}
AGENT_PROMPT = "You are the shop's agent. SECRET: never refund more than 50 EUR."


def lookup_order(order_id: str) -> str:
    """Look up an order by its id.

    Args:
        order_id: the order's id, e.g. "O-1001"
    """
    if order_id not in ORDERS:
        raise ToolError(f"no order {order_id}")
    return json.dumps({"order_id": order_id, "status": ORDERS[order_id]})


def agent(messages: list[dict]) -> dict:
    """The shop's scripted agent: asks for the order id, looks it up, tells the status."""
    last = messages[-1]
    if last["role"] == "tool":
        status = json.loads(last["content"])["status"]
        return {"role": "assistant", "content": f"Your order is {status}. Anything else?"}
    found = re.search(r"O-\d+", last["content"])
    if found:
        call = {"id": "c", "type": "function",
                "function": {"name": "lookup_order", "arguments": json.dumps({"order_id": found.group()})}}
        return {"role": "assistant", "content": "", "tool_calls": [call]}
    return {"role": "assistant", "content": "Could you give me your order id?"}


def told_status(task: Task, messages: list[dict]) -> float:
    final = messages[-1].get("content") or ""
    return float(messages[-1]["role"] == "assistant" and task.data["status"] in final)


def customer(task: Task, messages: list[dict]) -> str:
    """The scripted user: gives the order id when asked, then is done."""
    if "order id" in messages[-1]["content"]:
        return f"It is {task.data['order_id']}."
    return f"No, thanks. {STOP}"


def shop_task(order_id: str = "O-1001", **data) -> Task:
    prompt = [{"role": "system", "content": AGENT_PROMPT}, {"role": "user", "content": "Where is my order?"}]
    answer = {"order_id": order_id, "status": ORDERS[order_id], **data}
    return Task(f"t-{order_id}", "shop", prompt, json.dumps(answer), "all")


def no_tasks(seed: int):
    return iter(())


def shop(user=None) -> Env:
    return Env("shop", tools=[lookup_order], tasks=no_tasks, rewards=[Reward(told_status, name="status")],
               solver=agent, user=user)


def llm_user(server, tmp_path, **options) -> LLMUser:
    return LLMUser("user-model", base_url=server.url, cache=tmp_path / "user-cache.sqlite", timeout_s=2.0,
                   **options)


# --- the SDK's scripted user ---------------------------------------------------------------------------------

def test_a_scripted_user_carries_the_episode_over_several_turns():
    env = shop(user=customer)
    (episode,) = Harness(env, Limits(max_turns=6)).run(OraclePolicy(env), [shop_task()])
    said = [(m["role"], m.get("content")) for m in episode.messages if m["role"] in ("user", "assistant")]
    assert said == [("user", "Where is my order?"), ("assistant", "Could you give me your order id?"),
                    ("user", "It is O-1001."), ("assistant", ""),
                    ("assistant", "Your order is shipped. Anything else?")]
    assert episode.messages[5]["role"] == "tool"
    assert episode.stop == "answer" and episode.turns == 3 and episode.reward == 1.0


def test_without_a_user_the_conversation_ends_at_the_first_answer():
    env = shop()
    (episode,) = Harness(env, Limits(max_turns=6)).run(OraclePolicy(env), [shop_task()])
    assert episode.messages[-1]["content"] == "Could you give me your order id?" and episode.turns == 1
    assert env.user_turn(shop_task(), episode.messages) is None


def test_a_user_may_read_the_state_and_answer_with_a_message():
    seen = []

    def with_state(task, messages, state):
        seen.append(state)
        return {"role": "user", "content": f"It is {task.data['order_id']}."} if len(seen) == 1 else None

    env = Env("shop", tools=[lookup_order], tasks=no_tasks, rewards=[told_status], solver=agent,
              setup=lambda task: {"desk": task.task_id}, user=with_state)
    (episode,) = Harness(env, Limits(max_turns=6)).run(OraclePolicy(env), [shop_task("O-2002")])
    assert seen == [{"desk": "t-O-2002"}, {"desk": "t-O-2002"}]
    assert episode.messages[-1]["content"] == "Your order is delayed. Anything else?" and episode.reward == 1.0


def test_a_user_that_raises_or_returns_nonsense_is_a_user_error():
    def broken(task, messages):
        raise KeyError("order_id")

    env = shop(user=broken)
    conversation = shop_task().prompt + [{"role": "assistant", "content": "Your order id?"}]
    with pytest.raises(UserError, match=r"environment 'shop': user 'broken' raised KeyError: 'order_id'"):
        env.user_turn(shop_task(), conversation)
    env = shop(user=lambda task, messages: 42)
    with pytest.raises(UserError, match="returned int 42"):
        env.user_turn(shop_task(), conversation)
    env = shop(user=broken)
    (episode,) = Harness(env, Limits(max_turns=6)).run(OraclePolicy(env), [shop_task()])  # the harness counts it once
    assert episode.stop == "user_error" and not episode.scored and env.counters["user_errors"] == 1
    with pytest.raises(TypeError, match="user must be a function"):
        shop(user="the customer")


# --- the LLM user against the test server ----------------------------------------------------------------------

SCENARIO = "Where is my order? My order id is O-1001."


def test_the_llm_user_goes_on_then_stops(openai_server, tmp_path):
    user = llm_user(openai_server, tmp_path)
    conversation = shop_task().prompt + [{"role": "assistant", "content": "Could you give me your order id?"}]
    reply = user.reply(SCENARIO, conversation)
    assert reply == {"role": "user", "content": "My order id is O-1001."}
    conversation += [reply, {"role": "assistant", "content": "Your order is shipped. Anything else?"}]
    assert user.reply(SCENARIO, conversation) is None  # "Thank you, that is all. ###STOP###"
    assert user.counters["user_requests"] == 2 and user.counters["user_stops"] == 1
    assert user.counters["user_failures"] == 0 and openai_server.answers == 2


def test_an_env_with_an_llm_user_runs_whole_episodes(openai_server, tmp_path):
    env = shop(user=llm_user(openai_server, tmp_path))
    tasks = [shop_task(scenario=SCENARIO),  # the scenario field
             shop_task("O-2002")]  # none: the first user message is the scenario, which gives no order id
    with_scenario, without = Harness(env, Limits(max_turns=8)).run(OraclePolicy(env), tasks)
    assert [m["content"] for m in with_scenario.messages if m["role"] == "user"] == [
        "Where is my order?", "My order id is O-1001."]
    assert with_scenario.stop == "answer" and with_scenario.reward == 1.0
    assert without.stop == "answer" and without.turns == 1 and without.reward == 0.0
    assert env.counters["user_requests"] == 3 and env.counters["user_stops"] == 2


def test_the_llm_user_sees_the_visible_conversation_only(openai_server, tmp_path):
    task = shop_task(scenario=SCENARIO, rubric="RUBRIC: status must be shipped")
    call = {"id": "c0", "type": "function", "function": {"name": "lookup_order", "arguments": '{"order_id": "x"}'}}
    conversation = task.prompt + [
        {"role": "assistant", "content": "Let me check.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c0", "content": "TOOL RESULT: internal note 7"},
        {"role": "assistant", "content": 'Hmm <tool_call>{"name": "lookup_order", "arguments": {"order_id": "y"'},
        {"role": "user", "content": "Error: a <tool_call> was opened but never closed with </tool_call>"},
        {"role": "assistant", "content": "Could you give me your order id?"}]
    shop(user=llm_user(openai_server, tmp_path)).user_turn(task, conversation)
    (request,) = openai_server.received
    text = json.dumps(request)
    for hidden in ("SECRET", "TOOL RESULT", "lookup_order", "tool_call", "RUBRIC", "shipped", "Error:"):
        assert hidden not in text, hidden
    assert "tools" not in request and request["seed"] == 0 and request["temperature"] == 0.0
    roles = [(m["role"], m["content"]) for m in request["messages"][1:]]
    assert roles == [("assistant", "Where is my order?"),
                     ("user", "Let me check.\n\nHmm\n\nCould you give me your order id?")]
    assert SCENARIO in request["messages"][0]["content"] and STOP in request["messages"][0]["content"]


def test_a_written_scenario_is_cached_and_playable(openai_server, tmp_path):
    recorded = shop_task().prompt + [
        {"role": "assistant", "content": "Could you give me your order id?"},
        {"role": "user", "content": "It is O-1001."},
        {"role": "assistant", "content": "Your order is shipped. SECRET detail."}]
    scenario = llm_user(openai_server, tmp_path).write_scenario(recorded)
    assert scenario == "Where is my order?\nIt is O-1001."  # the test server's rule: the customer's lines
    (request,) = openai_server.received
    assert "SECRET" not in json.dumps(request) and "order id?" not in json.dumps(request)
    again = llm_user(openai_server, tmp_path)  # a second run: the same cache file
    assert again.write_scenario(recorded) == scenario and openai_server.answers == 1
    assert again.counters["user_scenarios"] == 1
    reply = again.reply(scenario, recorded[:3])
    assert reply == {"role": "user", "content": "It is O-1001."}


def test_an_endpoint_that_is_down_is_a_user_error(openai_server, tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    user = LLMUser("user-model", base_url=f"http://127.0.0.1:{port}/v1", max_retries=1, timeout_s=1.0)
    conversation = shop_task().prompt + [{"role": "assistant", "content": "Your order id?"}]
    with pytest.raises(UserError, match="simulated user's model 'user-model' wrote no reply") as caught:
        user.reply(SCENARIO, conversation)
    assert "\n" not in str(caught.value)
    assert user.counters["user_failures"] == 1 and user.counters["user_requests"] == 1

    openai_server.down_after = 0  # it drops every request
    env = shop(user=llm_user(openai_server, tmp_path, max_retries=1))
    with pytest.raises(UserError, match=r"environment 'shop', task t-O-1001: the simulated user's model"):
        env.user_turn(shop_task(), conversation)
    with pytest.raises(UserError):
        env.user.write_scenario(conversation)
    assert env.counters["user_failures"] == 2  # the model's failures; the harness counts episodes (user_errors)


def test_an_llm_user_from_config_pickles_without_its_client(openai_server, tmp_path):
    cfg = UserConfig(kind="openai", model="user-model", base_url=openai_server.url, cache=".flywheel/users.sqlite",
                     max_new_tokens=64)
    user = LLMUser.from_config(cfg, tmp_path)
    conversation = shop_task().prompt + [{"role": "assistant", "content": "Your order id?"}]
    assert user.reply(SCENARIO, conversation)["content"] == "My order id is O-1001."
    assert (tmp_path / ".flywheel" / "users.sqlite").exists() and user._client is not None
    copy = pickle.loads(pickle.dumps(shop(user=user))).user
    assert copy._client is None and copy.counters["user_requests"] == 1
    assert copy.reply(SCENARIO, conversation)["content"] == "My order id is O-1001."
    assert openai_server.answers == 1  # the copy read the same cache
    with pytest.raises(ValueError, match="kind 'openai'"):
        LLMUser.from_config(UserConfig(kind="replay"), tmp_path)


def test_the_visible_conversation_leaves_out_what_the_customer_never_saw():
    messages = [{"role": "system", "content": "hidden"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
                {"role": "tool", "content": "hidden"},
                {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
                {"role": "user", "content": "Error: my own words, after a plain answer"}]
    assert visible_conversation(messages) == [("user", "hi"), ("agent", "hello"),
                                              ("user", "Error: my own words, after a plain answer")]
