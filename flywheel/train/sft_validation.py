"""SFT's validation slice: train tasks set aside to pick the checkpoint, never held-out ones.

With few tasks (tens to hundreds) the right length of SFT is not known in advance: too short and a pretrained
student has not learned the format, too long and it over-fits a few conversations. So `sft.validation_tasks` train
tasks (a count, or a fraction below 1) are chosen by a seeded hash of their group (every attempt at one scenario
together) or id, their conversations are left out of SFT's data, and at each validation point (each epoch's end,
or every `sft.validate_every` steps, and the last step) the live student answers them greedily through the
harness, as evaluate does. The run's output is the point with the best pass rate (ties: the higher mean reward,
then the later step). The held-out tasks stay the gate's: this module never sees them.

A run resumed from a checkpoint knows only the points of its own session.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

from flywheel.config import SFTConfig
from flywheel.contract import Task
from flywheel.metrics import SFT_VAL_PASS_RATE, SFT_VAL_REWARD

# (the live model, its tokenizer) -> (pass rate, mean reward) on the validation tasks
Validate = Callable[[object, object], tuple[float, float]]


def _rank(seed: int, key: str) -> bytes:
    return hashlib.sha256(f"{seed}:{key}".encode()).digest()


def validation_slice(tasks: list[Task], cfg: SFTConfig) -> list[Task]:
    """The train tasks set aside for validation (sft.validation_tasks of them, at least one left to train on):
    whole groups, ranked by a hash of (sft.seed, group or id), so the same tasks on every rerun. Raises
    ValueError for a held-out task, which must never be in it."""
    heldout = [t.task_id for t in tasks if t.split != "train"]
    if heldout:
        raise ValueError(f"validation_slice takes train tasks only; got held-out {heldout[:3]}")
    wanted = int(cfg.validation_tasks) if cfg.validation_tasks >= 1 else round(cfg.validation_tasks * len(tasks))
    wanted = min(wanted, len(tasks) - 1)
    if wanted <= 0:
        return []
    groups: dict[str, list[Task]] = {}
    for task in tasks:
        groups.setdefault(task.group or task.task_id, []).append(task)
    chosen: list[Task] = []
    for key in sorted(groups, key=lambda k: _rank(cfg.seed, k)):
        if len(chosen) >= wanted:
            break
        if len(chosen) + len(groups[key]) < len(tasks):  # a group that would leave nothing to train is skipped
            chosen += groups[key]
    return sorted(chosen, key=lambda t: t.task_id)


def validation_steps(cfg: SFTConfig, n_examples: int, total: int) -> list[int]:
    """The steps validated: every validate_every steps (default: each epoch's end) and the last."""
    every = cfg.validate_every or cfg.steps_per_epoch(n_examples)
    return sorted({*range(every, total + 1, every), total})


@dataclass
class Selection:
    """The validation points so far and the best one's trainable weights (on the CPU)."""

    points: list[dict] = field(default_factory=list)
    best_state: dict | None = None

    @property
    def best(self) -> dict | None:
        """Most passed, then the higher mean reward, then the later step."""
        return max(self.points, key=lambda p: (p[SFT_VAL_PASS_RATE], p[SFT_VAL_REWARD], p["step"]), default=None)

    def add(self, step: int, pass_rate: float, reward: float, model) -> dict:
        """Record a point; keep the model's trainable weights if it is the best so far."""
        point = {"step": step, SFT_VAL_PASS_RATE: pass_rate, SFT_VAL_REWARD: reward}
        self.points.append(point)
        if self.best is point:
            self.best_state = {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()
                               if p.requires_grad}
        return point

    def restore(self, model) -> int | None:
        """Put the best point's weights back into `model` (trained past it); the step kept (None: no points)."""
        best = self.best
        if best is None:
            return None
        if best["step"] != self.points[-1]["step"]:
            import torch

            params = dict(model.named_parameters())
            with torch.no_grad():
                for name, value in self.best_state.items():
                    params[name].copy_(value.to(params[name].device))
        return best["step"]

    def summary(self) -> dict:
        """The numbers the sft run reports of its validation."""
        best = self.best
        if best is None:
            return {}
        return {"sft.val_kept_step": best["step"], "sft.val_pass_rate_kept": best[SFT_VAL_PASS_RATE],
                "sft.val_reward_kept": best[SFT_VAL_REWARD], "sft.val_points": len(self.points),
                "sft.val_pass_rate_last": self.points[-1][SFT_VAL_PASS_RATE]}
