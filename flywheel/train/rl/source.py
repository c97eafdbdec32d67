"""The source of rollout work: which tasks each learner step trains on, and the seed they are sampled with.

Work for step s depends only on (seed, s), never on which process runs it or when: a synchronous run and an
asynchronous run with max_staleness 0 sample the same episodes, and a resumed run continues the same stream.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass

from flywheel.envs.base import Task


@dataclass(frozen=True)
class Work:
    """One learner step's rollouts to make: G samples of each task, sampled with this seed."""

    step: int
    tasks: list[Task]
    seed: int


def task_stream(tasks: list[Task], seed: int) -> Iterator[Task]:
    """The tasks in a seeded order, reshuffled each time the list runs out."""
    if not tasks:
        raise ValueError("train_rl needs at least one task")
    rng = random.Random(seed)
    while True:
        order = list(tasks)
        rng.shuffle(order)
        yield from order


def work_items(tasks: list[Task], tasks_per_step: int, seed: int, start: int, stop: int) -> list[Work]:
    """The work of steps start..stop-1, taken from the same seeded stream whatever `start` is."""
    stream = task_stream(tasks, seed)
    for _ in itertools.islice(stream, start * tasks_per_step):
        pass
    return [Work(step, list(itertools.islice(stream, tasks_per_step)), seed * 1_000_003 + step)
            for step in range(start, stop)]
