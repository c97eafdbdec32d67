"""What crosses the stage boundaries, typed: the gate report (gate.json) and the retrain summary, each written and
read in one place, older stored shapes read there and nowhere else."""

from __future__ import annotations

import json
import pickle
from dataclasses import replace
from pathlib import Path

import pytest

from flywheel.data.catalog import Catalog
from flywheel.stages import GateReport, RetrainSummary, StageResult

# data/demo/evaluate/gate.json as `flywheel run demo` wrote it before the report was typed (the dict the evaluate
# stage built, through Catalog.write_json)
REAL = Path(__file__).parent / "gate_report_demo.json"

# a report of the first evaluate stages, before refusals, pass rates, per-model rows, references, user errors and
# warnings were measured
OLDER = {"passed": False, "reasons": ["candidate score 0.4000 < min_score 0.5"],
         "numbers": {"candidate": {"score": 0.4, "low": 0.3, "high": 0.5}, "diff": None, "mode": "improve"},
         "scores": {"score_base": 0.1, "score_sft": 0.35, "score_rl": 0.4}, "candidate_hash": "c0ffee",
         "champion_version": None,
         "slice_scores": [{"model": "rl", "slice": "all", "score": 0.4, "low": 0.3, "high": 0.5, "tasks": 20}]}


def test_a_real_report_reads_back_equal_and_writes_the_same_bytes(tmp_path):
    text = REAL.read_text()
    report = GateReport.from_dict(json.loads(text))
    assert report.passed and report.candidate_hash == "5a1e6b0bdce9b3daa8e45dd89f3003ab"
    assert report.scores["score_rl"] == report.pass_rates["pass_rate_rl"] and len(report.slice_scores) == 16
    written = Catalog(tmp_path, "demo").write_json("evaluate", "gate.json", report.to_dict())
    assert written.read_text() == text, "gate.json is a DVC output: the same report, the same bytes"
    assert GateReport.from_dict(json.loads(written.read_text())) == report


def test_an_older_report_reads_with_what_it_lacks_empty():
    report = GateReport.from_dict(OLDER)
    assert not report.passed and report.scores == OLDER["scores"] and report.champion_version is None
    assert (report.refused, report.pass_rates, report.models, report.references, report.user_errors,
            report.warnings) == ([], {}, [], {}, {}, [])
    assert GateReport.from_dict(report.to_dict()) == report
    assert list(report.to_dict()) == ["passed", "reasons", "refused", "numbers", "scores", "pass_rates", "models",
                                      "references", "user_errors", "warnings", "candidate_hash", "champion_version",
                                      "slice_scores"], "the order the evaluate stage has always built"


def test_a_report_without_its_decision_is_an_error_naming_what_is_missing():
    broken = {k: v for k, v in OLDER.items() if k not in ("passed", "candidate_hash")}
    with pytest.raises(ValueError, match=r"the gate report has no passed, candidate_hash: .* run the evaluate "
                                         r"stage again"):
        GateReport.from_dict(broken)


def test_a_stage_result_cached_with_a_dict_gate_loads_with_a_report():
    """Prefect pickled evaluate's StageResult with gate.json's dict before the report was typed."""
    cached = StageResult("evaluate", "run-1", {"score_rl": 0.4}, {"data/p/evaluate": "abc"}, gate=dict(OLDER))
    loaded = pickle.loads(pickle.dumps(cached))
    assert loaded.gate == GateReport.from_dict(OLDER) and loaded.outputs == {"data/p/evaluate": "abc"}
    typed = replace(cached, gate=GateReport.from_dict(OLDER))
    assert pickle.loads(pickle.dumps(typed)) == typed
    assert pickle.loads(pickle.dumps(StageResult("sft", "run-2"))).gate is None


def test_an_older_summary_reads_with_what_it_lacks_empty():
    older = {"pipeline": "demo", "scores": {"score_rl": 0.9}, "gate_passed": True, "gate_reasons": ["ok"],
             "version": "3", "aliases": ["champion"], "champion": "3", "ran": ["sft"], "restored": [],
             "cached": ["collect"], "run_id": "r1"}
    summary = RetrainSummary.from_dict(older)
    assert (summary.pass_rates, summary.references, summary.warnings, summary.refused, summary.student) == \
        ({}, {}, [], [], "")
    assert summary.version == "3" and summary.cached == ["collect"]
    assert RetrainSummary.from_dict(summary.to_dict()) == summary
    assert list(summary.to_dict())[:5] == ["pipeline", "scores", "gate_passed", "gate_reasons", "version"]
    with pytest.raises(ValueError, match="the retrain summary has no version: .* run the pipeline again"):
        RetrainSummary.from_dict({k: v for k, v in older.items() if k != "version"})
