"""Messages written in a log's own layout, as OpenAI chat messages (a source's `turns:` mapping).

Benchmarks and agent frameworks write a conversation their own way: other key names (`text` for `content`),
other role names (`AI`), calls without the `function` wrapper, or each call with its result inline (ToolTalk's
`apis: [{request, response, exception}]`) instead of a tool message after it, or a turn's calls among other
entries of one list (a dialogue's frames, only some holding a service call: `call_if` names the path they
hold). `turns:` names where each part is (flywheel.config.TurnLayout); what this gives goes through the same
checks as any chat record (trace_rows.normalise_messages). A call's result that is not text is written as its
JSON; an error, as "Error: <the error>" (replay counts a call that errored as one that changed nothing).
"""

from __future__ import annotations

import json

from flywheel.config import TurnLayout
from flywheel.data.shapes import _MISSING, BadRecord, get_path


def chat_messages(messages, layout: TurnLayout) -> list[dict]:
    """The messages as OpenAI chat messages; BadRecord when a message is not an object."""
    if not isinstance(messages, list):
        raise BadRecord("wrong_type", "messages is not a list")
    out: list[dict] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRecord("wrong_type", f"message {i} is not an object")
        role = _value(message, layout.role)
        role = layout.roles.get(str(role), role)
        if role in layout.skip:
            continue
        content = _value(message, layout.content)
        calls = _value(message, layout.calls) if layout.calls else None
        if calls and layout.call_if and isinstance(calls, list):
            calls = [c for c in calls if not isinstance(c, dict) or _value(c, layout.call_if) is not None]
        if role == "tool":
            call_id = _value(message, layout.result_id)
            out.append({"role": "tool", "tool_call_id": None if call_id is None else str(call_id),
                        "content": _text(content)})
        elif role == "assistant" and calls:
            if not isinstance(calls, list):
                raise BadRecord("wrong_type", f"message {i}: '{layout.calls}' is not a list of calls")
            out += _assistant_turn(i, content, calls, layout)
        else:
            out.append({"role": role, "content": content})
    return out


def _assistant_turn(i: int, content, calls: list, layout: TurnLayout) -> list[dict]:
    made, results = [], []
    for j, call in enumerate(calls):
        if not isinstance(call, dict):
            raise BadRecord("bad_tool_call", f"message {i}: call {j} is not an object")
        call_id = _value(call, layout.call_id) if layout.call_id else None
        call_id = f"call_{i}_{j}" if call_id is None else str(call_id)
        arguments = _value(call, layout.call_arguments)
        arguments = {} if arguments is None else arguments
        made.append({"id": call_id, "type": "function", "function": {
            "name": _value(call, layout.call_name),
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)}})
        if layout.call_result:
            error = _value(call, layout.call_error) if layout.call_error else None
            result = f"Error: {_text(error)}" if error not in (None, "", {}, []) else _text(
                _value(call, layout.call_result))
            results.append({"role": "tool", "tool_call_id": call_id, "content": result})
    if not layout.call_result:  # the results are tool messages of their own, after this one
        return [{"role": "assistant", "content": content, "tool_calls": made}]
    turn = [{"role": "assistant", "content": None, "tool_calls": made}, *results]
    return turn + ([{"role": "assistant", "content": content}] if content else [])


def _value(node, path: str):
    value = get_path(node, path)
    return None if value is _MISSING else value


def _text(value) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)
