"""The `flywheel` command: run a pipeline or one stage, eval, check, compare, rerun, status, envs, serve, deploy."""

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
POLICY = typer.Option(..., "--policy", help="[LABEL=]SPEC, repeatable: a checkpoint folder, models:/NAME/VERSION, "
                      "models:/NAME@ALIAS, @ALIAS (this pipeline's model), openai:MODEL or null.")
RESTORE = typer.Option(["collect"], "--restore", help="A stage checked out from DVC instead of run (repeat: "
                       "collect, synthesize): their inputs lie outside the project and may have changed.")


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
        cfg = load_pipeline(pipeline, root / "pipelines.yaml")
    except ConfigError as err:
        _fail(str(err))
    _check_environments(root, {pipeline: cfg})
    from flows.retrain import retrain

    started = time.monotonic()
    summary = retrain(pipeline=pipeline, root=str(root), refresh=refresh, push=push)
    _print_summary(summary, root, time.monotonic() - started)


@app.command()
def stage(name: str = typer.Argument(..., help="collect, synthesize, sft, rl, evaluate or register."),
          pipeline: str = typer.Option(..., "--pipeline", "-p"), root: Path = ROOT) -> None:
    """Run one stage directly, without Prefect (what dvc.yaml calls)."""
    from flywheel.stages import ORDER

    root = _checked_root(root)
    if name not in ORDER:
        _fail(f"unknown stage '{name}' (stages: {', '.join(ORDER)})")
    from tasks.kernel import stage_by_name

    result = stage_by_name(name).fn(pipeline=pipeline, root=str(root))
    typer.echo(f"{name}: done (MLflow run {result.run_id})")


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
    console = Console(width=max(160, Console().width))
    # two tables, each run's id first in both: the runs, then their held-out scores (mean reward and pass rate)
    scores = ["run", *comparison.SCORE_COLUMNS]
    for title, columns in ((f"{pipeline}: the last {len(rows)} retrain runs",
                            [c for c in frame.columns if c not in comparison.SCORE_COLUMNS]),
                           ("held-out (greedy): mean reward and pass rate of each model", scores)):
        table = Table(title=title)
        for column in columns:
            table.add_column(column, overflow="fold", no_wrap=column == "run")
        for line in frame[columns].itertuples(index=False):
            table.add_row(*[str(v) for v in line])
        console.print(table)
    if html is not None:
        typer.echo(f"wrote {comparison.write_html(rows, html, pipeline)}")


@app.command()
def rerun(run_id: str = typer.Argument(..., help="MLflow run id of a retrain run (`flywheel compare` lists them)."),
          promote: bool = typer.Option(False, "--promote", help="Let the gate move champion, as a run would."),
          restore: list[str] = RESTORE,
          push: bool = typer.Option(True, "--push/--no-push", help="Push reproduced data to the DVC remote."),
          root: Path = ROOT) -> None:
    """Run a recorded retrain run again from its config and data versions; compare every output and score."""
    from rich.console import Console
    from rich.table import Table

    root = _checked_root(root)  # before Prefect is imported: it reads its settings once
    from flows.rerun import rerun as rerun_flow
    from flywheel.reproduce import RerunError

    try:
        report = rerun_flow(run_id, root=str(root), promote=promote, push=push, restore=tuple(restore))
    except RerunError as err:
        _fail(str(err))
    console = Console(width=max(140, Console().width))
    outputs = Table(title=f"rerun {report.rerun_id[:8]} of {run_id[:8]}: outputs (DVC md5)")
    for column in ("stage", "path", "recorded", "reproduced", "", "note"):
        outputs.add_column(column, overflow="fold")
    colour = {"identical": "green", "restored": "cyan", "measured": "yellow", "differs": "red"}
    for o in report.outputs:
        outputs.add_row(o.stage, o.path, o.recorded[:12], o.reproduced[:12],
                        f"[{colour[o.verdict]}]{o.verdict}[/]", o.note)
    console.print(outputs)
    scores = Table(title="held-out mean reward (greedy): recorded and reproduced")
    for column in ("model", "recorded", "reproduced", "difference [interval]", "", "how"):
        scores.add_column(column)
    for s in report.scores:
        interval = f"[{s.low:+.3f}, {s.high:+.3f}]" if s.low is not None else ""
        recorded = "" if s.recorded is None else f"{s.recorded:.3f}"
        diff = "" if s.recorded is None else f"{s.reproduced - s.recorded:+.3f} {interval}"
        scores.add_row(s.model, recorded, f"{s.reproduced:.3f}", diff,
                       "[green]within noise[/]" if s.within_noise else "[red]outside noise[/]", s.how)
    console.print(scores)
    console.print(f"gate: recorded {report.gate_recorded or '?'}, reproduced {report.gate_reproduced}; "
                  f"registered version {report.version}; champion is version {report.champion}"
                  + ("" if promote else " (not moved: --promote offers it to the gate)"))
    if report.code_changes:
        console.print(f"code that differs from the recorded run's: {', '.join(report.code_changes)}")
    for warning in report.warnings:
        console.print(f"[yellow]warning:[/] {warning}")
    verdict = ("datasets and models identical" if report.datasets_identical
               else "[red]datasets or models differ[/]") + ", " + \
        ("scores within noise" if report.scores_within_noise else "[red]scores outside noise[/]")
    console.print(f"{verdict}; workspace {report.workspace}")
    if not report.reproduced:
        raise typer.Exit(1)


