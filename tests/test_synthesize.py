"""The synthesize stage against a real OpenAI-compatible server: faults, rejection sampling, determinism,
secrets, a kill half-way; and the oracle default."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import replace
from itertools import islice
from pathlib import Path

import pandas as pd
import pytest
import yaml
from mlflow import MlflowClient

from flywheel.config import ConfigError, load_pipelines
from flywheel.contract import split_of
from flywheel.data.catalog import Catalog
from flywheel.data.schemas import Traces
from flywheel.data.tasksets import task_row
from flywheel.envs.calculator import CalculatorEnv
from tasks.synthesize import synthesize

REPO = Path(__file__).resolve().parent.parent
KEY_ENV = "FLYWHEEL_TEST_TEACHER_KEY"
KEY = "sk-test-d0n0tl34k-7f3a9c2e"


def write_pipeline(root: Path, teacher: dict, synthesize_section: dict | None = None) -> None:
    pipeline = {"environment": {"name": "calculator", "train_tasks": 16, "heldout_tasks": 4, "seed": 0},
                "student": {}, "teacher": teacher, "collect": {}, "synthesize": synthesize_section or {},
                "sft": {}, "rl": {}, "evaluate": {}, "gate": {}}
    (root / "pipelines.yaml").write_text(yaml.safe_dump({"pipelines": {"t": pipeline}}))


@pytest.fixture
def root(tmp_path, mlflow_store) -> Path:
    """A project with the collect stage's tables as the contract has them: 20 tasks and 12 traces."""
    root = tmp_path / "project"
    root.mkdir()
    write_pipeline(root, {"policy": "oracle"})
    env = CalculatorEnv()
    tasks = {t.task_id: task_row(replace(t, split=split_of(t.task_id, 0.2)), "generated")
             for t in islice(env.generate_tasks(0), 20)}
    traces = []
    for number, line in enumerate((REPO / "examples/traces/support-agent-2026-11-01.jsonl").read_text()
                                  .splitlines()[:12], start=1):
        record = json.loads(line)
        task = env.task_from_messages(record["messages"])
        split = split_of(task.task_id, 0.2)
        tasks.setdefault(task.task_id, task_row(replace(task, split=split), "trace"))
        traces.append({"trace_id": hashlib.sha256(line.encode()).hexdigest()[:16], "record_id": record["id"],
                       "source": "sample", "location": f"sample.jsonl:{number}",
                       "collected_at": record["timestamp"], "messages": json.dumps(record["messages"]),
                       "tools": json.dumps(record["tools"]), "outcome": record["outcome"],
                       "score": record.get("score"), "split": split, "group": "", "scenario": "",
                       "expected_actions": "", "metadata": "{}"})
    catalog = Catalog(root, "t")
    catalog.write("tasks", pd.DataFrame(list(tasks.values())))
    columns = list(Traces.to_schema().columns)  # the collect stage's contract as it stands
    catalog.write("traces", pd.DataFrame(traces)[columns])
    return root


def openai_teacher(server, **options) -> dict:
    return {"policy": "openai", "model": "oracle", "base_url": server.url, "concurrency": 4, "timeout_s": 1.0,
            **options}


def train_tasks(root: Path) -> int:
    tasks = Catalog(root, "t").read("tasks")
    return int((tasks["split"] == "train").sum())


