"""`flywheel serve-model`: the version behind an alias over the OpenAI protocol, its answers recorded as traces.

Endpoints: POST /v1/chat/completions (tools, tool_choice, parallel_tool_calls, n, temperature, top_p, max_tokens or
max_completion_tokens, stop, seed, stream, stream_options; see chat.py for what tool_choice does), GET /v1/models,
GET /health (the version served), POST /v1/feedback ({id, outcome | score}; with --mlflow-traces also assessments
on the answer's trace). Every error is OpenAI's error body.

The alias is followed: the registry is polled every `poll_s` seconds (and at once on SIGHUP); a new version is
downloaded and loaded completely before it replaces the old one, and a request keeps the model it started
with, so no request ever meets a half-loaded model. A version that fails to load leaves the old one serving.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request  # at module level: FastAPI resolves the handlers' annotations here
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from flywheel import registry
from flywheel.errors import UserFacingError
from flywheel.serving.batching import MAX_BATCH, WINDOW_S, Batcher
from flywheel.serving.chat import ChatEngine, RequestError, parse_request, stream_chunks
from flywheel.serving.traffic import OUTCOMES, MlflowTraffic, TrafficLog, UnknownAnswer

log = logging.getLogger("flywheel.serve")


class ServeError(UserFacingError, RuntimeError):
    """The server cannot start: no version behind the alias, or no backend for this machine."""


def choose_backend(requested: str = "auto") -> str:
    """hf (transformers) or vllm: auto takes vLLM when it is installed (the `gpu` extra) and a GPU is visible."""
    import importlib.util

    if requested not in ("auto", "hf", "vllm"):
        raise ServeError(f"unknown backend '{requested}' (auto, hf, vllm)")
    if requested == "hf":
        return "hf"
    has_vllm = importlib.util.find_spec("vllm") is not None
    import torch

    has_gpu = torch.cuda.is_available()
    if requested == "vllm" and not (has_vllm and has_gpu):
        missing = "vLLM is not installed (pip install '.[gpu]')" if not has_vllm else "no CUDA GPU is visible"
        raise ServeError(f"backend vllm: {missing}; use --backend hf (transformers, CPU or GPU)")
    return "vllm" if has_vllm and has_gpu else "hf"


@dataclass
class Loaded:
    """One version, loaded whole; concurrent requests on it share generate calls (batching.py)."""

    version: registry.Version
    engine: ChatEngine
    batcher: Batcher
    loaded_at: float = field(default_factory=time.time)

    def answer(self, request, model: str) -> dict:
        return self.batcher.answer(request, model)


class AliasFollower:
    """The version behind `name@alias`, loaded; `check()` swaps in a newer one once it is loaded whole."""

    def __init__(self, name: str, alias: str = "champion", backend: str = "hf", device: str = "auto",
                 constrained: bool = False, max_batch: int = MAX_BATCH, window_s: float = WINDOW_S):
        self.name, self.alias, self.backend, self.device = name, alias, backend, device
        self.constrained, self.max_batch, self.window_s = constrained, max_batch, window_s
        self.current: Loaded | None = None
        self.swaps = 0
        self.last_error: str | None = None
        self._checking = threading.Lock()

    def start(self) -> Loaded:
        """Load the version behind the alias now; ServeError naming the model and alias if there is none."""
        version = registry.get_alias(self.name, self.alias)
        if version is None:
            raise ServeError(f"no version of the registered model '{self.name}' has the alias '{self.alias}' "
                             f"(tracking store {registry.client().tracking_uri}): run `flywheel run {self.name}` "
                             f"or `flywheel promote {self.name} VERSION` first")
        self.current = self._load(version)
        return self.current

    def check(self) -> bool:
        """Follow the alias: True when a different version was loaded and is now served."""
        with self._checking:  # one load at a time; a SIGHUP during a poll waits for it
            version = registry.get_alias(self.name, self.alias)
            if version is None:
                self.last_error = f"alias '{self.alias}' of '{self.name}' was removed; still serving " \
                                  f"version {self.current.version.version}"
                log.warning(self.last_error)
                return False
            if self.current is not None and version.version == self.current.version.version:
                return False
            try:
                loaded = self._load(version)
            except Exception as err:  # keep serving the old version; say why on /health
                self.last_error = f"version {version.version} failed to load: {type(err).__name__}: {err}"
                log.error(self.last_error)
                return False
            previous, self.current = self.current, loaded  # one assignment: requests see old or new, whole
            self.swaps += 1
            self.last_error = None
            log.warning("%s@%s: now serving version %s (was %s)", self.name, self.alias, version.version,
                        previous.version.version if previous else "none")
            return True

    def follow(self, stop: threading.Event, wake: threading.Event, poll_s: float) -> None:
        """Check every poll_s seconds, or when `wake` is set (SIGHUP), until `stop`."""
        while not stop.is_set():
            wake.wait(poll_s)
            wake.clear()
            if stop.is_set():
                return
            try:
                self.check()
            except Exception as err:  # a registry that is briefly unreachable must not end the server
                self.last_error = f"checking the alias failed: {type(err).__name__}: {err}"
                log.error(self.last_error)

    def _load(self, version: registry.Version) -> Loaded:
        # both backends read the checkpoint whole when the engine is made: the download goes once it is loaded
        with tempfile.TemporaryDirectory(prefix=f"flywheel-serve-{version.name}-v{version.version}-") as folder:
            checkpoint = registry.download(version, Path(folder))
            engine = ChatEngine.from_checkpoint(checkpoint, self.backend, self.device, self.constrained)
        return Loaded(version, engine, Batcher(engine, self.max_batch, self.window_s))


def create_app(follower: AliasFollower, traffic: TrafficLog | None, traced: MlflowTraffic | None = None):
    """The FastAPI app: chat completions, models, health, feedback; errors in OpenAI's error shape. `traced`:
    every answer also an MLflow trace."""
    app = FastAPI(title=f"flywheel serve-model {follower.name}@{follower.alias}")
    names = {follower.name, f"{follower.name}@{follower.alias}"}

    @app.exception_handler(RequestError)
    async def refused(_, err: RequestError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def http_error(_, err: HTTPException):
        body = RequestError(str(err.detail), code=str(err.status_code), status=err.status_code).body()
        return JSONResponse(body, status_code=err.status_code)

    @app.exception_handler(Exception)  # a failed generation: still OpenAI's body (uvicorn logs the traceback)
    async def failed(_, err: Exception):
        body = RequestError(f"the server failed to answer: {type(err).__name__}: {err}", status=500).body()
        return JSONResponse(body, status_code=500)

    async def json_body(request: Request) -> dict:
        try:
            body = await request.json()
        except ValueError as err:
            raise RequestError(f"the request body is not JSON: {err}") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        return body

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await json_body(request)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise RequestError("model is required", param="model", code="missing_model")
        if model not in names:
            raise RequestError(f"the model '{model}' does not exist here; this server serves "
                               f"{' or '.join(sorted(names))}", param="model", code="model_not_found", status=404)
        parsed = parse_request(body)
        loaded = follower.current  # this request's model, whatever the alias does meanwhile
        started = time.monotonic()
        response = await run_in_threadpool(loaded.answer, parsed, follower.name)
        latency_s = time.monotonic() - started
        served = {"model": follower.name, "alias": follower.alias, "version": loaded.version.version}
        response["system_fingerprint"] = f"{follower.name}-v{loaded.version.version}"
        if traffic is not None:
            await run_in_threadpool(traffic.record, body, response, served)
        if traced is not None:
            await run_in_threadpool(traced.record, body, response, served, latency_s)
        if parsed.stream:
            chunks = stream_chunks(response, parsed.include_usage)
            events = [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks] + ["data: [DONE]\n\n"]
            return StreamingResponse(iter(events), media_type="text/event-stream")
        return response

    @app.get("/v1/models")
    async def models():
        loaded = follower.current
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": int(loaded.loaded_at), "owned_by": "flywheel",
             "version": loaded.version.version} for name in sorted(names)]}

    @app.get("/health")
    async def health():
        loaded = follower.current
        return {"status": "ok", "model": follower.name, "alias": follower.alias, "version": loaded.version.version,
                "model_hash": loaded.version.model_hash, "backend": follower.backend, "swaps": follower.swaps,
                "constrained_tools": follower.constrained, "generate_calls": loaded.batcher.calls,
                "answered": loaded.batcher.answered, "resampled": loaded.engine.resampled,
                "last_error": follower.last_error,
                "recorded": traffic.recorded if traffic else 0, "labelled": traffic.labelled if traffic else 0,
                "mlflow_traces": traced.recorded if traced else 0}

    @app.post("/v1/feedback")
    async def feedback(request: Request):
        body = await json_body(request)
        answer_id, outcome, score = body.get("id"), body.get("outcome"), body.get("score")
        if not isinstance(answer_id, str) or not answer_id:
            raise RequestError("id (the chat completion's id) is required", param="id")
        if outcome is None and score is None:
            raise RequestError("give an outcome or a score (or both)", param="outcome")
        if outcome is not None and outcome not in OUTCOMES:
            raise RequestError(f"outcome must be one of {', '.join(OUTCOMES)}, not {outcome!r}", param="outcome")
        if score is not None and (isinstance(score, bool) or not isinstance(score, int | float)):
            raise RequestError(f"score must be a number, not {score!r}", param="score")
        if traffic is None and traced is None:
            raise RequestError("this server records no traffic (started with --no-record)", status=409)
        found = False
        if traffic is not None:
            try:
                await run_in_threadpool(traffic.label, answer_id, outcome, score)
                found = True
            except UnknownAnswer:
                pass
        if traced is not None:  # also an assessment on its MLflow trace
            found = await run_in_threadpool(traced.label, answer_id, outcome, score) or found
        if not found:
            raise RequestError(f"no answer with id '{answer_id}' was recorded by this server", param="id",
                               code="not_found", status=404)
        return {"id": answer_id, "labelled": True}

    return app


def constrained_tools(root: Path, name: str) -> bool:
    """The served pipeline's `environment.constrained_tools`; False when root's pipelines.yaml has no such pipeline
    (a model registered elsewhere). A pipeline that is there must load: its ConfigError names the key."""
    from flywheel.config import load_pipeline, read_pipelines_file

    path = root / "pipelines.yaml"
    if not path.is_file() or name not in read_pipelines_file(path):
        return False
    return load_pipeline(name, path).environment.constrained_tools


def traces_folder(root: Path, name: str) -> Path:
    """Where served traffic goes by default: traces/served/<pipeline>/ under the project root."""
    return root / "traces" / "served" / name


class ModelServer:
    """The server: `with ModelServer(...)` runs it in a background thread on a free loopback port (tests, the loop,
    the benchmark); `run()` serves in this thread until interrupted (`flywheel serve-model`)."""

    def __init__(self, name: str, alias: str = "champion", traces: Path | None = None, poll_s: float = 2.0,
                 backend: str = "hf", device: str = "auto", port: int = 0, host: str = "127.0.0.1",
                 mlflow_experiment: str | None = None, root: Path = Path("."), constrained: bool | None = None,
                 max_batch: int = MAX_BATCH, window_s: float = WINDOW_S):
        """constrained: None takes the pipeline's `environment.constrained_tools` from root's pipelines.yaml (off
        for a model no pipeline there names). max_batch, window_s: how concurrent requests share generate calls."""
        if constrained is None:
            constrained = constrained_tools(root, name)
        self.follower = AliasFollower(name, alias, backend, device, constrained, max_batch, window_s)
        self.traces = traces
        self.traffic: TrafficLog | None = None  # made once the version is loaded
        self.mlflow_experiment, self.root = mlflow_experiment, root
        self.traced: MlflowTraffic | None = None
        self.host, self.port, self.poll_s = host, port, poll_s
        self._stop, self._wake = threading.Event(), threading.Event()
        self._threads: list[threading.Thread] = []
        self._server = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def reload(self) -> None:
        """Check the alias now (what SIGHUP does)."""
        self._wake.set()

    def _start(self) -> None:
        """Load the version behind the alias, build the HTTP server and start following the alias."""
        import socket

        import uvicorn

        self.follower.start()
        self.traffic = TrafficLog(self.traces) if self.traces is not None else None
        if self.mlflow_experiment:
            self.traced = MlflowTraffic(self.root, self.follower.name, self.mlflow_experiment)
        if not self.port:
            with socket.socket() as probe:
                probe.bind((self.host, 0))
                self.port = probe.getsockname()[1]
        config = uvicorn.Config(create_app(self.follower, self.traffic, self.traced), host=self.host, port=self.port,
                                log_level="warning", access_log=False)
        self._server = uvicorn.Server(config)
        follow = threading.Thread(target=self.follower.follow, args=(self._stop, self._wake, self.poll_s),
                                  daemon=True, name="serve-model-alias")
        self._threads.append(follow)
        follow.start()

    def run(self) -> None:
        """Serve in this thread until interrupted (uvicorn's SIGINT and SIGTERM handling); SIGHUP checks the alias."""
        self._start()
        if hasattr(signal, "SIGHUP"):
            signal.signal(signal.SIGHUP, lambda *_: self.reload())
        follower = self.follower
        also = f" and MLflow experiment {self.mlflow_experiment!r}" if self.traced else ""
        print(f"serving {follower.name}@{follower.alias} (version {follower.current.version.version}, "
              f"{follower.backend}) at {self.url} (pid {os.getpid()}); traffic to "
              f"{self.traces or 'nowhere (--no-record)'}{also}; following the alias every {self.poll_s:g}s and on "
              f"SIGHUP; up to {follower.max_batch} rows a generate call; tool calls "
              f"{'constrained' if follower.constrained else 'not constrained'} (environment.constrained_tools)",
              flush=True)
        try:
            self._server.run()
        finally:
            self._stop.set()
            self._wake.set()

    def __enter__(self) -> ModelServer:
        self._start()
        serving = threading.Thread(target=self._server.run, daemon=True, name="serve-model")
        self._threads.append(serving)
        serving.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if time.monotonic() > deadline or not serving.is_alive():
                raise ServeError(f"the server did not start on {self.host}:{self.port}")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._wake.set()
        if self._server is not None:
            self._server.should_exit = True
        for thread in self._threads:
            thread.join(timeout=30)


def serve(name: str, alias: str, host: str, port: int, traces: Path | None, poll_s: float, backend: str,
          device: str, mlflow_experiment: str | None = None, root: Path = Path("."), max_batch: int = MAX_BATCH,
          window_s: float = WINDOW_S) -> None:
    """Serve until interrupted (the `flywheel serve-model` command): SIGHUP checks the alias at once.
    mlflow_experiment: every answer also an MLflow trace there."""
    ModelServer(name, alias, traces, poll_s, choose_backend(backend), device, port, host, mlflow_experiment,
                root, max_batch=max_batch, window_s=window_s).run()
