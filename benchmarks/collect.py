"""The whole collect stage against a bare `json.loads` loop over the same generated records, side by side.

    .venv/bin/python benchmarks/collect.py [--records 200000] [--pipeline demo] [--workers N] [--quick]

Writes N production-like records (tool-using calculator conversations in OpenAI chat format, ~5% carrying an
email, phone number or API key, ~2% duplicates, ~0.5% malformed) as JSON Lines in a temporary project, then
times `json.loads` over every line, the collect stage in full (read, check, normalise, redact, de-duplicate,
split, pandera, Parquet, the tasks table, MLflow; the MLflow store is created and timed apart first, as a
project's store exists after its first run) with `--workers` worker processes (default: one per core), an
incremental rerun with nothing new (the tables must keep their bytes), one with 1% more records appended to
the last file, and a full re-collect of the same records in one process (it must write the same bytes; its
time, per the first runs' record count, is the stage without workers). The last line is one JSON object: both
rates and their ratio, the stage's CPU seconds (workers included), the one-process time and ratio, the peak
RSS of this process and of the largest worker, the incremental runs' seconds, the machine's load average.
`--quick` runs the same on 2,000 records, in seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import random
import resource
import time
from datetime import datetime, timedelta
from pathlib import Path

import yaml
from _scratch import scratch  # benchmarks/ is the script's folder, first on sys.path

from flywheel.envs.calculator import CalculatorEnv

ROOT = Path(__file__).resolve().parents[1]


def _example_conversations():
    """`conversation` of examples/make_traces.py, loaded by path: `examples` is no installed package."""
    spec = importlib.util.spec_from_file_location("make_traces", ROOT / "examples" / "make_traces.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.conversation


conversation = _example_conversations()
PII = ["My email is {}@example.com.", "Call me on +1 415-555-{:04d}.", "key sk-proj-{}abcdefghijklmnopqrstu"]


def make_records(n: int, seed: int = 0) -> list[str]:
    """n JSON lines in time order."""
    rng = random.Random(seed)
    env = CalculatorEnv()
    tools = env.tools()
    clock = datetime(2026, 11, 1, 8)
    lines: list[str] = []
    for i in range(n):
        if lines and rng.random() < 0.02:
            lines.append(rng.choice(lines[-1000:]))  # a retried upload
            continue
        a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-*")
        expression = f"{a} {op} {b}"
        outcome = "accepted" if rng.random() < 0.75 else "rejected"
        messages = conversation(env, rng, expression, int(env.call_tool("calculator", {"expression": expression})),
                                outcome)
        if rng.random() < 0.05:
            messages[0]["content"] += " " + rng.choice(PII).format(i % 10_000)
        clock += timedelta(seconds=rng.randint(1, 30))
        record = {"id": f"tr_{i:08d}", "timestamp": clock.strftime("%Y-%m-%dT%H:%M:%SZ"), "messages": messages,
                  "tools": tools, "outcome": outcome, "score": 1.0 if outcome == "accepted" else 0.0}
        text = json.dumps(record)
        lines.append(text[: len(text) // 2] if rng.random() < 0.005 else text)
    return lines


def write_records(path: Path, lines: list[str]) -> None:
    """The lines, chunked into one file per 50k records (a day of logs)."""
    for part in range(0, len(lines), 50_000):
        (path / f"agent-{part // 50_000:03d}.jsonl").write_text("\n".join(lines[part:part + 50_000]) + "\n")


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_s() -> float:
    """CPU seconds of this process and of its ended child processes (collect's workers) so far."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    """Generate, time json.loads, time the stage (full, then an incremental rerun), print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--pipeline", default="demo")
    parser.add_argument("--workers", type=int, default=0,
                        help="collect.workers for the timed runs (default 0: one process per CPU core)")
    parser.add_argument("--quick", action="store_true", help="the same on 2,000 records (what the tests run)")
    args = parser.parse_args()
    if args.quick:
        args.records = min(args.records, 2_000)

    root = scratch("bench-collect-")
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root / 'mlflow.db'}"
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    config = yaml.safe_load((ROOT / "pipelines.yaml").read_text())
    pipeline = config["pipelines"][args.pipeline]
    pipeline["collect"]["sources"] = ["logs/*.jsonl"]

    def configure(workers: int) -> None:
        pipeline["collect"]["workers"] = workers
        (root / "pipelines.yaml").write_text(yaml.safe_dump({"pipelines": {args.pipeline: pipeline}}))

    configure(args.workers)
    (root / "logs").mkdir()
    started = time.perf_counter()
    lines = make_records(args.records + args.records // 100)
    lines, later = lines[: args.records], lines[args.records:]  # 1% more, appended after the first runs
    write_records(root / "logs", lines)
    del lines
    size = sum(p.stat().st_size for p in (root / "logs").iterdir())
    print(f"wrote {args.records} records ({size / 1e6:.0f} MB) in {time.perf_counter() - started:.1f}s", flush=True)

    started = time.perf_counter()
    parsed = 0
    for path in sorted((root / "logs").iterdir()):
        with path.open("rb") as handle:
            for line in handle:
                try:
                    json.loads(line)
                    parsed += 1
                except json.JSONDecodeError:
                    pass
    bare_s = time.perf_counter() - started
    print(f"json.loads: {bare_s:.2f}s for {args.records} lines", flush=True)

    from tasks.collect import collect  # after MLFLOW_TRACKING_URI is set

    # A project's MLflow store exists after its first run: creating the database (its schema migrations, ~5 s
    # here) is no cost of collecting, so it is done and timed apart, before the stage is timed
    started = time.perf_counter()
    import mlflow

    mlflow.MlflowClient().search_experiments()
    store_s = time.perf_counter() - started
    print(f"MLflow store created in {store_s:.2f}s (not part of the stage's time)", flush=True)

    from flywheel.config import CollectConfig
    from flywheel.data.collection import workers

    processes = workers(CollectConfig(workers=args.workers))
    started, cpu = time.perf_counter(), cpu_s()
    result = collect.fn(pipeline=args.pipeline, root=str(root))
    stage_s, stage_cpu_s = time.perf_counter() - started, cpu_s() - cpu
    m = result.metrics
    print(f"collect stage: {stage_s:.2f}s ({stage_cpu_s:.1f}s of CPU, {processes} worker processes): "
          f"{m['traces']} traces, {m['quarantined']} quarantined, {m['duplicates']} duplicates, "
          f"redacted {({k: v for k, v in m.items() if k.startswith('redacted_')})}", flush=True)
    peak_mb = peak_rss_mb()  # the generated records, json.loads and the full stage
    worker_peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # the largest worker's
    started = time.perf_counter()
    before = _outputs(root)
    collect.fn(pipeline=args.pipeline, root=str(root))
    rerun_s = time.perf_counter() - started
    unchanged = _outputs(root) == before
    print(f"incremental rerun with nothing new: {rerun_s:.2f}s, tables unchanged: {unchanged}", flush=True)

    last = max((root / "logs").iterdir())
    with last.open("a") as handle:
        handle.write("\n".join(later) + "\n")
    started = time.perf_counter()
    grown = collect.fn(pipeline=args.pipeline, root=str(root))
    grown_s = time.perf_counter() - started
    print(f"incremental run with {len(later)} new records (1%): {grown_s:.2f}s, "
          f"{grown.metrics['traces_new']} new traces", flush=True)
    incremental = _outputs(root)
    configure(1)  # in this process only: the same bytes, and the time the workers save
    started = time.perf_counter()
    full = collect.fn(pipeline=args.pipeline, root=str(root), full=True)
    one_process_s = time.perf_counter() - started
    identical = _outputs(root) == incremental and full.metrics["traces"] == grown.metrics["traces"]
    print(f"full re-collect of the same {args.records + len(later)} records in one process: {one_process_s:.2f}s; "
          f"the same bytes as incremental collection with {processes} workers: {identical}", flush=True)
    one_process_s *= args.records / (args.records + len(later))  # per the first runs' record count
    print(json.dumps({"benchmark": "collect", "records": args.records, "megabytes": round(size / 1e6, 1),
                      "json_loads_records_per_s": round(args.records / bare_s),
                      "collect_stage_records_per_s": round(args.records / stage_s),
                      "collect_stage_s": round(stage_s, 1),
                      "ratio_json_loads_to_stage": round(stage_s / bare_s, 1),
                      "workers": processes, "collect_stage_cpu_s": round(stage_cpu_s, 1),
                      "one_process_stage_s": round(one_process_s, 1),
                      "ratio_json_loads_to_one_process": round(one_process_s / bare_s, 1),
                      "peak_rss_mb": round(peak_mb), "worker_peak_rss_mb": round(worker_peak_mb),
                      "mlflow_store_init_s": round(store_s, 2),
                      "incremental_no_new_s": round(rerun_s, 2), "incremental_no_new_unchanged": unchanged,
                      "incremental_1pct_new_s": round(grown_s, 2), "incremental_1pct_identical_to_full": identical,
                      "load_average": round(os.getloadavg()[0], 1)}))


def _outputs(root: Path) -> dict[str, str]:
    """md5 of each file of the collect stage's output folder."""
    folder = next((root / "data").iterdir()) / "collect"
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


if __name__ == "__main__":
    main()
