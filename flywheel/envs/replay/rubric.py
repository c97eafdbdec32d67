"""The replay rubric, from the accepted outcome: the same writes, the same facts, optionally a judge's verdict.

Over the whole conversation (every turn of the agent's), or its first exchange when the task is single-turn:
- writes: the target's state-changing calls (writes.py says which tools change state; a call that errored
  changed nothing), or the record's expected actions where it has them (what the label and the rewarded
  conversation agree on), were made with matching arguments, none missing and none extra (order free): 1, else 0;
- facts: the share of the facts the accepted answers stated that tool results had told the agent (numbers,
  ids, dates, amounts) which the model's answers state;
- judge (optional): a model's verdict comparing the conversation with the accepted one.

A part with nothing to check is left out of the reward (an empty answer must not score for it): writes when
the target has none and the model made none, facts when the accepted answers state none. A record with
neither is no task at all (ReplayEnv.task_from_trace).
"""

from __future__ import annotations

from flywheel.contract import Score, Task
from flywheel.envs.replay.record import facts_in

JUDGE_TEMPLATE = """You compare an assistant's conversation with a customer against one the customer accepted.

The customer's first message: {prompt}
The accepted assistant's answers, in order: {answer}

The conversation to judge:
{conversation}

Does the assistant reach the same outcome and give the customer the same information as the accepted answers?
Reply with a short reason, then a last line `SCORE: x` where x is 1 (same), 0 (different or missing) or in
between."""


def scored_part(task: Task, messages: list[dict]) -> list[dict]:
    """What the rubric scores after the prompt: every message of a whole conversation; of a single exchange, up
    to the assistant's first answer or the user's next message (a recorded conversation goes on after it)."""
    after = messages[len(task.prompt):]
    if task.data.get("whole"):
        return after
    out = []
    for message in after:
        if message.get("role") == "user":
            break
        out.append(message)
        if message.get("role") == "assistant" and not message.get("tool_calls"):
            break
    return out


def answers(task: Task, messages: list[dict]) -> list[str]:
    """The model's answers in the scored part: its assistant messages without tool calls."""
    return [m.get("content") or "" for m in scored_part(task, messages)
            if m.get("role") == "assistant" and not m.get("tool_calls")]


def facts_stated(required: list[str], said: list[str]) -> float:
    """The share of the required facts the model's answers state together; 0 without an answer."""
    if not said:
        return 0.0
    stated = facts_in("\n".join(said))
    return sum(f in stated for f in required) / len(required)


def combine(parts: dict[str, float], weights: dict[str, float], inverted: bool) -> Score:
    """The weighted reward; passed when every weighted part is 1. Inverted (a rejected trace, eval only): the
    reward is 1 minus it, passed when the model did not repeat the rejected outcome in full."""
    total = sum(weights.values())
    reward = sum(weights[k] * parts[k] for k in weights) / total if total > 0 else 0.0
    if inverted:
        return Score(reward=1.0 - reward, passed=reward < 1.0 - 1e-9, breakdown=parts)
    return Score(reward=min(1.0, reward), passed=total > 0 and reward >= 1.0 - 1e-9, breakdown=parts)
