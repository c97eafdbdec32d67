"""Asynchronous against synchronous RL: the same learner steps on the same work, side by side in one run.

    .venv/bin/python benchmarks/rl_async.py [--steps 16] [--rounds 2] [--student models/demo/sft] [--quick]

Sync is one actor process at max_staleness 0 (it waits for each new version while the learner steps); async is
one actor at max_staleness 1 (it generates step s+1 while the learner trains on step s). Each side gets one torch
thread for the learner and one for the actor. Step 0 (actor start-up, no overlap possible) is left out of the
timings. The ideal speedup, (generation + training) / max(generation, training), comes from the sync run's own
timings, summed over rounds that alternate sync and async. Without --student a random tiny student learns a
graded rubric (the share of digits in its answer), so that every step trains; with --student, the calculator's
own rubric. Last line: one JSON object. `--quick`: 3 steps (2 timed), one round.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from _scratch import scratch  # benchmarks/ is the script's folder, first on sys.path

from flywheel.agent import Harness, Limits
from flywheel.config import RLConfig, TinyModelConfig
from flywheel.contract import Score
from flywheel.envs.calculator import CalculatorEnv
from flywheel.train.rl.loop import train_rl
from flywheel.train.tiny import build_tiny_student, environment_corpus


class DigitShareCalculator(CalculatorEnv):
    """The calculator with a graded rubric a random student can climb: the share of digits in its answer."""

    def score(self, task, messages, state=None):
        last = messages[-1]
        text = (last.get("content") or "") if last["role"] == "assistant" else ""
        reward = sum(c.isdigit() for c in text) / max(len(text), 1)
        return Score(reward=reward, passed=reward > 0.5)


def timed_run(student: Path, env, tasks, cfg: RLConfig, out: Path, max_turns: int) -> dict:
    """Run train_rl; the timings of steps 1.. (after the actor is up)."""
    history = []
    _, summary = train_rl(student, Harness(env, Limits(max_turns=max_turns)), tasks, cfg, out,
                          on_step=lambda step, m: history.append(m))
    steady = history[1:]
    return {"wall_s": sum(m["step_time_s"] for m in steady),
            "generate_s": sum(m["generate_s"] for m in steady),
            "train_s": sum(m["learn_s"] for m in steady),
            "learner_idle_fraction": sum(m["wait_s"] for m in steady) / sum(m["step_time_s"] for m in steady),
            "actor_idle_fraction": sum(m["actor_idle_fraction"] for m in steady) / len(steady),
            "reward_first": history[0]["reward_mean"], "reward_last": history[-1]["reward_mean"],
            "total_wall_s": summary["wall_time_s"]}


def _combined(runs: list[dict]) -> dict:
    """Totals over rounds (fractions weighted by time); rewards of the first round."""
    wall = sum(r["wall_s"] for r in runs)
    return {"wall_s": wall, "generate_s": sum(r["generate_s"] for r in runs),
            "train_s": sum(r["train_s"] for r in runs),
            "learner_idle_fraction": sum(r["learner_idle_fraction"] * r["wall_s"] for r in runs) / wall,
            "actor_idle_fraction": sum(r["actor_idle_fraction"] for r in runs) / len(runs),
            "reward_first": runs[0]["reward_first"], "reward_last": runs[0]["reward_last"]}


def main() -> None:
    """Build (or take) a student, run sync then async, print both and the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--student", type=Path, default=None, help="an SFT checkpoint (default: a random tiny one)")
    parser.add_argument("--rounds", type=int, default=2, help="sync/async pairs, alternated")
    parser.add_argument("--epochs", type=int, default=1, help="epochs_per_batch: balances training against generation")
    parser.add_argument("--quick", action="store_true", help="the same on tiny sizes (what the tests run)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = min(args.steps, 3), 1

    work = scratch("rl-async-")
    if args.student:
        student, env, max_turns = args.student, CalculatorEnv(), 4
    else:
        student = build_tiny_student(environment_corpus(CalculatorEnv(), 300, 0),
                                     TinyModelConfig(hidden_size=128, layers=2, heads=4, vocab_size=400),
                                     work / "student")
        env, max_turns = DigitShareCalculator(), 1
    tasks = list(itertools.islice(env.generate_tasks(1), 500))
    base = RLConfig(steps=args.steps, tasks_per_step=16, group_size=4, lr=1e-3, epochs_per_batch=args.epochs,
                    minibatch_size=16, max_new_tokens=48, actors=1, checkpoint_every=0)
    # Rounds alternate sync and async, so a change in the machine's load falls on both sides alike.
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    for r in range(args.rounds):
        for name, staleness in (("sync", 0), ("async", 1)):
            runs[name].append(timed_run(student, env, tasks, base.model_copy(update={"max_staleness": staleness}),
                                        work / f"{name}-{r}", max_turns))
    sync, asyn = (_combined(runs[name]) for name in ("sync", "async"))

    ideal = (sync["generate_s"] + sync["train_s"]) / max(sync["generate_s"], sync["train_s"])
    speedup = sync["wall_s"] / asyn["wall_s"]
    for name, run in (("sync  (max_staleness 0)", sync), ("async (max_staleness 1)", asyn)):
        print(f"{name}: {run['wall_s']:.1f}s for {args.rounds} x {args.steps - 1} steps  "
              f"generation {run['generate_s']:.1f}s  training {run['train_s']:.1f}s  "
              f"learner idle {run['learner_idle_fraction']:.2f}  "
              f"actor idle {run['actor_idle_fraction']:.2f}  reward {run['reward_first']:.3f} -> "
              f"{run['reward_last']:.3f}")
    print(f"speedup {speedup:.2f}x; ideal {ideal:.2f}x (from the sync run's generation and training); "
          f"{speedup / ideal:.0%} of ideal")
    print(json.dumps({"benchmark": "rl_async", "steps_timed": args.steps - 1, "rounds": args.rounds,
                      "sync_wall_s": round(sync["wall_s"], 2), "async_wall_s": round(asyn["wall_s"], 2),
                      "sync_learner_idle_fraction": round(sync["learner_idle_fraction"], 3),
                      "async_learner_idle_fraction": round(asyn["learner_idle_fraction"], 3),
                      "sync_generate_s": round(sync["generate_s"], 2), "sync_train_s": round(sync["train_s"], 2),
                      "speedup": round(speedup, 3), "ideal_speedup": round(ideal, 3),
                      "fraction_of_ideal": round(speedup / ideal, 3)}))


if __name__ == "__main__":
    main()
