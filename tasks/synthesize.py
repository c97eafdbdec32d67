"""Stage synthesize: the teacher runs the harness on the train tasks; what the rubric passes is kept."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pandas as pd
from prefect import task

from flywheel.agent import run_episodes
from flywheel.config import load_pipeline
from flywheel.data.catalog import Catalog, content_hash
from flywheel.data.tasksets import row_task
from flywheel.envs import get_environment
from flywheel.policies import get_policy
from flywheel.policies.base import Sampling
from flywheel.registry import stage_run
from tasks.caching import by_content


@task(name="synthesize", cache_key_fn=by_content("synthesize"), persist_result=True)
def synthesize(pipeline: str, root: str = ".", parent_run_id: str | None = None) -> dict:
    """Teacher episodes on every train task, scored by the rubric: the synthetic table."""
    root_path = Path(root).resolve()
    cfg = load_pipeline(pipeline, root_path / "pipelines.yaml")
    catalog = Catalog(root_path, pipeline)
    env = get_environment(cfg.environment.name)
    params = cfg.model_dump(include={"teacher", "synthesize"})
    with stage_run(root_path, pipeline, "synthesize", parent_run_id, params) as run:
        tasks = [row_task(r) for r in catalog.read("tasks").to_dict("records") if r["split"] == "train"]
        teacher = get_policy(cfg.teacher.policy, env=env)
        sampling = Sampling(temperature=cfg.synthesize.temperature, seed=cfg.environment.seed)
        episodes = run_episodes(env, teacher, tasks, samples=cfg.synthesize.samples_per_task, sampling=sampling,
                                max_turns=cfg.environment.max_turns, tool_timeout_s=cfg.environment.tool_timeout_s)
        tools = json.dumps(env.tools(), ensure_ascii=False)
        rows = [{
            "sample_id": hashlib.sha256(f"{e.task.task_id}:{e.sample}".encode()).hexdigest()[:16],
            "task_id": e.task.task_id,
            "teacher": cfg.teacher.model or cfg.teacher.policy,
            "messages": json.dumps(e.messages, ensure_ascii=False),
            "tools": tools,
            "reward": e.reward,
            "breakdown": json.dumps(e.breakdown, sort_keys=True),
            "accepted": e.passed,
            "tokens_in": sum(c.usage.get("prompt_tokens", 0) for c in e.completions),
            "tokens_out": sum(c.usage.get("completion_tokens", 0) for c in e.completions),
            "latency_s": round(sum(c.latency_s for c in e.completions), 6),
        } for e in episodes]
        catalog.write("synthetic", pd.DataFrame(rows))
        accepted = sum(r["accepted"] for r in rows)
        metrics = {"samples": len(rows), "accepted": accepted, "accepted_fraction": accepted / max(len(rows), 1),
                   "reward_mean": sum(r["reward"] for r in rows) / max(len(rows), 1)}
        run.metrics(metrics)
        outputs = {"synthesize": content_hash([catalog.stage_dir("synthesize")], root_path)}
        run.tags({f"flywheel.out.{k}": v for k, v in outputs.items()})
    return {"stage": "synthesize", "run_id": run.run_id, "metrics": metrics, "outputs": outputs}
