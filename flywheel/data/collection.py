"""Trace rows from every source: checked, normalised, redacted, de-duplicated and split; bad records quarantined.

collect() reads every source's records in batches, each made trace rows (trace_rows.py) and checked against
the traces contract, here or by forked worker processes, and merges them as tracetable.keep_earliest does.
"""

from __future__ import annotations

import gc
import json
import math
import multiprocessing
import os
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import pandas as pd
import pandera.pandas as pandera
import pyarrow as pa

from flywheel.config import CollectConfig, SourceConfig
from flywheel.data import schemas, sources
from flywheel.data.redaction import Redactor
from flywheel.data.shapes import BadRecord, PartialTurn
from flywheel.data.sources import FileReader, Lines
from flywheel.data.trace_rows import redact_location, to_trace_parts, unknown_actions
from flywheel.data.tracetable import SCHEMA, keep_earliest, label_counts, place, placed, to_arrow

__all__ = ["BATCH", "Collected", "Reader", "collect", "gc_paused", "system_allocator", "table_rows", "workers"]

QUARANTINE_RAW_CHARS = 10_000


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

    rows = pa.concat_tables(tables) if tables else placed(to_arrow([]))
    found.table, found.duplicates, found.new, _ = keep_earliest(to_arrow(previous[0]), rows)
    found.labels_joined, found.labels_on_partial = label_counts(found.table)
    unique = {tuple(q[k] for k in ("source", "location", "kind", "reason", "raw")): q for q in previous[1] + bad}
    found.quarantine = sorted(unique.values(), key=lambda q: (q["source"], *place(q["location"]), q["kind"],
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
    """One batch processed: its rows (schema-checked, as Arrow, with tasks_of's columns, placed), quarantined
    records and redaction counts."""

    records: int
    table: pa.Table | None = None
    bad: list[dict] = field(default_factory=list)
    redacted: Counter = field(default_factory=Counter)
    partial: int = 0
    missing: Counter = field(default_factory=Counter)  # fields a source names that records lack, by field
    warnings: list[str] = field(default_factory=list)


_WORKER: _Work | None = None  # a worker process's, inherited from the parent when it forks


def _set_worker(work: _Work, parent: int) -> None:
    global _WORKER
    _WORKER = work
    _end_with(parent)


def _end_with(parent: int) -> None:
    """A forked worker ends when the stage's process does, even by SIGKILL: it holds its own end of the pool's pipe,
    so it would wait for work forever (Linux's parent-death signal; elsewhere nothing)."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


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
            row, messages, missing = to_trace_parts(record, source, location, cfg, redactor, label)
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
    done.table = placed(table)
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
                                             initializer=_set_worker, initargs=(self.work, os.getpid()))
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



def table_rows(frame: pd.DataFrame) -> list[dict]:
    """A table read back as rows like the ones collect() makes (nulls as None)."""
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
            for row in frame.to_dict("records")]
