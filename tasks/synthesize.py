"""Stage synthesize: the teacher runs the harness on the train tasks, n samples each; the rubric picks targets.

Rejection sampling: every sample is a row of the synthetic table and `accepted` marks the training targets:
the samples the rubric passed, or only the best one per task (`keep_best_only`), plus, by config, the train
traces whose outcome was accepted. A teacher behind the OpenAI protocol answers from its response cache on a
rerun, so the table is written again byte for byte without a call.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pandas as pd
from prefect import task

from flywheel.agent import Episode, run_episodes
from flywheel.config import TeacherConfig, load_pipeline
from flywheel.data.catalog import Catalog
from flywheel.data.tasksets import row_task
from flywheel.envs import Environment, get_environment
from flywheel.envs.base import prompt_hash
from flywheel.policies import Policy, get_policy
from flywheel.policies.base import Sampling
from flywheel.registry import Run, stage_run
from tasks.caching import by_content
from tasks.spec import output_hashes

# Conversations per run_episodes call: enough to keep every request slot busy through a turn, few enough
# that progress shows and a straggler holds up only its own chunk.
CHUNK = 256


@task(name="synthesize", cache_key_fn=by_content("synthesize"), persist_result=True)
def synthesize(pipeline: str, root: str = ".", parent_run_id: str | None = None) -> dict:
    """Teacher episodes on every train task, n samples each, scored by the rubric: the synthetic table."""
    root_path = Path(root).resolve()
    cfg = load_pipeline(pipeline, root_path / "pipelines.yaml")
    catalog = Catalog(root_path, pipeline)
    env = get_environment(cfg.environment.name)
    params = cfg.model_dump(include={"teacher", "synthesize"})  # the key's variable NAME only, never the key
    with stage_run(root_path, pipeline, "synthesize", parent_run_id, params) as run:
        task_table = catalog.read("tasks")
        tasks = [row_task(r) for r in task_table.to_dict("records") if r["split"] == "train"]
        n = cfg.synthesize.samples_per_task
        sampling = Sampling(temperature=cfg.synthesize.temperature, top_p=cfg.synthesize.top_p,
                            max_new_tokens=cfg.synthesize.max_new_tokens, seed=cfg.environment.seed)
        teacher = build_teacher(cfg.teacher, env, root_path)
        meter = Meter(run, len(tasks) * n, cfg.teacher)
        per_chunk = max(1, max(CHUNK, 8 * cfg.teacher.concurrency) // n)
        episodes: list[Episode] = []
        try:
            for start in range(0, len(tasks), per_chunk):
                chunk = run_episodes(env, teacher, tasks[start:start + per_chunk], samples=n, sampling=sampling,
                                     max_turns=cfg.environment.max_turns,
                                     tool_timeout_s=cfg.environment.tool_timeout_s)
                episodes += chunk
                meter.update(chunk)
        finally:
            getattr(teacher, "close", lambda: None)()
        targets = select_targets(episodes, cfg.synthesize.keep_best_only)
        teacher_name = cfg.teacher.model or cfg.teacher.policy
        tools = json.dumps(env.tools(), ensure_ascii=False)
        rows = [sample_row(e, i in targets, teacher_name, tools) for i, e in enumerate(episodes)]
        traces = []
        if cfg.synthesize.include_accepted_traces:
            heldout = {prompt_hash(json.loads(p)) for p in task_table.loc[task_table["split"] == "heldout", "prompt"]}
            traces = trace_rows(catalog.read("traces"), env, heldout)
        catalog.write("synthetic", pd.DataFrame(rows + traces))

        accepted = sum(r["accepted"] for r in rows)
        stats = dict(getattr(teacher, "stats", {}))
        metrics = {"samples": len(rows), "accepted": accepted, "accepted_fraction": accepted / max(len(rows), 1),
                   "passed_fraction": sum(e.passed for e in episodes) / max(len(episodes), 1),
                   "tasks_with_target_fraction": len({episodes[i].task.task_id for i in targets}) / max(len(tasks), 1),
                   "reward_mean": sum(r["reward"] for r in rows) / max(len(rows), 1),
                   "malformed_turns": sum(c.error is not None for e in episodes for c in e.completions),
                   "traces_added": len(traces), "traces_accepted": sum(r["accepted"] for r in traces),
                   **meter.totals(),
                   **{f"teacher_{k}": v for k, v in sorted(stats.items())},
                   "cost_usd_spent": meter.cost(stats.get("tokens_in", 0), stats.get("tokens_out", 0))}
        run.metrics(metrics)
        outputs = output_hashes("synthesize", pipeline, root_path)
        run.tags({f"flywheel.out.{k}": v for k, v in outputs.items()})
    return {"stage": "synthesize", "run_id": run.run_id, "metrics": metrics, "outputs": outputs}


def build_teacher(cfg: TeacherConfig, env: Environment, root: Path) -> Policy:
    """The teacher policy the config names; the openai one reads its key from the variable named, here only."""
    if cfg.policy == "oracle":
        return get_policy("oracle", env=env)
    if cfg.policy == "hf":
        return get_policy("hf", model_or_path=cfg.model)
    if cfg.policy == "vllm":
        return get_policy("vllm", model=cfg.model)
    return get_policy("openai", model=cfg.model, base_url=cfg.base_url, api_key_env=cfg.api_key_env,
                      concurrency=cfg.concurrency, timeout_s=cfg.timeout_s, max_retries=cfg.max_retries,
                      breaker_failures=cfg.breaker_failures, cache=root / cfg.cache if cfg.cache else None)


def select_targets(episodes: list[Episode], best_only: bool) -> set[int]:
    """Indexes of the episodes kept as targets: every one the rubric passed, or the best passing one per task."""
    passed = [i for i, e in enumerate(episodes) if e.passed]
    if not best_only:
        return set(passed)
    best: dict[str, tuple[tuple, int]] = {}
    for i in passed:
        e = episodes[i]
        # highest reward, then the shortest episode, then the first sample: the same pick on every rerun
        rank = (-e.reward, e.turns, _tokens(e, "completion_tokens"), e.sample)
        if e.task.task_id not in best or rank < best[e.task.task_id][0]:
            best[e.task.task_id] = (rank, i)
    return {i for _, i in best.values()}


def sample_row(e: Episode, accepted: bool, teacher: str, tools: str) -> dict:
    """One row of the synthetic table; latencies come from the answers themselves (cached ones included)."""
    return {
        "sample_id": hashlib.sha256(f"{e.task.task_id}:{e.sample}".encode()).hexdigest()[:16],
        "task_id": e.task.task_id,
        "teacher": teacher,
        "messages": json.dumps(e.messages, ensure_ascii=False),
        "tools": tools,
        "reward": e.reward,
        "breakdown": json.dumps(e.breakdown, sort_keys=True),
        "accepted": accepted,
        "tokens_in": _tokens(e, "prompt_tokens"),
        "tokens_out": _tokens(e, "completion_tokens"),
        "latency_s": round(sum(c.latency_s for c in e.completions), 6),
    }


def trace_rows(traces: pd.DataFrame, env: Environment, heldout_prompts: set[str]) -> list[dict]:
    """Train traces with outcome 'accepted' as targets; the rubric has the last word where it can check them."""
    rows = []
    for trace in traces.sort_values("trace_id").to_dict("records"):
        if trace["outcome"] != "accepted" or trace["split"] != "train":
            continue
        messages = json.loads(trace["messages"])
        first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
        if prompt_hash(messages[:first_user + 1]) in heldout_prompts:
            continue  # never train on a held-out prompt, whatever its trace says
        task = env.task_from_messages(messages)
        if task is not None:
            score = env.score(task, messages)
            reward, passed, breakdown = score.reward, score.passed, dict(score.breakdown)
        else:
            reward = min(max(float(trace["score"]), 0.0), 1.0) if pd.notna(trace["score"]) else 1.0
            passed, breakdown = True, {}
        # content null beside tool calls becomes "", as the teacher's own turns have it: one shape for SFT
        messages = [{**m, "content": m.get("content") or ""} for m in messages]
        rows.append({"sample_id": f"trace-{trace['trace_id']}", "task_id": task.task_id if task else trace["trace_id"],
                     "teacher": "trace", "messages": json.dumps(messages, ensure_ascii=False),
                     "tools": trace["tools"], "reward": reward,
                     "breakdown": json.dumps(breakdown, sort_keys=True), "accepted": passed,
                     "tokens_in": 0, "tokens_out": 0, "latency_s": 0.0})
    return rows


def _tokens(e: Episode, kind: str) -> int:
    return sum(int(c.usage.get(kind, 0)) for c in e.completions)


class Meter:
    """Progress of the sampling: a bar line about every tenth (rate, passed fraction, ETA, tokens, cost)."""

    def __init__(self, run: Run, total: int, teacher: TeacherConfig):
        self.run, self.total = run, total
        self.prices = (teacher.price_input_per_mtok, teacher.price_output_per_mtok)
        self.done = self.passed = self.tokens_in = self.tokens_out = 0
        self.started = time.monotonic()
        self.every = max(total // 10, 1)
        self.next_line = self.every

    def cost(self, tokens_in: int, tokens_out: int) -> float:
        return (tokens_in * self.prices[0] + tokens_out * self.prices[1]) / 1e6

    def update(self, episodes: list[Episode]) -> None:
        self.done += len(episodes)
        self.passed += sum(e.passed for e in episodes)
        self.tokens_in += sum(_tokens(e, "prompt_tokens") for e in episodes)
        self.tokens_out += sum(_tokens(e, "completion_tokens") for e in episodes)
        if self.done < self.next_line and self.done < self.total:
            return
        self.next_line = (self.done // self.every + 1) * self.every
        values = self.totals() | {"passed_fraction": self.passed / max(self.done, 1)}
        eta = (self.total - self.done) / max(values["samples_per_s"], 1e-9)
        bar = "#" * round(20 * self.done / max(self.total, 1))
        print(f"      synthesize [{bar:<20}] {self.done}/{self.total} samples  {values['samples_per_s']:.1f}/s"
              f"  passed {values['passed_fraction']:.2f}  ~{eta:.0f}s left  tokens {self.tokens_in} in / "
              f"{self.tokens_out} out  ${values['cost_usd']:.4f}", flush=True)
        self.run.metrics({f"progress/{k}": v for k, v in values.items()} | {"progress/samples": self.done},
                         step=self.done)

    def totals(self) -> dict:
        """Rate, tokens and cost so far (cached answers count their original tokens: the data's cost)."""
        elapsed = max(time.monotonic() - self.started, 1e-9)
        return {"samples_per_s": self.done / elapsed, "tokens_in": self.tokens_in, "tokens_out": self.tokens_out,
                "cost_usd": self.cost(self.tokens_in, self.tokens_out)}
