"""The commands that train, register and move models: run, stage, rerun, promote, loop."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from flywheel.cli.app import ROOT, TRACES, app, fail
from flywheel.cli.errors import reported
from flywheel.cli.preflight import checked_root, estimate_pipeline, hold_to_budget, pipeline_config, preflight
from flywheel.cli.render import print_rerun, print_summary

RESTORE = typer.Option(["collect"], "--restore", help="A stage checked out from DVC instead of run (repeat: "
                       "collect, synthesize): their inputs lie outside the project and may have changed.")

PANEL = "Train, register, promote"  # where `flywheel --help` lists these commands


@app.command(rich_help_panel=PANEL)
@reported
def run(pipeline: str = typer.Argument(..., help="Pipeline name in pipelines.yaml."), root: Path = ROOT,
        refresh: bool = typer.Option(False, "--refresh", help="Rerun every stage, ignoring the cache."),
        push: bool = typer.Option(True, "--push/--no-push", help="Push datasets to the DVC remote."),
        wait: bool = typer.Option(False, "--wait", help="If the pipeline is already running here, start when it "
                                  "ends (default: stop, naming the running one)."),
        yes: bool = typer.Option(False, "--yes", help="Run even when the time estimate is over the pipeline's "
                                 "budget_minutes, without asking.")) -> None:
    """Run the retrain flow: collect, synthesize, sft, rl, evaluate, register."""
    from flows.processes import Stopped, running_children, start_prefect_server, stop_on_signals, stop_started
    from flows.runlock import pipeline_lock, reap

    root = checked_root(root)
    cfg = pipeline_config(root, pipeline)
    holding = server = settled = None
    spared = running_children()  # a caller's own processes (a notebook's, a test's Prefect server) are not ours
    try:
        # the lock first: a second run stops here within seconds, before any check or server starts
        with stop_on_signals(), pipeline_lock(root, pipeline, wait=wait) as holding:
            try:
                reap(root, mark=False)  # what dead runs left running stops now; the flow marks their runs
                env = preflight(root, {pipeline: cfg})[pipeline]
                est = estimate_pipeline(root, pipeline, cfg, env)  # printed; recorded beside the measured times
                hold_to_budget(root, pipeline, cfg, est, yes)
                server = start_prefect_server(holding.record)
                from flows.retrain import retrain

                started = time.monotonic()
                summary = retrain(pipeline=pipeline, root=str(root), refresh=refresh, push=push,
                                  estimate=est.params() if est else None)
            except BaseException as err:
                settled = holding.settle(err)  # what the flow could not report, while the server is up
                raise
            finally:
                stop_started(server, spared=spared)  # every process it started, Prefect's server last
    except Stopped as stop:
        if holding is None:
            said = "nothing was started"
        elif settled is None:
            said = "its runs are not marked yet (`flywheel status` marks them)"
        else:
            said = ", ".join(settled.states) or "no flow run had started"
            said += "" if settled.complete else " (`flywheel status` marks the rest)"
        typer.secho(f"flywheel run {pipeline}: stopped by {stop.name}: {said}", fg=typer.colors.RED, err=True)
        raise typer.Exit(stop.exit_code) from None
    print_summary(summary, root, time.monotonic() - started)


@app.command("dvc-yaml", rich_help_panel=PANEL)
@reported
def dvc_yaml(root: Path = ROOT, check_only: bool = typer.Option(
        False, "--check", help="Write nothing; exit 2 naming what is out of date (as `flywheel check` does).")) -> None:
    """Write dvc.yaml for pipelines.yaml (one DVC stage per stage and pipeline), and flywheel-code.yaml with it in
    a project outside the flywheel's own repository: again after adding a pipeline or changing its sources."""
    from tasks.spec import stale, write_dvc_files

    root = checked_root(root)
    if check_only:
        why = stale(root)
        if why:
            fail(why)
        typer.echo(f"{root / 'dvc.yaml'}: up to date")
        return
    for path in write_dvc_files(root):
        typer.echo(f"wrote {path}")


