"""Constrained tool calls (flywheel/policies/constrained.py): over random tool schemas, whatever a sampler picks
among the allowed tokens parses into calls of offered tools with valid arguments; the switch reaches every run."""

from __future__ import annotations

import json
import logging
import random
import re
import string
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import yaml

from flywheel.agent import Harness, Limits, load_harness
from flywheel.config import ConfigError, EnvironmentConfig, load_pipelines
from flywheel.envs.calculator import CalculatorEnv
from flywheel.policies.base import Sampling
from flywheel.policies.constrained import CLOSE, OPEN, ConstraintError, row_constraints
from flywheel.policies.oracle import OraclePolicy
from flywheel.policies.toolcalls import TOOL_CALL, parse_completion

CHOICES = ("auto", "required", "named", "none")
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_student):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_student)


def _word(rng: random.Random, letters: str = string.ascii_lowercase) -> str:
    return "".join(rng.choice(letters) for _ in range(rng.randint(1, 8)))


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema of one value: string, integer, number, boolean, enum, nested object or array."""
    kinds = ["string", "integer", "number", "boolean", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", **({"maxLength": rng.randint(1, 12)} if rng.random() < 0.3 else {})}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", **({"minimum": low, "maximum": low + rng.randint(0, 100)}
                                      if rng.random() < 0.5 else {})}
    if kind == "enum":
        words = string.ascii_letters + " .,'\"\\-é"  # quotes, backslashes and non-ASCII must come out escaped right
        return {"type": "string", "enum": sorted({_word(rng, words) for _ in range(rng.randint(1, 4))})}
    if kind == "object":
        return random_object(rng, depth + 1)
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1),
                **({"maxItems": rng.randint(1, 3)} if rng.random() < 0.5 else {})}
    return {"type": kind}


def random_object(rng: random.Random, depth: int = 0) -> dict:
    names = sorted({_word(rng) for _ in range(rng.randint(1, 4))})
    return {"type": "object", "properties": {n: random_schema(rng, depth) for n in names},
            "required": sorted(rng.sample(names, rng.randint(0, len(names))))}


def random_tools(rng: random.Random) -> list[dict]:
    names = sorted({_word(rng, string.ascii_lowercase + "_") for _ in range(rng.randint(1, 3))})
    return [{"type": "function", "function": {"name": n, "description": "d", "parameters": random_object(rng)}}
            for n in names]


_CLOSERS: dict[int, object] = {}


def _closers(tokenizer):
    """As a bool array: the tokens that close a string, number, array or object (`"`, `}`, `]`, `,` alone or
    together), a call, or the answer."""
    if id(tokenizer) not in _CLOSERS:
        texts = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        closing = np.array([bool(t) and len(t) <= 3 and set(t) <= set('"}],') for t in texts])
        closing[tokenizer.encode(CLOSE, add_special_tokens=False)[:1] + [tokenizer.eos_token_id]] = True
        _CLOSERS[id(tokenizer)] = closing
    return _CLOSERS[id(tokenizer)]


def walk(row, tokenizer, rng: random.Random, vocab_size: int, cap: int = 600) -> tuple[str, bool]:
    """Drive one row without a model: uniformly among the allowed tokens (half the time among those that close a
    string, number, array or object, so walks end), or in free text among all tokens and the call opener.
    Returns the decoded text and whether the walk reached eos."""
    eos = tokenizer.eos_token_id
    opener = tokenizer.encode(OPEN, add_special_tokens=False)
    closers = _closers(tokenizer)
    ids: list[int] = []
    forced: list[int] = []
    for _ in range(cap):
        mask = row.allowed()
        if mask is None:
            roll = rng.random()
            if forced:
                token = forced.pop(0)
            elif roll < 0.1:
                token = eos
            elif roll < 0.4:
                forced = list(opener)
                token = forced.pop(0)
            else:
                token = rng.randrange(len(tokenizer))  # special tokens too: free text passes over them
        else:
            assert mask.shape == (vocab_size,) and not mask[len(tokenizer):].any()
            mask = mask.numpy()
            allowed = np.flatnonzero(mask)
            assert len(allowed), "a mask must allow something"
            closing = np.flatnonzero(mask[:len(closers)] & closers)
            if forced and mask[forced[0]]:
                token = forced.pop(0)
            else:
                forced = []
                pool = closing if len(closing) and rng.random() < 0.5 else allowed
                token = int(pool[rng.randrange(len(pool))])
        if token == eos:
            return tokenizer.decode(ids), True
        row.accept(token)
        ids.append(token)
    return tokenizer.decode(ids), False


def check_answer(text: str, tools: list[dict], choice: str, named: str) -> int:
    """Assert the answer keeps its tool_choice, every call parsing into a valid call of an offered tool; the
    number of calls."""
    completion = parse_completion(text)
    assert completion.error is None, (completion.error, text)
    calls = completion.message.get("tool_calls") or []
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call, body in zip(calls, TOOL_CALL.findall(text), strict=True):
        name = call["function"]["name"]
        assert name in schemas, text
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])
        # the form the templates render and the students learn: name first, json.dumps separators, no whitespace
        assert body.startswith('{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": {'), body
        skeleton = re.sub(r'"(?:[^"\\]|\\.)*"', '""', body)  # the strings' contents taken out
        assert not re.search(r"\s", re.sub(r"[,:] ", "", skeleton)), body
    if choice in ("required", "named"):
        assert calls and text.startswith(OPEN), text
    if choice == "named":
        assert {c["function"]["name"] for c in calls} == {named}
    if choice == "none":
        assert not calls and OPEN not in text, text
    return len(calls)


def property_run(tokenizer, seed: int, tool_sets: int, walks: int) -> None:
    rng = random.Random(seed)
    vocab_size = len(tokenizer) + 13  # logits wider than the tokenizer, as some models have
    finished = total = auto_calls = 0
    for _ in range(tool_sets):
        tools = random_tools(rng)
        for choice in CHOICES:
            named = rng.choice(tools)["function"]["name"]
            tool_choice = {"type": "function", "function": {"name": named}} if choice == "named" else choice
            rows = row_constraints(tokenizer, tools, tool_choice, walks, vocab_size)
            assert len(rows) == walks
            for row in rows:
                text, done = walk(row, tokenizer, rng, vocab_size)
                total += 1
                if done:
                    finished += 1
                    calls = check_answer(text, tools, choice, named)
                    auto_calls += calls if choice == "auto" else 0
    assert finished >= 0.9 * total, f"only {finished} of {total} walks reached eos"
    assert auto_calls > 0  # "auto" walks did enter calls, and those calls were checked


def test_random_walks_over_random_schemas_give_valid_calls_on_the_tiny_tokenizer(tiny_tokenizer, caplog):
    """The opener and closer are single tokens here; free text never spells them out."""
    with caplog.at_level(logging.WARNING, logger="flywheel.policies.constrained"):
        property_run(tiny_tokenizer, seed=0, tool_sets=25, walks=3)
    assert "cannot be compiled" not in caplog.text  # every random schema compiled as it is, none fell back


@pytest.mark.slow
def test_random_walks_over_random_schemas_give_valid_calls_on_smollm2():
    """SmolLM2's tokenizer writes `<tool_call>` as several text tokens: the lazy grammar waits for the text."""
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    from flywheel.checkpoints import CheckpointError, gguf_file
    from flywheel.train.students import SMOLLM2

    try:
        file = gguf_file(SMOLLM2)
    except CheckpointError as err:
        pytest.skip(str(err))
    tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    property_run(tokenizer, seed=1, tool_sets=6, walks=2)


