"""Teacher throughput over the OpenAI protocol: samples per second at the configured concurrency and one at a time.

    .venv/bin/python benchmarks/synthesis.py [--pipeline demo] [--latency 0.05] [--tasks 128] [--concurrency N]
                                             [--quick]

Starts the tests' OpenAI-compatible server (the calculator oracle, tests/openai_server.py) in its own process
with a fixed latency per request, then runs synthesis episodes (two requests each: the tool call, the answer)
through the openai policy and the one harness, without a cache, first with `teacher.concurrency` requests in
flight, then one at a time. The ideal ratio is the concurrency: every request waits the same fixed latency.
The last line is one JSON object (with the fraction of the ideal ratio reached, the
client's peak RSS and the machine's load average). `--quick` runs the same on 16 tasks (4 one at a time), in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from itertools import islice
from pathlib import Path

from flywheel.agent import Harness
from flywheel.config import load_pipeline
from flywheel.envs import get_environment
from flywheel.policies.base import Sampling
from flywheel.policies.openai import OpenAIPolicy

ROOT = Path(__file__).resolve().parents[1]


def samples_per_s(url: str, env, tasks, concurrency: int) -> tuple[float, float]:
    """Rate and wall time of one synthesis pass over the tasks; every episode must pass."""
    policy = OpenAIPolicy("oracle", url, concurrency=concurrency, timeout_s=30, cache=None)
    started = time.perf_counter()
    episodes = Harness(env).run(policy, tasks, sampling=Sampling(temperature=0.0, seed=0))
    took = time.perf_counter() - started
    failed = [e for e in episodes if not e.passed]
    if failed:
        raise SystemExit(f"{len(failed)} episodes failed; e.g. {failed[0].messages}")
    return len(episodes) / took, took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", default="demo")
    parser.add_argument("--config", default=str(ROOT / "pipelines.yaml"))
    parser.add_argument("--latency", type=float, default=0.05, help="seconds the server takes per request")
    parser.add_argument("--tasks", type=int, default=128, help="tasks at the configured concurrency")
    parser.add_argument("--sequential-tasks", type=int, default=16, help="tasks one request at a time")
    parser.add_argument("--concurrency", type=int, help="default: the pipeline's teacher.concurrency")
    parser.add_argument("--quick", action="store_true", help="the same on 16 tasks (what the tests run)")
    args = parser.parse_args()
    if args.quick:
        args.tasks, args.sequential_tasks = min(args.tasks, 16), min(args.sequential_tasks, 4)

    cfg = load_pipeline(args.pipeline, args.config)
    concurrency = args.concurrency or cfg.teacher.concurrency
    env = get_environment(cfg.environment.name)
    tasks = list(islice(env.generate_tasks(cfg.environment.seed), args.tasks))
    server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "openai_server.py"), "--latency",
                               str(args.latency)], stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().strip()
        if not url.startswith("http"):
            raise SystemExit("the OpenAI test server did not start")
        samples_per_s(url, env, tasks[:4], concurrency)  # warm-up: imports, connections
        concurrent, took_c = samples_per_s(url, env, tasks, concurrency)
        print(f"concurrency {concurrency}: {len(tasks)} samples in {took_c:.2f}s = {concurrent:.1f} samples/s")
        sequential, took_s = samples_per_s(url, env, tasks[:args.sequential_tasks], 1)
        print(f"one at a time: {args.sequential_tasks} samples in {took_s:.2f}s = {sequential:.1f} samples/s")
    finally:
        server.terminate()
        server.wait(timeout=10)
    if args.latency > 0:  # two requests per sample, and nothing else taking any time
        print(f"ideal: {1 / (2 * args.latency):.1f} samples/s one at a time, "
              f"{concurrency / (2 * args.latency):.1f} at concurrency {concurrency}")
    print(json.dumps({"benchmark": "synthesis", "latency_s": args.latency, "concurrency": concurrency,
                      "samples_per_s_concurrent": round(concurrent, 2),
                      "samples_per_s_sequential": round(sequential, 2),
                      "ratio": round(concurrent / sequential, 2), "ideal_ratio": float(concurrency),
                      "fraction_of_ideal": round(concurrent / sequential / concurrency, 2),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                      "load_average": round(os.getloadavg()[0], 1)}))


if __name__ == "__main__":
    main()
