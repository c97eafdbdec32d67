"""`flywheel serve-model` under concurrent requests: requests for one model share generate calls (counted, not
timed), each client gets its own answer and its own error; tool_choice and environment.constrained_tools reach
the policy; sampled choices that break tool_choice are sampled again, and a call that never parses is cut from the
content with finish_reason malformed_function_call.

One server for the module on the tiny random student. Where a test needs the model to write something exact, the
engine's policy is swapped for one that writes it (as tests/test_openai_contract.py does); `Counted` wraps the
policy in place and records every generate call it gets.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from flywheel.envs.calculator import CalculatorEnv
from flywheel.policies.toolcalls import parse_completion

NAME = "batched"
CALCULATOR = CalculatorEnv().tools()
LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "Look an order up.", "parameters": {
    "type": "object", "properties": {"order": {"type": "integer"}}, "required": ["order"]}}}
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "76 - 70"}}</tool_call>'
BROKEN = 'Let me see. <tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
WAIT_S = 120  # every request's deadline


@pytest.fixture(scope="module")
def server(serve_tiny):
    with serve_tiny(NAME, max_batch=8) as running:
        yield running


class Counted:
    """The policy it wraps, with every generate call recorded: (conversations, tools, sampling)."""

    name = "counted"

    def __init__(self, policy):
        self.policy, self.calls = policy, []

    def generate(self, conversations, tools, sampling):
        self.calls.append((list(conversations), tools, sampling))
        return self.policy.generate(conversations, tools, sampling)


class Writes:
    """Writes, for each conversation, what `text(last user message, how many times it was asked)` says; parsed and
    tokenized as the hf policy's text is. Raises for a conversation that says "boom"."""

    name = "writes"

    def __init__(self, text, tokenizer):
        self.text, self.tokenizer, self.asked = text, tokenizer, {}

    def generate(self, conversations, tools, sampling):
        completions = []
        for conversation in conversations:
            said = conversation[-1]["content"]
            if "boom" in said:
                raise RuntimeError("the model broke on this conversation")
            self.asked[said] = self.asked.get(said, 0) + 1
            text = self.text(said, self.asked[said])
            completion = parse_completion(text)
            completion.token_ids = self.tokenizer.encode(text, add_special_tokens=False) + [
                self.tokenizer.eos_token_id]
            completions.append(completion)
        return completions


@pytest.fixture
def engine(server):
    """The served engine, its policy and batcher settings restored after the test."""
    loaded = server.follower.current
    batcher = loaded.batcher
    kept = loaded.engine.policy, loaded.engine.constrained, batcher.window_s, batcher.window_share, batcher.max_batch
    yield loaded.engine
    loaded.engine.policy, loaded.engine.constrained, batcher.window_s, batcher.window_share, batcher.max_batch = kept


def _gather(server, requests: int) -> None:
    """From now on the first request waits (up to WAIT_S) until `requests` rows are waiting: one call for all."""
    batcher = server.follower.current.batcher
    batcher.window_s, batcher.window_share, batcher.max_batch = WAIT_S, None, requests


