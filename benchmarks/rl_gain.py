"""Held-out pass rate of an SFT student before and after the synchronous RL loop, side by side in one run.

    .venv/bin/python benchmarks/rl_gain.py --student models/demo/sft [--set steps=20 --set lr=1e-4]

Uses the pipeline's environment, tasks, rl and gate sections; prints both pass rates, the paired-bootstrap
difference, per-slice rates, the gate's verdict (RL model as candidate, SFT as champion) and the wall times.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import pandas as pd

from flywheel.config import RLConfig, load_pipeline
from flywheel.data.tasksets import build_tasks, row_task
from flywheel.envs import get_environment
from flywheel.evaluate.gate import decide
from flywheel.evaluate.runner import evaluate_model
from flywheel.train.rl.loop import train_rl


def main() -> None:
    """Evaluate, train RL, evaluate again, compare."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--student", type=Path, required=True, help="the SFT checkpoint folder")
    parser.add_argument("--pipeline", default="demo")
    parser.add_argument("--config", default="pipelines.yaml")
    parser.add_argument("--out", type=Path, default=None, help="the RL model's folder (default: temp)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override an rl key")
    args = parser.parse_args()

    pipeline = load_pipeline(args.pipeline, args.config)
    overrides = dict(item.split("=", 1) for item in args.set)
    rl_cfg = RLConfig.model_validate(pipeline.rl.model_dump() | overrides)
    env = get_environment(pipeline.environment.name)
    rows = build_tasks(env, pipeline.environment, pipeline.collect.heldout_fraction, [])
    train = [row_task(r) for r in rows if r["split"] == "train"]
    heldout = [row_task(r) for r in rows if r["split"] == "heldout"]
    run = {"max_turns": pipeline.environment.max_turns, "tool_timeout_s": pipeline.environment.tool_timeout_s,
           "batch_size": pipeline.evaluate.batch_size}

    t0 = time.perf_counter()
    before = pd.DataFrame(evaluate_model(args.student, env, heldout, "sft", **run))
    eval_s = time.perf_counter() - t0
    out = args.out or Path(tempfile.mkdtemp(prefix="rl-gain-"))
    print(f"rl config: {rl_cfg.model_dump()}")
    t0 = time.perf_counter()
    _, summary = train_rl(args.student, env, train, rl_cfg, out, pipeline.environment.max_turns,
                          on_step=lambda step, m: print(
                              f"  step {step:3d} reward {m['reward_mean']:.3f} skipped "
                              f"{m['skipped_groups']:2d}/{m['groups']} clip {m['clip_fraction']:.3f} "
                              f"{m['step_time_s']:.1f}s"))
    rl_s = time.perf_counter() - t0
    after = pd.DataFrame(evaluate_model(out, env, heldout, "rl", **run))

    # The gate's own numbers: the same pairing, bootstrap and seed that promotion would use.
    decision = decide(after, before, pipeline.gate)
    diff, level = decision.numbers.get("diff", {}), pipeline.gate.confidence
    print(f"held-out tasks: {len(heldout)}   (eval {eval_s:.1f}s per model)")
    print(f"pass rate  sft {before['passed'].mean():.3f}   rl {after['passed'].mean():.3f}   "
          f"diff {diff.get('estimate', float('nan')):+.3f} [{diff.get('low', float('nan')):+.3f}, "
          f"{diff.get('high', float('nan')):+.3f}] ({level:.0%} paired bootstrap)")
    for name, part in decision.numbers.get("slices", {}).items():
        print(f"  slice {name:6s} sft {part.get('champion', float('nan')):.3f}   rl {part['candidate']:.3f}")
    print(f"rl wall time {rl_s:.1f}s ({rl_cfg.steps} steps, {summary['episodes']} episodes)")
    print(f"gate (rl vs sft): {'PASS' if decision.passed else 'FAIL'}: " + "; ".join(decision.reasons))


if __name__ == "__main__":
    main()
