"""Where the learner's groups come from: its own process (`actors: 0`) or actor processes, and the versions kept.

Both sources give step s's groups made by exactly version max(s - max_staleness, 0), so the loop in
flywheel.train.rl.loop is the same whichever it drives: `take` a step's groups, learn, `publish` the new version.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import torch

from flywheel.agent import Harness
from flywheel.config import RLConfig
from flywheel.train.rl.actor import ActorPool, rollout
from flywheel.train.rl.batch import Group
from flywheel.train.rl.buffer import RolloutBuffer
from flywheel.train.rl.source import Work
from flywheel.train.rl.weights import WeightBoard


def actors_for(cfg: RLConfig) -> int:
    """rl.actors as a number. `auto`: one per rl.actor_devices entry when those are named, 1 under vLLM (which
    runs only in an actor); else 0 where an actor process cannot overlap the learner (max_staleness 0: it waits
    for each version) or the machine has no core to spare for it (2 cores or fewer, or torch allowed 2 threads
    or fewer: there the two only take turns, at the cost of a process; benchmarks/peer_rl.py), and 1 elsewhere."""
    if cfg.actors != "auto":
        return cfg.actors
    if cfg.actor_devices:
        return len(cfg.actor_devices)
    if cfg.generation == "vllm":
        return 1
    if cfg.max_staleness == 0:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 0 if min(cores, torch.get_num_threads()) <= 2 else 1


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the model's weights, kept on the CPU: a GPU holds the live model, not max_staleness + 1 copies."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


class Snapshots:
    """The versions later steps are generated with: the last max_staleness + 1.

    None are kept when max_staleness is 0: the live model is the behaviour policy. A resumed run gets back the
    ones its checkpoint kept (`kept`).
    """

    def __init__(self, max_staleness: int, model: torch.nn.Module, version: int,
                 kept: dict[int, dict[str, torch.Tensor]]):
        self.max_staleness = max_staleness
        self.versions = {**kept, version: snapshot(model)} if max_staleness else {}

    def add(self, model: torch.nn.Module, version: int) -> None:
        """Keep the model as `version`; forget the versions no later step is generated with."""
        if not self.versions:
            return
        self.versions[version] = snapshot(model)
        for old in [v for v in self.versions if v < version - self.max_staleness]:
            del self.versions[old]

    def up_to(self, version: int) -> dict[int, dict[str, torch.Tensor]]:
        """The kept versions no newer than `version` (what a checkpoint after that step holds)."""
        return {v: w for v, w in self.versions.items() if v <= version}


class InProcess:
    """`actors: 0`: the learner generates each step's groups itself, taking turns with learning.

    The same rollouts and weights as actor processes, without the overlap. With max_staleness > 0 an older
    version generates: a second copy of the model holds it.
    """

    def __init__(self, harness: Harness, model: torch.nn.Module, tokenizer, cfg: RLConfig, snapshots: Snapshots,
                 first: int):
        from flywheel.policies.hf import HFPolicy

        self.harness, self.tokenizer, self.cfg, self.snapshots = harness, tokenizer, cfg, snapshots
        self.policy = HFPolicy(copy.deepcopy(model) if cfg.max_staleness else model, tokenizer)
        self.version = first

    def take(self, item: Work, learn_s: float) -> tuple[list[Group], list[Group], float]:
        """(groups, stale groups: none here, seconds spent generating) of step item.step; learn_s: the last step's."""
        started = time.perf_counter()
        need = max(item.step - self.cfg.max_staleness, 0)
        if self.cfg.max_staleness and need != self.version:  # at 0 the live model generates
            self.policy.load_weights(self.snapshots.versions[need])
            self.version = need
        groups = rollout(self.harness, self.policy, self.tokenizer, item, self.cfg, need)
        generate_s = time.perf_counter() - started
        for group in groups:  # the learner is its own actor: it generates, then waits while it learns
            group.actor, group.generate_s = -1, generate_s / len(groups)
            group.idle_s = learn_s / len(groups)
        return groups, [], generate_s

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """Nothing to send: this process generates from the live model or a kept snapshot."""

    def dispatch(self, item: Work, final: bool) -> None:
        """Nothing to send: take() is handed each step's work."""

    def close(self) -> None:
        """Nothing to stop."""


class Actors:
    """`actors: N`: processes generate ahead of the learner, from the weights it publishes on a board."""

    def __init__(self, model_dir: Path, harness: Harness, model: torch.nn.Module, cfg: RLConfig,
                 snapshots: Snapshots, first: int, work: list[Work], device: str, final: bool = True):
        ctx = torch.multiprocessing.get_context("spawn")  # fork with torch threads running is unsafe
        self.cfg, self.env = cfg, harness.env
        self.board = WeightBoard(model.state_dict(), ctx, slots=cfg.max_staleness + 1)
        for held in sorted(snapshots.versions):
            self.board.publish(snapshots.versions[held], held)
        self.board.publish(model.state_dict(), first)
        # Room for every group the staleness bound lets the actors make ahead of the learner.
        size = (cfg.max_staleness + 1) * cfg.tasks_per_step * cfg.actors
        self.pool = ActorPool(cfg.actors, Path(model_dir), harness, cfg, self.board, ctx, size, device)
        self.pool.start(work, final)
        self.buffer = RolloutBuffer(self.pool.buffer, cfg.max_staleness, self.pool.check)

    def take(self, item: Work, learn_s: float) -> tuple[list[Group], list[Group], float]:
        """(fresh groups, stale groups dropped, seconds waited) of step item.step, the learner's version."""
        fresh, stale, waited = self.buffer.take(item.step, self.cfg.tasks_per_step, item.step)
        for group in fresh + stale:  # the actors' tool errors etc. join the stage's counters
            for key, n in (group.env_counts or {}).items():
                self.env.count(key, n)
        return fresh, stale, waited

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """Put the learner's new weights on the board for the actors."""
        self.board.publish(model.state_dict(), version)

    def dispatch(self, item: Work, final: bool) -> None:
        """Queue one more step's work for the actors; final: it is the run's last."""
        self.pool.dispatch(item)
        if final:
            self.pool.finish()

    def close(self) -> None:
        """Stop the actor processes."""
        self.pool.close()
