"""`flywheel serve-model` keeps OpenAI's chat.completions contract, driven over HTTP by the official `openai` client
as an application drives it: tool_choice, parallel_tool_calls, stop, max_completion_tokens, n, seed, usage, the
stream's chunks (a tool call assembled from its deltas, the usage chunk) and error bodies.

One server for the module, on the tiny random student registered as version 1. Where a test needs the model to
write something exact (a tool call, two, a stop sequence), `writes` swaps the engine's policy for one that writes
that text; it is read back by the harness's own parser and counted by the student's tokenizer, as the real
policy's text is. The tiny student itself never calls tools on its own.
"""

from __future__ import annotations

import json

import openai
import pytest

from flywheel.envs.calculator import CalculatorEnv
from flywheel.policies.toolcalls import parse_completion

NAME = "contract"
CALCULATOR = CalculatorEnv().tools()
LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "Look an order up.", "parameters": {
    "type": "object", "properties": {"order": {"type": "integer"}}, "required": ["order"]}}}
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "76 - 70"}}</tool_call>'
QUESTION = [{"role": "user", "content": "76 - 70 = ?"}]


@pytest.fixture(scope="module")
def server(serve_tiny):
    """`serve-model` following 'contract'@champion, version 1 being the tiny random student."""
    with serve_tiny(NAME) as running:
        yield running


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)


class Writes:
    """A policy writing one text for every conversation, parsed and tokenized as the hf policy's text is."""

    name = "writes"

    def __init__(self, text: str, tokenizer):
        self.text, self.tokenizer = text, tokenizer

    def generate(self, conversations, tools, sampling):
        ids = self.tokenizer.encode(self.text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        completions = [parse_completion(self.text) for _ in conversations]
        for completion in completions:
            completion.token_ids = list(ids)
        return completions


@pytest.fixture
def writes(server):
    """writes(text): from now on, until the test ends, the served model writes `text`."""
    engine = server.follower.current.engine
    student = engine.policy
    yield lambda text: setattr(engine, "policy", Writes(text, engine.tokenizer))
    engine.policy = student


def test_a_plain_call_counts_usage_and_max_completion_tokens_wins(client):
    answer = client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0.0, max_tokens=40,
                                            max_completion_tokens=3)
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    assert answer.model == NAME and answer.system_fingerprint == f"{NAME}-v1"
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.message.tool_calls is None
    assert answer.usage.completion_tokens <= 3 and answer.usage.prompt_tokens > 0
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    assert choice.finish_reason == ("length" if answer.usage.completion_tokens == 3 else "stop")


def test_n_choices_are_reproducible_with_a_seed_and_count_the_prompt_once(client):
    def ask(seed: int):
        return client.chat.completions.create(model=NAME, messages=QUESTION, temperature=1.0, n=2, seed=seed,
                                              max_tokens=8)

    first, again, other = ask(7), ask(7), ask(8)
    assert [c.index for c in first.choices] == [0, 1]
    contents = [c.message.content for c in first.choices]
    assert contents == [c.message.content for c in again.choices]
    assert contents != [c.message.content for c in other.choices]
    one = client.chat.completions.create(model=NAME, messages=QUESTION, temperature=1.0, seed=7, max_tokens=8)
    assert first.usage.prompt_tokens == one.usage.prompt_tokens


