"""Concurrent requests to one loaded model, answered by shared generate calls.

A request waits in a queue; one worker thread per loaded model takes the oldest, gathers every waiting request
that can share its call (the same tools and sampling settings: Prepared.batch_key) up to `max_batch` rows (n
each), and answers them with one ChatEngine.answer_many. Requests that arrive while a call runs wait for the next
one, so under load every call is as full as the queue allows. Before a call the model waits a window from when
the first request arrived or the last call ended, whichever is later, unless max_batch rows are waiting: the
clients a call has just answered send their next requests then, and without the wait the one request already
waiting would go alone, and the rest wait a whole call for the next. The window is `window_share` of the last
call's time, at most `window_s` (5% and 100 ms: a few ms for a tiny model, 100 ms where a call takes seconds), so
what it adds to a lone client's latency is bounded both ways. The oldest request always goes next: none waits
behind later ones.
The max tokens must be equal too: a request without max_tokens gets the context's room up to 1,024, so on a model
with a short context it shares a call only with prompts that leave it as much room.

A seeded request runs alone (its answer must not depend on what else is in flight). Errors stay per request: a
request the engine refuses (a 422) fails alone, and when a shared call raises, each of its requests is answered
again alone, so only the one that breaks generation gets the error. The worker ends when the queue has been empty
for IDLE_S: an old version swapped out keeps no thread (nor its model) alive once its last request is answered.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from flywheel.serving.chat import ChatEngine, ChatRequest, Prepared

MAX_BATCH = 16  # rows per generate call (requests times their n); a request with more rows runs alone
WINDOW_S = 0.1  # the longest a free model waits for more requests before it starts on the first waiting
WINDOW_SHARE = 0.05  # ... and at most this share of its last call's time, so the wait costs at most 5%
# How long the worker outlives an empty queue: steady traffic reuses one thread (and torch's thread pool for it)
IDLE_S = 2.0


@dataclass
class _Waiting:
    prepared: Prepared
    model: str
    arrived: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    answer: dict | None = None
    error: BaseException | None = None


class Batcher:
    """The queue and worker of one loaded model; `answer` blocks until the request's own answer is ready."""

    def __init__(self, engine: ChatEngine, max_batch: int = MAX_BATCH, window_s: float = WINDOW_S,
                 window_share: float | None = WINDOW_SHARE):
        """window_share None: always wait window_s (what a test that must gather a batch wants)."""
        if max_batch < 1 or window_s < 0:
            raise ValueError(f"max_batch must be >= 1 and window_s >= 0 (given {max_batch}, {window_s})")
        self.engine, self.max_batch, self.window_s = engine, max_batch, window_s
        self.window_share = window_share
        self._last_call_s = 0.0  # how long the last call took
        self._queue: list[_Waiting] = []
        self._ready = threading.Condition()
        self._working = False
        self._free_since = 0.0  # when the last call ended
        self.calls = 0  # shared generate calls made (resamples not counted)
        self.answered = 0

    def answer(self, request: ChatRequest, model: str) -> dict:
        """The chat.completion for this request; its RequestError (or the generate's exception) raised here."""
        waiting = _Waiting(self.engine.prepare(request), model)  # a request that cannot fit fails now, alone
        with self._ready:
            self._queue.append(waiting)
            self._ready.notify_all()
            if not self._working:
                self._working = True
                threading.Thread(target=self._work, daemon=True, name="serve-model-batch").start()
        waiting.done.wait()
        if waiting.error is not None:
            raise waiting.error
        return waiting.answer

    def _work(self) -> None:
        while True:
            with self._ready:
                if not self._queue:
                    self._ready.wait(IDLE_S)
                if not self._queue:
                    self._working = False
                    return
                batch = self._gather()
            started = time.monotonic()
            self._run(batch)
            self._free_since = time.monotonic()
            self._last_call_s = self._free_since - started

    def _gather(self) -> list[_Waiting]:
        """The oldest request and those that can share its call, after waiting out its window (lock held)."""
        first = self._queue[0]
        key = first.prepared.batch_key()
        while key is not None:
            rows = sum(w.prepared.rows for w in self._queue if w.prepared.batch_key() == key)
            window = self.window_s if self.window_share is None else \
                min(self.window_s, self.window_share * self._last_call_s)
            left = max(first.arrived, self._free_since) + window - time.monotonic()
            if rows >= self.max_batch or left <= 0:
                break
            self._ready.wait(left)
        batch, rows = [first], first.prepared.rows
        for waiting in self._queue[1:] if key is not None else []:
            if waiting.prepared.batch_key() == key and rows + waiting.prepared.rows <= self.max_batch:
                batch.append(waiting)
                rows += waiting.prepared.rows
        self._queue = [w for w in self._queue if all(w is not b for b in batch)]
        return batch

    def _run(self, batch: list[_Waiting]) -> None:
        self.calls += 1
        try:
            answers = self.engine.answer_many([w.prepared for w in batch], batch[0].model)
        except Exception as err:  # noqa: BLE001 - each request is answered again alone, or gets the error
            if len(batch) > 1:
                for waiting in batch:
                    self._run([waiting])
                return
            answers = [err]
        for waiting, answer in zip(batch, answers, strict=True):
            if isinstance(answer, BaseException):
                waiting.error = answer
            else:
                waiting.answer = answer
                self.answered += 1
            waiting.done.set()
