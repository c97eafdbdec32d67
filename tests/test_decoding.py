"""The hf policy's decode loop (flywheel/policies/decoding.py): the tokens and logprobs of transformers' generate,
finished rows leaving the batch, kept caches giving the turns of re-reading every turn, and the constraint hook."""

from __future__ import annotations

import sys
import types
from itertools import islice

import numpy as np
import pytest
import torch
from conftest import leaning_to_tool_calls

from flywheel.agent import Harness, Limits
from flywheel.checkpoints import load_student
from flywheel.envs.calculator import CalculatorEnv
from flywheel.policies.base import Sampling
from flywheel.policies.hf import HFPolicy


@pytest.fixture(scope="module")
def env() -> CalculatorEnv:
    return CalculatorEnv()


@pytest.fixture(scope="module")
def talkative(tiny_student):
    """The tiny student with its head leaning to `<tool_call>`: sampled turns often open a call they never close,
    earn an error turn and go on, so episodes end at different turns (a real model, its weights set)."""
    return leaning_to_tool_calls(tiny_student, eos_bias=2.0)


def _episodes(policy, env, sampling, n_tasks=6, samples=2):
    tasks = list(islice(env.generate_tasks(0), n_tasks))
    return Harness(env, Limits(max_turns=4)).run(policy, tasks, samples=samples, sampling=sampling)


def _turns(episodes):
    return [c for e in episodes for c in e.completions]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_kept_caches_give_the_turns_of_reading_every_turn_whole(talkative, env, temperature):
    model, tokenizer = talkative
    sampling = Sampling(temperature=temperature, max_new_tokens=16, seed=5)
    kept = HFPolicy(model, tokenizer, batch_size=8, continuous=False)  # turn by turn, across calls
    reread = HFPolicy(model, tokenizer, batch_size=8, kept_bytes=0)
    with_cache, without = _episodes(kept, env, sampling), _episodes(reread, env, sampling)
    assert [e.turns for e in with_cache] == [e.turns for e in without]
    if temperature:
        assert len({e.turns for e in with_cache}) >= 3  # rows of one batch end at different turns
    assert max(e.turns for e in with_cache) >= 3
    for a, b in zip(_turns(with_cache), _turns(without), strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert a.usage == b.usage
    # the later turns started from the kept caches: far fewer prompt tokens read
    assert kept.stats.kept_rows > 0 and reread.stats.kept_rows == 0
    assert kept.stats.read_tokens < 0.8 * reread.stats.read_tokens
    assert kept.stats.read_tokens + kept.stats.reused_tokens == reread.stats.read_tokens + reread.stats.reused_tokens
    again = _episodes(kept, env, sampling)  # seeded: the same episodes again, whatever the cache held
    assert [c.token_ids for c in _turns(again)] == [c.token_ids for c in _turns(with_cache)]


def _read_alone(model, tokenizer, tools, episode, temperature):
    """Each turn of an episode read alone and whole: its tokens' logprobs under the tempered distribution."""
    turns, conversation = [], list(episode.task.prompt)
    for completion in episode.completions:
        ids = tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=True)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids + completion.token_ids])).logits[0, len(ids) - 1:-1].float()
        logits = logits / temperature if temperature else logits
        chosen = torch.tensor(completion.token_ids)[:, None]
        turns.append(torch.log_softmax(logits, -1).gather(1, chosen).squeeze(1).tolist())
        at = episode.messages.index(completion_message(episode, completion), len(conversation))
        conversation = episode.messages[:at + 1]
        while len(conversation) < len(episode.messages) and episode.messages[len(conversation)]["role"] != "assistant":
            conversation.append(episode.messages[len(conversation)])
    return turns


