"""Progress of a long stage: every step's metrics to its MLflow run, a line on stdout about every tenth."""

from __future__ import annotations

import time
from collections.abc import Callable

from flywheel.registry import Run


def progress(run: Run, stage: str, total: int, headline: str) -> Callable[[int, dict], None]:
    """A per-step callback: every metric to the stage's MLflow run, a progress line about every tenth."""
    started = time.monotonic()
    every = max(total // 10, 1)
    next_line = every

    def on_step(step: int, values: dict) -> None:
        nonlocal next_line
        run.metrics(values, step=step)
        if step >= next_line or step == total:
            next_line = step + every
            elapsed = time.monotonic() - started
            eta = elapsed / max(step, 1) * (total - step)
            print(f"      {stage} step {step}/{total}  {headline} {values.get(headline, float('nan')):.3f}"
                  f"  {elapsed:.0f}s elapsed, ~{eta:.0f}s left", flush=True)

    return on_step