@app.command(rich_help_panel=PANEL)
@reported
def stage(name: str = typer.Argument(..., help="collect, synthesize, sft, rl, evaluate or register."),
          pipeline: str = typer.Option(..., "--pipeline", "-p"), root: Path = ROOT) -> None:
    """Run one stage directly, without Prefect (what dvc.yaml calls)."""
    from flywheel.stages import ORDER

    root = checked_root(root)
    if name not in ORDER:
        fail(f"unknown stage '{name}' (stages: {', '.join(ORDER)})")
    from tasks.kernel import stage_by_name

    result = stage_by_name(name).fn(pipeline=pipeline, root=str(root))
    typer.echo(f"{name}: done (MLflow run {result.run_id})")


@app.command(rich_help_panel=PANEL)
@reported
def promote(pipeline: str = typer.Argument(..., help="Pipeline name (the registered model's name)."),
            version: str | None = typer.Argument(None, help="Model version to make champion."),
            force: bool = typer.Option(False, "--force", help="Skip the gate; the move is tagged as forced."),
            rollback: bool = typer.Option(False, "--rollback", help="Return champion to the previous one."),
            root: Path = ROOT) -> None:
    """Move `champion` to a version through the gate against the current champion, or roll it back."""
    from flywheel import promotion

    root = checked_root(root)
    if rollback == (version is not None):
        fail("give either a VERSION or --rollback")
    try:
        if rollback:
            outcome = promotion.rollback(pipeline)
        else:
            cfg = pipeline_config(root, pipeline)
            # stored evaluations on other held-out tasks: both versions are scored again on the current ones
            outcome = promotion.promote(pipeline, version, cfg.gate, force=force,
                                        reevaluate=lambda v, c: promotion.evaluate_now(pipeline, v, c, root, cfg))
    except promotion.PromotionError as err:
        fail(str(err))
    for reason in outcome.reasons:
        typer.echo(f"  - {reason}")
    if outcome.promoted:
        typer.echo(f"{pipeline}: champion is version {outcome.champion} ({outcome.how}; was {outcome.previous})")
    else:
        typer.secho(f"{pipeline}: version {outcome.version} not promoted; champion stays {outcome.champion}",
                    fg=typer.colors.RED, err=True)
        raise typer.Exit(1)


@app.command(rich_help_panel=PANEL)
@reported
def rerun(run_id: str = typer.Argument(..., help="MLflow run id of a retrain run, or its first characters as "
                                        "`flywheel compare` lists them."),
          promote: bool = typer.Option(False, "--promote", help="Let the gate move champion, as a run would."),
          restore: list[str] = RESTORE,
          push: bool = typer.Option(True, "--push/--no-push", help="Push reproduced data to the DVC remote."),
          root: Path = ROOT) -> None:
    """Run a recorded retrain run again from its config and data versions; compare every output and score."""
    root = checked_root(root)  # before Prefect is imported: it reads its settings once
    from flows.rerun import rerun as rerun_flow
    from flywheel.reproduce import RerunError

    try:
        report = rerun_flow(run_id, root=str(root), promote=promote, push=push, restore=tuple(restore))
    except RerunError as err:
        fail(str(err))
    print_rerun(report, run_id, promote)
    if not report.reproduced:
        raise typer.Exit(1)


@app.command(rich_help_panel=PANEL)
@reported
def loop(pipeline: str = typer.Argument(..., help="Pipeline name in pipelines.yaml."),
         rounds: int = typer.Option(2, "--rounds", min=1, help="Retrain, serve, drive the agent: this many times."),
         episodes: int = typer.Option(100, "--episodes", min=1, help="Agent episodes against the server per round."),
         traces: Path | None = TRACES,
         push: bool = typer.Option(True, "--push/--no-push", help="Push datasets to the DVC remote."),
         root: Path = ROOT) -> None:
    """Close the flywheel: retrain, serve the champion, run the environment's agent on it, collect, retrain."""
    from flywheel.serving.loop import LoopError, check_sources, run_round
    from flywheel.serving.server import traces_folder

    root = checked_root(root)
    folder = traces or traces_folder(root, pipeline)
    try:
        check_sources(pipeline, pipeline_config(root, pipeline), root, folder)
    except LoopError as err:
        fail(str(err))
    from flows.retrain import retrain

    for number in range(1, rounds + 1):
        summary = retrain(pipeline=pipeline, root=str(root), push=push)
        line = run_round(pipeline, root, folder, summary, number, episodes)
        typer.echo(line.text())