@app.command()
def status(pipeline: str = typer.Argument(..., help="Pipeline name in pipelines.yaml."),
           last: int = typer.Option(5, "--last", min=1, help="How many of the newest retrain runs."),
           root: Path = ROOT) -> None:
    """The champion and challenger, the last runs with their gate, the data versions, the next scheduled run."""
    from rich.console import Console
    from rich.table import Table

    root = _checked_root(root)
    from flows.status import next_run
    from flywheel.config import ConfigError, load_pipeline
    from flywheel.status import pipeline_status

    try:
        cfg = load_pipeline(pipeline, root / "pipelines.yaml")
    except ConfigError as err:
        _fail(str(err))
    state = pipeline_status(pipeline, last=last)
    console = Console(width=max(140, Console().width))
    models = Table(title=f"{pipeline}: registered model")
    for column in ("alias", "version", "mean reward", "pass rate", "registered", "from pipeline run", "gate",
                   "promotion"):
        models.add_column(column)
    for a in state.aliases:
        models.add_row(a.alias, a.version, _fmt(a.score), _fmt(a.pass_rate),
                       a.registered.strftime("%Y-%m-%d %H:%M UTC"), a.pipeline_run, a.gate, a.promotion)
    console.print(models if state.aliases else f"{pipeline}: no registered version yet")
    runs = Table(title=f"{pipeline}: the last {len(state.runs)} retrain runs")
    for column in ("run", "started", "state", "gate", "version", "stages", "rerun of"):
        runs.add_column(column, overflow="fold")
    for r in state.runs:
        kinds = {how: [s for s, h in r.stages.items() if h == how] for how in dict.fromkeys(r.stages.values())}
        stages = "; ".join(f"{how}: {' '.join(names)}" for how, names in kinds.items())
        runs.add_row(r.run_id, r.started.strftime("%Y-%m-%d %H:%M UTC"), r.status, r.gate, r.version, stages,
                     r.rerun_of[:8])
    console.print(runs if state.runs else f"{pipeline}: no retrain runs yet (`flywheel run {pipeline}`)")
    data = state.data_versions()
    if not data.empty:
        versions = Table(title="data versions (DVC md5)")
        for column in data.columns:
            versions.add_column(column, overflow="fold")
        for line in data.itertuples(index=False):
            versions.add_row(*[str(v)[:12] if i else str(v) for i, v in enumerate(line)])
        console.print(versions)
    console.print(f"next scheduled run: {next_run(pipeline, cfg.schedule).line}")


