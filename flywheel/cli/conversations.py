"""`flywheel eval --show`: episodes of an eval table printed as conversations a person reads in a terminal."""

from __future__ import annotations

import json
import shutil
import textwrap

import pandas as pd
import typer

SHOWN = ("failed", "passed", "all")
_SYSTEM_LINES = 4  # of a system prompt, the rest counted
_ROLE = {"user": typer.colors.CYAN, "assistant": typer.colors.GREEN, "tool": typer.colors.MAGENTA,
         "system": typer.colors.BRIGHT_BLACK}


def chosen(table: pd.DataFrame, show: str, models: list[str] | None, n: int) -> pd.DataFrame:
    """The rows to print: `show` (failed, passed or all) of `models` (default: the candidate `rl` where the table
    has it, else every model but the null policy), at most `n`, greedy episodes first, in table order."""
    if not models:
        labels = list(dict.fromkeys(table["model"]))
        models = ["rl"] if "rl" in labels else [m for m in labels if m != "null"] or labels
    rows = table[table["model"].isin(models)]
    if show != "all":
        rows = rows[rows["passed"] == (show == "passed")]
    return rows.sort_values("sample", kind="stable").head(n)


def print_conversations(rows: pd.DataFrame, total: int, show: str, where: str) -> None:
    """Each row's conversation, a header line with its model, task, slice and score; how many were left out."""
    width = max(60, min(shutil.get_terminal_size((100, 24)).columns, 120))
    for row in rows.to_dict("records"):
        verdict = "passed" if row["passed"] else "failed"
        typer.secho(f"── {row['model']} · task {row['task_id']} · slice {row['slice']} · sample {row['sample']} · "
                    f"reward {row['reward']:.3f} ({verdict}) ".ljust(width, "─"), bold=True)
        for line, role in conversation_lines(json.loads(row["messages"]), width):
            typer.secho(line, fg=_ROLE.get(role))
        typer.echo("")
    left = total - len(rows)
    typer.echo(f"{len(rows)} of {total} {show if show != 'all' else ''} episode(s) shown from {where}".replace(
        "  ", " ") + (f"; -n {total} shows them all" if left > 0 else ""))


def conversation_lines(messages: list[dict], width: int = 100) -> list[tuple[str, str]]:
    """(line, role) for each line of the conversation: the speaker, then the text wrapped under it; a tool call
    as `-> name(arguments)`, a tool's result under the tool's name."""
    names: dict[str, str] = {}
    lines: list[tuple[str, str]] = []
    for message in messages:
        role = message.get("role", "?")
        speaker = role
        if role == "tool":
            speaker = f"tool {names.get(message.get('tool_call_id'), '')}".rstrip()
        text = message.get("content")
        if not isinstance(text, str):
            text = json.dumps(text, ensure_ascii=False) if text else ""
        body = [text] if text.strip() else []
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            names[call.get("id")] = function.get("name", "")
            body.append(f"-> {function.get('name')}({function.get('arguments') or ''})")
        said = []
        for part in body or ["(empty)"]:
            for paragraph in part.splitlines() or [""]:
                wrapped = textwrap.wrap(paragraph, width - 4, break_long_words=True, replace_whitespace=False)
                said += [f"    {w}" for w in wrapped or [""]]
        if role == "system" and len(said) > _SYSTEM_LINES:  # the policy an agent runs under: long, the same
            said = said[:_SYSTEM_LINES] + [f"    ... ({len(said) - _SYSTEM_LINES} more lines)"]
        lines += [(f"{speaker}:", role)] + [(line, role) for line in said]
    return lines
