"""The replay rubric, from the accepted outcome: the same writes, the same facts, optionally a judge's verdict.

- writes: every recorded state-changing call of the target (tools whose names do not match `reads`) was made
  with matching arguments, none missing and none extra (order free): 1, else 0;
- facts: the share of the accepted answer's facts that came from tool results (numbers, ids, dates, amounts)
  which the model's final answer states; 1 when there are none and the model answered;
- judge (optional): a model's verdict comparing the final answer with the accepted one.
"""

from __future__ import annotations

import re

from flywheel.contract import Score, Task
from flywheel.envs.replay.matching import Call, Matcher
from flywheel.envs.replay.record import call_arguments, facts_in

JUDGE_TEMPLATE = """You compare an assistant's answer with a reference answer that the user accepted.

The user asked: {prompt}
Reference answer: {answer}
Assistant's answer: {final}

Does the assistant's answer give the same outcome and the same information as the reference? Reply with a
short reason, then a last line `SCORE: x` where x is 1 (same), 0 (different or missing) or in between."""


def exchange(task: Task, messages: list[dict]) -> list[dict]:
    """The first exchange after the prompt: up to the assistant's first answer, or to the user's next message.

    An episode ends at its first answer; a recorded conversation scored whole is judged on the same part.
    """
    out = []
    for message in messages[len(task.prompt):]:
        if message.get("role") == "user":
            break
        out.append(message)
        if message.get("role") == "assistant" and not message.get("tool_calls"):
            break
    return out


def model_calls(task: Task, messages: list[dict]) -> list[tuple[str, dict | None]]:
    """The calls the model made in its exchange: (name, arguments; None when they are not a JSON object)."""
    calls = []
    for message in exchange(task, messages):
        if message.get("role") != "assistant":
            continue
        for call in message.get("tool_calls") or []:
            calls.append(((call.get("function") or {}).get("name", ""), call_arguments(call)))
    return calls


def final_answer(task: Task, messages: list[dict]) -> str | None:
    """The model's answer: the assistant message without tool calls that ends its exchange; None if none."""
    part = exchange(task, messages)
    last = part[-1] if part else {}
    if last.get("role") != "assistant" or last.get("tool_calls"):
        return None
    return last.get("content") or ""


def writes_made(recorded: list[Call], made: list[tuple[str, dict | None]], reads: re.Pattern, fuzzy: float) -> float:
    """1 when the model's writes are the recorded writes, each matched once (order free), else 0."""
    wanted = [c for c in recorded if not reads.match(c.name)]
    writes = [(name, arguments) for name, arguments in made if not reads.match(name)]
    if len(writes) != len(wanted):
        return 0.0
    matcher = Matcher(wanted, fuzzy)
    for name, arguments in writes:
        i = None if arguments is None else matcher.find(name, arguments, reuse=False)
        if i is None:
            return 0.0
        matcher.used[i] = True
    return 1.0


def facts_stated(required: list[str], answer: str | None) -> float:
    """The share of the required facts the answer states; an answer with nothing required scores 1."""
    if answer is None:
        return 0.0
    if not required:
        return 1.0
    stated = facts_in(answer)
    return sum(f in stated for f in required) / len(required)


def combine(parts: dict[str, float], weights: dict[str, float], inverted: bool) -> Score:
    """The weighted reward; passed when every weighted part is 1. Inverted (a rejected trace, eval only): the
    reward is 1 minus it, passed when the model did not repeat the rejected outcome in full."""
    total = sum(weights.values())
    reward = sum(weights[k] * parts[k] for k in weights) / total
    if inverted:
        return Score(reward=1.0 - reward, passed=reward < 1.0 - 1e-9, breakdown=parts)
    return Score(reward=min(1.0, reward), passed=reward >= 1.0 - 1e-9, breakdown=parts)
