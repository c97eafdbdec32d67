"""The source of rollout work: which tasks each learner step trains on, and the seed they are sampled with.

Work for step s depends only on (seed, s), never on which process runs it or when: a synchronous run and an
asynchronous run with max_staleness 0 sample the same episodes, and a resumed run continues the same stream.

With online difficulty filtering (`rl.difficulty_filter`, as in DAPO and prime-rl) step s's tasks also depend on
the outcomes of the groups learned before step s - max_staleness: a task whose last `filter_window` groups were
all-pass or all-fail gave the learner nothing (equal rewards, no advantage) and is drawn with weight
`filter_weight`. Those outcomes are the rollout rows a checkpoint keeps, so timing never changes which tasks are
drawn and a resumed run draws the same ones.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from flywheel.config import RLConfig
from flywheel.contract import Task


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


def saturated_tasks(rows: list[dict], before_step: int, window: int) -> set[str]:
    """Task ids whose last `window` groups (of steps before `before_step`) were each all-pass or all-fail."""
    groups: dict[tuple[int, int], list[dict]] = {}
    for row in rows:
        if row["step"] < before_step and not row.get("dropped"):
            groups.setdefault((row["step"], row["group"]), []).append(row)
    outcomes: dict[str, list[bool]] = {}  # per task, in step order: whether each group was saturated
    for key in sorted(groups):
        members = groups[key]
        passed = {bool(r["passed"]) for r in members}
        outcomes.setdefault(members[0]["task_id"], []).append(len(passed) == 1)
    return {task for task, seen in outcomes.items() if len(seen) >= window and all(seen[-window:])}


def filtered_work(tasks: list[Task], cfg: RLConfig, step: int, rows: list[dict]) -> Work:
    """Step `step`'s work under difficulty filtering: tasks_per_step distinct tasks, drawn with weights.

    Weighted sampling without replacement (Efraimidis-Spirakis keys log(u) / w) from a generator seeded by
    (seed, step): equal rows give equal draws. Saturated tasks weigh filter_weight (0: drawn only when too few
    others remain), the rest 1.
    """
    if cfg.tasks_per_step > len(tasks):
        raise ValueError(f"rl.tasks_per_step {cfg.tasks_per_step} is more than the {len(tasks)} train tasks: "
                         "difficulty filtering draws distinct tasks per step")
    saturated = saturated_tasks(rows, step - cfg.max_staleness, cfg.filter_window)
    rng = random.Random(f"difficulty-filter:{cfg.seed}:{step}")
    keys = []
    for index, task in enumerate(tasks):
        weight = cfg.filter_weight if task.task_id in saturated else 1.0
        u = rng.random() or 1e-300  # random() may return 0.0; log needs > 0
        keys.append((math.log(u) / weight if weight > 0 else -math.inf, -index))
    chosen = sorted(range(len(tasks)), key=lambda i: keys[i], reverse=True)[:cfg.tasks_per_step]
    return Work(step, [tasks[i] for i in chosen], cfg.seed * 1_000_003 + step)
