"""Retrain runs side by side, from MLflow: data versions, key params, SFT/RL metrics, eval scores (mean reward and
pass rate), gate decisions; as tables for a terminal of 100 columns and up, or as one HTML report."""

from __future__ import annotations

import html
import json
import tempfile
from pathlib import Path

import pandas as pd
from mlflow.exceptions import MlflowException
from rich import box
from rich.table import Table

from flywheel import plots
from flywheel.metrics import (
    CURVES,
    FINAL,
    GATE_COST_SAVING,
    GATE_COST_SAVING_LOW,
    GATE_REFUSED,
    PASS_RATE,
    RL_FINAL_AUDIT,
    RL_FINAL_GAP,
    RL_FINAL_HACKING,
    RL_FINAL_REWARD,
    SCORE,
    SFT_FINAL_LOSS,
    pass_rate_name,
    score_name,
)
from flywheel.registry import client
from flywheel.stages import GateReport
from flywheel.tags import GATE_TAG, REGISTERED_VERSION_TAG, STAGE_TAG, dvc_tag, stage_run_tag

PARAMS = ("sft.steps", "sft.lr", "rl.steps", "rl.lr", "rl.group_size", "rl.lr_schedule", "rl.difficulty_filter",
          "teacher.error_rate", "gate.mode", "gate.margin")
MODELS = ("null", "base", "sft", "rl")  # the models of a run whose held-out scores the table shows
# summary_table's held-out columns: each model's mean reward (the candidate's with its interval), then pass rates
SCORE_COLUMNS = (*[f"{m} reward" for m in MODELS[:-1]], "rl reward [95% CI]", *[f"{m} pass" for m in MODELS])
# `flywheel compare` in a terminal: summary_table's columns in tables narrow enough that a run is one line at 100
# columns (the third only when a run fills it; the HTML report has them all in one table, with the key params)
INPUT_DATA = ("collect", "synthesize")  # the datasets a run trains on, whose versions the first table shows
RUN_COLUMNS = ("run", "started", "version", *[f"{d} data" for d in INPUT_DATA], "sft loss", "rl train reward", "gate")
GATE_COLUMNS = ("vs champion", "cost saving", "audit", "reward-audit gap", "hacking")
PARAM_CHARS = 30  # a longer param value (a list of sources...) is cut in the terminal; MLflow has it whole
RETRAIN = f"tags.`{STAGE_TAG}` = 'retrain'"


def retrain_runs(pipeline: str, last: int = 5, run_ids: list[str] | None = None) -> list[dict]:
    """The last `last` retrain runs of the pipeline, newest first, or the runs named (by id or its first
    characters, as the tables print it), one dict each."""
    c = client()
    experiment = c.get_experiment_by_name(pipeline)
    if run_ids:
        parents = [_named_run(pipeline, experiment, r) for r in run_ids]
    elif experiment is None:
        return []
    else:
        parents = c.search_runs([experiment.experiment_id], RETRAIN, order_by=["attributes.start_time DESC"],
                                max_results=last)
    return [_describe(pipeline, parent) for parent in parents]


def _named_run(pipeline: str, experiment, run_id: str):
    try:
        return client().get_run(run_id)
    except MlflowException:
        pass  # not a whole id: the first characters of one
    found = [] if experiment is None else [r for r in client().search_runs([experiment.experiment_id], RETRAIN)
                                           if r.info.run_id.startswith(run_id)]
    if not found:
        raise LookupError(f"no retrain run of '{pipeline}' has an id starting with '{run_id}': give one that "
                          f"`flywheel compare {pipeline}` lists")
    if len(found) > 1:
        raise LookupError(f"{len(found)} retrain runs of '{pipeline}' have an id starting with '{run_id}': "
                          "give more of it")
    return found[0]


def _stage(parent, name: str):
    run_id = parent.data.tags.get(stage_run_tag(name))
    if not run_id:
        return None
    try:
        return client().get_run(run_id)
    except MlflowException:
        return None


def _describe(pipeline: str, parent) -> dict:
    tags = parent.data.tags
    data = dvc_tag(f"data/{pipeline}/")  # the lineage tags of the pipeline's datasets
    row = {"run_id": parent.info.run_id, "started": pd.Timestamp(parent.info.start_time, unit="ms"),
           "status": parent.info.status, "version": tags.get(REGISTERED_VERSION_TAG, ""),
           "gate": tags.get(GATE_TAG, ""),
           "data": {k.removeprefix(data): v[:8] for k, v in tags.items() if k.startswith(data)},
           "params": {}, "metrics": {}, "curves": {}, "slices": [], "reasons": []}
    for name in ("collect", "synthesize", "sft", "rl", "evaluate"):
        run = _stage(parent, name)
        if run is None:
            continue
        row["params"] |= run.data.params
        row["metrics"] |= {f"{name}.{k}": v for k, v in run.data.metrics.items()
                           if k.startswith((FINAL, SCORE, PASS_RATE, "gate_"))}
        if name in CURVES:
            history = client().get_metric_history(run.info.run_id, CURVES[name])
            row["curves"][f"{name} {CURVES[name]}"] = sorted((m.step, m.value) for m in history)
        if name == "evaluate":
            gate = _gate_report(run.info.run_id)
            if gate is not None:
                row["slices"], row["reasons"] = gate.slice_scores, gate.reasons
    return row


