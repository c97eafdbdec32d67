"""The opening a batch's rows share, held once (flywheel/policies/shared_prefix.py): attention over it and over each
row's own cache is attention over the whole sequence, and the hf policy's episodes are those of copying the
opening into every row."""

from __future__ import annotations

from dataclasses import replace
from itertools import islice

import pytest
import torch
from conftest import leaning_to_tool_calls
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicCache

from flywheel.agent import Harness, Limits
from flywheel.envs.calculator import CalculatorEnv
from flywheel.policies.base import Sampling
from flywheel.policies.hf import HFPolicy
from flywheel.policies.shared_prefix import NAME, SharedPrefix, use_shared_prefix


def _gqa_model(seed: int = 0) -> LlamaForCausalLM:
    """A random Llama with grouped keys and values (4 query heads on 2 key/value heads), as SmolLM2 has."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_attention_over_the_prefix_and_each_rows_own_cache_is_attention_over_the_whole(precision):
    """Rows of different lengths (left holes masked) after a 40-token opening: the read and two decode steps give
    the logits of the whole sequences read at once, and without a prefix the model computes as SDPA does."""
    model, plain = _gqa_model(), _gqa_model()
    assert use_shared_prefix(model) and model.config._attn_implementation == NAME
    opening, lengths = torch.randint(3, 97, (40,)), [12, 7, 12, 3]
    rows = [torch.randint(3, 97, (n,)) for n in lengths]
    width = max(lengths)
    ids = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.long), r]) for r in rows])
    mask = torch.stack([torch.cat([torch.zeros(width - len(r)), torch.ones(len(r))]).long() for r in rows])
    tolerance = 1e-4 if precision == "fp32" else 0.1
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        whole = [torch.cat([opening, r])[None] for r in rows]
        # without a prefix: exactly the model's SDPA
        assert torch.equal(model(input_ids=whole[0]).logits, plain(input_ids=whole[0]).logits)
        made = model(input_ids=opening[None], use_cache=True).cache
        prefix = SharedPrefix(opening.tolist(), [(layer.keys, layer.values) for layer in made.layers])
        positions = (mask.cumsum(-1) - 1).clamp(min=0) + len(opening)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=DynamicCache(),
                    use_cache=True, shared_prefix=prefix)
        for i, r in enumerate(rows):
            expected = plain(input_ids=whole[i]).logits[0, len(opening):]
            assert (out.logits[i, width - len(r):] - expected).abs().max() < tolerance
        cache, position = out.cache, positions[:, -1] + 1
        for _ in range(2):
            token = out.logits[:, -1].argmax(-1)
            whole = [torch.cat([w, t.view(1, 1)], dim=1) for w, t in zip(whole, token, strict=True)]
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
            out = model(input_ids=token[:, None], attention_mask=mask, position_ids=position[:, None], cache=cache,
                        use_cache=True, shared_prefix=prefix)
            cache, position = out.cache, position + 1
            for i in range(len(rows)):
                assert (out.logits[i, -1] - plain(input_ids=whole[i]).logits[0, -1]).abs().max() < tolerance


@pytest.fixture(scope="module")
def talkative(tiny_student):
    return leaning_to_tool_calls(tiny_student, eos_bias=2.0)


SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 12}


def _episodes(policy, sampling, n_tasks=6, samples=2):
    """The calculator's episodes, each task's prompt after a long system prompt (an opening of 100+ tokens)."""
    env = CalculatorEnv()
    tasks = [replace(t, prompt=[SYSTEM, *t.prompt]) for t in islice(env.generate_tasks(0), n_tasks)]
    return Harness(env, Limits(max_turns=4)).run(policy, tasks, samples=samples, sampling=sampling)


@pytest.mark.parametrize("continuous", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_episodes_with_the_opening_held_once_are_those_with_it_in_every_row(talkative, continuous, temperature):
    """A long system prompt and the calculator's tool as the batch's prefix: the same turns, tokens and logprobs (to
    rounding) as the opening copied into every row, turn by turn (kept caches across calls) and in one batch."""
    model, tokenizer = talkative
    sampling = Sampling(temperature=temperature, max_new_tokens=16, seed=5)
    held = HFPolicy(model, tokenizer, batch_size=4, continuous=continuous)
    copied = HFPolicy(model, tokenizer, batch_size=4, continuous=continuous, shared_prefix=False)
    once, every = _episodes(held, sampling), _episodes(copied, sampling)
    assert held.shared_prefix and held.stats.prefix_rows >= 12 and copied.stats.prefix_rows == 0
    assert max(e.turns for e in once) >= 3
    assert [m for e in once for m in e.messages] == [m for e in every for m in e.messages]
    for a, b in zip([c for e in once for c in e.completions], [c for e in every for c in e.completions], strict=True):
        assert a.token_ids == b.token_ids and a.usage == b.usage
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    # the same tokens read and taken from caches: only where the opening's keys and values lie differs
    assert (held.stats.read_tokens, held.stats.reused_tokens) == (copied.stats.read_tokens, copied.stats.reused_tokens)


def test_a_turn_that_no_longer_begins_with_the_prefix_goes_on_in_a_batch_of_its_own(talkative, monkeypatch):
    """A template that renders a conversation's opening otherwise once it has an answer in it: those turns cannot
    follow the batch's prefix, so they are read whole after the others; every episode still ends as it would
    with the opening copied into every row."""
    model, tokenizer = talkative
    render = HFPolicy._render

    def otherwise(self, conversations, tools):
        rows = render(self, conversations, tools)
        return [([row[1]] + row if any(m["role"] == "assistant" for m in c) else row)
                for row, c in zip(rows, conversations, strict=True)]

    monkeypatch.setattr(HFPolicy, "_render", otherwise)
    sampling = Sampling(temperature=0.0, max_new_tokens=16)  # greedy: the turns do not depend on draws' order
    held = HFPolicy(model, tokenizer, batch_size=4)
    copied = HFPolicy(model, tokenizer, batch_size=4, shared_prefix=False)
    once, every = _episodes(held, sampling), _episodes(copied, sampling)
    assert max(e.turns for e in once) >= 3  # turns went on after the first ...
    assert held.stats.prefix_rows == 12 and held.stats.calls > 1  # ... in batches of their own
    assert [e.turns for e in once] == [e.turns for e in every]
    for a, b in zip([c for e in once for c in e.completions], [c for e in every for c in e.completions], strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