@app.command("eval")
def eval_policies(pipeline: str = typer.Argument(..., help="Pipeline name in pipelines.yaml: its held-out tasks."),
                  policy: list[str] = POLICY,
                  base_url: str | None = typer.Option(None, "--base-url", help="openai: the endpoint, e.g. "
                                                      "http://localhost:8000/v1 (default: OPENAI_BASE_URL)."),
                  api_key_env: str | None = typer.Option(None, "--api-key-env", help="openai: the NAME of the "
                                                         "variable holding the key."),
                  price_input: float = typer.Option(0.0, "--price-input", min=0, help="openai: USD per million "
                                                    "prompt tokens."),
                  price_output: float = typer.Option(0.0, "--price-output", min=0, help="openai: USD per million "
                                                     "completion tokens."),
                  samples: int | None = typer.Option(None, "--samples", min=0, help="Sampled episodes per task "
                                                     "beside the greedy one (default: evaluate.samples)."),
                  root: Path = ROOT) -> None:
    """Score policies on a pipeline's held-out tasks without training, beside the null policy; an MLflow run."""
    from rich.console import Console

    from flywheel.config import ConfigError, ReferenceConfig, load_pipeline
    from flywheel.data.catalog import DataError
    from flywheel.evaluate.adhoc import evaluate_policies
    from flywheel.evaluate.arms import SpecError
    from flywheel.evaluate.runner import NoHeldoutError

    root = _checked_root(root)
    try:
        cfg = load_pipeline(pipeline, root / "pipelines.yaml")
        endpoint = {"base_url": base_url, "api_key_env": api_key_env, "price_input_per_mtok": price_input,
                    "price_output_per_mtok": price_output, "cache": None}
        ReferenceConfig(name="check", model="check", **endpoint)  # a bad --api-key-env is named here
    except (ConfigError, ValueError) as err:
        _fail(str(err))
    _check_environments(root, {pipeline: cfg})
    try:
        result = evaluate_policies(pipeline, root, cfg, policy, endpoint, samples)
    except (NoHeldoutError, SpecError, DataError) as err:
        _fail(str(err))
    lines = [(m.model,
              _fmt(m.mean_reward) + ("" if m.low is None else f" [{m.low:.3f}, {m.high:.3f}]"),
              _fmt(m.pass_rate), str(m.tasks), _fmt(m.cost_per_task_usd, "${:.6f}"),
              f"incomplete: {m.unanswered} task(s) unanswered" if m.unanswered else "")
             for m in result.models.itertuples(index=False)]
    console = Console(width=max(120, Console().width))
    console.print(_score_table(f"pipeline '{pipeline}': {result.tasks} held-out tasks (greedy)",
                               ("model", "mean reward [95% CI]", "pass rate", "tasks", "cost per task", "note"),
                               lines))
    for label, what in result.described.items():
        console.print(f"  {label}: {what}", soft_wrap=True)
    for label, count in result.user_errors.items():
        console.print(f"{label}: {count} episode(s) left out: the simulated user failed")
    console.print(f"MLflow run {result.run_id} (experiment '{pipeline}', run name 'eval')")


@app.command()
def check(root: Path = ROOT) -> None:
    """Validate pipelines.yaml: every bad key or value is reported with its place in the file."""
    from flywheel.config import ConfigError, load_pipelines

    try:
        pipelines = load_pipelines(root / "pipelines.yaml")
    except ConfigError as err:
        _fail(str(err))
    _check_environments(root, pipelines)
    stale = _stale_dvc_yaml(root)
    if stale:
        _fail(stale)
    typer.echo(f"{root / 'pipelines.yaml'}: ok ({', '.join(sorted(pipelines))})")


def _check_environments(root: Path, pipelines: dict) -> None:
    """Build each pipeline's environment now: an unknown factory, an import error or a factory that raises is
    an error naming the key, the module and the cause before any stage runs."""
    from flywheel.envs import EnvironmentLoadError, load_environment

    for name, cfg in pipelines.items():
        try:
            load_environment(cfg.environment, root.resolve())
        except EnvironmentLoadError as err:
            _fail(f"{root / 'pipelines.yaml'}: pipelines.{name}.{err}")


@app.command()
def envs() -> None:
    """List the environments a pipeline can name: built-ins and installed packages' entry points."""
    from flywheel.envs import ENTRY_POINT_GROUP, entry_point_environments, environment_names

    for name in environment_names():
        typer.echo(f"{name}\tbuilt-in\tflywheel.envs.{name}")
    for name, target in sorted(entry_point_environments().items()):
        typer.echo(f"{name}\tentry point ({ENTRY_POINT_GROUP})\t{target}")
    typer.echo("any other: environment: {factory: \"package.module:function\", args: {...}} in pipelines.yaml")