def test_auto_without_tools_constrains_nothing_and_bad_choices_are_named(tiny_tokenizer):
    tools = CalculatorEnv().tools()
    assert row_constraints(tiny_tokenizer, [], "auto", 4, len(tiny_tokenizer)) is None
    with pytest.raises(ConstraintError, match="'search', which is not among the offered tools \\(calculator\\)"):
        row_constraints(tiny_tokenizer, tools, {"type": "function", "function": {"name": "search"}}, 1, 400)
    with pytest.raises(ConstraintError, match="'required' with no tools offered"):
        row_constraints(tiny_tokenizer, [], "required", 1, 400)
    with pytest.raises(ConstraintError, match="use auto, required, none or a named function"):
        row_constraints(tiny_tokenizer, tools, "any", 1, 400)


def test_none_forbids_the_opener_and_required_allows_only_eos_after_its_calls(tiny_tokenizer):
    tools = CalculatorEnv().tools()
    opener = tiny_tokenizer.convert_tokens_to_ids(OPEN)
    (none,) = row_constraints(tiny_tokenizer, tools, "none", 1, len(tiny_tokenizer))
    mask = none.allowed()
    assert mask is not None and not mask[opener] and mask[tiny_tokenizer.eos_token_id]
    (required,) = row_constraints(tiny_tokenizer, tools, "required", 1, len(tiny_tokenizer))
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>'
    for token in tiny_tokenizer.encode(call, add_special_tokens=False):
        assert required.allowed()[token]
        required.accept(token)
    after = required.allowed().nonzero().flatten().tolist()
    assert sorted(after) == sorted([opener, tiny_tokenizer.eos_token_id])  # another call, or the end
    with pytest.raises(ValueError, match="sampled where the tool-call mask forbids it"):  # a decode loop's bug
        required.accept(tiny_tokenizer.encode("x", add_special_tokens=False)[0])


