"""The calculator environment: the safe tool, seeded tasks, the rubric, and reading tasks back from messages."""

from __future__ import annotations

import json
from itertools import islice

import pytest

from flywheel.contract import prompt_hash
from flywheel.envs import ToolError, get_environment
from flywheel.envs.calculator import CalculatorEnv, evaluate


@pytest.fixture
def env() -> CalculatorEnv:
    return CalculatorEnv()


def test_registry_builds_the_calculator():
    assert isinstance(get_environment("calculator"), CalculatorEnv)


def test_schema_has_one_required_expression(env):
    (tool,) = env.tools()
    assert tool["function"]["name"] == "calculator"
    assert tool["function"]["parameters"]["required"] == ["expression"]
    assert tool["function"]["parameters"]["properties"]["expression"]["type"] == "string"


@pytest.mark.parametrize("expression, expected", [
    ("37 * 12 + 5", "449"), ("48 - 90", "-42"), ("(12 + 7) * 3", "57"), ("-5 + +3", "-2"), ("7 / 2", "3.5"),
    ("6 / 2", "3"), ("7 // 2", "3"), ("7 % 3", "1"), ("2 ** 10", "1024"), ("2 ** -1", "0.5"), ("1.5 * 2", "3"),
    (" 3 + 4 ", "7"), ("2 ** 59", str(2 ** 59)),
])
def test_valid_expressions(env, expression, expected):
    assert env.call_tool("calculator", {"expression": expression}) == expected


@pytest.mark.parametrize("expression, reason", [
    ("().__class__", "not allowed"), ("__import__('os')", "not allowed"), ("x + 1", "not allowed"),
    ("abs(-3)", "not allowed"), ("(1).real", "not allowed"), ("[1, 2][0]", "not allowed"),
    ("'a' * 3", "not a number"), ("True + 1", "not a number"), ("lambda: 1", "not allowed"),
    ("1 < 2", "not allowed"), ("1 if 1 else 2", "not allowed"), ("9**9**9", "exponent"), ("10**100", "too large"),
    ("2 ** 65", "exponent"), ("1e300 * 1e300", "too large"), ("1e999", "too large"), ("(-8) ** 0.5", "real"),
    ("1 / 0", "division by zero"), ("5 % 0", "division by zero"), ("0 ** -1", "division by zero"),
    ("1 +" * 100 + "1", "limit is 200"), ("import os", "not an arithmetic expression"),
    ("1; 2", "not an arithmetic expression"), ("", "not an arithmetic expression"),
])
def test_unsafe_or_invalid_expressions_are_refused(env, expression, reason):
    with pytest.raises(ToolError, match=reason):
        env.call_tool("calculator", {"expression": expression})


def test_bad_calls_are_refused(env):
    with pytest.raises(ToolError, match="unknown tool"):
        env.call_tool("python", {"expression": "1 + 1"})
    with pytest.raises(ToolError, match="'expression'"):
        env.call_tool("calculator", {})
    with pytest.raises(ToolError, match="'expression'"):
        env.call_tool("calculator", {"expression": 42})


def test_tasks_are_seeded_and_cover_every_slice(env):
    first = list(islice(env.generate_tasks(7), 300))
    assert first == list(islice(env.generate_tasks(7), 300))
    assert first != list(islice(env.generate_tasks(8), 300))
    assert {t.slice for t in first} == {"add", "mul", "mixed"}
    assert any(json.loads(t.answer)["value"] < 0 for t in first)
    for task in first:
        assert task.env == "calculator" and task.split == ""  # collect splits it
        assert task.task_id == prompt_hash(task.prompt)
        (message,) = task.prompt
        assert message["role"] == "user" and len(message["content"]) < 40
        answer = json.loads(task.answer)
        assert isinstance(answer["value"], int) and evaluate(answer["expression"]) == answer["value"]
        assert answer["expression"] in message["content"]


