"""What serving costs: `flywheel serve-model` against a bare `generate` loop on the same model and prompts.

    .venv/bin/python benchmarks/serve.py [--requests 64] [--max-tokens 32] [--quick]

Builds the demo's tiny student (pipelines.yaml `demo.student.tiny`, random weights: every answer runs to
--max-tokens, so both sides do the same work), registers it as an MLflow model in a temporary SQLite store,
serves it (transformers on the CPU, traffic recorded as traces) and sends the environment's prompts one at a
time through the `openai` client; then answers the same prompts one at a time with the hf policy's `generate`.
`ratio` is the server's requests/s over the bare loop's: what HTTP, request checks, the chat template, the
response and the trace record cost. Then CLIENTS clients send the same prompts at once, as an application's
users do: the server's requests/s and p50/p95 latency under that load against the bare loop's (the server
generates one request at a time per model, so the bare loop is its ceiling: `concurrent_ratio`). The last line
is one JSON object. `--quick`: 8 requests and a smaller model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARM_UP = 4  # full-length requests on each side before timing: the first few take several times longer
CLIENTS = 8  # concurrent clients in the load part


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between the sorted values."""
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="8 requests on a smaller model, in seconds")
    args = parser.parse_args()
    requests = 8 if args.quick else args.requests

    state = Path(tempfile.mkdtemp(prefix="flywheel-bench-serve-"))
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{state / 'mlflow.db'}"
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    sys.path.insert(0, str(ROOT))

    import openai

    from flywheel import registry
    from flywheel.config import TinyModelConfig, load_pipeline
    from flywheel.envs import get_environment
    from flywheel.policies.base import Sampling
    from flywheel.policies.hf import HFPolicy
    from flywheel.serving.chat import input_example
    from flywheel.serving.mlflow_model import StudentChatModel
    from flywheel.serving.server import ModelServer
    from flywheel.train.tiny import build_tiny_student, environment_corpus

    cfg = load_pipeline("demo", ROOT / "pipelines.yaml")
    env = get_environment(cfg.environment.name)
    tiny = TinyModelConfig(hidden_size=64, layers=2, heads=4, vocab_size=400, seed=0) if args.quick \
        else cfg.student.tiny
    student = build_tiny_student(environment_corpus(env, n=300, seed=0), tiny, state / "student")
    run = registry.start_run(state, "bench", "register")
    registry.register(run, "bench", student, "bench", {}, [], python_model=StudentChatModel(),
                      example=input_example(env))
    run.end()
    registry.client().set_registered_model_alias("bench", "champion", "1")

    prompts = [task.prompt for task in islice(env.generate_tasks(seed=42), requests)]
    tools = env.tools()
    with ModelServer("bench", traces=state / "served", device="cpu") as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused")
        for prompt in prompts[:WARM_UP]:  # first calls pay one-time costs (allocations, template compiling)
            client.chat.completions.create(model="bench", messages=prompt, tools=tools, temperature=0.0,
                                           max_tokens=args.max_tokens)
        started, latencies = time.perf_counter(), []
        for prompt in prompts:
            sent = time.perf_counter()
            client.chat.completions.create(model="bench", messages=prompt, tools=tools, temperature=0.0,
                                           max_tokens=args.max_tokens)
            latencies.append(time.perf_counter() - sent)
        served_s = time.perf_counter() - started

        def timed(prompt: list[dict]) -> float:
            sent = time.perf_counter()
            client.chat.completions.create(model="bench", messages=prompt, tools=tools, temperature=0.0,
                                           max_tokens=args.max_tokens)
            return time.perf_counter() - sent

        with ThreadPoolExecutor(max_workers=CLIENTS) as clients:  # every prompt in flight, CLIENTS at a time
            started = time.perf_counter()
            loaded = list(clients.map(timed, prompts))
            loaded_s = time.perf_counter() - started
        recorded = server.traffic.recorded - min(WARM_UP, len(prompts))

    policy = HFPolicy(student, device="cpu")
    sampling = Sampling(temperature=0.0, max_new_tokens=args.max_tokens)

    def bare_loop() -> tuple[float, list[float]]:
        for prompt in prompts[:WARM_UP]:  # the same warm-up as the server's
            policy.generate([prompt], tools, sampling)
        started, bare = time.perf_counter(), []
        for prompt in prompts:
            sent = time.perf_counter()
            policy.generate([prompt], tools, sampling)
            bare.append(time.perf_counter() - sent)
        return time.perf_counter() - started, bare

    # in a worker thread, as the server generates: torch's CPU thread pool is set up per OS thread, so a loop
    # in the main thread would compare thread settings, not serving
    with ThreadPoolExecutor(max_workers=1) as pool:
        bare_s, bare = pool.submit(bare_loop).result()

    result = {"requests": requests, "max_tokens": args.max_tokens, "recorded": recorded,
              "server_requests_per_s": round(requests / served_s, 2),
              "server_mean_latency_s": round(sum(latencies) / len(latencies), 4),
              "generate_requests_per_s": round(requests / bare_s, 2),
              "generate_mean_latency_s": round(sum(bare) / len(bare), 4),
              "ratio": round((requests / served_s) / (requests / bare_s), 3),
              "clients": CLIENTS, "concurrent_requests_per_s": round(requests / loaded_s, 2),
              "concurrent_p50_s": round(percentile(loaded, 50), 4),
              "concurrent_p95_s": round(percentile(loaded, 95), 4),
              "generate_p50_s": round(percentile(bare, 50), 4), "generate_p95_s": round(percentile(bare, 95), 4),
              "concurrent_ratio": round((requests / loaded_s) / (requests / bare_s), 3)}
    print(f"server: {result['server_requests_per_s']} requests/s ({result['server_mean_latency_s']}s each); bare "
          f"generate: {result['generate_requests_per_s']}/s ({result['generate_mean_latency_s']}s each)")
    print(f"{CLIENTS} clients at once: {result['concurrent_requests_per_s']} requests/s, p50 "
          f"{result['concurrent_p50_s']}s, p95 {result['concurrent_p95_s']}s (bare generate p50 "
          f"{result['generate_p50_s']}s, p95 {result['generate_p95_s']}s)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
