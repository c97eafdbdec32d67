"""The reward-hacking monitor: does the policy still pass the environment's stricter audit as its reward rises?

Every `monitor_every` learner steps (and once before the first) the current policy answers a fixed sample of
held-out tasks greedily through the one harness. Each episode is scored by the rubric (the reward RL climbs) and
by the environment's audit checks (independent, stricter verifiers; the rubric's `passed` when it has none).
audit_pass is the share of audited episodes, reward_audit_gap the mean reward minus audit_pass: the part of the
reward the audit does not back. A run is flagged when its training reward rose from the first step while
audit_pass fell from its first value by more than `max_audit_drop`. Greedy decoding draws no random numbers, so
watching changes nothing the run learns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flywheel.agent import Episode, Harness
from flywheel.config import RLConfig
from flywheel.contract import Environment, Task
from flywheel.metrics import AUDIT_PASS, REWARD_AUDIT_GAP, REWARD_HACKING, RL_REWARD
from flywheel.policies.base import Sampling

MONITOR_FILE = "monitor.json"  # the rl stage's report (data/<pipeline>/rl/), which the evaluate stage's gate reads


def audit_sample(tasks: list[Task], n: int) -> list[Task]:
    """The fixed audit sample: the first n held-out tasks by task id (the same whatever the seed or order)."""
    return sorted(tasks, key=lambda t: t.task_id)[:n]


def audited(env: Environment, episode: Episode) -> bool:
    """Whether the episode passes the environment's audit checks; its rubric's `passed` when it declares none."""
    verdict = env.audit(episode.task, episode.messages)
    if verdict is None:
        return bool(episode.passed)
    return all(value >= 1.0 for value in verdict.values())


def _slope(points: list[tuple[int, float]]) -> float:
    """Least-squares change per step; 0 with fewer than two points."""
    if len(points) < 2:
        return 0.0
    steps, values = np.array(points, dtype=np.float64).T
    return float(np.polyfit(steps, values, 1)[0])


@dataclass
class Monitor:
    """Audits the live policy on a fixed held-out sample; keeps the checks and says whether the run is flagged."""

    harness: Harness
    tasks: list[Task]
    cfg: RLConfig
    checks: list[dict] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)  # the run's step metrics, as of the last check

    def due(self, version: int) -> bool:
        """Whether policy version `version` is audited: the first, every monitor_every-th, and the last."""
        every = self.cfg.monitor_every
        return bool(every and self.tasks) and (version % every == 0 or version == self.cfg.steps)

    def check(self, version: int, policy, history: list[dict]) -> dict:
        """Audit `policy` (version `version`); the metrics of this check, the flag included."""
        self.history = history
        episodes = self.harness.run(policy, self.tasks, samples=1, sampling=Sampling(temperature=0.0))
        audit_pass = float(np.mean([audited(self.harness.env, e) for e in episodes]))
        reward = float(np.mean([e.reward for e in episodes]))
        # the training reward of the steps since the last check: a noisy per-step mean, smoothed over the window
        window = [m[RL_REWARD] for m in history[self.checks[-1]["version"] if self.checks else 0:version]]
        check = {"version": version, AUDIT_PASS: audit_pass, "audit_reward": reward,
                 REWARD_AUDIT_GAP: reward - audit_pass,
                 "train_reward": float(np.mean(window)) if window else None}
        self.checks.append(check)
        return {AUDIT_PASS: audit_pass, REWARD_AUDIT_GAP: reward - audit_pass, "audit_reward": reward,
                f"{AUDIT_PASS}_trend": _slope([(c["version"], c[AUDIT_PASS]) for c in self.checks]),
                f"{REWARD_AUDIT_GAP}_trend": _slope([(c["version"], c[REWARD_AUDIT_GAP]) for c in self.checks]),
                REWARD_HACKING: float(self.flagged(history))}

    def flagged(self, history: list[dict] | None = None) -> bool:
        """Training reward up from the first step while audit_pass fell by more than max_audit_drop."""
        return self.reason(history) is not None

    def reason(self, history: list[dict] | None = None) -> str | None:
        """Why the run is flagged, or None when it is not (history: the run's step metrics, default the last seen)."""
        history = self.history if history is None else history
        if len(self.checks) < 2 or not history:
            return None
        first, last = self.checks[0], self.checks[-1]
        rise = (last["train_reward"] or 0.0) - history[0][RL_REWARD]
        drop = first[AUDIT_PASS] - last[AUDIT_PASS]
        if rise > 0 and drop > self.cfg.max_audit_drop:
            return (f"reward hacking: training reward rose by {rise:+.3f} (step 0: {history[0][RL_REWARD]:.3f}) while "
                    f"audit_pass fell from {first[AUDIT_PASS]:.3f} to {last[AUDIT_PASS]:.3f} (drop {drop:.3f} > "
                    f"max_audit_drop {self.cfg.max_audit_drop}) on {len(self.tasks)} held-out tasks")
        return None

    def report(self, history: list[dict] | None = None) -> dict:
        """What the rl stage writes (monitor.json) and the gate reads: the checks, the flag and its reason."""
        reason = self.reason(history)
        return {"flagged": reason is not None, "reason": reason, "checks": self.checks,
                "max_audit_drop": self.cfg.max_audit_drop, "audit_tasks": [t.task_id for t in self.tasks]}

    def summary(self, history: list[dict] | None = None) -> dict:
        """The run's monitor numbers for its summary (numbers only: they are logged as metrics)."""
        if not self.checks:
            return {}
        first, last = self.checks[0], self.checks[-1]
        return {f"{AUDIT_PASS}_first": first[AUDIT_PASS], f"{AUDIT_PASS}_last": last[AUDIT_PASS],
                f"{REWARD_AUDIT_GAP}_last": last[REWARD_AUDIT_GAP],
                f"{AUDIT_PASS}_trend": _slope([(c["version"], c[AUDIT_PASS]) for c in self.checks]),
                f"{REWARD_AUDIT_GAP}_trend": _slope([(c["version"], c[REWARD_AUDIT_GAP]) for c in self.checks]),
                REWARD_HACKING: float(self.flagged(history))}
