"""A benchmark's working folder. A temporary one is removed when the script ends, however it ends short of being
killed: a SmolLM2 benchmark leaves a gigabyte of checkpoints and state otherwise, and the suite runs every one."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path


def scratch(prefix: str, keep: Path | None = None) -> Path:
    """`keep` when given (a user's `--workdir`: left as it is), else a new temporary folder, removed at exit."""
    if keep is not None:
        return keep
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, True)
    return folder
