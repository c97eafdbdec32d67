"""The Typer applications and the options several commands share; the commands register themselves on `app`."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Turn an agent's traces into a better, cheaper model: distil, reinforce, gate, promote.")
stack_app = typer.Typer(no_args_is_help=True, help="The servers a company runs, as processes on 127.0.0.1 (no "
                        "Docker): PostgreSQL, S3 (moto), Prefect and MLflow servers, two process workers.")
app.add_typer(stack_app, name="stack", rich_help_panel="Serve and schedule")

ROOT = typer.Option(Path("."), "--root", help="Project root holding pipelines.yaml and dvc.yaml.")
TRACES = typer.Option(None, "--traces", help="Folder for the served traffic (default: traces/served/<pipeline>/ "
                      "under --root); the pipeline's collect.sources read it.")


def fail(message: str) -> None:
    """Print a user's mistake in red, `error: ` first as every command's errors are, and exit 2 (bad arguments or
    config, found before any work)."""
    typer.secho(message if message.startswith("error:") else f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)
