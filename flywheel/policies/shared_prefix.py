"""Attention over an opening every row of a batch shares (a tool-using agent's system prompt and tools), its keys
and values held once for the batch instead of once per row.

A decode step of a batch reads every row's cache whole: on a CPU, where that is bound by memory, a support-desk
batch of 64 rows (SmolLM2, bf16) spent about a third of each step in attention, reading 64 copies of the same
306-token opening. Here the opening's keys
and values are one row, which every query of the batch attends to in one pass (the batch folded into the query
rows), and each row's own cache holds only what follows it; the two attentions are joined by their
log-sum-exps, which is exactly softmax attention over both parts (up to rounding).

The model's attention is the one registered here (`use_shared_prefix`), which is transformers' SDPA wherever a
forward pass is not given `shared_prefix=` (training, scoring, a row alone): the model computes as before. CPU
only: it calls the CPU flash-attention kernel for the log-sum-exps (on a GPU, vLLM's prefix caching does this).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

NAME = "flywheel_shared_prefix"


@dataclass
class SharedPrefix:
    """The opening every row of a batch begins with: its token ids, and per layer its keys and values
    [1, kv_heads, len(ids), head_dim]. Rows' caches and positions follow it (a row's first own token is at
    position len(ids))."""

    ids: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    _additive: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.ids)

    def additive(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A boolean attention mask as the additive one the CPU kernel takes: made once per forward pass (every
        layer is given the same mask) and kept for the next layers."""
        made = self._additive
        if made is None or made[0] is not mask or made[1].dtype != dtype:
            made = (mask, torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf")))
            self._additive = made
        return made[1]

    def joined(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A row's own cache (per layer [kv_heads, n, head_dim]) with the opening before it: the row's whole cache."""
        return [(torch.cat([pk[0].to(k.dtype), k], dim=-2), torch.cat([pv[0].to(v.dtype), v], dim=-2))
                for (pk, pv), (k, v) in zip(self.layers, layers, strict=True)]


def use_shared_prefix(model) -> bool:
    """Make the model's attention the shared-prefix one (SDPA unless a forward pass is given a prefix); False where
    it cannot be (not on a CPU, or attention other than SDPA, which it would change)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if next(model.parameters()).device.type != "cpu" or not hasattr(model, "config"):
        return False
    if model.config._attn_implementation == NAME:
        return True
    if model.config._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(NAME, shared_prefix_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    try:
        model.set_attn_implementation(NAME)
    except (AttributeError, ValueError, TypeError):  # a wrapper without it, or a model that refuses the name
        return False
    return model.config._attn_implementation == NAME


def shared_prefix_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            shared_prefix: SharedPrefix | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of `query` [batch, heads, q, dim] over the shared opening and over each row's own keys and values
    ([batch, kv_heads, k, dim], masked by `attention_mask`): [batch, q, heads, dim], as SDPA's."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if shared_prefix is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    # the dtype SDPA would compute in: autocast's where it is on (the rotary embedding leaves the query in fp32)
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    prefix_keys, prefix_values = shared_prefix.layers[module.layer_idx]
    prefix_keys, prefix_values = prefix_keys.to(dtype), prefix_values.to(dtype)  # no copy where made in dtype
    # the opening: every query of the batch in one pass over its single copy, per key/value head
    folded = query.reshape(batch, kv_heads, group * q_len, dim).transpose(0, 1).reshape(1, kv_heads, -1, dim)
    opening, opening_lse = flash(folded, prefix_keys, prefix_values, scale=scaling)[:2]
    opening = opening.reshape(kv_heads, batch, group * q_len, dim).transpose(0, 1).reshape(batch, heads, q_len, dim)
    opening_lse = opening_lse.reshape(kv_heads, batch, group * q_len).transpose(0, 1).reshape(batch, heads, q_len)
    # the rows' own part, causal among the new tokens (the mask says so; without one, every key is visible to a
    # lone query, and new tokens see those before them)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = shared_prefix.additive(attention_mask, dtype)
    if q_len == 1:  # a decode step: each key/value head's queries as its query rows, no copy of the cache
        own, own_lse = flash(query.reshape(batch, kv_heads, group, dim), key, value, attn_mask=attention_mask,
                             scale=scaling)[:2]
        own, own_lse = own.reshape(batch, heads, 1, dim), own_lse.reshape(batch, heads, 1)
    else:
        own, own_lse = flash(query, repeat_kv(key, group), repeat_kv(value, group),
                             is_causal=attention_mask is None, attn_mask=attention_mask, scale=scaling)[:2]
    # softmax over both parts: the opening's share of the whole exp-sum is sigmoid(its lse - the row's), and the
    # result is the two parts' averages mixed by it (a row always attends to its own last token: own_lse is finite)
    share = torch.sigmoid(opening_lse - own_lse)[..., None]
    out = torch.lerp(own.float(), opening.float(), share)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None
