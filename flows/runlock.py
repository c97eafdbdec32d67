"""One run of a pipeline at a time on a machine, and runs whose process died marked as what they are.

Each pipeline has a lock file, `.flywheel/locks/<pipeline>.lock`, held with `fcntl.flock` while the run lasts: the
kernel releases it when the holder's process ends, however it ends. The file records the holder (pid, host, start
time, its Prefect flow run and MLflow run, its Prefect temporary server's pid, the mark its processes carry). A
second run of the pipeline (a schedule firing during a manual run, two `flywheel run` at once) fails at once
naming the first, or waits for it (`wait`), recording itself meanwhile in `<pipeline>.<pid>.waiting` (held the
same way) so that a waiter killed with a flow run of its own is found too.

`flywheel run` takes the lock before anything slow and the retrain flow then runs under it (the lock is
re-entrant within a thread); a deployment's flow run, with no command around it, takes it in the flow.

A run that ends by an error or a signal reports its own end (Prefect and MLflow, as the table in docs/reruns.md
says); what it could not report stays in its record. A holder that ended without clearing its
record (SIGKILL, out of memory, a state that did not reach the server) is found by the next `flywheel run` of any
pipeline of the project or by `flywheel status`: what it left running is stopped (flows/processes.py), its record
moves to `<pipeline>.<pid>.dead`, and its Prefect flow run and MLflow runs are marked where they still say
running; the record is deleted only once both answered, so a check while Prefect or MLflow is unreachable leaves
it for the next one.

The lock serialises runs sharing one project folder (the embedded default, or one worker's checkout); workers on
separate machines do not share it.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from flows.processes import RUN_MARK, end_left
from flywheel.errors import UserFacingError
from flywheel.settings import state_dir

_WAIT_POLL_S = 1.0
# how a run ended -> (its Prefect flow run's state, its MLflow runs' status); docs/reruns.md
STOPPED, FAILED = "stopped", "failed"
END_STATES = {STOPPED: ("CRASHED", "KILLED"), FAILED: ("FAILED", "FAILED")}
_HELD = threading.local()  # .locks: the locks this thread holds, by lock file (a flow runs in its caller's thread)


class PipelineBusy(UserFacingError, RuntimeError):
    """Another run of the pipeline holds its lock."""


@dataclass(frozen=True)
class Found:
    """A record `reap` found: a run holding its lock, one waiting for it, or one whose process died."""

    pipeline: str
    holder: dict
    state: str  # "running", "waiting" or "dead"
    marked: list[str] = field(default_factory=list)  # dead: what was stopped and set ("... Running -> CRASHED")
    settled: bool = True  # dead: Prefect and MLflow both answered, the record is gone

    @property
    def running(self) -> bool:
        return self.state == "running"

    def line(self) -> str:
        who = describe(self.holder)
        if self.state == "running":
            return f"{self.pipeline}: running now ({who})"
        if self.state == "waiting":
            return f"{self.pipeline}: waiting for the running one to finish ({who})"
        kept = "" if self.settled else "; its record is kept, the next check tries again"
        if self.holder.get("waiting"):
            done = "; ".join(self.marked) if self.marked else "it had started nothing"
            return f"{self.pipeline}: a run waiting to start ({who}) died: {done}{kept}"
        done = "; ".join(self.marked) if self.marked else "its runs had already ended"
        return f"{self.pipeline}: the run {who} died without finishing: {done}{kept}"


@dataclass(frozen=True)
class Marking:
    """What marking a run's end did: lines for what changed, the states its runs now have, whether both answered."""

    lines: list[str]
    states: list[str]  # "Prefect flow run ... CRASHED", "MLflow run ... KILLED"
    complete: bool


def lock_path(root: Path, pipeline: str) -> Path:
    return state_dir(root) / "locks" / f"{pipeline}.lock"


def describe(holder: dict) -> str:
    """The holder in a few words: pid, host, start, its Prefect and MLflow runs."""
    if not holder:
        return "its holder has not recorded itself yet"
    parts = [f"pid {holder.get('pid')} on {holder.get('host')}", f"started {holder.get('started', '?')}"]
    parts.append(f"Prefect flow run {holder['flow_run_id']}" if holder.get("flow_run_id")
                 else "no Prefect flow run yet")
    if holder.get("mlflow_run_id"):
        parts.append(f"MLflow run {holder['mlflow_run_id']}")
    return ", ".join(parts)


