"""The opening a batch's rows share (a system prompt and tools), read once for all of them, in training and
scoring passes alike; and the LM head run only where a token's probability is wanted."""

from __future__ import annotations

import torch

# Rows opening with this many identical, untrained tokens have them read once (a support desk conversation's
# first ~310 of ~590 tokens are the system prompt and the tools, the same in every row); a shorter opening is not
# worth the second forward pass. The same threshold as the hf policy's for generation.
SHARED_OPENING_MIN = 32


def shared_opening(input_ids: torch.Tensor, wanted: torch.Tensor, attention_mask: torch.Tensor | None = None) -> int:
    """How many leading positions every row has in common before the first token whose probability is wanted
    (wanted [B, T] bool: trained or scored), such that the opening's own outputs are never needed: 0 when under
    SHARED_OPENING_MIN or the batch has one row. The token right after the opening is not wanted either (its
    probability would come from the opening's last position, which the opening's pass does not keep)."""
    if input_ids.shape[0] < 2 or input_ids.shape[1] < 2:
        return 0
    same = (input_ids == input_ids[:1]).all(0) & ~wanted.any(0)
    if attention_mask is not None:
        same &= attention_mask.bool().all(0)
    same[:-1] &= ~wanted[:, 1:].any(0)
    same[-1] = False  # every row keeps at least its last token for the second pass
    length = int(same.long().cumprod(0).sum())
    return length if length >= SHARED_OPENING_MIN else 0


def read_opening(model, input_ids: torch.Tensor, opening: int):
    """The rows' shared opening read once (first row) into a cache repeated for every row; differentiable, so
    the rows' gradients meet in the opening."""
    cache = model(input_ids=input_ids[:1, :opening], use_cache=True, logits_to_keep=1).cache
    cache.batch_repeat_interleave(input_ids.shape[0])
    return cache


def wanted_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  wanted: torch.Tensor) -> torch.Tensor:
    """The logits that predict each wanted token, [N, V] in the row-major order of `wanted` [B, T] (bool; the
    first position has nothing before it and is never wanted): so `input_ids[wanted]` are the tokens they
    predict. The rows' shared opening is read once, and the LM head runs only where needed. Right padding (the
    attention mask covers each row from its start)."""
    if wanted[:, 0].any():
        raise ValueError("the first position of a row has no prediction: it cannot be wanted")
    opening = shared_opening(input_ids, wanted, attention_mask)
    extra = {"cache": read_opening(model, input_ids, opening)} if opening else {}
    rest = wanted[:, opening:]
    keep = torch.cat([rest[:, 1:], torch.zeros_like(rest[:, :1])], dim=1)  # position p predicts token p + 1
    logits = model(input_ids=input_ids[:, opening:], attention_mask=attention_mask, use_cache=False,
                   logits_to_keep=keep, **extra).logits
    return logits.reshape(-1, logits.shape[-1])
