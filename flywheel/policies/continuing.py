"""Whole episodes in one batch: a row whose turn ends is handed back (the harness runs its tool calls or lets the
user speak) and goes on in the same batch, reading only the tokens its cache does not hold; a row whose episode
ended leaves, and a waiting conversation takes its slot. A batch's sequential forward passes are then about those
of its longest episode, where turn by turn they are the sum over turns of each turn's longest row.

Layout: `slots` rows, each row's tokens right-aligned in the cache's columns and ending at the last one (as in
flywheel.policies.decoding, positions come from the mask, so where a row's columns lie does not matter). A step
samples every live row; then one forward pass gives the rows still in their turn their next token, and the rows
that go on (a new turn, or a conversation taking a free slot) are read apart (decoding.prefill, from the keys and
values their slot holds) and written back into their slot, ending at the same last column.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flywheel.policies.base import Sampling
from flywheel.policies.decoding import COMPACT_SHARE, Decoded, DecodeStats, Source, attention_mask, prefill, sample_step
from flywheel.policies.shared_prefix import SharedPrefix

# Rows are moved together (a copy of the live ones) once at most this share of the slots is live and nothing waits.
COMPACT_SLOTS = 0.5


@dataclass
class Next:
    """A row's next turn: the whole conversation's token ids as it now reads, the most tokens the turn may take
    (the rest of its episode's budget) and its tool-call constraint."""

    ids: list[int]
    max_new_tokens: int
    constraint: object | None = None


@dataclass
class _Row:
    key: int  # the conversation's index in the call
    fed: list[int]  # the tokens the slot's cache holds, in column order
    constraint: object | None
    result: Decoded
    cap: int  # the most tokens this turn may take


def decode_episodes(model, first: list[Source], constraints: list | None, sampling: Sampling, eos: int, pad: int,
                    stats: DecodeStats, ended: Callable[[int, Decoded], Next | None],
                    waiting: deque[tuple[int, Source, object | None]], prefix: SharedPrefix | None = None,
                    keys: list[int] | None = None, caps: list[int] | None = None) -> None:
    """Decode `first` (keys 0..n-1 and a turn's tokens up to sampling.max_new_tokens, unless `keys` and `caps`
    say; one slot each) and the conversations `waiting` holds (key,
    source, constraint), each taking a slot as one frees, until none is left: ended(key, decoded) is called at the
    end of each turn and says how the row goes on (None: its episode is over and its slot is free). prefix: the
    opening every source's ids follow, held once (flywheel.policies.shared_prefix); a turn whose conversation no
    longer begins with it goes on after the others, in a batch of its own kind. Sampling draws from torch's
    global generator (the caller seeds it)."""
    device = next(model.parameters()).device
    logits, cache, mask, position = prefill(model, first, pad, device, stats, True, sampling.max_new_tokens, prefix)
    shared = {"shared_prefix": prefix} if prefix is not None else {}
    keys = keys if keys is not None else list(range(len(first)))
    caps = caps if caps is not None else [sampling.max_new_tokens] * len(first)
    rows: list[_Row | None] = [_Row(keys[i], list(s.ids), constraints[i] if constraints else None, Decoded(),
                                    min(caps[i], sampling.max_new_tokens)) for i, s in enumerate(first)]
    apart: list[tuple[int, Source, object | None, int]] = []  # turns that no longer begin with the prefix
    stats.calls, stats.rows = stats.calls + 1, stats.rows + len(first)
    while any(r is not None for r in rows):
        live = [slot for slot, r in enumerate(rows) if r is not None]
        constraints = [rows[s].constraint for s in live]
        picked, logprobs, masked = sample_step(logits[live], sampling,
                                               constraints if any(c is not None for c in constraints) else None)
        stats.steps, stats.row_steps = stats.steps + 1, stats.row_steps + len(live)
        going_on: list[tuple[int, Source]] = []  # (slot, what its row reads next)
        chosen = torch.full((len(rows),), pad, dtype=torch.long, device=device)
        stepping = torch.zeros(len(rows), dtype=torch.bool)
        for i, (slot, token, logprob) in enumerate(zip(live, picked.tolist(), logprobs.tolist(), strict=True)):
            row = rows[slot]
            if i in masked:
                row.result.masks[len(row.result.token_ids)] = masked[i]
            row.result.token_ids.append(token)
            row.result.logprobs.append(logprob)
            if row.constraint is not None:
                row.constraint.accept(token)
            if token != eos and len(row.result.token_ids) < row.cap:
                row.fed.append(token)
                chosen[slot], stepping[slot] = token, True
                continue
            nxt = ended(row.key, row.result)
            ids = nxt.ids if nxt is not None else None
            if prefix is not None and nxt is not None:
                if nxt.ids[:len(prefix)] == prefix.ids:
                    ids = nxt.ids[len(prefix):]
                else:  # not seen with a template that renders a conversation's opening as it is
                    apart.append((row.key, Source(list(nxt.ids)), nxt.constraint, nxt.max_new_tokens))
                    nxt = None
            if nxt is None:
                rows[slot] = None
                mask[slot] = 0
                continue
            going_on.append((slot, _source_in_slot(cache, mask, slot, row.fed, ids)))
            rows[slot] = _Row(row.key, list(ids), nxt.constraint, Decoded(),
                              min(nxt.max_new_tokens, sampling.max_new_tokens))
        while None in rows and waiting:  # free slots to waiting conversations
            key, source, constraint = waiting.popleft()
            slot = rows.index(None)
            rows[slot] = _Row(key, list(source.ids), constraint, Decoded(), sampling.max_new_tokens)
            going_on.append((slot, source))
            stats.rows += 1
        if not any(r is not None for r in rows):
            break
        # one step for every slot: the rows in their turn read their token; the others a masked pad (a free slot,
        # or one just taken by a waiting conversation, attends to its pad alone, so that no row is all masked)
        free = torch.tensor([r is None for r in rows]) | (mask.sum(dim=1) == 0).cpu()
        mask = torch.cat([mask, (stepping | free).to(mask.dtype)[:, None].to(mask.device)], dim=1)
        out = model(input_ids=chosen[:, None], attention_mask=attention_mask(model, mask, 1, True),
                    position_ids=position[:, None], cache=cache, use_cache=True, **shared)
        logits, cache = out.logits[:, -1], out.cache
        position = torch.where(stepping.to(position.device), position + 1, position)
        if going_on:
            logits, mask, position = _read_into_slots(model, cache, mask, position, logits, going_on, pad, device,
                                                      stats, sampling.max_new_tokens, prefix)
        if not waiting and sum(r is not None for r in rows) <= COMPACT_SLOTS * len(rows):
            keep = [slot for slot, r in enumerate(rows) if r is not None]
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            mask, position, logits = mask[index], position[index], logits[index]
            rows = [rows[s] for s in keep]
        mask = _trim(cache, mask)
    slots = len(first)
    for start in range(0, len(apart), slots):  # their own batches, every row read whole
        chunk = apart[start:start + slots]
        decode_episodes(model, [source for _, source, _, _ in chunk], [c for _, _, c, _ in chunk], sampling, eos,
                        pad, stats, ended, deque(), keys=[key for key, _, _, _ in chunk],
                        caps=[cap for _, _, _, cap in chunk])


def _trim(cache, mask: torch.Tensor) -> torch.Tensor:
    """Drop the leading columns no slot attends to (rows end at the last column, so the unused ones lead)."""
    used = mask.bool().any(dim=0)
    first = int(used.nonzero()[0]) if used.any() else 0
    if first < COMPACT_SHARE * mask.shape[1]:
        return mask
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
    return mask[:, first:]


def _source_in_slot(cache, mask: torch.Tensor, slot: int, fed: list[int], ids: list[int]) -> Source:
    """A row going on to `ids`: the cache its slot holds of the opening `ids` shares with what it read."""
    common = 0
    limit = min(len(fed), len(ids) - 1)
    while common < limit and fed[common] == ids[common]:
        common += 1
    columns = mask[slot].bool().nonzero().squeeze(1)[:common]
    layers = [(layer.keys[slot][:, columns], layer.values[slot][:, columns]) for layer in cache.layers]
    return Source(list(ids), common, layers if common else None)


def _read_into_slots(model, cache, mask, position, logits, going_on, pad, device, stats, spare, prefix):
    """Read the going-on rows apart (their kept part from their slot) and write each back into its slot, ending
    at the cache's last column, growing the cache on the left where a row is longer than it is wide."""
    sources = [source for _, source in going_on]
    row_logits, row_cache, row_mask, row_position = prefill(model, sources, pad, device, stats, True, spare, prefix)
    width = mask.shape[1]
    need = int(row_mask.sum(dim=1).max())
    if need > width:
        grow = need - width + max(16, need // 4)
        for layer in cache.layers:
            layer.widen(grow)
        mask = torch.cat([mask.new_zeros((mask.shape[0], grow)), mask], dim=1)
        width += grow
    logits = logits.clone()
    for i, (slot, _) in enumerate(going_on):
        columns = row_mask[i].bool().nonzero().squeeze(1)
        n = len(columns)
        mask[slot] = 0
        mask[slot, width - n:] = 1
        for layer, made in zip(cache.layers, row_cache.layers, strict=True):
            layer.keys[slot, :, width - n:] = made.keys[i][:, columns]
            layer.values[slot, :, width - n:] = made.values[i][:, columns]
        logits[slot] = row_logits[i]
        position[slot] = row_position[i]
    return logits, mask, position
