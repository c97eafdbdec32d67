"""The traces and tasks tables as Arrow: new traces merged into the stored table, appended when they come after it.

An incremental run's new traces usually carry later times than every stored one, so the merged table is the
stored table with the new rows after it: no stored row is turned back into Python objects, sorted or checked
again (the stored table was checked when it was written, and its md5 is the one the watermark recorded). The
result is the table a full re-collect writes, row for row, and written the same way it is the same bytes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from flywheel.data import tasksets
from flywheel.data.catalog import Catalog
from flywheel.data.trace_rows import SCHEMA, completes_stored, keep_earliest, order, to_arrow

__all__ = ["SCHEMA", "Merged", "Written", "merge", "to_arrow", "unchanged", "write"]


@dataclass
class Merged:
    """The traces table after this run, and what this run added to it."""

    table: pa.Table  # with the columns collect gave its new rows beside the traces' (tasks_of), if any
    fresh: pa.Table  # the rows this run added, in table order (with those columns)
    appended: bool  # the table is the stored one with `fresh` after it
    duplicates: int  # new rows whose trace was already stored
    new: Counter  # per source: rows added


def merge(stored: pa.Table | None, rows: pa.Table) -> Merged:
    """The stored table plus new rows (collect's: sorted, each trace_id once), as keep_earliest merges them.

    Columns the new rows carry beside the traces schema (their tasks) stay beside them, null for stored rows."""
    if stored is None or stored.num_rows == 0:
        return Merged(rows, rows, True, 0, Counter(rows.column("source").to_pylist()))
    stored = stored.select(SCHEMA.names).cast(SCHEMA)
    last = order(stored.slice(stored.num_rows - 1).to_pylist()[0])
    # where each new trace_id is in the stored table, if it is (a hash lookup in Arrow, not in Python)
    where = pc.index_in(rows.column("trace_id"), value_set=stored.column("trace_id"))
    twin = pc.is_valid(where)
    twins = rows.filter(twin).to_pylist()  # a retried upload's few rows
    kept = stored.select(["collected_at", "source", "location", "trace_id"]).take(where.filter(twin)).to_pylist()
    fresh = rows.filter(pc.invert(twin))
    # appended: every new trace comes after the stored table (rows are sorted: the first says), and every
    # later copy of a stored trace comes after its stored copy, which therefore stays (a retried upload)
    later = all(order(row) >= order(k) for row, k in zip(twins, kept, strict=True))
    # ... and no new row completes a turn stored for its label (the label joins it: keep_earliest)
    if later and (not fresh.num_rows or (order(fresh.slice(0, 1).to_pylist()[0]) > last
                                         and not completes_stored(stored, fresh))):
        table = pa.concat_tables([stored, fresh.select(SCHEMA.names)]).combine_chunks()
        return Merged(table, fresh, True, len(twins), Counter(fresh.column("source").to_pylist()))
    # new rows among the stored ones: sorted again as a whole (the slow path, for late or back-filled records)
    table, duplicates, new, fresh = keep_earliest(stored, rows)
    return Merged(table, fresh, False, duplicates, new)


@dataclass
class Written:
    """What the traces and tasks tables hold after this run (whether or not it wrote them)."""

    outcomes: pa.ChunkedArray  # the traces' outcome column
    tasks: pa.Table  # the tasks' split and origin columns (at least)
    new: Counter  # per source: traces added
    duplicates: int  # new rows whose trace was already stored


def write(catalog: Catalog, rows: pa.Table, incremental: bool, same_tasks: bool,
          build: Callable[[pa.Table, set[str] | None], pa.Table]) -> Written:
    """Merge new trace rows (collect's table) into the stored traces (if `incremental`); write both tables.

    `build(traces, known)` is tasksets.task_table for the pipeline's environment. When the traces were
    appended and the tasks table was built the way it would be now (`same_tasks`), only the new traces' tasks
    are built and appended; otherwise the tasks table is built from every trace.
    """
    merged = merge(catalog.read_arrow("traces") if incremental else None, rows)
    # Parquet is written outside the GIL: the traces table on a thread of its own while the tasks are built
    with ThreadPoolExecutor(1) as thread:
        traces_written = thread.submit(catalog.write_arrow, "traces", merged.table.select(SCHEMA.names))
        if merged.appended and same_tasks:
            stored = catalog.read_arrow("tasks").cast(tasksets.SCHEMA)
            added = build(merged.fresh, tasksets.known_keys(stored))
            tasks = pa.concat_tables([stored, added]).combine_chunks()
        else:
            tasks = added = build(merged.table, None)
        catalog.check("tasks", added.to_pandas())  # the new rows, once
        traces_written.result()
    catalog.write_arrow("tasks", tasks)
    return Written(merged.table.column("outcome"), tasks, merged.new, merged.duplicates)


def unchanged(catalog: Catalog) -> Written:
    """The tables as they are, read only as far as the stage's metrics need (nothing new was read)."""
    return Written(catalog.read_arrow("traces", ["outcome"]).column("outcome"),
                   catalog.read_arrow("tasks", ["split", "origin"]), Counter(), 0)
