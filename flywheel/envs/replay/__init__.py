"""Replay: an agent's accepted traces become verifiable tasks, with no environment written for them.

Each accepted trace is a task (record.py): the prompt is the conversation up to its first user turn, the tools
are the trace's schemas (or ones inferred from its calls). When the model calls a tool, the recorded result of
the matching recorded call answers (matching.py: the same tool, the same arguments once normalised, free text
by word overlap); a call that was never recorded gets "not available in replay: ..." and is counted. The rubric
(rubric.py) is the accepted outcome: the same writes, the answer's facts, optionally a judge.

pipelines.yaml: `environment: {name: replay}` alone, or `replay: {...}` beside another environment, whose
verifiable traces stay its own. Replay cannot check what the record does not show: a write with other
arguments than the recorded ones that would also have been right, or a read whose answer was never recorded.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from flywheel.config import ReplayConfig
from flywheel.contract import Environment, Score, Task, ToolError, prompt_hash, split_of
from flywheel.envs.replay.matching import Call, Matcher, describe
from flywheel.envs.replay.record import UnusableRecord, infer_tools, read_record
from flywheel.envs.replay.rubric import (
    JUDGE_TEMPLATE,
    combine,
    exchange,
    facts_stated,
    final_answer,
    model_calls,
    writes_made,
)

NAME = "replay"


@dataclass
class ReplayState:
    """One replay episode's state: the recorded calls still to answer, and what found no record."""

    matcher: Matcher
    unmatched: list[str] = field(default_factory=list)


@dataclass
class BaseState:
    """The state of an episode of the environment beside replay (its own state, possibly None)."""

    inner: object


