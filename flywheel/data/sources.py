"""Where traces come from: local files and globs, an S3 prefix, MLflow Tracing; each reader keeps a watermark.

A reader yields (location, raw text or None, record or BadRecord) and, once exhausted, holds in `state` the
watermark a later incremental run passes back as `since` to read only what is new:
- files: per file, the bytes and lines already read and their md5 (JSON Lines files that grow are read from
  where the last run stopped; any other change re-reads the file, and duplicates merge by content);
- S3: per object key, the ETag read (a new or rewritten object is read whole);
- MLflow: see flywheel/data/mlflow_traces.py.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import orjson

from flywheel.config import CollectConfig, PipelineConfig, SourceConfig
from flywheel.data.catalog import expand
from flywheel.data.mlflow_traces import MlflowReader
from flywheel.data.shapes import BadRecord, SourceError

Item = tuple[str, str | None, dict | BadRecord]
BLOCK_BYTES = 4 << 20  # FileReader.read(parse=False): JSON Lines in blocks of about this many bytes of whole lines
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}


@dataclass
class Lines:
    """Whole JSON Lines lines of a file as read (the last may lack its newline), the first of them `first`;
    split and read where the records are processed (a worker process), not where the file is read."""

    name: str
    first: int
    data: bytes

    def items(self, max_bytes: int) -> Iterator[Item]:
        """Its records as FileReader.read(parse=True) yields them: blank lines skipped but counted."""
        for number, raw in enumerate(self.data.split(b"\n"), start=self.first):
            if raw.strip():
                yield jsonl_line(raw.rstrip(b"\r\n"), f"{self.name}:{number}", max_bytes)


def format_of(name: str, source: SourceConfig) -> tuple[str | None, bool]:
    """(jsonl | json | parquet | None, gzipped) from the source's format or the name's suffixes."""
    gz = name.endswith(".gz")
    if source.format != "auto":
        return source.format, gz
    stem = name.removesuffix(".gz")
    return next((fmt for suffix, fmt in _SUFFIXES.items() if stem.endswith(suffix)), None), gz


def records(data: bytes | BinaryIO, name: str, fmt: str | None, gz: bool, max_bytes: int,
            first_line: int = 1) -> Iterator[Item]:
    """The records of one file or object; a part that cannot be read becomes one quarantined entry."""
    try:
        if fmt is None:
            yield name, "", BadRecord("unsupported_format", f"{name}: not .jsonl, .ndjson, .json or .parquet "
                                                            "(+ .gz); set the source's `format`")
        elif fmt == "parquet":
            yield from _parquet(data, name, max_bytes)
        elif fmt == "json":
            yield from _json(_bytes(data, gz), name, max_bytes)
        else:
            stream = gzip.GzipFile(fileobj=_stream(data)) if gz else _stream(data)
            yield from _jsonl(stream, name, max_bytes, first_line)
    except (OSError, EOFError, zlib.error, ValueError) as err:  # a corrupt gzip or Parquet file
        yield name, "", BadRecord("unreadable", f"{name}: cannot be read past this point: {err}")


def jsonl_line(raw: bytes, location: str, max_bytes: int) -> Item:
    """One JSON Lines record, or why it is not one."""
    if len(raw) > max_bytes:
        return location, raw[:1000].decode("utf-8", "replace"), BadRecord(
            "oversize", f"record is {len(raw)} bytes, over max_record_bytes {max_bytes}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return location, raw.decode("utf-8", "replace"), BadRecord("not_utf8", f"not UTF-8: {err.reason} at "
                                                                              f"byte {err.start}")
    try:
        record = orjson.loads(raw)  # ~3x faster than json.loads
    except orjson.JSONDecodeError:
        # orjson refuses some text json accepts (NaN, integers past 64 bits) and words its errors its own way:
        # json decides, so what is read and what is quarantined, and why, stay as they were
        try:
            record = json.loads(text)
        except json.JSONDecodeError as err:
            return location, text, BadRecord("invalid_json", f"invalid JSON: {err.msg} at column {err.colno}")
    if not isinstance(record, dict):
        return location, text, BadRecord("wrong_type", f"record is a JSON {type(record).__name__}, not an object")
    return location, text, record


def _jsonl(lines: Iterable[bytes], name: str, max_bytes: int, first_line: int) -> Iterator[Item]:
    for number, raw in enumerate(lines, start=first_line):
        if raw.strip():
            yield jsonl_line(raw.rstrip(b"\r\n"), f"{name}:{number}", max_bytes)


def _json(data: bytes, name: str, max_bytes: int) -> Iterator[Item]:
    """A .json file: one record, or a list of records."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        yield name, data[:1000].decode("utf-8", "replace"), BadRecord("not_utf8", f"not UTF-8: {err.reason}")
        return
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as err:
        yield name, text[:1000], BadRecord("invalid_json", f"invalid JSON: {err.msg} at line {err.lineno}")
        return
    if not isinstance(parsed, dict | list):
        yield name, text[:1000], BadRecord("wrong_type", "a .json file holds an object or a list of objects")
        return
    for number, record in enumerate([parsed] if isinstance(parsed, dict) else parsed, start=1):
        raw = json_text(record)
        if not isinstance(record, dict):
            yield f"{name}:{number}", raw, BadRecord("wrong_type", f"element {number} is not an object")
        elif len(raw) > max_bytes:
            yield f"{name}:{number}", raw[:1000], BadRecord("oversize", f"record is {len(raw)} characters, "
                                                                        f"over max_record_bytes {max_bytes}")
        else:
            yield f"{name}:{number}", raw, record