def test_stage_against_a_faulty_endpoint_is_complete_deterministic_and_keeps_the_key(
        root, openai_server, monkeypatch, capsys):
    openai_server.api_key = KEY
    monkeypatch.setenv(KEY_ENV, KEY)
    write_pipeline(root, openai_teacher(openai_server, api_key_env=KEY_ENV, price_input_per_mtok=2.0,
                                        price_output_per_mtok=8.0),
                   {"samples_per_task": 2, "temperature": 1.0, "keep_best_only": True,
                    "include_accepted_traces": True})
    openai_server.inject("429", "500", "hang", "drop", "malformed")
    result = synthesize.fn("t", str(root))

    catalog = Catalog(root, "t")
    table = catalog.read("synthetic")
    samples = table[table["teacher"] == "oracle"]
    n_tasks = train_tasks(root)
    assert len(samples) == 2 * n_tasks and table["sample_id"].is_unique  # nothing lost, nothing twice
    assert samples.groupby("task_id")["accepted"].sum().eq(1).all()  # best only: one target per task
    traces = catalog.read("traces")
    accepted_train = traces[(traces["outcome"] == "accepted") & (traces["split"] == "train")]
    assert len(accepted_train) > 0 and (table["teacher"] == "trace").sum() == len(accepted_train)
    metrics = result.metrics
    assert (result.stage, result.gate, result.registration) == ("synthesize", None, None)
    assert metrics["samples"] == 2 * n_tasks and metrics["tasks_with_target_fraction"] == 1.0
    assert metrics["malformed_turns"] == 1 and metrics["teacher_retries"] == 4
    assert metrics["tokens_in"] == samples["tokens_in"].sum() > 0
    assert metrics["cost_usd"] == pytest.approx((metrics["tokens_in"] * 2 + metrics["tokens_out"] * 8) / 1e6)
    out = capsys.readouterr().out
    assert "synthesize [####################]" in out and "/s" in out and "left" in out and "passed" in out

    # the key reached the server and nowhere else: not MLflow params, tags or metric names, not the data
    run = MlflowClient().get_run(result.run_id)
    assert run.data.params["teacher.api_key_env"] == KEY_ENV
    logged = json.dumps([run.data.params, run.data.tags, list(run.data.metrics)])
    assert KEY not in logged and KEY not in out
    path = catalog.table_path("synthetic")
    assert KEY.encode() not in path.read_bytes()

    # a rerun answers from the cache: no request, the same bytes
    first, sent = path.read_bytes(), len(openai_server.received)
    again = synthesize.fn("t", str(root))
    assert len(openai_server.received) == sent and path.read_bytes() == first
    assert again.metrics["teacher_requests"] == 0 and again.metrics["cost_usd_spent"] == 0


def test_a_killed_stage_resumes_without_sending_any_request_twice(root, openai_server):
    write_pipeline(root, openai_teacher(openai_server, timeout_s=60.0))
    cache = root / ".flywheel" / "teacher-cache.sqlite"
    held = 15
    openai_server.hang_after = held  # answers 15 requests, then holds every further one unanswered
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; from tasks.synthesize import synthesize; synthesize.fn('t', sys.argv[1])",
         str(root)], cwd=REPO, env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        while not (openai_server.answers == held and len(openai_server.received) > held and _rows(cache) == held):
            assert child.poll() is None, child.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the stage never got half-way"
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stderr.close()
    openai_server.release()

    result = synthesize.fn("t", str(root))
    n_tasks = train_tasks(root)
    assert result.metrics["samples"] == n_tasks and result.metrics["accepted"] == n_tasks
    assert result.metrics["teacher_cache_hits"] >= held
    # every request answered exactly once across the killed run and the rerun
    assert openai_server.answers == 2 * n_tasks and set(openai_server.answered.values()) == {1}


def _rows(cache: Path) -> int:
    if not cache.exists():
        return 0
    try:
        with sqlite3.connect(cache, timeout=1) as db:
            return db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]
    except sqlite3.OperationalError:  # the table is not there yet
        return 0


def test_the_oracle_teacher_stays_the_default(root, capsys):
    result = synthesize.fn("t", str(root))
    assert (result.stage, result.gate, result.registration) == ("synthesize", None, None)
    n_tasks = train_tasks(root)
    assert result.metrics["samples"] == result.metrics["accepted"] == n_tasks
    assert result.metrics["cost_usd"] == 0 and result.metrics["traces_added"] == 0
    table = Catalog(root, "t").read("synthetic")
    assert table["accepted"].all() and (table["teacher"] == "oracle").all()
    assert f"{n_tasks}/{n_tasks} samples" in capsys.readouterr().out


def test_teacher_config_never_echoes_a_pasted_key(tmp_path):
    path = tmp_path / "pipelines.yaml"
    write_pipeline(tmp_path, {"policy": "openai", "model": "m", "api_key_env": KEY})
    with pytest.raises(ConfigError, match="api_key_env.*must be the NAME of the environment variable") as err:
        load_pipelines(path)
    assert KEY not in str(err.value)
    write_pipeline(tmp_path, {"policy": "openai", "model": "m", "api_key_env": "d0n0tl34kd0n0tl34k"})
    with pytest.raises(ConfigError) as err:  # a key that happens to look like a name (lower case) as well
        load_pipelines(path)
    assert "d0n0tl34k" not in str(err.value)

    write_pipeline(tmp_path, {"policy": "openai", "api_key_env": KEY_ENV})
    with pytest.raises(ConfigError, match="teacher policy 'openai' needs 'model'"):
        load_pipelines(path)


