"""The processes a run starts, and how none is left behind: Prefect's temporary server, the stages' children.

Without a Prefect server (`PREFECT_API_URL` unset) Prefect starts a temporary one as a child process of the command
(`SubprocessASGIServer`, stopped at the interpreter's exit). Python's default SIGTERM ends a process without that
exit, and a SIGKILL ends it without anything, so each killed run used to leave its server behind. Here:

- `stop_on_signals`: SIGTERM and SIGINT raise `Stopped` in the main thread, so the command unwinds (the stages'
  runs end, Prefect reports the flow run) and stops what it started (`stop_started`) before it exits.
- `start_prefect_server`: the temporary server, started by the command itself with its pid recorded with the run
  lock (flows/runlock.py) the moment it exists, and with SIGINT blocked in it: a Ctrl-C, which the terminal sends
  to the whole process group, leaves it up until the command has reported the run's end through it.
- `RUN_MARK`: every process a run starts with exec inherits this variable, set to the run's own mark, so after a
  SIGKILL the next command finds what the run left (`end_left`) by its mark and the recorded server pid, each
  checked before it is signalled (pids are reused).

Linux's /proc is read to find processes; elsewhere nothing is found and nothing is signalled.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from flywheel.errors import UserFacingError

RUN_MARK = "FLYWHEEL_RUN_MARK"
_PROC = Path("/proc")
_SERVER_APP = "prefect.server.api.server:create_app"  # what Prefect's temporary server runs (uvicorn --factory)
# children that end by themselves when this process does (their pipe to it closes) and ignore SIGTERM
_ENDS_ITSELF = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
TIMEOUT_VARIABLE = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGINT reached the command: it stops what it started, reports its runs and exits 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class PrefectServerTimeout(UserFacingError, RuntimeError):
    """Prefect's temporary server did not answer in time (a busy machine)."""


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGINT raise `Stopped` in the main thread while the body runs.

    Inside a flow, Prefect's own SIGTERM handler runs first (it reports the flow run CRASHED), then sends the
    signal again to this one."""

    def stop(signum: int, frame) -> None:
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def start_prefect_server(record: Callable[..., None]):
    """Start Prefect's temporary server for this process now, if no PREFECT_API_URL is set (else None): the
    instance Prefect's clients then use. `record(server_pid=, server_port=)` is called as soon as its process
    exists (again if Prefect moves it to another port); SIGINT is blocked in it. A start that times out is a
    PrefectServerTimeout saying what to set."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    from flywheel.settings import embedded_prefect_database, keep_prefect_template, seed_prefect_database

    if PREFECT_API_URL.value():
        return None
    database = embedded_prefect_database()
    migrates = seed_prefect_database(database)
    server = SubprocessASGIServer()  # one per process (per port): get_client finds this one running
    launch = server._run_uvicorn_command  # Prefect 3.9: how start() makes the process, and remakes it on a clash

    def launch_recorded():
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # inherited through exec
        try:
            process = launch()
            record(server_pid=process.pid, server_port=server.port)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return process

    server._run_uvicorn_command = launch_recorded
    try:
        server.start()
    except RuntimeError as err:
        server.stop()  # still starting, perhaps: it would answer after this process gave up on it
        if "Timed out while attempting to connect to ephemeral Prefect API server" not in str(err):
            raise
        seconds = PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
        raise PrefectServerTimeout(
            f"Prefect's temporary server did not answer within {seconds} s ({TIMEOUT_VARIABLE}={seconds}; a busy "
            f"machine starts it slowly): set {TIMEOUT_VARIABLE} higher (e.g. export {TIMEOUT_VARIABLE}=600), or "
            "run a Prefect server and point PREFECT_API_URL at it (`flywheel stack up`, then "
            "`eval \"$(flywheel stack env)\"`)") from None
    if migrates:
        keep_prefect_template(database)
    return server


def running_children() -> set[int]:
    """This process's descendants now: what a command run in a longer-lived process (a notebook, a test) finds
    already running, and so did not start and leaves alone (`stop_started(spared=...)`)."""
    return set(_descendants(os.getpid(), _tree()))


