"""The environment contract, declared once: Task, Score, the prompt hash and split, and Environment.

Everything that runs episodes (the harness, synthesis, RL, evaluate, serving) sees an environment only through
this module, and this module imports nothing of the project: it is the bottom of the house. Every kind of
environment (the SDK's `Env`, which the built-ins use, replay, the verifiers adapter, a user's own class)
subclasses `Environment`, so callers call its members and never ask whether it has them.
"""

from __future__ import annotations

import hashlib
import json
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace

from flywheel.errors import UserFacingError


@dataclass(frozen=True)
class Task:
    """One frozen problem: the prompt the agent sees and what the rubric checks against."""

    task_id: str
    env: str
    prompt: list[dict]
    answer: str  # JSON text the environment's rubric reads (verifier data)
    slice: str
    # "train" | "heldout", or "" when its source left the choice to collect, which splits it by a hash of its
    # prompt (collect.heldout_fraction); a task file's row may choose (`split: heldout`)
    split: str = ""
    # the scenario it is an attempt at (collect.group_by: the logs' task id); "" none. Every task of one group
    # is in one split, and the contamination check compares groups as well as prompts
    group: str = ""

    @property
    def data(self):
        """The answer's JSON parsed: what a rubric reads."""
        return json.loads(self.answer)


@dataclass(frozen=True)
class Score:
    """A rubric's verdict: a reward in [0, 1], its parts, and whether the task counts as solved."""

    reward: float
    passed: bool
    breakdown: dict[str, float] = field(default_factory=dict)


class ToolError(Exception):
    """A tool refused or failed; its message goes back to the model as the tool result."""


class RubricError(UserFacingError, ValueError):
    """A reward function returned NaN, a value outside [0, 1] or not a number: a bug in the environment."""


class UserError(UserFacingError, RuntimeError):
    """The simulated user could not answer (its model failed after retries, its script raised): the harness marks
    the episode `user_error`, counts it and leaves it out of every score; it is never the agent's failure."""


# What a simulated user says to end the conversation (tau-bench's marker): the episode ends there, as it does
# when the user has nothing more to say.
STOP = "###STOP###"


# --- the content hash and the split ----------------------------------------------------------------------------

