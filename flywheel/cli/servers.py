"""The commands that start servers or put work on them: serve, deploy, serve-model, and the stack."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from flywheel.cli.app import ROOT, TRACES, app, fail, stack_app
from flywheel.cli.errors import reported
from flywheel.cli.preflight import checked_root
from flywheel.cli.render import print_reconciled
from flywheel.serving.batching import MAX_BATCH, WINDOW_S

RESULTS = typer.Option(None, "--results", envvar="FLYWHEEL_RESULTS_URL",
                       help="Keep Prefect results (the stage caches) here, e.g. s3://bucket/prefect-results.")
STAGE_VARIABLES = typer.Option(
    None, "--stage-variables",
    help="Job variables per stage, for --job-per-stage (default: <root>/infra/k8s/stages.json).")

PANEL = "Serve and schedule"  # where `flywheel --help` lists these commands


def _planned(root: Path, stage_jobs: dict | None = None) -> list:
    from flows.deployments import plan
    from flywheel.config import ConfigError, load_pipelines

    try:  # every pipeline's schedule and trigger: each must load
        pipelines = load_pipelines(root / "pipelines.yaml")
    except ConfigError as err:
        fail(str(err))
    wanted = plan(pipelines, root, stage_jobs=stage_jobs)
    if not wanted:
        fail(f"{root / 'pipelines.yaml'}: no pipeline has a `schedule` or a `trigger`, so there is nothing to "
             "deploy; add e.g. `schedule: {cron: \"0 3 * * 1\", timezone: UTC}` to a pipeline")
    return wanted


@app.command(rich_help_panel=PANEL)
def serve(root: Path = ROOT, results: str | None = RESULTS,
          port: int = typer.Option(4200, "--port", help="Port of the local Prefect server, if one is started."),
          ) -> None:
    """Serve every pipeline's schedule and trigger from this one process (retrain/P, watch-traces/P)."""
    from contextlib import ExitStack

    from flows import deployments

    root = checked_root(root)
    wanted = _planned(root)
    os.chdir(root)  # the served flows' entrypoints are paths under the project root
    with ExitStack() as stack:
        if not os.environ.get("PREFECT_API_URL"):
            # Prefect's ephemeral server runs no scheduler: schedules need a real one, so start it here
            home = Path(os.environ["PREFECT_HOME"])
            try:
                url = stack.enter_context(deployments.local_server(home, port=port))
            except RuntimeError as err:
                fail(f"{err}\n(no PREFECT_API_URL is set, so `flywheel serve` starts its own Prefect server on "
                     f"127.0.0.1:{port}; pass --port, or point PREFECT_API_URL at a running server)")
            os.environ["PREFECT_API_URL"] = url
            typer.echo(f"no PREFECT_API_URL: started a local Prefect server at {url.removesuffix('/api')} "
                       f"(state in {home}); it stops with this process")
        from prefect import serve as prefect_serve

        if results:
            typer.echo(f"Prefect results in {results} ({deployments.use_result_storage(results)})")
        served = deployments.runner_deployments(wanted)
        for deployment in served:
            deployment.apply()
        report = deployments.reconcile(wanted, pool=None, root=root)
        print_reconciled(report, "served from this process (Ctrl-C stops)")
        prefect_serve(*served, print_starting_message=False)


@app.command(rich_help_panel=PANEL)
def deploy(pool: str = typer.Option(..., "--pool", help="Work pool on the Prefect server (PREFECT_API_URL)."),
           root: Path = ROOT, results: str | None = RESULTS,
           job_variables: str | None = typer.Option(None, "--job-variables",
                                                    help='JSON for the pool\'s job template, e.g. \'{"gpus": 1}\'.'),
           job_per_stage: bool = typer.Option(
               False, "--job-per-stage", help="Run each stage as its own job (flow run of stage/<pipeline>) with "
               "its job variables from --stage-variables: a GPU only for the stages that need one. The jobs "
               "share the project folder: see infra/README.md."),
           stage_variables: Path | None = STAGE_VARIABLES) -> None:
    """Create or update the deployments on a work pool; schedules end up exactly as pipelines.yaml says."""
    import json

    from flows import deployments
    from flywheel.settings import s3_summary

    root = checked_root(root)
    if not os.environ.get("PREFECT_API_URL"):
        fail("flywheel deploy needs a Prefect server: set PREFECT_API_URL (e.g. http://prefect:4200/api, see "
             "infra/README.md); on one machine without a server, `flywheel serve` runs the schedules instead")
    try:
        variables = json.loads(job_variables) if job_variables else None
    except json.JSONDecodeError as err:
        fail(f"--job-variables is not JSON: {err}")
    stage_jobs = None
    if job_per_stage:
        try:
            stage_jobs = deployments.stage_job_variables(stage_variables or root / "infra/k8s/stages.json")
        except deployments.DeployError as err:
            fail(str(err))
        if not results:
            typer.echo("note: the retrain flow reads each stage job's result from Prefect's result storage; with "
                       "jobs on more than one machine, share it with --results s3://... (see infra/README.md)")
    wanted = _planned(root, stage_jobs)
    os.chdir(root)  # the flows are loaded from the project's files, whose imports resolve from its root
    if results:
        typer.echo(f"Prefect results in {results} ({deployments.use_result_storage(results)}); S3 settings: "
                   f"{s3_summary() or 'none set (boto3 defaults)'}")
    try:
        report = deployments.deploy(root, pool, wanted, job_variables=variables)
    except deployments.DeployError as err:
        fail(str(err))
    print_reconciled(report, f"on work pool '{pool}'; run them with `prefect worker start --pool {pool}`")