def json_text(value) -> str:
    """A record (or a .json file's element) as JSON text, for the quarantine; escaped to ASCII where a string
    holds a lone surrogate (JSON's escapes can spell one, UTF-8 cannot hold it): the trace is refused later."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    try:
        text.encode()
    except UnicodeEncodeError:
        return json.dumps(value, default=str)
    return text


def _parquet(data: bytes | BinaryIO, name: str, max_bytes: int) -> Iterator[Item]:
    import pyarrow.parquet as pq

    number = 0
    for batch in pq.ParquetFile(_stream(data)).iter_batches(batch_size=10_000):
        for row in batch.to_pylist():
            number += 1
            yield f"{name}:{number}", None, row


def _stream(data: bytes | BinaryIO) -> BinaryIO:
    return io.BytesIO(data) if isinstance(data, bytes) else data


def _bytes(data: bytes | BinaryIO, gz: bool) -> bytes:
    raw = data if isinstance(data, bytes) else data.read()
    return gzip.decompress(raw) if gz else raw


class FileReader:
    """Files matching the source's globs under the project root, in sorted order."""

    def __init__(self, source: SourceConfig, root: Path, max_bytes: int):
        self.source, self.root, self.max_bytes = source, root, max_bytes
        self.state: dict = {}

    def files(self) -> list[Path]:
        return expand(self.root, self.source.path)

    def read(self, since: dict | None, parse: bool = True) -> Iterator[Item | Lines]:
        """parse=False: a JSON Lines file's lines come as Lines, blocks of about BLOCK_BYTES, to be split and
        read where the records are processed (a worker process), not here."""
        seen = (since or {}).get("files", {})
        state: dict[str, dict] = {}
        for path in self.files():
            name = str(path.relative_to(self.root)) if path.is_relative_to(self.root) else str(path)
            fmt, gz = format_of(name, self.source)
            with path.open("rb") as handle:
                before = seen.get(name)
                digest, skip, first_line = hashlib.md5(), 0, 1
                if before and path.stat().st_size >= before["bytes"]:
                    digest = _md5_prefix(handle, before["bytes"])
                    if digest.hexdigest() == before["md5"] and (fmt == "jsonl" and not gz or
                                                                 path.stat().st_size == before["bytes"]):
                        skip, first_line = before["bytes"], before["lines"] + 1
                    else:
                        digest = hashlib.md5()
                handle.seek(skip)
                if fmt == "jsonl" and not gz:
                    # read from where the last run stopped; a last line without its newline may still be being
                    # written, so the watermark stays before it
                    done = {"bytes": skip, "lines": first_line - 1}
                    for block in _blocks(handle):
                        whole = block.endswith(b"\n")
                        lines = Lines(name, done["lines"] + 1, block)
                        if parse:
                            yield from lines.items(self.max_bytes)
                        else:
                            yield lines
                        if whole:
                            digest.update(block)
                            done = {"bytes": done["bytes"] + len(block), "lines": done["lines"] + block.count(b"\n")}
                    state[name] = {**done, "md5": digest.hexdigest()}
                elif skip:
                    state[name] = before
                else:
                    data = handle.read()
                    yield from records(data, name, fmt, gz, self.max_bytes)
                    state[name] = {"bytes": len(data), "lines": 0, "md5": hashlib.md5(data).hexdigest()}
        self.state = {"files": state}


def _blocks(handle: BinaryIO) -> Iterator[bytes]:
    """The rest of the file in blocks of whole lines (about BLOCK_BYTES, or one line if longer), then the last
    line if it has no newline."""
    rest = b""
    while chunk := handle.read(BLOCK_BYTES):
        data = rest + chunk if rest else chunk
        cut = data.rfind(b"\n") + 1
        rest = data[cut:]
        if cut:
            yield data[:cut] if rest else data
    if rest:
        yield rest


