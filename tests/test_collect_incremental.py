"""Incremental collection: a watermark per source, only new records read, the same tables as a full re-collect."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import SOURCES_ONLY

from flywheel.config import CollectConfig
from flywheel.data import sources, watermarks
from flywheel.data.catalog import Catalog
from flywheel.data.collection import collect
from flywheel.data.lineage import dvc_md5
from flywheel.data.redaction import Redactor
from flywheel.data.sources import FileReader

REPO = Path(__file__).resolve().parent.parent


def _record(n: int) -> str:
    return json.dumps({"id": f"r{n}", "timestamp": f"2026-11-0{1 + n % 3}T08:00:{n % 60:02d}Z",
                       "messages": [{"role": "user", "content": f"What is {n} + {n}?"},
                                    {"role": "assistant", "content": f"{2 * n}"}],
                       "outcome": "accepted" if n % 2 else "rejected"})


def _append(path: Path, lines: list[str], newline: bool = True) -> None:
    with path.open("a") as handle:
        handle.write("\n".join(lines) + ("\n" if newline else ""))


@pytest.mark.parametrize("block_bytes", [sources.BLOCK_BYTES, 1, 60])
@pytest.mark.parametrize("parse", [True, False])
def test_a_file_reader_resumes_where_it_stopped(tmp_path, monkeypatch, parse, block_bytes):
    """Lines read in blocks of any size (a line longer than a block, blank lines, CRLF, a last line still being
    written) give the records and watermarks line-by-line reading gives, parsed here or in blocks (Lines)."""
    monkeypatch.setattr(sources, "BLOCK_BYTES", block_bytes)
    log = tmp_path / "a.jsonl"
    _append(log, [_record(1), _record(2) + "\r"])
    _append(log, [_record(3)], newline=False)  # still being written
    cfg = CollectConfig(sources=["*.jsonl"])
    reader = FileReader(cfg.sources[0], tmp_path, cfg.max_record_bytes)

    def read(since):
        items = []
        for item in reader.read(since, parse=parse):
            items += item.items(cfg.max_record_bytes) if isinstance(item, sources.Lines) else [item]
        return items

    items = read(None)
    assert [loc for loc, _, _ in items] == ["a.jsonl:1", "a.jsonl:2", "a.jsonl:3"]
    assert [record["id"] for _, _, record in items] == ["r1", "r2", "r3"]
    first = reader.state
    assert first["files"]["a.jsonl"] == {"bytes": log.stat().st_size - len(_record(3)), "lines": 2,
                                         "md5": hashlib.md5(log.read_bytes()[:-len(_record(3))]).hexdigest()}, \
        "the unfinished line is read again next time"
    _append(log, ["", "", _record(4)])
    assert [loc for loc, _, _ in read(first)] == ["a.jsonl:3", "a.jsonl:5"]
    assert reader.state["files"]["a.jsonl"] == {"bytes": log.stat().st_size, "lines": 5,
                                                "md5": hashlib.md5(log.read_bytes()).hexdigest()}
    assert read(reader.state) == []
    log.write_text(_record(9) + "\n")  # rewritten, not appended: read from the start
    assert [loc for loc, _, _ in read(first)] == ["a.jsonl:1"]


def test_incremental_and_full_collects_write_the_same_tables(tmp_path):
    cfg = CollectConfig(sources=["*.jsonl"])
    _append(tmp_path / "b.jsonl", [_record(n) for n in range(10)] + ["{bad"])

    def run(previous=([], []), since=None):
        return collect([FileReader(cfg.sources[0], tmp_path, cfg.max_record_bytes)], cfg, Redactor(cfg.redact),
                       previous, since)

    first = run()
    _append(tmp_path / "b.jsonl", [_record(n) for n in range(8, 14)])  # two repeats, four new
    _append(tmp_path / "a.jsonl", [_record(20), "{bad"])  # a new file that sorts first
    second = run((first.traces, first.quarantine), first.states)
    assert sum(second.records.values()) == 8 and second.duplicates == 2
    full = run()
    assert second.traces == full.traces and second.quarantine == full.quarantine
    assert len(full.traces) == 15


def test_the_stage_reads_only_new_records_and_stays_reproducible(tmp_path, mlflow_store):
    from mlflow import MlflowClient

    from tasks.collect import collect as stage

    shutil.copytree(REPO / "examples", tmp_path / "examples", ignore=SOURCES_ONLY)
    config = (REPO / "tests/conftest.py").read_text().split('SMALL_PIPELINE = """')[1].split('"""')[0]
    (tmp_path / "pipelines.yaml").write_text(config)
    catalog = Catalog(tmp_path, "small")
    first = stage.fn(pipeline="small", root=str(tmp_path))
    assert first.metrics["records"] == 150
    state = watermarks.state_path(tmp_path, "small")
    assert state.exists() and not state.is_relative_to(catalog.stage_dir("collect")), \
        "watermarks are project state, not part of the DVC output"

    rerun = stage.fn(pipeline="small", root=str(tmp_path))
    assert rerun.metrics["records"] == 0 and rerun.outputs == first.outputs, "nothing new: same bytes"

    log = tmp_path / "examples/traces/support-agent-2026-11-03.jsonl"
    _append(log, [_record(n) for n in range(5)])
    second = stage.fn(pipeline="small", root=str(tmp_path))
    assert second.metrics["records"] == 5 and second.metrics["traces_new"] == 5
    assert second.metrics["traces"] == first.metrics["traces"] + 5, "the table keeps earlier traces"

    full = stage.fn(pipeline="small", root=str(tmp_path), full=True)
    assert full.metrics["records"] == 155
    assert full.outputs == second.outputs
    assert MlflowClient().get_run(full.run_id).data.tags["flywheel.out.collect"] == dvc_md5(
        catalog.stage_dir("collect"))

    # outputs that are not the ones the watermark was written with (a `dvc checkout`, a removed folder): full
    shutil.rmtree(catalog.stage_dir("collect"))
    assert stage.fn(pipeline="small", root=str(tmp_path)).metrics["records"] == 155
    # a changed collect config: full
    (tmp_path / "pipelines.yaml").write_text(config.replace("heldout_fraction: 0.1, max_bad", "heldout_fraction: 0.2, "
                                                                                              "max_bad"))
    changed = stage.fn(pipeline="small", root=str(tmp_path))
    assert changed.metrics["records"] == 155 and changed.outputs != full.outputs


def test_new_traces_are_appended_to_the_stored_table_as_a_full_merge_would_place_them(tmp_path):
    from flywheel.data import tracetable

    cfg = CollectConfig(sources=["*.jsonl"])

    def timed(n: int) -> str:  # record n at minute n
        return json.dumps({**json.loads(_record(n)), "timestamp": f"2026-11-01T{n // 60:02d}:{n % 60:02d}:00Z"})

    def run(since=None):
        return collect([FileReader(cfg.sources[0], tmp_path, cfg.max_record_bytes)], cfg, Redactor(cfg.redact),
                       ([], []), since)

    _append(tmp_path / "b.jsonl", [timed(n) for n in range(0, 60, 2)])
    first = run()
    stored = first.table
    # later records, and a retried upload of an early one: appended, the stored copy stays
    _append(tmp_path / "b.jsonl", [timed(n) for n in (61, 63, 4)])
    merged = tracetable.merge(stored, run(first.states).table)
    assert merged.appended and merged.duplicates == 1 and len(merged.fresh) == 2
    assert merged.table.to_pylist() == run().traces
    # a back-filled record that sorts among the stored ones: merged in place, not appended
    _append(tmp_path / "b.jsonl", [timed(7)])
    merged = tracetable.merge(stored, run(first.states).table)
    assert not merged.appended and merged.table.to_pylist() == run().traces


def test_the_stage_appends_later_traces_and_their_tasks_as_a_full_collect_writes_them(tmp_path, mlflow_store):
    from tasks.collect import collect as stage

    shutil.copytree(REPO / "examples", tmp_path / "examples", ignore=SOURCES_ONLY)
    config = (REPO / "tests/conftest.py").read_text().split('SMALL_PIPELINE = """')[1].split('"""')[0]
    (tmp_path / "pipelines.yaml").write_text(config)
    stage.fn(pipeline="small", root=str(tmp_path))
    log = tmp_path / "examples/traces/support-agent-2026-11-02.jsonl"
    later = [json.dumps({**json.loads(_record(n)), "timestamp": f"2027-01-01T00:00:{n:02d}Z",
                         "messages": [{"role": "user", "content": f"What is {n} * 7?"},
                                      {"role": "assistant", "content": f"{7 * n}"}]}) for n in range(40, 45)]
    _append(log, later + [log.read_text().splitlines()[0]])  # and a retried upload of an earlier record
    second = stage.fn(pipeline="small", root=str(tmp_path))
    assert second.metrics["traces_new"] == 5 and second.metrics["duplicates"] >= 1
    full = stage.fn(pipeline="small", root=str(tmp_path), full=True)
    assert full.outputs == second.outputs and full.metrics["tasks_from_traces"] == \
        second.metrics["tasks_from_traces"]


def test_worker_processes_write_the_tables_one_process_writes(tmp_path, mlflow_store, monkeypatch):
    """Records in batches of 7 through 2 forked workers (tasks made there too) against one process: the same
    bytes, metrics and quarantine, with bad lines, personal data and duplicates among them."""
    import yaml

    from flywheel.data import collection
    from tasks.collect import collect as stage

    shutil.copytree(REPO / "examples", tmp_path / "examples", ignore=SOURCES_ONLY)
    config = yaml.safe_load((REPO / "tests/conftest.py").read_text().split('SMALL_PIPELINE = """')[1]
                            .split('"""')[0])
    log = tmp_path / "examples/traces/support-agent-2026-11-02.jsonl"
    extra = [json.dumps({**json.loads(_record(n)), "messages": [
        {"role": "user", "content": f"What is {n} * 3? Mail me at user{n}@example.com"},
        {"role": "assistant", "content": f"{3 * n}"}]}) for n in range(60)]
    _append(log, extra + ["{bad", extra[0], "[1]"])
    monkeypatch.setattr(collection, "BATCH", 7)
    monkeypatch.setattr(sources, "BLOCK_BYTES", 2_000)  # JSON Lines: a few records a block
    process, pids = collection._process, tmp_path / "pids"

    def noted(*args):  # which process did each batch (a file: the workers are other processes)
        with pids.open("a") as handle:
            handle.write(f"{os.getpid()}\n")
        return process(*args)

    monkeypatch.setattr(collection, "_process", noted)
    results, used = {}, {}
    for workers in (1, 2):
        pids.write_text("")
        config["pipelines"]["small"]["collect"]["workers"] = workers
        (tmp_path / "pipelines.yaml").write_text(yaml.safe_dump(config))
        result = stage.fn(pipeline="small", root=str(tmp_path), full=True)
        tables = {p.name: p.read_bytes() for p in sorted((tmp_path / "data/small/collect").glob("*.parquet"))}
        results[workers] = (result.outputs, result.metrics, tables)
        used[workers] = set(pids.read_text().split())
    assert used[1] == {str(os.getpid())} and len(used[2]) == 2 and str(os.getpid()) not in used[2]
    one, two = results[1], results[2]
    assert one[1]["records"] > 3 * 7 and one[1]["quarantined"] >= 2 and one[1]["redacted_email"] >= 60
    assert one[1]["tasks_from_traces"] > 0
    assert two == one
    # the tasks the workers made are the ones build_tasks makes itself from the written traces table
    import pyarrow.parquet as pq

    from flywheel.config import load_pipeline
    from flywheel.data.tasksets import build_tasks
    from flywheel.envs import load_environment

    cfg = load_pipeline("small", tmp_path / "pipelines.yaml")
    traces_table = pq.read_table(tmp_path / "data/small/collect/traces.parquet").to_pylist()
    rebuilt = build_tasks(load_environment(cfg.environment, tmp_path), cfg.environment,
                          cfg.collect.heldout_fraction, traces_table)
    assert rebuilt == pq.read_table(tmp_path / "data/small/collect/tasks.parquet").to_pylist()


