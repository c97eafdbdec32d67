"""Replay: an agent's accepted traces become verifiable tasks, with no environment written for them.

Each accepted trace is a task (record.py): a whole conversation. The prompt is the conversation up to its first
user turn; after each of the agent's answers a user simulator speaks (environment.user): `replay` (the
default) gives the recorded user turns in order and ends the conversation when they run out; `openai` has an
LLM play the user from the record's scenario (or one written once from the recorded conversation); `none`
ends it at the first answer. The tools are the trace's schemas (or ones inferred from its calls). When the
model calls a tool, the recorded result of the matching recorded call answers (matching.py: the same tool, the
same arguments once normalised, free text by word overlap); a call that was never recorded gets "not available
in replay: ..." and is counted. The rubric (rubric.py) is the accepted outcome over the whole conversation:
the same writes (writes.py: tools known by what they do, errored calls changing nothing, arguments compared by
their rule; with expected actions, what the label and the recording agree on), the answers' facts, optionally a
judge.

pipelines.yaml: `environment: {name: replay}` alone, or `replay: {...}` beside another environment, whose
verifiable traces stay its own. Replay cannot check what the record does not show: a write with other
arguments than the recorded ones that would also have been right, or a read whose answer was never recorded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from flywheel.config import ReplayConfig, UserConfig
from flywheel.contract import Environment, Score, Task, ToolError, UserError, prompt_hash, split_of
from flywheel.data.tasksets import row_task
from flywheel.envs.replay.matching import Call, Matcher, describe
from flywheel.envs.replay.record import Record, UnusableRecord, infer_tools, read_record
from flywheel.envs.replay.rubric import (
    JUDGE_TEMPLATE,
    answers,
    combine,
    facts_stated,
    scored_part,
)
from flywheel.envs.replay.writes import (
    ARGUMENT_TEMPLATE,
    Agreement,
    WriteRules,
    agreement,
    model_writes,
    recorded_writes,
    writes_match,
)

NAME = "replay"


@dataclass
class ReplayState:
    """One replay episode's state: the recorded calls still to answer, and what found no record."""

    matcher: Matcher
    unmatched: list[str] = field(default_factory=list)
    said: int = 0  # the recorded user turns given so far (the replay user)


@dataclass
class BaseState:
    """The state of an episode of the environment beside replay (its own state, possibly None)."""

    inner: object


