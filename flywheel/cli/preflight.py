"""The checks before any work: the config loads, the trace sources are there, each environment builds, each
student fits its prompts and each on-policy teacher is a checkpoint. `flywheel run`, `check` and `eval` run the
same checks, so what `check` passes a run does not refuse minutes later. Each pipeline is checked on its own:
one pipeline's bad config never stops the check or the run of another."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import typer

from flywheel.cli.app import fail
from flywheel.errors import UserFacingError


@dataclass
class Checked:
    """One pipeline's checks: its environment (None if it did not build), the errors that fail it, and the lines
    that only inform (notes) or warn."""

    env: object | None = None
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def checked_root(root: Path) -> Path:
    """The project root, resolved, with a pipelines.yaml that reads (YAML, a `pipelines:` mapping); the project's
    settings put in place. Each pipeline is checked where a command loads it (pipeline_config), alone."""
    from flywheel.config import ConfigError, read_pipelines_file
    from flywheel.settings import configure

    root = root.resolve()
    try:
        read_pipelines_file(root / "pipelines.yaml")
    except ConfigError as err:
        fail(str(err))
    configure(root)
    return root


def pipeline_config(root: Path, name: str):
    """One pipeline's checked config (another pipeline's errors do not count), or its error on the terminal."""
    from flywheel.config import ConfigError, load_pipeline

    try:
        return load_pipeline(name, root / "pipelines.yaml")
    except ConfigError as err:
        fail_each(str(err).splitlines())


def preflight(root: Path, pipelines: dict, *, students: bool = True) -> dict:
    """Every pipeline's environment built (returned by name); with `students` (a run that trains), its trace
    sources, each student against its prompts and each on-policy distillation teacher loaded. The first pipeline
    with errors exits, one `error:` line each naming the file and key."""
    built = {}
    for name, cfg in pipelines.items():
        checked = check_pipeline(root, name, cfg, students=students)
        say(name, checked)
        if checked.errors:
            fail_each(checked.errors)
        built[name] = checked.env
    return built


def fail_each(errors: list[str], code: int = 2) -> None:
    """Errors found before any work, one `error:` line each, in red; exit 2 as `fail` does (`flywheel check`: 1)."""
    for line in errors:
        typer.secho(line if line.startswith("error:") else f"error: {line}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def say(name: str, checked: Checked) -> None:
    """A pipeline's notes and warnings on the terminal (its errors are the caller's to report)."""
    for note in checked.notes:
        typer.echo(f"  pipelines.{name}: {note}")
    for warning in checked.warnings:
        typer.secho(f"  warning: {warning}", fg=typer.colors.YELLOW)


def check_pipeline(root: Path, name: str, cfg, *, students: bool = True) -> Checked:
    """Every check of one pipeline whose config loaded: its environment, and with `students` (a run that trains)
    its trace sources, its student against the prompts and its on-policy teacher. Each error names the file and
    the key."""
    from flywheel.data.sources import unmatched_globs

    checked = Checked()
    if students:  # (`flywheel eval` reads the collected tasks, not the sources)
        missing, empty = unmatched_globs(name, cfg, root.resolve())
        checked.errors += [f"{root / 'pipelines.yaml'}: {line}" for line in missing]
        checked.warnings += empty
    checked.env = _environment(root, name, cfg, checked)
    if students and checked.env is not None:
        _context(root, name, cfg, checked)
    if students:
        _teacher(root, name, cfg, checked)
        checked.warnings += same_samples(name, cfg)
    return checked


def same_samples(name: str, cfg) -> list[str]:
    """A teacher that cannot vary asked for several samples a task: they come out as one, and the duplicates are
    dropped (a warning, not an error: the run is right, only slower than it need be)."""
    n, teacher = cfg.synthesize.samples_per_task, cfg.teacher
    if n == 1 or teacher.policy == "none":
        return []
    key = f"pipelines.{name}.synthesize.samples_per_task {n}"
    if teacher.policy == "oracle" and not teacher.error_rate:
        return [f"{key}: the oracle (a scripted solver) writes the same conversation every time, so {n - 1} of "
                "every task's samples are dropped as duplicates; variety needs a sampling teacher (openai, vllm, "
                "hf) with synthesize.temperature above 0"]
    if teacher.policy != "oracle" and cfg.synthesize.temperature == 0:
        return [f"{key} at synthesize.temperature 0: a greedy teacher writes each task's samples alike (dropped "
                "as duplicates); set synthesize.temperature above 0 (e.g. 0.8) for variety"]
    return []


def _environment(root: Path, name: str, cfg, checked: Checked):
    """The pipeline's environment built now: an unknown factory, an import error or a factory that raises is an
    error naming the key, the module and the cause before any stage runs."""
    from flywheel.agent import load_harness
    from flywheel.envs import EnvironmentLoadError

    try:
        return load_harness(cfg.environment, root.resolve(), pipeline=name).env  # replay: its collected tasks
    except EnvironmentLoadError as err:
        checked.errors.append(f"{root / 'pipelines.yaml'}: pipelines.{name}.{err}")
        return None


def _context(root: Path, name: str, cfg, checked: Checked) -> None:
    """The student (`auto` resolved, and installed when it picks SmolLM2) against the environment's prompts: a
    prompt and a turn's tokens, or a max_length, over the student's context is an error naming the lengths and
    the keys, before any stage trains (flywheel/train/context.py)."""
    from flywheel.checkpoints import CheckpointError
    from flywheel.config import ConfigError
    from flywheel.train.context import ContextError, check_fit
    from flywheel.train.students import require_installed, resolve_student

    try:
        resolved, choice = resolve_student(cfg, root.resolve())
        require_installed(choice)
        notes = check_fit(name, resolved, checked.env, root.resolve())
    except (ConfigError, CheckpointError, ContextError) as err:
        checked.errors += [f"{root / 'pipelines.yaml'}: pipelines.{name}: {line}" for line in str(err).splitlines()]
        return
    if choice.auto:
        checked.notes.append(f"student {choice.line()}")
    checked.warnings += [f"pipelines.{name}: {note}" for note in notes]


def _teacher(root: Path, name: str, cfg, checked: Checked) -> None:
    """On-policy distillation's local teacher must be a checkpoint folder now, not when the rl stage starts after
    SFT (its tokenizer is compared with the student's there, and a served teacher is probed there)."""
    from flywheel.checkpoints import CheckpointError, load_student

    opd = cfg.rl.objective.opd  # none unless the objective distils
    if opd is None or opd.base_url:
        return
    folder = Path(opd.teacher) if Path(opd.teacher).is_absolute() else root / opd.teacher
    try:
        load_student(folder)
    except CheckpointError as err:
        checked.errors.append(f"{root / 'pipelines.yaml'}: pipelines.{name}.rl.opd.teacher: {err}")


class OverBudget(UserFacingError):
    """A run whose estimate is over its pipeline's budget_minutes, without a terminal to ask on and without --yes."""


def estimate_pipeline(root: Path, name: str, cfg, env):
    """Each stage's estimated time for one pipeline whose checks passed, printed; None (with a warning saying why)
    when it cannot be estimated: an estimate never stops a check or a run."""
    from flywheel.agent import Harness, Limits
    from flywheel.estimate import estimate, render
    from flywheel.train.students import resolve_student

    try:
        resolved, _ = resolve_student(cfg, root.resolve())
        est = estimate(name, resolved, Harness(env, Limits.from_config(cfg.environment)), root.resolve())
    except Exception as err:  # noqa: BLE001 - a student that does not load here, a solver that breaks: said, not fatal
        typer.secho(f"  warning: pipelines.{name}: no time estimate: {type(err).__name__}: {err}",
                    fg=typer.colors.YELLOW)
        return None
    typer.echo(f"  pipelines.{name}: estimated time")
    for line in render(est):
        typer.echo(line)
    return est


def hold_to_budget(root: Path, name: str, cfg, est, yes: bool) -> None:
    """A run estimated over `budget_minutes`: asked on a terminal, refused without one (unless --yes)."""
    import sys

    from flywheel.estimate import clock

    budget = cfg.budget_minutes
    if budget is None or est is None or yes or est.total <= budget * 60:
        return
    said = (f"pipelines.{name}: the estimate is {clock(est.total)} (" + ", ".join(
        f"{stage} {clock(s)}" for stage, s in est.seconds.items()) + f"), over budget_minutes {budget:g} in "
        f"{root / 'pipelines.yaml'}")
    if sys.stdin.isatty() and sys.stdout.isatty():
        if typer.confirm(f"{said}. Run anyway?", default=False):
            return
        typer.echo(f"flywheel run {name}: not started")
        raise typer.Exit(1)
    raise OverBudget(f"{said}; nothing was started. Run it anyway with `flywheel run {name} --yes`, or raise "
                     f"pipelines.{name}.budget_minutes to at least {math.ceil(est.total / 60)}")


def stale_dvc_yaml(root: Path) -> str | None:
    """Why root/dvc.yaml no longer matches pipelines.yaml and the stage specs, or is missing in a DVC project; or
    None (tasks/spec.py stale)."""
    from tasks.spec import stale

    return stale(root)
