"""Trace rows from every source: checked, normalised, redacted, de-duplicated and split; bad records quarantined."""

from __future__ import annotations

import gc
import hashlib
import json
import math
import multiprocessing
import os
import re
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import orjson
import pandas as pd
import pandera.pandas as pandera
import pyarrow as pa
import pyarrow.compute as pc

from flywheel.config import CollectConfig, SourceConfig
from flywheel.contract import conversation_hash, split_of
from flywheel.data import schemas, sources
from flywheel.data.redaction import Redactor
from flywheel.data.shapes import _MISSING, BadRecord, PartialTurn, extract, get_path
from flywheel.data.sources import FileReader, Lines

ROLES = {"system", "user", "assistant", "tool"}
_ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
QUARANTINE_RAW_CHARS = 10_000
# what shapes.timestamp() makes of a time it could read; anything else is the record's own text
_ISO_UTC = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d{3})?Z")
# json.dumps(value, ensure_ascii=False, ...) builds an encoder per call; these are the same encoders, built once
_JSON_TEXT = json.JSONEncoder(ensure_ascii=False).encode
_JSON_SORTED = json.JSONEncoder(sort_keys=True, ensure_ascii=False, default=str).encode
# The Traces contract's columns as Arrow types: written as they are, with no pandas metadata (whose row count
# would differ between a table built whole and one appended to)
SCHEMA = pa.schema([("trace_id", pa.string()), ("record_id", pa.string()), ("source", pa.string()),
                    ("location", pa.string()), ("collected_at", pa.string()), ("messages", pa.string()),
                    ("tools", pa.string()), ("outcome", pa.string()), ("score", pa.float64()),
                    ("split", pa.string()), ("group", pa.string()), ("scenario", pa.string()),
                    ("expected_actions", pa.string()), ("metadata", pa.string())])

__all__ = ["BadRecord", "Collected", "Reader", "collect", "gc_paused", "label_counts", "normalise_messages",
           "system_allocator", "to_trace"]


class Reader(Protocol):
    """A source of records: (location, raw text or None, record or the reason it is not one)."""

    source: SourceConfig
    state: dict  # the watermark after read() is exhausted: what the next incremental run skips

    def read(self, since: dict | None) -> Iterator[tuple[str, str | None, dict | BadRecord]]:
        """Every record (since=None), or only those after the watermark `since`."""
        ...


@dataclass
class Collected:
    """The traces and quarantine tables after this run, and what this run read, per source and kind."""

    table: pa.Table  # the traces, sorted, each trace_id once; with tasks_of, its columns too (not the table's)
    quarantine: list[dict]
    records: Counter = field(default_factory=Counter)  # per source: records read this run
    new: Counter = field(default_factory=Counter)  # per source: traces added to the table
    bad: Counter = field(default_factory=Counter)  # per source: records quarantined
    reasons: Counter = field(default_factory=Counter)  # per kind
    redacted: Counter = field(default_factory=Counter)  # per kind
    duplicates: int = 0
    partial: int = 0  # calls that ended in tool calls, with no label: skipped (the next call holds the turn)
    labels_joined: int = 0  # in `table`: labels of such calls, on the conversation that completes them
    labels_on_partial: int = 0  # in `table`: such calls kept as traces for their label (nothing completes them)
    states: dict[str, dict] = field(default_factory=dict)
    missing: Counter = field(default_factory=Counter)  # per field a source names: records without it
    warnings: list[str] = field(default_factory=list)  # records kept, with something to look at

    @property
    def traces(self) -> list[dict]:
        """The traces table's rows as Python objects (tests, small tables: the stage keeps them in Arrow)."""
        return self.table.select(SCHEMA.names).to_pylist()


