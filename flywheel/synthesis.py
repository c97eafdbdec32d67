"""Rejection sampling: which teacher episodes become training targets, and the synthetic table's rows."""

from __future__ import annotations

import hashlib
import json

import pandas as pd

from flywheel.agent import Episode
from flywheel.contract import Environment, conversation_hash


def select_targets(episodes: list[Episode], best_only: bool) -> set[int]:
    """Indexes of the episodes kept as targets: every one the rubric passed, or the best passing one per task
    (never one whose simulated user failed: its conversation is not one the task would have had)."""
    passed = [i for i, e in enumerate(episodes) if e.passed and e.scored]
    if not best_only:
        return set(passed)
    best: dict[str, tuple[tuple, int]] = {}
    for i in passed:
        e = episodes[i]
        # highest reward, then the shortest episode, then the first sample: the same pick on every rerun
        rank = (-e.reward, e.turns, episode_tokens(e, "completion_tokens"), e.sample)
        if e.task.task_id not in best or rank < best[e.task.task_id][0]:
            best[e.task.task_id] = (rank, i)
    return {i for _, i in best.values()}


def sample_row(e: Episode, accepted: bool, teacher: str, tools: str) -> dict:
    """One row of the synthetic table; latencies come from the answers themselves (cached ones included)."""
    return {
        "sample_id": hashlib.sha256(f"{e.task.task_id}:{e.sample}".encode()).hexdigest()[:16],
        "task_id": e.task.task_id,
        "teacher": teacher,
        "messages": json.dumps(e.messages, ensure_ascii=False),
        "tools": tools,
        "reward": e.reward,
        "breakdown": json.dumps(e.breakdown, sort_keys=True),
        "accepted": accepted,
        "tokens_in": episode_tokens(e, "prompt_tokens"),
        "tokens_out": episode_tokens(e, "completion_tokens"),
        "latency_s": round(sum(c.latency_s for c in e.completions), 6),
    }


def trace_rows(traces: pd.DataFrame, env: Environment, heldout_prompts: set[str], heldout_fraction: float,
               heldout_groups: set[str] = frozenset()) -> list[dict]:
    """Train traces with outcome 'accepted' as targets; the rubric has the last word where it can check them.

    Each row carries the tools the model is shown for its task in RL and evaluate (env.tools(), the same list
    the teacher's rows carry), not the ones the agent happened to log: one harness for training and eval."""
    rows = []
    tools = json.dumps(env.tools(), ensure_ascii=False)
    for trace in traces.sort_values("trace_id").to_dict("records"):
        if trace["outcome"] != "accepted" or trace["split"] != "train":
            continue
        messages = json.loads(trace["messages"])
        if conversation_hash(messages) in heldout_prompts or (trace.get("group") or "") in heldout_groups - {""}:
            continue  # never train on a held-out prompt or scenario, whatever its trace says
        task = env.task_from_trace(trace, heldout_fraction)
        if task is not None:
            score = env.score(task, messages)
            reward, passed, breakdown = score.reward, score.passed, dict(score.breakdown)
        else:
            reward = min(max(float(trace["score"]), 0.0), 1.0) if pd.notna(trace["score"]) else 1.0
            passed, breakdown = True, {}
        # content null beside tool calls becomes "", as the teacher's own turns have it: one shape for SFT
        messages = [{**m, "content": m.get("content") or ""} for m in messages]
        rows.append({"sample_id": f"trace-{trace['trace_id']}", "task_id": task.task_id if task else trace["trace_id"],
                     "teacher": "trace", "messages": json.dumps(messages, ensure_ascii=False),
                     "tools": tools, "reward": reward,
                     "breakdown": json.dumps(breakdown, sort_keys=True), "accepted": passed,
                     "tokens_in": 0, "tokens_out": 0, "latency_s": 0.0})
    return rows


def episode_tokens(e: Episode, kind: str) -> int:
    return sum(int(c.usage.get(kind, 0)) for c in e.completions)