def _md5_prefix(handle: BinaryIO, size: int):
    digest, left = hashlib.md5(), size
    while left > 0:
        chunk = handle.read(min(left, 1 << 20))
        if not chunk:
            break
        digest.update(chunk)
        left -= len(chunk)
    return digest


class S3Reader:
    """Objects under an S3 prefix through boto3: endpoint, region and credentials from the AWS environment."""

    def __init__(self, source: SourceConfig, max_bytes: int):
        self.source, self.max_bytes = source, max_bytes
        self.bucket, _, self.prefix = source.s3.removeprefix("s3://").partition("/")
        self.state: dict = {}
        self._client = None

    def client(self):
        if self._client is None:
            import boto3

            self._client = boto3.session.Session().client("s3")
        return self._client

    def listing(self) -> list[tuple[str, str]]:
        """(key, ETag) of every object under the prefix, sorted by key."""
        from botocore.exceptions import BotoCoreError, ClientError

        found = []
        try:
            for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                                Prefix=self.prefix):
                found += [(o["Key"], o["ETag"].strip('"')) for o in page.get("Contents", []) if o["Size"] > 0]
        except (BotoCoreError, ClientError) as err:
            raise SourceError(f"source '{self.source.label}': cannot list {self.source.s3}: {err}") from err
        return sorted(found)

    def read(self, since: dict | None) -> Iterator[Item]:
        from botocore.exceptions import BotoCoreError, ClientError

        seen = (since or {}).get("objects", {})
        objects = {}
        for key, etag in self.listing():
            objects[key] = etag
            if seen.get(key) == etag:
                continue
            name = f"s3://{self.bucket}/{key}"
            try:
                body = self.client().get_object(Bucket=self.bucket, Key=key)["Body"].read()
            except (BotoCoreError, ClientError) as err:
                raise SourceError(f"source '{self.source.label}': cannot read {name}: {err}") from err
            yield from records(body, name, *format_of(key, self.source), self.max_bytes)
        self.state = {"objects": objects}

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.listing()).encode()).hexdigest()


def readers(cfg: CollectConfig, root: Path) -> list:
    """A reader for every source, in the config's order."""
    made = []
    for source in cfg.sources:
        if source.path:
            made.append(FileReader(source, root, cfg.max_record_bytes))
        elif source.s3:
            made.append(S3Reader(source, cfg.max_record_bytes))
        else:
            made.append(MlflowReader(source, cfg.max_record_bytes))
    return made


def unmatched_globs(pipeline: str, cfg: PipelineConfig, root: Path) -> tuple[list[str], list[str]]:
    """(errors, warnings) for the local sources' globs that match no file under root, each naming its key.

    A source none of whose globs matches a file is an error when the pipeline cannot start without traces (its
    tasks or SFT targets come from them: PipelineConfig.needs_traces). Any other glob that matches nothing is a
    warning: a folder that fills later (the served traffic `flywheel loop` writes) may be empty at first.
    """
    errors, warnings = [], []
    for number, source in enumerate(cfg.collect.sources):
        key = f"pipelines.{pipeline}.collect.sources.{number}.path"
        empty = [pattern for pattern in source.path or [] if not expand(root, [pattern])]
        if empty and len(empty) == len(source.path) and cfg.needs_traces:
            needs = ("its tasks come from traces (environment replay)" if cfg.environment.name == "replay" else
                     "its SFT targets come from traces (teacher.policy none)")
            errors.append(f"{key}: no file matches {', '.join(map(repr, empty))} under {root} (source "
                          f"'{source.label}'), and this pipeline cannot start without traces: {needs}; put the "
                          "trace files there, or point the path at where they are")
            continue
        warnings += [f"{key}: {pattern!r} matches no file under {root} yet; collect reads nothing there until "
                     "files arrive (fine for a folder that fills later, such as served traffic)" for pattern in empty]
    return errors, warnings


def local_files(cfg: CollectConfig, root: Path) -> list[Path]:
    """Every local file the sources match: the part of the stage's input whose content is hashed here."""
    return sorted({p for source in cfg.sources if source.path for p in expand(root, source.path)})


def remote_fingerprint(cfg: CollectConfig, root: Path) -> str:
    """A hash of what the remote sources hold now (S3 keys and ETags, MLflow trace ids and states); '' if none."""
    remote = [r for r in readers(cfg, root) if not isinstance(r, FileReader)]
    if not remote:
        return ""
    return hashlib.sha256("|".join(r.fingerprint() for r in remote).encode()).hexdigest()[:16]