def completion_message(episode, completion):
    """The assistant message the harness appended for a completion (its tool calls given ids)."""
    n = episode.completions.index(completion)
    return [m for m in episode.messages if m["role"] == "assistant"][n]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_episodes_that_go_on_in_one_batch_read_as_turn_by_turn_ones(talkative, env, temperature):
    """continuous: whole episodes in one batch of 4 slots (12 conversations: the waiting take freed slots), rows
    ending at different turns; the same turns as reading every turn whole (greedy), and every sampled token's
    logprob that of its turn read alone."""
    model, tokenizer = talkative
    sampling = Sampling(temperature=temperature, max_new_tokens=16, seed=5)
    going_on = HFPolicy(model, tokenizer, batch_size=4)
    reread = HFPolicy(model, tokenizer, batch_size=4, kept_bytes=0)
    assert going_on.continues_turns and not reread.continues_turns
    episodes = _episodes(going_on, env, sampling)
    assert max(e.turns for e in episodes) >= 3
    assert going_on.stats.calls == 1 and going_on.stats.rows == 12  # one batch; the waiting took freed slots
    if temperature:
        assert len({e.turns for e in episodes}) >= 3
        again = _episodes(HFPolicy(model, tokenizer, batch_size=4), env, sampling)  # seeded: reproduced
        assert [c.token_ids for c in _turns(again)] == [c.token_ids for c in _turns(episodes)]
    else:
        whole = _episodes(reread, env, sampling)
        assert [e.turns for e in episodes] == [e.turns for e in whole]
        assert [m for e in episodes for m in e.messages] == [m for e in whole for m in e.messages]
        for a, b in zip(_turns(episodes), _turns(whole), strict=True):
            assert a.token_ids == b.token_ids and a.usage == b.usage
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    for episode in episodes:
        alone = _read_alone(model, tokenizer, env.tools(), episode, temperature)
        for completion, expected in zip(episode.completions, alone, strict=True):
            assert completion.logprobs == pytest.approx(expected, abs=1e-4)


def test_finished_rows_leave_the_batch_and_every_row_keeps_its_own_logprobs(talkative, env):
    model, tokenizer = talkative
    prompts = [t.prompt for t in islice(env.generate_tasks(3), 8)]
    policy = HFPolicy(model, tokenizer, kept_bytes=0)
    temperature = 0.8
    completions = policy.generate(prompts, env.tools(), Sampling(temperature=temperature, top_p=0.95,
                                                                 max_new_tokens=24, seed=2))
    assert len({len(c.token_ids) for c in completions}) > 1
    assert policy.stats.row_steps == sum(len(c.token_ids) for c in completions)
    assert policy.stats.row_steps < policy.stats.ridealong_row_steps  # no row paid for the longest
    for prompt, completion in zip(prompts, completions, strict=True):  # each row read alone, whole
        ids = tokenizer.apply_chat_template(prompt, tools=env.tools(), add_generation_prompt=True)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids + completion.token_ids])).logits[0, len(ids) - 1:-1] / temperature
        chosen = torch.tensor(completion.token_ids)[:, None]
        probs = torch.softmax(logits, -1)
        assert (probs.gather(1, chosen) > 0).all()
        # top_p keeps the sampled token; where it kept the whole distribution the logprob is the tempered one
        whole = torch.log_softmax(logits, -1).gather(1, chosen).squeeze(1)
        assert all(lp >= w - 1e-5 for lp, w in zip(completion.logprobs, whole.tolist(), strict=True))


def test_the_loop_writes_what_transformers_generate_writes(tiny_student, env):
    """Rows that never end early, greedy: the same tokens and scores as `model.generate` (the old path). Sampled
    tokens are drawn otherwise (decoding.draw, not torch.multinomial): see test_draw_gives_each_token_its_
    probability, and test_finished_rows_leave_the_batch_and_every_row_keeps_its_own_logprobs for their logprobs."""
    sampling = Sampling(max_new_tokens=8)
    policy = HFPolicy(tiny_student, kept_bytes=0)
    tokenizer, model = policy.tokenizer, policy.model
    prompts = [t.prompt for t in islice(env.generate_tasks(4), 5)]
    completions = policy.generate(prompts, env.tools(), sampling)
    assert all(tokenizer.eos_token_id not in c.token_ids for c in completions)
    batch = tokenizer.apply_chat_template(prompts, tools=env.tools(), add_generation_prompt=True, padding=True,
                                          return_tensors="pt", return_dict=True)
    options = {"do_sample": False}
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=sampling.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.eos_token_id, output_scores=True, return_dict_in_generate=True,
                             **options)
    new = out.sequences[:, batch["input_ids"].shape[1]:]
    assert [c.token_ids for c in completions] == new.tolist()
    expected = torch.stack([torch.log_softmax(s, -1).gather(1, new[:, i:i + 1]).squeeze(1)
                            for i, s in enumerate(out.scores)], dim=1)
    assert torch.allclose(torch.tensor([c.logprobs for c in completions]), expected, atol=1e-5)


