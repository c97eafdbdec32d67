"""Stage synthesize: the teacher runs the harness on the train tasks, n samples each; the rubric picks targets.

Rejection sampling: every sample is a row of the synthetic table and `accepted` marks the training targets:
the samples the rubric passed, or only the best one per task (`keep_best_only`), plus, by config, the train
traces whose outcome was accepted. A teacher behind the OpenAI protocol answers from its response cache on a
rerun, so the table is written again byte for byte without a call.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pandas as pd

from flywheel.agent import Episode
from flywheel.config import ConfigError, TeacherConfig
from flywheel.contract import Environment, Task, prompt_hash
from flywheel.data.catalog import named_model
from flywheel.data.tasksets import row_task
from flywheel.policies import Policy, get_policy
from flywheel.policies.base import Sampling
from flywheel.stages import StageResult
from flywheel.synthesis import sample_row, select, trace_rows
from flywheel.train.context import check_fit, longest_collected
from tasks.kernel import stage_context, stage_task
from tasks.progress import Meter

# Conversations per harness run: enough to keep every request slot busy through a turn, few enough
# that progress shows and a straggler holds up only its own chunk.
CHUNK = 256


@stage_task()
def synthesize(pipeline: str, root: str = ".", parent_run_id: str | None = None) -> StageResult:
    """Teacher episodes on every train task, n samples each, scored by the rubric: the synthetic table."""
    # params: the teacher's key variable's NAME only, never the key
    with stage_context("synthesize", pipeline, root, parent_run_id, params=("teacher", "synthesize")) as stage:
        cfg, catalog, harness, env = stage.cfg, stage.catalog, stage.harness, stage.env
        if longest_collected(env):  # replay: fail on prompts over the student's context before a teacher runs
            check_fit(pipeline, cfg, env, stage.root)
        task_table = catalog.read("tasks")
        train = [row_task(r) for r in task_table.to_dict("records") if r["split"] == "train"]
        tasks = without_slices(train, cfg.synthesize.exclude_slices)
        n = cfg.synthesize.samples_per_task
        sampling = Sampling(temperature=cfg.synthesize.temperature, top_p=cfg.synthesize.top_p,
                            max_new_tokens=cfg.synthesize.max_new_tokens, seed=cfg.environment.seed)
        teacher = build_teacher(cfg.teacher, env, stage.root)
        if teacher is None:  # teacher.policy none: the accepted traces are the targets, nothing is sampled
            tasks = []
        meter = Meter(stage.run, len(tasks) * n, cfg.teacher)
        per_chunk = max(1, max(CHUNK, 8 * cfg.teacher.concurrency) // n)
        episodes: list[Episode] = []
        try:
            for start in range(0, len(tasks), per_chunk):
                chunk = harness.run(teacher, tasks[start:start + per_chunk], samples=n, sampling=sampling)
                episodes += chunk
                meter.update(chunk)
        finally:
            getattr(teacher, "close", lambda: None)()
        selection = select(episodes, cfg.synthesize.keep_best_only)
        targets = selection.targets
        teacher_name = cfg.teacher.model or cfg.teacher.policy
        tools = json.dumps(env.tools(), ensure_ascii=False)
        rows = [sample_row(e, i in targets, teacher_name, tools) for i, e in enumerate(episodes)]
        traces = []
        if cfg.synthesize.include_accepted_traces:
            held = task_table[task_table["split"] == "heldout"]
            heldout = {prompt_hash(json.loads(p)) for p in held["prompt"]}
            traces = trace_rows(catalog.read("traces"), env, heldout, cfg.collect.heldout_fraction,
                                set(held["group"]))
        catalog.write("synthetic", pd.DataFrame(rows + traces))

        accepted = sum(r["accepted"] for r in rows)
        stats = getattr(teacher, "stats", {})  # an OpenAI teacher's request counts (an hf one's are decode stats)
        stats = dict(stats) if isinstance(stats, dict) else {}
        metrics = {"samples": len(rows), "accepted": accepted, "accepted_fraction": accepted / max(len(rows), 1),
                   "passed_fraction": sum(e.passed for e in episodes) / max(len(episodes), 1),
                   "tasks_with_target_fraction": len({episodes[i].task.task_id for i in targets}) / max(len(tasks), 1),
                   "reward_mean": sum(r["reward"] for r in rows) / max(len(rows), 1),
                   "malformed_turns": sum(c.error is not None for e in episodes for c in e.completions),
                   "tasks_excluded": len(train) - len(tasks), "traces_added": len(traces),
                   "traces_accepted": sum(r["accepted"] for r in traces),
                   **meter.totals(),
                   **{f"teacher_{k}": v for k, v in sorted(stats.items())},
                   "cost_usd_spent": meter.cost(stats.get("tokens_in", 0), stats.get("tokens_out", 0))}
        metrics["traces_failed_rubric"] = len(traces) - metrics["traces_accepted"]
        metrics |= selection.metrics() if tasks else {}
        print(f"      synthesize: {accepted} of {len(rows)} teacher samples accepted{selection.line(n)}"
              f"{_traces_line(traces)}", flush=True)
        warnings = [selection.failed_warning(env, tasks)] if selection.failed_tasks else []
        for warning in warnings:
            print(f"      warning: {warning}", flush=True)
        stage.run.metrics(metrics)
        return stage.done(metrics, warnings=warnings)


def _traces_line(traces: list[dict]) -> str:
    """What became of the accepted traces: how many failed their own rubric, and which parts were under 1."""
    if not traces:
        return ""
    failed = [r for r in traces if not r["accepted"]]
    parts = Counter(k for r in failed for k, v in json.loads(r["breakdown"] or "{}").items() if v < 1.0)
    why = f" (parts under 1: {', '.join(f'{k} {n}' for k, n in parts.most_common())})" if parts else ""
    return (f"; {len(traces) - len(failed)} of {len(traces)} accepted traces kept, {len(failed)} failed their own "
            f"rubric{why}")


def without_slices(tasks: list[Task], excluded: list[str]) -> list[Task]:
    """The train tasks the teacher writes conversations for: all but synthesize.exclude_slices. A slice named
    there that no train task has is a config error (a typo would otherwise exclude nothing, silently)."""
    present = {t.slice for t in tasks}
    unknown = sorted(set(excluded) - present)
    if unknown:
        raise ConfigError(f"synthesize.exclude_slices names {unknown}, but no train task is in that slice; the "
                          f"train tasks' slices are {sorted(present)}")
    return [t for t in tasks if t.slice not in excluded]


def build_teacher(cfg: TeacherConfig, env: Environment, root: Path) -> Policy | None:
    """The teacher policy the config names (None for `none`); the openai one reads its key from the variable
    named, here only."""
    if cfg.policy == "none":
        return None
    if cfg.policy == "oracle":
        return get_policy("oracle", env=env, error_rate=cfg.error_rate, error_slices=cfg.error_slices,
                          error_seed=cfg.error_seed)
    if cfg.policy in ("hf", "vllm"):  # a folder under the project root (not the cwd), else a hub id as given
        model = str(named_model(root, cfg.model))
        if cfg.policy == "hf":
            return get_policy("hf", model_or_path=model, device=cfg.device)
        return get_policy("vllm", model=model, device=cfg.device)
    from flywheel.policies.openai import OpenAIPolicy

    return OpenAIPolicy.from_endpoint(cfg, root)
