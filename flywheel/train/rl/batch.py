"""Scored episodes to training tensors: encoded rollouts with behaviour logprobs, groups, padded batches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from flywheel.agent import Episode
from flywheel.train.encoding import encode_conversation
from flywheel.train.rl.advantages import group_advantages
from flywheel.train.rl.loss import MASK_KEYS


@dataclass
class Segment:
    """Token ids with a loss mask (1: generated assistant tokens) and the behaviour logprobs aligned to them; with
    constrained decoding, the masks too: position in input_ids -> the packed allowed tokens it was sampled from
    (the same arrays as the completions', so they cross to the learner as packed bits, only where masked)."""

    input_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]
    masks: dict[int, np.ndarray] | None = None


@dataclass
class Rollout:
    """One episode as it travels from an actor to the learner: its training segments and its score.

    Usually one segment, the whole conversation as the chat template encodes it. When the template does not
    re-tokenise the episode into the tokens that were generated (a malformed tool call re-rendered, a BPE
    merge across a turn boundary), each turn becomes its own segment, its prompt exactly as the policy saw it
    plus the ids it generated (`split`): the behaviour logprobs are never misaligned.
    """

    task_id: str
    sample: int
    reward: float
    passed: bool
    segments: list[Segment]
    split: bool = False
    episode: Episode | None = None  # the episode itself (tracing.lean), kept for an MLflow trace (rl.trace_rollouts)

    @property
    def tokens(self) -> int:
        """Assistant tokens the loss sees."""
        return sum(sum(s.loss_mask) for s in self.segments)


@dataclass
class Group:
    """The G rollouts of one task, made for learner step `step` by policy version `behaviour_version`."""

    step: int
    index: int  # the task's position among the step's tasks
    behaviour_version: int
    rollouts: list[Rollout]
    actor: int = 0  # -1: generated in the learner's own process
    generate_s: float = 0.0  # the actor's generation time, this group's share
    idle_s: float = 0.0  # the actor's waiting time (for weights, for buffer room), this group's share
    # An actor process's environment counts (tool errors, timeouts, ...) since its last group: the stage logs
    # the counters of its own environment object, which an actor's copy never touches.
    env_counts: dict[str, int] | None = None


@dataclass
class Sample:
    """One rollout as the learner trains on it."""

    input_ids: list[int]
    loss_mask: list[int]
    advantage: float
    behaviour_logprobs: list[float] | None = None
    masks: dict[int, np.ndarray] | None = None  # position -> packed allowed tokens (Segment.masks)


def _assistant_runs(mask: Sequence[int]) -> list[tuple[int, int]]:
    """(start, end) of each contiguous run of assistant tokens: one per assistant turn."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _shifted(masks: dict[int, np.ndarray] | None, offset: int, n: int) -> dict[int, np.ndarray]:
    """A turn's masks (keyed by position in its token_ids) of its first n tokens, keyed by position + offset."""
    return {offset + i: bits for i, bits in (masks or {}).items() if i < n}


def align_behaviour(episode: Episode, input_ids: list[int], mask: list[int], eos_id: int,
                    max_length: int) -> tuple[list[int], list[float], dict[int, np.ndarray]] | None:
    """(loss mask, behaviour logprobs, token masks) aligned with input_ids, or None when the tokens differ from
    the generated.

    Each assistant run of the encoding must hold its turn's generated ids. A turn cut off at max_new_tokens
    renders with an end token the policy never sampled: that token leaves the loss mask (no behaviour logprob).
    A conversation cut at max_length keeps the turns (and the part of a turn) that fit.
    """
    turns = episode.completions
    runs = _assistant_runs(mask)
    cut = len(input_ids) >= max_length  # encode_conversation cut the conversation here
    if len(runs) > len(turns) or (len(runs) < len(turns) and not cut):
        return None
    mask, behaviour, masks = list(mask), [0.0] * len(input_ids), {}
    for (start, end), turn in zip(runs, turns, strict=False):
        span, ids = input_ids[start:end], turn.token_ids
        if span == ids or (cut and end == len(input_ids) and ids[:len(span)] == span):
            n = len(span)
        elif span[:len(ids)] == ids and (not ids or ids[-1] != eos_id):
            n = len(ids)
            mask[start + n:end] = [0] * (end - start - n)
        else:
            return None
        behaviour[start:start + n] = turn.logprobs[:n]
        masks |= _shifted(turn.masks, start, n)
    return mask, behaviour, masks


def turn_segments(episode: Episode, tokenizer, tools: list[dict], max_length: int) -> list[Segment]:
    """Each assistant turn as a segment: the prompt as the policy saw it, then the ids it generated."""
    from flywheel.policies.toolcalls import canonical_messages

    starts = [i for i, m in enumerate(episode.messages)
              if i >= len(episode.task.prompt) and m["role"] == "assistant"]
    if len(starts) != len(episode.completions):
        raise ValueError(f"task {episode.task.task_id}: {len(episode.completions)} turns generated but "
                         f"{len(starts)} assistant messages in the episode")
    segments = []
    for start, turn in zip(starts, episode.completions, strict=True):
        prompt = tokenizer.apply_chat_template(canonical_messages(episode.messages[:start]), tools=tools or None,
                                               add_generation_prompt=True, tokenize=True, return_dict=True)
        prompt_ids = list(prompt["input_ids"])
        ids = (prompt_ids + list(turn.token_ids))[:max_length]
        n = len(ids) - len(prompt_ids)
        if n > 0:
            segments.append(Segment(ids, [0] * len(prompt_ids) + [1] * n,
                                    [0.0] * len(prompt_ids) + list(turn.logprobs[:n]),
                                    _shifted(turn.masks, len(prompt_ids), n) or None))
    return segments


