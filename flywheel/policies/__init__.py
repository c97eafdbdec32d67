"""The registry of policies by kind; each backend is imported only when asked for (vLLM and torch are heavy)."""

from __future__ import annotations

import importlib

from flywheel.policies.base import Completion, Policy, Sampling

__all__ = ["POLICIES", "Completion", "Policy", "Sampling", "get_policy"]

POLICIES = {
    "null": ("flywheel.policies.null", "NullPolicy"),
    "oracle": ("flywheel.policies.oracle", "OraclePolicy"),
    "hf": ("flywheel.policies.hf", "HFPolicy"),
    "openai": ("flywheel.policies.openai", "OpenAIPolicy"),
    "vllm": ("flywheel.policies.vllm", "VLLMPolicy"),
}


def get_policy(kind: str, **kwargs) -> Policy:
    """Build the policy of this kind; an unknown kind lists the known ones, a missing module is named."""
    if kind not in POLICIES:
        raise ValueError(f"unknown policy '{kind}' (known: {', '.join(sorted(POLICIES))})")
    module_name, class_name = POLICIES[kind]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:  # the backend exists but one of its own imports is missing
            raise
        raise ModuleNotFoundError(f"policy '{kind}' needs module {module_name}, which does not exist",
                                  name=module_name) from err
    return getattr(module, class_name)(**kwargs)
