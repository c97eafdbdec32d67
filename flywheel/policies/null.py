"""The `null` policy: an empty answer and no tool calls to every conversation.

What doing nothing scores: evaluate runs it beside every model, and the gate refuses a candidate that does not beat
it by more than its margin (a rubric that rewards silence cannot tell models apart).
"""

from __future__ import annotations

from collections.abc import Sequence

from flywheel.policies.base import Completion, Sampling


class NullPolicy:
    """Answers every conversation with an empty assistant message; no model, no tokens, no cost. Sampling,
    tool_choice and constrained included, does not apply: it never calls a tool, so never a malformed call."""

    name = "null"

    def generate(self, conversations: Sequence[list[dict]], tools: list[dict],
                 sampling: Sampling) -> list[Completion]:
        """One empty assistant turn per conversation."""
        return [Completion(message={"role": "assistant", "content": ""}, token_ids=[]) for _ in conversations]
