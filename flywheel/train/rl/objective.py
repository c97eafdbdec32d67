"""What the learner learns from (rl.objective): one small class per objective, chosen from the config
(objective_of), never by comparing its name.

    reward (grpo)  group advantages of the task reward; a group of equal rewards carries no signal: skipped
    opd            on-policy distillation: the teacher scores every token the student wrote; every group trains
    reward+opd     both: the reward's group advantage (times rl.opd.reward_coef) beside the teacher's

Each holds what differs between them: whether rewards make advantages (and their weight beside the teacher's),
whether a teacher is loaded to score tokens, whether equal-reward groups are skipped, and the metrics it adds.
The settings live in the config's variant (flywheel.config.Objective); the loop asks the chosen class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from flywheel.config import OPDConfig, OPDObjective, RewardObjective, RewardOPDObjective, RLConfig
from flywheel.train.rl.batch import Group, advantages_of
from flywheel.train.rl.teacher import LocalTeacher, ServerTeacher, load_teacher

_TEACHER_COUNTS = ("teacher_tokens", "teacher_nonfinite_tokens", "teacher_failed_groups")


@dataclass(frozen=True)
class Reward:
    """`reward` (or `grpo`): GRPO-family group advantages of the task reward, no teacher."""

    config: RewardObjective
    skips_equal_groups = True  # equal rewards: no advantage, so the group is not trained on (and counted)

    @property
    def opd(self) -> OPDConfig | None:
        """The teacher's settings: none."""
        return None

    def load_teacher(self, root: str | Path = ".") -> None:
        """The teacher that scores the student's tokens: none."""
        return None

    def advantages(self, group: Group, loss_type: str) -> list[float] | None:
        """The group's reward advantages (None: equal rewards, no signal)."""
        return advantages_of(group, loss_type)

    def metrics(self, stats: dict) -> dict:
        """What a step logs beyond the shared metrics: nothing."""
        return {}

    def summary(self, history: list[dict]) -> dict:
        """What the run summary adds: nothing."""
        return {}


@dataclass(frozen=True)
class Distill:
    """`opd`: the teacher's per-token judgement of the student's own samples is the whole signal, no reward.
    Every group trains (each token has the teacher's signal), equal rewards or not."""

    config: OPDObjective | RewardOPDObjective
    skips_equal_groups = False

    @property
    def opd(self) -> OPDConfig:
        """The teacher's settings (rl.opd)."""
        return self.config.opd

    @property
    def reward_coef(self) -> float:
        """The weight of the group's reward advantage beside the teacher's: none under `opd`."""
        return 0.0

    def load_teacher(self, root: str | Path = ".") -> LocalTeacher | ServerTeacher:
        """The teacher rl.opd names (a checkpoint folder under root, or a server)."""
        return load_teacher(self.opd, root)

    def advantages(self, group: Group, loss_type: str) -> list[float] | None:
        """No reward advantages: the teacher's per-token ones are added in the learner."""
        return None

    def metrics(self, stats: dict) -> dict:
        """The per-token KL to the teacher, and what the teacher could not score."""
        metrics = {"teacher_kl": stats.get("teacher_kl", math.nan),
                   "teacher_logprob": stats.get("teacher_logprob", math.nan),
                   **{key: stats.get(key, 0) for key in _TEACHER_COUNTS}}
        if "teacher_divergence" in stats:  # rl.opd.divergence reverse or forward: the exact KL, the loss's term
            metrics["teacher_divergence"] = stats["teacher_divergence"]
        return metrics

    def summary(self, history: list[dict]) -> dict:
        """The KL to the teacher at the first and last step, and the run's counts of what it could not score."""
        kl = [m["teacher_kl"] for m in history if m.get("teacher_tokens")]
        exact = [m["teacher_divergence"] for m in history if "teacher_divergence" in m]
        summary = {"teacher_divergence_first": exact[0], "teacher_divergence_last": exact[-1]} if exact else {}
        return summary | {"teacher_kl_first": kl[0] if kl else math.nan, "teacher_kl_last": kl[-1] if kl else math.nan,
                          **{key: int(sum(m.get(key, 0) for m in history)) for key in _TEACHER_COUNTS}}


@dataclass(frozen=True)
class RewardAndDistill(Distill):
    """`reward+opd`: the teacher's per-token advantage plus rl.opd.reward_coef times the group's reward advantage
    (zeros where the rewards were equal: such a group still trains on the teacher's signal)."""

    @property
    def reward_coef(self) -> float:
        """rl.opd.reward_coef."""
        return self.opd.reward_coef

    def advantages(self, group: Group, loss_type: str) -> list[float] | None:
        """The group's reward advantages (None: equal rewards)."""
        return advantages_of(group, loss_type)


OBJECTIVES: dict[str, type[Reward] | type[Distill]] = {"reward": Reward, "opd": Distill,
                                                       "reward+opd": RewardAndDistill}


def objective_of(cfg: RLConfig) -> Reward | Distill:
    """The class of rl.objective, holding its settings."""
    return OBJECTIVES[cfg.objective.kind](cfg.objective)
