"""The base class of every error a user can fix: the `flywheel` command shows its message alone, no traceback."""

from __future__ import annotations


class UserFacingError(Exception):
    """Bad input, config, data or state: the message names the file, key, task row or prompt and the fix."""
