"""The response cache: one SQLite row per answered request, written as each answer arrives.

A request is identified by (model, messages, tools, sampling parameters, sample index). A rerun with the same
inputs is served from here without a call, and a run killed half-way resumes: every answer it had received is
kept, nothing it had not received is.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path


def request_key(model: str, messages: list[dict], tools: list[dict], sampling: dict, sample: int) -> str:
    """The content hash that identifies one request; equal keys must mean interchangeable answers."""
    payload = {"model": model, "messages": messages, "tools": tools, "sampling": sampling, "sample": sample}
    text = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def sample_indexes(conversations: Sequence[list[dict]]) -> list[int]:
    """The default sample index of each conversation: the k-th identical conversation in a batch is sample k.

    Harness.run(samples=n) puts n copies of a task's prompt in one batch; this tells them apart (distinct
    cache entries and, with a seed, distinct seeds) without the harness passing anything.
    """
    seen: Counter[str] = Counter()
    indexes = []
    for conversation in conversations:
        identity = json.dumps(conversation, sort_keys=True, ensure_ascii=False)
        indexes.append(seen[identity])
        seen[identity] += 1
    return indexes


class ResponseCache:
    """request key -> the endpoint's answer (JSON), in a SQLite file shared by runs and processes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # autocommit: each put is durable on its own, so a kill loses at most the answer in flight
        self._db = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS responses (key TEXT PRIMARY KEY, model TEXT NOT NULL, "
                         "record TEXT NOT NULL, created_at REAL NOT NULL)")

    def get_many(self, keys: Iterable[str]) -> dict[str, dict]:
        """The cached records among these keys."""
        wanted = list(dict.fromkeys(keys))
        found: dict[str, dict] = {}
        with self._lock:
            for start in range(0, len(wanted), 500):
                chunk = wanted[start:start + 500]
                marks = ",".join("?" * len(chunk))
                rows = self._db.execute(f"SELECT key, record FROM responses WHERE key IN ({marks})",
                                        chunk).fetchall()
                found.update((key, json.loads(record)) for key, record in rows)
        return found

    def put(self, key: str, model: str, record: dict) -> None:
        """Keep an answer; the first answer to a key stays, so a replay is always what the first run used."""
        text = json.dumps(record, sort_keys=True, ensure_ascii=False)
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO responses (key, model, record, created_at) VALUES (?, ?, ?, ?)",
                             (key, model, text, time.time()))

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()
