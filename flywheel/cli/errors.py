"""How a failed command reports: `error: STAGE: MESSAGE` and where the full traceback went, exit 1.

A user's error (a subclass of flywheel.errors.UserFacingError: its message names the file, key, task row or prompt
and the fix) is its message alone; anything else is a bug and says so. With --debug every traceback reaches the
terminal as it happens.
"""

from __future__ import annotations

import functools
import logging
import time
from contextlib import contextmanager
from pathlib import Path

import typer

from flywheel.errors import UserFacingError

invocation = {"debug": False, "command": ""}  # this invocation's app-level options and command (the app callback)
_RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")  # where Prefect reports a failed flow or task run


def reported(command):
    """A command whose errors print as one short block (`error: ...`, then where the traceback is) and exit 1;
    with --debug they propagate as they are, every traceback on the terminal."""

    @functools.wraps(command)
    def wrapper(**kwargs):
        if invocation["debug"]:
            return command(**kwargs)
        name = invocation["command"] or command.__name__
        log = _CommandLog(kwargs.get("root", Path(".")), name)
        try:
            with _run_failures_logged(log):
                return command(**kwargs)
        except (typer.Exit, typer.Abort, typer.TyperException):
            raise
        except Exception as err:
            log.handle(logging.makeLogRecord({"name": "flywheel", "levelno": logging.ERROR, "levelname": "ERROR",
                                              "msg": f"flywheel {name} failed",
                                              "exc_info": (type(err), err, err.__traceback__)}))
            for line in error_block(err, Path(log.baseFilename)):
                typer.secho(line, fg=typer.colors.RED, err=True)
            raise typer.Exit(1) from None
        finally:
            log.close()

    wrapper.reported = True  # the app's --debug help lists these commands
    return wrapper


def error_block(err: Exception, log: Path) -> list[str]:
    """What the terminal shows of an error: `error: STAGE: MESSAGE` (a bug says so), then where its traceback is."""
    stage = _stage_of(err)
    where = f"{stage}: " if stage else ""
    if isinstance(err, UserFacingError):
        return [f"error: {where}{err}", f"full traceback: {log}"]
    return [f"error: {where}{type(err).__name__}: {err}",
            "this is a bug, not bad input (in flywheel, or in code it calls such as an environment's): please "
            "report it with the log", f"full traceback: {log}"]


def _stage_of(err: BaseException) -> str | None:
    """The pipeline stage an error was raised in (the innermost frame of a stage function, tasks/<stage>.py)."""
    import traceback

    from flywheel.stages import ORDER

    stages = [frame.f_code.co_name for frame, _ in traceback.walk_tb(err.__traceback__)
              if frame.f_code.co_name in ORDER and frame.f_globals.get("__name__") == f"tasks.{frame.f_code.co_name}"]
    return stages[-1] if stages else None


class _CommandLog(logging.FileHandler):
    """A command's tracebacks: .flywheel/logs/<time>-<command>.log under the project root, made when first written."""

    def __init__(self, root: Path, command: str):
        from flywheel.settings import state_dir

        path = state_dir(root) / "logs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{command}.log"
        super().__init__(path, delay=True, encoding="utf-8")
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        super().emit(record)


class _RunFailuresToLog(logging.Filter):
    """On a terminal handler: a Prefect run's failure report (an error or a traceback) goes to the command's log
    instead, since the command says the error once; Prefect's API handler (its UI) still gets it."""

    def __init__(self, log: logging.Handler):
        super().__init__()
        self.log = log

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name not in _RUN_LOGGERS or (record.levelno < logging.ERROR and not record.exc_info):
            return True  # Prefect's progress lines stay
        self.log.handle(record)
        return False


@contextmanager
def _run_failures_logged(log: logging.Handler):
    """While a command runs, Prefect's reports of a failed run go to `log`, not to the terminal."""
    to_log = _RunFailuresToLog(log)
    terminal = logging.getLogger()

    def onto_terminal_handlers(record: logging.LogRecord) -> bool:
        # Prefect makes its terminal handler (on the root logger) when it is imported, inside the command, after
        # the project's settings are in place; its run loggers see a record before any handler does
        for handler in terminal.handlers:
            on_terminal = isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
            if on_terminal and to_log not in handler.filters:
                handler.addFilter(to_log)
        return True

    run_loggers = [logging.getLogger(name) for name in _RUN_LOGGERS]
    for logger in run_loggers:
        logger.addFilter(onto_terminal_handlers)
    try:
        yield
    finally:
        for logger in run_loggers:
            logger.removeFilter(onto_terminal_handlers)
        for handler in terminal.handlers:
            handler.removeFilter(to_log)