def prompt_hash(prompt: list[dict]) -> str:
    """The stable content hash of a prompt: the key of held-out splits and contamination checks.

    The hashed text is `json.dumps([{"role", "content"} ...], sort_keys=True, ensure_ascii=False)`. Text roles
    and contents, nearly every prompt, are written by json's own string encoder without building the encoder
    (the same bytes at about half the cost: collect hashes every record's prompt); anything else by json.dumps.
    """
    try:
        canonical = "[" + ", ".join(f'{{"content": {_string(m.get("content") or "")}, "role": {_string(m["role"])}}}'
                                    for m in prompt) + "]"
    except TypeError:  # a content or role that is no text (parts, None role): json decides
        canonical = json.dumps([{"role": m["role"], "content": m.get("content") or ""} for m in prompt],
                               sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _string(value) -> str:
    # json's C string encoder (ensure_ascii=False), as json.dumps uses for a str; anything else is no text here
    if type(value) is not str:
        raise TypeError(value)
    return _ENCODE_STRING(value)


_ENCODE_STRING = json.encoder.encode_basestring


def opening(messages: list[dict]) -> list[dict] | None:
    """A conversation up to and including its first user message (what identifies its task); None without one."""
    first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    return None if first_user is None else messages[:first_user + 1]


def conversation_hash(messages: list[dict]) -> str:
    """The prompt hash of a whole conversation: that of its opening, so it meets its task's `prompt_hash`."""
    start = opening(messages)
    if start is None:
        raise ValueError("the conversation has no user message, so no prompt to hash")
    return prompt_hash(start)


def prompt_excerpt(prompt: list[dict], width: int = 60) -> str:
    """The last user message of a prompt on one line, cut to `width` characters and quoted: a task in a message."""
    text = next((str(m.get("content") or "") for m in reversed(prompt) if m.get("role") == "user"), "")
    text = " ".join(text.split())
    return json.dumps(text if len(text) <= width else text[:width - 3] + "...", ensure_ascii=False)


def split_of(key: str, heldout_fraction: float) -> str:
    """Assign a split from a content hash, never from row order: the same content always lands the same way."""
    bucket = int(hashlib.sha256(("split:" + key).encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "heldout" if bucket < heldout_fraction else "train"


# --- the environment -------------------------------------------------------------------------------------------

class Environment(ABC):
    """Tasks + tools + rubric. The harness (flywheel.agent) runs episodes in it; nothing else does.

    Required: `name`, `tools`, `generate_tasks`, `call_tool`, `score`. Every other member has a default here
    that means "this environment has none of it"; an environment overrides what it has.

    Episode state is opaque to the harness: start(task) makes it (None for a stateless environment), every
    call_tool, user_turn and the score of that episode get it, then finish(state) tears it down. Concurrent
    episodes never share one. score with state None scores a recorded conversation.

    Runtime parts (the counters and their lock, and whatever `_runtime_fields` names) are made fresh for every
    instance, also one unpickled in an RL actor process, and never pickled; an environment the loader built
    crosses into another process by being built again from its factory (`_origin`).
    """

    name: str = ""  # what tasks' `env` and the logs call it; the loader refuses an environment without one
    _runtime_fields: tuple[str, ...] = ("_counts", "_lock")
    # (function, args) that build this environment again, set by the loader (flywheel/envs): a copy for another
    # process (an RL actor) is built there from its factory, since a lambda, a loop or a connection cannot cross
    _origin: tuple | None = None

    def __new__(cls, *args, **kwargs):
        # here, not in __init__: a subclass that forgets super().__init__(), and an unpickled copy, still count
        self = super().__new__(cls)
        self._init_runtime()
        return self

    def _init_runtime(self) -> None:
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def __reduce_ex__(self, protocol):
        if self._origin is not None:
            return self._origin
        return super().__reduce_ex__(protocol)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in self._runtime_fields}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    # --- required

    @abstractmethod
    def tools(self) -> list[dict]:
        """The OpenAI function schemas the agent may call."""

    @abstractmethod
    def generate_tasks(self, seed: int) -> Iterator[Task]:
        """A seeded stream of tasks, endless or finite; a task's split is "" unless its source chose one (collect
        splits the rest by a hash of the prompt)."""

    @abstractmethod
    def call_tool(self, name: str, arguments: dict, state: object = None) -> str:
        """Run one tool call in the episode's state; raise ToolError with a message the model will see."""

    @abstractmethod
    def score(self, task: Task, messages: list[dict], state: object = None) -> Score:
        """The rubric: the RL reward and the eval metric are this one call."""

    # --- optional: tasks from recorded conversations

    def task_from_messages(self, messages: list[dict]) -> Task | None:
        """The task behind a recorded conversation, if this environment can verify it; else None."""
        return None

    def task_from_trace(self, trace: dict, heldout_fraction: float) -> Task | None:
        """The task of a traces-table row (its `messages` as JSON text or a list), with its split.

        The default reads the messages (task_from_messages) and keeps the split the task chose, else splits it
        by its id, or by the trace's group when it has one (collect.group_by: every attempt at a scenario in one
        split); replay reads the whole row and keeps the trace's split. It must depend on the row alone:
        collect's worker processes call it."""
        messages = trace["messages"]
        task = self.task_from_messages(json.loads(messages) if isinstance(messages, str | bytes) else messages)
        if task is None:
            return None
        group = trace.get("group") or ""
        return replace(task, split=task.split or split_of(group or task.task_id, heldout_fraction), group=group)

    def recorded_tasks(self) -> list[Task]:
        """Tasks that come from a pipeline's collected traces rather than generate_tasks (replay's); none here."""
        return []

    def describe_task(self, task: Task) -> str:
        """The task as a person finds it in messages: where it comes from (a task file's path and row, when the
        environment read one) and the opening of its prompt; the default names its id."""
        return f"task {task.task_id} ({prompt_excerpt(task.prompt)})"

    # --- optional: one episode

    def start(self, task: Task) -> object:
        """A fresh per-episode state for `task` (e.g. a copy of a database); None when there is none."""
        return None

    def user_turn(self, task: Task, messages: list[dict], state: object = None) -> dict | None:
        """The user's next message after the agent answered (a message without tool calls), or None: the
        conversation ends. The default ends it at the agent's first answer (a single-turn task)."""
        return None

    def finish(self, state: object) -> None:
        """Tear down an episode's state after it was scored."""
        return None  # nothing to release by default

    def solve(self, messages: list[dict], state: object = None) -> dict:
        """The scripted oracle's next assistant message (NotImplementedError when the environment has none)."""
        raise NotImplementedError(f"environment '{self.name}' has no scripted solver, so the oracle teacher cannot "
                                  "run in it; use a model teacher (teacher.policy: openai)")

    def audit(self, task: Task, messages: list[dict], state: object = None) -> dict[str, float] | None:
        """Stricter checks than the reward that nothing trains on, {check: value}; None when there are none.

        The RL reward-hacking monitor counts an episode as audited when every value is 1
        (flywheel/train/rl/monitor.py); an environment without checks is audited by its rubric's `passed`."""
        return None

    # --- counters (logged by the stage as env.<name>)

    def count(self, key: str, n: int = 1) -> None:
        """Add n to a counter (thread-safe): tool errors, timeouts, bad returns, ... for the stage to log."""
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + n

    @property
    def counters(self) -> dict[str, float]:
        """This instance's counts so far, with those of its counted parts (counter_parts)."""
        with self._lock:
            merged = dict(self._counts)
        for part in self.counter_parts():
            for key, value in (getattr(part, "counters", None) or {}).items():
                merged[key] = merged.get(key, 0) + value
        return merged

    def counter_parts(self) -> Iterable[object]:
        """Parts whose own `counters` join this environment's (a judge, a tool source, a wrapped environment)."""
        return ()
