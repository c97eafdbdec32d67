"""`flywheel compare`: retrain runs read back from MLflow into one table and an HTML report."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from flywheel import comparison, registry


def _retrain_run(root, score: float, gate: str, version: str) -> str:
    """A retrain run as the flow logs it: a parent with stage runs, curves, eval scores and gate.json."""
    parent = registry.start_run(root, "small", "retrain")
    tags = {"flywheel.gate": gate, "flywheel.registered_version": version,
            "flywheel.dvc.data/small/collect": "0123456789abcdef"}
    for stage in ("sft", "rl", "evaluate"):
        with registry.stage_run(root, "small", stage, parent.run_id, {stage: {"steps": 3}}) as run:
            if stage == "sft":
                for step, loss in enumerate([2.0, 1.0, 0.5], start=1):
                    run.metrics({"loss": loss}, step=step)
                run.metrics({"final_loss": 0.5})
            if stage == "rl":
                run.metrics({"reward_mean": score}, step=1)
                run.metrics({"final_reward_mean": score})
            if stage == "evaluate":
                run.metrics({"score_base": 0.1, "score_sft": 0.5, "score_rl": score, "gate_candidate_low": score - 0.1,
                             "gate_candidate_high": score + 0.05, "gate_diff_estimate": 0.02, "gate_diff_low": -0.01})
                report = root / f"gate-{version}" / "gate.json"
                report.parent.mkdir()
                report.write_text(json.dumps({"reasons": [f"candidate score {score}"], "slice_scores": [
                    {"model": "rl", "slice": "add", "score": score, "low": score - 0.1, "high": score + 0.1}]}))
                run.artifact(report)
        tags[f"stage.{stage}.run_id"] = run.run_id
    parent.tags(tags)
    parent.end()
    return parent.run_id


def test_compare_prints_the_last_runs_and_writes_html(project, tmp_path):
    from flywheel.cli import app

    old = _retrain_run(tmp_path, 0.7, "passed", "1")
    new = _retrain_run(tmp_path, 0.9, "failed", "2")
    rows = comparison.retrain_runs("small", last=5)
    assert [r["run_id"] for r in rows] == [new, old]
    assert rows[0]["curves"]["sft loss"] == [(1, 2.0), (2, 1.0), (3, 0.5)]
    assert rows[0]["data"] == {"collect": "01234567"}
    table = comparison.summary_table(rows)
    assert table.loc[0, "rl [95% CI]"] == "0.900 [0.800, 0.950]" and table.loc[1, "gate"] == "passed"

    out = CliRunner().invoke(app, ["compare", "small", "--last", "1", "--html", str(tmp_path / "r.html"),
                                   "--root", str(project)])
    assert out.exit_code == 0, out.output
    assert new[:8] in out.output and old[:8] not in out.output
    page = (tmp_path / "r.html").read_text()
    assert "Learning curves" in page and "data:image/png;base64" in page and "candidate score 0.9" in page
    missing = CliRunner().invoke(app, ["compare", "nothing", "--root", str(project)])
    assert missing.exit_code == 2
