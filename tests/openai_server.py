"""A real OpenAI-compatible HTTP server for tests and benchmarks: the calculator oracle behind chat.completions.

Starlette + uvicorn in a thread on a free port (not FastAPI: its per-request layer is CPU that the one server
thread spends while the benchmark's answers wait). It answers with `tool_calls` (mode "tools", like vLLM with a
tool parser) or with `<tool_call>` text (mode "text", a model served without one), counts every request, and
injects faults on demand: `inject("429", "500", "hang", "drop", "malformed")` applies one fault to each of the
next requests; `down_after = N` drops every request after the N-th answer (an endpoint that died); `hang_after
= N` holds every request after the N-th answer unanswered (so a test can kill its client at a known point).
It also plays the simulated user (flywheel/envs/users.py) by rule, known by its prompts: see `simulated_user`.
With `logprob_model` (a checkpoint folder) it serves POST /v1/completions as vLLM does for on-policy
distillation: `prompt` as token ids, `prompt_logprobs`, each prompt token's log-probability under that model
(fault "nan": every log-probability of the answer is null, as a broken teacher would give).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import socket
import threading
import time
from collections import Counter, deque
from typing import Self

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from flywheel.contract import STOP
from flywheel.envs.calculator import CalculatorEnv
from flywheel.envs.users import SCENARIO_PROMPT, USER_PROMPT
from flywheel.policies.toolcalls import render_tool_call

FAULTS = {"429", "500", "hang", "drop", "malformed", "nan"}


class _Dropped(Response):
    """Start a response, send half of it, then break the connection (a proxy or server dying mid-answer)."""

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"4096")]})
        await send({"type": "http.response.body", "body": b'{"id": "chatcmpl-dropped", "choi', "more_body": True})
        raise ConnectionAbortedError("connection dropped on purpose")


def body_hash(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def _tokens(text: str) -> int:
    return max(1, len(text) // 4)


class OracleServer:
    """The calculator oracle served over the OpenAI protocol, with request counts and fault injection."""

    def __init__(self, mode: str = "tools", latency_s: float = 0.0, api_key: str | None = None,
                 retry_after: str = "1", hang_s: float = 5.0, logprob_model: str | None = None):
        if mode not in ("tools", "text"):
            raise ValueError(f"mode must be 'tools' or 'text', not {mode!r}")
        self.mode, self.latency_s, self.api_key = mode, latency_s, api_key
        self.retry_after, self.hang_s = retry_after, hang_s
        self.env = CalculatorEnv()
        self.faults: deque[str] = deque()
        self.down_after: int | None = None
        self.hang_after: int | None = None
        # judge mode: when set, every answer is judge(messages) as plain text (an LLM judge's verdict)
        self.judge = None
        # replay mode: when set (a TraceReplayer), every answer is the recorded conversation's next assistant turn
        self.replay = None
        self.logprob_model = logprob_model  # completions with prompt_logprobs from this checkpoint; None: no route
        self._scorer = None  # (model, tokenizer), loaded at the first completions request
        self.received: list[dict] = []  # every request body, in arrival order
        self.answered: Counter[str] = Counter()  # body hash -> how many times it got a 200 answer
        self.seen_faults: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0
        self.app = self._app()

    # ---- control ---------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def inject(self, *faults: str) -> None:
        unknown = set(faults) - FAULTS
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)} (known: {sorted(FAULTS)})")
        with self._lock:
            self.faults.extend(faults)

    def release(self) -> None:
        """Let go of the requests held by hang_after (they end with a 503 nobody is waiting for)."""
        self.hang_after = None
        self._release.set()

    @property
    def answers(self) -> int:
        with self._lock:
            return sum(self.answered.values())

    def start(self) -> Self:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted connections inherit it; without it every answer waits ~40 ms for a delayed ACK (Nagle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="critical", lifespan="off", timeout_graceful_shutdown=1,
                                timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name=f"oracle-server-{self.port}")
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test OpenAI server did not start within 30 s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.release()
        if self._server:
            self._server.should_exit = True
        if self._thread:
            self._thread.join(timeout=10)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- the endpoint ----------------------------------------------------------------------------------------

    def _app(self) -> Starlette:
        async def models(request: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "oracle", "object": "model", "owned_by": "tests"}]})

        async def chat(request: Request) -> Response:
            return await handle(request, self._answer)

        async def completions(request: Request) -> Response:
            if self.logprob_model is None:
                return _error(404, "This server does not serve the completions API.", "invalid_request_error")
            return await handle(request, self._completion)

        async def handle(request: Request, answer) -> Response:
            body = await request.json()
            with self._lock:
                number = len(self.received)
                self.received.append(body)
                fault = self.faults.popleft() if self.faults else None
                answered = sum(self.answered.values())
                down = self.down_after is not None and answered >= self.down_after
                hang = self.hang_after is not None and answered >= self.hang_after
                if fault:
                    self.seen_faults[fault] += 1
            if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
                return _error(401, "Incorrect API key provided.", "invalid_request_error")
            if down:
                return _Dropped()
            if hang:
                while not self._release.is_set():
                    await asyncio.sleep(0.02)
                return _error(503, "released", "server_error")
            if self.latency_s:
                await asyncio.sleep(self.latency_s)
            if fault == "429":
                return _error(429, "Rate limit reached; slow down.", "rate_limit_error",
                              headers={"Retry-After": self.retry_after})
            if fault == "500":
                return _error(500, "The server had an error while processing your request.", "server_error")
            if fault == "hang":
                await asyncio.sleep(self.hang_s)
                return _error(504, "gave up", "server_error")  # the client stopped waiting long ago
            if fault == "drop":
                return _Dropped()
            payload = answer(body, number, malformed=fault == "malformed", nan=fault == "nan")
            with self._lock:
                self.answered[body_hash(body)] += 1
            return JSONResponse(payload)

        return Starlette(routes=[Route("/v1/models", models, methods=["GET"]),
                                 Route("/v1/chat/completions", chat, methods=["POST"]),
                                 Route("/v1/completions", completions, methods=["POST"])])

    def _completion(self, body: dict, number: int, malformed: bool, nan: bool) -> dict:
        """vLLM's completions answer with prompt_logprobs: per prompt token {id: {logprob, rank, decoded_token}}."""
        import torch

        from flywheel.checkpoints import load_student
        from flywheel.train.rl.loss import token_logprobs

        if self._scorer is None:
            self._scorer = load_student(self.logprob_model)
        model, tokenizer = self._scorer
        ids = body["prompt"]
        with torch.no_grad():
            values = token_logprobs(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0]
        entries = [None] + [{str(t): {"logprob": None if nan else float(v), "rank": 1,
                                      "decoded_token": tokenizer.decode([t])}}
                            for t, v in zip(ids[1:], values[1:].tolist(), strict=True)]
        choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
        if body.get("prompt_logprobs") is not None:
            choice["prompt_logprobs"] = entries
        return {"id": f"cmpl-{number}", "object": "text_completion", "created": 0, "model": body["model"],
                "choices": [choice], "usage": {"prompt_tokens": len(ids), "completion_tokens": 1,
                                               "total_tokens": len(ids) + 1}}

    def _answer(self, body: dict, number: int, malformed: bool, nan: bool = False) -> dict:
        judge = self.judge
        played = simulated_user(body)
        if played is not None:
            message = {"role": "assistant", "content": played}
        elif judge:
            message = {"role": "assistant", "content": judge(body["messages"])}
        elif self.replay is not None:
            message = self.replay(body["messages"])
        else:
            message = self.env.solve(body["messages"])
        calls = message.get("tool_calls") or []
        if malformed and calls:
            calls = [{**calls[0], "function": {**calls[0]["function"], "arguments": '{"expression": "1 +'}}]
        if self.mode == "tools":
            out = {"role": "assistant", "content": message.get("content") or None}
            if calls:
                out["tool_calls"] = [{"id": f"call_{number}_{i}", "type": "function", "function": c["function"]}
                                     for i, c in enumerate(calls)]
        else:
            text = message.get("content") or ""
            for call in calls:
                text += (render_tool_call(call) if not malformed
                         else '<tool_call>{"name": "calculator", "arguments": {"expression": "1 +</tool_call>')
            out = {"role": "assistant", "content": text}
        prompt_tokens = _tokens(json.dumps(body["messages"]) + json.dumps(body.get("tools") or []))
        completion_tokens = _tokens(json.dumps(out))
        return {"id": f"chatcmpl-{number}", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "message": out, "logprobs": None,
                             "finish_reason": "tool_calls" if calls and self.mode == "tools" else "stop"}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}


