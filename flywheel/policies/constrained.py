"""Constrained decoding of tool calls: per-row token masks that keep every `<tool_call>` a valid call.

The calls are the chat templates' Hermes form, `<tool_call>{"name": N, "arguments": {...}}</tool_call>`, written
as flywheel.policies.toolcalls.render_tool_call writes them (json.dumps separators, no other whitespace), so a
constrained call is what the student was trained to write and always parses with parse_completion. The grammar is
compiled by llguidance (chosen over xgrammar by measurement: docs/measured.md) once per (tokenizer, tools,
tool_choice) and cached; each row of a batch gets its own matcher.

- "auto": free text; from the moment the text opens a call until `</tool_call>`, only a call of an offered tool
  whose arguments are valid against its JSON schema; then free again. Where the tokenizer has the opener as one
  token (the tiny student) that token opens a call and free text may not spell the marker out; where it is text
  (SmolLM2 writes `<`, `tool`, `_`, `call`, `>`) a lazy grammar rule ends the free text at the marker.
- "required" or a named function ({"type": "function", "function": {"name": N}}): one or more calls (of that
  function) from the first token, then the end of the answer (eos).
- "none": never a call.

Free text is unmasked: `allowed()` is None when the grammar allows every token that free text can take at all;
the others (special tokens such as `<|im_start|>`, bytes that cannot begin a character), sampled there, are
passed over, as they open nothing. So masks, and the learner's work with them, exist only where a call is being
written or where the free text could open one it must not (with "none" and a one-token opener: every position).

A tool whose schema the library cannot compile is not an error that stops a run: a warning names the tool and
the library's reason, and that tool's arguments are constrained to any JSON object (its name still to an offered
tool); the other tools keep their schemas. A named function that is not offered, or "required" with no tools, is
a ConstraintError.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass

import numpy as np

from flywheel.errors import UserFacingError

log = logging.getLogger(__name__)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# json.dumps's separators and nothing else: the form the templates render and the student learned
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 64  # compiled grammars kept (tokenizer x tools x tool_choice); every turn of every episode asks again


class ConstraintError(UserFacingError, ValueError):
    """A tool_choice the offered tools cannot satisfy (or that is not a tool_choice), or a tokenizer that is not a
    fast one."""


def row_constraints(tokenizer, tools: list[dict] | None, tool_choice: str | dict, n_rows: int,
                    vocab_size: int) -> list[RowConstraint] | None:
    """One RowConstraint per row of a batch, or None when nothing is constrained (no tools and choice "auto").

    `tokenizer` is a fast Hugging Face tokenizer; `vocab_size` the width of the logits (masks are padded with
    False past the tokenizer's length)."""
    choice = _choice_key(tool_choice)
    if not tools and choice == "auto":
        return None
    grammar = _compiled(_tokenizer_key(tokenizer), _tools_key(tools or []), choice)
    return [RowConstraint(grammar, vocab_size) for _ in range(n_rows)]


class RowConstraint:
    """The constraint of one row: `allowed()` before sampling, `accept(token)` after."""

    def __init__(self, grammar: _Grammar, vocab_size: int):
        self._grammar = grammar
        self._matcher = grammar.matcher.deep_copy()
        self._vocab_size = vocab_size
        self._bits = np.zeros(grammar.words, dtype=np.int32)
        self._masked = True  # whether the last allowed() returned a mask

    def allowed(self):
        """torch.BoolTensor[vocab_size] of the tokens that may come next, or None when any may (free text)."""
        import torch

        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        free = self._grammar.free_words
        if free is not None and (np.bitwise_or(self._bits, free) == -1).all():
            self._masked = False
            return None
        self._masked = True
        # the bits past the tokenizer's length are 0, and unpackbits pads with 0 up to `count`
        return torch.from_numpy(np.unpackbits(self._bits.view(np.uint8), count=self._vocab_size,
                                              bitorder="little").view(bool))

    def accept(self, token_id: int) -> None:
        """Advance past the sampled token."""
        token_id = int(token_id)
        if token_id < self._grammar.n_vocab and self._matcher.try_consume_tokens([token_id]) == 1:
            return
        if not self._masked:
            return  # a special token in free text: it opens nothing, the grammar passes over it
        raise ValueError(f"token {token_id} was sampled where the tool-call mask forbids it: apply "
                              f"allowed() to the logits before sampling ({self._matcher.get_error() or 'no error'})")

    @property
    def finished(self) -> bool:
        """Whether the grammar allows nothing more than the end of the answer."""
        return self._matcher.is_stopped()


@dataclass(frozen=True)
class _Grammar:
    matcher: object  # llguidance.LLMatcher at the start: each row gets a deep copy
    n_vocab: int  # the tokenizer's length as llguidance counts it
    words: int  # int32 words of a mask
    # where free text needs no mask: the mask's bits OR these (what free text refuses at its start but the opener
    # and eos: special tokens, stray bytes, the padding past the vocabulary) set every bit.
    # None: the grammar never starts in free text ("required", a named function).
    free_words: np.ndarray | None


# Tokenizers are not hashable by content: the cache is keyed on the object, kept alive while it is cached.
_TOKENIZERS: dict[int, tuple[object, object]] = {}


def _tokenizer_key(tokenizer) -> int:
    key = id(tokenizer)
    if key not in _TOKENIZERS:
        import llguidance.hf

        if len(_TOKENIZERS) >= 8:
            _TOKENIZERS.clear()
            _compiled.cache_clear()
        try:
            _TOKENIZERS[key] = (tokenizer, llguidance.hf.from_tokenizer(tokenizer))
        except ValueError as err:
            raise ConstraintError(f"constrained tool calls need a fast Hugging Face tokenizer "
                                  f"({type(tokenizer).__name__}): {err}") from None
    return key


def _tools_key(tools: list[dict]) -> str:
    return json.dumps([t.get("function", t) for t in tools], sort_keys=False)


def _choice_key(tool_choice: str | dict) -> str:
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ConstraintError(f"tool_choice {tool_choice!r}: a named choice is "
                                  '{"type": "function", "function": {"name": ...}}')
        return "function:" + name
    if tool_choice not in ("auto", "required", "none"):
        raise ConstraintError(f"tool_choice {tool_choice!r}: use auto, required, none or a named function")
    return tool_choice


@functools.lru_cache(maxsize=CACHE_SIZE)
def _compiled(tokenizer_key: int, tools_json: str, choice: str) -> _Grammar:
    import llguidance

    hf, lltok = _TOKENIZERS[tokenizer_key]
    functions = json.loads(tools_json)
    if choice.startswith("function:"):
        name = choice.removeprefix("function:")
        functions = [f for f in functions if f.get("name") == name]
        if not functions:
            raise ConstraintError(f"tool_choice names the function {name!r}, which is not among the offered tools "
                                  f"({', '.join(f.get('name', '?') for f in json.loads(tools_json)) or 'none'})")
    elif choice == "required" and not functions:
        raise ConstraintError("tool_choice 'required' with no tools offered: offer a tool or use 'auto'")
    opener, closer = _marker(hf, lltok, OPEN), _marker(hf, lltok, CLOSE)
    lark = _lark(functions, choice, lltok, opener, closer)
    matcher = llguidance.LLMatcher(lltok, lark, log_level=0)
    if matcher.is_error():
        raise ConstraintError(f"the tool-call grammar does not compile: {matcher.get_error()}")
    n_vocab = lltok.vocab_size
    words = (n_vocab + 31) // 32
    free_words = None
    if choice in ("auto", "none"):
        # what free text refuses at its start (special tokens, bytes that cannot begin a character) is passed
        # over when sampled there; the opener and eos never are
        start = np.zeros(words, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(start.ctypes.data, start.nbytes)
        passable = ~np.unpackbits(start.view(np.uint8), bitorder="little").view(bool)
        passable[lltok.eos_token] = False
        if opener.startswith("<["):
            passable[int(opener[2:-2])] = False
        free_words = np.packbits(passable, bitorder="little").view(np.int32).copy()
    return _Grammar(matcher, n_vocab, words, free_words)


def _marker(hf, lltok, text: str) -> str:
    """The grammar's form of a marker: `<[id]>` where the tokenizer has it as one special token, else a string."""
    ids = hf.encode(text, add_special_tokens=False)
    if len(ids) == 1 and lltok.is_special_token(ids[0]):
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def _lark(functions: list[dict], choice: str, lltok, opener: str, closer: str) -> str:
    """The llguidance (Lark) grammar of an answer under `choice`."""
    no_open = "TEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/\n"  # free text that never spells the opener
    if choice == "none":
        return "start: TEXT\n" + no_open
    body = "body: " + " | ".join(f"fn{i}" for i in range(len(functions))) + "\n" + "".join(
        f"fn{i}: %json {json.dumps(_call_schema(fn))}\n" for i, fn in enumerate(functions))
    if choice != "auto":
        return f"start: call+\ncall: {opener} body {closer}\n" + body
    if opener.startswith("<["):
        return f"start: TEXT (call TEXT)*\ncall: {opener} body {closer}\n" + body + no_open
    # the opener is text: a lazy rule ends the free text at the first `<tool_call>` (llguidance's tool-call form)
    return ("start: call* TEXT\ncall: head body " + closer + "\nhead[lazy]: ANY " + opener + "\n"
            "ANY: /(?s:.*)/\n" + body + no_open)


def _call_schema(fn: dict) -> dict:
    """The JSON schema of one call of `fn`, name first; arguments by its schema, or any object if that fails."""
    name = fn.get("name", "")
    arguments = _strict(fn.get("parameters") or {"type": "object", "properties": {}})
    if "properties" in arguments:
        arguments.setdefault("additionalProperties", False)  # tools take their declared parameters only
    schema = {"type": "object", "properties": {"name": {"const": name}, "arguments": arguments},
              "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": JSON_FORMAT}
    problem = _compile_problem(schema)
    if problem:
        log.warning("tool %r: its parameters schema cannot be compiled into the tool-call grammar (%s); its calls "
                    "are constrained to its name and any JSON object of arguments", name, problem)
        schema["properties"]["arguments"] = {"type": "object"}
    return schema


def _compile_problem(schema: dict) -> str:
    import llguidance

    error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        llguidance.LLMatcher.grammar_from_json_schema(schema))
    return "; ".join(messages) if error else ""


def _strict(schema):
    """A copy whose free strings cannot contain `</tool_call>` (it would end the call early when parsed)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) if k not in ("enum", "const", "default", "examples") else v for k, v in schema.items()}
    kind = out.get("type")
    if (kind == "string" or (isinstance(kind, list) and "string" in kind)) and not (
            {"pattern", "format", "enum", "const"} & out.keys()):
        out["pattern"] = NO_CLOSER
    return out


def _excluding(word: str) -> str:
    """An anchored regex of the strings that do not contain `word` (whose first character occurs only first)."""
    first, rest = word[0], word[1:]
    assert first not in rest
    c = [re.escape(ch) for ch in word]
    back = "|".join("".join(c[1:k]) + c[0] for k in range(1, len(word)))  # back to having seen `first`
    out = "|".join("".join(c[1:k]) + f"[^{c[0]}{c[k]}]" for k in range(1, len(word)))  # back to nothing seen
    tail = "|".join("".join(c[1:k]) for k in range(1, len(word)))  # a prefix of word left at the end
    return f"^(?:[^{c[0]}]|{c[0]}(?:{back})*(?:{out}))*(?:{c[0]}(?:{back})*(?:{tail}))?$"


NO_CLOSER = _excluding(CLOSE)
