"""The `flywheel` command: run a pipeline or one stage, eval, check, compare, rerun, status, envs, serve, deploy."""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import typer

from flywheel.stages import RetrainSummary

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Turn an agent's traces into a better, cheaper model: distil, reinforce, gate, promote.")

ROOT = typer.Option(Path("."), "--root", help="Project root holding pipelines.yaml and dvc.yaml.")
RUN_IDS = typer.Argument(None, help="MLflow run ids of retrain runs, or their first characters as the tables "
                                    "print them (default: the last N).")
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


_invocation = {"debug": False, "command": ""}  # this invocation's app-level options and command (_options)


@app.callback()
def _options(ctx: typer.Context, debug: bool = typer.Option(
        False, "--debug", envvar="FLYWHEEL_DEBUG",
        help="Print tracebacks on the terminal (Prefect's and the command's) as they happen. Without it, a command "
        "that fails (run, stage, eval, rerun, promote, loop) prints `error: STAGE: MESSAGE` (the message names the "
        "file, key, task or prompt and the fix) and `full traceback: PATH`, the log under .flywheel/logs/ that "
        "holds every traceback, and exits 1.")) -> None:
    """Turn an agent's traces into a better, cheaper model: distil, reinforce, gate, promote."""
    _invocation.update(debug=debug, command=ctx.invoked_subcommand or "")


# Errors a user can fix (a config, an environment, a rubric, data, the gate): their message names the file, key,
# task row or prompt and the fix, so it is all the terminal shows. Named by module and class, since those modules
# load with the work, not with the CLI; tests/test_errors_cli.py checks that each name still imports.
USER_ERRORS = (
    "flywheel.config.ConfigError", "flywheel.envs.EnvironmentLoadError", "flywheel.envs.sdk.SchemaError",
    "flywheel.envs.mcp.McpError", "flywheel.contract.RubricError", "flywheel.contract.UserError",
    "flywheel.data.catalog.DataError", "flywheel.data.shapes.SourceError", "flywheel.data.dvc.DvcError",
    "tasks.collect.TooManyBadRecords", "flywheel.policies.openai.TeacherError",
    "flywheel.train.templates.ChatTemplateError", "flywheel.checkpoints.CheckpointError", "tasks.rl.NoUpdatesError",
    "flywheel.evaluate.runner.NoHeldoutError", "flywheel.evaluate.runner.ContaminationError",
    "flywheel.evaluate.arms.SpecError", "flywheel.promotion.PromotionError", "flywheel.reproduce.RerunError",
    "flywheel.serving.loop.LoopError", "flywheel.serving.server.ServeError", "flows.deployments.DeployError",
    "flows.stage.StageJobError", "flows.runlock.PipelineBusy", "flows.stack.StackError",
    "flywheel.train.rl.teacher.OPDSetupError", "flywheel.train.rl.opd.NonFiniteTeacher",
    "flywheel.train.context.ContextError",
)
_RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")  # where Prefect reports a failed flow or task run


def _reported(command):
    """A command whose errors print as one short block (`error: ...`, then where the traceback is) and exit 1;
    with --debug they propagate as they are, every traceback on the terminal."""

    @functools.wraps(command)
    def reported(**kwargs):
        if _invocation["debug"]:
            return command(**kwargs)
        name = _invocation["command"] or command.__name__
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

    return reported


def error_block(err: Exception, log: Path) -> list[str]:
    """What the terminal shows of an error: `error: STAGE: MESSAGE` (a bug says so), then where its traceback is."""
    stage = _stage_of(err)
    where = f"{stage}: " if stage else ""
    if any(f"{c.__module__}.{c.__qualname__}" in USER_ERRORS for c in type(err).__mro__):
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


@app.command()
@_reported
def run(pipeline: str = typer.Argument(..., help="Pipeline name in pipelines.yaml."), root: Path = ROOT,
        refresh: bool = typer.Option(False, "--refresh", help="Rerun every stage, ignoring the cache."),
        push: bool = typer.Option(True, "--push/--no-push", help="Push datasets to the DVC remote."),
        wait: bool = typer.Option(False, "--wait", help="If the pipeline is already running here, start when it "
                                  "ends (default: stop, naming the running one).")) -> None:
    """Run the retrain flow: collect, synthesize, sft, rl, evaluate, register."""
    from flywheel.config import ConfigError, load_pipeline

    root = _checked_root(root)
    try:
        cfg = load_pipeline(pipeline, root / "pipelines.yaml")
    except ConfigError as err:
        _fail(str(err))
    built = _check_environments(root, {pipeline: cfg})
    _check_contexts(root, {pipeline: cfg}, built)
    from flows.retrain import retrain

    started = time.monotonic()
    summary = retrain(pipeline=pipeline, root=str(root), refresh=refresh, push=push, wait=wait)
    _print_summary(summary, root, time.monotonic() - started)


