"""One chat request checked and answered in OpenAI's chat.completions format, by a student policy.

The pyfunc model (mlflow_model.py) and the HTTP server (server.py) both answer through ChatEngine, so the
registered model and the served one give the same answer to the same request. Tool calls come out of the
policy already parsed by the harness's one parser (flywheel/policies/toolcalls.py).

`tool_choice` ("auto", "none", "required" or a named function) goes to the policy in Sampling.tool_choice, and
the served pipeline's `environment.constrained_tools` in Sampling.constrained: a policy that constrains (hf) then
writes only calls that parse, one where one is required, none under "none". The server holds every answer to
tool_choice either way, for a policy that does not constrain (the switch off, vLLM):
- "none" (and a request without tools) never answers with tool calls: the tools are left out of the prompt and
  any `<tool_call>` text the model still writes is cut from the content.
- A sampled choice (temperature > 0) whose call does not parse, or with no (matching) call where one is required,
  is sampled again, at most MAX_RESAMPLES times. A greedy one is not: it would write the same text.
- "required" and a named function still unmet: the request fails with a 422 `tool_choice_not_met`; the client
  decides (sample, or ask with "auto").
- A call that still does not parse is never returned as markup in `content`: it is cut out (the text before it
  stays) and the choice's finish_reason is `malformed_function_call` (Gemini's name for the same event), so a
  client can tell it from an answer ("length" when the call was cut by max_tokens).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from flywheel.policies.base import Policy, Sampling
from flywheel.policies.toolcalls import MALFORMED_CALL

MAX_N = 16
MAX_DEFAULT_TOKENS = 1024  # when a request gives no max_tokens: the rest of the context, up to this
MAX_STOP = 4  # stop sequences per request, as OpenAI allows
CALL_TEXT = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)  # closed or not: cut under "none"
MAX_RESAMPLES = 2  # sampled choices that break tool_choice are sampled again at most this many times
RESAMPLE_SEED_STEP = 7919  # a seeded request's resamples use seed + step * attempt: reproducible, not repeated


class RequestError(ValueError):
    """A request the server refuses: an HTTP 4xx with an OpenAI-style error body; nothing is recorded."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status

    def body(self) -> dict:
        kind = "not_found_error" if self.status == 404 else "server_error" if self.status >= 500 else \
            "invalid_request_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatRequest:
    """What a chat.completions request asks for, checked: normalised messages, tools, n and sampling.

    `tools` are those the prompt shows: none under tool_choice "none", only the named one under a named choice.
    """

    messages: list[dict]
    tools: list[dict]
    n: int
    temperature: float
    top_p: float
    max_tokens: int | None
    seed: int | None
    stream: bool
    tool_choice: str = "auto"  # none, auto or required (a named function is required, with `function`)
    function: str | None = None
    parallel_tool_calls: bool = True
    stop: tuple[str, ...] = ()
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage


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
    choice, function = check_tool_choice(body.get("tool_choice"), tools)
    shown = [] if choice == "none" else [t for t in tools if t["function"]["name"] == function] if function else tools
    # max_completion_tokens is OpenAI's newer name for max_tokens: it wins when both are given
    max_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not (stream and isinstance(options, dict)):
        raise RequestError("stream_options must be an object, given only with stream: true", param="stream_options",
                           code="invalid_value")
    return ChatRequest(
        messages=messages, tools=shown,
        n=_number(body, "n", 1, 1, MAX_N, integer=True),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        max_tokens=_number(body, max_key, None, 1, 1 << 20, integer=True),
        seed=None if body.get("seed") is None else _number(body, "seed", 0, -(1 << 62), 1 << 62, integer=True),
        stream=stream, tool_choice=choice, function=function,
        parallel_tool_calls=_flag(body, "parallel_tool_calls", default=True),
        stop=_stop(body.get("stop")),
        include_usage=_flag(options or {}, "include_usage", param="stream_options.include_usage"))


