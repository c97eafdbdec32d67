"""What the gate looked at, for people: per-model and per-slice scores (mean reward with its bootstrap interval, and
pass rate, side by side), the reference arms' shares."""

from __future__ import annotations

import pandas as pd

from flywheel.config import GateConfig
from flywheel.evaluate.stats import bootstrap_mean

# the models evaluate itself scores, in the order tables show them; references and others follow
ORDER = ("null", "base", "sft", "rl", "champion")


def labels(table: pd.DataFrame) -> list[str]:
    """The models of an eval table in display order: the null policy and the students first, then the rest."""
    present = list(dict.fromkeys(table["model"]))
    return [m for m in ORDER if m in present] + [m for m in present if m not in ORDER]


def _interval(part: pd.DataFrame, gate: GateConfig):
    by_task = part.groupby("task_id")["reward"].mean().to_numpy(dtype=float)
    return bootstrap_mean(by_task, n=gate.bootstrap_samples, alpha=1 - gate.confidence, seed=gate.seed), len(by_task)


def model_scores(table: pd.DataFrame, gate: GateConfig, unanswered: dict[str, int] | None = None) -> pd.DataFrame:
    """One row per model on its greedy episodes: mean reward with its interval over tasks, pass rate, cost per task.

    unanswered: model -> tasks it never answered (a reference endpoint that failed): its row is incomplete.
    """
    unanswered = unanswered or {}
    rows = []
    for model in labels(table):
        part = table[(table["model"] == model) & (table["sample"] == 0)]
        est, tasks = _interval(part, gate)
        rows.append({"model": model, "mean_reward": est.estimate, "low": est.low, "high": est.high,
                     "pass_rate": float(part["passed"].astype(float).mean()), "tasks": tasks,
                     "cost_per_task_usd": float(part["cost_usd"].mean()) if "cost_usd" in part else 0.0,
                     "unanswered": int(unanswered.get(model, 0))})
    for model, missing in unanswered.items():  # a reference that answered nothing at all
        if missing and model not in set(table["model"]):
            rows.append({"model": model, "mean_reward": None, "low": None, "high": None, "pass_rate": None,
                         "tasks": 0, "cost_per_task_usd": None, "unanswered": int(missing)})
    return pd.DataFrame(rows, columns=["model", "mean_reward", "low", "high", "pass_rate", "tasks",
                                       "cost_per_task_usd", "unanswered"])


def slice_scores(table: pd.DataFrame, gate: GateConfig, models: tuple[str, ...] | None = None) -> pd.DataFrame:
    """Mean reward per (model, slice) with its bootstrap interval over tasks, and the pass rate, for the models
    present (default: every model in the table)."""
    rows = []
    for model in models or labels(table):
        frame = table[table["model"] == model]
        for name, part in [("all", frame), *frame.groupby("slice", sort=True)]:
            if part.empty:
                continue
            est, tasks = _interval(part, gate)
            rows.append({"model": model, "slice": str(name), "score": est.estimate, "low": est.low,
                         "high": est.high, "pass_rate": float(part["passed"].astype(float).mean()), "tasks": tasks})
    return pd.DataFrame(rows, columns=["model", "slice", "score", "low", "high", "pass_rate", "tasks"])


def reference_shares(table: pd.DataFrame, candidate: str, reference: str, unanswered: int = 0,
                     failure: str = "") -> dict:
    """The candidate beside a reference on the tasks the reference answered (greedy): its share of the reference's
    pass rate and of its cost per task (None where the reference's is 0), and whether the reference is incomplete."""
    greedy = table[table["sample"] == 0]
    ref = greedy[greedy["model"] == reference]
    cand = greedy[(greedy["model"] == candidate) & greedy["task_id"].isin(set(ref["task_id"]))]
    numbers = {"tasks": int(ref["task_id"].nunique()), "unanswered": int(unanswered), "incomplete": unanswered > 0,
               "failure": failure}
    if ref.empty or cand.empty:
        return numbers | {"pass_rate": None, "mean_reward": None, "cost_per_task_usd": None, "pass_share": None,
                          "cost_share": None, "candidate_pass_rate": None, "candidate_cost_per_task_usd": None}
    ref_pass, cand_pass = float(ref["passed"].astype(float).mean()), float(cand["passed"].astype(float).mean())
    ref_cost, cand_cost = float(ref["cost_usd"].mean()), float(cand["cost_usd"].mean())
    return numbers | {"pass_rate": ref_pass, "mean_reward": float(ref["reward"].mean()),
                      "cost_per_task_usd": ref_cost, "candidate_pass_rate": cand_pass,
                      "candidate_cost_per_task_usd": cand_cost,
                      "pass_share": cand_pass / ref_pass if ref_pass > 0 else None,
                      "cost_share": cand_cost / ref_cost if ref_cost > 0 else None}


def reference_line(name: str, ref: dict) -> str:
    """One sentence on a reference arm: its pass rate, the candidate's share of it and of its cost per task."""
    missing = (f" INCOMPLETE: {ref['unanswered']} task(s) unanswered ({ref['failure']}); the shares are on the "
               f"{ref['tasks']} it answered" if ref["incomplete"] else "")
    if ref["pass_rate"] is None:
        return f"reference '{name}': no task answered{missing}"
    share = "n/a (it passes none)" if ref["pass_share"] is None else f"{ref['pass_share']:.1%}"
    cost = ("n/a (it is unpriced)" if ref["cost_share"] is None
            else f"{ref['cost_share']:.1%} of its cost per task (${ref['candidate_cost_per_task_usd']:.6f} vs "
                 f"${ref['cost_per_task_usd']:.6f})")
    return (f"reference '{name}': pass rate {ref['pass_rate']:.3f}; the candidate reaches {share} of it at "
            f"{cost}{missing}")