class Holding:
    """The held lock: `record` adds what the run learns later (its flow run, MLflow run, server) to the file."""

    def __init__(self, handle, holder: dict):
        self._handle = handle
        self.holder = holder
        self.settled: Marking | None = None
        self._write()

    def record(self, **fields) -> None:
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

    def settle(self, err: BaseException) -> Marking:
        """After the run ended by `err` (outside its flow, whose engine has reported by then): set what still says
        running as an error (FAILED) or a signal (CRASHED / KILLED) ends; clear the record once Prefect and MLflow
        both answered, keep it for the next check otherwise."""
        if self.settled is None:
            self.record(ended=FAILED if isinstance(err, Exception) else STOPPED)
            self.settled = mark_ended(self.holder, f"the run ended ({type(err).__name__}: {err})")
            if self.settled.complete:
                self.clear()
        return self.settled


@contextmanager
def pipeline_lock(root: Path, pipeline: str, flow_run_id: str = "", wait: bool = False) -> Iterator[Holding]:
    """Hold the pipeline's run lock for the body; raise PipelineBusy naming the holder (or wait, `wait`).

    Within a thread that holds it already (`flywheel run` around the flow), the body runs under that hold. The
    record is cleared when the body returns, or raises an error (the flow reports its FAILED state itself); a body
    ended by a signal leaves it, marked stopped, for `settle` or the next check."""
    path = lock_path(root, pipeline)
    held = _HELD.__dict__.setdefault("locks", {})
    if path in held:
        holding = held[path]
        if flow_run_id:
            holding.record(flow_run_id=flow_run_id)
        yield holding
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    me = {"pipeline": pipeline, "pid": os.getpid(), "host": socket.gethostname(), "started": _now(),
          "flow_run_id": flow_run_id, "mark": uuid.uuid4().hex}
    handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 (held open for the body: the lock is the handle)
    try:
        _take(handle, path, pipeline, wait, me)
        left = _read(handle)
        holding = Holding(handle, me)  # recorded before anything else: a refused run names this one
        if left:  # its holder died holding it: stop what it left running, keep its record for marking
            _set_aside(path.parent, left)
            end_left(left)
        held[path] = holding
        mark_before = os.environ.get(RUN_MARK)
        os.environ[RUN_MARK] = me["mark"]  # every process the run starts carries it
        try:
            yield holding
        except Exception:
            if holding.settled is None:
                holding.clear()
            raise
        except BaseException:
            if holding.settled is None:
                holding.record(ended=STOPPED)
            raise
        else:
            holding.clear()
        finally:
            del held[path]
            if mark_before is None:
                os.environ.pop(RUN_MARK, None)
            else:
                os.environ[RUN_MARK] = mark_before
    finally:
        handle.close()  # releases the lock


def _take(handle, path: Path, pipeline: str, wait: bool, me: dict) -> None:
    """Take the lock on handle, or raise PipelineBusy, or (wait) wait for it with a waiting record."""
    waiting = None
    try:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                holder = _holder(handle)
                if not wait:
                    raise PipelineBusy(
                        f"pipeline '{pipeline}' is already running ({describe(holder)}); let it finish, or run "
                        f"with --wait to start when it ends (lock: {path})") from None
                if waiting is None:
                    print(f"waiting for the running '{pipeline}' run to finish ({describe(holder)})", flush=True)
                    waiting = open(path.parent / f"{pipeline}.{os.getpid()}.waiting", "w", encoding="utf-8")  # noqa: SIM115
                    fcntl.flock(waiting, fcntl.LOCK_EX)  # blocks only while a check reads it
                    waiting.write(json.dumps(me | {"waiting": True}))
                    waiting.flush()
                time.sleep(_WAIT_POLL_S)
    finally:
        if waiting is not None:  # emptied first: a check that opened it before it went reads nothing
            waiting.truncate(0)
            waiting.flush()
            Path(waiting.name).unlink(missing_ok=True)
            waiting.close()


