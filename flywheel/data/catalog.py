"""The data catalog: where each stage's tables and models live, validated reads and writes, content hashes."""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pandera.pandas as pa

from flywheel.data import schemas
from flywheel.errors import UserFacingError

# table name -> (the stage that writes it, its schema)
TABLES: dict[str, tuple[str, type[schemas.Strict]]] = {
    "traces": ("collect", schemas.Traces),
    "quarantine": ("collect", schemas.Quarantine),
    "tasks": ("collect", schemas.Tasks),
    "synthetic": ("synthesize", schemas.Synthetic),
    "rollouts": ("rl", schemas.Rollouts),
    "heldout": ("evaluate", schemas.Tasks),  # the eval set this evaluation froze: its own DVC-tracked table
    "eval": ("evaluate", schemas.Eval),
}


# models/<p>/base/SOURCE: the name of the checkpoint the student starts from, when it was not built there
BASE_SOURCE = "SOURCE"


class DataError(UserFacingError, ValueError):
    """A table is missing or breaks its contract; the message names the file and the failing checks."""


@dataclass(frozen=True)
class Catalog:
    """Every path of one pipeline under a project root; stages ask it, they never build paths by hand."""

    root: Path
    pipeline: str

    def stage_dir(self, stage: str) -> Path:
        return self.root / "data" / self.pipeline / stage

    def model_dir(self, name: str) -> Path:
        return self.root / "models" / self.pipeline / name

    def name_base(self, model: str) -> None:
        """Record that the student's base is the checkpoint the config names, not one built in models/<p>/base."""
        self.model_dir("base").mkdir(parents=True)
        (self.model_dir("base") / BASE_SOURCE).write_text(model + "\n")

    def base_source(self) -> str | None:
        """The checkpoint models/<p>/base/SOURCE names; None when the base was built there (tiny)."""
        source = self.model_dir("base") / BASE_SOURCE
        return source.read_text().strip() if source.exists() else None

    def base_model(self) -> Path:
        """Where the student's base lives: models/<p>/base when built there, else the checkpoint SOURCE names."""
        source = self.base_source()
        return self.model_dir("base") if source is None else named_model(self.root, source)

    def table_path(self, name: str) -> Path:
        stage, _ = TABLES[name]
        return self.stage_dir(stage) / f"{name}.parquet"

    def write(self, name: str, frame: pd.DataFrame) -> Path:
        """Validate and write a table; an invalid table is never written."""
        _, schema = TABLES[name]
        path = self.table_path(name)
        frame = _validate(schema, frame, path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        frame.to_parquet(tmp, index=False)
        os.replace(tmp, path)  # readers never see half a file
        return path

    def check(self, name: str, frame: pd.DataFrame) -> pd.DataFrame:
        """Validate rows against a table's contract without writing them (DataError naming the table's file)."""
        return _validate(TABLES[name][1], frame, self.table_path(name))

    def write_arrow(self, name: str, table) -> Path:
        """Write an Arrow table whose rows were checked against the table's contract as they were made.

        For the traces table: collect checks each new row with pandera, and the stored rows it appends to were
        checked when first written; checking all of them again on every write would cost more than the rest.
        """
        import pyarrow.parquet as pq

        path = self.table_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, path)  # readers never see half a file
        return path

    def read_arrow(self, name: str, columns: list[str] | None = None):
        """A table (or some of its columns) as Arrow, as written: unchecked, for the stage that wrote it."""
        import pyarrow.parquet as pq

        path = self.table_path(name)
        if not path.exists():
            raise DataError(f"{path}: table '{name}' not found; run the stage '{TABLES[name][0]}' first")
        return pq.read_table(path, columns=columns)

    def read(self, name: str) -> pd.DataFrame:
        """Read and validate a table written by an earlier stage."""
        _, schema = TABLES[name]
        path = self.table_path(name)
        if not path.exists():
            raise DataError(f"{path}: table '{name}' not found; run the stage '{TABLES[name][0]}' first")
        return _validate(schema, pd.read_parquet(path), path)

    def write_json(self, stage: str, name: str, payload: dict) -> Path:
        path = self.stage_dir(stage) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
        return path

    def read_json(self, stage: str, name: str) -> dict:
        path = self.stage_dir(stage) / name
        if not path.exists():
            raise DataError(f"{path}: not found; run the stage '{stage}' first")
        return json.loads(path.read_text())


def named_model(root: Path, name: str) -> Path:
    """A model the config names: under the project root when it is there (a folder, a GGUF file), else as given
    (a hub id, an absolute path, `pkg:PACKAGE/FILE.gguf`)."""
    local = root / name
    return local if local.exists() else Path(name)


def _validate(schema: type[schemas.Strict], frame: pd.DataFrame, path: Path) -> pd.DataFrame:
    try:
        return schema.validate(frame, lazy=True)
    except pa.errors.SchemaErrors as err:
        cases = err.failure_cases[["column", "check", "index"]].head(10).to_string(index=False)
        raise DataError(f"{path}: breaks the {schema.__name__} contract:\n{cases}") from None


def expand(root: Path, patterns: list[str]) -> list[Path]:
    """Files matching glob patterns relative to root, sorted so hashes do not depend on listing order."""
    found: set[Path] = set()
    for pattern in patterns:
        full = pattern if os.path.isabs(pattern) else str(root / pattern)
        found.update(Path(p) for p in glob.glob(full, recursive=True) if Path(p).is_file())
    return sorted(found)


def content_hash(paths: list[Path], root: Path) -> str:
    """md5 over files' bytes and names (inside a folder: relative to it), in sorted order; missing paths count."""
    digest = hashlib.md5()
    for path in sorted(paths):
        if not path.exists():
            digest.update(f"missing:{_name(path, root)}".encode())
            continue
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            if "__pycache__" in file.parts:
                continue
            digest.update(str(file.relative_to(path) if path.is_dir() else _name(file, root)).encode())
            digest.update(hashlib.md5(file.read_bytes()).digest())
    return digest.hexdigest()


def _name(path: Path, root: Path) -> str:
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
