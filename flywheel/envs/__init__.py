"""The registry of environments by name: a new environment is one new module here that defines ENVIRONMENT."""

from __future__ import annotations

import importlib
import pkgutil

from flywheel.envs.base import Environment, Score, Task, ToolError

# modules of this package that are parts of environments, not environments
_PARTS = {"base", "sdk", "judge", "mcp", "verifiers"}

__all__ = ["Environment", "Score", "Task", "ToolError", "get_environment", "environment_names"]


def environment_names() -> list[str]:
    """Names of the built-in environments (modules of this package that define ENVIRONMENT)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in _PARTS)


def get_environment(name: str, **options) -> Environment:
    """Build the environment called `name`; an unknown name lists the known ones."""
    if name not in environment_names():
        raise ValueError(f"unknown environment '{name}' (known: {', '.join(environment_names())})")
    module = importlib.import_module(f"flywheel.envs.{name}")
    return module.ENVIRONMENT(**options)
