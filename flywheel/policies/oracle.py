"""The oracle policy: an environment's scripted solver behind the Policy interface (the demo's teacher).

It can be made imperfect, as real teachers are (`teacher.error_rate`): a seeded hash of the conversation picks
the final answers it gets wrong, so a rerun makes the same mistakes and the synthetic table stays byte-identical.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence

from flywheel.contract import Environment
from flywheel.policies.base import Completion, Sampling
from flywheel.policies.toolcalls import render_tool_call

_NUMBER = re.compile(r"\d+")


def wrong_answer(content: str) -> str:
    """The answer with its last number one larger in magnitude (a plausible slip), or a refusal without a number."""
    numbers = list(_NUMBER.finditer(content))
    if not numbers:
        return "I am not sure."
    last = numbers[-1]
    return content[:last.start()] + str(int(last.group()) + 1) + content[last.end():]


class OraclePolicy:
    """Answers every conversation with env.solve; deterministic, so sampling settings do not apply (tool_choice
    and constrained neither: its calls are the environment's own, well formed by construction).

    error_rate: the share of final answers (turns without tool calls) made wrong, in the tasks of
    `error_slices` (every task when empty), chosen by a hash of (error_seed, the conversation, its repeat).
    """

    name = "oracle"
    takes_states = True  # the harness passes each conversation's episode state (flywheel/agent.py)

    def __init__(self, env: Environment, error_rate: float = 0.0, error_slices: Sequence[str] = (),
                 error_seed: int = 0):
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
        self.env = env
        self.error_rate, self.error_slices, self.error_seed = error_rate, set(error_slices), error_seed

    def generate(self, conversations: Sequence[list[dict]], tools: list[dict],
                 sampling: Sampling, states: Sequence | None = None) -> list[Completion]:
        """One scripted assistant turn per conversation, with the text a model would have written."""
        completions = []
        seen: dict[str, int] = {}  # identical conversations (samples of one task) err independently
        for i, conversation in enumerate(conversations):
            state = states[i] if states else None
            message = self.env.solve(conversation, state)
            calls = message.get("tool_calls") or []
            if self.error_rate and not calls and self._errs(conversation, seen):
                message = {**message, "content": wrong_answer(message.get("content") or "")}
            text = (message.get("content") or "") + "".join(render_tool_call(c) for c in calls)
            completions.append(Completion(message=message, text=text))
        return completions

    def _errs(self, conversation: list[dict], seen: dict[str, int]) -> bool:
        """Whether this final answer is one the imperfect teacher gets wrong (seeded, order-independent)."""
        if self.error_slices:
            task = self.env.task_from_messages(conversation)
            if task is None or task.slice not in self.error_slices:
                return False
        key = hashlib.sha256(json.dumps(conversation, sort_keys=True, default=str).encode()).hexdigest()
        repeat = seen.get(key, 0)
        seen[key] = repeat + 1
        digest = hashlib.sha256(f"{self.error_seed}:{key}:{repeat}".encode()).hexdigest()
        return int(digest[:8], 16) / 0xFFFFFFFF < self.error_rate