def _stale_dvc_yaml(root: Path) -> str | None:
    """Why root/dvc.yaml no longer matches pipelines.yaml and the stage specs, or None (also: no dvc.yaml)."""
    from tasks.spec import dvc_yaml

    path = root / "dvc.yaml"
    if not path.exists() or path.read_text() == dvc_yaml(root):
        return None
    return (f"{path} is out of date with {root / 'pipelines.yaml'} (a pipeline or its collect sources changed, or "
            "the stages' code deps did), so `dvc repro` would track the wrong inputs; regenerate it: "
            "python -m tasks.spec > dvc.yaml")


RESULTS = typer.Option(None, "--results", envvar="FLYWHEEL_RESULTS_URL",
                       help="Keep Prefect results (the stage caches) here, e.g. s3://bucket/prefect-results.")
STAGE_VARIABLES = typer.Option(
    None, "--stage-variables",
    help="Job variables per stage, for --job-per-stage (default: <root>/infra/k8s/stages.json).")


def _planned(root: Path, stage_jobs: dict | None = None) -> list:
    from flows.deployments import plan
    from flywheel.config import load_pipelines

    wanted = plan(load_pipelines(root / "pipelines.yaml"), root, stage_jobs=stage_jobs)
    if not wanted:
        _fail(f"{root / 'pipelines.yaml'}: no pipeline has a `schedule` or a `trigger`, so there is nothing to "
              "deploy; add e.g. `schedule: {cron: \"0 3 * * 1\", timezone: UTC}` to a pipeline")
    return wanted


def _print_reconciled(report: dict, where: str) -> None:
    for name in report["kept"]:
        typer.echo(f"  {name}: {', '.join(report['schedules'][name]) or 'no schedule (started by its sensor)'}")
    for name in report["deleted"]:
        typer.echo(f"  {name}: deleted (no schedule or trigger for it in pipelines.yaml)")
    typer.echo(f"{len(report['kept'])} deployment(s) {where}")


@app.command()
def serve(root: Path = ROOT, results: str | None = RESULTS,
          port: int = typer.Option(4200, "--port", help="Port of the local Prefect server, if one is started."),
          ) -> None:
    """Serve every pipeline's schedule and trigger from this one process (retrain/P, watch-traces/P)."""
    from contextlib import ExitStack

    from flows import deployments

    root = _checked_root(root)
    wanted = _planned(root)
    os.chdir(root)  # the served flows' entrypoints are paths under the project root
    with ExitStack() as stack:
        if not os.environ.get("PREFECT_API_URL"):
            # Prefect's ephemeral server runs no scheduler: schedules need a real one, so start it here
            home = Path(os.environ["PREFECT_HOME"])
            try:
                url = stack.enter_context(deployments.local_server(home, port=port))
            except RuntimeError as err:
                _fail(f"{err}\n(no PREFECT_API_URL is set, so `flywheel serve` starts its own Prefect server on "
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
        _print_reconciled(report, "served from this process (Ctrl-C stops)")
        prefect_serve(*served, print_starting_message=False)


@app.command()
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

    root = _checked_root(root)
    if not os.environ.get("PREFECT_API_URL"):
        _fail("flywheel deploy needs a Prefect server: set PREFECT_API_URL (e.g. http://prefect:4200/api, see "
              "infra/README.md); on one machine without a server, `flywheel serve` runs the schedules instead")
    try:
        variables = json.loads(job_variables) if job_variables else None
    except json.JSONDecodeError as err:
        _fail(f"--job-variables is not JSON: {err}")
    stage_jobs = None
    if job_per_stage:
        try:
            stage_jobs = deployments.stage_job_variables(stage_variables or root / "infra/k8s/stages.json")
        except deployments.DeployError as err:
            _fail(str(err))
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
        _fail(str(err))
    _print_reconciled(report, f"on work pool '{pool}'; run them with `prefect worker start --pool {pool}`")


TRACES = typer.Option(None, "--traces", help="Folder for the served traffic (default: traces/served/<pipeline>/ "
                      "under --root); the pipeline's collect.sources read it.")


@app.command("serve-model")
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
                root: Path = ROOT) -> None:
    """Serve the version behind an alias over the OpenAI protocol; its answers become traces collect reads."""
    from flywheel.serving.server import ServeError, serve, traces_folder

    root = _checked_root(root)
    folder = (traces or traces_folder(root, pipeline)) if record else None
    try:
        serve(pipeline, alias, host, port, folder, poll_s, backend, device)
    except ServeError as err:
        _fail(str(err))


