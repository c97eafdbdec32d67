"""The collect stage: traces validated, malformed records quarantined with reasons, split by content hash."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from flywheel.data.catalog import Catalog, DataError
from flywheel.data.traces import collect_files
from flywheel.envs.base import prompt_hash, split_of

REPO = Path(__file__).resolve().parent.parent
CALL = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}
GOOD = {"messages": [{"role": "user", "content": "What is 2+3?"},
                     {"role": "assistant", "content": None, "tool_calls": [CALL]},
                     {"role": "tool", "tool_call_id": "c1", "content": "5"},
                     {"role": "assistant", "content": "The answer is 5."}], "outcome": "accepted", "score": 1.0}


def _lines(tmp_path: Path, lines: list) -> Path:
    path = tmp_path / "traces.jsonl"
    path.write_bytes(b"\n".join(x if isinstance(x, bytes) else json.dumps(x).encode() for x in lines) + b"\n")
    return path


@pytest.mark.parametrize("record, kind", [
    (b"{not json", "invalid_json"),
    (b"\xff\xfe bad bytes", "not_utf8"),
    ([1, 2], "wrong_type"),
    ({"messages": []}, "empty"),
    ({"messages": "hello"}, "wrong_type"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "unknown_role"),
    ({"messages": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "tool_calls": [CALL]}]},
     "unanswered_tool_call"),
    ({"messages": [{"role": "user", "content": "2+3?"}, {"role": "tool", "tool_call_id": "x", "content": "5"}]},
     "orphan_tool_result"),
    ({"messages": [{"role": "user", "content": 5}]}, "wrong_type"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "no_user_message"),
    ({**GOOD, "outcome": "great"}, "bad_outcome"),
])
def test_malformed_records_are_quarantined_with_their_kind(tmp_path, record, kind):
    found = collect_files([_lines(tmp_path, [GOOD, record])], tmp_path, 0.1)
    assert len(found.traces) == 1, "the valid neighbour is kept"
    assert [q["kind"] for q in found.quarantine] == [kind]
    assert found.quarantine[0]["location"].endswith("traces.jsonl:2")


def test_duplicates_are_dropped_and_split_follows_the_prompt_hash(tmp_path):
    found = collect_files([_lines(tmp_path, [GOOD, GOOD])], tmp_path, 0.5)
    assert len(found.traces) == 1 and found.duplicates == 1
    expected = split_of(prompt_hash(GOOD["messages"][:1]), 0.5)
    assert found.traces[0]["split"] == expected


def test_the_example_traces(tmp_path):
    files = sorted((REPO / "examples/traces").glob("*.jsonl"))
    found = collect_files(files, REPO, 0.1)
    outcomes = {t["outcome"] for t in found.traces}
    assert outcomes == {"accepted", "rejected"}
    assert 4 <= len(found.quarantine) <= 10
    assert {"invalid_json", "unknown_role"} <= {q["kind"] for q in found.quarantine}


def test_collect_stage_writes_valid_tables(tmp_path, mlflow_store):
    from tasks.collect import TooManyBadRecords, collect

    shutil.copytree(REPO / "examples", tmp_path / "examples")
    config = (REPO / "tests/conftest.py").read_text().split('SMALL_PIPELINE = """')[1].split('"""')[0]
    (tmp_path / "pipelines.yaml").write_text(config)
    result = collect.fn(pipeline="small", root=str(tmp_path))
    catalog = Catalog(tmp_path, "small")
    tasks = catalog.read("tasks")
    assert (tasks["split"] == "train").sum() >= 600 and (tasks["split"] == "heldout").sum() >= 60
    assert set(tasks["origin"]) == {"generated", "trace"}
    assert tasks["task_id"].is_unique
    assert result["metrics"]["quarantined"] == len(catalog.read("quarantine"))

    (tmp_path / "examples/traces/zz-broken.jsonl").write_text("{broken\n" * 200)
    with pytest.raises(TooManyBadRecords, match="invalid_json"):
        collect.fn(pipeline="small", root=str(tmp_path))


def test_catalog_refuses_a_table_that_breaks_its_contract(tmp_path):
    catalog = Catalog(tmp_path, "p")
    bad = pd.DataFrame([{"model": "m", "task_id": "t", "sample": 0, "reward": 1.5, "passed": True, "slice": "s"}])
    with pytest.raises(DataError, match="Eval contract"):
        catalog.write("eval", bad)
    assert not catalog.table_path("eval").exists()
    with pytest.raises(DataError, match="run the stage 'collect' first"):
        catalog.read("traces")