def test_a_schema_the_library_cannot_compile_is_named_and_its_calls_still_parse(tiny_tokenizer, caplog):
    """`not` is not implemented by llguidance: that tool's arguments fall back to any object; others keep theirs."""
    odd = {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "not": {"const": "a"}}}}}}
    tools = [odd, *CalculatorEnv().tools()]
    with caplog.at_level(logging.WARNING, logger="flywheel.policies.constrained"):
        rows = row_constraints(tiny_tokenizer, tools, "required", 4, len(tiny_tokenizer))
    assert "tool 'odd': its parameters schema cannot be compiled" in caplog.text
    rng = random.Random(3)
    for row in rows:
        text, done = walk(row, tiny_tokenizer, rng, len(tiny_tokenizer))
        if done:
            completion = parse_completion(text)
            assert completion.error is None and completion.message["tool_calls"]
            for call in completion.message["tool_calls"]:
                assert call["function"]["name"] in ("odd", "calculator")
                if call["function"]["name"] == "calculator":
                    jsonschema.validate(json.loads(call["function"]["arguments"]),
                                        tools[1]["function"]["parameters"])


def test_the_key_validates_and_a_misspelt_one_is_still_named(tmp_path):
    data = yaml.safe_load((REPO / "pipelines.yaml").read_text())
    data["pipelines"]["demo"].setdefault("environment", {})["constrained_tools"] = True
    (tmp_path / "pipelines.yaml").write_text(yaml.safe_dump(data))
    environment = load_pipelines(tmp_path / "pipelines.yaml")["demo"].environment
    assert environment.constrained_tools is True and Limits.from_config(environment).constrained is True
    assert EnvironmentConfig().constrained_tools is False and Limits.from_config(EnvironmentConfig()) == Limits()
    data["pipelines"]["demo"]["environment"]["constrained_tool"] = data["pipelines"]["demo"]["environment"].pop(
        "constrained_tools")
    (tmp_path / "pipelines.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as err:
        load_pipelines(tmp_path / "pipelines.yaml")
    assert ("pipelines.demo.environment.constrained_tool: unknown key; did you mean 'constrained_tools'?"
            in str(err.value))
    with pytest.raises(ValueError, match="constrained_tools"):
        EnvironmentConfig(constrained_tools="sometimes")


class Recording:
    """The oracle, recording the Sampling each turn was asked under."""

    name = "recording"
    takes_states = True

    def __init__(self, env):
        self.inner, self.seen = OraclePolicy(env), []

    def generate(self, conversations, tools, sampling, **kw):
        self.seen.append(sampling)
        return self.inner.generate(conversations, tools, sampling, **kw)


@pytest.mark.parametrize("on", [True, False])
def test_the_harness_sets_constrained_on_every_turn_whatever_the_caller_passed(tmp_path, on):
    harness = load_harness(EnvironmentConfig(name="calculator", constrained_tools=on), tmp_path)
    assert harness.limits.constrained is on
    policy = Recording(harness.env)
    tasks = [next(harness.env.generate_tasks(0))]
    asked = Sampling(temperature=0.5, seed=7, tool_choice="required", constrained=not on)
    episodes = harness.run(policy, tasks, samples=2, sampling=asked)
    assert all(e.passed for e in episodes) and len(policy.seen) == episodes[0].turns >= 2
    assert {s.constrained for s in policy.seen} == {on}
    # the rest of the caller's sampling is kept as it was
    assert {(s.temperature, s.seed, s.tool_choice) for s in policy.seen} == {(0.5, 7, "required")}
    assert Harness(harness.env).limits.constrained is False  # a harness built without a section: the default


def _follows(row, tokenizer, text: str) -> bool:
    """Whether the row's masks allow `text`, token by token (accepting it as far as they do)."""
    for token in tokenizer.encode(text, add_special_tokens=False):
        mask = row.allowed()
        if mask is not None and not mask[token]:
            return False
        row.accept(token)
    return True


def test_declared_parameters_only_and_an_object_without_properties_takes_any(tiny_tokenizer):
    calculator = CalculatorEnv().tools()
    free = [{"type": "function", "function": {"name": "free", "parameters": {"type": "object"}}}]
    call = '<tool_call>{"name": "%s", "arguments": %s}</tool_call>'

    def rows(tools):
        return row_constraints(tiny_tokenizer, tools, "required", 1, len(tiny_tokenizer))[0]

    assert _follows(rows(calculator), tiny_tokenizer, call % ("calculator", '{"expression": "1 + 2"}'))
    assert not _follows(rows(calculator), tiny_tokenizer, call % ("calculator", '{"expression": "1", "x": 2}'))
    assert not _follows(rows(calculator), tiny_tokenizer, call % ("calculator", '{"expression":"1"}'))  # spacing
    assert _follows(rows(free), tiny_tokenizer, call % ("free", '{"a": 1, "b": ["x", null]}'))