def simulated_user(body: dict) -> str | None:
    """The simulated user's answer, by rule, to a request with its prompt (None: not such a request).

    Playing a scenario: the first of its sentences (or lines) that none of the user's own earlier turns (the
    request's assistant messages) contains, then "Thank you, that is all." with STOP. Writing a scenario: the
    customer's messages as sentences, one per line, so playing it says them again in order.
    """
    messages = body.get("messages") or []
    system = (messages[0].get("content") or "") if messages and messages[0].get("role") == "system" else ""
    if body.get("tools") or not isinstance(system, str):
        return None
    if system.startswith(USER_PROMPT.splitlines()[0]):
        scenario = system.split("<scenario>", 1)[1].split("</scenario>", 1)[0]
        said = " ".join(m.get("content") or "" for m in messages if m.get("role") == "assistant")
        for sentence in _sentences(scenario):
            if sentence not in said:
                return sentence
        return f"Thank you, that is all. {STOP}"
    if system.startswith(SCENARIO_PROMPT.splitlines()[0]):
        listed = messages[-1].get("content") or ""
        blocks = re.split(r"(?:^|\n\n)Message \d+:\n", listed)
        return "\n".join(block.strip() for block in blocks if block.strip())
    return None


def _sentences(text: str) -> list[str]:
    return [s.strip() for line in text.splitlines() for s in re.split(r"(?<=[.!?])\s+", line) if s.strip()]


