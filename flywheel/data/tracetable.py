"""The traces and tasks tables as Arrow: the traces schema and order, rows merged (each trace once, labels joined
to the conversations they complete), new traces merged into the stored table, appended when they come after it.

An incremental run's new traces usually carry later times than every stored one, so the merged table is the
stored table with the new rows after it: no stored row is turned back into Python objects, sorted or checked
again (the stored table was checked when it was written, and its md5 is the one the watermark recorded). The
result is the table a full re-collect writes, row for row, and written the same way it is the same bytes.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from flywheel.data import tasksets
from flywheel.data.catalog import Catalog
from flywheel.data.trace_rows import JSON_SORTED

__all__ = ["OPEN_END", "SCHEMA", "Merged", "Written", "completes_stored", "join_labels", "keep_earliest",
           "label_counts", "merge", "order", "place", "placed", "to_arrow", "unchanged", "write"]

# The Traces contract's columns as Arrow types: written as they are, with no pandas metadata (whose row count
# would differ between a table built whole and one appended to)
SCHEMA = pa.schema([("trace_id", pa.string()), ("record_id", pa.string()), ("source", pa.string()),
                    ("location", pa.string()), ("collected_at", pa.string()), ("messages", pa.string()),
                    ("tools", pa.string()), ("outcome", pa.string()), ("score", pa.float64()),
                    ("split", pa.string()), ("group", pa.string()), ("scenario", pa.string()),
                    ("expected_actions", pa.string()), ("metadata", pa.string())])


def to_arrow(rows: list[dict]) -> pa.Table:
    """Rows as to_trace makes them, as an Arrow table of the traces schema (a column at a time: ~5x faster than
    pa.Table.from_pylist, the same table)."""
    return pa.table([pa.array([row[name] for row in rows], column.type) for name, column in
                     zip(SCHEMA.names, SCHEMA, strict=True)], schema=SCHEMA)


def place(location: str) -> tuple[str, int]:
    """Where a row was read, as (`file`, line) of `file:line`; (location, 0) when it names no line."""
    head, _, tail = location.rpartition(":")
    return (head, int(tail)) if tail.isdigit() else (location, 0)


def order(row: dict) -> tuple:
    """The traces table's sort key: the record's time, then where it was read."""
    return (row["collected_at"], row["source"], *place(row["location"]), row["trace_id"])


PLACE = ["_head", "_line"]  # place(location), as two columns: what the table is sorted by after the time


def placed(table: pa.Table) -> pa.Table:
    """The table with its rows' place(location) as the columns PLACE (if it has not got them yet); the line as
    text that sorts as the number does (its digit count first), so no number is too large for a column."""
    if table.schema.names[-len(PLACE):] == PLACE:
        return table
    heads, lines = [], []
    for location in table.column("location").to_pylist():
        head, line = place(location)
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
    rows = placed(rows)
    previous = previous.select(SCHEMA.names)
    for column in rows.schema:
        if column.name not in SCHEMA.names and column.name not in PLACE:
            previous = previous.append_column(column, pa.nulls(previous.num_rows, column.type))
    previous = placed(previous)
    both, joined = join_labels(pa.concat_tables([previous, rows]))
    keys = [(name, "ascending") for name in ("collected_at", "source", *PLACE, "trace_id")]
    ranked = pc.sort_indices(both, sort_keys=keys)  # a stable sort: equals stay in the order given
    seen: set[str] = set()
    kept = []
    for i, trace_id in zip(ranked.to_pylist(), both.column("trace_id").take(ranked).to_pylist(), strict=True):
        if trace_id not in seen and i not in joined:
            seen.add(trace_id)
            kept.append(i)
    new_ids = set(rows.column("trace_id").to_pylist())
    duplicates = rows.num_rows - len(new_ids - set(previous.column("trace_id").to_pylist()))
    table = both.take(pa.array(kept, pa.int64())).drop_columns(PLACE).combine_chunks()
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
    rows = both.take([j for _, j in pairs]).drop_columns(PLACE)
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
    return pa.concat_tables([both, placed(rows)]), {i for i, _ in pairs}


def _labelled(metadata: str, label: dict) -> str:
    """The completing conversation's metadata with the label's time (`labelled_at`, if it has one) and the
    answer it labelled: the same whichever copy of that conversation it was (a label of its own, or none)."""
    out = json.loads(metadata)
    out.pop("labelled_at", None)
    at = json.loads(label["metadata"]).get("labelled_at")
    if at is not None:
        out["labelled_at"] = at
    out["labelled_answer"] = label["record_id"]
    return JSON_SORTED(out)


def label_counts(table: pa.Table) -> tuple[int, int]:
    """(Rows labelled through a partial turn they complete, partial turns kept for their label) in a traces table."""
    joined = pc.sum(pc.match_substring(table.column("metadata"), '"labelled_answer": ')).as_py()
    partial = pc.sum(pc.ends_with(table.column("messages"), OPEN_END)).as_py()
    return joined or 0, partial or 0


def completes_stored(stored: pa.Table, rows: pa.Table) -> bool:
    """Whether new rows may complete a partial turn of the stored table: then they cannot simply be appended
    (merge), the table is merged whole (keep_earliest) so that the label joins them."""
    messages = stored.column("messages")
    new = rows.column("messages")
    return any(pc.any(pc.starts_with(new, pattern=messages[i].as_py()[:-1] + ", ")).as_py()
               for i in _where(pc.ends_with(messages, OPEN_END)))


def _where(mask: pa.ChunkedArray) -> list[int]:
    """The positions where a boolean column is true (one array first: Arrow 25 crashes on a column of no chunks)."""
    return pc.indices_nonzero(mask.combine_chunks()).to_pylist()


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
