"""docs/keys.md, every key of a pipeline with its default and the comment beside it in flywheel/config/, is what
the pydantic models say: regenerate it with `python tests/test_config_keys.py` after changing a section."""

from __future__ import annotations

import ast
import enum
import inspect
import io
import json
import sys
import textwrap
import tokenize
import typing
from functools import cache
from pathlib import Path

from pydantic import BaseModel

from flywheel.config import PipelineConfig

PAGE = Path(__file__).resolve().parent.parent / "docs" / "keys.md"
HEAD = """# Every key and its default

<!-- generated from the pydantic models in flywheel/config/ by running tests/test_config_keys.py as a script; its test
fails while this page differs from them -->

A section written `{}` takes every default below, as does a section left out where
[Configuration](configuration.md) says one may be; a key you write replaces its default alone, and a nested
section (`student.tiny`) is merged the same way, key by key. The meaning is the comment beside the key in
`flywheel/config/` (blank where the key explains itself or the comment on the first key of a group says it). A
section whose default is `null` (`sft.lora`, `environment.replay.judge`) takes the keys listed under it once
written, as does `rl.opd` beside `objective: opd` or `reward+opd`; `[]` marks the keys of each entry of a list.
"""


@cache
def _comments(cls: type) -> dict[str, str]:
    """Field name -> the comment lines right above its line and those on its own lines, in cls's source."""
    source = textwrap.dedent("".join(inspect.getsourcelines(cls)[0]))
    lines = source.splitlines()
    beside: dict[int, list[str]] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            beside.setdefault(token.start[0], []).append(token.string.lstrip("#").strip())
    found = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above, line = [], node.lineno - 1
            while line >= 1 and lines[line - 1].strip().startswith("#"):
                above.insert(0, lines[line - 1].strip().lstrip("#").strip())
                line -= 1
            on_it = [c for n in range(node.lineno, node.end_lineno + 1) for c in beside.get(n, [])]
            found[node.target.id] = " ".join(above + on_it)
    return found


def _meaning(model: type[BaseModel], name: str) -> str:
    cls = next(c for c in model.__mro__ if name in c.__dict__.get("__annotations__", {}))
    text = _comments(cls).get(name, "")
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _models(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def _shown(value) -> str:
    value = value.value if isinstance(value, enum.Enum) else value
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        key = prefix + name
        default = None if field.is_required() else field.get_default(call_default_factory=True)
        variants = _models(field.annotation)
        if len(variants) > 1 and all("kind" in v.model_fields for v in variants):
            # one of several kinds (rl.objective), written as its kind with its settings beside it (rl.opd)
            rows.append(f"| `{key}` | `{_shown(default.kind)}` | {_meaning(model, name)} |")
            settings = {(n, m) for v in variants for n, f in v.model_fields.items() for m in _models(f.annotation)}
            for setting, sub in sorted(settings, key=lambda pair: pair[0]):
                rows += _rows(sub, prefix + setting + ".")
            continue
        if isinstance(default, BaseModel):  # a nested section: its own keys
            rows += _rows(type(default), key + ".")
            continue
        shown = "(required)" if field.is_required() else f"`{_shown(default)}`"
        rows.append(f"| `{key}` | {shown} | {_meaning(model, name)} |")
        inner = _models(field.annotation)
        for sub in inner:  # a section that is null (or a list) by default: the keys it takes once written
            label = f" ({sub.__name__})" if len(inner) > 1 else ""
            rows += [row.replace(f"`{key}", f"`{key}{label}", 1) for row in
                     _rows(sub, key + ("[]." if typing.get_origin(field.annotation) is list else "."))]
    return rows


def page() -> str:
    """docs/keys.md as the models are now."""
    parts = [HEAD]
    scalars = [name for name, field in PipelineConfig.model_fields.items() if not _models(field.annotation)]
    for section, field in PipelineConfig.model_fields.items():
        for model in _models(field.annotation):
            optional = " (optional)" if not field.is_required() else ""
            parts += [f"## {section}{optional}", "", "| key | default | meaning |", "| --- | --- | --- |",
                      *_rows(model, section + "."), ""]
    if scalars:  # keys of a pipeline that are no section (budget_minutes)
        parts += ["## Keys beside the sections", "", "| key | default | meaning |", "| --- | --- | --- |",
                  *[f"| `{name}` | `{_shown(PipelineConfig.model_fields[name].default)}` | "
                    f"{_meaning(PipelineConfig, name)} |" for name in scalars], ""]
    return "\n".join(parts)


def test_the_keys_page_is_what_the_models_say():
    assert PAGE.read_text() == page(), "regenerate docs/keys.md: python tests/test_config_keys.py"


def test_the_page_names_every_section_and_a_known_default():
    text = PAGE.read_text()
    assert all(f"## {section}" in text or f"| `{section}` |" in text for section in PipelineConfig.model_fields)
    default = PipelineConfig.model_fields["environment"].annotation.model_fields["max_turns"].default
    assert f"| `environment.max_turns` | `{default}` | Assistant messages per episode" in text


if __name__ == "__main__":
    PAGE.write_text(page())
    print(f"wrote {PAGE}", file=sys.stderr)