def _gate_report(run_id: str) -> GateReport | None:
    """The gate report the evaluate run stored (gate.json); None when it stored none."""
    import mlflow.artifacts

    with tempfile.TemporaryDirectory(prefix="flywheel-gate-") as folder:
        try:
            local = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="gate.json", dst_path=folder)
        except (MlflowException, OSError):
            return None
        return GateReport.from_dict(json.loads(Path(local).read_text()))


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
            "params": " ".join(f"{k}={v}" for k, v in sorted(row["params"].items()) if k in PARAMS),
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


def terminal_tables(rows: list[dict], pipeline: str, width: int = 100, params: bool = False) -> list[Table]:
    """The tables `flywheel compare` prints for a terminal `width` columns wide: the runs, their held-out scores,
    the gate's comparison with the champion and the RL monitor (when a run has them), with `params` every param."""
    frame = summary_table(rows)
    for name in INPUT_DATA:
        frame[f"{name} data"] = [row["data"].get(name, "") for row in rows]
    tables = [_table(f"{pipeline}: the last {len(rows)} retrain runs", frame[list(RUN_COLUMNS)], width),
              _table("held-out (greedy): mean reward and pass rate of each model",
                     frame[["run", *SCORE_COLUMNS]], width)]
    if (frame[list(GATE_COLUMNS)] != "").any(axis=None):
        tables.append(_table("the gate against the champion; the RL reward-hacking monitor",
                             frame[["run", *GATE_COLUMNS]], width))
    if params:
        tables.append(params_table(rows))
    return tables


def _table(title: str, frame: pd.DataFrame, width: int) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0))
    # each column as wide as its widest value or header word, so that a header folds rather than a value; what the
    # width leaves unfolds headers, the shortest first. Narrower than that, rich folds the widest columns.
    widths = {c: max([len(v) for v in frame[c]] + [len(word) for word in c.split()]) for c in frame.columns}
    spare = width - sum(widths.values()) - 2 * (len(widths) - 1)
    for column in sorted(widths, key=lambda c: len(c) - widths[c]):
        if widths[column] < len(column) <= widths[column] + spare:
            spare -= len(column) - widths[column]
            widths[column] = len(column)
    for column, fits in widths.items():
        table.add_column(column, width=fits if spare >= 0 else None, overflow="fold", no_wrap=column == "run")
    for line in frame.itertuples(index=False):
        table.add_row(*line)
    return table


def params_table(rows: list[dict]) -> Table:
    """Every param the runs' stages logged, one per line (the key ones first, those that differ in bold), one
    column per run."""
    logged = {k for row in rows for k in row["params"]}
    table = Table(title="params (bold: not the same in every run)", box=box.SIMPLE_HEAD, show_edge=False,
                  pad_edge=False, padding=(0, 1, 0, 0))
    table.add_column("param", no_wrap=True)
    for row in rows:
        table.add_column(row["run_id"][:8], overflow="fold")
    for name in [*[k for k in PARAMS if k in logged], *sorted(logged - set(PARAMS))]:
        values = [row["params"].get(name, "") for row in rows]
        table.add_row(name, *[v if len(v) <= PARAM_CHARS else v[:PARAM_CHARS - 1] + "…" for v in values],
                      style="bold" if len(set(values)) > 1 else None)
    return table


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
    for row in rows:  # each run's models side by side: the null policy, base, SFT, RL, the champion
        if row["slices"]:
            title = f"run {row['run_id'][:8]}: held-out mean reward by slice, each model"
            parts += [f"<h3>{html.escape(title)}</h3>",
                      f"<img src='{plots.data_uri(plots.slice_bars(row['slices'], title))}'/>"]
    for row in rows:
        if row["reasons"]:
            parts += [f"<h3>Gate of run {row['run_id'][:8]}: {html.escape(row['gate'])}</h3><ul>",
                      *[f"<li>{html.escape(r)}</li>" for r in row["reasons"]], "</ul>"]
    parts.append("</body></html>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts))
    return path


def _img(fig) -> str:
    return f"<img src='{plots.data_uri(plots.png(fig))}'/>"


def _figure_curves(rows: list[dict]) -> str:
    plt = plots.pyplot()
    names = sorted({name for row in rows for name in row["curves"]})
    if not names:
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
    return _img(fig)


def _figure_slices(rows: list[dict]) -> str:
    plt = plots.pyplot()
    scores = pd.DataFrame([s | {"run": row["run_id"][:8]} for row in rows for s in row["slices"]
                           if s.get("model") == "rl"])
    if scores.empty:
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
    return _img(fig)
