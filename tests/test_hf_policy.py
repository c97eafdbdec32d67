"""The hf policy on a random tiny model: batching, token data, determinism, seeds and the end token."""

from __future__ import annotations

import math
from itertools import islice

import pytest
import torch
from conftest import leaning_to_tool_calls

from flywheel.agent import Harness, Limits
from flywheel.checkpoints import load_student
from flywheel.envs.calculator import CalculatorEnv
from flywheel.policies import get_policy
from flywheel.policies.base import Sampling
from flywheel.policies.hf import HFPolicy


@pytest.fixture(scope="module")
def env() -> CalculatorEnv:
    return CalculatorEnv()


@pytest.fixture(scope="module")
def prompts(env) -> list[list[dict]]:
    return [t.prompt for t in islice(env.generate_tasks(7), 5)]


@pytest.fixture(scope="module")
def policy(tiny_student) -> HFPolicy:
    return HFPolicy(tiny_student, batch_size=2)  # 5 prompts: chunks of 2, 2 and 1


def test_completions_carry_token_ids_and_logprobs(policy, env, prompts):
    completions = policy.generate(prompts, env.tools(), Sampling(max_new_tokens=12))
    assert len(completions) == len(prompts)
    for c in completions:
        assert c.message["role"] == "assistant"
        assert 1 <= len(c.token_ids) == len(c.logprobs) <= 12
        assert all(lp <= 0 and math.isfinite(lp) for lp in c.logprobs)


def test_greedy_is_deterministic(policy, env, prompts):
    first = policy.generate(prompts, env.tools(), Sampling(max_new_tokens=12))
    second = policy.generate(prompts, env.tools(), Sampling(max_new_tokens=12))
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    assert [c.text for c in first] == [c.text for c in second]


def test_seeded_sampling_is_reproducible_and_leaves_global_rng_alone(policy, env, prompts):
    sampling = Sampling(temperature=1.0, max_new_tokens=12, seed=3)
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    first = policy.generate(prompts, env.tools(), sampling)
    assert torch.rand(1) == before
    second = policy.generate(prompts, env.tools(), sampling)
    other = policy.generate(prompts, env.tools(), Sampling(temperature=1.0, max_new_tokens=12, seed=4))
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]


def test_logprobs_are_those_of_the_tempered_distribution(policy, env, prompts):
    temperature = 0.7
    [completion] = policy.generate(prompts[:1], env.tools(), Sampling(temperature=temperature, max_new_tokens=10,
                                                                      seed=1))
    prompt = policy.tokenizer.apply_chat_template(prompts[0], tools=env.tools(), add_generation_prompt=True)
    ids = torch.tensor([prompt["input_ids"] + completion.token_ids])
    with torch.no_grad():
        logits = policy.model(ids).logits[0, len(prompt["input_ids"]) - 1:-1]
    expected = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(completion.token_ids)[:, None])
    assert torch.allclose(torch.tensor(completion.logprobs), expected.squeeze(1), atol=1e-4)


def test_generation_stops_at_the_end_token(tiny_student, env, prompts):
    model, tokenizer = load_student(tiny_student)
    # A head that always prefers <|im_end|>: the model answers at once with an empty turn.
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    torch.nn.init.zeros_(head.weight)
    with torch.no_grad():
        head.bias.fill_(-10.0)
        head.bias[tokenizer.eos_token_id] = 10.0
    model.lm_head = head
    policy = HFPolicy(model, tokenizer)
    for completion in policy.generate(prompts, env.tools(), Sampling(max_new_tokens=8)):
        assert completion.token_ids == [tokenizer.eos_token_id]
        assert completion.text == "" and completion.message == {"role": "assistant", "content": ""}
        assert completion.logprobs[0] == pytest.approx(0.0, abs=1e-6)


def test_runs_in_the_harness_and_restores_training_mode(tiny_student, env):
    model, tokenizer = load_student(tiny_student)
    model.train()
    policy = get_policy("hf", model_or_path=model, tokenizer=tokenizer)
    tasks = list(islice(env.generate_tasks(3), 4))
    episodes = Harness(env, Limits(max_turns=2)).run(policy, tasks, sampling=Sampling(max_new_tokens=16))
    assert len(episodes) == 4 and all(not e.passed for e in episodes)  # random weights solve nothing
    assert model.training
    with pytest.raises(ValueError, match="tokenizer"):
        HFPolicy(model)


