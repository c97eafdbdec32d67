"""How many trace records arrived since collect's watermarks, counted cheaply: what the trigger sensor asks.

The count reads as little as it can: a local file the watermark knows is only looked at past the bytes already
read (its size says whether there is anything), an S3 object only when its ETag is new, MLflow only the trace
metadata newer than the watermark's time (no spans). JSON Lines records are counted as non-blank lines, not
parsed: a malformed line counts as an arrival here and is quarantined by the collect stage it triggers.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from flywheel.config import CollectConfig
from flywheel.data import watermarks
from flywheel.data.sources import FileReader, S3Reader, format_of, readers, records


def saved_watermarks(root: Path, pipeline: str) -> dict[str, dict]:
    """source label -> the watermark the last collect left; empty if it never ran (everything is new)."""
    path = watermarks.state_path(root, pipeline)
    try:
        return json.loads(path.read_text()).get("sources", {})
    except (OSError, json.JSONDecodeError):
        return {}


def count_new(cfg: CollectConfig, root: Path, since: dict[str, dict]) -> dict[str, int]:
    """source label -> records newer than its watermark (every record where it has none)."""
    counts = {}
    for reader in readers(cfg, root):
        mark = since.get(reader.source.label) or {}
        if isinstance(reader, FileReader):
            counts[reader.source.label] = sum(_new_in_file(reader, path, mark.get("files", {}))
                                              for path in reader.files())
        elif isinstance(reader, S3Reader):
            counts[reader.source.label] = _new_in_objects(reader, mark.get("objects", {}))
        else:
            counts[reader.source.label] = _new_traces(reader, mark)
    return counts


def _new_in_file(reader: FileReader, path: Path, seen: dict[str, dict]) -> int:
    name = str(path.relative_to(reader.root)) if path.is_relative_to(reader.root) else str(path)
    fmt, gz = format_of(name, reader.source)
    before = seen.get(name)
    size = path.stat().st_size
    if before and size == before["bytes"]:
        return 0  # unchanged (a same-size rewrite is caught by the collect stage's own md5 check)
    if fmt == "jsonl" and not gz:
        # a grown JSON Lines file: only the lines past the watermark, and only finished ones (newline-ended)
        skip = before["bytes"] if before and size > before["bytes"] else 0
        with path.open("rb") as handle:
            handle.seek(skip)
            return sum(1 for line in handle if line.endswith(b"\n") and line.strip())
    return _count_records(path.read_bytes(), name, fmt, gz, reader.max_bytes)


def _new_in_objects(reader: S3Reader, seen: dict[str, str]) -> int:
    count = 0
    for key, etag in reader.listing():
        if seen.get(key) != etag:
            body = reader.client().get_object(Bucket=reader.bucket, Key=key)["Body"].read()
            count += _count_records(body, f"s3://{reader.bucket}/{key}", *format_of(key, reader.source),
                                    reader.max_bytes)
    return count


def _count_records(data: bytes, name: str, fmt: str | None, gz: bool, max_bytes: int) -> int:
    if fmt == "jsonl":
        text = gzip.decompress(data) if gz else data
        return sum(1 for line in text.splitlines() if line.strip())
    return sum(1 for _ in records(data, name, fmt, gz, max_bytes))


def _new_traces(reader, mark: dict) -> int:
    """Finished traces of the MLflow experiment newer than the watermark, less those it already read."""
    start, seen = mark.get("timestamp_ms"), set(mark.get("ids", []))
    count = 0
    for trace in reader._search(start, include_spans=False):
        state = getattr(trace.info.state, "value", str(trace.info.state))
        if state in ("OK", "ERROR") and trace.info.trace_id not in seen:
            count += 1
    return count
