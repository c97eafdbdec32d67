"""The pictures people look at, as PNG bytes: held-out reward per slice and model, a learning curve over steps.

matplotlib (pinned) draws them off screen (the Agg backend); the same bytes become a run's artifact, an image in
the Prefect markdown artifact (a data URI) and a figure in `flywheel compare --html`.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence


def pyplot():
    """matplotlib's pyplot on the Agg backend: no display is ever needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png(fig, dpi: int = 90) -> bytes:
    """The figure as PNG bytes; the figure is closed."""
    plt = pyplot()
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    return buffer.getvalue()


def data_uri(image: bytes) -> str:
    """A PNG as a data URI, for markdown or HTML that must carry its images inside."""
    return "data:image/png;base64," + base64.b64encode(image).decode()


def slice_bars(scores: Sequence[dict], title: str) -> bytes:
    """Bars of held-out mean reward per slice, one colour per model in the order given (null, base, sft, rl,
    champion...), each with its interval. `scores`: records with model, slice, score, low and high."""
    plt = pyplot()
    slices = list(dict.fromkeys(s["slice"] for s in scores))
    models = list(dict.fromkeys(s["model"] for s in scores))
    by = {(s["model"], s["slice"]): s for s in scores}
    width = 0.8 / max(len(models), 1)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(slices) + 2), 3.5))
    for i, model in enumerate(models):
        found = [by.get((model, name)) for name in slices]
        heights = [s["score"] if s else 0.0 for s in found]
        errors = [[max(s["score"] - (s["low"] if s["low"] is not None else s["score"]), 0) if s else 0 for s in found],
                  [max((s["high"] if s["high"] is not None else s["score"]) - s["score"], 0) if s else 0
                   for s in found]]
        ax.bar([j + i * width for j in range(len(slices))], heights, width, yerr=errors, capsize=3, label=model)
    ax.set_xticks([j + width * (len(models) - 1) / 2 for j in range(len(slices))], slices)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("held-out mean reward")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return png(fig)


def curves(lines: dict[str, Sequence[tuple[int, float]]], title: str, ylabel: str) -> bytes:
    """One line per name over steps (a training curve; several runs' curves side by side)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for name, points in lines.items():
        ordered = sorted(points)
        ax.plot([s for s, _ in ordered], [v for _, v in ordered], marker="." if len(ordered) < 30 else None,
                label=name)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(lines) > 1:
        ax.legend(fontsize=8)
    return png(fig)
