"""Does RL pay for itself? Held-out success after SFT and after RL, per seed, with the gate's paired bootstrap.

    .venv/bin/python benchmarks/rl_gain.py [--pipeline rl-lift] [--seeds 0 1 2] [--rl-steps N] [--sft-steps N]
                                           [--quick]

Per seed, the pipeline's whole loop without orchestration: tasks from its environment, the tiny student built
(seeded), the pipeline's teacher (an imperfect oracle in rl-lift) synthesising the SFT data with rejection
sampling, SFT, RL (the pipeline's rl section: difficulty filtering, schedule, monitor), then base, SFT and RL
scored greedily on the held-out tasks in the one harness. The difference RL - SFT is paired per task and its
interval is the gate's paired bootstrap (flywheel/evaluate/stats.py). One JSON line per seed, then a summary
line: how many seeds had a lower bound above 0. `--quick`: tiny sizes (what a test can run).
"""

from __future__ import annotations

import argparse
import json
import time
from itertools import islice
from pathlib import Path

import numpy as np
from _scratch import scratch  # benchmarks/ is the script's folder, first on sys.path
from transformers.utils import logging as hf_logging

from flywheel.agent import Harness, Limits
from flywheel.config import load_pipeline
from flywheel.envs import load_environment
from flywheel.evaluate.stats import paired_bootstrap
from flywheel.policies.base import Sampling
from flywheel.policies.hf import HFPolicy
from flywheel.policies.oracle import OraclePolicy
from flywheel.train.rl.loop import train_rl
from flywheel.train.rl.monitor import Monitor, audit_sample
from flywheel.train.sft import train_sft
from flywheel.train.tiny import build_tiny_student, environment_corpus

ROOT = Path(__file__).resolve().parents[1]


def scores(env, path: Path, tasks, max_turns: int) -> dict[str, float]:
    """Greedy reward per held-out task id."""
    episodes = Harness(env, Limits(max_turns=max_turns)).run(HFPolicy(path, batch_size=64), tasks,
                                                             sampling=Sampling(temperature=0.0))
    return {e.task.task_id: float(e.reward) for e in episodes}


def by_slice(rewards: dict[str, float], tasks) -> dict[str, float]:
    slices = sorted({t.slice for t in tasks})
    return {s: round(float(np.mean([rewards[t.task_id] for t in tasks if t.slice == s])), 4) for s in slices}


