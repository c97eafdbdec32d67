"""What a person sees of a stage outside the terminal: Prefect artifacts (the eval's table, the candidate's
summary with its plots, the reward-hacking monitor) and the plots as PNG artifacts of the MLflow runs."""

from __future__ import annotations

from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.context import TaskRunContext

from flywheel import plots
from flywheel.evaluate import summary
from flywheel.metrics import CURVES
from flywheel.stages import GateReport
from tasks.progress import curve_png

SLICES_PNG = "gate_slices.png"  # the evaluate run's bars of held-out reward per slice and model


def slices_png(pipeline: str, report: GateReport) -> bytes | None:
    """Bars of held-out mean reward per slice, one per model (null, base, sft, rl, champion, references)."""
    if not report.slice_scores:
        return None
    return plots.slice_bars(report.slice_scores, f"{pipeline}: held-out mean reward by slice")


def images(pipeline: str, report: GateReport, runs: dict[str, str]) -> list[tuple[str, str]]:
    """The plots for a markdown artifact, as data URIs (Prefect's UI shows data: images): the per-slice bars and
    the learning curves of the stage runs named in `runs`."""
    found = []
    bars = slices_png(pipeline, report)
    if bars is not None:
        found.append(("Held-out mean reward by slice", plots.data_uri(bars)))
    for stage in CURVES:
        image = curve_png(runs[stage], stage) if runs.get(stage) else None
        if image is not None:
            found.append((f"{stage} learning curve", plots.data_uri(image)))
    return found


def publish_eval_report(pipeline: str, report: GateReport) -> None:
    """Attach the eval report to the running Prefect task; a no-op when the stage runs outside Prefect."""
    if TaskRunContext.get() is None:
        return
    # one row per (model, slice): the mean reward and the pass rate side by side, the null policy's row first
    rows = [{"model": s["model"], "slice": s["slice"], "mean reward": round(s["score"], 4),
             "pass rate": round(s["pass_rate"], 4), "tasks": s["tasks"]} for s in report.slice_scores]
    create_table_artifact(key=f"{pipeline}-eval-scores", table=rows,
                          description=f"Held-out mean reward and pass rate by model and slice ({pipeline})")
    create_markdown_artifact(key=f"{pipeline}-gate", markdown=summary.render(
        pipeline, report, images=images(pipeline, report, {})),
        description=f"Promotion gate decision ({pipeline})")


def publish_model_report(pipeline: str, markdown: str) -> None:
    """The registered version's summary (its description in MLflow, with the plots) as a Prefect artifact."""
    if TaskRunContext.get() is None:
        return
    create_markdown_artifact(key=f"{pipeline}-model", markdown=markdown,
                             description=f"The candidate registered by this run, and why ({pipeline})")


def publish_monitor_report(pipeline: str, report: dict) -> None:
    """The reward-hacking monitor's checks and verdict as a Prefect artifact; a no-op outside Prefect."""
    if TaskRunContext.get() is None:
        return
    verdict = "FLAGGED: " + report["reason"] if report["flagged"] else "not flagged"
    lines = [f"# Reward-hacking monitor: {verdict}", "",
             "| policy version | audit_pass | audit reward | reward_audit_gap | training reward |",
             "|---|---|---|---|---|",
             *[f"| {c['version']} | {c['audit_pass']:.3f} | {c['audit_reward']:.3f} | {c['reward_audit_gap']:+.3f} | "
               + ("" if c["train_reward"] is None else f"{c['train_reward']:.3f}") + " |" for c in report["checks"]]]
    create_markdown_artifact(key=f"{pipeline}-reward-monitor", markdown="\n".join(lines),
                             description=f"Audit of the RL policy on held-out tasks ({pipeline})")
