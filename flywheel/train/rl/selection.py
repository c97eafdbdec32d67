"""Early stopping for RL: keep the policy version that does best on a validation sample of train tasks.

RL on a small student often improves a hard slice for a while and then unlearns an easy one (docs/rl.md: "RL that
pays for itself"); the last version is then worse than one on the way. With `rl.keep_best`, the first
`validate_tasks` train tasks by task id are set aside (RL never draws them), every `validate_every` steps and
before the first the live policy answers them greedily, and the run's output is the best version: most passed,
then the higher mean reward, then the earlier. Version 0 is the starting checkpoint, so a run whose RL never
beats it on validation returns it unchanged. Greedy decoding draws no random numbers: validating changes nothing
the run learns. The held-out tasks are never used here: they stay the gate's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from flywheel.agent import Harness
from flywheel.config import RLConfig
from flywheel.contract import Task
from flywheel.policies.base import Sampling

VALIDATION_PASS = "validation_pass"  # per check: share of the validation sample the rubric passes
VALIDATION_REWARD = "validation_reward"  # per check: its mean reward


def validation_split(tasks: list[Task], cfg: RLConfig) -> tuple[list[Task], list[Task]]:
    """(the validation sample, the tasks RL draws from): the first validate_tasks by task id (at most half of
    them), and the rest in their order; with keep_best off, no sample and every task."""
    if not cfg.keep_best:
        return [], tasks
    wanted = min(cfg.validate_tasks, len(tasks) // 2)  # at most half: RL keeps the rest to learn from
    if wanted < 1:
        raise ValueError(f"rl.keep_best sets train tasks aside for validation, but there are only {len(tasks)}: "
                         "add train tasks or set rl.keep_best: false")
    held = {t.task_id for t in sorted(tasks, key=lambda t: t.task_id)[:wanted]}
    return [t for t in tasks if t.task_id in held], [t for t in tasks if t.task_id not in held]


@dataclass
class Selection:
    """The validation checks so far and the best version's weights (on the CPU)."""

    harness: Harness
    tasks: list[Task]
    cfg: RLConfig
    checks: list[dict] = field(default_factory=list)
    best_state: dict[str, torch.Tensor] | None = None

    @property
    def best(self) -> dict | None:
        """The best check so far: most passed, then the higher mean reward, then the earlier version."""
        return max(self.checks, key=lambda c: (c[VALIDATION_PASS], c[VALIDATION_REWARD], -c["version"]),
                   default=None)

    def due(self, version: int) -> bool:
        """Whether version `version` is validated: the first, every validate_every-th, and the last."""
        return bool(self.tasks) and (version % self.cfg.validate_every == 0 or version == self.cfg.steps)

    def check(self, version: int, policy, model: torch.nn.Module) -> dict:
        """Validate `policy` (version `version`, the learner's `model`); keep its weights if it is the best."""
        episodes = self.harness.run(policy, self.tasks, samples=1, sampling=Sampling(temperature=0.0))
        check = {"version": version, VALIDATION_PASS: float(np.mean([bool(e.passed) for e in episodes])),
                 VALIDATION_REWARD: float(np.mean([e.reward for e in episodes]))}
        self.checks.append(check)
        if self.best is check:
            self.best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        return {VALIDATION_PASS: check[VALIDATION_PASS], VALIDATION_REWARD: check[VALIDATION_REWARD],
                "best_version": self.best["version"]}

    def restore(self, model: torch.nn.Module) -> int:
        """Load the best version's weights into `model` (the learner's last); the version kept."""
        best = self.best
        if best is None:
            raise RuntimeError("rl.keep_best: no version was validated")
        if best["version"] != self.checks[-1]["version"]:
            model.load_state_dict(self.best_state)
        return best["version"]

    def summary(self) -> dict:
        """The run's validation numbers for its summary."""
        if not self.checks:
            return {}
        best = self.best
        return {"best_version": best["version"], f"{VALIDATION_PASS}_best": best[VALIDATION_PASS],
                f"{VALIDATION_REWARD}_best": best[VALIDATION_REWARD],
                f"{VALIDATION_PASS}_first": self.checks[0][VALIDATION_PASS],
                f"{VALIDATION_REWARD}_first": self.checks[0][VALIDATION_REWARD],
                f"{VALIDATION_PASS}_last": self.checks[-1][VALIDATION_PASS], "validation_tasks": len(self.tasks)}