def test_bf16_generates_under_autocast_with_finite_logprobs_and_the_weights_untouched(tiny_student, env, prompts):
    bf16 = HFPolicy(tiny_student, batch_size=2, precision="bf16")
    before = {k: v.clone() for k, v in bf16.model.state_dict().items()}
    seen = []
    hook = bf16.model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    try:
        completions = bf16.generate(prompts, env.tools(), Sampling(temperature=0.0, max_new_tokens=8))
    finally:
        hook.remove()
    assert seen and set(seen) == {torch.bfloat16}  # the matmuls ran in bf16
    assert all(1 <= len(c.token_ids) == len(c.logprobs) for c in completions)
    assert all(lp <= 0 and math.isfinite(lp) for c in completions for lp in c.logprobs)
    after = bf16.model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    with pytest.raises(ValueError, match="precision: 'fp16'"):
        HFPolicy(tiny_student, precision="fp16")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_opening_every_row_shares_is_read_once_and_changes_no_turn(tiny_student, env, prompts, monkeypatch,
                                                                      temperature):
    import flywheel.policies.hf as hf

    system = {"role": "system", "content": "You are a careful assistant. " * 12}
    shared = [[system, *p] for p in prompts]
    policy = HFPolicy(tiny_student, batch_size=8, kept_bytes=0)  # the second call must not start from the first's
    sampling = Sampling(temperature=temperature, max_new_tokens=10, seed=3)
    rows = [policy.tokenizer.apply_chat_template(p, tools=env.tools(), add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"] for p in shared]
    assert hf._common_prefix(rows) >= hf.SHARED_PREFIX_MIN
    calls = []
    original = policy.model.forward

    def forward(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(policy.model, "forward", forward)
    once = policy.generate(shared, env.tools(), sampling)
    assert calls[0][0] == 1 and calls[1][0] == len(prompts)  # the opening alone, then every row's rest
    assert calls[1][1] < max(len(r) for r in rows) - hf._common_prefix(rows) + 1

    monkeypatch.setattr(hf, "SHARED_PREFIX_MIN", 10 ** 6)  # the opening read again in every row
    calls.clear()
    whole = policy.generate(shared, env.tools(), sampling)
    assert calls[0] == (len(prompts), max(len(r) for r in rows))
    assert [c.token_ids for c in once] == [c.token_ids for c in whole]
    assert [c.usage for c in once] == [c.usage for c in whole]
    for a, b in zip(once, whole, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_an_episode_in_the_continuing_batch_is_reported_while_the_batch_decodes(tiny_student, env):
    """The hf policy runs whole episodes in one batch: the harness hears of each as its row ends (evaluate's
    progress), not when the whole batch is done. The student leans to tool calls and to its end token, so that its
    rows end at different steps (the random one may write 24 tokens in every row and end them all at once)."""
    from flywheel.policies.hf import HFPolicy

    policy = HFPolicy(*leaning_to_tool_calls(tiny_student, eos_bias=2.0), batch_size=8)
    steps_when_done = []
    Harness(env, Limits(max_turns=3)).run(policy, list(islice(env.generate_tasks(0), 8)),
                                          sampling=Sampling(temperature=1.0, max_new_tokens=24, seed=0),
                                          on_done=lambda e: steps_when_done.append(policy.stats.steps))
    assert len(steps_when_done) == 8
    assert steps_when_done[0] < policy.stats.steps  # the first was reported while other rows still decoded


@pytest.mark.parametrize("continuous", [True, False])
def test_bf16_casts_each_weight_once_a_call_and_keeps_its_cache_in_bf16_with_the_same_turns(
        tiny_student, env, monkeypatch, continuous):
    """Under autocast the weights are cast once per call (not at every linear of every step: inference_mode turns
    autocast's cache of cast weights off) and the kept keys and values are bf16, the dtype attention reads them in:
    the same tokens and logprobs as a cache kept in fp32, which attention cast whole at every step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import flywheel.policies.decoding as decoding

    policy = HFPolicy(tiny_student, batch_size=8, precision="bf16", continuous=continuous)
    weights = {p.data_ptr(): name for name, p in policy.model.named_parameters()}
    casts: dict[str, int] = {}

    class CountWeightCasts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # (inference_mode shows autocast's casts as aten.to.dtype, no_grad as aten._to_copy)
            if func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype) and args[0].data_ptr() in weights:
                name = weights[args[0].data_ptr()]
                casts[name] = casts.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    tasks = list(islice(env.generate_tasks(5), 6))
    sampling = Sampling(temperature=1.0, max_new_tokens=12, seed=4)

    def run() -> list:
        return Harness(env, Limits(max_turns=3)).run(policy, tasks, sampling=sampling)

    with CountWeightCasts():
        episodes = run()
    assert policy.stats.steps > 3 and casts and max(casts.values()) == 1  # every step used the one cast
    kept = [k for entry in policy.kept.entries for k, _ in entry.layers]
    if not continuous:  # turn by turn: finished rows' caches are kept for their next turn
        assert kept and {k.dtype for k in kept} == {torch.bfloat16}
    policy.forget()
    monkeypatch.setattr(decoding, "_stored_dtype", lambda states: states.dtype)  # the cache as the model made it
    in_fp32 = run()
    assert [[c.token_ids for c in e.completions] for e in episodes] == \
        [[c.token_ids for c in e.completions] for e in in_fp32]
    assert [[c.logprobs for c in e.completions] for e in episodes] == \
        [[c.logprobs for c in e.completions] for e in in_fp32]
