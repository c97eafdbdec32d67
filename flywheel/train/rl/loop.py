"""The RL loop: actors roll out scored groups with a policy snapshot while the learner steps and publishes.

    source (work per step) -> actors (processes: episodes, rubric, encode) -> bounded buffer -> learner
    learner: drop stale groups, group advantages, clipped loss with truncated IS, step, publish weights

Step s's rollouts are made by exactly policy version max(s - max_staleness, 0), whichever process makes them and
whenever: `max_staleness: 0` is the synchronous baseline on the same code (an actor starts step s's work only once
version s is published, so it waits while the learner steps), and an asynchronous run is as reproducible as a
synchronous one. `actors: 0` generates in the learner's own process, taking turns with learning: the same
rollouts and weights as actor processes, without the overlap (the reference the tests compare against).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from flywheel.config import RLConfig
from flywheel.envs.base import Environment, Task
from flywheel.metrics import RL_LAST_REWARD, RL_REWARD
from flywheel.train.rl.actor import ActorPool, rollout
from flywheel.train.rl.batch import Group, advantages_of, collate, samples_of
from flywheel.train.rl.buffer import RolloutBuffer
from flywheel.train.rl.checkpoints import Checkpoints, fingerprint
from flywheel.train.rl.learner import learn_on_batch
from flywheel.train.rl.source import task_stream, work_items
from flywheel.train.rl.weights import WeightBoard

__all__ = ["task_stream", "train_rl"]


def _rows(step: int, version: int, groups: list[Group], advantages: dict[int, list[float] | None],
          dropped: set[int]) -> list[dict]:
    rows = []
    for group in groups:
        adv = advantages.get(group.index)
        for i, r in enumerate(group.rollouts):
            rows.append({"step": step, "policy_version": version, "behaviour_version": group.behaviour_version,
                         "task_id": r.task_id, "group": group.index, "sample": r.sample, "reward": r.reward,
                         "advantage": None if adv is None else float(adv[i]), "tokens": r.tokens,
                         "passed": r.passed, "dropped": group.index in dropped, "split": r.split})
    return rows


def train_rl(model_dir: Path, env: Environment, tasks: list[Task], cfg: RLConfig, out_dir: Path,
             max_turns: int, on_step: Callable[[int, dict], None] | None = None,
             checkpoint_dir: Path | None = None, device: str = "auto") -> tuple[list[dict], dict]:
    """GRPO-family RL from the checkpoint in model_dir; saves to out_dir; returns (rollout rows, summary).

    Checkpoints go to checkpoint_dir (default: `rl-checkpoints` beside out_dir); a killed run resumes there.
    device: the learner's (student.device; auto: CUDA when present); each actor's is cfg.actor_devices[i] or it.
    """
    from flywheel.devices import resolve_device
    from flywheel.policies.hf import HFPolicy
    from flywheel.train.checkpoint import load_student, save_student

    learner_device = resolve_device(device, "student.device (the RL learner)")
    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.learner_threads)
    checkpoints = Checkpoints(checkpoint_dir or Path(out_dir).parent / "rl-checkpoints",
                              fingerprint(Path(model_dir), tasks, cfg, env.name, max_turns))
    resumed = checkpoints.latest()
    first = resumed.step if resumed else 0
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_student(resumed.model_dir if resumed else model_dir)
    model.to(learner_device)
    reference = load_student(model_dir)[0].to(learner_device) if cfg.kl_beta > 0 else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    shuffle = torch.Generator().manual_seed(cfg.seed)
    rows, history = [], []
    if resumed:
        optimizer.load_state_dict(resumed.optimizer)
        shuffle.set_state(resumed.shuffle)
        rows, history = resumed.rows, resumed.history
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    work = work_items(tasks, cfg.tasks_per_step, cfg.seed, first, cfg.steps)
    # The versions later steps are generated with: the last max_staleness + 1 (none kept when it is 0: the live
    # model is the behaviour policy). A resumed run gets back the ones its checkpoint kept.
    recent = ({**(resumed.behaviour if resumed else {}), first: _snapshot(model)} if cfg.max_staleness else {})

    pool = None
    if cfg.actors:
        ctx = torch.multiprocessing.get_context("spawn")  # fork with torch threads running is unsafe
        board = WeightBoard(model.state_dict(), ctx, slots=cfg.max_staleness + 1)
        for held in sorted(recent):
            board.publish(recent[held], held)
        board.publish(model.state_dict(), first)
        # Room for every group the staleness bound lets the actors make ahead of the learner.
        size = (cfg.max_staleness + 1) * cfg.tasks_per_step * cfg.actors
        pool = ActorPool(cfg.actors, Path(model_dir), env, cfg, max_turns, board, ctx, size, device)
        pool.start(work)
        buffer = RolloutBuffer(pool.buffer, cfg.max_staleness, pool.check)
    else:  # with max_staleness > 0 an older version generates: a second copy of the model holds it
        policy = HFPolicy(copy.deepcopy(model) if cfg.max_staleness else model, tokenizer)
        policy_version = first

    totals = {"wait_s": 0.0, "learn_s": 0.0, "generate_s": 0.0, "actor_idle_s": 0.0}
    steps_started = time.perf_counter()
    learn_s = 0.0
    try:
        for item in work:
            step = version = item.step  # the learner's weights at this step are version `step`
            t0 = time.perf_counter()
            if pool:
                groups, stale, wait_s = buffer.take(step, cfg.tasks_per_step, version)
            else:
                need = max(step - cfg.max_staleness, 0)
                if cfg.max_staleness and need != policy_version:  # at 0 the live model generates
                    policy.load_weights(recent[need])
                    policy_version = need
                groups = rollout(env, policy, tokenizer, item, cfg, max_turns, need)
                stale, wait_s = [], time.perf_counter() - t0
                for group in groups:  # the learner is its own actor: it generates, then waits while it learns
                    group.actor, group.generate_s = -1, wait_s / len(groups)
                    group.idle_s = learn_s / len(groups)
            t1 = time.perf_counter()

            advantages = {g.index: advantages_of(g, cfg.loss_type) for g in groups}
            samples = [s for g in groups if advantages[g.index] is not None
                       for s in samples_of(g, advantages[g.index])]
            stats = (learn_on_batch(model, optimizer, collate(samples, pad_id), cfg, shuffle, reference)
                     if samples else {})
            if recent:
                recent[version + 1] = _snapshot(model)
                for old in [v for v in recent if v < version + 1 - cfg.max_staleness]:
                    del recent[old]
            if pool:
                board.publish(model.state_dict(), version + 1)
            everything = sorted(groups + stale, key=lambda g: g.index)
            rows.extend(_rows(step, version, everything, advantages, {g.index for g in stale}))
            learn_s = time.perf_counter() - t1
            metrics = _metrics(groups, stale, stats, cfg, wait_s, learn_s, version + 1)
            history.append(metrics)
            if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
                checkpoints.save(step + 1, model, tokenizer, optimizer, shuffle, rows, history,
                                 {v: w for v, w in recent.items() if v <= step})
            totals["wait_s"] += wait_s
            totals["learn_s"] += learn_s
            totals["generate_s"] += sum(g.generate_s for g in groups + stale)
            totals["actor_idle_s"] += sum(g.idle_s for g in groups + stale)
            if on_step:
                on_step(step, metrics)
    finally:
        if pool:
            pool.close()
        torch.set_num_threads(threads)

    save_student(model, tokenizer, out_dir)
    checkpoints.remove()
    return rows, _summary(cfg, rows, history, totals, started, steps_started, first)


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # kept on the CPU: a GPU holds the live model, not max_staleness + 1 copies of it
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def _metrics(groups: list[Group], stale: list[Group], stats: dict, cfg: RLConfig, wait_s: float,
             learn_s: float, version: int) -> dict:
    rollouts = [r for g in groups for r in g.rollouts]
    rewards = np.array([r.reward for r in rollouts] or [0.0], dtype=np.float64)
    staleness = [version - 1 - g.behaviour_version for g in groups]
    generate_s = sum(g.generate_s for g in groups + stale)
    idle_s = sum(g.idle_s for g in groups + stale)
    step_s = wait_s + learn_s
    metrics = {RL_REWARD: float(rewards.mean()), "reward_std": float(rewards.std()),
               "pass_rate": float(np.mean([r.passed for r in rollouts])) if rollouts else 0.0,
               "groups": len(groups), "dropped_groups": len(stale),
               "skipped_groups": sum(len({r.reward for r in g.rollouts}) == 1 for g in groups),
               "split_rollouts": sum(r.split for r in rollouts),
               **{f"staleness_{k}": staleness.count(k) for k in range(cfg.max_staleness + 1)},
               "loss": stats.get("loss", float("nan")), "clip_fraction": stats.get("clip_fraction", 0.0),
               "ratio_mean": stats.get("ratio_mean", 1.0), "ratio_max": stats.get("ratio_max", 1.0),
               "is_weight_mean": stats.get("is_weight_mean", 1.0), "is_weight_max": stats.get("is_weight_max", 1.0),
               "kl_behaviour": stats.get("kl_behaviour", 0.0),
               "grad_norm": stats.get("grad_norm", 0.0), "updates": stats.get("updates", 0),
               "learner_idle_fraction": wait_s / max(step_s, 1e-9),
               "actor_idle_fraction": idle_s / max(idle_s + generate_s, 1e-9),
               # assistant tokens generated (and learned from) per second of the learner's step
               "tokens_per_s": sum(r.tokens for r in rollouts) / max(step_s, 1e-9),
               "wait_s": wait_s, "learn_s": learn_s, "generate_s": generate_s, "step_time_s": step_s,
               "policy_version": version}
    if "kl" in stats:
        metrics["kl"] = stats["kl"]
    return metrics


def _summary(cfg: RLConfig, rows: list[dict], history: list[dict], totals: dict, started: float,
             steps_started: float, first: int) -> dict:
    now = time.perf_counter()
    summary = {"steps": cfg.steps, "policy_version": cfg.steps, "episodes": len(rows),
               "resumed_from_step": first, "wall_time_s": now - started, "steps_wall_s": now - steps_started,
               "generate_s": totals["generate_s"], "learn_s": totals["learn_s"], "wait_s": totals["wait_s"],
               "learner_idle_fraction": totals["wait_s"] / max(totals["wait_s"] + totals["learn_s"], 1e-9),
               "actor_idle_fraction": totals["actor_idle_s"] / max(totals["actor_idle_s"] + totals["generate_s"],
                                                                   1e-9)}
    if history:
        summary |= {"reward_mean_first": history[0][RL_REWARD], RL_LAST_REWARD: history[-1][RL_REWARD],
                    "pass_rate_mean": float(np.mean([m["pass_rate"] for m in history])),
                    "skipped_groups": int(sum(m["skipped_groups"] for m in history)),
                    "dropped_groups": int(sum(m["dropped_groups"] for m in history)),
                    "split_rollouts": int(sum(m["split_rollouts"] for m in history))}
    return summary
