"""Replay's speed, and whether its matcher answers every recorded call when the recorded conversation is replayed.

    .venv/bin/python benchmarks/replay.py [--traces 400] [--quick]

Builds replay tasks from a banking agent's conversations (examples/agent_traces.py, normalised as collect
stores them), then runs each task through the one harness (flywheel.agent.run_episodes) with a policy that
says exactly what the recorded assistant said: every tool call is answered by the replay environment and the
rubric scores the episode. `answered` is the share of the recorded calls whose served result is the recorded
one, every call of every conversation replayed in order (must be 1.0; `answered_in_episodes`: the same for
the calls the episodes made); `reward_mean` is the rubric's mean over those episodes (1.0: each accepted
trace passes its own rubric). The last line is one JSON object. `--quick` uses 60 traces, in seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from flywheel.agent import run_episodes
from flywheel.data.trace_rows import normalise_messages
from flywheel.envs.replay import ReplayEnv
from flywheel.policies.base import Completion

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from agent_traces import records  # noqa: E402


class Recorded:
    """A policy that gives each conversation's next recorded assistant turn (the recorded agent itself)."""

    def __init__(self, conversations: dict[str, list[dict]]):
        self.turns = conversations  # first user message -> recorded assistant turns

    def generate(self, conversations: list[list[dict]], tools: list[dict], sampling, **_) -> list[Completion]:
        out = []
        for messages in conversations:
            user = next(m["content"] for m in messages if m["role"] == "user")
            done = sum(m["role"] == "assistant" for m in messages)
            out.append(Completion(message=dict(self.turns[user][done])))
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=400)
    parser.add_argument("--quick", action="store_true", help="60 traces (what the tests run)")
    args = parser.parse_args()
    n = 60 if args.quick else args.traces

    env = ReplayEnv()
    tasks, turns = [], {}
    for record in records(n, rejected_every=0):
        messages = normalise_messages(record["messages"])
        task = env.task_from_trace({"messages": messages, "tools": record["tools"], "outcome": "accepted",
                                    "source": "bank", "split": "train"})
        tasks.append(task)
        turns[task.prompt[-1]["content"]] = [m for m in messages if m["role"] == "assistant"]

    started = time.perf_counter()
    episodes = run_episodes(env, Recorded(turns), tasks, max_turns=16)
    seconds = time.perf_counter() - started

    in_episodes = served_in_episodes = 0
    for episode in episodes:
        calls = episode.task.data["calls"][:episode.task.data["target"]]
        results = [m["content"] for m in episode.messages[len(episode.task.prompt):] if m["role"] == "tool"]
        in_episodes += len(calls)
        served_in_episodes += sum(got == call[2] for got, call in zip(results, calls, strict=False))
    # every recorded call of every conversation (later requests too), in recorded order, straight to the matcher
    recorded = served = 0
    for task in tasks:
        state = env.start(task)
        for name, arguments, result in task.data["calls"]:
            recorded += 1
            served += env.call_tool(name, arguments, state) == result
        env.finish(state)
    line = {"traces": len(tasks), "recorded_calls": recorded, "answered": round(served / max(recorded, 1), 6),
            "answered_in_episodes": round(served_in_episodes / max(in_episodes, 1), 6),
            "unmatched": env.counters["replay_unmatched"],
            "reward_mean": round(sum(e.reward for e in episodes) / len(episodes), 6),
            "episodes_per_s": round(len(episodes) / seconds, 1)}
    print(f"{len(episodes)} replay episodes in {seconds:.2f}s; {served}/{recorded} recorded calls answered")
    print(json.dumps(line))


if __name__ == "__main__":
    main()
