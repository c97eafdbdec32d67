"""The learner's update: old log-probs once, then epochs of clipped-loss minibatch steps on one batch."""

from __future__ import annotations

import math

import torch

from flywheel.config import RLConfig
from flywheel.train.rl.loss import (
    MASK_KEYS,
    TokenMasks,
    aggregate,
    k3_kl,
    policy_loss,
    token_distributions,
    token_logprobs,
)
from flywheel.train.rl.objective import objective_of
from flywheel.train.rl.opd import distill_advantages, exact_divergence

_MAXIMA = ("ratio_max", "is_weight_max", "grad_norm_max")


def learning_rate(cfg: RLConfig, step: int) -> float:
    """The learning rate of learner step `step` under cfg.lr_schedule (warm-up, then constant or decaying)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    if cfg.lr_schedule == "constant":
        return cfg.lr
    span = max(cfg.steps - 1 - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.lr_schedule == "cosine" else 1.0 - progress
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape)


@torch.no_grad()
def batch_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk: int,
                   temperature: float = 1.0) -> torch.Tensor:
    """token_logprobs of a whole batch's loss-mask tokens without gradient, `chunk` sequences at a time (under the
    batch's token masks where constrained decoding sampled them)."""
    masks, n = TokenMasks.of(batch), len(batch["input_ids"])
    parts = [token_logprobs(model, batch["input_ids"][i:i + chunk], batch["attention_mask"][i:i + chunk],
                            temperature, wanted=batch["loss_mask"][i:i + chunk] > 0,
                            masks=masks and masks.select(slice(i, i + chunk), n))
             for i in range(0, n, chunk)]
    return torch.cat(parts)


