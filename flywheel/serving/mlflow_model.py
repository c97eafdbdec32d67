"""The registered student as an MLflow model: a pyfunc model answering OpenAI chat.completions requests.

A plain PythonModel with a signature of its own. Not a ChatModel: its fixed signature types every tool's
`parameters` key by key, so an ordinary JSON-Schema keyword (`minimum`, `maxLength`, ...) fails MLflow's schema
check before the model sees it. Not the transformers flavor: its chat pipeline neither passes `tools` to the chat
template nor parses `<tool_call>` text, and a LoRA adapter needs its base. Here the signature names the request's
keys with MLflow's AnyType, and the request is checked by the same parse_request as `flywheel serve-model` (a bad
one is an MLflow INVALID_PARAMETER_VALUE, HTTP 400, saying which key). So
`mlflow.pyfunc.load_model("models:/<pipeline>@champion").predict({"messages": [...], "tools": [...]})` and
`mlflow models serve -m models:/<pipeline>@champion` (POST /invocations with the same body) give the server's
answers. Loading it needs the flywheel package importable (`mlflow models serve --env-manager local` from the
project's environment).

Streaming: `predict_stream` yields chat.completion.chunk dicts (the MLmodel says `streamable`). MLflow 3.17's
scoring server has no streamed response (it answers every request with one JSON body), so there a request with
`"stream": true` gets the same chunks as one JSON list.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import mlflow.pyfunc
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.types.schema import AnyType, Array, ColSpec, Schema

from flywheel.registry import CHECKPOINT
from flywheel.serving.chat import ChatRequest, RequestError, parse_request, stream_chunks

# The chat.completions keys the engine reads, all but `messages` optional and every one of MLflow's AnyType: MLflow
# passes them as sent (a tool's JSON Schema, a null seed) and parse_request checks them, as `flywheel serve-model`
# does. Keys not named here (`model`, `user`) are dropped by MLflow's schema check.
SIGNATURE = ModelSignature(inputs=Schema(
    [ColSpec(Array(AnyType()), "messages")]
    + [ColSpec(AnyType(), key, required=False)
       for key in ("tools", "tool_choice", "parallel_tool_calls", "n", "temperature", "top_p", "max_tokens",
                   "max_completion_tokens", "seed", "stop", "stream", "stream_options")]))


class StudentChatModel(mlflow.pyfunc.PythonModel):
    """The student checkpoint answering chat requests with tools; loaded on CPU unless a GPU is present."""

    signature = SIGNATURE

    def load_context(self, context) -> None:
        from flywheel.serving.chat import ChatEngine

        config = context.model_config or {}
        # constrained_tools: as the pipeline's environment.constrained_tools; give it at load time with
        # mlflow.pyfunc.load_model(uri, model_config={"constrained_tools": True})
        self.engine = ChatEngine.from_checkpoint(Path(context.artifacts[CHECKPOINT]),
                                                 constrained=bool(config.get("constrained_tools", False)))
        self.model_name = config.get("model_name", "student")

    # the hint is what MLflow passes (a frame, after its schema check; dicts are taken too): with none, MLflow
    # warns at every import that predict has no type hints
    def predict(self, context, model_input: pd.DataFrame):
        """The chat.completion for each request (its chunks as a list when it asks to stream); one: not a list."""
        answers = []
        for body in _requests(model_input):
            request, response = self._answer(body)
            answers.append(list(_chunks(request, response)) if request.stream else response)
        return answers[0] if len(answers) == 1 else answers

    def predict_stream(self, context, model_input) -> Iterator[dict]:
        """One request's answer as chat.completion.chunk dicts."""
        requests = _requests(model_input)
        if len(requests) != 1:
            raise MlflowException.invalid_parameter_value(f"predict_stream takes one request, not {len(requests)}")
        yield from _chunks(*self._answer(requests[0]))

    def _answer(self, body: dict) -> tuple[ChatRequest, dict]:
        try:
            request = parse_request(body)
            return request, self.engine.answer(request, self.model_name)
        except RequestError as err:
            raise MlflowException.invalid_parameter_value(str(err)) from None


def _chunks(request: ChatRequest, response: dict) -> Iterator[dict]:
    return stream_chunks(response, include_usage=request.include_usage)


def _requests(model_input) -> list[dict]:
    """The request bodies in what MLflow passes: a DataFrame after its schema check (a row per request), or dicts."""
    if isinstance(model_input, dict):
        return [model_input]
    if isinstance(model_input, list):
        return model_input
    return [{key: _unwidened(key, value) for key, value in row.items() if not _missing(value)}
            for row in model_input.to_dict(orient="records")]


def _missing(value) -> bool:
    """A key the row's request left out: None, or NaN where pandas filled a gap in a column."""
    return value is None or (isinstance(value, float) and value != value)


def _unwidened(key: str, value):
    """An integer key as sent: pandas makes a column of ints float when another row leaves it out."""
    if key in ("n", "max_tokens", "max_completion_tokens", "seed") and isinstance(value, float) and value.is_integer():
        return int(value)
    return value