@app.command()
@_reported
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
@_reported
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
            cfg = load_pipeline(pipeline, root / "pipelines.yaml")
            # stored evaluations on other held-out tasks: both versions are scored again on the current ones
            outcome = promotion.promote(pipeline, version, cfg.gate, force=force,
                                        reevaluate=lambda v, c: promotion.evaluate_now(pipeline, v, c, root, cfg))
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
            params: bool = typer.Option(False, "--params", help="Also list every param, one per line."),
            root: Path = ROOT) -> None:
    """Compare retrain runs: data versions, SFT/RL metrics, eval scores with intervals, gate; params on request."""
    from rich.console import Console

    from flywheel import comparison

    _checked_root(root)
    try:
        rows = comparison.retrain_runs(pipeline, last=last, run_ids=runs or None)
    except LookupError as err:
        _fail(str(err))
    if not rows:
        _fail(f"no retrain runs of '{pipeline}' in MLflow ({os.environ['MLFLOW_TRACKING_URI']}); "
              f"run `flywheel run {pipeline}` first")
    console = Console()  # the terminal's width (or COLUMNS): a run is one line from 100 columns, folds below
    for table in comparison.terminal_tables(rows, pipeline, console.width, params=params):
        console.print(table)
    if html is not None:
        typer.echo(f"wrote {comparison.write_html(rows, html, pipeline)}")