def reap(root: Path, mark: bool = True) -> list[Found]:
    """Every run record under root: the live holders and waiters, and the dead ones, whose leftover processes are
    stopped and (`mark`) whose runs are marked as they ended (a record is deleted once both systems answered)."""
    found = []
    folder = state_dir(root) / "locks"
    if not folder.is_dir():
        return found
    for path in sorted(folder.glob("*.lock")):
        with open(path, "a+", encoding="utf-8") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                found.append(Found(path.stem, _holder(handle), "running"))
                continue
            left = _read(handle)
            if left:  # moved aside at once: a run starting now takes the lock without waiting for the marking
                _set_aside(folder, left)
                handle.seek(0)
                handle.truncate()
    for path in sorted(folder.glob("*.waiting")) + sorted(folder.glob("*.dead")):
        try:
            handle = open(path, "r+", encoding="utf-8")  # noqa: SIM115
        except FileNotFoundError:  # a waiter took its lock, or another check finished it
            continue
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a live waiter, or a record another check is marking now
                if path.suffix == ".waiting":
                    found.append(Found(path.name.split(".")[0], _read(handle), "waiting"))
                continue
            record = _read(handle)
            if not record:
                continue
            lines = end_left(record)
            settled = False
            if mark:
                marking = mark_ended(record)
                lines, settled = lines + marking.lines, marking.complete
            if settled:
                path.unlink(missing_ok=True)
            found.append(Found(record.get("pipeline", path.name.split(".")[0]), record, "dead", lines, settled))
    return found


def _set_aside(folder: Path, record: dict) -> None:
    """A dead holder's record, kept as `<pipeline>.<pid>.dead` until its runs are marked."""
    name = f"{record.get('pipeline', 'unknown')}.{record.get('pid', '?')}-{uuid.uuid4().hex[:6]}.dead"
    partial = folder / f".{name}.partial"
    partial.write_text(json.dumps(record), encoding="utf-8")
    partial.replace(folder / name)


def mark_ended(holder: dict, why: str = "") -> Marking:
    """Set the holder's Prefect flow run and MLflow runs (the pipeline's and its stages') to the states of how it
    ended (its record's `ended`: stopped unless it says failed) where they still say running."""
    ended = holder.get("ended", STOPPED)
    prefect_state, mlflow_status = END_STATES[ended]
    why = why or (f"the process ({describe(holder)}) ended without reporting how (killed?); found by flywheel at "
                  f"{_now()}")
    lines, states, complete = [], [], True
    for marker, run_id, state in ((_mark_flow_run, holder.get("flow_run_id"), prefect_state),
                                  (_mark_mlflow_runs, holder.get("mlflow_run_id"), mlflow_status)):
        if run_id:
            changed, now, answered = marker(run_id, state, why)
            lines += changed
            states.append(now)
            complete = complete and answered
    return Marking(lines, states, complete)


def _mark_flow_run(flow_run_id: str, state: str, why: str) -> tuple[list[str], str, bool]:
    from prefect import get_client
    from prefect.states import Crashed, Failed

    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(flow_run_id)
            if run.state is not None and run.state.is_final():
                return [], f"Prefect flow run {flow_run_id} {run.state.type.value}", True
            client.set_flow_run_state(flow_run_id, {"CRASHED": Crashed, "FAILED": Failed}[state](message=why),
                                      force=True)
    except Exception as err:  # no server now: the record stays and the next check tries again
        line = f"Prefect flow run {flow_run_id} could not be marked ({type(err).__name__}: {err})"
        return [line], f"Prefect flow run {flow_run_id} not marked", False
    was = run.state.name if run.state is not None else "no state"
    return [f"Prefect flow run {flow_run_id} {was} -> {state}"], f"Prefect flow run {flow_run_id} {state}", True


def _mark_mlflow_runs(run_id: str, status: str, why: str) -> tuple[list[str], str, bool]:
    from flywheel.registry import client

    lines = []
    try:
        c = client()
        parent = c.get_run(run_id)
        children = c.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{run_id}'")
        for run in [parent, *children]:
            if run.info.status in ("RUNNING", "SCHEDULED"):
                c.set_terminated(run.info.run_id, status=status)
                lines.append(f"MLflow run {run.info.run_id} {run.info.status} -> {status}")
        now = c.get_run(run_id).info.status
    except Exception as err:  # no tracking server now: the record stays and the next check tries again
        return lines + [f"MLflow run {run_id} could not be marked ({type(err).__name__}: {err})"], \
            f"MLflow run {run_id} not marked", False
    return lines, f"MLflow run {run_id} {now}", True


def _holder(handle, timeout_s: float = 3.0) -> dict:
    """The holder's record, read again for a moment while it is empty: a holder writes it just after taking the
    lock, and rewrites it (truncate, write) when it records its flow run or MLflow run."""
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
