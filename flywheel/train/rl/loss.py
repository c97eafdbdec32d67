"""The clipped GRPO-family policy loss on assistant tokens, with truncated importance sampling and a k3 KL; the
log-probabilities it takes, of the distribution each token was actually sampled from (tempered, and masked where
constrained decoding masked it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

LossType = Literal["grpo", "dr_grpo", "dapo"]


# A collated batch's token masks (constrained decoding), as three tensors beside input_ids (see TokenMasks).
MASK_KEYS = ("mask_rows", "mask_positions", "mask_bits")


@dataclass
class TokenMasks:
    """The allowed tokens at the positions constrained decoding masked, for a batch [B, T]: entry m says that the
    token at (rows[m], positions[m]) was sampled from the tokens whose bits are set in bits[m] (numpy.packbits of
    allowed[vocab], bit order big; flywheel.policies.base.Completion.masks). Kept packed, only where masked."""

    rows: torch.Tensor  # [M] long
    positions: torch.Tensor  # [M] long
    bits: torch.Tensor  # [M, ceil(V / 8)] uint8

    @classmethod
    def of(cls, batch: dict[str, torch.Tensor]) -> TokenMasks | None:
        """The batch's masks, or None when no token of it was sampled under a mask."""
        return cls(*(batch[key] for key in MASK_KEYS)) if MASK_KEYS[0] in batch else None

    def select(self, rows: torch.Tensor | slice, n: int) -> TokenMasks | None:
        """The masks of the sub-batch batch[rows] (of a batch of n rows), renumbered to its rows; None if none."""
        picked = torch.arange(n, device=self.rows.device)[rows]
        lookup = torch.full((n,), -1, dtype=torch.long, device=self.rows.device)
        lookup[picked] = torch.arange(len(picked), device=self.rows.device)
        new_rows = lookup[self.rows]
        keep = new_rows >= 0
        if not keep.any():
            return None
        return TokenMasks(new_rows[keep], self.positions[keep], self.bits[keep])

    def apply(self, logits: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
        """logits [N, V] of the wanted tokens (row-major order of wanted [B, T]) with each masked position's
        disallowed tokens at -inf; positions not wanted are skipped."""
        order = torch.full(wanted.shape, -1, dtype=torch.long, device=logits.device)
        order[wanted] = torch.arange(int(wanted.sum()), device=logits.device)
        index = order[self.rows.to(logits.device), self.positions.to(logits.device)]
        keep = index >= 0
        if not keep.any():
            return logits
        bits = self.bits.to(logits.device)[keep]
        shifts = torch.arange(7, -1, -1, device=logits.device, dtype=torch.uint8)
        allowed = ((bits.unsqueeze(-1) >> shifts) & 1).reshape(len(bits), -1).bool()
        vocab = logits.shape[-1]
        if allowed.shape[1] < vocab:
            raise ValueError(f"a token mask covers {allowed.shape[1]} tokens but the model has {vocab} logits: the "
                             "mask must be as wide as the logits it was applied to (padded to a multiple of 8)")
        index = index[keep]
        return logits.index_put((index,), logits[index].masked_fill(~allowed[:, :vocab], float("-inf")))


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0, wanted: torch.Tensor | None = None,
                   masks: TokenMasks | None = None) -> torch.Tensor:
    """Log-prob of each token given its prefix, [B, T]: position t holds log p(input_ids[t]); position 0 is 0.

    With a sampling temperature the log-probs are those of the tempered distribution the tokens came from; with
    masks (constrained decoding), of that distribution masked and renormalised where the sampler masked it.
    wanted [B, T] (the loss mask): only those tokens' log-probs are worked out, the others are 0; the rows'
    shared opening (system prompt, tools) is then read once and the LM head runs only where wanted
    (flywheel/train/opening.py), the same numbers at a fraction of the positions.
    """
    if wanted is not None:
        return token_distributions(model, input_ids, attention_mask, wanted, temperature, masks)[0]
    if masks is not None:
        raise ValueError("token masks need `wanted` (the positions whose log-probabilities are taken)")
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    # float32 for the softmax: bf16 log-probs are too coarse for ratios near 1.
    logp = F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return F.pad(picked, (1, 0), value=0.0)