def test_draw_gives_each_token_its_probability():
    """decoding.draw samples each row's distribution: frequencies within 5 standard errors of the probabilities
    over 400,000 draws, a token of probability 0 (masked) never drawn, even last in the row; the same draws from
    the same seed; not-finite probabilities refused."""
    from flywheel.policies.decoding import draw

    logits = torch.tensor([0.0, 1.0, float("-inf"), 2.0, -3.0, float("-inf"), float("-inf")])
    probs = torch.softmax(logits, -1)
    n = 400_000
    torch.manual_seed(0)
    drawn = draw(probs.expand(n, -1).contiguous())
    frequency = torch.bincount(drawn, minlength=len(probs)).double() / n
    error = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert ((frequency - probs.double()).abs() <= 5 * error).all(), (frequency, probs)
    assert frequency[probs == 0].eq(0).all()
    torch.manual_seed(0)
    assert torch.equal(draw(probs.expand(n, -1).contiguous()), drawn)
    rows = torch.softmax(torch.randn(64, 49_152) * 4, -1)  # SmolLM2's vocabulary: every row its own token
    assert draw(rows).shape == (64,) and (rows.gather(1, draw(rows)[:, None]) > 0).all()
    with pytest.raises(RuntimeError, match="not finite"):
        draw(torch.tensor([[0.5, float("nan")]]))


def test_the_mask_made_here_gives_what_transformers_own_gives(tiny_student):
    """decoding.attention_mask: under SDPA the 4-D mask made here reads left-holed rows (a prefill of several
    tokens, then a decode step) exactly as transformers' own mask from the 2-D one; under another attention the
    2-D mask is passed on for transformers to make the model's own."""
    from flywheel.policies.decoding import attention_mask

    model, _ = load_student(tiny_student)
    model.eval()
    ids = torch.randint(3, 300, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :4], mask[2, :1] = 0, 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        own = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        made = model(input_ids=ids, attention_mask=attention_mask(model, mask, 9, True), position_ids=positions,
                     use_cache=True)
        assert torch.equal(own.logits[mask.bool()], made.logits[mask.bool()])
        step = torch.cat([mask, mask.new_ones(3, 1)], dim=1)
        token, position = torch.tensor([[5], [6], [7]]), positions[:, -1:] + 1
        own = model(input_ids=token, attention_mask=step, position_ids=position, cache=own.cache).logits
        made = model(input_ids=token, attention_mask=attention_mask(model, step, 1, True), position_ids=position,
                     cache=made.cache).logits
        assert torch.equal(own, made)
    assert attention_mask(model, mask, 9, False) is mask  # not a plain cache: transformers makes it
    model.set_attn_implementation("eager")
    assert attention_mask(model, mask, 9, True) is mask


def test_a_growing_layer_writes_in_its_room_after_columns_or_rows_are_dropped():
    """GrowingLayer: a decode step writes its token into the buffer's room, also after leading columns were
    sliced off (continuing._trim) or rows picked (a batch that shrank); a widened layer has zero columns before
    its keys (in the buffer's room before them where it has enough, else in a fresh buffer with room before and
    after them). Each time the keys and values are what concatenating would give."""
    from flywheel.policies.decoding import GrowingLayer

    def states(rows, n):
        return torch.randn(rows, 2, n, 4), torch.randn(rows, 2, n, 4)

    layer = GrowingLayer(spare=8)
    k0, v0 = states(3, 5)
    layer.update(k0, v0)
    buffer = layer.room[0]
    layer.keys, layer.values = layer.keys[:, :, 2:], layer.values[:, :, 2:]  # leading columns dropped
    k1, v1 = states(3, 1)
    keys, values = layer.update(k1, v1)
    assert layer.room[0] is buffer  # no copy
    assert torch.equal(keys, torch.cat([k0[:, :, 2:], k1], dim=2))
    assert torch.equal(values, torch.cat([v0[:, :, 2:], v1], dim=2))
    layer.batch_select_indices(torch.tensor([2, 0]))
    buffer = layer.room[0]
    k2, v2 = states(2, 1)
    keys, values = layer.update(k2, v2)
    assert layer.room[0] is buffer  # the picked rows kept their room
    assert torch.equal(keys, torch.cat([k0[[2, 0], :, 2:], k1[[2, 0]], k2], dim=2))
    assert torch.equal(values, torch.cat([v0[[2, 0], :, 2:], v1[[2, 0]], v2], dim=2))
    layer.widen(2)  # into the two columns dropped before: no copy
    assert layer.room[0] is buffer
    layer.widen(3)  # more than the buffer has before the keys: a fresh one, with room before them too
    buffer = layer.room[0]
    k3, v3 = states(2, 1)
    keys, values = layer.update(k3, v3)
    layer.widen(3)
    assert layer.room[0] is buffer
    zeros = torch.zeros(2, 2, 8, 4)
    keys, values = layer.keys, layer.values
    assert torch.equal(keys, torch.cat([zeros, k0[[2, 0], :, 2:], k1[[2, 0]], k2, k3], dim=2))
    assert torch.equal(values, torch.cat([zeros, v0[[2, 0], :, 2:], v1[[2, 0]], v2, v3], dim=2))
    for _ in range(40):  # past the room: a fresh buffer, the same contents
        keys, _ = layer.update(*states(2, 1))
    assert keys.shape[2] == 8 + 3 + 1 + 1 + 1 + 40 and torch.equal(keys[:, :, :8], zeros)


