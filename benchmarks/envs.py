"""The harness's overhead on a stateful environment: `support` episodes/s with the oracle against bare tool calls.

    .venv/bin/python benchmarks/envs.py [--tasks 2000] [--quick]

Runs the support desk's oracle on generated tasks through the one harness (flywheel.agent.Harness: a fresh
database per episode, each tool call in the tool thread pool with its timeout, the oracle's turns, the rubric,
the teardown), then replays the very same tool calls straight on the tool functions, each episode on its own
fresh database, with nothing else. `ratio` is harness episodes/s over bare episodes/s: the share of the bare
speed the harness keeps. The last line is one JSON object. `--quick` runs 40 tasks, in seconds.
"""

from __future__ import annotations

import argparse
import json
import time
from itertools import islice

from flywheel.agent import Harness, Limits
from flywheel.envs import get_environment
from flywheel.envs.support import db as database
from flywheel.envs.support.tools import BY_NAME
from flywheel.policies.oracle import OraclePolicy


def bare(calls_per_episode: list[list[tuple[str, dict]]], db_seed: int) -> float:
    """Seconds to run every episode's tool calls directly, each episode on a fresh copy of the database."""
    started = time.perf_counter()
    for calls in calls_per_episode:
        state = database.fresh(db_seed)
        for name, arguments in calls:
            BY_NAME[name](**arguments, state=state)
        state.close()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="40 tasks (what the tests run)")
    args = parser.parse_args()
    if args.quick:
        args.tasks = min(args.tasks, 40)

    env = get_environment("support")
    tasks = list(islice(env.generate_tasks(0), args.tasks))
    Harness(env, Limits(max_turns=6)).run(OraclePolicy(env), tasks[:8])  # warm-up: imports, the database image
    started = time.perf_counter()
    episodes = Harness(env, Limits(max_turns=6)).run(OraclePolicy(env), tasks)
    harness_s = time.perf_counter() - started
    failed = [e for e in episodes if not e.passed]
    if failed:
        raise SystemExit(f"{len(failed)} oracle episodes failed; e.g. {failed[0].messages}")
    calls = [[(c["function"]["name"], json.loads(c["function"]["arguments"]))
              for m in e.messages if m["role"] == "assistant" for c in m.get("tool_calls") or []] for e in episodes]
    bare_s = bare(calls, 0)
    n_calls = sum(len(c) for c in calls)
    harness_rate, bare_rate = len(episodes) / harness_s, len(episodes) / bare_s
    print(f"harness: {len(episodes)} episodes ({n_calls} tool calls) in {harness_s:.2f}s = {harness_rate:.0f}/s")
    print(f"bare tool calls: the same {n_calls} calls in {bare_s:.3f}s = {bare_rate:.0f} episodes/s")
    print(json.dumps({"benchmark": "envs", "env": "support", "episodes": len(episodes), "tool_calls": n_calls,
                      "harness_episodes_per_s": round(harness_rate, 1), "bare_episodes_per_s": round(bare_rate, 1),
                      "ratio": round(harness_rate / bare_rate, 4)}))


if __name__ == "__main__":
    main()