class TraceReplayer:
    """A teacher that answers by replaying recorded conversations: the one whose prompt (up to its first user
    message) opens the request gives its next assistant turn, counted by the assistant turns already there."""

    def __init__(self, conversations: list[list[dict]]):
        self.by_prompt: dict[str, list[dict]] = {}
        for messages in conversations:
            first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
            self.by_prompt.setdefault(self._key(messages[:first_user + 1]), [
                m for m in messages[first_user + 1:] if m["role"] == "assistant"])

    @staticmethod
    def _key(prompt: list[dict]) -> str:
        return json.dumps([[m["role"], m.get("content") or ""] for m in prompt])

    def __call__(self, messages: list[dict]) -> dict:
        first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
        turns = self.by_prompt.get(self._key(messages[:first_user + 1]))
        if turns is None:
            return {"role": "assistant", "content": "I have no record of this conversation."}
        done = sum(m["role"] == "assistant" for m in messages[first_user + 1:])
        if done >= len(turns):
            return {"role": "assistant", "content": "That is all."}
        turn = turns[done]
        return {"role": "assistant", "content": turn.get("content") or "",
                **({"tool_calls": turn["tool_calls"]} if turn.get("tool_calls") else {})}


def _error(status: int, message: str, kind: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                        status_code=status, headers=headers)


def main() -> None:
    """Serve until killed, printing the base URL first: `python tests/openai_server.py --latency 0.05`."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--mode", choices=["tools", "text"], default="tools")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds added to every answer")
    args = parser.parse_args()
    server = OracleServer(mode=args.mode, latency_s=args.latency).start()
    print(server.url, flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
