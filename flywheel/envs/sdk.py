"""The environment SDK: an environment is plain typed Python functions, a task source and a weighted rubric.

    from flywheel.envs.sdk import Env, Reward, tasks_from_file, ToolError

    def lookup_order(order_id: str, state: Db) -> str:
        \"\"\"Look up an order by its id.

        Args:
            order_id: the order's id, e.g. "O-1001"
        \"\"\"

    def make_env() -> Env:                   # pipelines.yaml: environment: {factory: "envs.shop:make_env"}
        return Env(name="shop", tools=[lookup_order], tasks=tasks_from_file("envs/shop/tasks.jsonl"),
                   rewards=[Reward(correct_state, weight=0.7), Reward(answer_has_facts, weight=0.3)],
                   setup=Db.fresh, teardown=Db.close)

Tool schemas are generated from each function's signature and docstring (tool_schemas.py), never written by
hand; task files are read and checked row by row (task_files.py). A parameter named `state` receives the
episode's state (what `setup(task)` returned) and is not part of the schema. Tools run in the harness's tool
threads, one call at a time per episode: a state that holds a SQLite connection opens it with
`check_same_thread=False`. Async tools run on one event loop the environment owns.

A conversation goes on after the agent's answer when the environment has a user (`user=`): a function
`user(task, messages)` or `user(task, messages, state)` that returns the user's next text (or a message), or None,
or text holding `###STOP###` (STOP) to end it; or an `LLMUser` (flywheel/envs/users.py), a model playing the
scenario of the task (its answer's `scenario` field, else its first user message). Without one, the conversation
ends at the agent's first answer. A user that raises ends the episode as `user_error`, never scored:

    def customer(task: Task, messages: list[dict]) -> str | None:
        said = messages[-1]["content"].lower()
        if "order id" in said:
            return f"It is {task.data['order_id']}."
        return STOP                          # anything else: the customer is done

    Env(name="shop", ..., user=customer)     # or user=LLMUser(model="gpt-4.1-mini", base_url=...)
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import math
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from flywheel.contract import (
    STOP,
    Environment,
    RubricError,
    Score,
    Task,
    ToolError,
    UserError,
    opening,
    prompt_excerpt,
    prompt_hash,
)
from flywheel.envs.task_files import TaskFile, tasks_from_file
from flywheel.envs.tool_schemas import SchemaError, Tool, check_arguments, tool_schema

__all__ = ["Env", "Reward", "Score", "Task", "ToolError", "SchemaError", "RubricError", "UserError", "STOP",
           "tasks_from_file", "tool_schema", "TaskFile"]

COUNTERS = ("tool_calls", "tool_errors", "tool_refusals", "tool_bad_returns", "tool_timeouts", "bad_calls")


@dataclass(frozen=True)
class Reward:
    """One weighted part of the rubric: fn(task, messages, state) -> float in [0, 1], logged under `name`."""

    fn: Callable
    weight: float = 1.0
    name: str | None = None

    @property
    def label(self) -> str:
        """The breakdown key: `name`, else the function's name."""
        return self.name or getattr(self.fn, "__name__", type(self.fn).__name__)


def _arity(fn: Callable) -> int:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 3
    if any(p.kind == p.VAR_POSITIONAL for p in parameters):
        return 3
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)


