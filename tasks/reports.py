"""Eval reports as Prefect artifacts (mean reward and pass rate per model and slice, the gate decision in markdown)."""

from __future__ import annotations

from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.context import TaskRunContext

from flywheel.evaluate.report import reference_line
from flywheel.stages import GateReport


def publish_eval_report(pipeline: str, report: GateReport) -> None:
    """Attach the eval report to the running Prefect task; a no-op when the stage runs outside Prefect."""
    if TaskRunContext.get() is None:
        return
    # one row per (model, slice): the mean reward and the pass rate side by side, the null policy's row first
    rows = [{"model": s["model"], "slice": s["slice"], "mean reward": round(s["score"], 4),
             "pass rate": round(s["pass_rate"], 4), "tasks": s["tasks"]} for s in report.slice_scores]
    create_table_artifact(key=f"{pipeline}-eval-scores", table=rows,
                          description=f"Held-out mean reward and pass rate by model and slice ({pipeline})")
    verdict = ("PASSED" if report.passed else
               "REFUSED: the eval cannot measure this candidate" if report.refused else "NOT PROMOTED")
    lines = [f"# Gate: {verdict}", "", *[f"- {r}" for r in report.reasons]]
    if report.references:
        lines += ["", "## References", *[f"- {reference_line(n, r)}" for n, r in report.references.items()]]
    if report.warnings:
        lines += ["", "## Warnings", *[f"- {w}" for w in report.warnings]]
    create_markdown_artifact(key=f"{pipeline}-gate", markdown="\n".join(lines),
                             description=f"Promotion gate decision ({pipeline})")


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
