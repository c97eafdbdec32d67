"""The synchronous RL loop: each step the live policy rolls out scored groups, then learns."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from flywheel.agent import run_episodes
from flywheel.config import RLConfig
from flywheel.envs.base import Environment, Task
from flywheel.policies.base import Sampling
from flywheel.train.rl.batch import collate, encode_groups, make_groups
from flywheel.train.rl.learner import learn_on_batch


def task_stream(tasks: list[Task], seed: int) -> Iterator[Task]:
    """The tasks in a seeded order, reshuffled each time the list runs out."""
    if not tasks:
        raise ValueError("train_rl needs at least one task")
    rng = random.Random(seed)
    while True:
        order = list(tasks)
        rng.shuffle(order)
        yield from order


def train_rl(model_dir: Path, env: Environment, tasks: list[Task], cfg: RLConfig, out_dir: Path,
             max_turns: int, on_step: Callable[[int, dict], None] | None = None) -> tuple[list[dict], dict]:
    """GRPO-family RL from the checkpoint in model_dir; saves to out_dir; returns (rollout rows, summary)."""
    from flywheel.policies.hf import HFPolicy
    from flywheel.train.checkpoint import load_student, save_student

    torch.manual_seed(cfg.seed)
    model, tokenizer = load_student(model_dir)
    policy = HFPolicy(model, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    shuffle = torch.Generator().manual_seed(cfg.seed)
    stream = task_stream(tasks, cfg.seed)
    tools = env.tools()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    rows: list[dict] = []
    history: list[dict] = []
    version = 0  # the weights that generate this step's rollouts; the loaded checkpoint is version 0
    started = time.perf_counter()
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        step_tasks = [next(stream) for _ in range(cfg.tasks_per_step)]
        sampling = Sampling(temperature=cfg.temperature, seed=cfg.seed * 1_000_003 + step)
        episodes = run_episodes(env, policy, step_tasks, samples=cfg.group_size, sampling=sampling,
                                max_turns=max_turns)
        rollout_s = time.perf_counter() - t0

        groups = make_groups(episodes, cfg.group_size, cfg.loss_type)
        samples, tokens = encode_groups(groups, tokenizer, tools, cfg.max_length)
        stats = learn_on_batch(model, optimizer, collate(samples, pad_id), cfg, shuffle) if samples else {}
        # Sync RL: the learner consumes exactly the version that generated, then publishes the next one.
        for group in groups:
            for i, episode in enumerate(group.episodes):
                rows.append({"step": step, "policy_version": version, "behaviour_version": version,
                             "task_id": episode.task.task_id, "group": group.index, "sample": episode.sample,
                             "reward": float(episode.reward),
                             "advantage": None if group.skipped else float(group.advantages[i]),
                             "tokens": tokens[(group.index, episode.sample)], "passed": bool(episode.passed)})
        version += 1

        rewards = np.array([e.reward for e in episodes], dtype=np.float64)
        step_time = time.perf_counter() - t0
        assistant_tokens = sum(tokens.values())
        metrics = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
                   "pass_rate": float(np.mean([e.passed for e in episodes])),
                   "skipped_groups": sum(g.skipped for g in groups), "groups": len(groups),
                   "loss": stats.get("loss", float("nan")), "clip_fraction": stats.get("clip_fraction", 0.0),
                   "ratio_mean": stats.get("ratio_mean", 1.0), "ratio_max": stats.get("ratio_max", 1.0),
                   "grad_norm": stats.get("grad_norm", 0.0), "updates": stats.get("updates", 0),
                   # assistant tokens (generated and learned from) per second of the whole step
                   "tokens_per_s": assistant_tokens / step_time, "rollout_s": rollout_s,
                   "step_time_s": step_time, "policy_version": version}
        if "kl" in stats:
            metrics["kl"] = stats["kl"]
        history.append(metrics)
        if on_step:
            on_step(step, metrics)

    save_student(model, tokenizer, out_dir)
    summary = {"steps": cfg.steps, "policy_version": version, "episodes": len(rows),
               "wall_time_s": time.perf_counter() - started}
    if history:
        summary |= {"reward_mean_first": history[0]["reward_mean"],
                    "reward_mean_last": history[-1]["reward_mean"],
                    "pass_rate_mean": float(np.mean([m["pass_rate"] for m in history])),
                    "skipped_groups": int(sum(m["skipped_groups"] for m in history))}
    return rows, summary