def test_changed_weights_drop_the_kept_caches(tiny_student, env):
    model, tokenizer = load_student(tiny_student)
    policy = HFPolicy(model, tokenizer)
    reread = HFPolicy(model, tokenizer, kept_bytes=0)
    prompts = [t.prompt for t in islice(env.generate_tasks(5), 3)]
    sampling = Sampling(max_new_tokens=6)
    first = policy.generate(prompts, env.tools(), sampling)
    nexts = [[*p, c.message, {"role": "user", "content": "Again?"}] for p, c in zip(prompts, first, strict=True)]
    assert policy.kept.entries
    model.train()  # a learner's step on the live model the policy shares (RL with actors 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model(torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss.backward()
    optimizer.step()
    reused = policy.stats.reused_tokens
    after = policy.generate(nexts, env.tools(), sampling)
    assert policy.stats.reused_tokens == reused  # nothing taken from the old weights' caches
    expected = reread.generate(nexts, env.tools(), sampling)
    assert [c.token_ids for c in after] == [c.token_ids for c in expected]
    assert [c.logprobs for c in after] == [pytest.approx(c.logprobs, abs=1e-6) for c in expected]
    assert policy.kept.entries
    policy.load_weights({k: v.clone() for k, v in model.state_dict().items()})  # published weights: forgotten
    assert not policy.kept.entries


def test_a_turn_rendered_otherwise_than_written_reuses_what_matches(tiny_student, env):
    policy, reread = HFPolicy(tiny_student), HFPolicy(tiny_student, kept_bytes=0)
    tokenizer, tools = policy.tokenizer, env.tools()
    prompts = [t.prompt for t in islice(env.generate_tasks(8), 3)]
    sampling = Sampling(max_new_tokens=6)
    first = policy.generate(prompts, tools, sampling)
    nexts = [[*p, {"role": "assistant", "content": "Something else."}, {"role": "user", "content": "Again?"}]
             for p in prompts]
    expected = 0
    for prompt, completion, conversation in zip(prompts, first, nexts, strict=True):
        written = tokenizer.apply_chat_template(prompt, tools=tools, add_generation_prompt=True)["input_ids"] + \
            completion.token_ids[:-1]  # the kept cache: all but the last token (never read)
        new = tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=True)["input_ids"]
        common = next((i for i, (a, b) in enumerate(zip(written, new, strict=False)) if a != b),
                      min(len(written), len(new)))
        assert common < len(written)  # the turn as rendered differs from the tokens written
        expected += common
    reused = policy.stats.reused_tokens
    after = policy.generate(nexts, tools, sampling)
    assert policy.stats.reused_tokens - reused == expected  # cropped to what matches, no more, no less
    whole = reread.generate(nexts, tools, sampling)
    assert [c.token_ids for c in after] == [c.token_ids for c in whole]
    assert [c.logprobs for c in after] == [pytest.approx(c.logprobs, abs=1e-5) for c in whole]