def check_tool_choice(choice, tools: list[dict]) -> tuple[str, str | None]:
    """(none | auto | required, the function a named choice forces); "none" whenever the request has no tools."""
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if isinstance(name, str):
        names = [t["function"]["name"] for t in tools]
        if name not in names:
            raise RequestError(f"tool_choice names the function '{name}', which is not among the request's tools "
                               f"({', '.join(names) or 'none given'})", param="tool_choice", code="invalid_value")
        return "required", name
    choice = "auto" if choice is None else choice
    if choice not in ("none", "auto", "required"):
        raise RequestError(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                           f"{{'name': ...}}}}, not {choice!r}", param="tool_choice", code="invalid_value")
    if choice == "required" and not tools:
        raise RequestError("tool_choice 'required' needs tools: the request gives none", param="tool_choice",
                           code="invalid_value")
    return (choice if tools else "none"), None


def _stop(value) -> tuple[str, ...]:
    stops = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be a non-empty string or a list of up to {MAX_STOP} of them, not {value!r}",
                           param="stop", code="invalid_value")
    return tuple(stops)


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


def _flag(body: dict, key: str, default: bool = False, param: str | None = None) -> bool:
    value = body.get(key)
    if not isinstance(value, bool | None):
        raise RequestError(f"{param or key} must be true or false, not {value!r}", param=param or key,
                           code="invalid_value")
    return default if value is None else value


def input_example(env) -> dict:
    """A chat request in the environment's own terms: one of its task prompts, with its tools, answered greedily."""
    task = next(iter(env.generate_tasks(seed=0)), None)
    if task is None:  # an environment whose tasks all come from traces (replay): one of those
        task = next(iter(env.recorded_tasks()))
    return {"messages": list(task.prompt), "tools": env.tools(), "temperature": 0.0, "max_tokens": 64}


@dataclass(frozen=True)
class Prepared:
    """A checked request with what its generate needs: the prompt's length and the sampling settings."""

    request: ChatRequest
    prompt_tokens: int
    sampling: Sampling

    @property
    def rows(self) -> int:
        return self.request.n

    def batch_key(self) -> str | None:
        """What must be equal for requests to share one generate call (tools and every sampling setting); None
        for a seeded request, which runs alone: its answer must not depend on what else is in flight."""
        if self.request.seed is not None:
            return None
        return json.dumps([self.request.tools, asdict(self.sampling)], sort_keys=True)


