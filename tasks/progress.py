"""Progress of a long stage: every step's metrics to its MLflow run, a line on stdout about every tenth, and at
the end the learning curve as a PNG of the run."""

from __future__ import annotations

import time
from collections.abc import Callable

from flywheel import plots
from flywheel.agent import Episode
from flywheel.config import TeacherConfig
from flywheel.metrics import CURVES
from flywheel.registry import Run
from flywheel.synthesis import episode_tokens


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


class Meter:
    """Progress of the sampling: a bar line about every tenth (rate, passed fraction, ETA, tokens, cost)."""

    def __init__(self, run: Run, total: int, teacher: TeacherConfig):
        self.run, self.total = run, total
        self.prices = (teacher.price_input_per_mtok, teacher.price_output_per_mtok)
        self.done = self.passed = self.tokens_in = self.tokens_out = 0
        self.started = time.monotonic()
        self.every = max(total // 10, 1)
        self.next_line = self.every

    def cost(self, tokens_in: int, tokens_out: int) -> float:
        return (tokens_in * self.prices[0] + tokens_out * self.prices[1]) / 1e6

    def update(self, episodes: list[Episode]) -> None:
        self.done += len(episodes)
        self.passed += sum(e.passed for e in episodes)
        self.tokens_in += sum(episode_tokens(e, "prompt_tokens") for e in episodes)
        self.tokens_out += sum(episode_tokens(e, "completion_tokens") for e in episodes)
        if self.done < self.next_line and self.done < self.total:
            return
        self.next_line = (self.done // self.every + 1) * self.every
        values = self.totals() | {"passed_fraction": self.passed / max(self.done, 1)}
        eta = (self.total - self.done) / max(values["samples_per_s"], 1e-9)
        bar = "#" * round(20 * self.done / max(self.total, 1))
        print(f"      synthesize [{bar:<20}] {self.done}/{self.total} samples  {values['samples_per_s']:.1f}/s"
              f"  passed {values['passed_fraction']:.2f}  ~{eta:.0f}s left  tokens {self.tokens_in} in / "
              f"{self.tokens_out} out  ${values['cost_usd']:.4f}", flush=True)
        self.run.metrics({f"progress/{k}": v for k, v in values.items()} | {"progress/samples": self.done},
                         step=self.done)

    def totals(self) -> dict:
        """Rate, tokens and cost so far (cached answers count their original tokens: the data's cost)."""
        elapsed = max(time.monotonic() - self.started, 1e-9)
        return {"samples_per_s": self.done / elapsed, "tokens_in": self.tokens_in, "tokens_out": self.tokens_out,
                "cost_usd": self.cost(self.tokens_in, self.tokens_out)}


def curve_png(run_id: str, stage: str) -> bytes | None:
    """A training stage's learning curve (SFT loss, RL mean reward) over steps, from its run; None if not logged."""
    points = Run(run_id).history(CURVES[stage])
    if not points:
        return None
    return plots.curves({stage: points}, f"{stage}: {CURVES[stage]} per step", CURVES[stage])


def log_curve(run: Run, stage: str) -> None:
    """Keep the stage's learning curve with its run, as plots/<stage>_<metric>.png."""
    image = curve_png(run.run_id, stage)
    if image is not None:
        run.image(image, f"plots/{stage}_{CURVES[stage]}.png")