def token_distributions(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        wanted: torch.Tensor, temperature: float = 1.0,
                        masks: TokenMasks | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_logprobs at the wanted tokens [B, T], 0 elsewhere; the whole log-distribution each wanted token was
    drawn from [N, V], in the row-major order of `wanted`, -inf where a mask disallowed a token). A row's first
    position is never wanted."""
    from flywheel.train.opening import wanted_logits

    wanted = wanted.bool().clone()
    wanted[:, 0] = False
    logits = wanted_logits(model, input_ids, attention_mask, wanted).float() / temperature
    if masks is not None:
        logits = masks.apply(logits, wanted)
    logp = F.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, input_ids[wanted].unsqueeze(-1)).squeeze(-1)
    return torch.zeros(input_ids.shape, dtype=picked.dtype, device=picked.device).masked_scatter(wanted, picked), logp


def truncated_is_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                         cap: float) -> torch.Tensor:
    """Per-token importance weights min(pi_old / pi_behaviour, cap), detached: they correct, never train."""
    return torch.exp(old_logprobs - behaviour_logprobs).clamp(max=cap).detach()


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref): exp(ref - new) - (ref - new) - 1, unbiased and >= 0."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: LossType = "grpo",
              max_length: int | None = None) -> torch.Tensor:
    """The loss of per-token terms [B, T] over the masked tokens, as `loss_type` averages (see policy_loss)."""
    mask = mask.to(per_token.dtype)
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "dr_grpo":
        length = max_length if max_length is not None else mask.shape[1]
        return (per_token * mask).sum() / (mask.shape[0] * length)
    if loss_type == "dapo":
        return _masked_mean(per_token, mask)
    raise ValueError(f"unknown loss_type '{loss_type}' (known: grpo, dr_grpo, dapo)")


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, clip_eps: float, loss_type: LossType = "grpo",
                max_length: int | None = None, behaviour_logprobs: torch.Tensor | None = None,
                tis_cap: float = 2.0, ref_logprobs: torch.Tensor | None = None,
                beta: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate over masked tokens; returns (loss, stats): clip fraction, ratios, IS weights, KL.

    logprobs carry the gradient; old_logprobs are the policy the ratio is taken against; behaviour_logprobs,
    when given, are the policy that actually sampled (older, in async RL), corrected by truncated IS.
    "grpo" averages each sequence over its own tokens, then over sequences; "dr_grpo" sums every token and
    divides by B * max_length (a constant, so long answers are not down-weighted per token); "dapo" is the mean
    over every masked token of the batch (each token counts once, whatever its sequence's length).
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and "
                         f"mask {tuple(mask.shape)} must all be [B, T]")
    mask = mask.to(logprobs.dtype)
    old_logprobs = old_logprobs.detach()
    # one advantage per sequence [B] (the group's reward), or one per token [B, T] (on-policy distillation)
    adv = advantages.to(logprobs.dtype)
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv

    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    per_token = torch.maximum(unclipped, clipped)

    if behaviour_logprobs is not None:
        weights = truncated_is_weights(old_logprobs, behaviour_logprobs, tis_cap)
        per_token = per_token * weights
    else:
        weights = torch.ones_like(per_token)

    kl = None
    if ref_logprobs is not None:
        kl = k3_kl(logprobs, ref_logprobs.detach())
        per_token = per_token + beta * kl

    loss = aggregate(per_token, mask, loss_type, max_length)

    with torch.no_grad():
        # A token is clipped when clipping removes its gradient: the ratio left the trust region in the
        # direction the advantage pushes it.
        is_clipped = ((adv > 0) & (ratio > 1.0 + clip_eps)) | ((adv < 0) & (ratio < 1.0 - clip_eps))
        on = mask.bool()
        stats = {
            "clip_fraction": _masked_mean(is_clipped.to(mask.dtype), mask).item(),
            "ratio_mean": _masked_mean(ratio, mask).item(),
            "ratio_max": ratio[on].max().item() if on.any() else 1.0,
            "is_weight_mean": _masked_mean(weights, mask).item(),
            "is_weight_max": weights[on].max().item() if on.any() else 1.0,
        }
        if kl is not None:
            stats["kl"] = _masked_mean(kl, mask).item()
    return loss, stats
