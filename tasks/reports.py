"""Eval reports as Prefect artifacts (a table of scores per slice, the gate decision in markdown)."""

from __future__ import annotations

import pandas as pd
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.context import TaskRunContext


def publish_eval_report(pipeline: str, report: dict, table: pd.DataFrame) -> None:
    """Attach the eval report to the running Prefect task; a no-op when the stage runs outside Prefect."""
    if TaskRunContext.get() is None:
        return
    scores = (table.groupby(["model", "slice"])["reward"].mean().unstack("slice").reset_index())
    scores["all"] = table.groupby("model")["reward"].mean().reindex(scores["model"]).to_numpy()
    create_table_artifact(key=f"{pipeline}-eval-scores", table=scores.round(4).to_dict("records"),
                          description=f"Held-out reward by model and slice ({pipeline})")
    verdict = "PASSED" if report["passed"] else "NOT PROMOTED"
    lines = [f"# Gate: {verdict}", "", *[f"- {r}" for r in report["reasons"]]]
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