def test_a_stream_has_openai_chunks_and_the_usage_when_asked(client):
    plain = client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0.0, max_tokens=6)
    chunks = list(client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0.0, max_tokens=6,
                                                 stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and {c.object for c in chunks} == {"chat.completion.chunk"}
    assert {(c.model, c.system_fingerprint) for c in chunks} == {(NAME, f"{NAME}-v1")}
    assert all(c.created for c in chunks)
    *answer, last = chunks
    assert answer[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in answer) == plain.choices[0].message.content
    assert answer[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert all(c.usage is None for c in answer)
    assert last.choices == [] and last.usage == plain.usage
    unasked = list(client.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=2, stream=True))
    assert all(c.choices and c.usage is None for c in unasked)


def test_a_streamed_tool_call_is_assembled_from_its_deltas(client, writes):
    writes("Let me work it out. " + CALL)
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(model=NAME, messages=QUESTION, tools=CALCULATOR, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += part.id or ""
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me work it out." and finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["id"].startswith("call_") and calls[0]["name"] == "calculator"
    assert json.loads(calls[0]["arguments"]) == {"expression": "76 - 70"}


def test_tool_choice_auto_none_and_no_tools(client, writes):
    writes("Let me work it out. " + CALL)
    auto = client.chat.completions.create(model=NAME, messages=QUESTION, tools=CALCULATOR, tool_choice="auto")
    assert auto.choices[0].finish_reason == "tool_calls"
    assert auto.choices[0].message.tool_calls[0].function.name == "calculator"
    # "none", or no tools at all: never tool calls; the call the model wrote anyway is cut from the content
    for asked in ({"tools": CALCULATOR, "tool_choice": "none"}, {}):
        answer = client.chat.completions.create(model=NAME, messages=QUESTION, **asked)
        message = answer.choices[0].message
        assert message.tool_calls is None and message.content == "Let me work it out.", asked
        assert answer.choices[0].finish_reason == "stop"
    for stream in ({"tools": CALCULATOR, "tool_choice": "none"}, {}):
        chunks = list(client.chat.completions.create(model=NAME, messages=QUESTION, stream=True, **stream))
        assert not any(c.choices[0].delta.tool_calls for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_tool_choice_required_answers_with_a_call_or_refuses(client, server, writes):
    writes(CALL)
    answer = client.chat.completions.create(model=NAME, messages=QUESTION, tools=CALCULATOR, tool_choice="required")
    assert answer.choices[0].message.tool_calls[0].function.name == "calculator"
    recorded = server.traffic.recorded
    writes("6")
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.chat.completions.create(model=NAME, messages=QUESTION, tools=CALCULATOR, tool_choice="required")
    assert refused.value.code == "tool_choice_not_met" and refused.value.param == "tool_choice"
    assert "choice 0 has none" in refused.value.message and "'6'" in refused.value.message
    assert server.traffic.recorded == recorded
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        client.chat.completions.create(model=NAME, messages=QUESTION, tool_choice="required")


def test_a_named_tool_choice_calls_only_that_function(client, writes):
    writes(CALL)
    tools = CALCULATOR + [LOOKUP]
    named = client.chat.completions.create(model=NAME, messages=QUESTION, tools=tools, tool_choice={
        "type": "function", "function": {"name": "calculator"}})
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["calculator"]
    with pytest.raises(openai.UnprocessableEntityError, match="a call to 'lookup'"):
        client.chat.completions.create(model=NAME, messages=QUESTION, tools=tools, tool_choice={
            "type": "function", "function": {"name": "lookup"}})
    with pytest.raises(openai.BadRequestError, match="'search', which is not among the request's tools") as bad:
        client.chat.completions.create(model=NAME, messages=QUESTION, tools=tools, tool_choice={
            "type": "function", "function": {"name": "search"}})
    assert bad.value.param == "tool_choice" and bad.value.type == "invalid_request_error"


def test_parallel_tool_calls_false_answers_with_one_call(client, writes):
    writes(CALL + CALL.replace("76 - 70", "6 * 7"))
    both = client.chat.completions.create(model=NAME, messages=QUESTION, tools=CALCULATOR)
    assert [json.loads(c.function.arguments)["expression"] for c in both.choices[0].message.tool_calls] == [
        "76 - 70", "6 * 7"]
    one = client.chat.completions.create(model=NAME, messages=QUESTION, tools=CALCULATOR, parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1 and one.choices[0].finish_reason == "tool_calls"


def test_stop_cuts_the_content(client, writes):
    writes("The answer is 6. END of the answer.")
    for stop in ("END", ["nowhere", "6.", "END"]):
        answer = client.chat.completions.create(model=NAME, messages=QUESTION, stop=stop)
        assert answer.choices[0].finish_reason == "stop"
        assert answer.choices[0].message.content == ("The answer is 6. " if stop == "END" else "The answer is ")
    assert client.chat.completions.create(model=NAME, messages=QUESTION, stop=["none of it"]).choices[
        0].message.content == "The answer is 6. END of the answer."


@pytest.mark.parametrize("change, param, says", [
    ({"n": 0}, "n", "n must be an integer in [1, 16]"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "up to 4"),
    ({"tool_choice": "sometimes", "tools": CALCULATOR}, "tool_choice", "'none', 'auto', 'required'"),
    ({"max_completion_tokens": 0, "max_tokens": 8}, "max_completion_tokens", "max_completion_tokens must be"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only with stream: true"),
    ({"parallel_tool_calls": "no", "tools": CALCULATOR}, "parallel_tool_calls", "true or false"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages", "messages:"),
])
def test_bad_parameters_raise_bad_request_with_openai_error_bodies(client, server, change, param, says):
    recorded = server.traffic.recorded
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**{"model": NAME, "messages": QUESTION} | change)
    error = refused.value
    assert error.status_code == 400 and error.param == param and error.type == "invalid_request_error"
    assert says in error.message and set(error.body) == {"message", "type", "param", "code"}
    assert server.traffic.recorded == recorded


def test_an_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError, match="does not exist here") as missing:
        client.chat.completions.create(model="someone-else", messages=QUESTION)
    assert missing.value.code == "model_not_found" and missing.value.type == "not_found_error"


class Fails:
    name = "fails"

    def generate(self, conversations, tools, sampling):
        raise RuntimeError("CUDA out of memory")


def test_a_failed_generation_is_a_500_with_openai_error_body(client, server):
    engine = server.follower.current.engine
    student, engine.policy = engine.policy, Fails()
    try:
        with pytest.raises(openai.InternalServerError, match="RuntimeError: CUDA out of memory") as failed:
            client.chat.completions.create(model=NAME, messages=QUESTION)
    finally:
        engine.policy = student
    assert failed.value.type == "server_error"
