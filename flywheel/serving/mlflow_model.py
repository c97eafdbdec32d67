"""The registered student as an MLflow model: a pyfunc chat model over the checkpoint folder.

A pyfunc ChatModel rather than the transformers flavor: the flavor's chat pipeline neither passes `tools` to the
chat template nor parses `<tool_call>` text, and a LoRA adapter needs its base. This model answers in
OpenAI's chat.completion format through the same ChatEngine as `flywheel serve-model`, so
`mlflow.pyfunc.load_model("models:/<pipeline>@champion").predict({"messages": [...], "tools": [...]})` and
`mlflow models serve -m models:/<pipeline>@champion` give the server's answers. Loading it needs the flywheel
package importable (the project's environment: `mlflow models serve --env-manager local`).
"""

from __future__ import annotations

import warnings
from pathlib import Path

with warnings.catch_warnings():  # ChatModel is "deprecated" in favour of ResponsesAgent, which is not
    warnings.simplefilter("ignore")  # OpenAI chat.completions: the format the harness and collect speak
    from mlflow.pyfunc import ChatModel
    from mlflow.types.llm import ChatCompletionResponse

from flywheel.registry import CHECKPOINT


class StudentChatModel(ChatModel):
    """The student checkpoint answering chat requests with tools; loaded on CPU unless a GPU is present."""

    def __init__(self):
        with warnings.catch_warnings():  # ChatModel's deprecation, as at its import above
            warnings.simplefilter("ignore")
            super().__init__()

    def load_context(self, context) -> None:
        from flywheel.serving.chat import ChatEngine

        self.engine = ChatEngine.from_checkpoint(Path(context.artifacts[CHECKPOINT]))
        self.model_name = (context.model_config or {}).get("model_name", "student")

    def predict(self, context, messages, params) -> ChatCompletionResponse:
        from flywheel.serving.chat import parse_request

        body = {"messages": [m.to_dict() for m in messages], **_params(params)}
        response = self.engine.answer(parse_request(body), self.model_name)
        for choice in response["choices"]:
            choice.pop("logprobs", None)
        return ChatCompletionResponse.from_dict(response)


def _params(params) -> dict:
    """ChatParams as the request keys the engine reads (tools back to plain OpenAI dicts)."""
    out = {"temperature": params.temperature, "n": params.n}
    for key in ("max_tokens", "top_p"):
        if getattr(params, key) is not None:
            out[key] = getattr(params, key)
    if params.tools:
        out["tools"] = [_plain(tool.to_dict()) for tool in params.tools]
    if params.custom_inputs and "seed" in params.custom_inputs:
        out["seed"] = int(params.custom_inputs["seed"])
    return out


def _plain(value):
    """A dataclass dict without the None fields MLflow fills in (a JSON Schema keyword set to null is invalid)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value

