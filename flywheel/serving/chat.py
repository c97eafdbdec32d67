"""One chat request checked and answered in OpenAI's chat.completions format, by a student policy.

The pyfunc model (mlflow_model.py) and the HTTP server (server.py) both answer through ChatEngine, so the
registered model and the served one give the same answer to the same request. Tool calls come out of the
policy already parsed by the harness's one parser (flywheel/policies/toolcalls.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from flywheel.policies.base import Policy, Sampling

MAX_N = 16
MAX_DEFAULT_TOKENS = 1024  # when a request gives no max_tokens: the rest of the context, up to this


class RequestError(ValueError):
    """A request the server refuses: an HTTP 4xx with an OpenAI-style error body; nothing is recorded."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status

    def body(self) -> dict:
        kind = "not_found_error" if self.status == 404 else "invalid_request_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatRequest:
    """What a chat.completions request asks for, checked: normalised messages, tools, n and sampling."""

    messages: list[dict]
    tools: list[dict]
    n: int
    temperature: float
    top_p: float
    max_tokens: int | None
    seed: int | None
    stream: bool


def parse_request(body) -> ChatRequest:
    """Check a chat.completions body; raise RequestError naming the parameter that is wrong."""
    from flywheel.data.trace_rows import BadRecord, normalise_messages

    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        messages = normalise_messages(body.get("messages"))
    except BadRecord as why:
        raise RequestError(f"messages: {why}", param="messages", code="invalid_messages") from None
    tools = check_tools(body.get("tools"))
    choice = body.get("tool_choice", "auto")
    if choice == "none":
        tools = []
    elif choice not in ("auto", None):
        raise RequestError("tool_choice: only 'auto' and 'none' are supported", param="tool_choice",
                           code="unsupported_value")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    return ChatRequest(
        messages=messages, tools=tools,
        n=_number(body, "n", 1, 1, MAX_N, integer=True),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        max_tokens=None if max_tokens is None else _number({"max_tokens": max_tokens}, "max_tokens", None, 1,
                                                           1 << 20, integer=True),
        seed=None if body.get("seed") is None else _number(body, "seed", 0, -(1 << 62), 1 << 62, integer=True),
        stream=_flag(body, "stream"))


def check_tools(tools) -> list[dict]:
    """OpenAI function tools whose `parameters` are a valid JSON Schema; RequestError naming the tool otherwise."""
    import jsonschema
    from jsonschema.validators import validator_for

    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of function tools", param="tools", code="invalid_tools")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise RequestError(f"{where}: expected {{'type': 'function', 'function': {{...}}}}", param=where,
                               code="invalid_tools")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise RequestError(f"{where}.function.name must be a non-empty string", param=where,
                               code="invalid_tools")
        schema = function.get("parameters", {})
        if not isinstance(schema, dict):
            raise RequestError(f"{where}.function.parameters must be a JSON Schema object", param=where,
                               code="invalid_tools")
        try:
            validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as err:
            raise RequestError(f"{where}.function.parameters is not a valid JSON Schema: {err.message}",
                               param=where, code="invalid_tools") from None
    return tools


def _number(body: dict, key: str, default, low, high, integer: bool = False):
    value = body.get(key, default)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise RequestError(f"{key} must be {kind} in [{low}, {high}], not {value!r}", param=key,
                           code="invalid_value")
    return value if integer else float(value)


def _flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool | None):
        raise RequestError(f"{key} must be true or false, not {value!r}", param=key, code="invalid_value")
    return bool(value)


def input_example(env) -> dict:
    """A chat request in the environment's own terms: one of its task prompts, with its tools, answered greedily."""
    task = next(iter(env.generate_tasks(seed=0)), None)
    if task is None:  # an environment whose tasks all come from traces (replay): one of those
        task = next(iter(env.recorded_tasks()))
    return {"messages": list(task.prompt), "tools": env.tools(), "temperature": 0.0, "max_tokens": 64}


