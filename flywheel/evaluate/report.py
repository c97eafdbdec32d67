"""What the gate looked at, for people: per-slice scores with bootstrap intervals, and their plot."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from flywheel.config import GateConfig
from flywheel.evaluate.stats import bootstrap_mean


def slice_scores(table: pd.DataFrame, gate: GateConfig, models: tuple[str, ...] = ("rl", "champion")) -> pd.DataFrame:
    """Mean reward per (model, slice) with its bootstrap interval over tasks, for the models present."""
    rows = []
    for model in models:
        frame = table[table["model"] == model]
        for name, part in [("all", frame), *frame.groupby("slice", sort=True)]:
            if part.empty:
                continue
            by_task = part.groupby("task_id")["reward"].mean().to_numpy(dtype=float)
            est = bootstrap_mean(by_task, n=gate.bootstrap_samples, alpha=1 - gate.confidence, seed=gate.seed)
            rows.append({"model": model, "slice": str(name), "score": est.estimate, "low": est.low,
                         "high": est.high, "tasks": len(by_task)})
    return pd.DataFrame(rows, columns=["model", "slice", "score", "low", "high", "tasks"])


def plot_slices(scores: pd.DataFrame, path: Path, title: str) -> Path | None:
    """A bar chart of per-slice scores with their intervals as PNG; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    slices = list(dict.fromkeys(scores["slice"]))
    models = list(dict.fromkeys(scores["model"]))
    width = 0.8 / max(len(models), 1)
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(slices) + 2), 3.5))
    for i, model in enumerate(models):
        part = scores[scores["model"] == model].set_index("slice").reindex(slices)
        xs = [j + i * width for j in range(len(slices))]
        errors = [(part["score"] - part["low"]).clip(lower=0).fillna(0),
                  (part["high"] - part["score"]).clip(lower=0).fillna(0)]
        ax.bar(xs, part["score"].fillna(0), width, yerr=errors, capsize=3, label=model)
    ax.set_xticks([j + width * (len(models) - 1) / 2 for j in range(len(slices))], slices)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("held-out reward")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
