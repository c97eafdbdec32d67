"""Where the embedded defaults keep their state (.flywheel/ under the project root), set before anything starts."""

from __future__ import annotations

import logging
import os
import sqlite3
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