def stop_started(server=None, grace_s: float = 5.0, spared: set[int] = frozenset()) -> list[int]:
    """End every process this one started that still runs (their children, and any carrying this run's mark
    whose parent went first), but those in `spared` (running before the command began), then Prefect's temporary
    `server`: what was ended, by pid."""
    server_pid = server.server_process.pid if server is not None and server.server_process is not None else None
    tree = _tree()
    keep = {os.getpid()}
    for pid in [*spared, server_pid] if server_pid else spared:  # each with what it started itself
        keep |= {pid, *_descendants(pid, tree)}
    found = [pid for pid in _descendants(os.getpid(), tree) if pid not in keep]
    if os.environ.get(RUN_MARK):
        found += [pid for pid in marked(os.environ[RUN_MARK]) if pid not in keep and pid not in found]
    ended = end([pid for pid in found if not any(name in _cmdline(pid) for name in _ENDS_ITSELF)], grace_s)
    if server_pid is not None:
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        for worker in (APILogWorker, EventsWorker):  # what they hold goes to the server before it stops
            worker.drain_all(timeout=grace_s)
        server.stop()  # SIGTERM, SIGKILL after 5 s (Prefect's own stop; at exit it would do the same)
        ended.append(server_pid)
    return ended


def end_left(record: dict, grace_s: float = 5.0) -> list[str]:
    """End what a dead run left running: its recorded Prefect server (if that pid still runs that server) and
    every process carrying its mark, with their children. What was ended, as lines."""
    tree = _tree()
    server = record.get("server_pid")
    server = server if isinstance(server, int) and _is_prefect_server(server, record.get("server_port")) else None
    others = [pid for pid in marked(record["mark"]) if pid != server] if record.get("mark") else []
    others = list(dict.fromkeys(others + [child for pid in [*others, server] if pid
                                          for child in _descendants(pid, tree) if child != server]))
    lines = []
    if server is not None and server in end([server], grace_s):
        lines.append(f"stopped its Prefect server (pid {server})")
    if others := end(others, grace_s):
        lines.append(f"stopped {len(others)} process{'es' if len(others) > 1 else ''} it started "
                     f"(pid {', '.join(map(str, others))})")
    return lines


def marked(mark: str) -> list[int]:
    """Processes started (with exec) by the run whose mark this is: RUN_MARK=mark in their environment."""
    wanted = f"{RUN_MARK}={mark}".encode()
    found = []
    for pid in _pids():
        try:
            if wanted in (_PROC / str(pid) / "environ").read_bytes().split(b"\0"):
                found.append(pid)
        except OSError:  # gone, or another user's
            continue
    return found


def end(pids: list[int], grace_s: float = 5.0) -> list[int]:
    """SIGTERM each pid, SIGKILL those still running after `grace_s`: the pids that were running."""
    running = [pid for pid in pids if alive(pid)]
    for pid in running:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(alive(pid) for pid in running) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in running:
        if alive(pid):
            _signal(pid, signal.SIGKILL)
    return running


def alive(pid: int) -> bool:
    """Whether pid runs (a zombie, ended but not yet collected by its parent, does not)."""
    if not _PROC.is_dir():
        return _signal(pid, 0)
    try:
        return _stat(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name: state, parent pid, ..."""
    return (_PROC / str(pid) / "stat").read_text().rsplit(") ", 1)[1].split()


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def _is_prefect_server(pid: int, port) -> bool:
    """pid runs Prefect's temporary server on `port` (not another process that got the pid since)."""
    args = _cmdline(pid).split("\0")
    return _SERVER_APP in args and (port is None or ["--port", str(port)] in [args[i:i + 2] for i in
                                                                            range(len(args) - 1)])


def _cmdline(pid: int) -> str:
    try:
        return (_PROC / str(pid) / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _pids() -> list[int]:
    return [int(p.name) for p in _PROC.iterdir() if p.name.isdigit()] if _PROC.is_dir() else []


def _tree() -> dict[int, int]:
    """Every process's parent, by pid."""
    parents = {}
    for pid in _pids():
        try:
            parents[pid] = int(_stat(pid)[1])
        except (OSError, IndexError, ValueError):
            continue
    return parents


def _descendants(pid: int | None, tree: dict[int, int]) -> list[int]:
    children: dict[int, list[int]] = {}
    for child, parent in tree.items():
        children.setdefault(parent, []).append(child)
    found, todo = [], list(children.get(pid, [])) if pid else []
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, []))
    return found
