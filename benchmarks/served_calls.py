"""Served answers with tools offered: how many hold raw tool-call markup, calls that do not parse, and whether every
`required` or named tool_choice got its call.

    .venv/bin/python benchmarks/served_calls.py [--requests 1000] [--constrained auto|on|off] [--smol] [--quick]

Serves, as benchmarks/serve.py does (a temporary MLflow store, `flywheel serve-model` on the CPU), a tiny student
(hidden 64, 2 layers) given --steps SFT steps on the oracle's calculator conversations (a student that has begun
to learn the call format, so it still breaks some calls at temperature 1), or with --smol SmolLM2-135M-Instruct with the
support-smol pipeline's chat template on the support desk (untrained). Sends --requests requests at temperature 1
with the environment's tools, CLIENTS at a time, their tool_choice in turn auto, required, the first tool by
name, and none. Counts, over every choice:
- `markup_in_content`: `<tool_call>` or `</tool_call>` in a message's content (the issue's target: 0);
- `malformed_finish`: choices answered with finish_reason malformed_function_call (a call that did not parse,
  cut from the content by the server); `invalid_calls`: returned tool calls naming no offered tool or whose
  arguments are not valid against its JSON schema;
- `required_requests` and `required_met`: required/named requests answered with their call (the rest were
  refused with a 422 tool_choice_not_met: `required_refused`); `none_with_calls`: calls under "none";
- `resampled`: choices the server sampled again because they broke tool_choice.
--constrained: the served pipeline's `environment.constrained_tools` (auto: as pipelines.yaml says; on or off).
The last line is one JSON object. `--quick`: 40 requests to the student untrained (it checks that the benchmark
works; its figures mean little).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from itertools import cycle, islice
from pathlib import Path

from _scratch import scratch  # benchmarks/ is the script's folder, first on sys.path

ROOT = Path(__file__).resolve().parents[1]
CLIENTS = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=60, help="SFT steps of the tiny student (hidden 64, 2 layers)")
    parser.add_argument("--max-tokens", type=int, default=None, help="default 48 (96 with --smol)")
    parser.add_argument("--constrained", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--smol", action="store_true", help="SmolLM2-135M-Instruct on the support desk")
    parser.add_argument("--quick", action="store_true", help="40 requests to the untrained student")
    args = parser.parse_args()
    requests = 40 if args.quick else args.requests
    max_tokens = args.max_tokens or (96 if args.smol else 48)

    state = scratch("flywheel-bench-calls-")
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{state / 'mlflow.db'}"
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))

    import httpx
    import jsonschema
    from serve import served_student  # benchmarks/serve.py: the same served student

    from flywheel.serving.server import ModelServer

    # --quick: random weights (no SFT to start): it checks that the benchmark works, its figures mean little
    _, env, cfg = served_student(state, args.smol, small=True, trained_steps=0 if args.smol or args.quick else
                                 args.steps)
    constrained = {"on": True, "off": False}.get(args.constrained,
                                                 bool(getattr(cfg.environment, "constrained_tools", False)))
    tools = env.tools()
    schemas = {t["function"]["name"]: t["function"].get("parameters", {}) for t in tools}
    named = {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
    prompts = [task.prompt for task in islice(env.generate_tasks(seed=7), requests)]
    bodies = [{"model": "bench", "messages": prompt, "tools": tools, "tool_choice": choice, "temperature": 1.0,
               "max_tokens": max_tokens} for prompt, choice in zip(prompts, cycle(["auto", "required", named, "none"]))]
    counts: Counter[str] = Counter()

    def check(body: dict, reply: httpx.Response) -> None:
        forced = body["tool_choice"] != "auto" and body["tool_choice"] != "none"
        counts["required_requests"] += forced
        if reply.status_code == 422 and forced:
            counts["required_refused"] += 1
            return
        if reply.status_code != 200:
            counts["errors"] += 1
            return
        for choice in reply.json()["choices"]:
            counts["choices"] += 1
            message = choice["message"]
            content, calls = message.get("content") or "", message.get("tool_calls") or []
            counts["markup_in_content"] += "<tool_call>" in content or "</tool_call>" in content
            counts["malformed_finish"] += choice["finish_reason"] == "malformed_function_call"
            counts["with_calls"] += bool(calls)
            counts["tool_calls"] += len(calls)
            counts["none_with_calls"] += bool(calls) and body["tool_choice"] == "none"
            wanted = body["tool_choice"]["function"]["name"] if isinstance(body["tool_choice"], dict) else None
            counts["required_met"] += forced and bool(calls) and all(
                wanted in (None, c["function"]["name"]) for c in calls)
            for call in calls:
                name = call["function"]["name"]
                try:
                    jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])
                except (KeyError, ValueError, jsonschema.ValidationError):
                    counts["invalid_calls"] += 1

    with ModelServer("bench", device="cpu", constrained=constrained) as server, \
            httpx.Client(base_url=server.url, timeout=600) as http:
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=CLIENTS) as clients:
            replies = list(clients.map(lambda body: http.post("/chat/completions", json=body), bodies))
        wall_s = time.perf_counter() - started
        health = http.get(server.url.removesuffix("/v1") + "/health").json()
    for body, reply in zip(bodies, replies, strict=True):
        check(body, reply)
    keys = ("choices", "with_calls", "tool_calls", "markup_in_content", "malformed_finish", "invalid_calls",
            "required_requests", "required_met", "required_refused", "none_with_calls", "errors")
    result = {"model": "SmolLM2-135M-Instruct" if args.smol else "tiny", "environment": cfg.environment.name,
              "requests": requests, "temperature": 1.0, "max_tokens": max_tokens, "constrained": constrained,
              **{key: counts[key] for key in keys}, "resampled": health["resampled"],
              "generate_calls": health["generate_calls"], "wall_s": round(wall_s, 1)}
    summary = ", ".join(f"{key} {counts[key]}" for key in keys)
    print(f"{requests} requests at temperature 1, constrained {constrained}: {summary}; resampled "
          f"{health['resampled']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