def normalise_messages(messages, open_end: bool = False) -> list[dict]:
    """OpenAI chat messages with only the keys that matter, each tool call answered by id, in call order.

    `open_end`: the last message's tool calls may be unanswered (a call that ended in them, kept for its label).
    """
    if not isinstance(messages, list):
        raise BadRecord("wrong_type", "messages is not a list")
    if not messages:
        raise BadRecord("empty", "empty conversation")
    out: list[dict] = []
    pending: dict[str, int] = {}  # call id -> its position among the open calls
    results: list[dict] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRecord("wrong_type", f"message {i} is not an object")
        role = message.get("role")
        role = _ROLE_ALIASES.get(role, role)
        if role not in ROLES:
            raise BadRecord("unknown_role", f"message {i} has unknown role {role!r}")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in pending:
                raise BadRecord("orphan_tool_result", f"message {i} is a tool result without a matching call "
                                                      f"({call_id!r})")
            results.append({"role": "tool", "tool_call_id": call_id, "content": _text(message.get("content"), i)})
            continue
        if pending:
            _close(out, pending, results, before=i)
        content = _text(message.get("content"), i)
        if role == "assistant" and message.get("tool_calls"):
            calls = [_call(call, i) for call in _list(message["tool_calls"], f"message {i} tool_calls")]
            pending = {call["id"]: n for n, call in enumerate(calls)}
            if len(pending) < len(calls):
                raise BadRecord("bad_tool_call", f"message {i} has two tool calls with one id")
            out.append({"role": role, "content": content or None, "tool_calls": calls})
        else:
            out.append({"role": role, "content": content})
    if pending and not (open_end and not results):
        _close(out, pending, results, before=None)
    if not any(m["role"] == "user" for m in out):
        raise BadRecord("no_user_message", "conversation has no user message")
    return out


def _close(out: list[dict], pending: dict[str, int], results: list[dict], before: int | None) -> None:
    # The results of one assistant turn, in the order of its calls (logs often write them as they finish).
    answered = {r["tool_call_id"] for r in results}
    missing = [c for c in pending if c not in answered]
    if missing:
        where = f"before message {before}" if before is not None else "at the end"
        raise BadRecord("unanswered_tool_call", f"tool call {missing[0]!r} has no result {where}")
    if len(results) > len(pending):
        raise BadRecord("orphan_tool_result", f"tool call {results[0]['tool_call_id']!r} has two results")
    out.extend(sorted(results, key=lambda r: pending[r["tool_call_id"]]))
    pending.clear()
    results.clear()


