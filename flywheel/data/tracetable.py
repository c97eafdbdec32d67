"""The traces and tasks tables as Arrow: new traces merged into the stored table, appended when they come after it.

An incremental run's new traces usually carry later times than every stored one, so the merged table is the
stored table with the new rows after it: no stored row is turned back into Python objects, sorted or checked
again (the stored table was checked when it was written, and its md5 is the one the watermark recorded). The
result is the table a full re-collect writes, row for row, and written the same way it is the same bytes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from flywheel.data import tasksets
from flywheel.data.catalog import Catalog
from flywheel.data.traces import keep_earliest, order

# The Traces contract's columns as Arrow types: written as they are, with no pandas metadata (whose row count
# would differ between a table built whole and one appended to)
SCHEMA = pa.schema([("trace_id", pa.string()), ("record_id", pa.string()), ("source", pa.string()),
                    ("location", pa.string()), ("collected_at", pa.string()), ("messages", pa.string()),
                    ("tools", pa.string()), ("outcome", pa.string()), ("score", pa.float64()),
                    ("split", pa.string()), ("metadata", pa.string())])


@dataclass
class Merged:
    """The traces table after this run, and what this run added to it."""

    table: pa.Table
    fresh: list[dict]  # the rows this run added, in table order
    appended: bool  # the table is the stored one with `fresh` after it
    duplicates: int  # new rows whose trace was already stored
    new: Counter  # per source: rows added


def to_arrow(rows: list[dict]) -> pa.Table:
    """Rows as collect() makes them, as an Arrow table of the traces schema."""
    return pa.Table.from_pylist(rows, schema=SCHEMA)


def merge(stored: pa.Table | None, rows: list[dict]) -> Merged:
    """The stored table plus new rows (sorted, each trace_id once), exactly as collect() merges lists of rows."""
    if stored is None or stored.num_rows == 0:
        return Merged(to_arrow(rows), rows, True, 0, Counter(row["source"] for row in rows))
    stored = stored.select(SCHEMA.names).cast(SCHEMA)
    last = order(stored.slice(stored.num_rows - 1).to_pylist()[0])
    # where each new trace_id is in the stored table, if it is (a hash lookup in Arrow, not in Python)
    where = pc.index_in(pa.array([row["trace_id"] for row in rows], pa.string()),
                        value_set=stored.column("trace_id")).to_pylist()
    twins = [(row, i) for row, i in zip(rows, where, strict=True) if i is not None]
    kept = stored.select(["collected_at", "source", "location", "trace_id"]).take(
        pa.array([i for _, i in twins], pa.int64())).to_pylist()
    fresh = [row for row, i in zip(rows, where, strict=True) if i is None]
    # appended: every new trace comes after the stored table (rows are sorted: the first says), and every
    # later copy of a stored trace comes after its stored copy, which therefore stays (a retried upload)
    later = all(order(row) >= order(k) for (row, _), k in zip(twins, kept, strict=True))
    if later and (not fresh or order(fresh[0]) > last):
        table = pa.concat_tables([stored, to_arrow(fresh)]).combine_chunks()
        return Merged(table, fresh, True, len(twins), Counter(row["source"] for row in fresh))
    # new rows among the stored ones: merge as Python rows (the slow path, for late or back-filled records)
    merged, duplicates, new = keep_earliest(stored.to_pylist(), rows)
    added = {id(row) for row in rows}
    return Merged(to_arrow(merged), [row for row in merged if id(row) in added], False, duplicates, new)


@dataclass
class Written:
    """What the traces and tasks tables hold after this run (whether or not it wrote them)."""

    outcomes: pa.ChunkedArray  # the traces' outcome column
    tasks: pa.Table  # the tasks' split and origin columns (at least)
    new: Counter  # per source: traces added
    duplicates: int  # new rows whose trace was already stored


def write(catalog: Catalog, rows: list[dict], incremental: bool, same_tasks: bool,
          build: Callable[[Iterable[str], set[str] | None], list[dict]]) -> Written:
    """Merge new trace rows into the stored traces (if `incremental`) and write both tables.

    `build(traces, known)` is tasksets.build_tasks for the pipeline's environment. When the traces were
    appended and the tasks table was built the way it would be now (`same_tasks`), only the new traces' tasks
    are built and appended; otherwise the tasks table is built from every trace.
    """
    merged = merge(catalog.read_arrow("traces") if incremental else None, rows)
    catalog.write_arrow("traces", merged.table)
    if merged.appended and same_tasks:
        stored = catalog.read_arrow("tasks").cast(tasksets.SCHEMA)
        added = tasksets.to_arrow(build(merged.fresh, tasksets.known_keys(stored)))
        tasks = pa.concat_tables([stored, added]).combine_chunks()
    else:
        # every row of the table is this run's (a full collect): its rows as they are, not read back from Arrow
        every = merged.fresh if len(merged.fresh) == merged.table.num_rows else (
            merged.table.select(tasksets.TRACE_COLUMNS).to_pylist())
        tasks = added = tasksets.to_arrow(build(every, None))
    catalog.check("tasks", added.to_pandas())  # the new rows, once
    catalog.write_arrow("tasks", tasks)
    return Written(merged.table.column("outcome"), tasks, merged.new, merged.duplicates)


def unchanged(catalog: Catalog) -> Written:
    """The tables as they are, read only as far as the stage's metrics need (nothing new was read)."""
    return Written(catalog.read_arrow("traces", ["outcome"]).column("outcome"),
                   catalog.read_arrow("tasks", ["split", "origin"]), Counter(), 0)
