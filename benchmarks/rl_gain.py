"""Held-out pass rate of an SFT student before and after the synchronous RL loop, side by side in one run.

    .venv/bin/python benchmarks/rl_gain.py [--student models/demo/sft] [--set steps=20 --set lr=1e-4] [--quick]

Uses the pipeline's environment, tasks, rl and gate sections; prints both pass rates, the paired-bootstrap
difference, per-slice rates, the gate's verdict (RL model as candidate, SFT as champion) and the wall times; the
last line is one JSON object. The student is the demo's SFT checkpoint (`make demo` makes it). `--quick`: one RL
step on 16 held-out tasks, from a random tiny student unless --student is given.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import pandas as pd

from flywheel.config import RLConfig, TinyModelConfig, load_pipeline
from flywheel.data.tasksets import build_tasks, row_task
from flywheel.envs import get_environment
from flywheel.evaluate.gate import decide
from flywheel.evaluate.runner import evaluate_model
from flywheel.train.rl.loop import train_rl
from flywheel.train.tiny import build_tiny_student, environment_corpus

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    """Evaluate, train RL, evaluate again, compare."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--student", type=Path, help="the SFT checkpoint folder (default: models/<pipeline>/sft)")
    parser.add_argument("--pipeline", default="demo")
    parser.add_argument("--config", default=str(ROOT / "pipelines.yaml"))
    parser.add_argument("--out", type=Path, default=None, help="the RL model's folder (default: temp)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override an rl key")
    parser.add_argument("--quick", action="store_true", help="the same on tiny sizes (what the tests run)")
    args = parser.parse_args()

    pipeline = load_pipeline(args.pipeline, args.config)
    quick = {"steps": 1, "tasks_per_step": 4, "group_size": 2} if args.quick else {}
    overrides = quick | dict(item.split("=", 1) for item in args.set)
    rl_cfg = RLConfig.model_validate(pipeline.rl.model_dump() | overrides)
    env = get_environment(pipeline.environment.name)
    rows = build_tasks(env, pipeline.environment, pipeline.collect.heldout_fraction, [])
    train = [row_task(r) for r in rows if r["split"] == "train"]
    heldout = [row_task(r) for r in rows if r["split"] == "heldout"][:16 if args.quick else None]
    student = args.student or ROOT / "models" / args.pipeline / "sft"
    if args.quick and args.student is None:  # no checkpoint needed: a random tiny student runs the same steps
        student = build_tiny_student(environment_corpus(env, 200, 0),
                                     TinyModelConfig(hidden_size=32, layers=1, heads=2, vocab_size=400),
                                     Path(tempfile.mkdtemp(prefix="rl-gain-student-")))
    if not student.is_dir():
        raise SystemExit(f"{student}: no SFT checkpoint; run `flywheel run {args.pipeline}` (or `make demo`) first, "
                         "or pass --student")
    run = {"max_turns": pipeline.environment.max_turns, "tool_timeout_s": pipeline.environment.tool_timeout_s,
           "batch_size": pipeline.evaluate.batch_size}

    t0 = time.perf_counter()
    before = pd.DataFrame(evaluate_model(student, env, heldout, "sft", **run))
    eval_s = time.perf_counter() - t0
    out = args.out or Path(tempfile.mkdtemp(prefix="rl-gain-"))
    print(f"rl config: {rl_cfg.model_dump()}")
    t0 = time.perf_counter()
    _, summary = train_rl(student, env, train, rl_cfg, out, pipeline.environment.max_turns,
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
    print(json.dumps({"benchmark": "rl_gain", "rl_steps": rl_cfg.steps, "heldout_tasks": len(heldout),
                      "sft_pass_rate": round(float(before["passed"].mean()), 4),
                      "rl_pass_rate": round(float(after["passed"].mean()), 4),
                      "diff": {k: round(v, 4) for k, v in diff.items() if isinstance(v, float)},
                      "gate_passed": bool(decision.passed), "eval_s": round(eval_s, 1), "rl_s": round(rl_s, 1)}))


if __name__ == "__main__":
    main()