def test_the_kept_caches_stay_within_their_bound_and_last_one_call(talkative, env):
    model, tokenizer = talkative
    sampling = Sampling(temperature=1.0, max_new_tokens=16, seed=5)
    per_token = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * \
        (model.config.hidden_size // model.config.num_attention_heads) * 4
    bound = 300 * per_token  # room for a couple of rows
    small = HFPolicy(model, tokenizer, batch_size=8, kept_bytes=bound, continuous=False)
    reread = HFPolicy(model, tokenizer, batch_size=8, kept_bytes=0)
    bounded, whole = _episodes(small, env, sampling), _episodes(reread, env, sampling)
    assert 0 < small.stats.kept_rows < small.stats.rows  # some rows were kept, the rest read again
    assert small.kept.nbytes <= bound
    assert [c.token_ids for c in _turns(bounded)] == [c.token_ids for c in _turns(whole)]
    # a call on other conversations leaves nothing of the episodes above but what it read from
    others = [t.prompt for t in islice(env.generate_tasks(9), 2)]
    policy = HFPolicy(model, tokenizer, batch_size=8, continuous=False)
    _episodes(policy, env, sampling)
    policy.generate(others, env.tools(), Sampling(max_new_tokens=4))
    assert 2 <= len(policy.kept.entries) <= 2 + 2  # its two rows', and at most two it read openings from
    assert all(e.used == policy.kept.call for e in policy.kept.entries)


class AllowOnly:
    """A test double of flywheel.policies.constrained's RowConstraint: only `tokens`, then the end token."""

    def __init__(self, tokens: set[int], eos: int, vocab: int, length: int):
        self.tokens, self.eos, self.vocab, self.length, self.seen = tokens, eos, vocab, length, []

    def allowed(self) -> torch.Tensor:
        allowed = torch.zeros(self.vocab, dtype=torch.bool)
        allowed[list(self.tokens) if len(self.seen) < self.length else [self.eos]] = True
        return allowed

    def accept(self, token_id: int) -> None:
        self.seen.append(token_id)


def test_the_constraint_hook_masks_the_rows_it_constrains_and_records_the_masks(tiny_student, env, monkeypatch):
    policy = HFPolicy(tiny_student, kept_bytes=0)
    tokenizer = policy.tokenizer
    digits = {tokenizer.convert_tokens_to_ids(d) for d in "0123456789"}
    made, asked = [], []

    def row_constraints(tok, tools, tool_choice, n_rows, vocab_size):
        asked.append((tools, tool_choice, n_rows, vocab_size))
        rows = [AllowOnly(digits, tok.eos_token_id, vocab_size, length=3), None]
        made.extend(rows)
        return rows

    monkeypatch.setitem(sys.modules, "flywheel.policies.constrained",
                        types.SimpleNamespace(row_constraints=row_constraints))
    prompts = [t.prompt for t in islice(env.generate_tasks(6), 2)]
    temperature = 0.7
    constrained, free = policy.generate(prompts, env.tools(), Sampling(temperature=temperature, max_new_tokens=8,
                                                                      seed=1, constrained=True, tool_choice="required"))
    vocab = policy.model.config.vocab_size
    assert asked == [(env.tools(), "required", 2, vocab)]
    assert constrained.token_ids[:3] == made[0].seen[:3] and set(constrained.token_ids[:3]) <= digits
    assert constrained.token_ids[3] == tokenizer.eos_token_id and len(constrained.token_ids) == 4
    assert free.masks is None
    assert sorted(constrained.masks) == [0, 1, 2, 3]
    for position, packed in constrained.masks.items():
        allowed = np.unpackbits(packed)[:vocab].astype(bool)
        assert set(np.flatnonzero(allowed)) == (digits if position < 3 else {tokenizer.eos_token_id})
    # the logprobs are of the distribution sampled: tempered, masked, renormalised
    ids = tokenizer.apply_chat_template(prompts[0], tools=env.tools(), add_generation_prompt=True)["input_ids"]
    with torch.no_grad():
        logits = policy.model(torch.tensor([ids + constrained.token_ids])).logits[0, len(ids) - 1:-1] / temperature
    for position, packed in constrained.masks.items():
        allowed = torch.from_numpy(np.unpackbits(packed)[:vocab].astype(bool))
        expected = torch.log_softmax(logits[position].masked_fill(~allowed, float("-inf")), -1)
        assert constrained.logprobs[position] == pytest.approx(float(expected[constrained.token_ids[position]]),
                                                              abs=1e-5)
    assert constrained.logprobs[3] == pytest.approx(0.0, abs=1e-6)  # only the end token was allowed
