"""The `flywheel` command (Typer), above everything: free to call flows and stages.

app.py holds the Typer apps and shared options; errors.py how a failed command reports; preflight.py the checks
before run, check and eval; render.py what the commands print (conversations.py: the episodes `eval --show`
prints); pipeline.py, inspection.py, servers.py and ui.py the commands themselves. `flywheel --help` lists them
from their docstrings.
"""

from __future__ import annotations

import typer

# isort: off
# the order `flywheel --help` lists the commands' panels in
from flywheel.cli import pipeline, inspection, servers, ui
# isort: on
from flywheel.cli.app import app
from flywheel.cli.errors import invocation

__all__ = ["app", "inspection", "pipeline", "reported_commands", "servers", "ui"]


def reported_commands() -> list[str]:
    """The commands whose errors print as one short block (those wrapped by errors.reported), as typed."""
    groups = [("", app)] + [(f"{group.name} ", group.typer_instance) for group in app.registered_groups]
    return [prefix + (command.name or command.callback.__name__.replace("_", "-"))
            for prefix, typer_app in groups for command in typer_app.registered_commands
            if getattr(command.callback, "reported", False)]


@app.callback(help=app.info.help)
def _options(ctx: typer.Context, debug: bool = typer.Option(
        False, "--debug", envvar="FLYWHEEL_DEBUG",
        help="Print tracebacks on the terminal (Prefect's and the command's) as they happen. Without it, a command "
        f"that fails ({', '.join(reported_commands())}) prints `error: STAGE: MESSAGE` (the message names the "
        "file, key, task or prompt and the fix) and `full traceback: PATH`, the log under .flywheel/logs/ that "
        "holds every traceback, and exits 1.")) -> None:
    invocation.update(debug=debug, command=ctx.invoked_subcommand or "")
