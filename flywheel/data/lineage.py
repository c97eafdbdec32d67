"""A stage's output as DVC will hash it, computed in-process, and logged to MLflow as a dataset under that hash.

The flow runs `dvc commit` only after the stage returns, so the stage cannot read its own hash from dvc.lock;
it computes the same one. DVC 3 (dvc_data's Tree): a file's md5 is the md5 of its bytes; a folder's is the md5
of the JSON list of {"md5", "relpath"} of its files sorted by relpath (json.dumps, sort_keys), plus ".dir".
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pandas as pd

from flywheel.data.watermarks import file_md5


def dvc_md5(path: Path) -> str:
    """The md5 dvc.lock will record for this output (a file, or a folder as `<md5>.dir`)."""
    if not path.is_dir():
        return file_md5(path) or ""
    files = [p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"]
    listing = sorted(({"md5": file_md5(p), "relpath": p.relative_to(path).as_posix()} for p in files),
                     key=lambda entry: entry["relpath"])
    return hashlib.md5(json.dumps(listing, sort_keys=True).encode("utf-8")).hexdigest() + ".dir"


def log_dataset(run_id: str, frame: pd.DataFrame, name: str, source: Path, digest: str,
                context: str = "training", num_rows: int | None = None) -> None:
    """The table as an MLflow dataset input of the run; its digest is the DVC hash, so either finds the other.

    `num_rows` with an empty `frame` (the columns only) logs a table without loading its rows.
    """
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.types import ColSpec, Schema
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    from flywheel.registry import client

    rows = len(frame) if num_rows is None else num_rows
    # Built directly: mlflow.data.from_pandas infers the schema row by row (seconds for 200k traces).
    types = {"f": "double", "i": "long", "u": "long", "b": "boolean"}
    schema = Schema([ColSpec(types.get(dtype.kind, "string"), str(column)) for column, dtype in frame.dtypes.items()])
    dataset = Dataset(name=name, digest=digest, source_type="local",
                      source=json.dumps({"uri": source.resolve().as_uri()}),
                      schema=json.dumps({"mlflow_colspec": schema.to_dict()}),
                      profile=json.dumps({"num_rows": rows, "num_elements": rows * len(frame.columns)}))
    tags = [InputTag(key=MLFLOW_DATASET_CONTEXT, value=context)]
    client().log_inputs(run_id, datasets=[DatasetInput(dataset=dataset, tags=tags)])
