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
RUN_IDS = typer.Argument(None, help="MLflow run ids of retrain runs (default: the last N).")
HTML = typer.Option(None, "--html", help="Also write an HTML report with plots to this file.")


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
def promote(pipeline: str = typer.Argument(..., help="Pipeline name (the registered model's name)."),
            version: str | None = typer.Argument(None, help="Model version to make champion."),
            force: bool = typer.Option(False, "--force", help="Skip the gate; the move is tagged as forced."),
            rollback: bool = typer.Option(False, "--rollback", help="Return champion to the previous one."),
            root: Path = ROOT) -> None:
    """Move `champion` to a version through the gate against the current champion, or roll it back."""
    from flywheel import promotion
    from flywheel.config import ConfigError, load_pipeline

    root = _checked_root(root)
    if rollback == (version is not None):
        _fail("give either a VERSION or --rollback")
    try:
        if rollback:
            outcome = promotion.rollback(pipeline)
        else:
            gate = load_pipeline(pipeline, root / "pipelines.yaml").gate
            outcome = promotion.promote(pipeline, version, gate, force=force)
    except (ConfigError, promotion.PromotionError) as err:
        _fail(str(err))
    for reason in outcome.reasons:
        typer.echo(f"  - {reason}")
    if outcome.promoted:
        typer.echo(f"{pipeline}: champion is version {outcome.champion} ({outcome.how}; was {outcome.previous})")
    else:
        typer.secho(f"{pipeline}: version {outcome.version} not promoted; champion stays {outcome.champion}",
                    fg=typer.colors.RED, err=True)
        raise typer.Exit(1)


@app.command()
def compare(pipeline: str = typer.Argument(..., help="Pipeline name (the MLflow experiment)."),
            runs: list[str] | None = RUN_IDS,
            last: int = typer.Option(5, "--last", min=1, help="How many of the newest retrain runs."),
            html: Path | None = HTML,
            root: Path = ROOT) -> None:
    """Compare retrain runs: data versions, key params, SFT/RL metrics, eval scores with intervals, gate."""
    from rich.console import Console
    from rich.table import Table

    from flywheel import comparison

    _checked_root(root)
    rows = comparison.retrain_runs(pipeline, last=last, run_ids=runs or None)
    if not rows:
        _fail(f"no retrain runs of '{pipeline}' in MLflow ({os.environ['MLFLOW_TRACKING_URI']}); "
              f"run `flywheel run {pipeline}` first")
    frame = comparison.summary_table(rows)
    table = Table(title=f"{pipeline}: the last {len(rows)} retrain runs")
    for column in frame.columns:
        table.add_column(column, overflow="fold")
    for line in frame.itertuples(index=False):
        table.add_row(*[str(v) for v in line])
    Console(width=max(160, Console().width)).print(table)
    if html is not None:
        typer.echo(f"wrote {comparison.write_html(rows, html, pipeline)}")


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
