"""Retrain runs side by side, from MLflow: data versions, key params, SFT/RL metrics, eval scores (mean reward and
pass rate), gate decisions."""

from __future__ import annotations

import base64
import html
import io
import json
import tempfile
from pathlib import Path

import pandas as pd
from mlflow.exceptions import MlflowException

from flywheel.metrics import (
    FINAL,
    GATE_COST_SAVING,
    GATE_COST_SAVING_LOW,
    GATE_REFUSED,
    PASS_RATE,
    RL_FINAL_AUDIT,
    RL_FINAL_GAP,
    RL_FINAL_HACKING,
    RL_FINAL_REWARD,
    RL_REWARD,
    SCORE,
    SFT_FINAL_LOSS,
    SFT_LOSS,
    pass_rate_name,
    score_name,
)
from flywheel.registry import client

PARAMS = ("sft.steps", "sft.lr", "rl.steps", "rl.lr", "rl.group_size", "rl.lr_schedule", "rl.difficulty_filter",
          "teacher.error_rate", "gate.mode", "gate.margin")
CURVES = {"sft": SFT_LOSS, "rl": RL_REWARD}  # the learning curve each training stage logs per step
MODELS = ("null", "base", "sft", "rl")  # the models of a run whose held-out scores the table shows
# summary_table's held-out columns: each model's mean reward (the candidate's with its interval), then pass rates
SCORE_COLUMNS = (*[f"{m} reward" for m in MODELS[:-1]], "rl reward [95% CI]", *[f"{m} pass" for m in MODELS],
                 "vs champion")


def retrain_runs(pipeline: str, last: int = 5, run_ids: list[str] | None = None) -> list[dict]:
    """The last `last` retrain runs of the pipeline (or the runs named), newest first, one dict each."""
    c = client()
    if run_ids:
        parents = [c.get_run(r) for r in run_ids]
    else:
        experiment = c.get_experiment_by_name(pipeline)
        if experiment is None:
            return []
        parents = c.search_runs([experiment.experiment_id], "tags.`flywheel.stage` = 'retrain'",
                                order_by=["attributes.start_time DESC"], max_results=last)
    return [_describe(pipeline, parent) for parent in parents]


def _stage(parent, name: str):
    run_id = parent.data.tags.get(f"stage.{name}.run_id")
    if not run_id:
        return None
    try:
        return client().get_run(run_id)
    except MlflowException:
        return None


def _describe(pipeline: str, parent) -> dict:
    tags = parent.data.tags
    row = {"run_id": parent.info.run_id, "started": pd.Timestamp(parent.info.start_time, unit="ms"),
           "status": parent.info.status, "version": tags.get("flywheel.registered_version", ""),
           "gate": tags.get("flywheel.gate", ""),
           "data": {k.removeprefix(f"flywheel.dvc.data/{pipeline}/"): v[:8] for k, v in tags.items()
                    if k.startswith(f"flywheel.dvc.data/{pipeline}/")},
           "params": {}, "metrics": {}, "curves": {}, "slices": [], "reasons": []}
    for name in ("collect", "synthesize", "sft", "rl", "evaluate"):
        run = _stage(parent, name)
        if run is None:
            continue
        row["params"] |= {k: v for k, v in run.data.params.items() if k in PARAMS}
        row["metrics"] |= {f"{name}.{k}": v for k, v in run.data.metrics.items()
                           if k.startswith((FINAL, SCORE, PASS_RATE, "gate_"))}
        if name in CURVES:
            history = client().get_metric_history(run.info.run_id, CURVES[name])
            row["curves"][f"{name} {CURVES[name]}"] = sorted((m.step, m.value) for m in history)
        if name == "evaluate":
            gate = _gate_report(run.info.run_id)
            row["slices"], row["reasons"] = gate.get("slice_scores", []), gate.get("reasons", [])
    return row


def _gate_report(run_id: str) -> dict:
    import mlflow.artifacts

    try:
        local = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="gate.json",
                                                    dst_path=tempfile.mkdtemp(prefix="flywheel-gate-"))
    except (MlflowException, OSError):
        return {}
    return json.loads(Path(local).read_text())


