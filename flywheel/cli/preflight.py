"""The checks before any work: the config loads, each environment builds, each student fits its prompts and each
on-policy teacher is a checkpoint. `flywheel run`, `check` and `eval` run the same checks, so what `check` passes
a run does not refuse minutes later."""

from __future__ import annotations

from pathlib import Path

import typer

from flywheel.cli.app import fail


def checked_root(root: Path) -> Path:
    """The project root, resolved, with a pipelines.yaml that loads; the project's settings put in place."""
    from flywheel.config import ConfigError, load_pipelines
    from flywheel.settings import configure

    root = root.resolve()
    try:
        load_pipelines(root / "pipelines.yaml")
    except ConfigError as err:
        fail(str(err))
    configure(root)
    return root


def pipeline_config(root: Path, name: str):
    """One pipeline's checked config, or the config error on the terminal (exit 2)."""
    from flywheel.config import ConfigError, load_pipeline

    try:
        return load_pipeline(name, root / "pipelines.yaml")
    except ConfigError as err:
        fail(str(err))


def preflight(root: Path, pipelines: dict, *, students: bool = True) -> dict:
    """Every pipeline's environment built (returned by name); with `students`, each student against its prompts
    and each on-policy distillation teacher loaded. The first problem exits naming the file and key."""
    built = _environments(root, pipelines)
    if students:
        _contexts(root, pipelines, built)
        _teachers(root, pipelines)
    return built


def _environments(root: Path, pipelines: dict) -> dict:
    """Build each pipeline's environment now (returned by pipeline name): an unknown factory, an import error or
    a factory that raises is an error naming the key, the module and the cause before any stage runs."""
    from flywheel.agent import load_harness
    from flywheel.envs import EnvironmentLoadError

    built = {}
    for name, cfg in pipelines.items():
        try:
            built[name] = load_harness(cfg.environment, root.resolve()).env
        except EnvironmentLoadError as err:
            fail(f"{root / 'pipelines.yaml'}: pipelines.{name}.{err}")
    return built


def _contexts(root: Path, pipelines: dict, built: dict) -> None:
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
            fail("\n".join(f"{root / 'pipelines.yaml'}: pipelines.{name}: {line}" for line in str(err).splitlines()))
        if choice.auto:
            typer.echo(f"  pipelines.{name}: student {choice.line()}")
        for note in notes:
            typer.secho(f"  warning: pipelines.{name}: {note}", fg=typer.colors.YELLOW)


def _teachers(root: Path, pipelines: dict) -> None:
    """On-policy distillation's local teacher must be a checkpoint folder now, not when the rl stage starts after
    SFT (its tokenizer is compared with the student's there, and a served teacher is probed there)."""
    from flywheel.checkpoints import CheckpointError, load_student

    for name, cfg in pipelines.items():
        opd = cfg.rl.objective.opd  # none unless the objective distils
        if opd is None or opd.base_url:
            continue
        folder = Path(opd.teacher) if Path(opd.teacher).is_absolute() else root / opd.teacher
        try:
            load_student(folder)
        except CheckpointError as err:
            fail(f"{root / 'pipelines.yaml'}: pipelines.{name}.rl.opd.teacher: {err}")


def stale_dvc_yaml(root: Path) -> str | None:
    """Why root/dvc.yaml no longer matches pipelines.yaml and the stage specs, or None (also: no dvc.yaml)."""
    from tasks.spec import dvc_yaml

    path = root / "dvc.yaml"
    if not path.exists() or path.read_text() == dvc_yaml(root):
        return None
    return (f"{path} is out of date with {root / 'pipelines.yaml'} (a pipeline or its collect sources changed, or "
            "the stages' code deps did), so `dvc repro` would track the wrong inputs; regenerate it: "
            "python -m tasks.spec > dvc.yaml")