@app.command()
def loop(pipeline: str = typer.Argument(..., help="Pipeline name in pipelines.yaml."),
         rounds: int = typer.Option(2, "--rounds", min=1, help="Retrain, serve, drive the agent: this many times."),
         episodes: int = typer.Option(100, "--episodes", min=1, help="Agent episodes against the server per round."),
         traces: Path | None = TRACES,
         push: bool = typer.Option(True, "--push/--no-push", help="Push datasets to the DVC remote."),
         root: Path = ROOT) -> None:
    """Close the flywheel: retrain, serve the champion, run the environment's agent on it, collect, retrain."""
    from flywheel.config import ConfigError, load_pipeline
    from flywheel.serving.loop import LoopError, check_sources, run_round
    from flywheel.serving.server import traces_folder

    root = _checked_root(root)
    folder = traces or traces_folder(root, pipeline)
    try:
        check_sources(pipeline, load_pipeline(pipeline, root / "pipelines.yaml"), root, folder)
    except (ConfigError, LoopError) as err:
        _fail(str(err))
    from flows.retrain import retrain

    for number in range(1, rounds + 1):
        summary = retrain(pipeline=pipeline, root=str(root), push=push)
        line = run_round(pipeline, root, folder, summary, number, episodes)
        typer.echo(line.text())


def _score_table(title: str, columns: tuple[str, ...], lines: list[tuple[str, ...]]):
    """Held-out numbers per model: the mean reward and the pass rate side by side, never one for the other."""
    from rich.table import Table

    table = Table(title=title)
    for i, column in enumerate(columns):
        table.add_column(column, justify="right" if 0 < i < len(columns) - 1 else "left")
    for line in lines:
        table.add_row(*line)
    return table


def _fmt(value, pattern: str = "{:.3f}") -> str:
    """A number as text; blank when missing (None or NaN, the one value unequal to itself)."""
    return "" if value is None or value != value else pattern.format(value)


def _print_summary(summary: dict, root: Path, seconds: float) -> None:
    from rich.console import Console

    from flywheel.evaluate.report import reference_line

    console = Console()
    scores, passes = summary["scores"], summary.get("pass_rates", {})
    names = {"null": "null (empty answer)", "rl": "rl (candidate)", "champion": "champion before this run"}
    names |= {name: f"{name} (reference)" for name in summary.get("references", {})}
    lines = []
    for label in ("null", "base", "sft", "rl", "champion", *summary.get("references", {})):
        if f"score_{label}" in scores or label in summary.get("references", {}):
            ref = summary.get("references", {}).get(label) or {}
            note = f"incomplete: {ref['unanswered']} task(s) unanswered" if ref.get("incomplete") else ""
            lines.append((names.get(label, label), _fmt(scores.get(f"score_{label}")),
                          _fmt(passes.get(f"pass_rate_{label}")), note))
    console.print(_score_table(f"pipeline '{summary['pipeline']}': held-out (greedy)",
                               ("model", "mean reward", "pass rate", "note"), lines))
    verdict = ("[green]passed[/]" if summary["gate_passed"] else
               "[red]refused: the eval cannot measure this candidate[/]" if summary.get("refused")
               else "[red]not promoted[/]")
    console.print(f"gate: {verdict}")
    for reason in summary["gate_reasons"]:
        console.print(f"  - {reason}")
    for name, ref in summary.get("references", {}).items():
        console.print(reference_line(name, ref))
    for warning in summary.get("warnings", []):
        console.print(f"[yellow]warning:[/] {warning}")
    champion = f"champion is version {summary['champion']}" if summary["champion"] else "no champion yet"
    console.print(f"registered: {summary['pipeline']} version {summary['version']} "
                  f"(aliases: {', '.join(summary['aliases']) or 'none'}); {champion}")
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
