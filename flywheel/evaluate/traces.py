"""The scored episodes of an eval as MLflow traces linked to its run (flywheel/tracing.py, docs/traces.md)."""

from __future__ import annotations

from collections.abc import Mapping

from flywheel import tracing
from flywheel.agent import Episode
from flywheel.contract import Environment
from flywheel.evaluate.runner import Scored
from flywheel.registry import Run


def chosen(scored: Scored, cap: int) -> list[Episode]:
    """The episodes traced of one model: at most `cap`, its failed episodes first, each group in table order."""
    return sorted(scored.episodes, key=lambda e: e.passed)[:cap]


def log_traces(scored: Mapping[str, Scored], run: Run, pipeline: str, env: Environment, cap: int,
               kind: str = "evaluate") -> int:
    """Write up to `cap` traces per model (held-out episodes, failed first) to the run's experiment, linked to
    the run; how many were written."""
    if cap <= 0:
        return 0
    entries = [(label, episode, {}) for label, s in scored.items() for episode in chosen(s, cap)]
    return tracing.log_episodes(entries, run, pipeline, env, kind, split="heldout")
