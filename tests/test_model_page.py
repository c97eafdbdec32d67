"""What a person reads of a candidate: the registered version's description (read back through MLflow's client),
the plots, `flywheel status` in 120 columns saying `refused`, the run summary's commands one line each.

The description written by the real register stage is checked in tests/test_retrain_flow.py (slow).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from mlflow import MlflowClient

from flywheel import plots, registry, tags
from flywheel.evaluate import summary
from flywheel.stages import GateReport, RetrainSummary

DEMO = GateReport.from_dict(json.loads((Path(__file__).parent / "gate_report_demo.json").read_text()))
REFUSED = dataclasses.replace(DEMO, passed=False, refused=["base scores 0.9900: no room above it (margin 0.03)"],
                              reasons=["base scores 0.9900: no room above it (margin 0.03)"])


def _stand_in(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def test_the_version_description_says_the_decision_first_then_the_table(tmp_path, mlflow_store):
    run = registry.start_run(tmp_path, "p", "register")
    version = registry.register(run, "p", _stand_in(tmp_path), "hash-a", tags.gate_tag(True), ["challenger"])
    data = {"data/p/collect": "0123456789abcdef0123", "models/p/rl": "fedcba9876543210"}
    links = summary.Links(MlflowClient().get_run(run.run_id).info.experiment_id, {"pipeline": "a" * 32,
                                                                                   "register": run.run_id})
    markdown = summary.render("p", DEMO, summary.Registration("1", ["challenger", "champion"], True, ["gate"]),
                              data, links)
    registry.describe("p", version.version, markdown)

    shown = MlflowClient().get_model_version("p", "1").description
    assert shown == markdown
    first = shown.splitlines()[0]
    assert first == "**Gate: passed.** Version 1 (aliases: `challenger`, `champion`); it is champion."
    table = [line for line in shown.splitlines() if line.startswith("| ")]
    # the null row first, each model's mean reward with its interval beside its pass rate
    assert table[1] == "| null (empty answer) | 0.000 [0.000, 0.000] | 0.000 | 214 |"
    assert table[4] == "| rl (candidate) | 0.944 [0.911, 0.972] | 0.944 | 214 |"
    assert "| `data/p/collect` | `0123456789ab` |" in shown
    assert f"[`{run.run_id[:8]}`](#/experiments/{links.experiment_id}/runs/{run.run_id})" in shown
    assert len(shown) < registry.DESCRIPTION_CHARS

    long = markdown + "\n".join(f"- line {i}" for i in range(2000))
    registry.describe("p", version.version, long)  # PostgreSQL would refuse more than the column holds
    cut = MlflowClient().get_model_version("p", "1").description
    assert len(cut) <= registry.DESCRIPTION_CHARS and cut.startswith(first) and "cut at MLflow's 5000" in cut


def test_a_refused_or_failed_gate_says_so_in_its_first_line():
    refused = summary.render("p", REFUSED, summary.Registration("2", ["challenger"], False, champion="1"))
    assert refused.splitlines()[0] == ("**Gate: REFUSED: the eval cannot measure this candidate.** Version 2 "
                                       "(aliases: `challenger`); champion stays version 1.")
    assert "Promotion:" not in refused  # nothing said beyond the gate's reasons
    rerun = summary.render("p", REFUSED, summary.Registration("2", ["challenger"], False, ["not offered"], "1"))
    assert "\nPromotion:\n- not offered\n" in rerun
    failed = dataclasses.replace(DEMO, passed=False, reasons=["candidate score 0.5 < min_score 0.8"])
    assert summary.render("p", failed).splitlines()[0] == "**Gate: failed: not promoted.**"
    assert summary.verdict(REFUSED) == "refused" and summary.verdict(failed) == "failed"


def test_the_plots_are_pngs_with_every_model_and_slice(tmp_path):
    bars = plots.slice_bars(DEMO.slice_scores, "demo")
    curve = plots.curves({"sft": [(2, 1.5), (4, 0.9), (6, 0.4)]}, "sft: loss per step", "loss")
    for image in (bars, curve):
        assert image.startswith(b"\x89PNG\r\n\x1a\n") and len(image) > 2000
    uri = plots.data_uri(curve)
    markdown = summary.render("p", DEMO, images=[("sft learning curve", uri)])
    assert markdown.rstrip().endswith(f"![sft learning curve]({uri})")


def _status_state():
    import pandas as pd

    from flywheel.status import AliasState, PipelineStatus, RunState

    when = pd.Timestamp("2026-12-06 05:00", tz="UTC")
    run_id = "0123456789abcdef0123456789abcdef"
    data = {f"data/demo/{s}": "0123456789abcdef" for s in ("collect", "synthesize", "rl", "evaluate")}
    return PipelineStatus("demo", [AliasState("champion", "1", 0.9486, when, run_id, "passed", "gate", data, 0.9486),
                                   AliasState("challenger", "2", 0.99, when, run_id, "refused", "", data, 0.99)],
                          [RunState(run_id, when, "FINISHED", "refused", "2",
                                    {s: "ran" for s in ("collect", "synthesize", "sft", "rl", "evaluate", "register")},
                                    run_id, data)])


def test_status_fits_120_columns_with_short_ids_and_says_refused(capsys, monkeypatch):
    from flywheel.cli.render import print_status

    monkeypatch.setenv("COLUMNS", "120")
    print_status("demo", _status_state(), "retrain/demo at 2026-12-07 03:00 UTC")
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 120, out
    runs = [line for line in out.splitlines() if line.lstrip("│ ").startswith("01234567")]
    assert runs and all("0123456789abcdef0123" not in line for line in runs), out  # whole ids would not fit
    assert "refused" in out and "failed" not in out


def test_status_says_refused_where_the_gate_refused(tmp_path, mlflow_store):
    from flywheel.status import pipeline_status

    refused = tags.gate_tag(False) | {tags.GATE_REFUSED_TAG: "base at the ceiling"}
    parent = registry.start_run(tmp_path, "p", "retrain", tags=refused | {tags.REGISTERED_VERSION_TAG: "1"})
    parent.end()
    run = registry.start_run(tmp_path, "p", "register")
    registry.register(run, "p", _stand_in(tmp_path), "hash-a", refused, ["challenger"])
    state = pipeline_status("p")
    assert [a.gate for a in state.aliases] == ["refused"] and [r.gate for r in state.runs] == ["refused"]


@pytest.mark.parametrize("width", [60, 80])
def test_the_summary_prints_each_ui_command_on_one_line(tmp_path, monkeypatch, capsys, width):
    from flywheel.cli.render import print_summary
    from flywheel.cli.ui import ui_commands

    monkeypatch.setenv("COLUMNS", str(width))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'a-long-folder-name' / 'mlflow.db'}")
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / ".flywheel" / "prefect"))
    done = RetrainSummary(pipeline="demo", scores={"score_null": 0.0, "score_rl": 0.9}, gate_passed=False,
                          gate_reasons=["base at the ceiling"], version="2", aliases=["challenger"], champion="1",
                          ran=["evaluate", "register"], cached=[], refused=["base at the ceiling"])
    print_summary(done, tmp_path, 3.0)
    lines = capsys.readouterr().out.splitlines()
    assert "gate: refused: the eval cannot measure this candidate" in lines
    commands = ui_commands(tmp_path)
    for command in commands.values():
        assert f"    {command}" in lines, lines  # whole, however narrow the terminal
    prefect = commands["Prefect UI"]
    assert re.search(r"PREFECT_UI_API_URL=http://127\.0\.0\.1:4200/api .*prefect server start .*--port 4200$",
                     prefect), prefect
    assert "--port 4301" in ui_commands(tmp_path, prefect_port=4301)["Prefect UI"]
    assert "PREFECT_UI_API_URL=http://127.0.0.1:4301/api" in ui_commands(tmp_path, prefect_port=4301)["Prefect UI"]
