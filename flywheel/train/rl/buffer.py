"""The learner's end of the bounded rollout buffer: a step's groups, with stale ones dropped and counted.

Actors put groups into a bounded queue as they finish them (a full queue blocks them). The learner takes the
groups made for its current step; groups of later steps (several actors finish out of order) wait in a stash.
The staleness bound is checked again here, where groups are consumed: a group whose behaviour version is more
than max_staleness behind the learner's is dropped and counted, never trained on.
"""

from __future__ import annotations

import queue as queue_errors
import time
from collections.abc import Callable

from flywheel.train.rl.actor import ActorError
from flywheel.train.rl.batch import Group

_POLL_S = 0.5


class RolloutBuffer:
    """Takes each step's groups from the actors' queue; `check` raises if an actor died."""

    def __init__(self, queue, max_staleness: int, check: Callable[[], None]):
        self.queue, self.max_staleness, self.check = queue, max_staleness, check
        self.stash: dict[int, list[Group]] = {}

    def take(self, step: int, n: int, version: int) -> tuple[list[Group], list[Group], float]:
        """(fresh groups in task order, dropped stale groups, seconds waited) of step `step`'s n groups."""
        started = time.perf_counter()
        while len(self.stash.get(step, [])) < n:
            try:
                item = self.queue.get(timeout=_POLL_S)
            except queue_errors.Empty:
                self.check()
                continue
            if isinstance(item, ActorError):
                raise RuntimeError(f"RL actor {item.actor} failed:\n{item.traceback}")
            self.stash.setdefault(item.step, []).append(item)
        waited = time.perf_counter() - started
        groups = sorted(self.stash.pop(step), key=lambda g: g.index)
        fresh = [g for g in groups if version - g.behaviour_version <= self.max_staleness]
        stale = [g for g in groups if version - g.behaviour_version > self.max_staleness]
        return fresh, stale, waited