def one_seed(pipeline, env, train, heldout, seed: int, workdir: Path, confidence: float) -> dict:
    """The whole loop for one seed; the numbers of its JSON line."""
    started = time.perf_counter()
    cfg = pipeline
    max_turns = cfg.environment.max_turns
    tiny = cfg.student.tiny.model_copy(update={"seed": seed})
    base = build_tiny_student(environment_corpus(env, n=1000, seed=cfg.environment.seed + 7), tiny, workdir / "base")
    teacher = OraclePolicy(env, error_rate=cfg.teacher.error_rate, error_slices=cfg.teacher.error_slices,
                           error_seed=cfg.teacher.error_seed)
    episodes = Harness(env, Limits(max_turns=max_turns)).run(teacher, train, samples=cfg.synthesize.samples_per_task,
                                                             sampling=Sampling())
    rows = [{"messages": e.messages, "tools": env.tools()} for e in episodes if e.passed]
    sft_started = time.perf_counter()
    train_sft(base, rows, workdir / "sft", cfg.sft.model_copy(update={"seed": seed}))
    sft_s = time.perf_counter() - sft_started
    rl_started = time.perf_counter()
    rl_cfg = cfg.rl.model_copy(update={"seed": seed, "checkpoint_every": 0})
    harness = Harness(env, Limits(max_turns=max_turns))
    monitor = Monitor(harness, audit_sample(heldout, rl_cfg.monitor_tasks), rl_cfg) if rl_cfg.monitor_every else None
    _, summary = train_rl(workdir / "sft", harness, train, rl_cfg, workdir / "rl", monitor=monitor)
    rl_s = time.perf_counter() - rl_started
    result = {label: scores(env, workdir / label, heldout, max_turns) for label in ("base", "sft", "rl")}
    ids = sorted(result["sft"])
    diff = paired_bootstrap([result["rl"][i] for i in ids], [result["sft"][i] for i in ids],
                            n=2000, alpha=1 - confidence, seed=0)
    return {"benchmark": "rl_gain", "seed": seed, "heldout_tasks": len(ids), "sft_conversations": len(rows),
            "teacher_pass_rate": round(float(np.mean([e.passed for e in episodes])), 4),
            **{f"{label}_success": round(float(np.mean(list(r.values()))), 4) for label, r in result.items()},
            "rl_minus_sft": round(diff.estimate, 4), "lower_bound": round(diff.low, 4),
            "upper_bound": round(diff.high, 4),
            "sft_by_slice": by_slice(result["sft"], heldout), "rl_by_slice": by_slice(result["rl"], heldout),
            "rl_reward_first": round(summary.get("reward_mean_first", float("nan")), 4),
            "rl_reward_last": round(summary.get("reward_mean_last", float("nan")), 4),
            "reward_hacking": summary.get("reward_hacking"),
            **({"best_version": summary["best_version"], "validation_pass_first": summary["validation_pass_first"],
                "validation_pass_best": summary["validation_pass_best"],
                "validation_pass_last": summary["validation_pass_last"]} if "best_version" in summary else {}),
            "sft_s": round(sft_s, 1), "rl_s": round(rl_s, 1), "loop_s": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", default="rl-lift")
    parser.add_argument("--config", default=str(ROOT / "pipelines.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sft-steps", type=int, help="default: the pipeline's")
    parser.add_argument("--rl-steps", type=int, help="default: the pipeline's")
    parser.add_argument("--rl-lr", type=float, help="default: the pipeline's")
    parser.add_argument("--workdir", type=Path, help="where models go (default: a temporary folder)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: 5 SFT and 2 RL steps, 48 tasks")
    args = parser.parse_args()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

    pipeline = load_pipeline(args.pipeline, args.config)
    updates = {"sft": {"steps": args.sft_steps}, "rl": {"steps": args.rl_steps, "lr": args.rl_lr}}
    if args.quick:
        updates = {"sft": {"steps": 5, "log_every": 1}, "rl": {"steps": 2, "tasks_per_step": 4, "monitor_tasks": 4,
                                                             "validate_every": 1, "validate_tasks": 4}}
    for section, values in updates.items():
        values = {k: v for k, v in values.items() if v is not None}
        pipeline = pipeline.model_copy(update={section: getattr(pipeline, section).model_copy(update=values)})
    n_train, n_heldout = pipeline.environment.train_tasks, pipeline.environment.heldout_tasks
    if args.quick:
        n_train, n_heldout = 32, 16
    env = load_environment(pipeline.environment, ROOT)
    seed = pipeline.environment.seed
    train = list(islice(env.generate_tasks(seed), n_train))
    seen = {t.task_id for t in train}
    heldout = list(islice((t for t in env.generate_tasks(seed + 1_000_003) if t.task_id not in seen), n_heldout))
    workdir = scratch("rl-gain-", args.workdir)

    lines = []
    for s in args.seeds:
        line = one_seed(pipeline, env, train, heldout, s, workdir / f"seed-{s}", pipeline.gate.confidence)
        print(json.dumps(line), flush=True)
        lines.append(line)
    print(json.dumps({"benchmark": "rl_gain", "pipeline": args.pipeline, "seeds": args.seeds,
                      "lift_shown": sum(x["lower_bound"] > 0 for x in lines),
                      "sft_success": [x["sft_success"] for x in lines], "rl_success": [x["rl_success"] for x in lines],
                      "lower_bounds": [x["lower_bound"] for x in lines],
                      "max_loop_s": max(x["loop_s"] for x in lines)}))


if __name__ == "__main__":
    main()
