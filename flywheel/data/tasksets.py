"""The tasks table: the environment's seeded tasks plus the traces it can verify, split by content hash."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import orjson
import pyarrow as pa

from flywheel.config import EnvironmentConfig
from flywheel.envs.base import Environment, Task, prompt_hash, split_of

SCHEMA = pa.schema([(name, pa.string()) for name in ("task_id", "env", "prompt", "answer", "slice", "split",
                                                     "origin")])


# json.dumps(value, ensure_ascii=False) builds an encoder per call; this is the same encoder, built once
_JSON_TEXT = json.JSONEncoder(ensure_ascii=False).encode


def task_row(task: Task, origin: str) -> dict:
    return {"task_id": task.task_id, "env": task.env, "prompt": _JSON_TEXT(task.prompt),
            "answer": task.answer, "slice": task.slice, "split": task.split, "origin": origin}


def row_task(row: dict) -> Task:
    return Task(task_id=row["task_id"], env=row["env"], prompt=json.loads(row["prompt"]), answer=row["answer"],
                slice=row["slice"], split=row["split"])


# the traces-table columns an environment may build a task from (task_from_trace)
TRACE_COLUMNS = ["trace_id", "source", "messages", "tools", "outcome", "score", "split"]


def trace_task(env: Environment, heldout_fraction: float, trace: dict,
               messages: list[dict] | None = None) -> tuple[str, str, dict] | None:
    """The task a traces-table row holds for this environment, split: (its id, its prompt hash, its tasks-table
    row); None if it holds none. `messages`: the row's messages as a list, where the caller has them (collect).

    An environment with `task_from_trace` (replay) reads the whole row and sets the split; any other reads the
    messages and its task is split by its id. Both must depend on the row alone: collect builds these in its
    worker processes (flywheel/data/traces.py) and build_tasks takes them as built.
    """
    from_trace = getattr(env, "task_from_trace", None)
    if from_trace is not None:
        task = from_trace(trace, heldout_fraction)
    else:
        if messages is None:
            messages = orjson.loads(trace["messages"])  # our own JSON: orjson reads it as json does
        task = env.task_from_messages(messages)
        task = task and _with_split(task, split_of(task.task_id, heldout_fraction))
    return None if task is None else (task.task_id, prompt_hash(task.prompt), task_row(task, "trace"))


def build_tasks(env: Environment, cfg: EnvironmentConfig, heldout_fraction: float, traces: pa.Table | Iterable[dict],
                known: set[str] | None = None, made: dict | None = None) -> list[dict]:
    """Draw generated tasks until both splits are full, then add the traces' verifiable tasks; no duplicates.

    `traces` are traces-table rows (at least `messages`, JSON text) in table order, or the table, each made a
    task by trace_task, or taken from `made` (collect's: (source, location) -> (trace_id, trace_task's result))
    when it holds that row. A task whose prompt hash is already taken (by a generated task or an earlier
    trace's) is left out. With `known`, the ids and prompt hashes of the tasks built from the traces before
    these ones, only the tasks new to those are returned: appended to that table, they make the table a build
    over all the traces makes.
    """
    rows: dict[str, dict] = {}
    if known is None:
        _generate(env, cfg, heldout_fraction, rows)
    prompts = {prompt_hash(json.loads(row["prompt"])) for row in rows.values()} | (known or set())
    known = known or set()
    made = made or {}
    for trace in _rows(traces, made):
        kept = made.get((trace.get("source"), trace.get("location")))
        if kept is not None and kept[0] == trace.get("trace_id"):
            found = kept[1]
        else:
            found = trace_task(env, heldout_fraction, trace)
        if found is None:
            continue
        task_id, digest, row = found
        if task_id in rows or task_id in known:
            continue
        if digest in prompts:
            continue  # one prompt, one task: whichever task set had it first keeps it
        prompts.add(digest)
        rows[task_id] = row
    return list(rows.values())


def _rows(traces: pa.Table | Iterable[dict], made: dict) -> Iterable[dict]:
    """A table's rows: only their keys where `made` holds every row's task (whole rows cost ~10x more)."""
    if not isinstance(traces, pa.Table):
        return traces
    keys = ("source", "location", "trace_id")
    columns = [traces.column(k).to_pylist() for k in keys]
    rows = [dict(zip(keys, key, strict=True)) for key in zip(*columns, strict=True)]
    if all(made.get((row["source"], row["location"]), (None,))[0] == row["trace_id"] for row in rows):
        return rows
    return traces.select(list(dict.fromkeys([*TRACE_COLUMNS, "location"]))).to_pylist()


def known_keys(tasks: pa.Table) -> set[str]:
    """The ids and prompt hashes of a stored tasks table: what build_tasks must not add again."""
    return (set(tasks.column("task_id").to_pylist())
            | {prompt_hash(orjson.loads(p)) for p in tasks.column("prompt").to_pylist()})


def to_arrow(rows: list[dict]) -> pa.Table:
    """Task rows as an Arrow table of the Tasks contract's columns (no pandas metadata: appends stay equal)."""
    return pa.Table.from_pylist(rows, schema=SCHEMA)


def recipe(env: Environment, cfg: EnvironmentConfig, heldout_fraction: float) -> str:
    """What the tasks table is built from besides the traces: the environment's config and code, hashed."""
    from flywheel.data.catalog import content_hash

    envs = Path(__file__).resolve().parents[1] / "envs"
    code = content_hash([envs, Path(__file__).resolve()], envs.parent)
    config = json.dumps(cfg.model_dump(mode="json"), sort_keys=True)
    return hashlib.sha256(f"{env.name}|{config}|{heldout_fraction}|{code}".encode()).hexdigest()[:16]


def _generate(env: Environment, cfg: EnvironmentConfig, heldout_fraction: float, rows: dict[str, dict]) -> None:
    wanted = {"train": cfg.train_tasks, "heldout": cfg.heldout_tasks}
    have = {"train": 0, "heldout": 0}
    draws, limit = 0, 50 * (cfg.train_tasks + cfg.heldout_tasks)
    for task in env.generate_tasks(cfg.seed):
        draws += 1
        if draws > limit:
            raise RuntimeError(f"environment '{env.name}' produced too few distinct tasks for "
                               f"{wanted} (got {have} after {limit} draws)")
        split = split_of(task.task_id, heldout_fraction)
        if task.task_id in rows or have[split] >= wanted[split]:
            if have == wanted:
                break
            continue
        have[split] += 1
        rows[task.task_id] = task_row(_with_split(task, split), "generated")
        if have == wanted:
            break


def _with_split(task: Task, split: str) -> Task:
    return Task(task.task_id, task.env, task.prompt, task.answer, task.slice, split)
