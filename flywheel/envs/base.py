"""What an environment is: frozen tasks (data) apart from tools and a rubric (behaviour)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Task:
    """One frozen problem: the prompt the agent sees and what the rubric checks against."""

    task_id: str
    env: str
    prompt: list[dict]
    answer: str  # JSON text the environment's rubric reads (verifier data)
    slice: str
    split: str = "train"

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


def split_of(key: str, heldout_fraction: float) -> str:
    """Assign a split from a content hash, never from row order: the same content always lands the same way."""
    bucket = int(hashlib.sha256(("split:" + key).encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "heldout" if bucket < heldout_fraction else "train"


class Environment(Protocol):
    """Tasks + tools + rubric. The harness (flywheel.agent) runs episodes in it; nothing else does.

    Episode state is opaque to the harness: start(task) makes it (None for a stateless environment), every
    call_tool and the score of that episode get it, then finish(state) tears it down. Concurrent episodes never
    share one. score with state None scores a recorded conversation (flywheel/envs/sdk.py replays its calls).

    Optional: audit(task, messages, state=None) -> {check: value} or None, stricter checks than the reward that
    nothing trains on; the RL reward-hacking monitor counts an episode as audited when every value is 1
    (flywheel/train/rl/monitor.py). An environment without it is audited by its rubric's `passed`.
    """

    name: str

    def tools(self) -> list[dict]:
        """The OpenAI function schemas the agent may call."""
        ...

    def generate_tasks(self, seed: int) -> Iterator[Task]:
        """A seeded stream of tasks, endless or finite (split left as 'train'; the caller assigns splits)."""
        ...

    def task_from_messages(self, messages: list[dict]) -> Task | None:
        """The task behind a recorded conversation, if this environment can verify it; else None."""
        ...

    def start(self, task: Task) -> object:
        """A fresh per-episode state for `task` (e.g. a copy of a database); None when there is none."""
        ...

    def call_tool(self, name: str, arguments: dict, state: object = None) -> str:
        """Run one tool call in the episode's state; raise ToolError with a message the model will see."""
        ...

    def score(self, task: Task, messages: list[dict], state: object = None) -> Score:
        """The rubric: the RL reward and the eval metric are this one call."""
        ...

    def finish(self, state: object) -> None:
        """Tear down an episode's state after it was scored."""
        ...

    def solve(self, messages: list[dict], state: object = None) -> dict:
        """The scripted oracle's next assistant message (NotImplementedError when the environment has none)."""
        ...


class ToolError(Exception):
    """A tool refused or failed; its message goes back to the model as the tool result."""


class RubricError(ValueError):
    """A reward function returned NaN, a value outside [0, 1] or not a number: a bug in the environment."""
