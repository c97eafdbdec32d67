"""Prefect cache keys from content: a stage reruns when its inputs, config section or code change, never else."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from flywheel.config import PipelineConfig, load_pipeline
from tasks.spec import input_key


def by_content(stage: str, extra: Callable[[str, Path, PipelineConfig], str] | None = None) -> Callable:
    """A cache_key_fn for the stage; `extra` adds state outside the files (e.g. the current champion)."""

    def key(context, parameters: dict) -> str:
        root = Path(parameters.get("root") or ".").resolve()
        pipeline = parameters["pipeline"]
        cfg = load_pipeline(pipeline, root / "pipelines.yaml")  # once per key, for every part of it
        base = input_key(stage, pipeline, root, cfg)
        return f"{stage}-{base}" + (f"-{extra(pipeline, root, cfg)}" if extra else "")

    return key