class ChatEngine:
    """A policy (hf or vllm) with its tokenizer and context length, answering checked requests.

    constrained: the served pipeline's `environment.constrained_tools`, passed to the policy as
    Sampling.constrained (a policy that can constrain its tool calls then does)."""

    def __init__(self, policy: Policy, tokenizer, context_length: int, constrained: bool = False):
        self.policy, self.tokenizer, self.context_length = policy, tokenizer, context_length
        self.constrained = constrained
        self.resampled = 0  # choices sampled again because they broke tool_choice (see answer_many)

    @classmethod
    def from_checkpoint(cls, checkpoint: str | Path, backend: str = "hf", device: str = "auto",
                        constrained: bool = False) -> ChatEngine:
        """Load a student checkpoint folder with transformers (hf) or an in-process vLLM engine (vllm, GPU)."""
        from flywheel.policies import get_policy

        if backend == "vllm":
            policy = get_policy("vllm", model=str(checkpoint), device=device)
            return cls(policy, policy.llm.get_tokenizer(), policy.llm.llm_engine.model_config.max_model_len,
                       constrained)
        policy = get_policy("hf", model_or_path=checkpoint, device=device)
        config = policy.model.config
        return cls(policy, policy.tokenizer, getattr(config, "max_position_embeddings", None) or 1 << 20,
                   constrained)

    def prompt_tokens(self, request: ChatRequest) -> int:
        """How many tokens the prompt takes through the student's chat template."""
        from flywheel.policies.toolcalls import canonical_messages

        encoded = self.tokenizer.apply_chat_template(canonical_messages(request.messages),
                                                     tools=request.tools or None, add_generation_prompt=True,
                                                     tokenize=True, return_dict=True)
        return len(encoded["input_ids"])

    def prepare(self, request: ChatRequest) -> Prepared:
        """The request with its prompt counted and its sampling settings; RequestError if it does not fit."""
        prompt = self.prompt_tokens(request)
        room = self.context_length - prompt
        if room < 1:
            raise RequestError(f"this model's maximum context length is {self.context_length} tokens; the messages "
                               f"and tools take {prompt}", param="messages", code="context_length_exceeded")
        choice = {"type": "function", "function": {"name": request.function}} if request.function \
            else request.tool_choice
        sampling = Sampling(temperature=request.temperature, max_new_tokens=min(request.max_tokens or
                                                                                MAX_DEFAULT_TOKENS, room),
                            top_p=request.top_p, seed=request.seed, tool_choice=choice, constrained=self.constrained)
        return Prepared(request, prompt, sampling)

    def answer(self, request: ChatRequest, model: str) -> dict:
        """The chat.completion for one request (see answer_many); RequestError when it cannot be answered."""
        answer = self.answer_many([self.prepare(request)], model)[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def answer_many(self, batch: list[Prepared], model: str) -> list[dict | RequestError]:
        """One generate call for requests of one batch_key (n rows each), then each request's chat.completion:
        n choices, tool calls parsed and held to tool_choice, usage counted; or the RequestError it alone gets.

        Sampled choices that break tool_choice (a call that does not parse, none where one is required) are
        sampled again, at most MAX_RESAMPLES times, in one call for all of them. Usage counts the prompt once
        (as OpenAI does for n > 1) and every token generated, stop sequences and resampled choices included.
        """
        first = batch[0]
        owners = [j for j, prepared in enumerate(batch) for _ in range(prepared.rows)]
        conversations = [batch[j].request.messages for j in owners]
        completions = self.policy.generate(conversations, first.request.tools, first.sampling)
        spent = [len(c.token_ids or []) for c in completions]
        for attempt in range(1, MAX_RESAMPLES + 1 if first.request.temperature > 0 else 1):
            again = [i for i, c in enumerate(completions) if _breaks_tool_choice(c, batch[owners[i]].request)]
            if not again:
                break
            self.resampled += len(again)
            seed = None if first.sampling.seed is None else first.sampling.seed + RESAMPLE_SEED_STEP * attempt
            redone = self.policy.generate([conversations[i] for i in again], first.request.tools,
                                          replace(first.sampling, seed=seed))
            for i, completion in zip(again, redone, strict=True):
                completions[i] = completion
                spent[i] += len(completion.token_ids or [])
        answers: list[dict | RequestError] = []
        for j, prepared in enumerate(batch):
            mine = [i for i, owner in enumerate(owners) if owner == j]
            try:
                answers.append(self._response(prepared, [completions[i] for i in mine], sum(spent[i] for i in mine),
                                              model))
            except RequestError as refused:
                answers.append(refused)
        return answers

    def _response(self, prepared: Prepared, completions: list, generated: int, model: str) -> dict:
        request, max_new = prepared.request, prepared.sampling.max_new_tokens
        answer_id = uuid.uuid4().hex[:24]
        eos = getattr(self.tokenizer, "eos_token_id", None)
        choices = []
        for index, completion in enumerate(completions):
            content, calls = _held_to_tool_choice(completion, request, index)
            content, stopped = _cut_at_stop(content, request.stop)
            message = {"role": "assistant", "content": content or None}
            if calls:  # ids unique across conversations, as OpenAI's are
                message["tool_calls"] = [{**call, "id": f"call_{answer_id}_{index}_{i}"} for i, call in
                                         enumerate(calls)]
            elif message["content"] is None:
                message["content"] = ""
            ids = completion.token_ids or []
            ran_out = len(ids) >= max_new and not (stopped or (bool(ids) and ids[-1] == eos))
            finish = "tool_calls" if calls else "length" if ran_out else \
                MALFORMED_CALL if completion.error and request.tool_choice != "none" else "stop"
            choices.append({"index": index, "message": message, "finish_reason": finish, "logprobs": None})
        prompt = prepared.prompt_tokens
        return {"id": f"chatcmpl-{answer_id}", "object": "chat.completion", "created": int(time.time()),
                "model": model, "choices": choices,
                "usage": {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}}


def _breaks_tool_choice(completion, request: ChatRequest) -> bool:
    """Whether a choice would not do: its call does not parse, or it has no (matching) call where one is required."""
    if request.tool_choice == "none" or not request.tools:
        return False
    if completion.error:
        return True
    calls = completion.message.get("tool_calls") or []
    return request.tool_choice == "required" and not any(
        request.function in (None, call["function"]["name"]) for call in calls)


def _held_to_tool_choice(completion, request: ChatRequest, index: int) -> tuple[str, list[dict]]:
    """(content, tool calls) of one completion as tool_choice and parallel_tool_calls allow; 422 when it cannot.
    The content never holds tool-call markup: a call that did not parse is cut from it (finish_reason says so)."""
    written = request.tool_choice == "none" or completion.error  # no calls to take: the text, its markup cut
    calls = [] if written else completion.message.get("tool_calls") or []
    if request.function:
        calls = [call for call in calls if call["function"]["name"] == request.function]
    if not request.parallel_tool_calls:
        calls = calls[:1]
    if request.tool_choice == "required" and not calls:
        wanted = f"a call to '{request.function}'" if request.function else "a tool call"
        tries = f" in {MAX_RESAMPLES + 1} samples" if request.temperature > 0 else ""
        why = f" ({completion.error})" if completion.error else ""
        raise RequestError(f"tool_choice asks for {wanted}, and choice {index} has none{tries}{why}; the model wrote "
                           f"{completion.text[:200]!r}. Generation is not constrained (environment.constrained_tools "
                           f"is off for this model): ask again with temperature > 0 or with tool_choice 'auto'",
                           param="tool_choice", code="tool_choice_not_met", status=422)
    text = (completion.text or completion.message.get("content") or "") if written else \
        completion.message.get("content") or ""
    return _without_markup(text), calls


def _without_markup(text: str) -> str:
    """The text with every tool call cut out, closed or not, and any stray closing tag."""
    return CALL_TEXT.sub("", text).replace("</tool_call>", "").strip()


def _cut_at_stop(content: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """The content up to the first stop sequence in it, and whether one was found."""
    cuts = [content.find(s) for s in stop if s in content]
    return (content[:min(cuts)], True) if cuts else (content, False)


def stream_chunks(response: dict, include_usage: bool = False) -> Iterator[dict]:
    """A finished answer as chat.completion.chunk events, choice by choice: the role, the content, each tool call
    (with its `index`), the finish; then, with include_usage, a chunk with no choices and the usage."""
    head = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
            "model": response["model"]}
    if "system_fingerprint" in response:
        head["system_fingerprint"] = response["system_fingerprint"]
    if include_usage:
        head["usage"] = None  # as OpenAI's: null on every chunk but the last

    def chunk(index: int, delta: dict, finish: str | None = None) -> dict:
        return {**head, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    for choice in response["choices"]:
        index, message = choice["index"], choice["message"]
        yield chunk(index, {"role": "assistant", "content": ""})
        if message.get("content"):
            yield chunk(index, {"content": message["content"]})
        for i, call in enumerate(message.get("tool_calls") or []):
            yield chunk(index, {"tool_calls": [{"index": i, **call}]})
        yield chunk(index, {}, choice["finish_reason"])
    if include_usage:
        yield {**head, "choices": [], "usage": response["usage"]}
