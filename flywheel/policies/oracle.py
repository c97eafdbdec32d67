"""The oracle policy: an environment's scripted solver behind the Policy interface (the demo's teacher)."""

from __future__ import annotations

from collections.abc import Sequence

from flywheel.envs.base import Environment
from flywheel.policies.base import Completion, Sampling
from flywheel.policies.toolcalls import render_tool_call


class OraclePolicy:
    """Answers every conversation with env.solve; deterministic, so sampling settings do not apply."""

    name = "oracle"
    takes_states = True  # the harness passes each conversation's episode state (flywheel/agent.py)

    def __init__(self, env: Environment):
        self.env = env

    def generate(self, conversations: Sequence[list[dict]], tools: list[dict],
                 sampling: Sampling, states: Sequence | None = None) -> list[Completion]:
        """One scripted assistant turn per conversation, with the text a model would have written."""
        completions = []
        for i, conversation in enumerate(conversations):
            state = states[i] if states else None
            message = self.env.solve(conversation) if state is None else self.env.solve(conversation, state)
            calls = message.get("tool_calls") or []
            text = (message.get("content") or "") + "".join(render_tool_call(c) for c in calls)
            completions.append(Completion(message=message, text=text))
        return completions