def check_masks(episode: Episode) -> None:
    """ValueError unless every token sampled under a mask is one its mask allowed (else its log-probability
    under that mask is -inf: the policy's masks and token ids disagree)."""
    for turn, completion in enumerate(episode.completions):
        for i, bits in (completion.masks or {}).items():
            token = completion.token_ids[i] if 0 <= i < len(completion.token_ids) else None
            if token is None or token >= 8 * len(bits) or not (bits[token >> 3] >> (7 - (token & 7))) & 1:
                raise ValueError(f"task {episode.task.task_id}, turn {turn}: position {i} has a token mask, but "
                                 f"{'no token' if token is None else f'token {token} is not allowed by it'}: the "
                                 "policy's Completion.masks do not match its token_ids")


def encode_episode(episode: Episode, tokenizer, tools: list[dict], max_length: int) -> Rollout:
    """The episode as the learner sees it: segments of tokens, assistant masks and behaviour logprobs."""
    if any(c.token_ids is None or c.logprobs is None for c in episode.completions):
        raise ValueError(f"task {episode.task.task_id}: the policy returned no token ids or logprobs; RL needs "
                         "a backend that has them (hf, vllm)")
    check_masks(episode)
    input_ids, mask = encode_conversation(tokenizer, episode.messages, tools, max_length)
    aligned = align_behaviour(episode, input_ids, mask, tokenizer.eos_token_id, max_length)
    if aligned is not None:
        loss_mask, behaviour, masks = aligned
        segments, split = [Segment(input_ids, loss_mask, behaviour, masks or None)], False
    else:
        segments, split = turn_segments(episode, tokenizer, tools, max_length), True
    return Rollout(episode.task.task_id, episode.sample, float(episode.reward), bool(episode.passed), segments,
                   split)


def make_groups(episodes: Sequence[Episode], group_size: int, tokenizer, tools: list[dict], max_length: int,
                step: int, version: int) -> list[Group]:
    """Split Harness.run's output (task-major, `group_size` samples per task) into encoded groups.

    An episode whose simulated user failed (Episode.scored false) is left out of its group: its reward says
    nothing about the policy; a group with none left is no group."""
    if len(episodes) % group_size:
        raise ValueError(f"{len(episodes)} episodes do not split into groups of {group_size}")
    groups = []
    for index, start in enumerate(range(0, len(episodes), group_size)):
        members = list(episodes[start:start + group_size])
        if len({e.task.task_id for e in members}) != 1:
            raise ValueError(f"group {index} mixes tasks: Harness.run must return a task's samples together")
        scored = [e for e in members if e.scored]
        if scored:
            groups.append(Group(step, index, version,
                                [encode_episode(e, tokenizer, tools, max_length) for e in scored]))
    return groups


def advantages_of(group: Group, loss_type: str) -> list[float] | None:
    """The group's advantages (None: equal rewards, no signal); dr_grpo does not divide by the std."""
    return group_advantages([r.reward for r in group.rollouts], "dr_grpo" if loss_type == "dr_grpo" else "grpo")


def samples_of(group: Group, advantages: list[float]) -> list[Sample]:
    """The group's training samples: one per segment, each with its rollout's advantage."""
    return [Sample(seg.input_ids, seg.loss_mask, a, seg.behaviour_logprobs, seg.masks)
            for r, a in zip(group.rollouts, advantages, strict=True) for seg in r.segments]


def collate(samples: Sequence[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask, loss_mask [B, T], advantages [B] (+ behaviour_logprobs; + the
    token masks, flywheel.train.rl.loss.TokenMasks, when any token was sampled under one)."""
    if not samples:
        raise ValueError("no samples to collate")
    width = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(samples), width), dtype=torch.float32)
    for row, sample in enumerate(samples):
        n = len(sample.input_ids)
        # Right padding: with causal attention the pads come after every real token and change none of them.
        ids[row, :n] = torch.tensor(sample.input_ids)
        attention[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(sample.loss_mask, dtype=torch.float32)
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask,
             "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32)}
    if all(s.behaviour_logprobs is not None for s in samples):
        behaviour = torch.zeros((len(samples), width), dtype=torch.float32)
        for row, sample in enumerate(samples):
            behaviour[row, :len(sample.behaviour_logprobs)] = torch.tensor(sample.behaviour_logprobs)
        batch["behaviour_logprobs"] = behaviour
    return batch | _collated_masks(samples)


def _collated_masks(samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
    """The samples' token masks as TokenMasks' three tensors (row, position, packed bits), or none."""
    entries = [(row, position, bits) for row, sample in enumerate(samples)
               for position, bits in sorted((sample.masks or {}).items())]
    if not entries:
        return {}
    if len({len(bits) for _, _, bits in entries}) > 1:
        raise ValueError(f"token masks of {sorted({len(b) for _, _, b in entries})} bytes in one batch: every mask "
                         "must cover the same vocabulary (the logits' width)")
    rows, positions, bits = zip(*entries, strict=True)
    return dict(zip(MASK_KEYS, (torch.tensor(rows, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                                torch.from_numpy(np.stack([np.asarray(b, dtype=np.uint8) for b in bits]))),
                    strict=True))
