"""Constrained tool calls end to end: the hf policy's decode loop sampling a real model under the masks of
flywheel.policies.constrained, through the harness, and the masked distribution the RL learner is handed."""

from __future__ import annotations

import json
from itertools import islice

import jsonschema
import numpy as np
import pytest
from conftest import leaning_to_tool_calls

from flywheel.agent import Harness, Limits
from flywheel.envs.calculator import CalculatorEnv
from flywheel.policies.base import Sampling
from flywheel.policies.hf import HFPolicy
from flywheel.policies.toolcalls import TOOL_CALL


@pytest.fixture(scope="module")
def rambling(tiny_student):
    """The tests' tiny student with its head leaning to `<tool_call>`: unconstrained, its sampled calls are mostly
    malformed (a real model, its weights set)."""
    return leaning_to_tool_calls(tiny_student)


def _turns(model, tokenizer, constrained: bool, tool_choice="auto"):
    env = CalculatorEnv()
    tasks = list(islice(env.generate_tasks(0), 8))
    policy = HFPolicy(model, tokenizer, batch_size=16)
    sampling = Sampling(temperature=1.0, max_new_tokens=48, seed=3, tool_choice=tool_choice)
    episodes = Harness(env, Limits(max_turns=2, constrained=constrained)).run(policy, tasks, samples=2,
                                                                            sampling=sampling)
    return env, [c for e in episodes for c in e.completions]


def test_sampled_calls_always_parse_against_the_schema_when_constrained(rambling):
    model, tokenizer = rambling
    _, free = _turns(model, tokenizer, constrained=False)
    assert sum(c.error is not None for c in free) > 0  # the same model, unconstrained, breaks its calls
    env, turns = _turns(model, tokenizer, constrained=True)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in env.tools()}
    calls = [call for c in turns for call in c.message.get("tool_calls") or []]
    assert calls, "the leaning head opens calls: some must have been written"
    for completion in turns:
        # a turn cut by max_new_tokens inside a call is the one way left to an unparsed call
        if completion.error is not None:
            assert len(completion.token_ids) == 48 and tokenizer.eos_token_id not in completion.token_ids
        assert not TOOL_CALL.search(completion.message.get("content") or "")
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
    assert any(c.masks for c in turns)


def test_required_always_calls_and_the_logprobs_are_of_the_masked_distribution(rambling):
    model, tokenizer = rambling
    _, turns = _turns(model, tokenizer, constrained=True, tool_choice="required")
    opener = tokenizer.convert_tokens_to_ids("<tool_call>")
    for completion in turns:
        # a call from the first token on, every token under a mask; a turn that ended is a call that parses
        assert completion.token_ids[0] == opener and len(completion.masks) == len(completion.token_ids)
        if completion.token_ids[-1] == tokenizer.eos_token_id:
            assert completion.message.get("tool_calls") and completion.error is None
        for position, packed in (completion.masks or {}).items():
            allowed = np.unpackbits(packed)[:model.config.vocab_size].astype(bool)
            assert allowed[completion.token_ids[position]]  # only allowed tokens were sampled
            # renormalised: a logprob under the mask is at least that of the whole vocabulary
            assert completion.logprobs[position] <= 1e-6
