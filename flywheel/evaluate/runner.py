"""Run a policy on held-out tasks through the one harness; check that no held-out prompt was trained on."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from flywheel.agent import Episode, Harness
from flywheel.contract import Task, conversation_hash, prompt_hash
from flywheel.errors import UserFacingError
from flywheel.policies.base import Policy, Sampling

PROGRESS_EVERY_S = 30.0  # how often evaluate says, per model, how many of its episodes are done


class ContaminationError(UserFacingError, RuntimeError):
    """Held-out prompts appear in training data: the eval would flatter the model, so it refuses to run."""


class NoHeldoutError(UserFacingError, ValueError):
    """A pipeline whose tasks hold none in the held-out split: there is nothing to evaluate on."""


def require_heldout(pipeline: str, split: Iterable[str], path: Path) -> None:
    """Raise NoHeldoutError naming the pipeline and why when no task is held out (before any model is loaded)."""
    splits = list(split)
    if "heldout" not in splits:
        raise NoHeldoutError(f"pipeline '{pipeline}' has no held-out tasks to evaluate on: {path} holds "
                             f"{len(splits)} task(s), none in split 'heldout'; raise environment.heldout_tasks or "
                             "collect.heldout_fraction in pipelines.yaml and run collect again")


@dataclass
class Scored:
    """One policy's rows of the eval table, and what was left out of them."""

    rows: list[dict]
    episodes: list[Episode] = field(default_factory=list)  # the rows' episodes, in order (their MLflow traces)
    user_errors: int = 0  # episodes whose simulated user failed: they say nothing about the policy
    unanswered: int = 0  # tasks the policy never answered (an endpoint that failed past its retries)
    failure: str = ""  # why, for the unanswered ones


def evaluate_policy(policy: Policy, harness: Harness, tasks: list[Task], label: str, *, samples: int = 0,
                    temperature: float = 1.0, seed: int = 0, prices: tuple[float, float] = (0.0, 0.0),
                    chunk: int | None = None, failures: tuple[type[BaseException], ...] = ()) -> Scored:
    """Rows of the eval table: a greedy episode per task (sample 0), then `samples` seeded sampled ones (1..k).

    prices: USD per million prompt and completion tokens (the cost_usd column). Tasks run `chunk` at a time
    (default: all together); a chunk whose policy raised one of `failures` (an endpoint down past its retries) is
    counted unanswered and the rest go on. Episodes of a failed simulated user are left out and counted.
    """
    scored = Scored([])
    step = chunk or max(len(tasks), 1)
    with Progress(label, len(tasks) * (1 + samples)) as done:
        for start in range(0, len(tasks), step):
            _run_part(policy, harness, tasks[start:start + step], label, samples, temperature, seed, prices, failures,
                      scored, done)
    return scored


def _run_part(policy: Policy, harness: Harness, part: list[Task], label: str, samples: int, temperature: float,
              seed: int, prices: tuple[float, float], failures: tuple, scored: Scored, done: Progress) -> None:
    """One chunk of tasks: its greedy episodes, then its sampled ones, into `scored`."""
    try:
        episodes = harness.run(policy, part, samples=1, sampling=Sampling(temperature=0.0), on_done=done)
        if samples:
            sampled = harness.run(policy, part, samples=samples, on_done=done,
                                  sampling=Sampling(temperature=temperature, seed=seed))
            for episode in sampled:
                episode.sample += 1
            episodes += sampled
    except failures as err:
        scored.unanswered += len(part)
        scored.failure = f"{type(err).__name__}: {err}"
        return
    scored.user_errors += sum(not e.scored for e in episodes)
    scored.rows += [_row(label, e, prices) for e in episodes if e.scored]
    scored.episodes += [e for e in episodes if e.scored]


class Progress:
    """Says on the console, every PROGRESS_EVERY_S while a model's episodes run, how many of them are done."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.done = label, total, 0
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._say, daemon=True)

    def __call__(self, episode: Episode) -> None:
        self.done += 1

    def __enter__(self) -> Progress:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()

    def _say(self) -> None:
        while not self._stop.wait(PROGRESS_EVERY_S):
            print(f"      evaluate: {self.label}: {self.done} of {self.total} episodes done "
                  f"({time.monotonic() - self._started:.0f}s)", flush=True)


def evaluate_model(model_dir: Path, harness: Harness, tasks: list[Task], label: str, *, batch_size: int,
                   samples: int = 0, temperature: float = 1.0, seed: int = 0, device: str = "auto",
                   chat_template: str | None = None, prices: tuple[float, float] = (0.0, 0.0)) -> Scored:
    """evaluate_policy on a checkpoint folder, loaded with transformers.

    device: student.device (auto: a CUDA GPU when one is visible, else the CPU); chat_template: rendered with in
    place of the checkpoint's own (a base judged in its trained versions' format).
    """
    from flywheel.policies.hf import HFPolicy

    policy = HFPolicy(model_dir, batch_size=batch_size, device=device)
    if chat_template:
        policy.tokenizer.chat_template = chat_template
    return evaluate_policy(policy, harness, tasks, label, samples=samples, temperature=temperature, seed=seed,
                           prices=prices)


def _row(label: str, episode: Episode, prices: tuple[float, float]) -> dict:
    prompt = sum(int(c.usage.get("prompt_tokens", 0)) for c in episode.completions)
    return {"model": label, "task_id": episode.task.task_id, "sample": episode.sample, "reward": episode.reward,
            "passed": episode.passed, "slice": episode.task.slice, "tokens": episode.tokens,
            "latency_s": float(sum(c.latency_s for c in episode.completions)),
            "cost_usd": (prompt * prices[0] + episode.tokens * prices[1]) / 1e6,
            "messages": json.dumps(episode.messages, ensure_ascii=False)}


def check_contamination(heldout: list[Task], training: dict[str, Iterable[str]],
                        groups: dict[str, Iterable[str]] | None = None) -> None:
    """Raise ContaminationError naming the held-out ids whose prompt hash appears in any training set, or whose
    group (the scenario, collect.group_by) any training set's tasks share: another attempt at the same scenario
    is the same test."""
    by_hash = {prompt_hash(t.prompt): t.task_id for t in heldout}
    by_group: dict[str, list[str]] = {}
    for task in heldout:
        if task.group:
            by_group.setdefault(task.group, []).append(task.task_id)
    hits = []
    for name, hashes in training.items():
        found = sorted({by_hash[h] for h in hashes if h in by_hash})
        if found:
            hits.append(f"{name}: {len(found)} held-out task(s), e.g. {', '.join(found[:5])}")
    for name, trained in (groups or {}).items():
        shared = sorted({g for g in trained if g in by_group})
        if shared:
            ids = sorted({i for g in shared for i in by_group[g]})
            hits.append(f"{name}: {len(ids)} held-out task(s) of a scenario trained on (group "
                        f"{', '.join(shared[:5])}), e.g. {', '.join(ids[:5])}")
    if hits:
        raise ContaminationError("held-out prompts found in training data; refusing to evaluate: " + "; ".join(hits))


def synthetic_prompt_hashes(messages_json: Iterable[str]) -> list[str]:
    """The prompt hash of each conversation (JSON text) of a synthetic table, for check_contamination."""
    return [conversation_hash(json.loads(m)) for m in messages_json]