def _ask(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/chat/completions", json={"model": NAME, **body}, timeout=WAIT_S)


def _question(i: int) -> list[dict]:
    return next(CalculatorEnv().generate_tasks(100 + i)).prompt


def _at_once(server, bodies: list[dict]) -> list[httpx.Response]:
    """Every body sent at the same time, each by its own client."""
    with ThreadPoolExecutor(max_workers=len(bodies)) as clients:
        return list(clients.map(lambda body: _ask(server, **body), bodies))


def _content(reply: httpx.Response) -> str:
    if reply.headers["content-type"].startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in reply.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    return reply.json()["choices"][0]["message"]["content"]


def test_concurrent_requests_share_one_generate_and_each_gets_its_own_answer(server, engine):
    bodies = [{"messages": _question(i), "temperature": 0.0, "max_tokens": 8, "stream": i == 3} for i in range(8)]
    alone = [_content(_ask(server, **body)) for body in bodies]  # one at a time first
    engine.policy = counted = Counted(engine.policy)
    _gather(server, 8)
    replies = _at_once(server, bodies)
    assert [r.status_code for r in replies] == [200] * 8
    assert len(counted.calls) == 1 and len(counted.calls[0][0]) == 8
    assert sorted(json.dumps(c) for c in counted.calls[0][0]) == sorted(json.dumps(b["messages"]) for b in bodies)
    assert [_content(r) for r in replies] == alone  # greedy: the same answer batched as alone
    assert len({r.json()["id"] for i, r in enumerate(replies) if i != 3}) == 7


def test_requests_that_cannot_share_a_call_and_seeded_ones_run_apart(server, engine):
    engine.policy = counted = Counted(engine.policy)
    batcher = server.follower.current.batcher
    batcher.window_s, batcher.window_share = 2.0, None
    question = _question(0)
    bodies = [{"messages": question, "temperature": 1.0, "max_tokens": 4, "seed": 1},
              {"messages": question, "temperature": 1.0, "max_tokens": 4, "seed": 1},
              {"messages": question, "temperature": 0.0, "max_tokens": 6, "n": 2}]
    replies = _at_once(server, bodies)
    assert [r.status_code for r in replies] == [200] * 3
    assert sorted(len(conversations) for conversations, _, _ in counted.calls) == [1, 1, 2]
    # a seeded request runs alone, so the same seed gives the same answer whatever else was in flight
    assert _content(replies[0]) == _content(replies[1])


def test_errors_stay_with_the_request_that_caused_them(server, engine):
    engine.policy = counted = Counted(Writes(lambda said, _: CALL if "call" in said else "6", engine.tokenizer))
    _gather(server, 4)
    asked = {"tools": CALCULATOR, "tool_choice": "required", "temperature": 0.0, "max_tokens": 32}
    says = ["76 - 70, call it", "76 - 70", "boom", "6 * 7, call it"]
    replies = _at_once(server, [{"messages": [{"role": "user", "content": s}], **asked} for s in says])
    assert [r.status_code for r in replies] == [200, 422, 500, 200]
    assert [r.json()["choices"][0]["finish_reason"] for r in (replies[0], replies[3])] == ["tool_calls"] * 2
    assert replies[1].json()["error"]["code"] == "tool_choice_not_met"
    assert "broke on this conversation" in replies[2].json()["error"]["message"]
    # the shared call failed (boom), so each request was answered again alone
    assert [len(conversations) for conversations, _, _ in counted.calls] == [4, 1, 1, 1, 1]


def test_tool_choice_and_the_constraint_switch_reach_the_policy(server, engine):
    from flywheel.policies.base import Sampling
    from flywheel.policies.openai import OpenAIPolicy

    engine.policy = counted = Counted(Writes(lambda *_: CALL, engine.tokenizer))
    engine.constrained = True
    named = {"type": "function", "function": {"name": "calculator"}}
    for choice, tools, shown, sent in (("required", CALCULATOR, CALCULATOR, "required"),
                                       (named, CALCULATOR + [LOOKUP], CALCULATOR, named),
                                       ("none", CALCULATOR, [], "none"), (None, CALCULATOR, CALCULATOR, "auto")):
        reply = _ask(server, messages=_question(0), tools=tools, temperature=0.0,
                     **({"tool_choice": choice} if choice else {}))
        _, given, sampling = counted.calls[-1]
        assert (given, sampling.tool_choice, sampling.constrained) == (shown, sent, True), choice
        assert reply.json()["choices"][0]["finish_reason"] == ("stop" if choice == "none" else "tool_calls")
    # the openai policy sends the harness's tool_choice on to the endpoint (auto, the default, is not sent)
    policy = OpenAIPolicy(model=NAME, base_url=server.url, max_retries=0)
    done = policy.generate([_question(0)], CALCULATOR, Sampling(tool_choice=named, constrained=True))
    assert counted.calls[-1][2].tool_choice == named and done[0].message["tool_calls"][0]["function"]["name"] == \
        "calculator"


def test_a_sampled_call_that_does_not_parse_is_sampled_again_and_never_returned_as_markup(server, engine):
    from flywheel.policies.base import Sampling
    from flywheel.policies.openai import OpenAIPolicy

    # broken the first time each question is asked, right the second
    engine.policy = counted = Counted(Writes(lambda said, k: BROKEN if k == 1 or "never" in said else CALL,
                                             engine.tokenizer))
    fixed = _ask(server, messages=[{"role": "user", "content": "76 - 70"}], tools=CALCULATOR, temperature=1.0)
    choice = fixed.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and len(counted.calls) == 2
    assert fixed.json()["usage"]["completion_tokens"] == sum(
        len(engine.tokenizer.encode(t, add_special_tokens=False)) + 1 for t in (BROKEN, CALL))
    # never right: the call is cut from the content and the finish reason says why; greedy: not sampled again
    for temperature, calls in ((1.0, 3), (0.0, 1)):
        before = len(counted.calls)
        broken = _ask(server, messages=[{"role": "user", "content": "never"}], tools=CALCULATOR,
                      temperature=temperature).json()["choices"][0]
        assert broken["finish_reason"] == "malformed_function_call" and len(counted.calls) - before == calls
        assert broken["message"]["content"] == "Let me see." and "tool_calls" not in broken["message"]
    required = _ask(server, messages=[{"role": "user", "content": "never"}], tools=CALCULATOR, temperature=1.0,
                    tool_choice="required")
    assert required.status_code == 422 and "in 3 samples" in required.json()["error"]["message"]
    # the openai policy reads the finish reason back as the turn's error: the harness gives an error turn
    got = OpenAIPolicy(model=NAME, base_url=server.url, max_retries=0).generate(
        [[{"role": "user", "content": "never"}]], CALCULATOR, Sampling(temperature=0.0))[0]
    assert got.error and "did not parse" in got.error and "<tool_call>" not in got.message["content"]


def test_the_constraint_switch_is_the_served_pipelines_and_off_for_a_model_no_pipeline_names(tmp_path):
    from flywheel.config import load_pipeline
    from flywheel.serving.server import constrained_tools

    root = Path(__file__).resolve().parents[1]
    for name in ("demo", "support-smol"):
        expected = bool(getattr(load_pipeline(name, root / "pipelines.yaml").environment, "constrained_tools", False))
        assert constrained_tools(root, name) is expected
    assert constrained_tools(root, "no-such-pipeline") is False
    assert constrained_tools(tmp_path, "demo") is False  # no pipelines.yaml there
