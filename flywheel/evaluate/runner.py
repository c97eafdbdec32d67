"""Run a checkpoint on held-out tasks through the one harness; check that no held-out prompt was trained on."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from flywheel.agent import run_episodes
from flywheel.contract import Environment, Task, conversation_hash, prompt_hash
from flywheel.policies.base import Sampling


class ContaminationError(RuntimeError):
    """Held-out prompts appear in training data: the eval would flatter the model, so it refuses to run."""


def evaluate_model(model_dir: Path, env: Environment, tasks: list[Task], label: str, *, max_turns: int,
                   tool_timeout_s: float, batch_size: int, samples: int = 0, temperature: float = 1.0,
                   seed: int = 0, device: str = "auto", chat_template: str | None = None) -> list[dict]:
    """Rows of the eval table: a greedy episode per task (sample 0), then `samples` seeded sampled ones (1..k).

    device: student.device (auto: a CUDA GPU when one is visible, else the CPU); chat_template: rendered with in
    place of the checkpoint's own (a base judged in its trained versions' format).
    """
    from flywheel.policies.hf import HFPolicy

    policy = HFPolicy(model_dir, batch_size=batch_size, device=device)
    if chat_template:
        policy.tokenizer.chat_template = chat_template
    episodes = run_episodes(env, policy, tasks, samples=1, sampling=Sampling(temperature=0.0),
                            max_turns=max_turns, tool_timeout_s=tool_timeout_s)
    if samples:
        sampled = run_episodes(env, policy, tasks, samples=samples,
                               sampling=Sampling(temperature=temperature, seed=seed),
                               max_turns=max_turns, tool_timeout_s=tool_timeout_s)
        for episode in sampled:
            episode.sample += 1
        episodes += sampled
    return [{"model": label, "task_id": e.task.task_id, "sample": e.sample, "reward": e.reward,
             "passed": e.passed, "slice": e.task.slice, "tokens": sum(_tokens(c) for c in e.completions),
             "latency_s": float(sum(c.latency_s for c in e.completions))} for e in episodes]


def _tokens(completion) -> int:
    if completion.token_ids is not None:
        return len(completion.token_ids)
    return int(completion.usage.get("completion_tokens", 0))


def check_contamination(heldout: list[Task], training: dict[str, Iterable[str]]) -> None:
    """Raise ContaminationError naming the held-out ids whose prompt hash appears in any training set."""
    by_hash = {prompt_hash(t.prompt): t.task_id for t in heldout}
    hits = []
    for name, hashes in training.items():
        found = sorted({by_hash[h] for h in hashes if h in by_hash})
        if found:
            hits.append(f"{name}: {len(found)} held-out task(s), e.g. {', '.join(found[:5])}")
    if hits:
        raise ContaminationError("held-out prompts found in training data; refusing to evaluate: " + "; ".join(hits))


def synthetic_prompt_hashes(messages_json: Iterable[str]) -> list[str]:
    """The prompt hash of each conversation (JSON text) of a synthetic table, for check_contamination."""
    return [conversation_hash(json.loads(m)) for m in messages_json]