def _rows(batch: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """The sub-batch of these rows, its token masks renumbered to them."""
    out = {key: value[rows] for key, value in batch.items() if key not in MASK_KEYS}
    masks = TokenMasks.of(batch)
    picked = masks.select(rows, len(batch["input_ids"])) if masks is not None else None
    return out | (dict(zip(MASK_KEYS, (picked.rows, picked.positions, picked.bits), strict=True)) if picked else {})


def learn_on_batch(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor],
                   cfg: RLConfig, generator: torch.Generator,
                   reference: torch.nn.Module | None = None, teacher=None) -> dict[str, float]:
    """cfg.epochs_per_batch passes of minibatch steps; the ratio is against the batch's starting weights.

    A batch with behaviour_logprobs (the actors' sampling logprobs) also gets truncated importance weights
    (cap cfg.tis_cap); with a reference model, a k3 KL penalty (cfg.kl_beta) towards it; with teacher_logprobs
    (on-policy distillation), per-token advantages from the teacher (flywheel/train/rl/opd.py), or under an
    exact rl.opd.divergence the loss term kl_coef * KL over the vocabulary, the distributions from `teacher`
    (a LocalTeacher) for each minibatch.

    A batch with token masks (constrained decoding) has every log-probability of a masked position taken under
    its mask (disallowed tokens -inf, renormalised): the new and old policy's, so the ratio is 1 for an unchanged
    policy; the reference's, so the KL penalty compares the two policies as the harness runs them; a local
    teacher's, the distribution it would sample under the same constraint.

    The first minibatch's old log-probabilities are its own new ones, detached (the weights have not moved yet:
    a forward pass saved, as TRL does with one iteration); the other rows' are read before any step. Under
    on-policy distillation every row's are read first (its advantages need them).
    """
    device = next(model.parameters()).device
    batch = {key: value.to(device) for key, value in batch.items()}  # collated on the CPU; learned where the model is
    n = len(batch["input_ids"])
    orders = [torch.randperm(n, generator=generator) for _ in range(cfg.epochs_per_batch)]
    first = orders[0][:cfg.minibatch_size] if "teacher_logprobs" not in batch else orders[0][:0]
    rest = torch.ones(n, dtype=torch.bool)
    rest[first] = False
    model.eval()  # deterministic old log-probs (no dropout)
    old = torch.zeros(batch["input_ids"].shape, device=device)
    if rest.any():
        rows = rest.nonzero().squeeze(-1).to(device)
        old[rows] = batch_logprobs(model, _rows(batch, rows), cfg.minibatch_size, cfg.temperature)
    ref = batch_logprobs(reference, batch, cfg.minibatch_size, cfg.temperature) if reference is not None else None
    extra: dict[str, float] = {}
    advantages = batch["advantages"]
    exact = None  # an exact divergence to the teacher, a loss term of its own
    if "teacher_logprobs" in batch:  # on-policy distillation: per-token advantages against these old log-probs
        objective = objective_of(cfg)
        opd = objective.opd
        exact = opd.divergence if opd.divergence != "sampled" else None
        if exact and not hasattr(teacher, "distributions"):
            raise ValueError(f"rl.opd.divergence '{exact}' needs the teacher's whole distributions: a local "
                             f"checkpoint, not {getattr(teacher, 'name', teacher)}")
        advantages, extra = distill_advantages(old, batch["teacher_logprobs"], batch["loss_mask"],
                                               batch["advantages"], 0.0 if exact else opd.kl_coef,
                                               objective.reward_coef)
    model.train()
    totals: dict[str, float] = {}
    maxima: dict[str, float] = {}
    count = 0
    masks = TokenMasks.of(batch)
    for order in orders:
        for idx in order.split(cfg.minibatch_size):
            ids, attention, wanted = batch["input_ids"][idx], batch["attention_mask"][idx], batch["loss_mask"][idx] > 0
            picked = masks and masks.select(idx.to(masks.rows.device), n)
            logprobs, distributions = token_distributions(model, ids, attention, wanted, cfg.temperature, picked)
            if count == 0 and len(first):  # the weights are the batch's starting ones: these are its old log-probs
                old[idx.to(device)] = logprobs.detach()
                extra |= _behaviour_kl(old, batch)
            behaviour = batch["behaviour_logprobs"][idx] if "behaviour_logprobs" in batch else None
            loss, stats = policy_loss(
                logprobs, old[idx], advantages[idx], batch["loss_mask"][idx], clip_eps=cfg.clip_eps,
                loss_type=cfg.loss_type, max_length=cfg.max_length, behaviour_logprobs=behaviour,
                tis_cap=cfg.tis_cap, ref_logprobs=None if ref is None else ref[idx], beta=cfg.kl_beta)
            if exact:
                # under the student's token masks, where it sampled under any (constrained decoding)
                targets = teacher.distributions(ids, attention, wanted, **({"masks": picked} if picked else {}))
                # a teacher row with NaN or +inf gets no term (its token already left the loss mask, counted by
                # with_teacher): computed there at all, it would give NaN gradients even masked
                usable = ~(torch.isnan(targets) | (targets == torch.inf)).any(-1)
                divergence = torch.zeros(len(targets), dtype=distributions.dtype, device=distributions.device)
                divergence[usable] = exact_divergence(distributions[usable], targets[usable], exact)
                wanted[:, 0] = False  # as token_distributions reads it: a row's first token is never predicted
                per_token = torch.zeros(ids.shape, dtype=divergence.dtype,
                                        device=divergence.device).masked_scatter(wanted, divergence)
                term = aggregate(per_token, batch["loss_mask"][idx], cfg.loss_type, cfg.max_length)
                loss = loss + opd.kl_coef * term
                stats["teacher_divergence"] = term.item()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()
            stats |= {"loss": loss.item(), "grad_norm": grad_norm.item(), "grad_norm_max": grad_norm.item()}
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value
                if key in _MAXIMA:
                    maxima[key] = max(maxima.get(key, value), value)
            count += 1
    model.eval()
    if not len(first):
        extra |= _behaviour_kl(old, batch)
    # Maxima stay maxima: an average of per-minibatch maxima would hide the outlier they exist to show.
    return {key: value / count for key, value in totals.items()} | maxima | extra | {"updates": count}


def _behaviour_kl(old: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """How far the learner's policy has moved from the one that sampled (the cost of staleness), if known."""
    if "behaviour_logprobs" not in batch:
        return {}
    mask = batch["loss_mask"]
    return {"kl_behaviour": float((k3_kl(old, batch["behaviour_logprobs"]) * mask).sum() / mask.sum().clamp(min=1))}