def _text(content, i: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRecord("wrong_type", f"message {i} has a content part that is not text ({kind!r})")
            texts.append(part["text"])
        return "\n".join(texts)
    raise BadRecord("wrong_type", f"message {i} content is not text")


def _list(value, what: str) -> list:
    if not isinstance(value, list):
        raise BadRecord("wrong_type", f"{what} is not a list")
    return value


def _call(call, i: int) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not call.get("id") or not isinstance(function.get("name"), str):
        raise BadRecord("bad_tool_call", f"message {i} has a tool call without id or function name")
    # A target with such a call would teach the model to emit it, and replay could not serve it: each its own kind.
    if not function["name"].strip():
        raise BadRecord("empty_tool_name", f"message {i} has a tool call with an empty function name")
    arguments = function.get("arguments")
    if arguments is None:
        arguments = "{}"
    elif not isinstance(arguments, str):  # some loggers keep the parsed object
        if not isinstance(arguments, dict):
            raise BadRecord("tool_arguments_not_object", f"message {i}: tool call {function['name']!r} has "
                                                         f"arguments that are not a JSON object")
        arguments = json.dumps(arguments, ensure_ascii=False)
    else:
        try:
            parsed = orjson.loads(arguments) if arguments.strip() else {}
        except orjson.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise BadRecord("tool_arguments_not_object", f"message {i}: tool call {function['name']!r} has "
                                                         f"arguments that are not a JSON object")
    return {"id": str(call["id"]), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def to_trace(record: dict, source: SourceConfig, location: str, cfg: CollectConfig, redactor: Redactor,
             label: str | None = None) -> dict:
    """One traces-table row, redacted; raise BadRecord with the reason otherwise (PartialTurn: skip it).

    `label`, the source's label, saves deriving it again for every record.
    """
    return _to_trace(record, source, location, cfg, redactor, label)[0]


def _to_trace(record: dict, source: SourceConfig, location: str, cfg: CollectConfig, redactor: Redactor,
              label: str | None) -> tuple[dict, list[dict], tuple[str, ...]]:
    """to_trace's row, its messages as a list (what json.loads of the row's `messages` gives), and the fields
    the config names that the record lacks (scenario, expected_actions, group)."""
    parts = extract(record, source)
    messages, tools = normalise_messages(parts.messages, open_end=parts.partial), _list(parts.tools, "tools")
    tools_text = _tools_text(tools)
    # Gated first, as one text, since most records have nothing to redact: the strings of the messages (their
    # shape is normalise_messages's), the tool list as its text (which holds all its strings), the rest
    scrub = _unchanged
    scenario, expected = parts.scenario, parts.expected_actions
    group = _group(record, cfg.group_by)
    if redactor.needed_in(_message_strings(messages), tools_text, parts.metadata, parts.record_id, scenario,
                          expected, group):
        scrub = redactor.value
        messages, tools = scrub(messages), scrub(tools)
        tools_text = _tools_text(tools)
        scenario, expected, group = scrub(scenario), scrub(expected), scrub(group)
    metadata = scrub(parts.metadata)  # keeps the record's time field as it was, redacted like the rest
    # collected_at holds a time or nothing: text that is no time may be anything (a name, an address)
    collected_at = parts.time if _ISO_UTC.fullmatch(parts.time) else ""
    messages_text = _JSON_TEXT(messages)
    metadata_text = _JSON_SORTED(metadata)
    size = len(messages_text) + len(tools_text) + len(metadata_text)
    if size > cfg.max_record_bytes:
        raise BadRecord("oversize", f"record is {size} characters, over max_record_bytes {cfg.max_record_bytes}")
    body = f'{{"messages": {messages_text}, "tools": {tools_text}}}'
    record_id = scrub(parts.record_id)
    try:  # JSON's escapes can spell a lone surrogate, which no UTF-8 text (the hash, Parquet) can hold
        trace_id = hashlib.sha256(body.encode()).hexdigest()[:16]
        metadata_text.encode()
        record_id.encode()
    except UnicodeEncodeError as err:
        raise BadRecord("not_unicode", f"a string holds {err.object[err.start]!r}, an unpaired surrogate: "
                                       "not Unicode text") from None
    return {
        "trace_id": trace_id,
        "record_id": record_id,
        "source": source.label if label is None else label,
        "location": location,
        # the record's own time; never the clock, so a rerun writes the same bytes
        "collected_at": collected_at,
        "messages": messages_text,
        "tools": tools_text,
        "outcome": parts.outcome,
        "score": parts.score,
        # every attempt at one scenario in one split, when the records say which (collect.group_by)
        "split": split_of(group or conversation_hash(messages), cfg.heldout_fraction),
        "group": group,
        "scenario": scenario,
        "expected_actions": "" if expected is None else _JSON_TEXT(expected),
        "metadata": metadata_text,
    }, messages, parts.missing + (("group",) if cfg.group_by and not group else ())


def _group(record: dict, path: str | None) -> str:
    """collect.group_by's value in the record, as text; "" when unset or absent (split by the conversation)."""
    if path is None:
        return ""
    value = get_path(record, path)
    return "" if value in (_MISSING, None, "") else str(value)


def unknown_actions(row: dict) -> list[str]:
    """The expected actions' tools that the trace neither lists nor calls (a label for another agent's tools?)."""
    if not row["expected_actions"]:
        return []
    known = {t["function"]["name"] for t in orjson.loads(row["tools"])}
    known |= {c["function"]["name"] for m in orjson.loads(row["messages"]) for c in m.get("tool_calls") or []}
    return sorted({a["name"] for a in orjson.loads(row["expected_actions"])} - known)


def _unchanged(value):
    return value


def _message_strings(messages: list[dict]) -> list[str]:
    """Every string of normalised messages that redaction could change (roles are one of ROLES, call types
    'function', and a result's tool_call_id is its call's id, as normalise_messages checked)."""
    out = []
    for message in messages:
        if message["content"]:
            out.append(message["content"])
        for call in message.get("tool_calls") or ():
            out += (call["id"], call["function"]["name"], call["function"]["arguments"])
    return out


# Every record of an agent carries the same few tool lists: their JSON text is kept, keyed by orjson's text of
# the list (~10x cheaper to make) and given back only for an equal list. The two checks together are exact:
# equal orjson texts differ in json's text only where orjson writes null for NaN or an infinity, and those
# lists are not equal (NaN equals nothing, None no number).
_TOOLS_TEXT: dict[bytes, tuple[list, str]] = {}


def _tools_text(tools: list) -> str:
    try:
        key = orjson.dumps(tools)
    except (TypeError, orjson.JSONEncodeError):  # integers past 64 bits, lone surrogates, ...: json decides
        return _JSON_TEXT(tools)
    kept = _TOOLS_TEXT.get(key)
    if kept is not None and kept[0] == tools:
        return kept[1]
    text = _JSON_TEXT(tools)
    if len(_TOOLS_TEXT) >= 1_000:
        _TOOLS_TEXT.clear()
    _TOOLS_TEXT[key] = (tools, text)
    return text


def redact_location(location: str, redactor: Redactor) -> str:
    """`file:line`, `s3://bucket/key:line`, `mlflow:...` with personal data in the name replaced.

    File names and object keys are often made of user ids and addresses (`exports/jane@example.com.jsonl`).
    The name is redacted apart from its line number, so a file's many records cost one search (the redactor
    remembers strings it has seen) and the line stays readable.
    """
    head, sep, tail = location.rpartition(":")
    if sep and tail.isdigit():
        return f"{redactor.text(head)}:{tail}"
    return redactor.text(location)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a while (it is process-wide), on again after if it was on.

    Collecting makes hundreds of thousands of rows and records, and no reference cycles: each collection the
    allocations trigger walks every one of them again (parsing 20k records kept alive: 33 µs each, 6 without).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextmanager
def system_allocator() -> Iterator[None]:
    """Arrow's buffers from the C library's malloc for a while (the default pool is process-wide, and forked
    workers inherit it), the default pool again after.

    Arrow's default pool (mimalloc) hands a freed batch's memory back to the OS and the next batch faults its
    pages in again: collect's Arrow tables cost 6 µs a row with it and 1.8 µs without (200k rows in one
    process: 1.1-1.2 s against 0.36 s).
    """
    before = pa.default_memory_pool()
    pa.set_memory_pool(pa.system_memory_pool())
    try:
        yield
    finally:
        pa.set_memory_pool(before)


def collect(readers: Iterable[Reader], cfg: CollectConfig, redactor: Redactor,
            previous: tuple[list[dict], list[dict]] = ([], []), since: dict[str, dict] | None = None,
            tasks_of: Callable[[list[dict], list[list[dict]]], pa.Table] | None = None) -> Collected:
    """Previous rows plus every record the readers yield (after their watermarks in `since`, if given).

    The result does not depend on which records came in which run: duplicates keep the earliest row, the label
    of a call that ended in tool calls joins the conversation that completes it (keep_earliest), and both tables
    are sorted, so an incremental run writes the same tables as a full re-collect of the same records.
    Records are processed in batches of BATCH (read, checked, normalised, redacted, made an Arrow table and
    pandera-checked and, with `tasks_of(rows, their messages)`, given its columns: tasksets.made_tasks, the
    rows' tasks, for tasksets.task_table), by `cfg.workers` processes once there is more than one batch; the
    result does not depend on how many.
    """
    found = Collected(to_arrow([]), [])
    tables: list[pa.Table] = []
    bad: list[dict] = []
    redacted: Counter = Counter()
    with _Batches(_Work(cfg, redactor, tasks_of), workers(cfg)) as batches:
        for reader in readers:
            label = reader.source.label
            after = None if since is None else since.get(label)
            items = reader.read(after, parse=False) if isinstance(reader, FileReader) else reader.read(after)
            for done in batches.run(label, reader.source, items):
                found.records[label] += done.records
                found.partial += done.partial
                tables.append(done.table)
                bad += done.bad
                redacted.update(done.redacted)
                found.missing.update(done.missing)
                found.warnings += done.warnings
            found.states[label] = reader.state

    rows = pa.concat_tables(tables) if tables else _placed(to_arrow([]))
    found.table, found.duplicates, found.new, _ = keep_earliest(to_arrow(previous[0]), rows)
    found.labels_joined, found.labels_on_partial = label_counts(found.table)
    unique = {tuple(q[k] for k in ("source", "location", "kind", "reason", "raw")): q for q in previous[1] + bad}
    found.quarantine = sorted(unique.values(), key=lambda q: (q["source"], *_place(q["location"]), q["kind"],
                                                              q["reason"], q["raw"]))
    found.bad = Counter(q["source"] for q in bad)
    found.reasons = Counter(q["kind"] for q in bad)
    found.redacted = redacted
    return found


BATCH = 5_000  # records per batch: one pandera check, one trip to a worker process and back
MAX_WORKERS = 8


def workers(cfg: CollectConfig) -> int:
    """How many processes collect's records go to: cfg.workers, or with 0 one per CPU this process may use
    (at most MAX_WORKERS); 1 where processes cannot be forked (they inherit the environment, not pickle it)."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return 1
    return cfg.workers or min(MAX_WORKERS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                               else os.cpu_count() or 1)


@dataclass
class _Work:
    """What processing a batch needs: the same in this process and in a forked worker."""

    cfg: CollectConfig
    redactor: Redactor
    tasks_of: Callable[[list[dict], list[list[dict]]], pa.Table] | None  # columns beside the rows (their tasks)


@dataclass
class _Done:
    """One batch processed: its rows (schema-checked, as Arrow, with tasks_of's columns, _placed), quarantined
    records and redaction counts."""

    records: int
    table: pa.Table | None = None
    bad: list[dict] = field(default_factory=list)
    redacted: Counter = field(default_factory=Counter)
    partial: int = 0
    missing: Counter = field(default_factory=Counter)  # fields a source names that records lack, by field
    warnings: list[str] = field(default_factory=list)


_WORKER: _Work | None = None  # a worker process's, inherited from the parent when it forks


def _set_worker(work: _Work) -> None:
    global _WORKER
    _WORKER = work


def _in_worker(label: str, source: SourceConfig, items: list) -> _Done:
    return _process(_WORKER, label, source, items)


def _process(work: _Work, label: str, source: SourceConfig, items: list) -> _Done:
    done, rows, parsed = _Done(0), [], {}
    redactor, cfg = work.redactor, work.cfg
    redactor.counts = Counter()  # this batch's counts: the caller adds up every batch's
    for location, raw, record in _items(items, cfg.max_record_bytes):
        done.records += 1
        location = redact_location(location, redactor)
        try:
            if isinstance(record, BadRecord):
                raise record
            row, messages, missing = _to_trace(record, source, location, cfg, redactor, label)
            rows.append(row)
            parsed[id(row)] = messages
            done.missing.update(missing)
            unknown = unknown_actions(row)
            if unknown:
                done.warnings.append(f"{location}: expected actions name tools the trace never saw: "
                                     f"{', '.join(unknown)}")
        except PartialTurn:
            done.partial += 1
        except BadRecord as why:
            if raw is None:
                raw = sources.json_text(record)
            done.bad.append({"source": label, "location": location, "kind": why.kind,
                             "reason": redactor.text(str(why)), "raw": redactor.text(raw)[:QUARANTINE_RAW_CHARS]})
    rows, table, invalid = _schema_check(rows)
    done.bad += invalid
    if work.tasks_of is not None:
        beside = work.tasks_of(rows, [parsed[id(row)] for row in rows])
        for name, column in zip(beside.column_names, beside.columns, strict=True):
            table = table.append_column(name, column)
    done.table = _placed(table)
    done.redacted = redactor.counts
    return done


class _Batches:
    """Batches processed here, or by worker processes forked at the second batch, in order either way."""

    def __init__(self, work: _Work, workers: int):
        self.work, self.workers = work, workers
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> _Batches:
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def run(self, label: str, source: SourceConfig, items: Iterable) -> Iterator[_Done]:
        chunks = _chunks(items, BATCH)
        first = next(chunks, None)
        if first is None:
            return
        second = next(chunks, None) if self.workers > 1 else None
        if second is None and self._pool is None:
            yield _process(self.work, label, source, first)
            yield from (_process(self.work, label, source, chunk) for chunk in chunks)
            return
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("fork"),
                                             initializer=_set_worker, initargs=(self.work,))
        pending: deque = deque()
        try:
            for chunk in (c for c in (first, second) if c is not None):
                pending.append(self._pool.submit(_in_worker, label, source, chunk))
            for chunk in chunks:
                if len(pending) >= 2 * self.workers:  # bounded: memory stays flat however many records there are
                    yield pending.popleft().result()
                pending.append(self._pool.submit(_in_worker, label, source, chunk))
            while pending:
                yield pending.popleft().result()
        except BrokenProcessPool as err:
            raise RuntimeError(f"collect: a worker process of source '{label}' ended abruptly (killed, or out of "
                               f"memory?); nothing was written. `collect.workers: 1` processes the records in "
                               f"the stage's own process") from err


def _items(items: list, max_bytes: int) -> Iterator[tuple]:
    """A batch's records: Lines (FileReader.read(parse=False)) split and read here."""
    for item in items:
        if isinstance(item, Lines):
            yield from item.items(max_bytes)
        else:
            yield item


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    """Batches of about `size` records, a block of Lines counted as the records its bytes would hold at
    sources.BLOCK_BYTES a batch (so a large file's blocks are a batch each, and small files share one)."""
    batch: list = []
    weight = 0.0
    for item in items:
        batch.append(item)
        weight += size * len(item.data) / sources.BLOCK_BYTES if isinstance(item, Lines) else 1
        if weight >= size:
            yield batch
            batch, weight = [], 0.0
    if batch:
        yield batch


def to_arrow(rows: list[dict]) -> pa.Table:
    """Rows as to_trace makes them, as an Arrow table of the traces schema (a column at a time: ~5x faster than
    pa.Table.from_pylist, the same table)."""
    return pa.table([pa.array([row[name] for row in rows], column.type) for name, column in
                     zip(SCHEMA.names, SCHEMA, strict=True)], schema=SCHEMA)


_PLACE = ["_head", "_line"]  # _place(location), as two columns: what the table is sorted by after the time


def _placed(table: pa.Table) -> pa.Table:
    """The table with its rows' _place as the columns _PLACE (if it has not got them yet); the line number as
    text that sorts as the number does (its digit count first), so no number is too large for a column."""
    if table.schema.names[-len(_PLACE):] == _PLACE:
        return table
    heads, lines = [], []
    for location in table.column("location").to_pylist():
        head, line = _place(location)
        heads.append(head)
        lines.append(f"{len(digits := str(line)):04d}{digits}")
    return table.append_column("_head", pa.array(heads, pa.string())).append_column("_line",
                                                                                    pa.array(lines, pa.string()))


def keep_earliest(previous: pa.Table, rows: pa.Table) -> tuple[pa.Table, int, Counter, pa.Table]:
    """Previous and new rows sorted by `order`, each trace_id's earliest kept (of equals, the first given), the
    label of a partial turn on the conversation that completes it (join_labels);
    (the table, new rows whose trace_id was already there, new rows kept per source, the new rows kept).

    Columns the new rows have beside the traces schema (collect's tasks_of) are kept, null for previous rows.
    """
    rows = _placed(rows)
    previous = previous.select(SCHEMA.names)
    for column in rows.schema:
        if column.name not in SCHEMA.names and column.name not in _PLACE:
            previous = previous.append_column(column, pa.nulls(previous.num_rows, column.type))
    previous = _placed(previous)
    both, joined = join_labels(pa.concat_tables([previous, rows]))
    keys = [(name, "ascending") for name in ("collected_at", "source", *_PLACE, "trace_id")]
    ranked = pc.sort_indices(both, sort_keys=keys)  # a stable sort: equals stay in the order given
    seen: set[str] = set()
    kept = []
    for i, trace_id in zip(ranked.to_pylist(), both.column("trace_id").take(ranked).to_pylist(), strict=True):
        if trace_id not in seen and i not in joined:
            seen.add(trace_id)
            kept.append(i)
    new_ids = set(rows.column("trace_id").to_pylist())
    duplicates = rows.num_rows - len(new_ids - set(previous.column("trace_id").to_pylist()))
    table = both.take(pa.array(kept, pa.int64())).drop_columns(_PLACE).combine_chunks()
    fresh = table if not previous.num_rows else (  # a full collect's: every row, not a copy of them
        table.filter(pa.array([i >= previous.num_rows for i in kept], pa.bool_())))
    return table, duplicates, Counter(fresh.column("source").to_pylist()), fresh


# A call that ended in tool calls, kept for its label (shapes.extract's `partial`): its messages end in those
# calls, and normalised messages as JSON text end in `]}]` exactly then (any other last message ends in its
# content, a JSON string or null)
OPEN_END = "]}]"


def join_labels(both: pa.Table) -> tuple[pa.Table, set[int]]:
    """Rows (placed) with the label of each partial turn (a call that ended in tool calls, kept for its label) on
    the conversation that completes it: (the rows plus one per such label, the partial turns' rows now joined).

    An agent's turn is several calls: one ends in tool calls, the client runs them, and the next call sends the
    whole conversation with their results. The completing conversation is the earliest row (by time, then
    trace_id) that ends in no tool calls and whose messages begin with the partial turn's; its row is added with
    the label's outcome, score, source and location (so it sorts with the labels that count first: a label
    kept in `labels-*` before the unlabelled `traffic-*` copy), and its metadata names the labelled answer
    (`labelled_answer`, its record id). A partial turn that nothing completes stays a row of its own: its label
    is counted among the outcomes, and an accepted one may be a training target that ends in its tool calls.

    Joined in one run or over several, the table is the same, as long as a completing call is not read before
    an earlier call that also completes the turn (an agent's calls come in order).
    """
    messages = both.column("messages")
    partial = pc.ends_with(messages, OPEN_END)
    at = _where(partial)
    if not at:
        return both, set()
    complete, times, ids = pc.invert(partial), both.column("collected_at"), both.column("trace_id")
    pairs = []  # (the partial turn's row, its completing conversation's row)
    for i in at:
        opened = messages[i].as_py()[:-1] + ", "  # its messages, then more
        found = _where(pc.and_(complete, pc.starts_with(messages, pattern=opened)))
        if found:
            pairs.append((i, min(found, key=lambda j: (times[j].as_py(), ids[j].as_py()))))
    if not pairs:
        return both, set()
    labels = both.take([i for i, _ in pairs]).select(["record_id", "source", "location", "outcome", "score",
                                                      "metadata"]).to_pylist()
    rows = both.take([j for _, j in pairs]).drop_columns(_PLACE)
    given = {name: [label[name] for label in labels] for name in ("source", "location", "outcome", "score")}
    given["metadata"] = [_labelled(text, label) for text, label in
                         zip(rows.column("metadata").to_pylist(), labels, strict=True)]
    for column in rows.schema:
        if column.name in given:
            values = pa.array(given[column.name], column.type)
        elif column.name not in SCHEMA.names:  # tasks_of's columns: the task is made again, with the label
            values = pa.nulls(rows.num_rows, column.type)
        else:
            continue
        rows = rows.set_column(rows.schema.get_field_index(column.name), column, values)
    return pa.concat_tables([both, _placed(rows)]), {i for i, _ in pairs}


def _labelled(metadata: str, label: dict) -> str:
    """The completing conversation's metadata with the label's time (`labelled_at`, if it has one) and the
    answer it labelled: the same whichever copy of that conversation it was (a label of its own, or none)."""
    out = json.loads(metadata)
    out.pop("labelled_at", None)
    at = json.loads(label["metadata"]).get("labelled_at")
    if at is not None:
        out["labelled_at"] = at
    out["labelled_answer"] = label["record_id"]
    return _JSON_SORTED(out)


def label_counts(table: pa.Table) -> tuple[int, int]:
    """(Rows labelled through a partial turn they complete, partial turns kept for their label) in a traces table."""
    joined = pc.sum(pc.match_substring(table.column("metadata"), '"labelled_answer": ')).as_py()
    partial = pc.sum(pc.ends_with(table.column("messages"), OPEN_END)).as_py()
    return joined or 0, partial or 0


def completes_stored(stored: pa.Table, rows: pa.Table) -> bool:
    """Whether new rows may complete a partial turn of the stored table: then they cannot simply be appended
    (tracetable.merge), the table is merged whole (keep_earliest) so that the label joins them."""
    messages = stored.column("messages")
    new = rows.column("messages")
    return any(pc.any(pc.starts_with(new, pattern=messages[i].as_py()[:-1] + ", ")).as_py()
               for i in _where(pc.ends_with(messages, OPEN_END)))


def _where(mask: pa.ChunkedArray) -> list[int]:
    """The positions where a boolean column is true (one array first: Arrow 25 crashes on a column of no chunks)."""
    return pc.indices_nonzero(mask.combine_chunks()).to_pylist()


def _schema_check(rows: list[dict]) -> tuple[list[dict], pa.Table, list[dict]]:
    """The traces contract checked on the new rows (lazily: every failure); rows that break it are quarantined.
    (The rows kept, them as Arrow, the quarantined.)"""
    table = to_arrow(rows)
    if not rows:
        return rows, table, []
    schema = schemas.Traces.to_schema().update_column("trace_id", unique=False)  # duplicates are merged later
    try:
        schema.validate(table.to_pandas(), lazy=True)
        return rows, table, []
    except pandera.errors.SchemaErrors as err:
        cases = err.failure_cases.dropna(subset=["index"])
    why: dict[int, list[str]] = {}
    for case in cases.itertuples():
        why.setdefault(int(case.index), []).append(f"{case.column}: {case.check} (got {case.failure_case!r})")
    good = [row for i, row in enumerate(rows) if i not in why]
    quarantined = [{"source": rows[i]["source"], "location": rows[i]["location"], "kind": "schema",
                    "reason": "; ".join(reasons), "raw": json.dumps(rows[i], default=str)[:QUARANTINE_RAW_CHARS]}
                   for i, reasons in sorted(why.items())]
    return good, to_arrow(good), quarantined


def _place(location: str) -> tuple[str, int]:
    head, _, tail = location.rpartition(":")
    return (head, int(tail)) if tail.isdigit() else (location, 0)


def order(row: dict) -> tuple:
    """The traces table's sort key: the record's time, then where it was read."""
    return (row["collected_at"], row["source"], *_place(row["location"]), row["trace_id"])


def table_rows(frame: pd.DataFrame) -> list[dict]:
    """A table read back as rows like the ones collect() makes (nulls as None)."""
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
            for row in frame.to_dict("records")]
