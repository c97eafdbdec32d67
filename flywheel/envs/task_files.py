"""Task files: an environment's tasks read from a JSONL or Parquet file (tasks_from_file), every row checked.

While flywheel.envs builds an environment from a factory, a relative path is read from the project root and
every file read is noted (PROJECT_ROOT, FILES_READ): the files are part of the environment's identity.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path

from flywheel.contract import Task, prompt_hash

__all__ = ["FILES_READ", "PROJECT_ROOT", "TaskFile", "tasks_from_file"]

# Set while flywheel.envs resolves a factory: relative task files are read from the project root.
PROJECT_ROOT: ContextVar[Path | None] = ContextVar("flywheel_project_root", default=None)
# Set while flywheel.envs resolves a factory: every task file read is listed here, for the environment's identity
# (flywheel.envs.environment_sources: a task file outside the factory's folder is one of its files too)
FILES_READ: ContextVar[list[Path] | None] = ContextVar("flywheel_files_read", default=None)


class TaskFile:
    """Tasks read from a JSONL or Parquet file; called with a seed, yields them once in a seeded order."""

    def __init__(self, path: str | Path):
        path = Path(path)
        root = PROJECT_ROOT.get()
        if not path.is_absolute() and root is not None and not path.exists():
            path = root / path
        self.path = path
        self.root = root  # the project root it was read under: messages name the file from there
        self.tasks, self.rows = _read_tasks(path)  # rows: task id -> its row number in the file (from 1)
        listed = FILES_READ.get()
        if listed is not None:
            listed.append(path.resolve())

    def __call__(self, seed: int) -> Iterator[Task]:
        order = list(range(len(self.tasks)))
        random.Random(seed).shuffle(order)
        return (self.tasks[i] for i in order)


def tasks_from_file(path: str | Path) -> TaskFile:
    """Tasks from a JSONL or Parquet file with `prompt` (text or messages), `answer` (any JSON), optional `slice`,
    `id` and `split` ("train" or "heldout": the row chooses; without it collect splits the task by a hash of its
    prompt); a relative path is read from the current folder, else from the project root."""
    return TaskFile(path)


def _read_tasks(path: Path) -> tuple[list[Task], dict[str, int]]:
    if not path.exists():
        raise FileNotFoundError(f"{path}: task file not found")
    if path.suffix == ".parquet":
        import pandas as pd

        frame = pd.read_parquet(path).astype(object)
        records = frame.where(frame.notna(), None).to_dict("records")  # a missing slice or id is None, not NaN
    else:
        records = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{number}: not valid JSON: {err}") from None
    tasks, seen = [], {}
    for number, record in enumerate(records, 1):
        where = f"{path}: row {number}" + (f" (id {record['id']})" if record.get("id") is not None else "")
        if not isinstance(record, dict) or "prompt" not in record or "answer" not in record:
            raise ValueError(f"{where}: a task needs 'prompt' and 'answer'")
        prompt = record["prompt"]
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        elif hasattr(prompt, "tolist"):  # Parquet gives arrays
            prompt = [dict(m) for m in prompt.tolist()]
        if not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt)):
            raise ValueError(f"{where}: 'prompt' must be a string or a list of messages with a 'role'")
        answer = record["answer"]
        if isinstance(answer, str) and path.suffix == ".parquet":
            answer = json.loads(answer)  # Parquet holds nested answers as JSON text
        split = record.get("split") or ""
        if split not in ("", "train", "heldout"):
            raise ValueError(f"{where}: split {split!r} is neither 'train' nor 'heldout' (leave it out to let "
                             "collect split the task by a hash of its prompt)")
        task_id = prompt_hash(prompt)
        if task_id in seen:
            raise ValueError(f"{where}: the same prompt as row {seen[task_id]}: a prompt is a task's identity")
        seen[task_id] = number
        tasks.append(Task(task_id=task_id, env="", prompt=prompt, answer=json.dumps(answer, ensure_ascii=False),
                          slice=str(record.get("slice") or "all"), split=split))
    return tasks, seen

