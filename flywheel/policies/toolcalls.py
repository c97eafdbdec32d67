"""Tool calls written as text, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, to and from messages."""

from __future__ import annotations

import json
import re

from flywheel.policies.base import Completion

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
# The finish_reason of a served choice whose tool call did not parse (Gemini's MALFORMED_FUNCTION_CALL): the server
# cuts the call from the content and says so here; the openai policy reads it back as the completion's error.
MALFORMED_CALL = "malformed_function_call"


def parse_completion(text: str, turn_id: str = "call") -> Completion:
    """Turn generated text into an assistant message; malformed call JSON is an error, not an exception."""
    calls, problems = [], []
    for i, raw in enumerate(TOOL_CALL.findall(text)):
        try:
            body = json.loads(raw)
            name, arguments = body["name"], body.get("arguments", {})
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise TypeError("'name' must be a string and 'arguments' an object")
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            problems.append(f"tool call {i} is not valid JSON with 'name' and 'arguments': {err}")
            continue
        calls.append({"id": f"{turn_id}_{i}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
    if "<tool_call>" in text and not calls and not problems:
        problems.append("a <tool_call> was opened but never closed with </tool_call>")
    content = TOOL_CALL.sub("", text).replace("<tool_call>", "").strip()
    message: dict = {"role": "assistant", "content": content}
    if calls and not problems:
        message["tool_calls"] = calls
    if problems:
        message["content"] = text.strip()
    return Completion(message=message, text=text, error="; ".join(problems) or None)


def render_tool_call(call: dict) -> str:
    """The text form of one OpenAI tool call, as the chat templates write it."""
    fn = call["function"]
    arguments = fn["arguments"]
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    return "<tool_call>" + json.dumps({"name": fn["name"], "arguments": arguments}, ensure_ascii=False) + "</tool_call>"


def canonical_messages(messages: list[dict]) -> list[dict]:
    """Copies with tool-call arguments as objects, the form real templates expect (`arguments | tojson`).

    Templates that accept text write the same characters: transformers' tojson is json.dumps(ensure_ascii=False).
    """
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                fn = dict(call.get("function", {}))
                arguments = fn.get("arguments")
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments)
                    except json.JSONDecodeError:
                        pass  # written as it came: the model sees what it (or the trace) wrote
                fn["arguments"] = arguments if arguments is not None else {}
                calls.append({**call, "function": fn})
            message["tool_calls"] = calls
        out.append(message)
    return out
