"""Group-normalised advantages: each task's G samples are scored against each other, not against a critic."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

AdvantageKind = Literal["grpo", "dr_grpo"]

# Rewards closer than this count as equal: such a group carries no learning signal.
_ZERO_VARIANCE = 1e-8


def group_advantages(rewards: Sequence[float], kind: AdvantageKind = "grpo",
                     eps: float = 1e-6) -> list[float] | None:
    """Advantages of one group's rewards, or None when they are all equal (the caller skips and counts it)."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size < 2:
        raise ValueError(f"a group needs at least 2 rewards in a flat list, got shape {r.shape}")
    if not np.isfinite(r).all():
        raise ValueError(f"group rewards must be finite, got {r.tolist()}")
    std = r.std()  # population std, as GRPO normalises within the group it has
    if std < _ZERO_VARIANCE:
        return None
    centred = r - r.mean()
    if kind == "grpo":
        return (centred / (std + eps)).tolist()
    if kind == "dr_grpo":
        # Dr. GRPO drops the std division: it biases learning towards easy/hard groups of low variance.
        return centred.tolist()
    raise ValueError(f"unknown advantage kind '{kind}' (known: grpo, dr_grpo)")
