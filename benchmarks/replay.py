"""Replay's speed, and whether its whole-conversation rubric tells the recorded agent from one that does nothing.

    .venv/bin/python benchmarks/replay.py [--traces 300] [--quick]

Builds replay tasks from a banking agent's multi-turn conversations (examples/agent_traces.py: 3 attempts per
scenario, a 0/1 reward, the scenario's expected actions; normalised as collect stores them), then runs each
accepted one through the one harness (flywheel.agent.Harness) with the replay user (the recorded user
turns, one after each answer) and three policies:

- recorded: says exactly what the recorded agent said, turn by turn (must score 1.0: every accepted
  conversation passes its own rubric);
- null: an empty answer, no tool call (must score ~0: the rubric must not pay for doing nothing);
- id-only: asks for the member number after every user turn and does nothing else (~0: a real agent's first
  answer is that question, so a rubric that stops at the first answer pays it in full).

`answered` is the share of the recorded calls whose served result is the recorded one, every call of every
conversation replayed in order (must be 1.0). The last line is one JSON object. `--quick`: 60 traces.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from flywheel.agent import Harness, Limits
from flywheel.data.trace_rows import normalise_messages
from flywheel.envs.replay import ReplayEnv
from flywheel.policies.base import Completion

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from agent_traces import records  # noqa: E402

ASK_ID = "Could you give me your member number, please?"


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


class Says:
    """A policy that answers every turn with one fixed text and never calls a tool."""

    def __init__(self, text: str):
        self.text = text

    def generate(self, conversations: list[list[dict]], tools: list[dict], sampling, **_) -> list[Completion]:
        return [Completion(message={"role": "assistant", "content": self.text}) for _ in conversations]


def trace_row(record: dict) -> dict:
    """A record as the traces table holds it (the fields pipelines.yaml's `replay` pipeline maps)."""
    return {"messages": normalise_messages(record["messages"]), "tools": record["tools"],
            "outcome": "accepted" if record["reward"] >= 1.0 else "rejected", "source": "bank", "split": "train",
            "group": record["task_id"], "scenario": record["info"]["user_goal"],
            "expected_actions": json.dumps(record["info"]["expected_actions"])}


def scores(episodes) -> dict:
    return {"reward_mean": round(sum(e.reward for e in episodes) / len(episodes), 4),
            "pass_rate": round(sum(e.passed for e in episodes) / len(episodes), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="60 traces (what the tests run)")
    args = parser.parse_args()
    n = 60 if args.quick else args.traces

    env = ReplayEnv()
    tasks, turns = [], {}
    for record in records(n):
        trace = trace_row(record)
        task = env.task_from_trace(trace)
        if task is None or trace["outcome"] != "accepted" or task.prompt[-1]["content"] in turns:
            continue  # one opening, one task, as in the tasks table ("Hi, my balances?" opens several)
        tasks.append(task)
        turns[task.prompt[-1]["content"]] = [m for m in trace["messages"] if m["role"] == "assistant"]
    longest = max(len(t) for t in turns.values())

    started = time.perf_counter()
    recorded = Harness(env, Limits(max_turns=longest + 1)).run(Recorded(turns), tasks)
    seconds = time.perf_counter() - started
    null = Harness(env, Limits(max_turns=longest + 1)).run(Says(""), tasks)
    ask_id = Harness(env, Limits(max_turns=longest + 1)).run(Says(ASK_ID), tasks)

    # every recorded call of every conversation, in recorded order, straight to the matcher
    calls = served = 0
    for task in tasks:
        state = env.start(task)
        for name, arguments, result in task.data["calls"]:
            calls += 1
            served += env.call_tool(name, arguments, state) == result
        env.finish(state)
    user_turns = sum(len(t.data["users"]) for t in tasks)
    line = {"traces": n, "tasks": len(tasks), "user_turns": user_turns, "recorded_calls": calls,
            "answered": round(served / max(calls, 1), 6), "unmatched": env.counters["replay_unmatched"],
            "recorded": scores(recorded), "null": scores(null), "id_only": scores(ask_id),
            "episodes_per_s": round(len(recorded) / seconds, 1),
            "messages_per_episode": round(sum(len(e.messages) for e in recorded) / len(recorded), 1)}
    print(f"{len(recorded)} whole conversations ({user_turns} replayed user turns) in {seconds:.2f}s; "
          f"{served}/{calls} recorded calls answered")
    print(json.dumps(line))


if __name__ == "__main__":
    main()