class ChatEngine:
    """A policy (hf or vllm) with its tokenizer and context length, answering checked requests."""

    def __init__(self, policy: Policy, tokenizer, context_length: int):
        self.policy, self.tokenizer, self.context_length = policy, tokenizer, context_length

    @classmethod
    def from_checkpoint(cls, checkpoint: str | Path, backend: str = "hf", device: str = "auto") -> ChatEngine:
        """Load a student checkpoint folder with transformers (hf) or an in-process vLLM engine (vllm, GPU)."""
        from flywheel.policies import get_policy

        if backend == "vllm":
            policy = get_policy("vllm", model=str(checkpoint), device=device)
            return cls(policy, policy.llm.get_tokenizer(), policy.llm.llm_engine.model_config.max_model_len)
        policy = get_policy("hf", model_or_path=checkpoint, device=device)
        config = policy.model.config
        return cls(policy, policy.tokenizer, getattr(config, "max_position_embeddings", None) or 1 << 20)

    def prompt_tokens(self, request: ChatRequest) -> int:
        """How many tokens the prompt takes through the student's chat template."""
        from flywheel.policies.toolcalls import canonical_messages

        encoded = self.tokenizer.apply_chat_template(canonical_messages(request.messages),
                                                     tools=request.tools or None, add_generation_prompt=True,
                                                     tokenize=True, return_dict=True)
        return len(encoded["input_ids"])

    def answer(self, request: ChatRequest, model: str) -> dict:
        """The chat.completion for the request: n choices, tool calls parsed, usage counted."""
        prompt = self.prompt_tokens(request)
        room = self.context_length - prompt
        if room < 1:
            raise RequestError(f"this model's maximum context length is {self.context_length} tokens; the messages "
                               f"and tools take {prompt}", param="messages", code="context_length_exceeded")
        max_new = min(request.max_tokens or MAX_DEFAULT_TOKENS, room)
        sampling = Sampling(temperature=request.temperature, max_new_tokens=max_new, top_p=request.top_p,
                            seed=request.seed)
        completions = self.policy.generate([request.messages] * request.n, request.tools, sampling)
        answer_id = uuid.uuid4().hex[:24]
        eos = getattr(self.tokenizer, "eos_token_id", None)
        choices, generated = [], 0
        for index, completion in enumerate(completions):
            message = {"role": "assistant", "content": completion.message.get("content") or None}
            calls = completion.message.get("tool_calls") or []
            if calls:  # ids unique across conversations, as OpenAI's are
                message["tool_calls"] = [{**call, "id": f"call_{answer_id}_{index}_{i}"} for i, call in
                                         enumerate(calls)]
            elif message["content"] is None:
                message["content"] = ""
            ids = completion.token_ids or []
            generated += len(ids)
            ended = bool(ids) and ids[-1] == eos
            finish = "tool_calls" if calls else "length" if len(ids) >= max_new and not ended else "stop"
            choices.append({"index": index, "message": message, "finish_reason": finish, "logprobs": None})
        return {"id": f"chatcmpl-{answer_id}", "object": "chat.completion", "created": int(time.time()),
                "model": model, "choices": choices,
                "usage": {"prompt_tokens": prompt * request.n, "completion_tokens": generated,
                          "total_tokens": prompt * request.n + generated}}


def stream_chunks(response: dict) -> Iterator[dict]:
    """A finished answer as chat.completion.chunk events: role and content, tool calls, then the finish."""
    head = {k: response[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    for choice in response["choices"]:
        message = choice["message"]
        delta = {"role": "assistant", "content": message.get("content") or ""}
        yield {**head, "choices": [{"index": choice["index"], "delta": delta, "finish_reason": None}]}
        if message.get("tool_calls"):
            calls = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
            yield {**head, "choices": [{"index": choice["index"], "delta": {"tool_calls": calls},
                                        "finish_reason": None}]}
        yield {**head, "choices": [{"index": choice["index"], "delta": {}, "finish_reason": choice["finish_reason"]}]}
