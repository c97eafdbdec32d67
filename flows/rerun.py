"""`flywheel rerun <run-id>`: a recorded retrain run again, in a workspace of its own, from its config and data.

The stages whose inputs lie outside the project (collect by default) are checked out from DVC by the md5s
the run recorded, not run: their sources may hold other records today. The stages after them run with the
recorded config through the same retrain flow, then every output is compared with the recorded one. The
rerun is an MLflow run like any other, tagged `flywheel.rerun_of`; it registers its model but leaves
champion alone unless `promote` is set.
"""

from __future__ import annotations

from pathlib import Path

from flows.retrain import retrain
from flywheel import registry, reproduce
from flywheel.config import load_pipeline
from flywheel.data.catalog import Catalog
from flywheel.stages import ORDER
from flywheel.tags import RERUN_DATASETS_TAG, RERUN_OF_TAG, RERUN_SCORES_TAG, gate_verdict

RESTORABLE = list(ORDER[:2])  # collect reads trace sources, synthesize a teacher: both may answer differently today


def rerun(run_id: str, root: str = ".", promote: bool = False, push: bool = True,
          restore: tuple[str, ...] = ("collect",)) -> reproduce.RerunReport:
    """Run a recorded retrain run again and say, output by output and score by score, what it reproduced."""
    root_path = Path(root).resolve()
    restore = list(restore)
    if restore != RESTORABLE[:len(restore)]:
        raise reproduce.RerunError(f"--restore takes the first stages in order, from {', '.join(RESTORABLE)} "
                                   f"(got {', '.join(restore) or 'none'}): a stage runs on what the one before "
                                   "it wrote")
    recorded = reproduce.recorded_run(run_id)
    run_id = recorded.run_id  # the whole id where the first characters were given
    warnings = reproduce.warnings(recorded, root_path)
    for warning in warnings:
        print(f"warning: {warning}", flush=True)
    ws = reproduce.prepare_workspace(root_path, recorded, ORDER)
    print(f"rerun of {run_id} ({recorded.pipeline}) in {ws.path}", flush=True)
    for stage in restore:
        reproduce.restore(ws, recorded, stage)
    if not reproduce.fetch_recorded(ws, recorded, reproduce.MEASURED):
        warnings.append("the recorded eval table is not in DVC: scores are compared with the recorded numbers")

    summary = retrain(pipeline=recorded.pipeline, root=str(ws.path), push=push, restored=restore,
                      tags={RERUN_OF_TAG: run_id}, promote=promote)

    gate = load_pipeline(recorded.pipeline, ws.path / "pipelines.yaml").gate
    report = reproduce.RerunReport(
        run_id=run_id, rerun_id=summary.run_id, pipeline=recorded.pipeline, workspace=ws.path,
        outputs=reproduce.compare_outputs(recorded, ws.path, ws.cache, ORDER, restore),
        scores=reproduce.compare_scores(recorded, reproduce.recorded_eval(recorded, ws.cache),
                                        Catalog(ws.path, recorded.pipeline).read("eval"), gate.confidence,
                                        gate.bootstrap_samples, gate.seed),
        code_changes=reproduce.code_changes(recorded, ws.path), warnings=warnings, gate_recorded=recorded.gate,
        gate_reproduced=gate_verdict(summary.gate_passed), version=summary.version, champion=summary.champion)
    run = registry.Run(report.rerun_id)
    run.tags({RERUN_DATASETS_TAG: "identical" if report.datasets_identical else "differ",
              RERUN_SCORES_TAG: "within_noise" if report.scores_within_noise else "outside_noise"})
    run.text(report.to_json(), "flywheel/rerun.json")
    return report
