"""Rejection sampling: which teacher episodes become training targets, and the synthetic table's rows."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass

import pandas as pd

from flywheel.agent import Episode
from flywheel.contract import Environment, Task, conversation_hash


@dataclass
class Selection:
    """What rejection sampling kept of the teacher's episodes, and why the rest went.

    rejected: samples the rubric failed (or whose simulated user failed); duplicates: passing samples whose whole
    conversation equals an earlier passing sample of the same task (a deterministic teacher, or a sampling one
    that said the same thing twice): training on n copies weighs that task n times, so one is kept."""

    targets: set[int]
    samples: int
    rejected: int
    duplicates: int
    kept_per_task: dict[str, int]  # task id -> targets kept (0 for a task every sample of which failed)
    failed_tasks: list[str]  # tasks where no sample passed, in the order they ran

    def distribution(self) -> dict[int, int]:
        """How many tasks kept k targets, by k (0 first)."""
        return dict(sorted(Counter(self.kept_per_task.values()).items()))

    def metrics(self) -> dict:
        """As the synthesize stage logs it: synth.samples, .rejected, .duplicates, the tasks where every sample
        failed, and how many tasks kept k targets (synth.tasks_kept_<k>)."""
        return {"synth.samples": self.samples, "synth.rejected": self.rejected, "synth.duplicates": self.duplicates,
                "synth.tasks_all_failed": len(self.failed_tasks),
                **{f"synth.tasks_kept_{k}": count for k, count in self.distribution().items()}}

    def line(self, n: int) -> str:
        """Rejected and duplicate samples and, with n > 1 samples a task, how many targets each task kept."""
        if not self.samples:
            return ""
        said = f" ({self.rejected} failed the rubric, {self.duplicates} duplicate(s) dropped"
        if n > 1:
            said += "; tasks by targets kept: " + ", ".join(f"{k}: {c}" for k, c in self.distribution().items())
        return said + ")"

    def failed_warning(self, env: Environment, tasks: list[Task], shown: int = 3) -> str:
        """The train tasks where every teacher sample failed: SFT has no target for them (the first few named)."""
        by_id = {t.task_id: t for t in tasks}
        names = "; ".join(env.describe_task(by_id[task_id]) for task_id in self.failed_tasks[:shown])
        more = f" and {len(self.failed_tasks) - shown} more" if len(self.failed_tasks) > shown else ""
        return (f"synthesize: on {len(self.failed_tasks)} of {len(self.kept_per_task)} train task(s) every teacher "
                f"sample failed the rubric, so SFT has no target for them: {names}{more}")


def select_targets(episodes: list[Episode], best_only: bool) -> set[int]:
    """Indexes of the episodes kept as targets (Selection.targets)."""
    return select(episodes, best_only).targets


def select(episodes: list[Episode], best_only: bool) -> Selection:
    """The episodes kept as targets: every one the rubric passed, less exact duplicates of an earlier one of the
    same task, or the best passing one per task (never one whose simulated user failed: its conversation is not
    one the task would have had)."""
    passed = [i for i, e in enumerate(episodes) if e.passed and e.scored]
    seen: set[tuple[str, str]] = set()
    unique = []
    for i in passed:
        key = (episodes[i].task.task_id, json.dumps(episodes[i].messages, sort_keys=True, ensure_ascii=False))
        if key not in seen:
            seen.add(key)
            unique.append(i)
    targets = set(unique)
    if best_only:
        best: dict[str, tuple[tuple, int]] = {}
        for i in unique:
            e = episodes[i]
            # highest reward, then the shortest episode, then the first sample: the same pick on every rerun
            rank = (-e.reward, e.turns, episode_tokens(e, "completion_tokens"), e.sample)
            if e.task.task_id not in best or rank < best[e.task.task_id][0]:
                best[e.task.task_id] = (rank, i)
        targets = {i for _, i in best.values()}
    kept = dict.fromkeys((e.task.task_id for e in episodes), 0)
    for i in targets:
        kept[episodes[i].task.task_id] += 1
    return Selection(targets=targets, samples=len(episodes), rejected=len(episodes) - len(passed),
                     duplicates=len(passed) - len(unique), kept_per_task=kept,
                     failed_tasks=[t for t, n in kept.items() if n == 0])


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
