"""Bootstrap intervals: one mean, and the mean difference of two models scored on the same tasks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class Interval(NamedTuple):
    """A point estimate and its (1 - alpha) percentile interval."""

    estimate: float
    low: float
    high: float


def _percentile_interval(values: np.ndarray, n: int, alpha: float, seed: int) -> Interval:
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"need a non-empty flat array of values, got shape {values.shape}")
    if not np.isfinite(values).all():
        raise ValueError("values contain NaN or infinity")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, values.size, size=(n, values.size))
    means = values[idx].mean(axis=1)
    low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return Interval(float(values.mean()), float(low), float(high))


def bootstrap_mean(values: Sequence[float], *, n: int = 2000, alpha: float = 0.05, seed: int = 0) -> Interval:
    """The mean of values and its bootstrap percentile interval from n resamples."""
    return _percentile_interval(np.asarray(values, dtype=np.float64), n, alpha, seed)


def paired_bootstrap(a: Sequence[float], b: Sequence[float], *, n: int = 2000, alpha: float = 0.05,
                     seed: int = 0) -> Interval:
    """mean(a - b) over paired items and its bootstrap interval; pairing takes task difficulty out."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired values need equal shapes, got {a.shape} and {b.shape}")
    return _percentile_interval(a - b, n, alpha, seed)
