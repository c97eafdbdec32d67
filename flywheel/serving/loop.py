"""One turn of the flywheel after a retrain: serve the champion, drive the environment's agent against it with
the harness as the client (the `openai` policy), label each episode through /v1/feedback, and report.

The next retrain's collect reads what the server recorded, because the pipeline's `collect.sources` include
the traffic folder (check_sources makes sure of it before anything runs).
"""

from __future__ import annotations

import fnmatch
import json
import os
import random
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING

from flywheel import registry
from flywheel.config import PipelineConfig
from flywheel.contract import Environment, Task
from flywheel.errors import UserFacingError
from flywheel.metrics import score_name
from flywheel.stages import RetrainSummary
from flywheel.tags import stage_run_tag, stage_state_tag

if TYPE_CHECKING:
    from flywheel.agent import Harness


class LoopError(UserFacingError, RuntimeError):
    """The loop cannot close: served traffic would not come back to collect, or nothing is served."""


@dataclass
class Round:
    """What one round did: the version served, what the agent did against it, what the retrain saw."""

    number: int
    version: str
    collected_new: int  # traces this round's retrain collected that it had not seen (the last round's traffic)
    heldout_reward: float  # the champion's held-out mean reward after this round's retrain (greedy)
    answers: int  # requests the server answered (each one a trace record)
    episodes: int
    passed: int

    def text(self) -> str:
        return (f"round {self.number}: champion version {self.version}; "
                f"held-out mean reward {self.heldout_reward:.3f}; new traces collected {self.collected_new}; "
                f"served {self.answers} answers to {self.episodes} episodes ({self.passed} solved), recorded for the "
                "next collect")


def check_sources(pipeline: str, cfg: PipelineConfig, root: Path, folder: Path) -> None:
    """LoopError unless a collect source's glob matches the traffic files written to `folder`."""
    probe = str((folder / "traffic-2000-01-01.jsonl").resolve())
    for source in cfg.collect.sources:
        if source.path and any(fnmatch.fnmatch(probe, str((root / p).resolve()) if not os.path.isabs(p) else p)
                               for p in source.path):
            return
    where = os.path.relpath(folder, root)
    raise LoopError(f"pipelines.yaml: no path in pipelines.{pipeline}.collect.sources matches {where}/*.jsonl, so "
                    f"the served traffic would never be collected; add \"{where}/*.jsonl\" to the sources")


def run_round(pipeline: str, root: Path, folder: Path, summary: RetrainSummary, number: int, episodes: int,
              seed: int | None = None) -> Round:
    """Serve the champion the retrain left, run `episodes` agent episodes against it, label them; the Round."""
    import httpx

    from flywheel.policies.base import Sampling
    from flywheel.policies.openai import OpenAIPolicy
    from flywheel.serving.server import ModelServer

    harness = round_harness(pipeline, root)
    tasks = round_tasks(harness.env, episodes, seed if seed is not None else 1000 + number)
    with ModelServer(pipeline, "champion", traces=folder, root=root) as server:  # root: its constrained_tools
        version = server.follower.current.version.version
        policy = OpenAIPolicy(model=pipeline, base_url=server.url, concurrency=4, max_retries=2)
        done = harness.run(policy, tasks, sampling=Sampling(temperature=0.0, max_new_tokens=64))
        final = _final_answers(server.traffic.folder, server.traffic.recorded)
        with httpx.Client(base_url=server.url, timeout=30) as http:
            for episode in done:
                answer_id = final.pop(_prompt_key(episode.task.prompt), [None]).pop(0) if episode.stop == "answer" \
                    else None
                if answer_id:  # the operator's verdict: the environment's rubric
                    http.post("/feedback", json={"id": answer_id, "score": episode.reward,
                                                 "outcome": "accepted" if episode.passed else "rejected"})
        answers = server.traffic.recorded
    scores = summary.scores
    # the champion was evaluated as "champion" unless it is this run's candidate (promoted, or the same model)
    champion_is_candidate = summary.champion == summary.version or score_name("champion") not in scores
    score = scores[score_name("rl")] if champion_is_candidate else scores[score_name("champion")]
    return Round(number=number, version=version, collected_new=_collected_new(summary), heldout_reward=float(score),
                 answers=answers, episodes=len(done), passed=sum(e.passed for e in done))


def round_harness(pipeline: str, root: Path) -> Harness:
    """The harness the agent runs in against the served champion: the pipeline's own environment (its factory and
    args; with replay, its collected tasks) under the `environment:` section's limits, as the retrain's stages."""
    from flywheel.agent import load_harness
    from flywheel.config import load_pipeline

    cfg = load_pipeline(pipeline, root / "pipelines.yaml")
    return load_harness(cfg.environment, root, pipeline)


def round_tasks(env: Environment, episodes: int, seed: int) -> list[Task]:
    """`episodes` fresh tasks of the environment's stream at `seed` (the loop never passes the held-out ones'
    seed); an environment that generates none (replay) gives a seeded sample of its recorded train tasks."""
    tasks = list(islice(env.generate_tasks(seed), episodes))
    if tasks:
        return tasks
    recorded = [t for t in env.recorded_tasks() if t.split == "train"]
    return random.Random(seed).sample(recorded, min(episodes, len(recorded)))


def _prompt_key(messages: list[dict]) -> str:
    user = next(m for m in messages if m.get("role") == "user")
    return json.dumps(user.get("content"), ensure_ascii=False)


def _final_answers(folder: Path, count: int) -> dict[str, list[str]]:
    """Response ids of the last `count` answers that ended a turn (no tool calls), by the prompt they answer."""
    lines: list[str] = []
    for path in sorted(folder.glob("traffic-*.jsonl")):
        lines += path.read_text(encoding="utf-8").splitlines()
    found: dict[str, list[str]] = {}
    for line in lines[-count:] if count else []:
        record = json.loads(line)
        message = record["response"]["choices"][0]["message"]
        if not message.get("tool_calls"):
            found.setdefault(_prompt_key(record["request"]["messages"]), []).append(record["id"])
    return found


def _collected_new(summary: RetrainSummary) -> int:
    """traces_new of the collect stage the retrain ran (0 when it came from the cache)."""
    c = registry.client()
    collect_run = c.get_run(summary.run_id).data.tags.get(stage_run_tag("collect"))
    if not collect_run or c.get_run(summary.run_id).data.tags.get(stage_state_tag("collect")) != "ran":
        return 0
    return int(c.get_run(collect_run).data.metrics.get("traces_new", 0))