@app.command("serve-model", rich_help_panel=PANEL)
def serve_model(pipeline: str = typer.Argument(..., help="Pipeline name (the registered model's name)."),
                alias: str = typer.Option("champion", "--alias", help="The alias whose version is served."),
                host: str = typer.Option("127.0.0.1", "--host"),
                port: int = typer.Option(8000, "--port"),
                traces: Path | None = TRACES,
                record: bool = typer.Option(True, "--record/--no-record", help="Record answers as traces."),
                poll_s: float = typer.Option(10.0, "--poll-s", min=0.1, help="How often the alias is checked "
                                             "(SIGHUP checks it at once)."),
                backend: str = typer.Option("auto", "--backend", help="auto (vLLM with the gpu extra on a GPU, "
                                            "else transformers), hf or vllm."),
                device: str = typer.Option("auto", "--device", help="hf backend: auto, cpu, cuda or cuda:N."),
                mlflow_traces: bool = typer.Option(False, "--mlflow-traces", help="Also write every answer as an "
                                                   "MLflow trace, where feedback given in MLflow's UI comes back "
                                                   "through a collect source `mlflow: EXPERIMENT`."),
                mlflow_experiment: str | None = typer.Option(None, "--mlflow-experiment", help="With "
                                                             "--mlflow-traces: the experiment (default: "
                                                             "<pipeline>-served)."),
                max_batch: int = typer.Option(MAX_BATCH, "--max-batch", min=1, help="Rows (requests times their n) "
                                              "that concurrent requests may share in one generate call."),
                batch_window_ms: float = typer.Option(WINDOW_S * 1000, "--batch-window-ms", min=0.0,
                                                      help="The longest the model waits for more requests before "
                                                      "a call (and at most 5% of its last call's time)."),
                root: Path = ROOT) -> None:
    """Serve the version behind an alias over the OpenAI protocol; its answers become traces collect reads."""
    from flywheel.config import ConfigError
    from flywheel.serving.server import ServeError, serve, traces_folder

    root = checked_root(root)
    folder = (traces or traces_folder(root, pipeline)) if record else None
    experiment = (mlflow_experiment or f"{pipeline}-served") if mlflow_traces else None
    try:
        serve(pipeline, alias, host, port, folder, poll_s, backend, device, experiment, root, max_batch,
              batch_window_ms / 1000)
    except (ServeError, ConfigError) as err:
        fail(str(err))


@stack_app.command("up")
@reported
def stack_up(root: Path = ROOT,
             prefect_port: int = typer.Option(4200, "--prefect-port"), mlflow_port: int = typer.Option(
                 5000, "--mlflow-port"), s3_port: int = typer.Option(9000, "--s3-port"),
             postgres_port: int = typer.Option(5432, "--postgres-port"),
             s3_endpoint: str | None = typer.Option(None, "--s3-endpoint", help="An S3 you run (MinIO, AWS) "
                                                    "instead of moto's server; its bucket `flywheel` is created."),
             workers: int = typer.Option(2, "--workers", min=0)) -> None:
    """Start the stack (what is already running is kept); print where each service listens."""
    from flows import stack

    root = checked_root(root)
    stack.up(root, stack.Ports(prefect_port, mlflow_port, s3_port, postgres_port), s3_endpoint, workers,
             say=typer.echo)


@stack_app.command("down")
@reported
def stack_down(root: Path = ROOT) -> None:
    """Stop the workers, the servers and PostgreSQL; the data stays under .flywheel/stack/."""
    from flows import stack

    stack.down(checked_root(root), say=typer.echo)


@stack_app.command("status")
@reported
def stack_status(root: Path = ROOT) -> None:
    """Each process of the stack: running or not; PostgreSQL and the servers on it answering or not (exit 1)."""
    from flows import stack

    rows = stack.status(checked_root(root))
    for row in rows:
        typer.echo(f"{row.service:<10} pid {row.pid:<8} {row.state}  {row.detail}".rstrip())
    if not all(row.ok for row in rows):
        raise typer.Exit(1)


@stack_app.command("env")
@reported
def stack_env(root: Path = ROOT) -> None:
    """The variables that point a shell at the stack: eval "$(flywheel stack env)"."""
    import shlex

    from flows import stack

    recorded = stack.load(checked_root(root))
    if recorded is None:
        fail("no stack is up here: `flywheel stack up` first")
    for name, value in recorded.client_env().items():
        typer.echo(f"export {name}={shlex.quote(value)}")