def test_a_worker_that_dies_fails_the_collect_with_what_to_do(tmp_path, monkeypatch):
    import pytest

    from flywheel.data import collection

    _append(tmp_path / "b.jsonl", [_record(n) for n in range(30)])
    cfg = CollectConfig(sources=["*.jsonl"], workers=2)
    parent, process = os.getpid(), collection._process

    def dies(*args):  # a worker killed mid-batch (the OOM killer, say)
        if os.getpid() != parent:
            os._exit(9)
        return process(*args)

    monkeypatch.setattr(sources, "BLOCK_BYTES", 1_000)
    monkeypatch.setattr(collection, "_process", dies)
    with pytest.raises(RuntimeError, match="ended abruptly .* `collect.workers: 1`"):
        collect([FileReader(cfg.sources[0], tmp_path, cfg.max_record_bytes)], cfg, Redactor(cfg.redact))
    one = CollectConfig(sources=["*.jsonl"], workers=1)
    found = collect([FileReader(one.sources[0], tmp_path, one.max_record_bytes)], one, Redactor(one.redact))
    assert len(found.traces) == 30


WORKERS_LEFT = """
import multiprocessing, os, time
from concurrent.futures import ProcessPoolExecutor
from flywheel.data import collection
pool = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork"), initializer=collection._set_worker,
                           initargs=(None, os.getpid()))
print(" ".join(str(pid) for pid in {pool.submit(os.getpid).result() for _ in range(8)} | set(pool._processes)),
      flush=True)
time.sleep(600)
"""


