"""The hf policy's decode loop: a batch of rows read (each from where its kept cache ends), then one token a step,
each row leaving the batch when it ends; and the kept caches of finished rows, for the next turn to start from.

Layout of a batch: row i's kept cache (r_i tokens) right-aligned in the first R = max r columns, its unread rest
(m_i tokens) right-aligned in the next M = max m columns, the holes masked. Positions come from the mask, so every
row reads as it would alone: a kept key was rotated at its own position when it was made and keeps it. A column
no remaining row attends to is dropped from the cache (positions do not depend on columns).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from flywheel.policies.base import Sampling
from flywheel.policies.shared_prefix import NAME as SHARED_PREFIX_ATTENTION
from flywheel.policies.shared_prefix import SharedPrefix

# Dropping the columns no remaining row attends to copies the cache: only when at least this share of it goes.
COMPACT_SHARE = 0.125


@dataclass
class DecodeStats:
    """What the loop did, summed over calls: its work in rows x steps, and how much of the prompts it read."""

    calls: int = 0
    rows: int = 0
    steps: int = 0  # decode steps (one token for every row still in the batch)
    row_steps: int = 0  # sum over steps of the rows in the batch: the work done
    ridealong_row_steps: int = 0  # what it would be if every row rode along to its batch's longest
    read_tokens: int = 0  # prompt tokens read by a forward pass
    reused_tokens: int = 0  # prompt tokens taken from a kept cache (or from the batch's opening, read once)
    kept_rows: int = 0  # finished rows whose cache was kept
    prefix_rows: int = 0  # rows read after an opening held once for the batch (flywheel.policies.shared_prefix)


@dataclass
class Source:
    """One row to decode: its prompt, and the cache of its first `reuse` tokens (per layer keys, values
    [heads, reuse, head_dim]) where it has one."""

    ids: list[int]
    reuse: int = 0
    layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None


@dataclass
class Decoded:
    """One row's generated tokens, their logprobs under the distribution sampled, and the masks applied."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    masks: dict[int, np.ndarray] = field(default_factory=dict)


@dataclass
class Entry:
    """A finished row's cache: the tokens it read (prompt and generated, all but the last) and their keys/values."""

    ids: np.ndarray
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    nbytes: int
    used: int  # the call that made it or last read from it


