"""The tasks table: the environment's seeded tasks plus the traces it can verify, split by content hash (or as a
task file's row chooses)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import orjson
import pyarrow as pa

from flywheel.config import EnvironmentConfig
from flywheel.contract import Environment, Task, prompt_hash, split_of

SCHEMA = pa.schema([(name, pa.string()) for name in ("task_id", "env", "prompt", "answer", "slice", "split",
                                                     "group", "origin")])


# json.dumps(value, ensure_ascii=False) builds an encoder per call; this is the same encoder, built once
_JSON_TEXT = json.JSONEncoder(ensure_ascii=False).encode


def task_row(task: Task, origin: str) -> dict:
    return {"task_id": task.task_id, "env": task.env, "prompt": _JSON_TEXT(task.prompt),
            "answer": task.answer, "slice": task.slice, "split": task.split, "group": task.group, "origin": origin}


def row_task(row: dict) -> Task:
    return Task(task_id=row["task_id"], env=row["env"], prompt=json.loads(row["prompt"]), answer=row["answer"],
                slice=row["slice"], split=row["split"], group=row.get("group") or "")


# the traces-table columns an environment may build a task from (task_from_trace)
TRACE_COLUMNS = ["trace_id", "source", "messages", "tools", "outcome", "score", "split", "group", "scenario",
                 "expected_actions"]


def trace_task(env: Environment, heldout_fraction: float, trace: dict,
               messages: list[dict] | None = None) -> tuple[str, str, dict] | None:
    """The task a traces-table row holds for this environment, split: (its id, its prompt hash, its tasks-table
    row); None if it holds none. `messages`: the row's messages as a list, where the caller has them (collect).

    The environment's task_from_trace reads the row and sets the split (by default its task_from_messages, split
    by the task's id; replay keeps the trace's). It must depend on the row alone: collect builds these in its
    worker processes (made_tasks) and task_table takes them as made.
    """
    if messages is not None:
        trace = {**trace, "messages": messages}
    if _ends_in_calls(trace["messages"]):
        return None  # a turn kept for its label that nothing completed: it has no answer to check
    task = env.task_from_trace(trace, heldout_fraction)
    return None if task is None else (task.task_id, prompt_hash(task.prompt), task_row(task, "trace"))


def _ends_in_calls(messages: str | bytes | list[dict]) -> bool:
    """Whether a conversation ends in tool calls nothing answered (collect keeps such a turn for its label)."""
    if isinstance(messages, str | bytes):
        if not messages.endswith("]}]" if isinstance(messages, str) else b"]}]"):  # cheap: most end in content
            return False
        messages = orjson.loads(messages)
    return bool(messages) and isinstance(messages[-1], dict) and bool(messages[-1].get("tool_calls"))


# A trace's task as collect's workers make it (made_tasks), in columns beside the trace's row through collect's
# sorting and merging: whether it was made, its prompt hash, and its tasks-table row (origin: "trace")
MADE = pa.schema([("task:made", pa.bool_()), ("task:digest", pa.string()),
                  *((f"task:{name}", pa.string()) for name in SCHEMA.names[:-1])])


def made_tasks(env: Environment, heldout_fraction: float, rows: list[dict], messages: list[list[dict]]) -> pa.Table:
    """trace_task of each traces-table row (given its messages as lists), as the columns MADE, row for row."""
    found = [trace_task(env, heldout_fraction, row, listed) for row, listed in zip(rows, messages, strict=True)]
    columns = [pa.array([True] * len(found), pa.bool_()), pa.array([f and f[1] for f in found], pa.string())]
    columns += [pa.array([f and f[2][name] for f in found], pa.string()) for name in SCHEMA.names[:-1]]
    return pa.table(columns, schema=MADE)


def build_tasks(env: Environment, cfg: EnvironmentConfig, heldout_fraction: float, traces: pa.Table | Iterable[dict],
                known: set[str] | None = None) -> list[dict]:
    """task_table's rows."""
    return task_table(env, cfg, heldout_fraction, traces, known).to_pylist()


def task_table(env: Environment, cfg: EnvironmentConfig, heldout_fraction: float, traces: pa.Table | Iterable[dict],
               known: set[str] | None = None) -> pa.Table:
    """Draw generated tasks until both splits are full, then add the traces' verifiable tasks; no duplicates.

    `traces` are traces-table rows (at least `messages`, JSON text) in table order, or the table, each made a
    task by trace_task, or taken from the table's MADE columns where it has them (collect's). A task whose
    prompt hash is already taken (by a generated task or an earlier trace's) is left out. With `known`, the ids
    and prompt hashes of the tasks built from the traces before these ones, only the tasks new to those are
    returned: appended to that table, they make the table a build over all the traces makes.
    """
    rows: dict[str, dict] = {}
    if known is None:
        _generate(env, cfg, heldout_fraction, rows)
    prompts = {prompt_hash(json.loads(row["prompt"])) for row in rows.values()} | (known or set())
    known = known or set()
    generated = len(rows)
    for i, found in enumerate(_trace_tasks(env, heldout_fraction, traces)):
        if found is None:
            continue
        task_id, digest, row = found
        if task_id in rows or task_id in known:
            continue
        if digest in prompts:
            continue  # one prompt, one task: whichever task set had it first keeps it
        prompts.add(digest)
        rows[task_id] = i if row is None else row  # i: the row in the table's MADE columns
    picked = list(rows.values())
    made = [i for i in picked[generated:] if type(i) is int]
    if not made:
        return to_arrow(picked)
    names = [f"task:{name}" for name in SCHEMA.names[:-1]]
    taken = traces.select(names).take(pa.array(made, pa.int64())).rename_columns(SCHEMA.names[:-1])
    taken = taken.append_column("origin", pa.array(["trace"] * len(made), pa.string()))
    if len(made) == len(picked) - generated:  # every trace's task as collect made it: no row in Python
        return pa.concat_tables([to_arrow(picked[:generated]), taken]).combine_chunks()
    as_rows = dict(zip(made, taken.to_pylist(), strict=True))
    return to_arrow([as_rows[row] if type(row) is int else row for row in picked])