def test_slices_follow_the_expression(env):
    for task in islice(env.generate_tasks(3), 200):
        expression = json.loads(task.answer)["expression"]
        operands = len([p for p in expression.replace("(", " ").replace(")", " ").split() if p.isdigit()])
        assert task.slice == {3: "mixed"}.get(operands, "mul" if "*" in expression else "add")


def _answered(task, content, tool_result="449"):
    return task.prompt + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "calculator", "arguments": json.dumps({"expression": "x"})}}]},
        {"role": "tool", "tool_call_id": "c", "content": tool_result},
        {"role": "assistant", "content": content},
    ]


def test_rubric(env):
    task = env.task_from_messages([{"role": "user", "content": "What is 37 * 12 + 5?"}])
    right = env.score(task, _answered(task, "The answer is 449."))
    assert right.reward == 1.0 and right.passed
    assert right.breakdown == {"answer": 1.0, "used_tool": 1.0, "valid_tool_calls": 1.0}

    wrong = env.score(task, _answered(task, "The answer is 448."))
    assert wrong.reward == 0.0 and not wrong.passed and wrong.breakdown["answer"] == 0.0
    # the LAST number counts: restating the question then answering wrongly fails
    assert env.score(task, _answered(task, "37 * 12 + 5 = 450")).reward == 0.0
    assert env.score(task, _answered(task, "12 * 37 + 5 = 449")).reward == 1.0
    assert env.score(task, _answered(task, "It is 449", tool_result="Error: timed out")).breakdown[
        "valid_tool_calls"] == 0.0

    no_tool = env.score(task, task.prompt + [{"role": "assistant", "content": "449"}])
    assert no_tool.reward == 1.0 and no_tool.breakdown["used_tool"] == 0.0

    # an episode that ends on a tool call or a tool result has no answer
    unanswered = _answered(task, "")[:-1]
    assert env.score(task, unanswered).reward == 0.0
    assert env.score(task, unanswered[:-1]).reward == 0.0
    assert env.score(task, task.prompt).reward == 0.0


def test_rubric_reads_negative_answers(env):
    task = env.task_from_messages([{"role": "user", "content": "Compute 48 - 90."}])
    assert env.score(task, task.prompt + [{"role": "assistant", "content": "It is -42."}]).passed
    assert not env.score(task, task.prompt + [{"role": "assistant", "content": "It is 42."}]).passed


def test_task_from_messages_round_trips_generated_prompts(env):
    for task in islice(env.generate_tasks(11), 300):
        assert env.task_from_messages(task.prompt) == task


def test_task_from_messages_reads_the_first_user_message(env):
    conversation = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "hey, can you work out 12*(3+4) for me?"},
                    {"role": "assistant", "content": "84"},
                    {"role": "user", "content": "and 1 + 1?"}]
    task = env.task_from_messages(conversation)
    assert task.prompt == [conversation[1]] and task.slice == "mixed"
    assert json.loads(task.answer) == {"expression": "12*(3+4)", "value": 84}


@pytest.mark.parametrize("content", ["Hello there", "What is 7?", "What is 7 / 2?", "What is __import__('os')?",
                                     "Compute 10**100"])
def test_task_from_messages_refuses_what_it_cannot_verify(env, content):
    assert env.task_from_messages([{"role": "user", "content": content}]) is None


def test_oracle_calls_the_tool_then_answers(env):
    task = next(env.generate_tasks(0))
    value = json.loads(task.answer)["value"]
    call = env.solve(task.prompt)
    (tool_call,) = call["tool_calls"]
    arguments = json.loads(tool_call["function"]["arguments"])
    assert arguments == {"expression": json.loads(task.answer)["expression"]}
    result = env.call_tool("calculator", arguments)
    answer = env.solve(task.prompt + [call, {"role": "tool", "tool_call_id": "call_0", "content": result}])
    assert answer == {"role": "assistant", "content": f"The answer is {value}."}
    failed = env.solve(task.prompt + [call, {"role": "tool", "tool_call_id": "call_0", "content": "Error: x"}])
    assert failed["content"] == f"The answer is {value}."