class ReplayEnv(Environment):
    """Tasks from traces, tools served from their record, the accepted outcome as the rubric; optionally beside
    a `base` environment that keeps the traces it can verify and the tasks it generates."""

    _runtime_fields = (*Environment._runtime_fields, "_llm_user")  # an HTTP client: built again where used

    def __init__(self, cfg: ReplayConfig | None = None, base: Environment | None = None,
                 tasks_table: Path | None = None, root: Path | None = None, user: UserConfig | None = None):
        self.cfg = cfg or ReplayConfig()
        self.user = user or UserConfig()
        self.root = Path(root or ".")
        self.base = base
        self.name = NAME if base is None else f"{base.name}+{NAME}"
        self.tasks_table = tasks_table  # the pipeline's tasks: what tools() offers (read on first use)
        self._named: set[str] = set()  # the tools the expected actions of the tasks built here name
        self._judge = self._arguments_judge = None
        if self.cfg.judge is not None:
            from flywheel.envs.judge import JudgeReward

            self._judge = JudgeReward.from_config(JUDGE_TEMPLATE, self.cfg.judge, root)
            self._arguments_judge = JudgeReward.from_config(ARGUMENT_TEMPLATE, self.cfg.judge, root)
            self._arguments_judge.__name__ = "argument_judge"
        self.rules = WriteRules.from_config(self.cfg, self._arguments_judge)
        self._recorded: list[Task] | None = None
        # read once from the recorded tasks (each score and episode asks; parsing every task's JSON each time
        # made the replay check quadratic in the tasks): the names their expected actions give, their tools
        self._recorded_named: set[str] = set()
        self._recorded_tools: list[dict] = []
        self._made: dict[str, dict] = {}  # tool schemas of the tasks built here (collect), by name

    def _init_runtime(self) -> None:
        super()._init_runtime()
        self._counts = {"tool_calls": 0, "replay_served": 0, "replay_unmatched": 0}
        self._llm_user = None

    def counter_parts(self) -> list:
        """The base environment, the judge and the LLM user: their counters join the calls served here."""
        return [part for part in (self.base, self._judge, self._arguments_judge, self._llm_user) if part is not None]

    def llm_user(self):
        """The LLM that plays the user (environment.user: openai), built on first use in this process."""
        with self._lock:
            if self._llm_user is None:
                from flywheel.envs.users import LLMUser

                self._llm_user = LLMUser.from_config(self.user, self.root)
            return self._llm_user

    # --- tasks

    def recorded_tasks(self) -> list[Task]:
        """The replay tasks of the pipeline's tasks table (none before collect wrote it)."""
        if self._recorded is None:
            tasks = []
            if self.tasks_table is not None and Path(self.tasks_table).exists():
                import pyarrow.parquet as pq

                table = pq.read_table(self.tasks_table).to_pylist()
                tasks = [row_task(r) for r in table if r["env"] == NAME]
            self._take(tasks)
        return self._recorded

    def use_tasks(self, tasks: list[Task]) -> None:
        """Take these as the pipeline's tasks (collect, once it built them: the table read before is stale)."""
        self._take([t for t in tasks if t.env == NAME])

    def _take(self, tasks: list[Task]) -> None:
        self._recorded = tasks
        data = [t.data for t in tasks]
        self._recorded_named = {name for d in data for name, _ in d.get("expected") or []}
        self._recorded_tools = [s for d in data for s in d["tools"]]

    def tools(self) -> list[dict]:
        """The base environment's tools, then every replay task's (the first schema of a name wins): the model
        sees one tool list in training and in eval."""
        schemas = list(self.base.tools()) if self.base is not None else []
        names = {s["function"]["name"] for s in schemas}
        self.recorded_tasks()
        for schema in self._recorded_tools + list(self._made.values()):
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
        """The task of a traces-table row: the base environment's (split by its id, or its group) when it
        verifies it; else the replay of an accepted trace (the trace's split), of a rejected one only with
        `rejected: eval`."""
        messages = _json(trace["messages"])
        if self.base is not None:
            task = self.base.task_from_messages(messages)
            if task is not None:
                group = trace.get("group") or ""
                if heldout_fraction is not None:
                    task = replace(task, split=split_of(group or task.task_id, heldout_fraction))
                return replace(task, group=group)
        outcome = trace.get("outcome")
        if outcome not in ("accepted", "rejected") or (outcome == "rejected" and self.cfg.rejected != "eval"):
            return None  # an unknown outcome is no target; a rejected one never is
        whole = self.user.kind != "none"
        try:
            record = read_record(messages, whole=whole)
        except UnusableRecord:
            return None
        # the label's own writes (those of the whole conversation) are the target; a rejected trace's task asks
        # that its own writes not be repeated
        expected = _json(trace.get("expected_actions") or "null") if outcome == "accepted" and whole else None
        # ({name, kwargs} too: collect stores {name, arguments}, a trace given here may be as its log wrote it)
        expected = None if expected is None else [[a["name"], a.get("arguments", a.get("kwargs", {}))]
                                                  for a in expected]
        tools = _json(trace.get("tools") or "[]") or infer_tools(record.calls)
        source = trace.get("source") or "traces"
        data = {"source": source, "outcome": outcome, "tools": tools, "target": record.target,
                "calls": [[c.name, c.arguments, c.result] for c in record.calls], "answers": record.answers,
                "facts": record.facts, "whole": whole, "users": record.users,
                "expected": expected, **self._scenario(trace.get("scenario") or "", messages, record)}
        task = Task(task_id=prompt_hash(record.prompt), env=NAME, prompt=record.prompt,
                    answer=json.dumps(data, ensure_ascii=False, sort_keys=True), slice=f"{NAME}/{source}",
                    split=trace.get("split") or "train", group=trace.get("group") or "")
        named = self.named() | {name for name, _ in expected or []}
        if not self.agreement(task, named).required and not record.facts and self._judge is None:
            return None  # nothing the rubric could check: an empty answer would pass it
        with self._lock:
            self._named.update(name for name, _ in expected or [])
            for schema in tools:
                self._made.setdefault(schema["function"]["name"], schema)
        if outcome == "rejected":
            return replace(task, slice=f"{NAME}-rejected/{source}", split="heldout")
        return task

    def _scenario(self, given: str, messages: list[dict], record: Record) -> dict:
        """The user's goal for an LLM user: the record's, else one the user's model writes once from the recorded
        conversation (cached), else the recorded user turns themselves; `scenario_by` says which."""
        if given or self.user.kind != "openai":
            return {"scenario": given, "scenario_by": "record" if given else ""}
        try:
            return {"scenario": self.llm_user().write_scenario(messages), "scenario_by": "written"}
        except UserError:
            self.count("scenarios_unwritten")
            said = [m["content"] for m in [*record.prompt, *record.users] if m.get("role") == "user"]
            return {"scenario": "Say, in turn, when the assistant answers: " + " | ".join(said),
                    "scenario_by": "recorded turns"}

    # --- what changed state

    def named(self) -> set[str]:
        """The tools the logs' expected actions name (every collected task's, and those built here)."""
        self.recorded_tasks()
        return self._named | self._recorded_named

    def agreement(self, task: Task, named: set[str] | None = None) -> Agreement:
        """The writes a replay task requires and allows, and where its label and its recording disagree."""
        named = self.named() if named is None else named
        data = task.data
        recorded = recorded_writes(data["calls"][:data["target"]], self.rules, named)
        return agreement(data.get("expected"), recorded, self.rules, named)

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

    def user_turn(self, task: Task, messages: list[dict], state: object = None) -> dict | None:
        """The base environment's user for its tasks; for a whole replay conversation the next recorded user
        turn (none left: it ends), or the LLM user's reply (environment.user: openai)."""
        if isinstance(state, BaseState):
            return self.base.user_turn(task, messages, state.inner)
        if not isinstance(state, ReplayState) or self.user.kind == "none" or not task.data.get("whole"):
            return None
        if self.user.kind == "openai":
            return self.llm_user().reply(task.data["scenario"], messages)
        users = task.data["users"]
        if state.said >= len(users):
            return None
        state.said += 1
        return dict(users[state.said - 1])

    def score(self, task: Task, messages: list[dict], state: object = None) -> Score:
        """The base environment's rubric for its tasks; for replay tasks: writes, facts and the optional judge,
        each part weighed only where there is something to check (rubric.py)."""
        if task.env != NAME:
            return self.base.score(task, messages, state.inner if isinstance(state, BaseState) else state)
        data, named = task.data, self.named()
        agreed = self.agreement(task, named)
        made = model_writes(scored_part(task, messages), self.rules, named)
        said = answers(task, messages)
        parts, weights = {}, {}
        if agreed.required or made:
            parts["writes"] = writes_match(agreed.required, agreed.allowed, made, self.rules)
            weights["writes"] = self.cfg.writes_weight
        if data["facts"]:
            parts["facts"] = facts_stated(data["facts"], said)
            weights["facts"] = self.cfg.facts_weight
        if self._judge is not None:
            # the judge sees the part the rubric scores, beside the accepted answers
            reference = Task(task.task_id, task.env, task.prompt, json.dumps(data["answers"]), task.slice, task.split)
            parts["judge"] = float(self._judge(reference, task.prompt + scored_part(task, messages))) if said else 0.0
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


def build(cfg: ReplayConfig, base: Environment | None, root: Path, tasks_table: Path | None,
          user: UserConfig | None = None) -> ReplayEnv:
    """The replay environment of a pipeline: over `base` (None: replay alone), its tools from `tasks_table`,
    its user simulator `user` (environment.user)."""
    return ReplayEnv(cfg, base, tasks_table, root, user)


ENVIRONMENT = make_env
