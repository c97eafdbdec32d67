"""What produces assistant turns: one small interface for oracle, HF, OpenAI-compatible and vLLM backends."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 means greedy
    max_new_tokens: int = 64
    top_p: float = 1.0
    seed: int | None = None
    # Tool calls: "auto" (the model chooses), "required" (it must call a tool), "none" (it must not), or
    # {"type": "function", "function": {"name": ...}} (it must call that one). With `constrained` (the pipeline's
    # `environment.constrained_tools`), a backend that can masks the tokens that would break a call of an offered
    # tool (flywheel.policies.constrained); without it the choice is checked after the fact where it is checked.
    tool_choice: str | dict = "auto"
    constrained: bool = False


@dataclass
class Completion:
    """One assistant turn: the OpenAI-format message, the raw text, and token data where the backend has it."""

    message: dict  # {"role": "assistant", "content": str, "tool_calls": [...]} (tool_calls only if any)
    text: str = ""
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    error: str | None = None  # e.g. malformed tool-call JSON; the harness shows it to the model
    usage: dict = field(default_factory=dict)  # prompt_tokens / completion_tokens where the backend counts them
    latency_s: float = 0.0
    # Constrained decoding: for each position of token_ids where a mask applied, the allowed tokens as
    # numpy.packbits(bool[vocab]) (positions absent were unmasked). token_ids' logprobs are of the masked,
    # renormalised distribution; the RL learner applies the same masks, so its ratio is 1 for an unchanged policy.
    masks: dict[int, object] | None = None


class Policy(Protocol):
    """Batched: one completion per conversation. n samples of a task are n copies of its conversation."""

    name: str

    def generate(self, conversations: Sequence[list[dict]], tools: list[dict],
                 sampling: Sampling) -> list[Completion]:
        ...
