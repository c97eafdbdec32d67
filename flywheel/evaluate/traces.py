"""The scored episodes of an eval as MLflow traces linked to its run (flywheel/tracing.py, docs/traces.md)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from flywheel import tracing
from flywheel.contract import Environment
from flywheel.evaluate.runner import Scored
from flywheel.registry import Run
from flywheel.tags import TRACES_ERROR_TAG

log = logging.getLogger(__name__)


def chosen(scored: Scored, cap: int) -> list:
    """The episodes traced of one model: at most `cap`, its failed episodes first, each group in table order."""
    return sorted(scored.episodes, key=lambda e: e.passed)[:cap]


def log_traces(scored: Mapping[str, Scored], run: Run, pipeline: str, env: Environment, cap: int,
               kind: str = "evaluate") -> int:
    """Write up to `cap` traces per model to the run's experiment, linked to the run; how many were written.

    Traces say how episodes went; they decide nothing. A store that refuses them is a warning and the run's tag
    `flywheel.traces_error`, never a failed stage."""
    if cap <= 0:
        return 0
    tools = env.tools()
    pending = [tracing.episode_trace(episode, model=label, tools=tools, kind=kind, pipeline=pipeline,
                                     rubric=env.name)
               for label, s in scored.items() for episode in chosen(s, cap)]
    try:
        written = tracing.write(pending, run_id=run.run_id)
    except Exception as err:  # noqa: BLE001 -- a tracking store's errors vary; the eval's numbers stand
        log.warning("the %s run %s: its episodes' traces were not written: %s: %s", kind, run.run_id,
                    type(err).__name__, err)
        run.tags({TRACES_ERROR_TAG: f"{type(err).__name__}: {err}"[:5000]})
        return 0
    run.metrics({"traces": len(written)})
    return len(written)
