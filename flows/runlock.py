"""One run of a pipeline at a time on a machine, and runs whose process died marked as what they are.

Each pipeline has a lock file, `.flywheel/locks/<pipeline>.lock`, held with `fcntl.flock` for the whole retrain
flow: the kernel releases it when the holder's process ends, however it ends. The file records the holder (pid,
host, start time, its Prefect flow run and MLflow run). A second run of the pipeline (a schedule firing during a
manual run, two `flywheel run` at once) fails at once naming the first, or waits for it (`flywheel run --wait`).

A holder that ended without clearing its record (SIGKILL, out of memory, a SIGTERM whose last state did not reach
the server) is found by the next run of the pipeline or by `flywheel status`: its Prefect flow run is set CRASHED
and its MLflow runs KILLED where they still say running, so no run stays RUNNING forever.

The lock serialises runs sharing one project folder (the embedded default, or one worker's checkout); workers on
separate machines do not share it.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from flywheel.errors import UserFacingError
from flywheel.settings import state_dir

log = logging.getLogger(__name__)
_WAIT_POLL_S = 1.0


class PipelineBusy(UserFacingError, RuntimeError):
    """Another run of the pipeline holds its lock."""


@dataclass(frozen=True)
class Found:
    """A pipeline's lock file as `reap` found it: held by a live run, or left by one that died (now marked)."""

    pipeline: str
    holder: dict
    running: bool
    marked: list[str]  # what was set: "Prefect flow run ... CRASHED", "MLflow run ... KILLED"

    def line(self) -> str:
        who = describe(self.holder)
        if self.running:
            return f"{self.pipeline}: running now ({who})"
        done = "; ".join(self.marked) if self.marked else "its runs had already ended"
        return f"{self.pipeline}: the run {who} died without finishing: {done}"


def lock_path(root: Path, pipeline: str) -> Path:
    return state_dir(root) / "locks" / f"{pipeline}.lock"


def describe(holder: dict) -> str:
    """The holder in a few words: pid, host, start, its Prefect and MLflow runs."""
    if not holder:
        return "its holder has not recorded itself yet"
    parts = [f"pid {holder.get('pid')} on {holder.get('host')}", f"started {holder.get('started', '?')}"]
    if holder.get("flow_run_id"):
        parts.append(f"Prefect flow run {holder['flow_run_id']}")
    if holder.get("mlflow_run_id"):
        parts.append(f"MLflow run {holder['mlflow_run_id']}")
    return ", ".join(parts)


class Holding:
    """The held lock: `record` adds what the run learns later (its MLflow run) to the file."""

    def __init__(self, handle, holder: dict):
        self._handle = handle
        self.holder = holder
        self._write()

    def record(self, **fields: str) -> None:
        self.holder.update(fields)
        self._write()

    def _write(self) -> None:
        self._handle.seek(0)
        self._handle.truncate()
        self._handle.write(json.dumps(self.holder))
        self._handle.flush()
        os.fsync(self._handle.fileno())

    def clear(self) -> None:
        self._handle.seek(0)
        self._handle.truncate()
        self._handle.flush()


@contextmanager
def pipeline_lock(root: Path, pipeline: str, flow_run_id: str = "", wait: bool = False) -> Iterator[Holding]:
    """Hold the pipeline's run lock for the body; raise PipelineBusy naming the holder (or wait, `wait`).

    The record is cleared when the body returns or raises an error; a body ended by a signal (SIGTERM, Ctrl-C)
    leaves it, so the next run or `flywheel status` checks that the run's states say how it ended."""
    path = lock_path(root, pipeline)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 (held open for the body: the lock is the handle)
    try:
        announced = False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _holder(handle)
                if not wait:
                    raise PipelineBusy(
                        f"pipeline '{pipeline}' is already running ({describe(holder)}); let it finish, or run "
                        f"with --wait to start when it ends (lock: {path})") from None
                if not announced:
                    print(f"waiting for the running '{pipeline}' run to finish ({describe(holder)})", flush=True)
                    announced = True
                time.sleep(_WAIT_POLL_S)
        left = _read(handle)
        if left:  # its holder died while holding it: say so where its runs are tracked
            for line in mark_crashed(left):
                log.warning("%s: %s", pipeline, line)
        holding = Holding(handle, {"pipeline": pipeline, "pid": os.getpid(), "host": socket.gethostname(),
                                   "started": _now(), "flow_run_id": flow_run_id})
        try:
            yield holding
        except Exception:
            holding.clear()  # an error: the flow reports its own FAILED state
            raise
        else:
            holding.clear()
    finally:
        handle.close()  # releases the lock


def reap(root: Path) -> list[Found]:
    """Every pipeline lock under root: the live holders, and the dead ones' runs marked CRASHED / KILLED."""
    found = []
    folder = state_dir(root) / "locks"
    for path in sorted(folder.glob("*.lock")) if folder.is_dir() else []:
        with open(path, "a+", encoding="utf-8") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                found.append(Found(path.stem, _holder(handle), True, []))
                continue
            left = _read(handle)
            if left:
                found.append(Found(path.stem, left, False, mark_crashed(left)))
                handle.seek(0)
                handle.truncate()
    return found


def mark_crashed(holder: dict) -> list[str]:
    """Set the dead holder's Prefect flow run CRASHED and its MLflow runs KILLED where they still say running."""
    marked = []
    why = f"the process ({describe(holder)}) ended without reporting how (killed?); found by flywheel at {_now()}"
    if holder.get("flow_run_id"):
        marked += _crash_flow_run(holder["flow_run_id"], why)
    if holder.get("mlflow_run_id"):
        marked += _kill_mlflow_runs(holder["mlflow_run_id"])
    return marked


def _crash_flow_run(flow_run_id: str, why: str) -> list[str]:
    from prefect import get_client
    from prefect.states import Crashed

    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(flow_run_id)
            if run.state is None or run.state.is_final():
                return []
            client.set_flow_run_state(flow_run_id, Crashed(message=why), force=True)
    except Exception as err:  # no server now: the next check tries again only if the record stays
        return [f"Prefect flow run {flow_run_id} could not be marked ({type(err).__name__}: {err})"]
    return [f"Prefect flow run {flow_run_id} {run.state.name} -> CRASHED"]


def _kill_mlflow_runs(run_id: str) -> list[str]:
    from mlflow.exceptions import MlflowException

    from flywheel.registry import client

    c = client()
    marked = []
    try:
        parent = c.get_run(run_id)
        children = c.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{run_id}'")
        for run in [parent, *children]:
            if run.info.status in ("RUNNING", "SCHEDULED"):
                c.set_terminated(run.info.run_id, status="KILLED")
                marked.append(f"MLflow run {run.info.run_id} {run.info.status} -> KILLED")
    except MlflowException as err:
        marked.append(f"MLflow run {run_id} could not be marked ({err.error_code})")
    return marked


def _holder(handle, timeout_s: float = 3.0) -> dict:
    """The holder's record, read again for a moment while it is empty: a holder writes it just after taking the
    lock, and rewrites it (truncate, write) when it records its MLflow run."""
    deadline = time.monotonic() + timeout_s
    while not (found := _read(handle)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def _read(handle) -> dict:
    handle.seek(0)
    text = handle.read().strip()
    try:
        return json.loads(text) if text else {}
    except ValueError:  # cut mid-write: the holder is unknown, not absent
        return {"pid": "?", "host": "?", "started": "?"}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