class Env(Environment):
    """An environment from typed tools, tasks (a file or a seeded generator) and weighted reward functions."""

    _runtime_fields = (*Environment._runtime_fields, "_loop")  # the async tools' event loop

    def __init__(self, name: str, tools: Iterable[Callable], tasks: Callable[[int], Iterable[Task]],
                 rewards: Iterable[Reward | Callable], passed: float | str = 1.0,
                 setup: Callable[[Task], object] | None = None, teardown: Callable[[object], None] | None = None,
                 solver: Callable | None = None, task_from_messages: Callable[[list[dict]], Task | None] | None = None,
                 tool_sources: Iterable = (), audits: Iterable[Reward | Callable] = (),
                 user: Callable | None = None):
        self.name = name
        self._tools = {}
        for fn in tools:
            tool = Tool.of(fn)
            if tool.schema["function"]["name"] in self._tools:
                raise SchemaError(f"environment '{name}': two tools named '{tool.schema['function']['name']}'")
            self._tools[tool.schema["function"]["name"]] = tool
        self._tasks = tasks
        self.rewards = [r if isinstance(r, Reward) else Reward(r) for r in rewards]
        if not self.rewards or sum(r.weight for r in self.rewards) <= 0 or any(r.weight < 0 for r in self.rewards):
            raise ValueError(f"environment '{name}': the rubric needs at least one reward, weights >= 0 and a "
                             "positive total weight")
        labels = [r.label for r in self.rewards]
        if len(set(labels)) != len(labels):
            raise ValueError(f"environment '{name}': two rewards named alike ({labels}); give one Reward(name=...)")
        if isinstance(passed, str) and passed not in labels:
            raise ValueError(f"environment '{name}': passed='{passed}' names no reward (rewards: {labels})")
        self.passed = passed
        # Audit checks: stricter verifiers than the reward, never trained on; the RL monitor watches them
        # (flywheel/train/rl/monitor.py). Same signature as a reward; an episode passes when every one gives 1.
        self.audits = [a if isinstance(a, Reward) else Reward(a) for a in audits]
        self.setup, self.teardown, self.solver = setup, teardown, solver
        self._task_from_messages = task_from_messages
        self.tool_sources = list(tool_sources)
        self._source_of: dict[str, object] | None = None  # tool name -> its source, listed on first use
        self._by_prompt: dict[str, Task] | None = None  # a task file's tasks by prompt hash, on first use
        # who answers the agent: a function of (task, messages[, state]), an LLMUser (it has `reply`), or None
        if user is not None and not callable(user) and not hasattr(user, "reply"):
            raise TypeError(f"environment '{name}': user must be a function user(task, messages[, state]) or an "
                            f"LLMUser, not {type(user).__name__}")
        self.user = user

    def _init_runtime(self) -> None:
        super()._init_runtime()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._loop: asyncio.AbstractEventLoop | None = None

    def counter_parts(self) -> list:
        """Its reward functions, tool sources and user: a judge counts its verdicts, an MCP server its calls, an
        LLM user its requests."""
        return [r.fn for r in self.rewards] + self.tool_sources + ([self.user] if self.user is not None else [])

    # --- the environment contract (flywheel/contract.py)

    def tools(self) -> list[dict]:
        """The function schemas: the Python tools' (generated), then each tool source's."""
        return [t.schema for t in self._tools.values()] + [s for source in self._sources() for s in source.tools()]

    def _sources(self) -> list:
        if self._source_of is None and self.tool_sources:
            found = {}
            for source in self.tool_sources:
                for schema in source.tools():
                    found.setdefault(schema["function"]["name"], source)
            self._source_of = found
        return self.tool_sources

    def generate_tasks(self, seed: int) -> Iterator[Task]:
        """The task source's stream for `seed`, each task stamped with this environment's name."""
        for task in self._tasks(seed):
            yield task if task.env == self.name else dataclasses.replace(task, env=self.name)

    def task_from_messages(self, messages: list[dict]) -> Task | None:
        """The given function's answer; for file tasks, the task whose prompt opens the conversation."""
        if self._task_from_messages is not None:
            return self._task_from_messages(messages)
        if not isinstance(self._tasks, TaskFile):
            return None
        if self._by_prompt is None:
            self._by_prompt = {t.task_id: dataclasses.replace(t, env=self.name) for t in self._tasks.tasks}
        start = opening(messages)
        return None if start is None else self._by_prompt.get(prompt_hash(start))

    def describe_task(self, task: Task) -> str:
        """A task file's task as its path and row with the prompt's opening; any other as the contract says."""
        found = self._tasks
        if isinstance(found, TaskFile) and task.task_id in found.rows:
            path = found.path.resolve()
            shown = path.relative_to(found.root.resolve()) if found.root and path.is_relative_to(found.root.resolve()) \
                else path
            return f"{shown}: row {found.rows[task.task_id]} ({prompt_excerpt(task.prompt)})"
        return super().describe_task(task)

    def start(self, task: Task) -> object:
        """The episode's own state: setup(task), or None without a setup."""
        return self.setup(task) if self.setup else None

    def finish(self, state: object) -> None:
        """Tear the episode's state down (teardown(state))."""
        if self.teardown and state is not None:
            self.teardown(state)

    def user_turn(self, task: Task, messages: list[dict], state: object = None) -> dict | None:
        """The user's next message after the agent's answer; None when there is no user or it ended the
        conversation (None, or text holding STOP). A user that fails raises UserError naming this environment."""
        user = self.user
        if user is None:
            return None
        if hasattr(user, "reply"):  # an LLMUser plays the task's scenario
            try:
                return user.reply(_scenario(task), messages)
            except UserError as err:
                raise UserError(f"environment '{self.name}', task {task.task_id}: {err}") from None
        who = getattr(user, "__name__", type(user).__name__)
        try:
            said = user(task, messages, state) if _arity(user) >= 3 else user(task, messages)
        except Exception as err:  # the script's bug: the episode is left out, never the agent's failure
            raise UserError(f"environment '{self.name}': user '{who}' raised {type(err).__name__}: {err} "
                            f"(task {task.task_id})") from None
        if said is None:
            return None
        if isinstance(said, dict) and isinstance(said.get("content"), str) and said.get("role", "user") == "user":
            said = said["content"]
        if not isinstance(said, str):
            raise UserError(f"environment '{self.name}': user '{who}' returned {type(said).__name__} "
                            f"{repr(said)[:60]}; a user returns its text, a user message or None (task "
                            f"{task.task_id})")
        return None if STOP in said else {"role": "user", "content": said}

    def call_tool(self, name: str, arguments: dict, state: object = None) -> str:
        """Check the arguments against the schema, run the tool in `state`; every failure is a ToolError."""
        return self._call(name, arguments, state, counted=True)

    def _call(self, name: str, arguments: dict, state: object, counted: bool) -> str:
        count = self.count if counted else (lambda key, n=1: None)
        count("tool_calls")
        self._sources()
        tool = self._tools.get(name)
        source = (self._source_of or {}).get(name)
        if tool is None and source is None:
            names = list(self._tools) + list(self._source_of or {})
            count("bad_calls")
            if len(names) == 1:
                raise ToolError(f"unknown tool '{name}'; the only tool is '{names[0]}'")
            raise ToolError(f"unknown tool '{name}'; the tools are {', '.join(repr(n) for n in names)}")
        if not isinstance(arguments, dict):
            count("bad_calls")
            raise ToolError("arguments must be a JSON object")
        try:
            if tool is not None:
                check_arguments(tool.schema, arguments)
        except ToolError:
            count("bad_calls")
            raise
        try:
            if tool is None:
                result = source.call_tool(name, arguments, state)
            else:
                kwargs = {k: tool.enums[k](v) if k in tool.enums else v for k, v in arguments.items()}
                if tool.wants_state:
                    kwargs["state"] = state
                result = tool.fn(**kwargs)
            if inspect.isawaitable(result):
                result = asyncio.run_coroutine_threadsafe(_awaited(result), self._event_loop()).result()
        except ToolError:
            count("tool_refusals")
            raise
        except Exception as err:  # a tool's bug is the model's error message and a count, never a crash
            count("tool_errors")
            raise ToolError(f"tool '{name}' failed: {type(err).__name__}: {err}") from None
        if not isinstance(result, str):
            count("tool_bad_returns")
            raise ToolError(f"tool '{name}' returned {type(result).__name__}, not a string")
        return result

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name=f"{self.name}-tools", daemon=True).start()
                self._loop = loop
            return self._loop

    def score(self, task: Task, messages: list[dict], state: object = None) -> Score:
        """The weighted rubric; state None with a setup: replay the conversation's tool calls in a fresh state."""
        if state is None and self.setup is not None:
            state = self.start(task)
            try:
                self._replay(messages, state)
                return self._rubric(task, messages, state)
            finally:
                self.finish(state)
        return self._rubric(task, messages, state)

    def audit(self, task: Task, messages: list[dict], state: object = None) -> dict[str, float] | None:
        """Each audit check's value for a finished episode (None: the environment declares no audit checks)."""
        if not self.audits:
            return None
        if state is None and self.setup is not None:  # replay the calls in a fresh state, as score does
            state = self.start(task)
            try:
                self._replay(messages, state)
                return self._checks(self.audits, task, messages, state, "audit")
            finally:
                self.finish(state)
        return self._checks(self.audits, task, messages, state, "audit")

    def _replay(self, messages: list[dict], state: object) -> None:
        for message in messages:
            if message.get("role") != "assistant":
                continue
            for call in message.get("tool_calls") or []:
                fn = call.get("function") or {}
                try:
                    arguments = json.loads(fn.get("arguments") or "{}")
                    self._call(fn.get("name", ""), arguments, state, counted=False)
                except (json.JSONDecodeError, ToolError):
                    continue  # the recorded result said so too; the rubric judges what the state became

    def _rubric(self, task: Task, messages: list[dict], state: object) -> Score:
        breakdown = self._checks(self.rewards, task, messages, state, "reward")
        total = sum(r.weight for r in self.rewards)
        reward = min(1.0, sum(r.weight * breakdown[r.label] for r in self.rewards) / total)
        if isinstance(self.passed, str):
            passed = breakdown[self.passed] >= 1.0
        else:
            passed = reward >= self.passed - 1e-9  # weights like 0.7 + 0.3 may sum to 0.999...
        return Score(reward=reward, passed=passed, breakdown=breakdown)

    def _checks(self, checks: list[Reward], task: Task, messages: list[dict], state: object,
                kind: str) -> dict[str, float]:
        breakdown = {}
        for check in checks:
            args = (task, messages, state) if _arity(check.fn) >= 3 else (task, messages)
            value = check.fn(*args)
            if isinstance(value, bool):
                value = float(value)
            if not isinstance(value, int | float) or math.isnan(value) or not 0.0 <= value <= 1.0:
                raise RubricError(f"environment '{self.name}': {kind} '{check.label}' returned {value!r} for "
                                  f"{self.describe_task(task)}; a {kind} must be a number in [0, 1]: fix "
                                  f"{_where_defined(check.fn)}")
            breakdown[check.label] = float(value)
        return breakdown

    def solve(self, messages: list[dict], state: object = None) -> dict:
        """The scripted solver's next assistant message; NotImplementedError when the environment has none."""
        if self.solver is None:
            raise NotImplementedError(f"environment '{self.name}' has no scripted solver (Env(solver=...)), so the "
                                      "oracle teacher cannot run in it; use a model teacher (teacher.policy)")
        return self.solver(messages, state) if _arity(self.solver) >= 2 else self.solver(messages)


def _where_defined(fn: Callable) -> str:
    """A function as `file:line (name)`, for errors that send the user to their own code."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    name = getattr(fn, "__qualname__", type(fn).__name__)
    return name if code is None else f"{name} ({code.co_filename}:{code.co_firstlineno})"


def _scenario(task: Task) -> str:
    """What an LLM user plays: the task data's `scenario` when it is an object with one, else the first user
    message of the prompt."""
    try:
        data = task.data
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("scenario"), str) and data["scenario"].strip():
        return data["scenario"]
    return next((m.get("content") or "" for m in task.prompt if m.get("role") == "user"), "")


async def _awaited(awaitable):
    return await awaitable
