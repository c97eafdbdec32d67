"""How much the tiny demo student learns from oracle conversations: held-out pass rate before and after SFT.

    .venv/bin/python benchmarks/demo_student.py [--pipeline demo] [--steps N] [--lr X] [--seed N]
                                                [--train 3000] [--heldout 200] [--quick]

Builds the tiny student (tokenizer trained on the environment's oracle conversations), evaluates the random
base model, runs SFT on oracle conversations, evaluates again, all greedy in the one harness; prints pass
rates (overall and per slice) and wall times of each part; the last line is one JSON object. `--quick`: 5 SFT steps
on 64 conversations, 16 held-out tasks.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from itertools import islice
from pathlib import Path

from _scratch import scratch  # benchmarks/ is the script's folder, first on sys.path
from transformers.utils import logging as hf_logging

from flywheel.agent import Harness, Limits
from flywheel.config import load_pipeline
from flywheel.envs import get_environment
from flywheel.policies.base import Sampling
from flywheel.policies.hf import HFPolicy
from flywheel.policies.oracle import OraclePolicy
from flywheel.train.sft import train_sft
from flywheel.train.tiny import build_tiny_student, environment_corpus


def pass_rates(episodes) -> dict[str, float]:
    """Overall and per-slice share of passed episodes."""
    total, passed = Counter(), Counter()
    for e in episodes:
        for key in ("all", e.task.slice):
            total[key] += 1
            passed[key] += e.passed
    return {key: passed[key] / total[key] for key in sorted(total, key=lambda k: (k != "all", k))}


def evaluate(env, path: Path, tasks, max_turns: int) -> tuple[dict[str, float], float, list]:
    policy = HFPolicy(path, batch_size=64)
    started = time.perf_counter()
    episodes = Harness(env, Limits(max_turns=max_turns)).run(policy, tasks,
                                                             sampling=Sampling(temperature=0.0, max_new_tokens=64))
    return pass_rates(episodes), time.perf_counter() - started, episodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", default="demo")
    parser.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "pipelines.yaml"))
    parser.add_argument("--steps", type=int, help="SFT steps (default: the pipeline's)")
    parser.add_argument("--lr", type=float, help="SFT learning rate (default: the pipeline's)")
    parser.add_argument("--seed", type=int, help="the tiny model's init seed (default: the pipeline's)")
    parser.add_argument("--train", type=int, default=3000, help="oracle conversations to train on")
    parser.add_argument("--heldout", type=int, default=200, help="held-out tasks to evaluate on")
    parser.add_argument("--corpus", type=int, default=2000, help="conversations to train the tokenizer on")
    parser.add_argument("--workdir", type=Path, help="where models go (default: a temporary folder)")
    parser.add_argument("--quick", action="store_true", help="the same on tiny sizes (what the tests run)")
    args = parser.parse_args()
    if args.quick:
        args.steps = min(args.steps or 5, 5)
        args.train, args.heldout, args.corpus = min(args.train, 64), min(args.heldout, 16), min(args.corpus, 200)
    hf_logging.disable_progress_bar()  # per-file bars and generation-length reminders would bury the numbers
    hf_logging.set_verbosity_error()

    pipeline = load_pipeline(args.pipeline, args.config)
    sft_cfg = pipeline.sft.model_copy(update={k: v for k, v in (("steps", args.steps), ("lr", args.lr))
                                               if v is not None})
    if args.quick:  # a loss is logged every log_every steps: one at least
        sft_cfg = sft_cfg.model_copy(update={"log_every": 1})
    tiny_cfg = pipeline.student.tiny if args.seed is None else pipeline.student.tiny.model_copy(
        update={"seed": args.seed})
    env = get_environment(pipeline.environment.name)
    seed, max_turns = pipeline.environment.seed, pipeline.environment.max_turns
    workdir = scratch("demo-student-", args.workdir)

    train_tasks = list(islice(env.generate_tasks(seed), args.train))
    seen = {t.task_id for t in train_tasks}
    heldout = list(islice((t for t in env.generate_tasks(seed + 1_000_003) if t.task_id not in seen), args.heldout))

    started = time.perf_counter()
    corpus = environment_corpus(env, n=args.corpus, seed=seed + 7)
    corpus_s = time.perf_counter() - started
    started = time.perf_counter()
    base = build_tiny_student(corpus, tiny_cfg, workdir / "base")
    build_s = time.perf_counter() - started

    base_rates, base_eval_s, _ = evaluate(env, base, heldout, max_turns)

    rows = [{"messages": e.messages, "tools": env.tools()}
            for e in Harness(env, Limits(max_turns=max_turns)).run(OraclePolicy(env), train_tasks) if e.passed]

    def show(step: int, m: dict) -> None:
        if step % 100 == 0 or step == sft_cfg.steps:
            print(f"  sft step {step:4d}  loss {m['loss']:.3f}  lr {m['learning_rate']:.2e}  "
                  f"{m['tokens_per_s']:.0f} tok/s", flush=True)

    metrics = train_sft(base, rows, workdir / "sft", sft_cfg, on_log=show)
    sft_rates, sft_eval_s, episodes = evaluate(env, workdir / "sft", heldout, max_turns)

    print(f"\nmodel: {tiny_cfg.model_dump()}  sft: {sft_cfg.model_dump()}")
    print(f"data: {len(rows)} oracle conversations, {len(heldout)} held-out tasks, tokenizer corpus {len(corpus)}")
    print(f"tokenizer corpus {corpus_s:.1f} s, tokenizer + model build {build_s:.1f} s")
    print(f"SFT: {metrics['steps']} steps in {metrics['runtime_s']:.1f} s, {metrics['tokens_per_s']:.0f} tok/s, "
          f"final loss {metrics['final_loss']:.3f}")
    print(f"base  pass rate {base_rates}  eval {base_eval_s:.1f} s")
    print(f"SFT   pass rate {sft_rates}  eval {sft_eval_s:.1f} s "
          f"({len(heldout) / sft_eval_s:.0f} episodes/s)")
    for e in [e for e in episodes if not e.passed][:5]:
        turns = " | ".join(f"{m['role']}: {m.get('content') or m.get('tool_calls')}" for m in e.messages)
        print(f"  failed [{e.task.slice}] {turns}")
    print(f"models under {workdir}")
    print(json.dumps({"benchmark": "demo_student", "sft_steps": metrics["steps"], "train_conversations": len(rows),
                      "heldout_tasks": len(heldout), "base_pass_rate": base_rates, "sft_pass_rate": sft_rates,
                      "sft_runtime_s": round(metrics["runtime_s"], 1),
                      "sft_tokens_per_s": round(metrics["tokens_per_s"]), "final_loss": round(metrics["final_loss"], 4),
                      "sft_eval_s": round(sft_eval_s, 1)}))


if __name__ == "__main__":
    main()
