"""The `openai` policy: any OpenAI-compatible endpoint (vLLM's server, a hosted API) over the SDK's HTTP client.

A batch of conversations becomes concurrent requests (at most `concurrency` in flight), each retried with
exponential backoff and jitter on 429, 5xx, timeouts and dropped connections, honouring Retry-After. A circuit
breaker stops the batch with a TeacherError when the endpoint looks down instead of burning retries. Answers
go to the response cache as they arrive, so a rerun makes no calls and a killed run resumes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import email.utils
import functools
import json
import os
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import httpx2  # the openai client's own HTTP library
import openai
import orjson

from flywheel.errors import UserFacingError
from flywheel.policies.base import Completion, Sampling
from flywheel.policies.cache import ResponseCache, request_key, sample_indexes
from flywheel.policies.toolcalls import MALFORMED_CALL, parse_completion, render_tool_call

if TYPE_CHECKING:
    from flywheel.config import EndpointConfig

MAX_RETRY_AFTER_S = 600.0
# what `stats` counts: HTTP attempts, fresh answers, answers from the cache, retries and why, fresh tokens
STATS = ("requests", "answers", "cache_hits", "retries", "rate_limited", "server_errors", "timeouts",
         "connection_errors", "tokens_in", "tokens_out")


class TeacherError(UserFacingError, RuntimeError):
    """The endpoint cannot serve the batch: down, refusing the key, or rejecting requests. Stops the stage."""


class OpenAIPolicy:
    """Assistant turns from a chat.completions endpoint; tool calls from `tool_calls` or `<tool_call>` text.

    Sampling.tool_choice goes to the endpoint as `tool_choice` (with tools; "auto" is its default and not sent):
    the endpoint holds its answers to it (vLLM's server and `flywheel serve-model` constrain or check them).
    Sampling.constrained is not sent: no endpoint takes it."""

    name = "openai"

    def __init__(self, model: str, base_url: str | None = None, api_key_env: str | None = None, *,
                 concurrency: int = 16, timeout_s: float = 120.0, max_retries: int = 6,
                 breaker_failures: int = 10, backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 cache: ResponseCache | str | Path | None = None, section: str = "teacher"):
        if not model:
            raise ValueError("the openai policy needs a model name (teacher.model in pipelines.yaml)")
        self.model = model
        self.section = section  # the config section its settings come from, for the messages
        self.base_url = base_url
        self.api_key_env = api_key_env
        self._api_key = _read_key(api_key_env, section)  # held here only; never logged or put in an error
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.breaker_failures = breaker_failures
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.cache = ResponseCache(cache) if isinstance(cache, str | Path) else cache
        self.stats: Counter[str] = Counter(dict.fromkeys(STATS, 0))
        self._failures_in_a_row = 0
        self._stopped: str | None = None  # why the breaker opened; every later request fails fast with it
        self._resume_at = 0.0  # monotonic time before which no request starts (a Retry-After for everyone)

    @classmethod
    def from_endpoint(cls, cfg: EndpointConfig, root: str | Path | None = None, *,
                      model: str | None = None) -> OpenAIPolicy:
        """The client of an endpoint section: its model (`model` where the section names it otherwise), URL, key's
        variable, limits, and its response cache (under `root`) where the section has one; messages name it."""
        cache = getattr(cfg, "cache", None)  # rl.opd has no cache: its requests go through post_many, uncached
        return cls(model or cfg.model, cfg.base_url, cfg.api_key_env, concurrency=cfg.concurrency,
                   timeout_s=cfg.timeout_s, max_retries=cfg.max_retries, breaker_failures=cfg.breaker_failures,
                   cache=Path(root or ".") / cache if cache else None, section=cfg.where)

    def __repr__(self) -> str:
        return f"OpenAIPolicy(model={self.model!r}, base_url={self.base_url!r}, api_key_env={self.api_key_env!r})"

    @property
    def endpoint(self) -> str:
        return self.base_url or os.environ.get("OPENAI_BASE_URL") or "the OpenAI API"

    def generate(self, conversations: Sequence[list[dict]], tools: list[dict], sampling: Sampling,
                 samples: Sequence[int] | None = None) -> list[Completion]:
        """One completion per conversation; `samples` tells identical conversations apart (default: by order)."""
        samples = list(samples) if samples is not None else sample_indexes(conversations)
        if len(samples) != len(conversations):
            raise ValueError(f"{len(samples)} sample indexes for {len(conversations)} conversations")
        sampling_fields = _keyed(sampling)
        bodies: dict[str, dict] = {}
        keys = []
        for conversation, sample in zip(conversations, samples, strict=True):
            key = request_key(self.model, conversation, tools, sampling_fields, sample)
            keys.append(key)
            bodies.setdefault(key, self._body(conversation, tools, sampling, sample))
        records = self.cache.get_many(bodies) if self.cache is not None else {}
        self.stats["cache_hits"] += sum(key in records for key in keys)
        todo = {key: body for key, body in bodies.items() if key not in records}
        if todo:
            records |= _run(self._fetch_all(todo))
        return [completion_from_record(records[key]) for key in keys]

    def post_many(self, bodies: dict[str, dict], path: str = "chat/completions") -> dict[str, dict]:
        """key -> {response, latency_s}: each body POSTed to `path` under the base URL, concurrently, with the
        retries and breaker of `generate` (a TeacherError past them); no cache. A fresh breaker per call: one
        bad batch does not stop the next."""
        self._stopped, self._failures_in_a_row = None, 0
        return _run(self._fetch_all(bodies, path)) if bodies else {}

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()

    def _body(self, conversation: list[dict], tools: list[dict], sampling: Sampling, sample: int) -> dict:
        body = {"model": self.model, "messages": [dict(m) for m in conversation],
                "temperature": sampling.temperature, "top_p": sampling.top_p,
                "max_completion_tokens": sampling.max_new_tokens}
        if tools:
            body["tools"] = tools
            if sampling.tool_choice != "auto":  # the endpoint's default; OpenAI refuses a tool_choice without tools
                body["tool_choice"] = sampling.tool_choice
        if sampling.seed is not None:
            # n samples of one prompt must not share a seed: a seeded server would return n equal answers
            body["seed"] = sampling.seed + sample
        return body

    async def _fetch_all(self, todo: dict[str, dict], path: str = "chat/completions") -> dict[str, dict]:
        stop = asyncio.Event()
        slots = asyncio.Semaphore(self.concurrency)
        http = openai.DefaultAsyncHttpxClient(verify=_tls_context(), timeout=self.timeout_s,
                                             limits=httpx2.Limits(max_connections=self.concurrency,
                                                                  max_keepalive_connections=self.concurrency))
        # The SDK resolves the base URL (OPENAI_BASE_URL) and the headers it would send (key, user agent); the
        # requests themselves are plain POSTs on its HTTP client: its per-request machinery (options, typed
        # parsing, ~0.6 ms of CPU each) delays every answer in flight behind it, a third of a 50 ms request
        # at concurrency 16.
        sdk = openai.AsyncOpenAI(api_key=self._api_key, base_url=self.base_url, max_retries=0, http_client=http)
        url = sdk.base_url.join(path)
        headers = {k: v for k, v in (sdk.default_headers | sdk.auth_headers).items() if isinstance(v, str)}
        async with http:
            fetches = [asyncio.create_task(self._fetch(http, url, headers, slots, stop, key, body))
                       for key, body in todo.items()]
            everything = asyncio.gather(*fetches, return_exceptions=True)
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait([everything, stopped], return_when=asyncio.FIRST_COMPLETED)
            if not everything.done():  # the breaker opened: requests in flight would only wait out their timeouts
                for fetch in fetches:
                    fetch.cancel()
            results = await everything
            stopped.cancel()
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            # every answer that did arrive is already cached; the first real cause is the message
            cause = next((e for e in errors if isinstance(e, TeacherError)), errors[0])
            if not isinstance(cause, TeacherError):
                raise cause
            kept = f"; answers received so far are cached in {self.cache.path}, a rerun resumes from them" \
                if self.cache is not None else ""
            raise TeacherError(f"{cause}{kept}") from None
        return dict(zip(todo, results, strict=True))

    async def _fetch(self, http: httpx2.AsyncClient, url, headers: dict[str, str], slots: asyncio.Semaphore,
                     stop: asyncio.Event, key: str, body: dict) -> dict:
        content = orjson.dumps(body)
        for attempt in range(self.max_retries + 1):
            while (wait := self._resume_at - time.monotonic()) > 0 and not stop.is_set():
                await _sleep(stop, wait)
            self._check(stop)
            retry_after, busy = None, False
            async with slots:
                self._check(stop)
                started = time.perf_counter()
                self.stats["requests"] += 1
                try:
                    response = await http.post(url, content=content, headers=headers)
                except httpx2.TimeoutException:
                    failure = f"no answer within {self.timeout_s:g}s"
                    self.stats["timeouts"] += 1
                except (httpx2.HTTPError, httpx2.StreamError, OSError) as err:
                    failure = f"connection failed ({type(err).__name__})"
                    self.stats["connection_errors"] += 1
                else:
                    status = response.status_code
                    if status >= 400:
                        message = self._redact(_error_message(response))
                        if not _retryable(status):
                            self._stop(stop, self._refusal(status, message))
                            self._check(stop)
                        retry_after = _retry_after_s(response.headers)
                        busy = status == 429
                        failure = f"HTTP {status}: {message}"
                        self.stats["rate_limited" if busy else "server_errors"] += 1
                    else:
                        answer = _json(response.content)
                        if isinstance(answer, dict) and isinstance(answer.get("choices"), list) and answer["choices"]:
                            return self._received(key, answer, time.perf_counter() - started)
                        failure = f"the answer is not a completion: {response.text[:200]!r}"
                        self.stats["server_errors"] += 1
            if not busy:  # a 429 says the endpoint is up, only busy: not a sign that it is down
                self._failed(stop, failure)
            self._check(stop)
            if attempt == self.max_retries:
                raise TeacherError(f"a request to {self.endpoint} failed {attempt + 1} times "
                                   f"({self.section}.max_retries {self.max_retries}); last: {failure}")
            self.stats["retries"] += 1
            if retry_after is not None:
                delay = min(retry_after, MAX_RETRY_AFTER_S) * random.uniform(1.0, 1.1)
                self._resume_at = max(self._resume_at, time.monotonic() + delay)  # everyone waits, not just us
            else:
                ceiling = min(self.max_backoff_s, self.backoff_s * 2 ** attempt)
                delay = random.uniform(ceiling / 2, ceiling)
            await _sleep(stop, delay)
        raise AssertionError("unreachable")

    def _received(self, key: str, response: dict, latency_s: float) -> dict:
        self._failures_in_a_row = 0
        record = {"response": response, "latency_s": round(latency_s, 6)}
        usage = response.get("usage") or {}
        self.stats["answers"] += 1
        self.stats["tokens_in"] += int(usage.get("prompt_tokens") or 0)
        self.stats["tokens_out"] += int(usage.get("completion_tokens") or 0)
        if self.cache is not None:
            self.cache.put(key, self.model, record)
        return record

    def _failed(self, stop: asyncio.Event, failure: str) -> None:
        self._failures_in_a_row += 1
        if self._failures_in_a_row >= self.breaker_failures:
            self._stop(stop, f"{self.section} endpoint {self.endpoint} looks down: {self._failures_in_a_row} attempts "
                             f"in a row failed ({self.section}.breaker_failures {self.breaker_failures}); "
                             f"last: {failure}")

    def _stop(self, stop: asyncio.Event, reason: str) -> None:
        self._stopped = self._stopped or reason
        stop.set()

    def _check(self, stop: asyncio.Event) -> None:
        if self._stopped:
            stop.set()
            raise TeacherError(self._stopped)

    def _refusal(self, status: int, message: str) -> str:
        if status in (401, 403):
            source = (f"the key in ${self.api_key_env}" if self.api_key_env
                      else f"no key ({self.section}.api_key_env is unset)")
            return f"{self.endpoint} refused {source} (HTTP {status}): {message}"
        if status == 404:
            return f"{self.endpoint} does not serve model '{self.model}' (HTTP 404): {message}"
        return f"{self.endpoint} rejected a request (HTTP {status}); check the {self.section} settings: {message}"

    def _redact(self, text: str) -> str:
        return text.replace(self._api_key, "***") if len(self._api_key) >= 8 else text


def completion_from_record(record: dict) -> Completion:
    """A Completion from a cached or fresh answer: tool calls from `tool_calls`, else parsed from the text."""
    response = record["response"]
    message = (response.get("choices") or [{}])[0].get("message") or {}
    content = message.get("content") or ""
    calls = message.get("tool_calls") or []
    completion = _with_api_calls(content, calls) if calls else parse_completion(content)
    reason = (response.get("choices") or [{}])[0].get("finish_reason")
    if reason == MALFORMED_CALL and not completion.error:  # `flywheel serve-model` cut a call that did not parse
        completion.error = "the model's tool call did not parse (the server answered finish_reason " \
                           f"{MALFORMED_CALL!r} and cut it from the content)"
    usage = response.get("usage") or {}
    completion.usage = {k: int(usage.get(k) or 0) for k in ("prompt_tokens", "completion_tokens")}
    completion.latency_s = float(record.get("latency_s", 0.0))
    return completion


def _keyed(sampling: Sampling) -> dict:
    """The sampling settings a cached answer is keyed by: `constrained` is this side's switch, not the endpoint's
    (the endpoint constrains by tool_choice, or not at all), and tool_choice counts only when it is not the
    default, so answers cached before either existed are still found."""
    fields = asdict(sampling)
    del fields["constrained"]
    if fields["tool_choice"] == "auto":
        del fields["tool_choice"]
    return fields


def _with_api_calls(content: str, calls: list[dict]) -> Completion:
    """An assistant message from the API's tool_calls; arguments that are not a JSON object are an error."""
    parsed, rendered, problems = [], [], []
    for i, call in enumerate(calls):
        function = call.get("function") or {}
        name, raw = function.get("name"), function.get("arguments") or "{}"
        try:
            arguments = json.loads(raw) if isinstance(raw, str) else raw
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise TypeError("'name' must be a string and 'arguments' an object")
        except (json.JSONDecodeError, TypeError) as err:
            problems.append(f"tool call {i} is not valid JSON with 'name' and 'arguments': {err}")
            rendered.append(f'<tool_call>{{"name": {json.dumps(name)}, "arguments": {raw}}}</tool_call>')
            continue
        call = {"id": call.get("id") or f"call_{i}", "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
        parsed.append(call)
        rendered.append(render_tool_call(call))
    text = content + "".join(rendered)
    if problems:  # no tool_calls in the message: an unanswered call would make the next request invalid
        return Completion(message={"role": "assistant", "content": text.strip()}, text=text,
                          error="; ".join(problems))
    return Completion(message={"role": "assistant", "content": content, "tool_calls": parsed}, text=text)


@functools.cache
def _tls_context():
    """The default TLS context (CA bundle, SSL_CERT_* variables), built once per process.

    httpx builds one for every client, loading the CA bundle (~25 ms of CPU), and a client is made per batch,
    since each batch runs in its own event loop: at 50 ms per request that was 5% of a synthesis pass.
    """
    return httpx2.create_ssl_context()


def _read_key(api_key_env: str | None, section: str) -> str:
    if not api_key_env:
        return "EMPTY"  # vLLM's server and most local endpoints accept any key; the client requires one
    key = os.environ.get(api_key_env)
    if not key:
        raise TeacherError(f"{section}.api_key_env names ${api_key_env}, which is not set in this environment "
                           "(export it; the key itself never goes in pipelines.yaml)")
    return key


def _json(content: bytes):
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        return None


def _error_message(response: httpx2.Response) -> str:
    """What the openai client would say of an error answer: the code, and the body's error.message if any."""
    text = f"Error code: {response.status_code}"
    body = _json(response.content)
    error = body.get("error", body) if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return f"{text} - {message}" if isinstance(message, str) and message else text


def _retryable(status: int) -> bool:
    return status in (408, 409, 429) or status >= 500


def _retry_after_s(headers) -> float | None:
    """Seconds the server asked us to wait (Retry-After in seconds or as a date, or retry-after-ms), if any."""
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            return max(float(value) / scale, 0.0)
        except ValueError:
            pass
    try:
        when = email.utils.parsedate_to_datetime(headers.get("retry-after") or "")
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max((when - datetime.now(UTC)).total_seconds(), 0.0)


async def _sleep(stop: asyncio.Event, seconds: float) -> None:
    """Sleep, but wake at once when the breaker opens."""
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        pass


def _run(coroutine):
    """Run a coroutine to the end from sync code, also when the caller already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
