"""Where incremental collection stopped, per pipeline and source: project state under .flywheel/, not data.

The watermarks are not a DVC output: outputs must be a function of the inputs, and a watermark is a function
of history. They are trusted only while they describe the tables in the workspace: they record the md5 of the
traces and quarantine tables they were written with and the recipe (the collect config and the code that
shapes rows). Any mismatch (a `dvc checkout` of other data, outputs removed by `dvc repro`, a config or code
change, a failed run) means a full re-collect, which writes the same tables an unbroken chain of incremental
runs would: so a rerun is deterministic and `dvc status` stays clean.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from flywheel.config import CollectConfig
from flywheel.data.catalog import content_hash
from flywheel.settings import state_dir

# The modules that decide what a row looks like and how the table is merged and written: a change to any of
# them re-collects everything.
_RECIPE_CODE = ("collection.py", "trace_rows.py", "shapes.py", "sources.py", "mlflow_traces.py", "redaction.py",
                "schemas.py", "tracetable.py")


def state_path(root: Path, pipeline: str) -> Path:
    return state_dir(root) / "watermarks" / pipeline / "collect.json"


def recipe(cfg: CollectConfig) -> str:
    """The collect config (less the incremental switch and the workers) and the row-shaping code, hashed."""
    here = Path(__file__).resolve().parent
    config = json.dumps(cfg.model_dump(mode="json", exclude={"incremental", "workers"}), sort_keys=True)
    code = content_hash([here / name for name in _RECIPE_CODE], here)
    return hashlib.sha256(f"{config}|{code}".encode()).hexdigest()[:16]


def file_md5(path: Path) -> str | None:
    if not path.exists():
        return None
    digest = hashlib.md5()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load(root: Path, pipeline: str, cfg: CollectConfig, tables: dict[str, Path]) -> dict[str, dict] | None:
    """source name -> watermark, if they belong to these tables and this recipe; None means collect in full."""
    path = state_path(root, pipeline)
    if not cfg.incremental or not path.exists():
        return None
    try:
        saved = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if saved.get("recipe") != recipe(cfg):
        return None
    if saved.get("tables") != {name: file_md5(p) for name, p in tables.items()}:
        return None
    return saved.get("sources", {})


def save(root: Path, pipeline: str, cfg: CollectConfig, tables: dict[str, Path], sources: dict[str, dict],
         tasks_recipe: str = "") -> None:
    """Record the watermarks together with the tables they were written with (atomically)."""
    path = state_path(root, pipeline)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"recipe": recipe(cfg), "tables": {name: file_md5(p) for name, p in tables.items()},
               "sources": sources, "tasks_recipe": tasks_recipe}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, sort_keys=True) + "\n")
    os.replace(tmp, path)


def saved_tasks_recipe(root: Path, pipeline: str) -> str:
    """The tasks recipe (tasksets.recipe) the tasks table was last built with; '' if unknown."""
    try:
        return json.loads(state_path(root, pipeline).read_text()).get("tasks_recipe", "")
    except (OSError, json.JSONDecodeError):
        return ""


def reset(root: Path, pipeline: str) -> None:
    """Forget the watermarks: the next run re-collects every source in full."""
    state_path(root, pipeline).unlink(missing_ok=True)
