"""Where the embedded defaults keep their state (.flywheel/ under the project root), set before anything starts."""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
from collections.abc import Mapping
from importlib.metadata import version
from pathlib import Path

# MLflow's INFO lines a fresh project root prints once, naming no choice of the user's ("Creating initial MLflow
# database tables...", "Updating database tables"): its own loggers otherwise stay as MLflow sets them
_QUIET_LOGGERS = ("mlflow.store.db.utils",)


def state_dir(root: Path) -> Path:
    return root.resolve() / ".flywheel"


def configure(root: Path) -> None:
    """Point Prefect, MLflow and boto at the project's embedded defaults unless the environment says otherwise."""
    state = state_dir(root)
    state.mkdir(parents=True, exist_ok=True)
    defaults = {
        "PREFECT_HOME": str(state / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # its heartbeat logs "database is locked" otherwise
        # 20 s is too short on a busy 2-core box; past this, `flywheel run` says what to set (flows/processes.py)
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "MLFLOW_TRACKING_URI": f"sqlite:///{state / 'mlflow.db'}",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # stages print their own progress lines
        "TRANSFORMERS_VERBOSITY": "error",
        "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",  # S3-compatible stores reject the new checksums
        "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
    }
    if os.environ.get("AWS_ENDPOINT_URL"):
        # boto3, s3fs (DVC, Prefect results) read AWS_ENDPOINT_URL themselves; MLflow's own variable, for clients
        # and servers that predate it
        defaults["MLFLOW_S3_ENDPOINT_URL"] = os.environ["AWS_ENDPOINT_URL"]
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    write_ahead(os.environ["MLFLOW_TRACKING_URI"])
    seed_prefect_database(embedded_prefect_database())
    for name in _QUIET_LOGGERS:  # a level on the child logger: MLflow's import sets only its parent's
        logging.getLogger(name).setLevel(logging.WARNING)


def write_ahead(tracking_uri: str) -> None:
    """Keep an SQLite tracking store in write-ahead-log mode (the file keeps the mode once set).

    In SQLite's default mode a read that never finished holds its lock until its statement is freed: a stage
    stopped by Ctrl-C in the middle of an MLflow read keeps that statement alive in the traceback, and the write
    that then marks its run KILLED waits MLflow's 20 s and fails with "database is locked". With the log, readers
    never block a writer."""
    if not tracking_uri.startswith("sqlite:///"):
        return
    path = Path(tracking_uri.removeprefix("sqlite:///").split("?")[0])
    if not path.parent.is_dir():  # MLflow makes the folder and the file on first use; the next command sets it
        return
    try:
        with sqlite3.connect(path, timeout=30) as db:
            db.execute("PRAGMA journal_mode=WAL")
        db.close()
    except sqlite3.Error as err:  # the store works without it; a stopped run's marking may then wait
        logging.getLogger(__name__).warning("could not set %s to write-ahead-log mode: %s", path, err)


# A new project's Prefect database: Prefect's server migrates an empty SQLite file on its first start, about 5 s of
# CPU before it answers (a start on a migrated one: 3 s). The first such start keeps its migrated database, still
# empty of runs, as a template for this Prefect version; a new project's database is copied from it.
PREFECT_TEMPLATE_ENV = "FLYWHEEL_PREFECT_TEMPLATE"  # the folder; else ~/.cache/flywheel/prefect-db/<version>
_PREFECT_DATABASE_VARIABLES = ("PREFECT_API_DATABASE_CONNECTION_URL", "PREFECT_SERVER_DATABASE_CONNECTION_URL")
_PREFECT_MEMO = "memo_store.toml"  # what Prefect's server registered at its first start (its block types)


def prefect_template_dir() -> Path:
    found = os.environ.get(PREFECT_TEMPLATE_ENV)
    return Path(found) if found else Path.home() / ".cache" / "flywheel" / "prefect-db" / version("prefect")


def embedded_prefect_database(env: Mapping[str, str] = os.environ) -> Path | None:
    """The SQLite file a Prefect server started with `env` would use: PREFECT_HOME's prefect.db, or None when a
    server is named (PREFECT_API_URL) or the database is set elsewhere."""
    if env.get("PREFECT_API_URL") or any(env.get(v) for v in _PREFECT_DATABASE_VARIABLES):
        return None
    return Path(env["PREFECT_HOME"]) / "prefect.db" if env.get("PREFECT_HOME") else None


def seed_prefect_database(database: Path | None) -> bool:
    """A missing `database` copied from the template, if one is kept. True when the file is still missing: the
    server's start migrates a new one, and keep_prefect_template(database) then keeps it."""
    if database is None or database.exists():
        return False
    template = prefect_template_dir()
    if not (template / database.name).is_file():
        return True
    database.parent.mkdir(parents=True, exist_ok=True)
    if (template / _PREFECT_MEMO).is_file() and not (database.parent / _PREFECT_MEMO).exists():
        _copy_whole(template / _PREFECT_MEMO, database.parent / _PREFECT_MEMO)
    _copy_whole(template / database.name, database)
    return False


def keep_prefect_template(database: Path | None) -> None:
    """Keep `database`, just migrated by a server's first start (no run in it yet), as the template, if none is
    kept: a consistent copy (SQLite's backup, the server still running) put in place whole."""
    template = prefect_template_dir()
    if database is None or not database.is_file() or (template / database.name).is_file():
        return
    try:
        template.mkdir(parents=True, exist_ok=True)
        partial = template / f".{database.name}.{os.getpid()}"
        with sqlite3.connect(database, timeout=30) as source, sqlite3.connect(partial) as copy:
            source.backup(copy)
        source.close()
        copy.close()
        if (database.parent / _PREFECT_MEMO).is_file():
            _copy_whole(database.parent / _PREFECT_MEMO, template / _PREFECT_MEMO)
        os.replace(partial, template / database.name)  # last: a template is whole once its database is there
    except (OSError, sqlite3.Error) as err:  # only the next project's first start is slower
        logging.getLogger(__name__).warning("could not keep a Prefect database template in %s: %s", template, err)


def _copy_whole(source: Path, target: Path) -> None:
    """source copied to target under another name first, then renamed: a reader never sees part of it."""
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    shutil.copyfile(source, partial)
    os.replace(partial, target)


# Object storage is configured the boto3 way, once, for DVC's S3 remote, MLflow's artifacts and Prefect's results:
# credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or a profile or an instance role), AWS_DEFAULT_REGION,
# and AWS_ENDPOINT_URL for an S3-compatible store (MinIO, Ceph, moto), which also needs the two checksum
# settings above.
S3_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_ACCESS_KEY_ID",
                "AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION")
RESULTS_URL = "FLYWHEEL_RESULTS_URL"  # e.g. s3://bucket/prefect-results: where Prefect keeps the stage caches


def s3_summary() -> dict[str, str]:
    """The S3 settings in effect, for messages: credentials only as "(set)", never their values."""
    found = {k: os.environ[k] for k in S3_VARIABLES if os.environ.get(k)}
    if "AWS_ACCESS_KEY_ID" in found:
        found["AWS_ACCESS_KEY_ID"] = "(set)"
    return found