def test_excluded_slices_get_no_teacher_conversation_and_a_typo_is_an_error(root):
    tasks = Catalog(root, "t").read("tasks")
    train = tasks[tasks["split"] == "train"]
    left_out = train["slice"].value_counts().index[0]  # the commonest train slice
    write_pipeline(root, {"policy": "oracle"}, {"exclude_slices": [left_out]})
    result = synthesize.fn("t", str(root))
    table = Catalog(root, "t").read("synthetic")
    slices = dict(zip(tasks["task_id"], tasks["slice"], strict=True))
    assert len(table) == len(train) - (train["slice"] == left_out).sum() > 0
    assert left_out not in {slices[t] for t in table["task_id"]}
    assert result.metrics["tasks_excluded"] == (train["slice"] == left_out).sum()
    write_pipeline(root, {"policy": "oracle"}, {"exclude_slices": ["hrad"]})
    with pytest.raises(ConfigError, match=r"exclude_slices names \['hrad'\].*train tasks' slices are"):
        synthesize.fn("t", str(root))


def test_oracle_samples_are_deduplicated_and_failures_rejected_and_named(root, capsys):
    """n samples of a deterministic teacher are one target per task; an imperfect one's failures are dropped, and
    the tasks where every sample failed are counted and named."""
    write_pipeline(root, {"policy": "oracle", "error_rate": 0.5, "error_seed": 3}, {"samples_per_task": 3})
    result = synthesize.fn("t", str(root))
    n_tasks, metrics = train_tasks(root), result.metrics
    table = Catalog(root, "t").read("synthetic")
    passed = table[[json.loads(b) == {} or min(json.loads(b).values()) == 1.0 for b in table["breakdown"]]]
    assert metrics["synth.samples"] == len(table) == 3 * n_tasks
    assert metrics["synth.rejected"] == (~table["reward"].ge(1.0)).sum() > 0
    # a right answer is the oracle's one answer: every passing sample after a task's first is a duplicate
    kept = table.groupby("task_id")["accepted"].sum()
    assert kept.max() == 1 and metrics["accepted"] == kept.sum()
    assert metrics["synth.duplicates"] == len(passed) - kept.sum() > 0
    assert sum(metrics[f"synth.tasks_kept_{k}"] for k in (0, 1) if f"synth.tasks_kept_{k}" in metrics) == n_tasks
    failed = kept[kept == 0].index.tolist()
    assert metrics["synth.tasks_all_failed"] == len(failed) == metrics.get("synth.tasks_kept_0", 0)
    out = capsys.readouterr().out
    assert f"{metrics['synth.duplicates']} duplicate(s) dropped" in out and "tasks by targets kept" in out
    assert failed  # (error_seed 3 fails some task three times: the warning is exercised)
    assert f"on {len(failed)} of {n_tasks} train task(s) every teacher sample" in result.warnings[0] in out
    assert sum(f"task {task_id}" in result.warnings[0] for task_id in failed) == min(3, len(failed))


def test_a_sampling_teacher_varies_its_samples_and_reruns_the_same(root, tiny_student, capsys):
    """The tiny student as an hf teacher at temperature 1 (a real sampling policy): a task's samples differ, each
    is scored, the failures are rejected and every task without a target is counted; a rerun writes the same
    table's conversations (seeded)."""
    import shutil

    shutil.copytree(tiny_student, root / "teacher")
    write_pipeline(root, {"policy": "hf", "model": "teacher", "device": "cpu"},
                   {"samples_per_task": 3, "temperature": 1.0, "max_new_tokens": 12})
    result = synthesize.fn("t", str(root))
    table = Catalog(root, "t").read("synthetic")
    n_tasks, metrics = train_tasks(root), result.metrics
    assert metrics["synth.samples"] == len(table) == 3 * n_tasks
    distinct = table.groupby("task_id")["messages"].nunique()
    assert (distinct > 1).mean() > 0.5  # variety: most tasks' samples are not one conversation three times
    assert metrics["synth.rejected"] == (~table["accepted"]).sum() - metrics["synth.duplicates"]
    assert metrics["synth.tasks_all_failed"] == (table.groupby("task_id")["accepted"].sum() == 0).sum()
    synthesize.fn("t", str(root))
    again = Catalog(root, "t").read("synthetic")  # (latencies are this run's: an hf teacher has no cache)
    assert again[["sample_id", "messages", "reward"]].equals(table[["sample_id", "messages", "reward"]])
