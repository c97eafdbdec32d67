"""The stage kernel: how every stage is declared (`stage_task`), starts (`stage_context`) and ends (`done`).

A stage module in tasks/ is then only what that stage does:

    @stage_task()
    def rl(pipeline: str, root: str = ".", parent_run_id: str | None = None) -> StageResult:
        with stage_context("rl", pipeline, root, parent_run_id, params=("rl",)) as stage:
            ...  # read inputs through stage.catalog, call parts of flywheel/, write outputs, log to stage.run
            return stage.done(metrics)

Words: a *stage* is one step of the pipeline (collect ... register), run as a Prefect task; a *task* without
the word stage is a problem the agent solves (flywheel.envs.Task, the `tasks` table).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from prefect import task as prefect_task

from flywheel.agent import Harness, load_harness
from flywheel.config import PipelineConfig, load_pipeline
from flywheel.contract import Environment
from flywheel.data.catalog import Catalog
from flywheel.registry import Run, stage_run
from flywheel.stages import ORDER, StageResult
from flywheel.tags import out_tag
from flywheel.train.students import resolve_student
from tasks.caching import by_content
from tasks.spec import output_hashes


def stage_task(cache_key_fn: Callable | None = None, **options) -> Callable:
    """Make the decorated function the Prefect task of the stage of its name: cached by content, results kept.

    `cache_key_fn` replaces the default key (tasks/caching.py `by_content`); other options (retries, ...) go
    to Prefect's `task`.
    """

    def declare(fn: Callable) -> Callable:
        return prefect_task(name=fn.__name__, cache_key_fn=cache_key_fn or by_content(fn.__name__),
                            persist_result=True, **options)(fn)

    return declare


@dataclass
class StageContext:
    """What a stage runs in: the project root, its pipeline's validated config (loaded once), catalog, MLflow run."""

    name: str
    pipeline: str
    root: Path
    cfg: PipelineConfig
    catalog: Catalog
    run: Run

    @cached_property
    def harness(self) -> Harness:
        """The pipeline's harness: its environment (a built-in or a factory's) under the `environment:` section's
        limits, built on first use (not every stage needs one)."""
        return load_harness(self.cfg.environment, self.root, self.pipeline)

    @property
    def env(self) -> Environment:
        """The pipeline's environment (the harness's)."""
        return self.harness.env

    def done(self, metrics: dict, **fields) -> StageResult:
        """Log the environment's counters, tag the run with each output's content hash (`flywheel.out.<path>`);
        the stage's result.

        `fields` are the stage's own (StageResult.gate, .registration)."""
        harness = self.__dict__.get("harness")  # built only if the stage used it
        counters = harness.env.counters if harness is not None else {}
        if counters:  # tool errors, timeouts, bad returns, judge verdicts it could not parse: env.<counter>
            self.run.metrics({f"env.{key}": value for key, value in counters.items()})
        outputs = output_hashes(self.name, self.pipeline, self.root)
        self.run.tags({out_tag(path): digest for path, digest in outputs.items()})
        return StageResult(self.name, self.run.run_id, metrics, outputs, **fields)


@contextmanager
def stage_context(name: str, pipeline: str, root: str | Path, parent_run_id: str | None,
                  params: tuple[str, ...] = ()) -> Iterator[StageContext]:
    """Load the pipeline's config once, `student.model: auto` resolved, and open the stage's MLflow run (config
    sections `params` logged as its params, with which student and why), nested under `parent_run_id`; the run
    ends FAILED if the stage raises."""
    root_path = Path(root).resolve()
    cfg, student = resolve_student(load_pipeline(pipeline, root_path / "pipelines.yaml"), root_path)
    logged = cfg.model_dump(include=set(params)) if params else {}
    if "student" in logged:
        logged["student"]["chosen"] = student.line()
    with stage_run(root_path, pipeline, name, parent_run_id, logged) as run:
        yield StageContext(name, pipeline, root_path, cfg, Catalog(root_path, pipeline), run)


def stage_by_name(name: str):
    """The Prefect task of stage `name`: the function `name` in tasks/<name>.py."""
    if name not in ORDER:
        raise KeyError(f"unknown stage '{name}' (stages: {', '.join(ORDER)})")
    return getattr(importlib.import_module(f"tasks.{name}"), name)