@app.command()
@_reported
def rerun(run_id: str = typer.Argument(..., help="MLflow run id of a retrain run, or its first characters as "
                                        "`flywheel compare` lists them."),
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
    from flows.runlock import reap

    for found in reap(root):  # runs of this project now, and those whose process died (marked here)
        typer.echo(found.line())
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
@_reported
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
def check(pipeline: str | None = typer.Argument(None, help="One pipeline in pipelines.yaml (default: every one)."),
          solve: bool = typer.Option(False, "--solve", help="Dry-run the environment: its scripted solver and the "
                                     "null policy (an empty answer) over its tasks, through the real harness and "
                                     "rubric; exits 1 on an error (a reward outside [0, 1], a tool that breaks)."),
          sample: int | None = typer.Option(None, "--sample", min=1, help="With --solve: a seeded sample of N "
                                            "tasks (default: every task collect would draw)."),
          root: Path = ROOT) -> None:
    """Validate pipelines.yaml (every bad key or value with its place in the file), build each environment and
    count the tasks its split gives against what the config asks; with --solve, dry-run the environment."""
    from flywheel.config import ConfigError, load_pipelines
    from flywheel.data.tasksets import own_tasks, short_splits

    try:
        pipelines = load_pipelines(root / "pipelines.yaml")
    except ConfigError as err:
        _fail(str(err))
    if pipeline is not None and pipeline not in pipelines:
        _fail(f"{root / 'pipelines.yaml'}: no pipeline '{pipeline}' (pipelines: {', '.join(sorted(pipelines))})")
    chosen = pipelines if pipeline is None else {pipeline: pipelines[pipeline]}
    built = _check_environments(root, chosen)
    _check_contexts(root, chosen, built)
    _check_teachers(root, chosen)
    stale = _stale_dvc_yaml(root)
    if stale:
        _fail(stale)
    typer.echo(f"{root / 'pipelines.yaml'}: ok ({', '.join(sorted(chosen))})")
    for name, cfg in chosen.items():
        if solve:
            continue  # the dry run says it with the rest
        splits = Counter(t.split for t in own_tasks(built[name], cfg.environment, cfg.collect.heldout_fraction))
        for line in short_splits(built[name].name, splits, cfg.environment, cfg.collect.heldout_fraction):
            typer.secho(f"  warning: pipelines.{name}: {line}", fg=typer.colors.YELLOW)
    if solve and not _dry_run(root.resolve(), chosen, named=pipeline is not None, sample=sample):
        raise typer.Exit(1)


def _dry_run(root: Path, pipelines: dict, named: bool, sample: int | None) -> bool:
    """`check --solve` over each pipeline's environment: its report printed; False when one has errors."""
    from flywheel.dryrun import NoTasksError, dry_run, render
    from flywheel.envs import load_environment
    from flywheel.settings import configure

    configure(root)
    clean = True
    for name, cfg in pipelines.items():
        env = load_environment(cfg.environment, root, pipeline=name)  # replay: the pipeline's collected tasks
        try:
            report = dry_run(name, cfg, env, sample=sample)
        except NoTasksError as err:
            if named:
                _fail(str(err))
            typer.echo(f"pipeline '{name}': not dry-run: {err}")
            continue
        for line in render(report):
            color = {"  error": typer.colors.RED, "  warning": typer.colors.YELLOW}.get(line.partition(":")[0])
            typer.secho(line, fg=color)
        clean = clean and not report.errors
    return clean


def _check_teachers(root: Path, pipelines: dict) -> None:
    """On-policy distillation's local teacher must be a checkpoint folder now, not when the rl stage starts after
    SFT (its tokenizer is compared with the student's there, and a served teacher is probed there)."""
    from flywheel.checkpoints import CheckpointError, load_student

    for name, cfg in pipelines.items():
        opd = cfg.rl.opd
        if cfg.rl.objective == "reward" or opd is None or opd.base_url:
            continue
        folder = Path(opd.teacher) if Path(opd.teacher).is_absolute() else root / opd.teacher
        try:
            load_student(folder)
        except CheckpointError as err:
            _fail(f"{root / 'pipelines.yaml'}: pipelines.{name}.rl.opd.teacher: {err}")


def _check_contexts(root: Path, pipelines: dict, built: dict) -> None:
    """Each pipeline's student (`auto` resolved, and installed when it picks SmolLM2) against its environment's
    prompts: a prompt and a turn's tokens, or a max_length, over the student's context is an error naming the
    lengths and the keys, before any stage trains (flywheel/train/context.py)."""
    from flywheel.checkpoints import CheckpointError
    from flywheel.config import ConfigError
    from flywheel.train.context import ContextError, check_fit
    from flywheel.train.students import require_installed, resolve_student

    for name, cfg in pipelines.items():
        try:
            resolved, choice = resolve_student(cfg, root.resolve())
            require_installed(choice)
            notes = check_fit(name, resolved, built[name], root.resolve())
        except (ConfigError, CheckpointError, ContextError) as err:
            _fail("\n".join(f"{root / 'pipelines.yaml'}: pipelines.{name}: {line}" for line in str(err).splitlines()))
        if choice.auto:
            typer.echo(f"  pipelines.{name}: student {choice.line()}")
        for note in notes:
            typer.secho(f"  warning: pipelines.{name}: {note}", fg=typer.colors.YELLOW)


def _check_environments(root: Path, pipelines: dict) -> dict:
    """Build each pipeline's environment now (returned by pipeline name): an unknown factory, an import error or
    a factory that raises is an error naming the key, the module and the cause before any stage runs."""
    from flywheel.envs import EnvironmentLoadError, load_environment

    built = {}
    for name, cfg in pipelines.items():
        try:
            built[name] = load_environment(cfg.environment, root.resolve())
        except EnvironmentLoadError as err:
            _fail(f"{root / 'pipelines.yaml'}: pipelines.{name}.{err}")
    return built


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


stack_app = typer.Typer(no_args_is_help=True, help="The servers a company runs, as processes on 127.0.0.1 (no "
                        "Docker): PostgreSQL, S3 (moto), Prefect and MLflow servers, two process workers.")
app.add_typer(stack_app, name="stack")


@stack_app.command("up")
@_reported
def stack_up(root: Path = ROOT,
             prefect_port: int = typer.Option(4200, "--prefect-port"), mlflow_port: int = typer.Option(
                 5000, "--mlflow-port"), s3_port: int = typer.Option(9000, "--s3-port"),
             postgres_port: int = typer.Option(5432, "--postgres-port"),
             s3_endpoint: str | None = typer.Option(None, "--s3-endpoint", help="An S3 you run (MinIO, AWS) "
                                                    "instead of moto's server; its bucket `flywheel` is created."),
             workers: int = typer.Option(2, "--workers", min=0)) -> None:
    """Start the stack (what is already running is kept); print where each service listens."""
    from flows import stack

    root = _checked_root(root)
    stack.up(root, stack.Ports(prefect_port, mlflow_port, s3_port, postgres_port), s3_endpoint, workers,
             say=typer.echo)


@stack_app.command("down")
@_reported
def stack_down(root: Path = ROOT) -> None:
    """Stop the workers, the servers and PostgreSQL; the data stays under .flywheel/stack/."""
    from flows import stack

    stack.down(_checked_root(root), say=typer.echo)


@stack_app.command("status")
@_reported
def stack_status(root: Path = ROOT) -> None:
    """Each process of the stack: running or not, and the servers' health."""
    from flows import stack

    rows = stack.status(_checked_root(root))
    for name, pid, running, detail in rows:
        typer.echo(f"{name:<10} pid {pid:<8} {'running' if running else 'STOPPED'}  {detail}".rstrip())
    if not all(running for _, _, running, _ in rows):
        raise typer.Exit(1)


@stack_app.command("env")
@_reported
def stack_env(root: Path = ROOT) -> None:
    """The variables that point a shell at the stack: eval "$(flywheel stack env)"."""
    import shlex

    from flows import stack

    recorded = stack.load(_checked_root(root))
    if recorded is None:
        _fail("no stack is up here: `flywheel stack up` first")
    for name, value in recorded.client_env().items():
        typer.echo(f"export {name}={shlex.quote(value)}")


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
@_reported
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


def _print_summary(summary: RetrainSummary, root: Path, seconds: float) -> None:
    from rich.console import Console

    from flywheel.evaluate.report import reference_line

    console = Console()
    scores, passes, references = summary.scores, summary.pass_rates, summary.references
    names = {"null": "null (empty answer)", "rl": "rl (candidate)", "champion": "champion before this run"}
    names |= {name: f"{name} (reference)" for name in references}
    lines = []
    for label in ("null", "base", "sft", "rl", "champion", *references):
        if f"score_{label}" in scores or label in references:
            ref = references.get(label) or {}
            note = f"incomplete: {ref['unanswered']} task(s) unanswered" if ref.get("incomplete") else ""
            lines.append((names.get(label, label), _fmt(scores.get(f"score_{label}")),
                          _fmt(passes.get(f"pass_rate_{label}")), note))
    console.print(_score_table(f"pipeline '{summary.pipeline}': held-out (greedy)",
                               ("model", "mean reward", "pass rate", "note"), lines))
    verdict = ("[green]passed[/]" if summary.gate_passed else
               "[red]refused: the eval cannot measure this candidate[/]" if summary.refused
               else "[red]not promoted[/]")
    console.print(f"gate: {verdict}")
    for reason in summary.gate_reasons:
        console.print(f"  - {reason}")
    for name, ref in references.items():
        console.print(reference_line(name, ref))
    for warning in summary.warnings:
        console.print(f"[yellow]warning:[/] {warning}")
    if summary.student:
        console.print(f"student: {summary.student}")
    champion = f"champion is version {summary.champion}" if summary.champion else "no champion yet"
    console.print(f"registered: {summary.pipeline} version {summary.version} "
                  f"(aliases: {', '.join(summary.aliases) or 'none'}); {champion}")
    console.print(f"stages run: {', '.join(summary.ran) or 'none'}; cached: {', '.join(summary.cached) or 'none'}"
                  f"; {seconds:.0f}s")
    state = root / ".flywheel"
    console.print("\nlook at it:")
    # MLflow reads its telemetry switch from the environment alone; Prefect also from prefect.toml in the root
    console.print(f"  MLflow UI:  MLFLOW_DISABLE_TELEMETRY=true {sys.executable.rsplit('/', 1)[0]}/mlflow ui "
                  f"--backend-store-uri {os.environ['MLFLOW_TRACKING_URI']} --port 5000")
    console.print(f"  Prefect UI: PREFECT_HOME={state / 'prefect'} {sys.executable.rsplit('/', 1)[0]}/prefect "
                  "server start --port 4200")


if __name__ == "__main__":
    app()
