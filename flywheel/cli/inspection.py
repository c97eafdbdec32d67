"""The commands that look without training: check, eval, status, compare, envs."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import typer

from flywheel.cli.app import ROOT, app, fail
from flywheel.cli.errors import reported
from flywheel.cli.preflight import (
    check_pipeline,
    checked_root,
    estimate_pipeline,
    fail_each,
    pipeline_config,
    preflight,
    say,
    stale_dvc_yaml,
)
from flywheel.cli.render import print_eval, print_status

RUN_IDS = typer.Argument(None, help="MLflow run ids of retrain runs, or their first characters as the tables "
                                    "print them (default: the last N).")
HTML = typer.Option(None, "--html", help="Also write an HTML report with plots to this file.")
POLICY = typer.Option(None, "--policy", help="[LABEL=]SPEC, repeatable: a checkpoint folder, models:/NAME/VERSION, "
                      "models:/NAME@ALIAS, @ALIAS (this pipeline's model), openai:MODEL or null.")
MODELS = typer.Option(None, "--model", help="With --show: the model labels shown (repeatable; default: rl, the "
                      "candidate).")

PANEL = "Check and look"  # where `flywheel --help` lists these commands


@app.command(rich_help_panel=PANEL)
def check(pipeline: str | None = typer.Argument(None, help="One pipeline in pipelines.yaml (default: every one)."),
          solve: bool = typer.Option(False, "--solve", help="Dry-run the environment: its scripted solver and the "
                                     "null policy (an empty answer) over its tasks, through the real harness and "
                                     "rubric; exits 1 on an error (a reward outside [0, 1], a tool that breaks)."),
          sample: int | None = typer.Option(None, "--sample", min=1, help="With --solve: a seeded sample of N "
                                            "tasks (default: every task collect would draw)."),
          estimate: bool = typer.Option(True, "--estimate/--no-estimate", help="Estimate each stage's time on "
                                        "this machine (a timed probe of the student, kept in .flywheel/probe/)."),
          root: Path = ROOT) -> None:
    """Check every pipeline in pipelines.yaml on its own (each bad key or value with its place in the file, the
    trace sources, the environment, the student's context) and count the tasks each split gives against what the
    config asks; estimate each stage's time here; with --solve, dry-run the environment. Each error is one
    `error:` line; exit 1 if any."""
    from flywheel.config import ConfigError, load_each
    from flywheel.data.tasksets import own_tasks, short_splits

    path = root / "pipelines.yaml"
    try:
        each = load_each(path)
    except ConfigError as err:
        fail_each(str(err).splitlines(), code=1)
    if pipeline is not None and pipeline not in each:
        fail_each([f"{path}: no pipeline named '{pipeline}' (have: {', '.join(sorted(each))})"], code=1)
    chosen = each if pipeline is None else {pipeline: each[pipeline]}
    passed, errors = {}, []
    for name, cfg in chosen.items():
        if isinstance(cfg, ConfigError):
            errors += str(cfg).splitlines()
            continue
        checked = check_pipeline(root, name, cfg)
        say(name, checked)
        errors += checked.errors
        if not checked.errors:
            passed[name] = (cfg, checked.env)
    if all(not isinstance(cfg, ConfigError) for cfg in each.values()):
        stale = stale_dvc_yaml(root)  # generated from every pipeline: only comparable when every one loads
        errors += [stale] if stale else []
        if not stale and not (root / "dvc.yaml").exists():
            typer.echo(f"  note: {root} is no DVC project (no .dvc/ or dvc.yaml): stages cache under Prefect and no "
                       "dataset is versioned; to version them, `dvc init` and `flywheel dvc-yaml`")
    else:
        typer.secho(f"  warning: {root / 'dvc.yaml'} not compared with {path} while a pipeline in it does not "
                    "load", fg=typer.colors.YELLOW)
    if passed:
        typer.echo(f"{path}: ok ({', '.join(sorted(passed))})")
    for name, (cfg, env) in passed.items():
        if solve:
            continue  # the dry run says it with the rest
        splits = Counter(t.split for t in own_tasks(env, cfg.environment, cfg.collect.heldout_fraction))
        for line in short_splits(env.name, splits, cfg.environment, cfg.collect.heldout_fraction):
            typer.secho(f"  warning: pipelines.{name}: {line}", fg=typer.colors.YELLOW)
    if errors:
        failed = sorted(set(chosen) - set(passed))
        fail_each(errors + [f"{path}: {len(failed)} of {len(chosen)} pipeline(s) failed the check: "
                            f"{', '.join(failed)}"] * bool(failed), code=1)
    for name, (cfg, env) in passed.items() if estimate else ():
        est = estimate_pipeline(root.resolve(), name, cfg, env)
        if est is not None and cfg.budget_minutes is not None and est.total > cfg.budget_minutes * 60:
            typer.secho(f"  warning: pipelines.{name}: the estimate is over budget_minutes {cfg.budget_minutes:g}: "
                        "`flywheel run` will ask before starting (or, without a terminal, stop unless --yes)",
                        fg=typer.colors.YELLOW)
    if solve and not _dry_run(root.resolve(), {name: cfg for name, (cfg, _) in passed.items()},
                              named=pipeline is not None, sample=sample):
        raise typer.Exit(1)


def _dry_run(root: Path, pipelines: dict, named: bool, sample: int | None) -> bool:
    """`check --solve` over each pipeline's environment: its report printed; False when one has errors."""
    from flywheel.agent import load_harness
    from flywheel.dryrun import NoTasksError, dry_run, render
    from flywheel.replaycheck import recorded_conversations
    from flywheel.settings import configure

    configure(root)
    clean = True
    for name, cfg in pipelines.items():
        harness = load_harness(cfg.environment, root, pipeline=name)  # replay: the pipeline's collected tasks
        try:
            report = dry_run(name, cfg, harness, sample=sample, conversations=recorded_conversations(root, name))
        except NoTasksError as err:
            if named:
                fail_each([str(err)], code=1)
            typer.echo(f"pipeline '{name}': not dry-run: {err}")
            continue
        for line in render(report):
            color = {"  error": typer.colors.RED, "  warning": typer.colors.YELLOW}.get(line.partition(":")[0])
            typer.secho(line, fg=color)
        clean = clean and not report.errors
    return clean


@app.command("eval", rich_help_panel=PANEL)
@reported
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
                  show: str | None = typer.Option(None, "--show", help="Print the conversations of the failed, "
                                                  "passed or all episodes: of this eval with --policy, else of the "
                                                  "pipeline's last evaluate stage."),
                  count: int = typer.Option(3, "-n", min=1, help="With --show: how many conversations."),
                  model: list[str] | None = MODELS,
                  root: Path = ROOT) -> None:
    """Score policies on a pipeline's held-out tasks without training, beside the null policy (an MLflow run,
    each episode a trace); or, with --show and no --policy, print episodes of the last evaluate stage."""
    from flywheel.cli.conversations import SHOWN
    from flywheel.config import ReferenceConfig
    from flywheel.data.catalog import DataError
    from flywheel.evaluate.adhoc import evaluate_policies
    from flywheel.evaluate.arms import SpecError
    from flywheel.evaluate.runner import NoHeldoutError

    root = checked_root(root)
    cfg = pipeline_config(root, pipeline)
    if show is not None and show not in SHOWN:
        fail(f"--show {show}: show one of {', '.join(SHOWN)}")
    if not policy:
        if show is None:
            fail("name a policy to score with --policy (repeatable), or --show failed to read the last evaluate "
                 f"stage's episodes of '{pipeline}'")
        _show_stage_eval(root, pipeline, show, count, model)
        return
    endpoint = {"base_url": base_url, "api_key_env": api_key_env, "price_input_per_mtok": price_input,
                "price_output_per_mtok": price_output, "cache": None}
    try:
        ReferenceConfig(name="check", model="check", **endpoint)  # a bad --api-key-env is named here
    except ValueError as err:
        fail(str(err))
    preflight(root, {pipeline: cfg}, students=False)
    try:
        result = evaluate_policies(pipeline, root, cfg, policy, endpoint, samples)
    except (NoHeldoutError, SpecError, DataError) as err:
        fail(str(err))
    print_eval(result, pipeline)
    if show is not None:
        from flywheel.cli.conversations import chosen, print_conversations

        rows = chosen(result.table, show, model, count)
        print_conversations(rows, _matching(result.table, show, model), show, f"MLflow run {result.run_id}")


