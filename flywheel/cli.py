"""The `flywheel` command: run a pipeline, run one stage without orchestration, check the config."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Turn an agent's traces into a better, cheaper model: distil, reinforce, gate, promote.")

ROOT = typer.Option(Path("."), "--root", help="Project root holding pipelines.yaml and dvc.yaml.")


def _fail(message: str) -> None:
    typer.secho(message, fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _checked_root(root: Path) -> Path:
    from flywheel.config import ConfigError, load_pipelines
    from flywheel.settings import configure

    root = root.resolve()
    try:
        load_pipelines(root / "pipelines.yaml")
    except ConfigError as err:
        _fail(str(err))
    configure(root)
    return root


@app.command()
def run(pipeline: str = typer.Argument(..., help="Pipeline name in pipelines.yaml."), root: Path = ROOT,
        refresh: bool = typer.Option(False, "--refresh", help="Rerun every stage, ignoring the cache."),
        push: bool = typer.Option(True, "--push/--no-push", help="Push datasets to the DVC remote.")) -> None:
    """Run the retrain flow: collect, synthesize, sft, rl, evaluate, register."""
    from flywheel.config import ConfigError, load_pipeline

    root = _checked_root(root)
    try:
        load_pipeline(pipeline, root / "pipelines.yaml")
    except ConfigError as err:
        _fail(str(err))
    from flows.retrain import retrain

    started = time.monotonic()
    summary = retrain(pipeline=pipeline, root=str(root), refresh=refresh, push=push)
    _print_summary(summary, root, time.monotonic() - started)


@app.command()
def stage(name: str = typer.Argument(..., help="collect, synthesize, sft, rl, evaluate or register."),
          pipeline: str = typer.Option(..., "--pipeline", "-p"), root: Path = ROOT) -> None:
    """Run one stage directly, without Prefect (what dvc.yaml calls)."""
    from flows.retrain import STAGE_TASKS

    root = _checked_root(root)
    if name not in STAGE_TASKS:
        _fail(f"unknown stage '{name}' (stages: {', '.join(STAGE_TASKS)})")
    result = STAGE_TASKS[name].fn(pipeline=pipeline, root=str(root))
    typer.echo(f"{name}: done (MLflow run {result['run_id']})")


@app.command()
def check(root: Path = ROOT) -> None:
    """Validate pipelines.yaml: every bad key or value is reported with its place in the file."""
    from flywheel.config import ConfigError, load_pipelines

    try:
        pipelines = load_pipelines(root / "pipelines.yaml")
    except ConfigError as err:
        _fail(str(err))
    typer.echo(f"{root / 'pipelines.yaml'}: ok ({', '.join(sorted(pipelines))})")


def _print_summary(summary: dict, root: Path, seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"pipeline '{summary['pipeline']}': held-out success (greedy)")
    table.add_column("model")
    table.add_column("held-out success", justify="right")
    for label in ("base", "sft", "rl", "champion"):
        if f"score_{label}" in summary["scores"]:
            name = {"rl": "rl (candidate)", "champion": "champion before this run"}.get(label, label)
            table.add_row(name, f"{summary['scores'][f'score_{label}']:.3f}")
    console.print(table)
    verdict = "[green]passed[/]" if summary["gate_passed"] else "[red]not promoted[/]"
    console.print(f"gate: {verdict}")
    for reason in summary["gate_reasons"]:
        console.print(f"  - {reason}")
    console.print(f"registered: {summary['pipeline']} version {summary['version']} "
                  f"(aliases: {', '.join(summary['aliases']) or 'none'}); champion is version {summary['champion']}")
    console.print(f"stages run: {', '.join(summary['ran']) or 'none'}; cached: {', '.join(summary['cached']) or 'none'}"
                  f"; {seconds:.0f}s")
    state = root / ".flywheel"
    console.print("\nlook at it:")
    console.print(f"  MLflow UI:  {sys.executable.rsplit('/', 1)[0]}/mlflow ui --backend-store-uri "
                  f"{os.environ['MLFLOW_TRACKING_URI']} --port 5000")
    console.print(f"  Prefect UI: PREFECT_HOME={state / 'prefect'} {sys.executable.rsplit('/', 1)[0]}/prefect "
                  "server start --port 4200")


if __name__ == "__main__":
    app()