class ReplayEnv(Environment):
    """Tasks from traces, tools served from their record, the accepted outcome as the rubric; optionally beside
    a `base` environment that keeps the traces it can verify and the tasks it generates."""

    def __init__(self, cfg: ReplayConfig | None = None, base: Environment | None = None,
                 tasks_table: Path | None = None, root: Path | None = None):
        self.cfg = cfg or ReplayConfig()
        self.base = base
        self.name = NAME if base is None else f"{base.name}+{NAME}"
        self.tasks_table = tasks_table  # the pipeline's tasks: what tools() offers (read on first use)
        self._reads = re.compile(f"(?:{self.cfg.reads})", re.IGNORECASE)
        self._judge = None
        if self.cfg.judge is not None:
            from flywheel.envs.judge import JudgeReward

            judge = self.cfg.judge
            cache = (Path(root or ".") / judge.cache) if judge.cache else None
            self._judge = JudgeReward(JUDGE_TEMPLATE, model=judge.model, base_url=judge.base_url,
                                      api_key_env=judge.api_key_env, cache=cache)
        self._recorded: list[Task] | None = None
        self._made: dict[str, dict] = {}  # tool schemas of the tasks built here (collect), by name

    def _init_runtime(self) -> None:
        super()._init_runtime()
        self._counts = {"tool_calls": 0, "replay_served": 0, "replay_unmatched": 0}

    def counter_parts(self) -> list:
        """The base environment and the judge: their counters join the calls served and unmatched here."""
        return [part for part in (self.base, self._judge) if part is not None]

    # --- tasks

    def recorded_tasks(self) -> list[Task]:
        """The replay tasks of the pipeline's tasks table (none before collect wrote it)."""
        if self._recorded is None:
            tasks = []
            if self.tasks_table is not None and Path(self.tasks_table).exists():
                import pyarrow.parquet as pq

                table = pq.read_table(self.tasks_table).to_pylist()
                tasks = [Task(r["task_id"], r["env"], json.loads(r["prompt"]), r["answer"], r["slice"], r["split"])
                         for r in table if r["env"] == NAME]
            self._recorded = tasks
        return self._recorded

    def tools(self) -> list[dict]:
        """The base environment's tools, then every replay task's (the first schema of a name wins): the model
        sees one tool list in training and in eval."""
        schemas = list(self.base.tools()) if self.base is not None else []
        names = {s["function"]["name"] for s in schemas}
        for schema in [s for t in self.recorded_tasks() for s in t.data["tools"]] + list(self._made.values()):
            if schema["function"]["name"] not in names:
                names.add(schema["function"]["name"])
                schemas.append(schema)
        return schemas

    def generate_tasks(self, seed: int) -> Iterator[Task]:
        """The base environment's generated tasks; replay generates none (its tasks come from traces)."""
        if self.base is not None:
            yield from self.base.generate_tasks(seed)

    def task_from_messages(self, messages: list[dict]) -> Task | None:
        """The base environment's task when it can verify the conversation, else its replay (taken as accepted)."""
        return self.task_from_trace({"messages": messages, "tools": [], "outcome": "accepted", "source": "",
                                     "split": "train"})

    def task_from_trace(self, trace: dict, heldout_fraction: float | None = None) -> Task | None:
        """The task of a traces-table row: the base environment's (split by its id) when it verifies it; else
        the replay of an accepted trace (the trace's split), of a rejected one only with `rejected: eval`."""
        messages = _json(trace["messages"])
        if self.base is not None:
            task = self.base.task_from_messages(messages)
            if task is not None:
                split = split_of(task.task_id, heldout_fraction) if heldout_fraction is not None else task.split
                return Task(task.task_id, task.env, task.prompt, task.answer, task.slice, split)
        outcome = trace.get("outcome")
        if outcome not in ("accepted", "rejected") or (outcome == "rejected" and self.cfg.rejected != "eval"):
            return None  # an unknown outcome is no target; a rejected one never is
        try:
            record = read_record(messages)
        except UnusableRecord:
            return None
        tools = _json(trace.get("tools") or "[]") or infer_tools(record.calls)
        source = trace.get("source") or "traces"
        data = {"source": source, "outcome": outcome, "tools": tools, "target": record.target,
                "calls": [[c.name, c.arguments, c.result] for c in record.calls], "final": record.final,
                "facts": record.facts}
        with self._lock:
            for schema in tools:
                self._made.setdefault(schema["function"]["name"], schema)
        rejected = outcome == "rejected"
        return Task(task_id=prompt_hash(record.prompt), env=NAME, prompt=record.prompt,
                    answer=json.dumps(data, ensure_ascii=False, sort_keys=True),
                    slice=f"{NAME}-rejected/{source}" if rejected else f"{NAME}/{source}",
                    split="heldout" if rejected else trace.get("split") or "train")

    # --- episodes

    def start(self, task: Task) -> ReplayState | BaseState:
        """A replay episode's recorded calls (every one unused), or the base environment's own state."""
        if task.env != NAME:
            return BaseState(self.base.start(task))
        calls = [Call(name, arguments, result) for name, arguments, result in task.data["calls"]]
        return ReplayState(Matcher(calls, self.cfg.fuzzy))

    def finish(self, state: object) -> None:
        """Tear down the base environment's state (a replay episode holds nothing to release)."""
        if isinstance(state, BaseState) and state.inner is not None:
            self.base.finish(state.inner)

    def call_tool(self, name: str, arguments: dict, state: object = None) -> str:
        """The recorded result of the matching recorded call; a ToolError "not available in replay" otherwise."""
        if isinstance(state, BaseState):
            return self.base.call_tool(name, arguments, state.inner)
        if not isinstance(state, ReplayState):
            if self.base is not None and state is not None:
                return self.base.call_tool(name, arguments, state)
            raise ToolError("replay answers tool calls within an episode (start(task) first)")
        self.count("tool_calls")
        result = state.matcher.answer(name, arguments)
        if result is not None:
            self.count("replay_served")
            return result
        self.count("replay_unmatched")
        state.unmatched.append(describe(name, arguments))
        if all(c.name != name for c in state.matcher.calls):
            recorded = sorted({c.name for c in state.matcher.calls})
            raise ToolError(f"not available in replay: no call of '{name}' was recorded for this conversation "
                            f"(recorded tools: {', '.join(recorded) or 'none'})")
        raise ToolError(f"not available in replay: {describe(name, arguments)} was not recorded for this "
                        "conversation (no recorded call has these arguments)")

    def score(self, task: Task, messages: list[dict], state: object = None) -> Score:
        """The base environment's rubric for its tasks; for replay tasks: writes, facts and the optional judge."""
        if task.env != NAME:
            return self.base.score(task, messages, state.inner if isinstance(state, BaseState) else state)
        data = task.data
        recorded = [Call(name, arguments, result) for name, arguments, result in data["calls"][:data["target"]]]
        answer = final_answer(task, messages)
        parts = {"writes": writes_made(recorded, model_calls(task, messages), self._reads, self.cfg.fuzzy),
                 "facts": facts_stated(data["facts"], answer)}
        weights = {"writes": self.cfg.writes_weight, "facts": self.cfg.facts_weight}
        if self._judge is not None:
            # the judge sees the exchange the rubric scores: a recorded conversation goes on after its first
            # answer, and the judge's {final} (the last assistant message) would otherwise be a later one
            reference = Task(task.task_id, task.env, task.prompt, json.dumps(data["final"]), task.slice, task.split)
            scored = task.prompt + exchange(task, messages)
            parts["judge"] = float(self._judge(reference, scored)) if answer is not None else 0.0
            weights["judge"] = self.cfg.judge.weight
        return combine(parts, weights, inverted=data["outcome"] == "rejected")

    def solve(self, messages: list[dict], state: object = None) -> dict:
        """The base environment's scripted solver for its tasks; replay has none."""
        if isinstance(state, BaseState):
            return self.base.solve(messages, state.inner)
        raise NotImplementedError(f"environment '{self.name}': replay tasks have no scripted solver, so the oracle "
                                  "cannot teach them; use a model teacher (teacher.policy: openai)")


def _json(value):
    return json.loads(value) if isinstance(value, str | bytes) else value


def make_env(**options) -> ReplayEnv:
    """Replay alone with these options (flywheel.config.ReplayConfig); pipelines use `environment: {name:
    replay}`, which also offers the tools of the pipeline's collected traces."""
    return ReplayEnv(ReplayConfig(**options))


def build(cfg: ReplayConfig, base: Environment | None, root: Path, tasks_table: Path | None) -> ReplayEnv:
    """The replay environment of a pipeline: over `base` (None: replay alone), its tools from `tasks_table`."""
    return ReplayEnv(cfg, base, tasks_table, root)


ENVIRONMENT = make_env
