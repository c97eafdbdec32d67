"""Tool schemas from typed Python functions, and a model's arguments checked against them.

A tool's OpenAI function schema is derived from its signature and its docstring's `Args:` section, never
written by hand (flywheel/envs/sdk.py). A parameter named `state` receives the episode's state and is not part
of the schema.
"""

from __future__ import annotations

import enum
import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass

from flywheel.contract import ToolError
from flywheel.errors import UserFacingError

__all__ = ["SchemaError", "Tool", "check_arguments", "tool_schema"]


class SchemaError(UserFacingError, TypeError):
    """A tool's schema cannot be derived from its signature (an untyped parameter, an unsupported type)."""


_SIMPLE = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}


def _json_schema(annotation, where: str) -> dict:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in _SIMPLE:
        return {"type": _SIMPLE[annotation]}
    if origin in (typing.Union, types.UnionType):
        present = [a for a in args if a is not type(None)]
        if len(present) != 1:
            raise SchemaError(f"{where}: a union of several types ({annotation}) has no tool schema; use one type "
                              "or Optional[X]")
        inner = _json_schema(present[0], where)
        return {**inner, "type": [inner["type"], "null"]} if isinstance(inner.get("type"), str) else inner
    if origin is typing.Literal:
        kinds = {type(a) for a in args}
        if len(kinds) != 1 or next(iter(kinds)) not in (str, int, float, bool):
            raise SchemaError(f"{where}: Literal{list(args)} must list values of one type (str, int, float, bool)")
        return {"type": _SIMPLE[next(iter(kinds))], "enum": list(args)}
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        values = [m.value for m in annotation]
        return {**_json_schema(type(values[0]), where), "enum": values}
    if origin is list:
        return {"type": "array", "items": _json_schema(args[0], where)} if args else {"type": "array"}
    if origin is dict:
        return {"type": "object"}
    raise SchemaError(f"{where}: type {annotation!r} has no tool schema (use str, int, float, bool, list[X], dict, "
                      "Literal[...], an Enum or Optional[X])")


def _docstring(fn: Callable) -> tuple[str, dict[str, str]]:
    """The first line, and Google-style `Args:` descriptions by parameter name."""
    doc = inspect.getdoc(fn) or ""
    lines = doc.splitlines()
    described: dict[str, str] = {}
    in_args, current, indent = False, None, None
    for line in lines[1:]:
        if re.fullmatch(r"(Args|Arguments|Parameters):\s*", line):
            in_args, current, indent = True, None, None
            continue
        if not in_args or not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if depth == 0:  # the next section (Returns:, Raises:, ...)
            in_args = False
            continue
        match = re.match(r"\s+(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)", line)
        if match and (indent is None or depth <= indent):
            current, indent = match.group(1), depth
            described[current] = match.group(2).strip()
        elif current:  # a description continued on the next line
            described[current] = (described[current] + " " + line.strip()).strip()
    return (lines[0].strip() if lines else ""), described


def tool_schema(fn: Callable) -> dict:
    """The OpenAI function schema of a typed Python function (its `state` parameter left out)."""
    name = fn.__name__
    try:
        hints = typing.get_type_hints(fn)
    except Exception as err:  # an annotation naming something undefined
        raise SchemaError(f"tool '{name}': its type hints cannot be read: {err}") from None
    description, described = _docstring(fn)
    properties, required = {}, []
    for param in inspect.signature(fn).parameters.values():
        if param.name == "state":
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise SchemaError(f"tool '{name}': parameter '{param.name}' is *args/**kwargs; a tool takes named, "
                              "typed parameters")
        if param.name not in hints:
            raise SchemaError(f"tool '{name}': parameter '{param.name}' has no type hint; the schema is derived "
                              f"from type hints (e.g. `{param.name}: str`)")
        prop = _json_schema(hints[param.name], f"tool '{name}', parameter '{param.name}'")
        if param.name in described:
            prop["description"] = described[param.name]
        properties[param.name] = prop
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required}}}


_ARTICLE = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "a boolean",
            "array": "a list", "object": "an object", "null": "null"}


def _fits(value, schema: dict) -> bool:
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds or []
    if "enum" in schema and value not in schema["enum"] and value is not None:
        return False
    if not kinds:
        return True
    for kind in kinds:
        if kind == "null" and value is None:
            return True
        if kind == "string" and isinstance(value, str):
            return True
        if kind == "integer" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if kind == "number" and isinstance(value, int | float) and not isinstance(value, bool):
            return True
        if kind == "boolean" and isinstance(value, bool):
            return True
        if kind == "object" and isinstance(value, dict):
            return True
        if kind == "array" and isinstance(value, list):
            items = schema.get("items")
            return not items or all(_fits(v, items) for v in value)
    return False


def _describe(schema: dict) -> str:
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds or ["any"]
    text = " or ".join(_ARTICLE.get(k, k) for k in kinds if k != "null")
    if "enum" in schema:
        text += " (one of " + ", ".join(json.dumps(v) for v in schema["enum"]) + ")"
    return text


def check_arguments(schema: dict, arguments: dict) -> None:
    """Raise a ToolError the model can act on when `arguments` do not fit the function schema."""
    name = schema["function"]["name"]
    parameters = schema["function"].get("parameters") or {}
    properties = parameters.get("properties") or {}
    for key in parameters.get("required") or []:
        if key not in arguments:
            raise ToolError(f"{name} needs {_describe(properties.get(key, {}))} argument '{key}'")
    for key, value in arguments.items():
        if key not in properties:
            if parameters.get("additionalProperties", False) is False:
                raise ToolError(f"{name} has no argument '{key}' (arguments: {', '.join(properties) or 'none'})")
            continue
        if not _fits(value, properties[key]):
            raise ToolError(f"{name} needs {_describe(properties[key])} argument '{key}', "
                            f"not {json.dumps(value)[:60]}")


@dataclass
class Tool:
    """A Python function as an environment's tool: its schema, whether it takes the state, its Enum parameters."""

    fn: Callable
    schema: dict
    wants_state: bool
    enums: dict[str, type]  # parameter -> its Enum class: the model's value becomes the member

    @classmethod
    def of(cls, fn: Callable) -> Tool:
        """The tool of a typed function (SchemaError when its signature has no schema)."""
        hints = typing.get_type_hints(fn) if not isinstance(fn, Tool) else {}
        parameters = inspect.signature(fn).parameters
        enums = {p: h for p, h in hints.items()
                 if p in parameters and isinstance(h, type) and issubclass(h, enum.Enum)}
        return cls(fn, tool_schema(fn), "state" in parameters, enums)

