"""The RL parts: group advantages, the clipped loss (checked by hand), truncated IS and token log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from flywheel.train.rl.advantages import group_advantages
from flywheel.train.rl.loss import k3_kl, policy_loss, token_logprobs, truncated_is_weights

# Two sequences of 3 tokens; position 0 is the prompt (no loss), sequence 1's last token is padding.
MASK = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
RATIOS = torch.tensor([[1.0, 1.5, 0.9], [1.0, 0.7, 2.0]])
ADVANTAGES = torch.tensor([1.0, -2.0])
OLD = torch.full((2, 3), -1.0)


def new_logprobs() -> torch.Tensor:
    return (OLD + RATIOS.log()).clone().requires_grad_(True)


# By hand, clip_eps 0.2, per token max(-A r, -A clip(r)):
#   seq 0: r 1.5 -> max(-1.5, -1.2) = -1.2 (clipped);  r 0.9 -> -0.9
#   seq 1: r 0.7, A -2 -> max(1.4, 1.6) = 1.6 (clipped)
def test_grpo_loss_by_hand():
    logprobs = new_logprobs()
    loss, stats = policy_loss(logprobs, OLD, ADVANTAGES, MASK, clip_eps=0.2, loss_type="grpo")
    assert loss.item() == pytest.approx(((-1.2 - 0.9) / 2 + 1.6) / 2)
    assert stats["clip_fraction"] == pytest.approx(2 / 3)
    assert stats["ratio_mean"] == pytest.approx((1.5 + 0.9 + 0.7) / 3)
    assert stats["ratio_max"] == pytest.approx(1.5)
    assert stats["is_weight_mean"] == 1.0 and "kl" not in stats
    loss.backward()
    # Clipped tokens get no gradient; d(-A r)/d logp = -A r, / 2 tokens / 2 sequences.
    expected = torch.tensor([[0.0, 0.0, -0.9 / 4], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected)


def test_dr_grpo_loss_by_hand():
    logprobs = new_logprobs()
    loss, _ = policy_loss(logprobs, OLD, ADVANTAGES, MASK, clip_eps=0.2, loss_type="dr_grpo", max_length=4)
    assert loss.item() == pytest.approx((-1.2 - 0.9 + 1.6) / (2 * 4))
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, -0.9 / 8], [0.0, 0.0, 0.0]]))


def test_dapo_loss_by_hand():
    # one mean over the batch's 3 assistant tokens, whatever sequence they are in
    logprobs = new_logprobs()
    loss, _ = policy_loss(logprobs, OLD, ADVANTAGES, MASK, clip_eps=0.2, loss_type="dapo")
    assert loss.item() == pytest.approx((-1.2 - 0.9 + 1.6) / 3)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, -0.9 / 3], [0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="unknown loss_type"):
        policy_loss(logprobs, OLD, ADVANTAGES, MASK, clip_eps=0.2, loss_type="ppo")


def test_equal_policies_give_minus_advantage_weighted_mean():
    logprobs = OLD.clone().requires_grad_(True)
    loss, stats = policy_loss(logprobs, OLD, ADVANTAGES, MASK, clip_eps=0.2)
    assert loss.item() == pytest.approx((-1.0 + 2.0) / 2)
    assert stats["clip_fraction"] == 0.0 and stats["ratio_max"] == pytest.approx(1.0)


def test_truncated_is_weights_are_capped_and_detached():
    old = torch.tensor([[0.0, math.log(3.0), math.log(0.5)]], requires_grad=True)
    weights = truncated_is_weights(old, torch.zeros(1, 3), cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 2.0, 0.5]]))
    assert not weights.requires_grad


def test_is_weights_scale_each_token():
    behaviour = OLD - torch.tensor([[0.0, math.log(3.0), math.log(0.5)], [0.0, math.log(0.25), 0.0]])
    # weights exp(old - behaviour) capped at 2: seq 0 [., 2, 0.5], seq 1 [., 0.25, .]
    logprobs = new_logprobs()
    loss, stats = policy_loss(logprobs, OLD, ADVANTAGES, MASK, clip_eps=0.2, behaviour_logprobs=behaviour,
                              tis_cap=2.0)
    assert loss.item() == pytest.approx(((-1.2 * 2 - 0.9 * 0.5) / 2 + 1.6 * 0.25) / 2)
    assert stats["is_weight_max"] == pytest.approx(2.0)
    assert stats["is_weight_mean"] == pytest.approx((2.0 + 0.5 + 0.25) / 3)


def test_k3_kl_term():
    ref = OLD - 0.5
    logprobs = OLD.clone().requires_grad_(True)
    per_token = math.exp(-0.5) + 0.5 - 1.0
    assert k3_kl(OLD, OLD).abs().max().item() == 0.0
    loss, stats = policy_loss(logprobs, OLD, ADVANTAGES, MASK, clip_eps=0.2, ref_logprobs=ref, beta=0.1)
    assert stats["kl"] == pytest.approx(per_token)
    assert loss.item() == pytest.approx((-1.0 + 2.0) / 2 + 0.1 * per_token)


def test_group_advantages():
    assert group_advantages([1.0, 0.0, 1.0, 0.0]) == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)
    dr = group_advantages([1.0, 0.0, 0.0, 0.0], kind="dr_grpo")
    assert dr == pytest.approx([0.75, -0.25, -0.25, -0.25])
    grpo = group_advantages([0.2, 0.5, 0.8])
    assert sum(grpo) == pytest.approx(0.0, abs=1e-9)
    assert grpo[2] == pytest.approx(0.3 / math.sqrt(0.06), rel=1e-4)
    assert group_advantages([1.0, 1.0, 1.0]) is None
    assert group_advantages([0.0, 0.0], kind="dr_grpo") is None
    with pytest.raises(ValueError, match="unknown advantage kind"):
        group_advantages([0.0, 1.0], kind="ppo")
    with pytest.raises(ValueError, match="finite"):
        group_advantages([0.0, float("nan")])


def test_token_logprobs_match_a_manual_gather():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=32, bos_token_id=None))
    ids = torch.randint(0, 40, (2, 6))
    attention = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    got = token_logprobs(model, ids, attention)
    logits = model(input_ids=ids, attention_mask=attention).logits
    for b in range(2):
        assert got[b, 0].item() == 0.0
        for t in range(1, 6):
            expected = torch.log_softmax(logits[b, t - 1], dim=-1)[ids[b, t]]
            assert got[b, t].item() == pytest.approx(expected.item(), abs=1e-5)


def test_wanted_logprobs_read_the_shared_opening_once_with_the_same_values_and_gradients():
    from transformers import LlamaConfig, LlamaForCausalLM

    from flywheel.train.opening import shared_opening

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=128, bos_token_id=None))
    opening = torch.randint(0, 50, (40,))  # a system prompt every row starts with
    ids = torch.cat([opening.expand(3, -1), torch.randint(0, 50, (3, 30))], dim=1)
    attention = torch.ones_like(ids)
    attention[1, 60:] = 0  # right padding
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 50:55] = True  # an assistant turn
    mask[0, 62:68] = True
    mask[2, 41:44] = True
    mask &= attention.bool()
    assert shared_opening(ids, mask, attention) == 40
    calls = []
    forward = model.forward
    model.forward = lambda *a, **k: calls.append(tuple(k["input_ids"].shape)) or forward(*a, **k)
    got = token_logprobs(model, ids, attention, temperature=0.7, wanted=mask)
    del model.forward
    assert calls == [(1, 40), (3, 30)]
    (got * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    whole = token_logprobs(model, ids, attention, temperature=0.7)
    (whole * mask).sum().backward()
    assert torch.allclose(got[mask], whole[mask], atol=1e-5) and (got[~mask] == 0).all()
    assert all(torch.allclose(grads[n], p.grad, rtol=1e-4, atol=1e-6) for n, p in model.named_parameters())