def test_collects_workers_end_with_a_stage_killed_by_sigkill():
    """A forked worker holds its own end of the pool's pipe: without the parent-death signal it would wait for
    work forever once the stage's process is SIGKILLed."""
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    stage = subprocess.Popen([sys.executable, "-c", WORKERS_LEFT], env=env, stdout=subprocess.PIPE, text=True)
    workers = [int(pid) for pid in stage.stdout.readline().split()]
    assert workers and stage.pid not in workers
    stage.send_signal(signal.SIGKILL)
    stage.wait()
    deadline = time.monotonic() + 30
    while (left := [pid for pid in workers if _running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:  # nothing left behind by a failing test either
        os.kill(pid, signal.SIGKILL)
    assert left == []


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def test_the_tasks_table_takes_the_tasks_collect_made_and_makes_the_rest(tmp_path):
    """A merged table whose task columns hold the new rows' tasks (made in collect) and nothing for the stored
    rows: task_table makes the stored rows' tasks itself and builds the table it builds from the rows alone."""
    from functools import partial

    from flywheel.config import EnvironmentConfig
    from flywheel.data import tasksets, tracetable
    from flywheel.envs import load_environment

    env_cfg = EnvironmentConfig(name="calculator", train_tasks=4, heldout_tasks=2)
    env = load_environment(env_cfg, tmp_path)
    cfg = CollectConfig(sources=["*.jsonl"])
    _append(tmp_path / "b.jsonl", [_record(n) for n in range(0, 40, 2)])
    first = collect([FileReader(cfg.sources[0], tmp_path, cfg.max_record_bytes)], cfg, Redactor(cfg.redact))
    _append(tmp_path / "b.jsonl", [_record(n) for n in range(1, 40, 2)])  # their times fall among the stored ones
    new = collect([FileReader(cfg.sources[0], tmp_path, cfg.max_record_bytes)], cfg, Redactor(cfg.redact),
                  since=first.states, tasks_of=partial(tasksets.made_tasks, env, 0.1)).table
    assert new.num_rows == 20 and new.column("task:made").to_pylist() == [True] * 20  # made for every new row
    stored = first.table
    merged = tracetable.merge(stored, new)
    assert not merged.appended and merged.table.column("task:made").null_count == stored.num_rows
    rows = merged.table.select(tracetable.SCHEMA.names).to_pylist()
    expected = tasksets.build_tasks(env, env_cfg, 0.1, rows)
    assert sum(row["origin"] == "trace" for row in expected) > 20
    assert tasksets.task_table(env, env_cfg, 0.1, merged.table).to_pylist() == expected
    # the made columns are what it takes for those rows (not made again): a changed one shows
    answers = merged.table.column("task:answer").to_pylist()
    made = next(i for i, done in enumerate(merged.table.column("task:made").to_pylist()) if done)
    answers[made] = '{"expression": "changed", "value": 0}'
    changed = merged.table.set_column(merged.table.column_names.index("task:answer"), "task:answer",
                                      pa.array(answers, pa.string()))
    built = tasksets.task_table(env, env_cfg, 0.1, changed).to_pylist()
    assert [row["answer"] for row in built].count('{"expression": "changed", "value": 0}') == 1


def test_bad_records_of_every_format_cross_to_the_worker_processes(tmp_path, monkeypatch):
    """A .json file's element that is no object comes to a worker as a BadRecord (pickled), and is quarantined
    with its kind and reason, as in one process."""
    from flywheel.data import collection

    (tmp_path / "a.json").write_text(json.dumps([json.loads(_record(1)), 5, json.loads(_record(2))]))
    _append(tmp_path / "b.jsonl", [_record(n) for n in range(3, 9)])
    monkeypatch.setattr(collection, "BATCH", 1)
    found = {}
    for workers in (1, 2):
        cfg = CollectConfig(sources=["*.json*"], workers=workers)
        found[workers] = collect([FileReader(cfg.sources[0], tmp_path, cfg.max_record_bytes)], cfg,
                                 Redactor(cfg.redact))
    assert [(q["location"], q["kind"], q["reason"]) for q in found[2].quarantine] == \
        [("a.json:2", "wrong_type", "element 2 is not an object")]
    assert found[2].quarantine == found[1].quarantine and found[2].traces == found[1].traces
    assert len(found[2].traces) == 8


def test_the_stage_allocates_arrow_from_the_system_allocator_and_puts_the_default_back():
    from flywheel.data.collection import system_allocator

    before = pa.default_memory_pool().backend_name
    with system_allocator():
        assert pa.default_memory_pool().backend_name == "system"
        assert pa.array(["x" * 1000] * 10).buffers()[2].size >= 10_000  # allocations work from it
    assert pa.default_memory_pool().backend_name == before