def _show_stage_eval(root: Path, pipeline: str, show: str, count: int, models: list[str] | None) -> None:
    """`flywheel eval PIPELINE --show ...`: episodes of the pipeline's eval table (data/<pipeline>/evaluate)."""
    from flywheel.cli.conversations import chosen, print_conversations
    from flywheel.data.catalog import Catalog, DataError

    catalog = Catalog(root, pipeline)
    path = catalog.table_path("eval")
    if not path.exists():
        fail(f"pipeline '{pipeline}' has no eval table yet ({path}): run `flywheel run {pipeline}` first, or score "
             "policies with --policy")
    try:
        table = catalog.read("eval")
    except DataError as err:
        fail(f"{err}; `flywheel run {pipeline}` writes it again")
    unknown = sorted(set(models or []) - set(table["model"]))
    if unknown:
        fail(f"--model {', '.join(unknown)}: {path} has the models {', '.join(dict.fromkeys(table['model']))}")
    print_conversations(chosen(table, show, models, count), _matching(table, show, models), show, str(path))


def _matching(table, show: str, models: list[str] | None) -> int:
    from flywheel.cli.conversations import chosen

    return len(chosen(table, show, models, len(table)))


@app.command(rich_help_panel=PANEL)
def status(pipeline: str = typer.Argument(..., help="Pipeline name in pipelines.yaml."),
           last: int = typer.Option(5, "--last", min=1, help="How many of the newest retrain runs."),
           root: Path = ROOT) -> None:
    """The champion and challenger, the last runs with their gate, the data versions, the next scheduled run."""
    root = checked_root(root)
    from flows.concurrency import check
    from flows.runlock import reap
    from flows.status import next_run
    from flywheel.status import pipeline_status

    cfg = pipeline_config(root, pipeline)
    for found in reap(root):  # runs of this project now, and those whose process died (marked here)
        typer.echo(found.line())
    for line in check(pipeline):  # its slot on a Prefect server: the holder, or a dead holder's slot released
        typer.echo(line)
    print_status(pipeline, pipeline_status(pipeline, last=last), next_run(pipeline, cfg.schedule).line)