class KeptCaches:
    """Finished rows' caches, for the next call's rows that begin with the same tokens.

    Kept until a call reads none of it (an episode that ended is not seen again), while the model's parameters
    are unchanged (a fingerprint of their version counters and storage: an optimiser step, load_state_dict or
    any in-place write moves it), and within `max_bytes` (between calls; a call's new entries beyond it are not
    kept and those rows are read again next time)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: list[Entry] = []
        self.call = 0
        self.fingerprint: tuple | None = None

    def start(self, model) -> None:
        """A new call: forget everything if the model's parameters changed since the last one."""
        self.call += 1
        fingerprint = tuple((p.data_ptr(), p._version) for p in model.parameters())
        if fingerprint != self.fingerprint:
            self.clear()
        self.fingerprint = fingerprint

    def clear(self) -> None:
        """Forget every kept cache (new weights: none of them is right any more)."""
        self.entries = []
        self.fingerprint = None

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def best(self, ids: list[int]) -> tuple[Entry | None, int]:
        """The kept entry sharing the longest opening with `ids`, and its length (at most len(ids) - 1: the last
        token is read to give the next token's logits)."""
        row = np.asarray(ids)
        best, best_n = None, 0
        for entry in self.entries:
            n = min(len(entry.ids), len(row) - 1)
            if n <= best_n:
                continue
            same = entry.ids[:n] == row[:n]
            common = n if same.all() else int(same.argmin())
            if common > best_n:
                best, best_n = entry, common
        if best is not None:
            best.used = self.call
        return best, best_n

    def add(self, ids: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Keep a finished row's cache, unless this call's new entries would pass max_bytes."""
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        fresh = sum(e.nbytes for e in self.entries if e.used == self.call)
        if fresh + nbytes > self.max_bytes:
            return False
        self.entries.append(Entry(np.asarray(ids), layers, nbytes, self.call))
        return True

    def finish(self) -> None:
        """End of a call: drop what it did not read, and what another entry holds whole (a row's last turn is the
        opening of its new one)."""
        kept = [e for e in self.entries if e.used == self.call]
        kept.sort(key=lambda e: -len(e.ids))
        self.entries = []
        for entry in kept:
            if not any(len(o.ids) >= len(entry.ids) and np.array_equal(o.ids[:len(entry.ids)], entry.ids)
                       for o in self.entries):
                self.entries.append(entry)
        while self.entries and self.nbytes > self.max_bytes:
            self.entries.pop()


def plain_cache(cache) -> bool:
    """Whether every layer of a cache holds all its tokens (no sliding window, no linear state): the kind whose
    columns the loop can move, drop and keep."""
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) in (DynamicLayer, GrowingLayer) for layer in cache.layers)


def plain_model(model) -> bool:
    """Whether the model's own cache would be plain (flywheel.policies.decoding.plain_cache)."""
    from transformers.cache_utils import DynamicCache

    return plain_cache(DynamicCache(config=model.config))


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views into buffers with room to grow: a decode step writes its
    token into the room where DynamicLayer concatenates, copying the whole cache every step (for SmolLM2 on a CPU
    about as long as the step's matmuls at a thousand tokens).

    Under autocast the buffers hold autocast's dtype (bf16), the dtype attention reads them in: autocast casts
    scaled_dot_product_attention's inputs, so a cache kept in the projections' fp32 (rotary embeddings promote
    the keys) was cast whole, every layer, every step, at twice the memory. Rounding once on the way in gives the
    same values attention read before."""

    def __init__(self, spare: int = 64, **kwargs):
        super().__init__(**kwargs)
        self.spare, self.room = spare, None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.keys.shape[-2] if self.keys.numel() else 0
        end = length + key_states.shape[-2]
        room = self.room
        start = self._start() if length else None
        if start is None or room[0].shape[0] != key_states.shape[0] or start + end > room[0].shape[-2]:
            # a fresh buffer: the first write, rows dropped or columns picked (a copy already), or the room used up
            shape = (*key_states.shape[:2], end + max(self.spare, end // 8), key_states.shape[-1])
            dtype = _stored_dtype(key_states)
            room, start = (key_states.new_empty(shape, dtype=dtype), value_states.new_empty(shape, dtype=dtype)), 0
            if length:
                room[0][:, :, :length], room[1][:, :, :length] = self.keys, self.values
            self.room = room
        room[0][:, :, start + length:start + end] = key_states
        room[1][:, :, start + length:start + end] = value_states
        self.keys, self.values = room[0][:, :, start:start + end], room[1][:, :, start:start + end]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep these rows: picked from the buffers whole (one copy, the room after the keys kept), where
        DynamicLayer's pick is copied again into a fresh buffer at the next write."""
        start = self._start() if self.keys.numel() else None
        if start is None:
            super().batch_select_indices(indices)
            return
        length = self.keys.shape[-2]
        self.room = (self.room[0].index_select(0, indices), self.room[1].index_select(0, indices))
        self.keys, self.values = (self.room[0][:, :, start:start + length], self.room[1][:, :, start:start + length])

    def widen(self, columns: int) -> None:
        """`columns` zero columns before the keys and values (a row longer than the cache is wide goes on in it):
        in the buffer's room before the keys where it has that much (no copy), else in a fresh buffer with room
        before them for as many again (conversations grow turn by turn) and after them."""
        rows, heads, length, dim = self.keys.shape
        start = self._start()
        if start is None or start < columns:
            ahead = max(columns, length // 4)
            start = ahead + columns
            shape = (rows, heads, start + length + max(self.spare, (columns + length) // 8), dim)
            self.room = (self.keys.new_empty(shape), self.values.new_empty(shape))
            self.room[0][:, :, start:start + length], self.room[1][:, :, start:start + length] = self.keys, self.values
        begin, end = start - columns, start + length
        for buffer in self.room:
            buffer[:, :, begin:start] = 0
        self.keys, self.values = self.room[0][:, :, begin:end], self.room[1][:, :, begin:end]

    def _start(self) -> int | None:
        """The buffer's column where the keys begin: 0, or further on where leading columns were dropped (a view
        still); None where the keys are not a view of the buffer (no buffer yet, rows or columns picked)."""
        return _column_in(self.room[0], self.keys) if self.room is not None else None

    def hold(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> GrowingLayer:
        """This layer with `keys` and `values` as its buffers, their first `length` columns its cache so far."""
        self.lazy_initialization(keys, values)
        self.room = (keys, values)
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]
        return self


def _column_in(buffer: torch.Tensor, view: torch.Tensor) -> int | None:
    """The column of `buffer` where `view` begins, where `view` is buffer's columns from there on (the same memory,
    rows and strides: what slicing off leading columns leaves); else None."""
    if (view.stride() != buffer.stride() or view.shape[:2] != buffer.shape[:2]
            or view.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()):
        return None
    column, rest = divmod(view.storage_offset() - buffer.storage_offset(), buffer.stride(2))
    return column if rest == 0 and column >= 0 else None


def _stored_dtype(states: torch.Tensor) -> torch.dtype:
    """The dtype a cache keeps its keys and values in: autocast's where it is on (attention casts them to it)."""
    kind = states.device.type
    if states.is_floating_point() and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return states.dtype


def decode(model, sources: list[Source], sampling: Sampling, eos: int, pad: int, constraints: list | None,
           stats: DecodeStats, keep=None, prefix: SharedPrefix | None = None) -> list[Decoded]:
    """Generate for every row until it writes `eos` or reaches sampling.max_new_tokens, a row leaving the batch
    when it ends. keep(row, ids, layers): called with each finished row's cache (the tokens it read and their
    keys/values, the shared prefix's included) where the cache is plain. prefix: the opening every row's ids
    follow, held once (flywheel.policies.shared_prefix). Sampling draws from torch's global generator (the caller
    seeds it)."""
    device = next(model.parameters()).device
    plain = plain_model(model)
    logits, cache, mask, position = prefill(model, sources, pad, device, stats, plain, sampling.max_new_tokens,
                                            prefix)
    shared = {"shared_prefix": prefix} if prefix is not None else {}
    results = [Decoded() for _ in sources]
    fed = [list(s.ids) for s in sources]  # what each row's cache holds, by its mask's columns
    active = list(range(len(sources)))
    stats.calls, stats.rows = stats.calls + 1, stats.rows + len(sources)
    steps = 0
    while active:
        steps += 1
        chosen, logprobs, masked = sample_step(logits, sampling, [constraints[r] for r in active]
                                               if constraints else None)
        stats.steps, stats.row_steps = stats.steps + 1, stats.row_steps + len(active)
        staying = []
        for slot, (row, token, logprob) in enumerate(zip(active, chosen.tolist(), logprobs.tolist(), strict=True)):
            result = results[row]
            if slot in masked:
                result.masks[len(result.token_ids)] = masked[slot]
            result.token_ids.append(token)
            result.logprobs.append(logprob)
            if constraints and constraints[row] is not None:
                constraints[row].accept(token)
            if token == eos or len(result.token_ids) >= sampling.max_new_tokens:
                if keep is not None and plain:
                    columns = mask[slot].bool()
                    layers = [(layer.keys[slot][:, columns], layer.values[slot][:, columns]) for layer in cache.layers]
                    if prefix is None:
                        keep(row, fed[row], layers)
                    else:
                        keep(row, prefix.ids + fed[row], prefix.joined(layers))
            else:
                staying.append(slot)
                fed[row].append(token)
        if not staying:
            break
        if len(staying) < len(active):
            index = torch.tensor(staying, device=device)
            cache.batch_select_indices(index)
            mask, position, chosen = mask[index], position[index], chosen[index]
            active = [active[s] for s in staying]
            if plain:
                mask = _compact(cache, mask)
        mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
        out = model(input_ids=chosen[:, None], attention_mask=attention_mask(model, mask, 1, plain),
                    position_ids=position[:, None], cache=cache, use_cache=True, **shared)
        logits, cache, position = out.logits[:, -1], out.cache, position + 1
    stats.ridealong_row_steps += steps * len(sources)
    return results


def sample_step(logits: torch.Tensor, sampling: Sampling, constraints: list | None
                ) -> tuple[torch.Tensor, torch.Tensor, dict[int, np.ndarray]]:
    """One token for each row of `logits` (constraints: each row's, or None): the tokens, their logprobs under the
    distribution sampled (temperature, the constraint's mask, top_p), and the masks applied by row."""
    scores = logits.float()
    if sampling.temperature > 0:
        scores = scores / sampling.temperature
    masked = _apply_constraints(scores, list(range(len(scores))), constraints) if constraints else {}
    if sampling.temperature > 0:
        if sampling.top_p < 1.0:
            scores = top_p(scores, sampling.top_p)
        chosen = draw(torch.softmax(scores, dim=-1))
    else:
        chosen = scores.argmax(dim=-1)
    logprobs = torch.log_softmax(scores, dim=-1).gather(1, chosen[:, None]).squeeze(1)
    return chosen, logprobs, masked


def prefill(model, sources: list[Source], pad: int, device, stats: DecodeStats, plain: bool, spare: int,
            prefix: SharedPrefix | None = None):
    """Read every row's unread rest over its kept cache (and the shared prefix, where given, which every row's ids
    follow): (last logits, cache, mask, next position per row)."""
    width_kept = max(s.reuse for s in sources)
    rests = [s.ids[s.reuse:] for s in sources]
    width_rest = max(len(r) for r in rests)
    mask = torch.zeros(len(sources), width_kept + width_rest, dtype=torch.long)
    ids = torch.full((len(sources), width_rest), pad, dtype=torch.long)
    for i, (source, rest) in enumerate(zip(sources, rests, strict=True)):
        mask[i, width_kept - source.reuse:width_kept] = 1
        mask[i, mask.shape[1] - len(rest):] = 1
        ids[i, width_rest - len(rest):] = torch.tensor(rest)
    stats.read_tokens += sum(len(r) for r in rests)
    stats.reused_tokens += sum(s.reuse for s in sources) + (len(prefix) * len(sources) if prefix is not None else 0)
    if plain:
        cache = DynamicCache()
        cache.layer_class_to_replicate = functools.partial(GrowingLayer, spare=spare)
        if width_kept:  # with room for the rest, read next
            cache.layers.extend(_kept_layers(sources, width_kept, width_rest + spare))
    else:  # sliding-window or linear layers: the model's own cache (and no kept caches: width_kept is 0)
        cache = DynamicCache(config=model.config)
    mask = mask.to(device)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)[:, width_kept:]
    shared = {}
    if prefix is not None:
        positions, shared = positions + len(prefix), {"shared_prefix": prefix}
        stats.prefix_rows += len(sources)
    out = model(input_ids=ids.to(device), attention_mask=attention_mask(model, mask, width_rest, plain),
                position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1, **shared)
    return out.logits[:, -1], out.cache, mask, positions[:, -1] + 1


def attention_mask(model, mask: torch.Tensor, new: int, plain: bool) -> torch.Tensor:
    """The attention mask a forward pass over each row's last `new` columns is given. `mask` [rows, columns] is 1
    where a row has a token; where the model attends with SDPA over a plain cache it is made here the 4-D boolean
    mask SDPA takes ([rows, 1, new, columns], the new tokens causal among themselves), which transformers passes
    on as it is; elsewhere (a sliding window, another kernel) `mask` itself, for transformers to make the model's
    own. transformers' create_causal_mask made the same mask in ~12% of the tiny student's decode step."""
    if not plain or getattr(model.config, "_attn_implementation", None) not in ("sdpa", SHARED_PREFIX_ATTENTION):
        return mask
    rows = mask.bool()[:, None, None, :]
    if new == 1:
        return rows
    columns = torch.arange(mask.shape[1], device=mask.device)
    return rows & (columns[None, :] <= columns[-new:, None])


def _kept_layers(sources: list[Source], width: int, room: int) -> list[GrowingLayer]:
    """The rows' kept caches side by side, each right-aligned in the first `width` columns (zeros where a row has
    none), in buffers with `room` columns after them."""
    some = next(s.layers for s in sources if s.reuse)
    layers = []
    for n, (k0, v0) in enumerate(some):
        dtype = _stored_dtype(k0)
        keys = k0.new_empty((len(sources), k0.shape[-3], width + room, k0.shape[-1]), dtype=dtype)
        values = v0.new_empty((len(sources), v0.shape[-3], width + room, v0.shape[-1]), dtype=dtype)
        for i, source in enumerate(sources):
            hole = width - source.reuse
            keys[i, :, :hole], values[i, :, :hole] = 0, 0
            if source.reuse:
                k, v = source.layers[n]
                keys[i, :, hole:width] = k[..., :source.reuse, :]
                values[i, :, hole:width] = v[..., :source.reuse, :]
        layers.append(GrowingLayer(spare=room).hold(keys, values, width))
    return layers


def _compact(cache, mask: torch.Tensor) -> torch.Tensor:
    """Drop the columns no row attends to any more (a row that left was the only one to use them)."""
    used = mask.bool().any(dim=0)
    if (~used).sum() < COMPACT_SHARE * mask.shape[1]:
        return mask
    columns = used.nonzero().squeeze(1)
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, columns], layer.values[:, :, columns]
    return mask[:, columns]


def _apply_constraints(scores: torch.Tensor, active: list[int], constraints: list) -> dict[int, np.ndarray]:
    """-inf on every token a row's constraint disallows now; the masks applied, packed, by batch slot."""
    masked = {}
    width = scores.shape[1]
    for slot, row in enumerate(active):
        constraint = constraints[row]
        allowed = constraint.allowed() if constraint is not None else None
        if allowed is None:
            continue
        allowed = allowed.to(device=scores.device, dtype=torch.bool)
        if allowed.shape[0] < width:  # the logits may be wider than the tokenizer's vocabulary
            allowed = torch.cat([allowed, allowed.new_zeros(width - allowed.shape[0])])
        if not allowed.any():
            raise RuntimeError(f"a tool-call constraint allowed no token at all (row {row}): a bug in "
                               "flywheel.policies.constrained, not in the model")
        scores[slot] = scores[slot].masked_fill(~allowed, float("-inf"))
        masked[slot] = np.packbits(allowed.cpu().numpy())
    return masked


def draw(probs: torch.Tensor) -> torch.Tensor:
    """One token for each row of `probs` [rows, vocab] from its inverse CDF: one uniform number a row from torch's
    global generator. torch.multinomial draws an exponential for every entry of the vocabulary: on this 2-core CPU
    67 ms for 64 rows of SmolLM2's 49,152 (a third of a bf16 decode step), against 1.4 ms here. The cumulative sum
    is accumulated in double on a CPU, so each token's chance is its probability to ~6e-8; a token of probability
    0 (masked) is never drawn."""
    cumulative = probs.cumsum(dim=-1)
    total = cumulative[:, -1:]
    if not torch.isfinite(total).all():
        raise RuntimeError("sampling from probabilities that are not finite (NaN or inf in the logits)")
    # below the total (and so below the last token of nonzero probability), however the product rounds
    u = torch.minimum(torch.rand(total.shape, dtype=probs.dtype, device=probs.device) * total,
                      torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, u, right=True).squeeze(1)


def top_p(scores: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering as transformers' TopPLogitsWarper does it: the least likely tokens whose mass is at most
    1 - p set to -inf, the most likely one always kept."""
    ordered, order = torch.sort(scores, descending=False)
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - p)
    remove[..., -1:] = False
    return scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))