def summary_table(rows: list[dict]) -> pd.DataFrame:
    """One line per run: the columns `flywheel compare` prints."""
    lines = []
    for row in rows:
        m = row["metrics"]
        low, high = m.get("evaluate.gate_candidate_low"), m.get("evaluate.gate_candidate_high")
        diff, diff_low = m.get("evaluate.gate_diff_estimate"), m.get("evaluate.gate_diff_low")
        lines.append({
            "run": row["run_id"][:8], "started": row["started"].strftime("%Y-%m-%d %H:%M"),
            "version": row["version"], "data": " ".join(f"{k}:{v}" for k, v in sorted(row["data"].items())),
            "params": " ".join(f"{k}={v}" for k, v in sorted(row["params"].items())),
            "sft loss": _fmt(m.get(f"sft.{SFT_FINAL_LOSS}")),
            "rl train reward": _fmt(m.get(f"rl.{RL_FINAL_REWARD}")),
            # held-out, greedy: the mean reward and the pass rate of each model, side by side
            **{f"{label} reward": _fmt(m.get(f"evaluate.{score_name(label)}")) for label in MODELS[:-1]},
            "rl reward [95% CI]": _fmt(m.get(f"evaluate.{score_name('rl')}"))
            + (f" [{low:.3f}, {high:.3f}]" if low is not None and high is not None else ""),
            **{f"{label} pass": _fmt(m.get(f"evaluate.{pass_rate_name(label)}")) for label in MODELS},
            "vs champion": "" if diff is None else f"{diff:+.3f} (low {diff_low:+.3f})",
            # the RL reward-hacking monitor: held-out audit pass rate, reward minus it, and its verdict
            "audit": _fmt(m.get(f"rl.{RL_FINAL_AUDIT}")), "reward-audit gap": _fmt(m.get(f"rl.{RL_FINAL_GAP}")),
            "hacking": {None: "", 0.0: "no", 1.0: "FLAGGED"}.get(m.get(f"rl.{RL_FINAL_HACKING}"), "?"),
            "cost saving": _saving(m.get(f"evaluate.{GATE_COST_SAVING}"), m.get(f"evaluate.{GATE_COST_SAVING_LOW}")),
            "gate": "refused" if m.get(f"evaluate.{GATE_REFUSED}") else row["gate"] or row["status"].lower()})
    return pd.DataFrame(lines)


def _saving(saving, low) -> str:
    return "" if saving is None else f"{saving:.1%}" + ("" if low is None else f" (low {low:.1%})")


def _fmt(value) -> str:
    return "" if value is None else f"{value:.3f}"


def write_html(rows: list[dict], path: Path, pipeline: str) -> Path:
    """The comparison table, learning curves and per-slice scores as one self-contained HTML file."""
    table = summary_table(rows)
    parts = [f"<html><head><meta charset='utf-8'><title>{html.escape(pipeline)}: retrain runs</title>",
             "<style>body{font-family:sans-serif} table{border-collapse:collapse} "
             "td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px}</style></head><body>",
             f"<h1>{html.escape(pipeline)}: the last {len(rows)} retrain runs</h1>",
             table.to_html(index=False, escape=True)]
    curves = _figure_curves(rows)
    if curves:
        parts += ["<h2>Learning curves</h2>", curves]
    slices = _figure_slices(rows)
    if slices:
        parts += ["<h2>Held-out reward by slice (candidate, 95% interval)</h2>", slices]
    for row in rows:
        if row["reasons"]:
            parts += [f"<h3>Gate of run {row['run_id'][:8]}: {html.escape(row['gate'])}</h3><ul>",
                      *[f"<li>{html.escape(r)}</li>" for r in row["reasons"]], "</ul>"]
    parts.append("</body></html>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts))
    return path


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _img(fig, plt) -> str:
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return f"<img src='data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}'/>"


def _figure_curves(rows: list[dict]) -> str:
    plt = _pyplot()
    names = sorted({name for row in rows for name in row["curves"]})
    if plt is None or not names:
        return ""
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.5), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for row in rows:
            points = row["curves"].get(name) or []
            if points:
                ax.plot([s for s, _ in points], [v for _, v in points], label=row["run_id"][:8])
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    return _img(fig, plt)


def _figure_slices(rows: list[dict]) -> str:
    plt = _pyplot()
    scores = pd.DataFrame([s | {"run": row["run_id"][:8]} for row in rows for s in row["slices"]
                           if s.get("model") == "rl"])
    if plt is None or scores.empty:
        return ""
    slices = list(dict.fromkeys(scores["slice"]))
    runs = list(dict.fromkeys(scores["run"]))
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(slices) + 2), 3.5))
    for i, run in enumerate(runs):
        part = scores[scores["run"] == run].set_index("slice").reindex(slices)
        errors = [(part["score"] - part["low"]).clip(lower=0).fillna(0),
                  (part["high"] - part["score"]).clip(lower=0).fillna(0)]
        ax.bar([j + i * width for j in range(len(slices))], part["score"].fillna(0), width, yerr=errors,
               capsize=3, label=run)
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(slices))], slices)
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    return _img(fig, plt)
