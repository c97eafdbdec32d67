"""Scored episodes to training tensors: group advantages, token ids with assistant masks, padded batches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flywheel.agent import Episode
from flywheel.train.checkpoint import encode_conversation
from flywheel.train.rl.advantages import AdvantageKind, group_advantages


@dataclass
class Group:
    """The G episodes of one task in one step, and their advantages (None: equal rewards, no signal)."""

    index: int
    episodes: list[Episode]
    advantages: list[float] | None

    @property
    def skipped(self) -> bool:
        return self.advantages is None


@dataclass
class Sample:
    """One episode as the learner sees it; behaviour_logprobs are the actor's, if known."""

    input_ids: list[int]
    loss_mask: list[int]
    advantage: float
    behaviour_logprobs: list[float] | None = None


def make_groups(episodes: Sequence[Episode], group_size: int, kind: AdvantageKind) -> list[Group]:
    """Split run_episodes' output (task-major, `group_size` samples per task) into scored groups."""
    if len(episodes) % group_size:
        raise ValueError(f"{len(episodes)} episodes do not split into groups of {group_size}")
    groups = []
    for index, start in enumerate(range(0, len(episodes), group_size)):
        members = list(episodes[start:start + group_size])
        if len({e.task.task_id for e in members}) != 1:
            raise ValueError(f"group {index} mixes tasks: run_episodes must return a task's samples together")
        groups.append(Group(index, members, group_advantages([e.reward for e in members], kind)))
    return groups


def encode_groups(groups: Sequence[Group], tokenizer, tools: list[dict],
                  max_length: int) -> tuple[list[Sample], dict[tuple[int, int], int]]:
    """Samples of the groups that carry a signal, and each episode's assistant tokens by (group, sample)."""
    samples, tokens = [], {}
    for group in groups:
        for i, episode in enumerate(group.episodes):
            input_ids, mask = encode_conversation(tokenizer, episode.messages, tools, max_length)
            tokens[(group.index, episode.sample)] = int(sum(mask))
            if not group.skipped:
                samples.append(Sample(input_ids, mask, group.advantages[i]))
    return samples, tokens


def collate(samples: Sequence[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask, loss_mask [B, T], advantages [B] (+ behaviour_logprobs)."""
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
    return batch