@app.command(rich_help_panel=PANEL)
def compare(pipeline: str = typer.Argument(..., help="Pipeline name (the MLflow experiment)."),
            runs: list[str] | None = RUN_IDS,
            last: int = typer.Option(5, "--last", min=1, help="How many of the newest retrain runs."),
            html: Path | None = HTML,
            params: bool = typer.Option(False, "--params", help="Also list every param, one per line."),
            root: Path = ROOT) -> None:
    """Compare retrain runs: data versions, SFT/RL metrics, eval scores with intervals, gate; params on request."""
    from rich.console import Console

    from flywheel import comparison

    checked_root(root)
    try:
        rows = comparison.retrain_runs(pipeline, last=last, run_ids=runs or None)
    except LookupError as err:
        fail(str(err))
    if not rows:
        fail(f"no retrain runs of '{pipeline}' in MLflow ({os.environ['MLFLOW_TRACKING_URI']}); "
             f"run `flywheel run {pipeline}` first")
    console = Console()  # the terminal's width (or COLUMNS): a run is one line from 100 columns, folds below
    for table in comparison.terminal_tables(rows, pipeline, console.width, params=params):
        console.print(table)
    if html is not None:
        typer.echo(f"wrote {comparison.write_html(rows, html, pipeline)}")


@app.command(rich_help_panel=PANEL)
def envs() -> None:
    """List the environments a pipeline can name: built-ins and installed packages' entry points."""
    from flywheel.envs import ENTRY_POINT_GROUP, entry_point_environments, environment_names

    for name in environment_names():
        typer.echo(f"{name}\tbuilt-in\tflywheel.envs.{name}")
    for name, target in sorted(entry_point_environments().items()):
        typer.echo(f"{name}\tentry point ({ENTRY_POINT_GROUP})\t{target}")
    typer.echo("any other: environment: {factory: \"package.module:function\", args: {...}} in pipelines.yaml")