def _trace_tasks(env: Environment, heldout_fraction: float, traces: pa.Table | Iterable[dict]) -> Iterator:
    """trace_task of each trace, in order; of a table row with MADE columns made, (task id, prompt hash, None)."""
    if not isinstance(traces, pa.Table):
        yield from (trace_task(env, heldout_fraction, trace) for trace in traces)
        return
    n = traces.num_rows
    made = traces.column("task:made").to_pylist() if "task:made" in traces.column_names else [None] * n
    ids = traces.column("task:task_id").to_pylist() if any(made) else made
    digests = traces.column("task:digest").to_pylist() if any(made) else made
    missing = [i for i, done in enumerate(made) if not done]  # read from the table as rows only if there are any
    rows = dict(zip(missing, traces.select(TRACE_COLUMNS).take(pa.array(missing, pa.int64())).to_pylist(),
                    strict=True)) if missing else {}
    for i in range(n):
        if not made[i]:
            yield trace_task(env, heldout_fraction, rows[i])
        elif ids[i] is not None:
            yield ids[i], digests[i], None
        else:
            yield None


def known_keys(tasks: pa.Table) -> set[str]:
    """The ids and prompt hashes of a stored tasks table: what build_tasks must not add again."""
    return (set(tasks.column("task_id").to_pylist())
            | {prompt_hash(orjson.loads(p)) for p in tasks.column("prompt").to_pylist()})


def to_arrow(rows: list[dict]) -> pa.Table:
    """Task rows as an Arrow table of the Tasks contract's columns (no pandas metadata: appends stay equal)."""
    return pa.Table.from_pylist(rows, schema=SCHEMA)


def recipe(env: Environment, cfg: EnvironmentConfig, heldout_fraction: float, sources: Iterable[Path],
           root: Path) -> str:
    """What the tasks table is built from besides the traces, hashed: the environment's config and code, and
    `sources`, its own files (flywheel.envs.environment_sources: a factory's folder, the task files it reads;
    named relative to `root`). An edited task file is a new recipe: collect builds the tasks table again."""
    from flywheel.data.catalog import content_hash

    envs = Path(__file__).resolve().parents[1] / "envs"
    code = content_hash([envs, Path(__file__).resolve()], envs.parent)
    own = content_hash(list(sources), root)
    config = json.dumps(cfg.model_dump(mode="json"), sort_keys=True)
    return hashlib.sha256(f"{env.name}|{config}|{heldout_fraction}|{code}|{own}".encode()).hexdigest()[:16]


def own_tasks(env: Environment, cfg: EnvironmentConfig, heldout_fraction: float) -> list[Task]:
    """The environment's own tasks as collect draws them into the tasks table, each with its split: what
    `flywheel check` counts and dry-runs before anything runs."""
    rows: dict[str, dict] = {}
    _generate(env, cfg, heldout_fraction, rows)
    return [row_task(row) for row in rows.values()]


def short_splits(env_name: str, have: Mapping[str, int], cfg: EnvironmentConfig, heldout_fraction: float) -> list[str]:
    """A warning per split that holds fewer of the environment's own tasks (`have`, by split) than the config asks
    for (a task file smaller than train_tasks + heldout_tasks); none for an environment with none."""
    if not any(have.values()):
        return []
    wanted = {"train": cfg.train_tasks, "heldout": cfg.heldout_tasks}
    return [f"environment '{env_name}' gives {have.get(split, 0)} {split} tasks, fewer than environment.{split}_tasks "
            f"{n}: its tasks run out (a task lands in the split its row names, `split: train|heldout`, else in one "
            f"by a hash of its prompt, held out at collect.heldout_fraction {heldout_fraction})"
            for split, n in wanted.items() if have.get(split, 0) < n]


def _generate(env: Environment, cfg: EnvironmentConfig, heldout_fraction: float, rows: dict[str, dict]) -> None:
    wanted = {"train": cfg.train_tasks, "heldout": cfg.heldout_tasks}
    have = {"train": 0, "heldout": 0}
    draws, limit = 0, 50 * (cfg.train_tasks + cfg.heldout_tasks)
    for task in env.generate_tasks(cfg.seed):
        draws += 1
        if draws > limit:
            raise RuntimeError(f"environment '{env.name}' produced too few distinct tasks for "
                               f"{wanted} (got {have} after {limit} draws)")
        split = task.split or split_of(task.task_id, heldout_fraction)  # a task file's row may choose
        if task.task_id in rows or have[split] >= wanted[split]:
            if have == wanted:
                break
            continue
        have[split] += 1
        rows[task.task_id] = task_row(_with_split(task, split), "generated")
        if have == wanted:
            break


def _with_split(task: Task, split: str) -> Task:
    return Task(task.task_id, task.env, task.prompt, task.answer, task.slice, split, task.group)
