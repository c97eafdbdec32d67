"""What the commands print: tables of held-out scores, a run's summary, status, a rerun's comparison."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from flywheel.stages import RetrainSummary


def fmt(value, pattern: str = "{:.3f}") -> str:
    """A number as text; blank when missing (None or NaN, the one value unequal to itself)."""
    return "" if value is None or value != value else pattern.format(value)


def score_table(title: str, columns: tuple[str, ...], lines: list[tuple[str, ...]]):
    """Held-out numbers per model: the mean reward and the pass rate side by side, never one for the other."""
    from rich.table import Table

    table = Table(title=title)
    for i, column in enumerate(columns):
        table.add_column(column, justify="right" if 0 < i < len(columns) - 1 else "left")
    for line in lines:
        table.add_row(*line)
    return table


def print_summary(summary: RetrainSummary, root: Path, seconds: float) -> None:
    """A retrain run's end: the held-out table with the null row, the gate and why, what was registered, where
    to look."""
    from rich.console import Console

    from flywheel.cli.ui import ui_commands
    from flywheel.evaluate.report import reference_line

    console = Console()
    scores, passes, references = summary.scores, summary.pass_rates, summary.references
    names = {"null": "null (empty answer)", "rl": "rl (candidate)", "champion": "champion before this run"}
    names |= {name: f"{name} (reference)" for name in references}
    lines = []
    for label in ("null", "base", "sft", "rl", "champion", *references):
        if f"score_{label}" in scores or label in references:
            ref = references.get(label) or {}
            note = f"incomplete: {ref['unanswered']} task(s) unanswered" if ref.get("incomplete") else ""
            lines.append((names.get(label, label), fmt(scores.get(f"score_{label}")),
                          fmt(passes.get(f"pass_rate_{label}")), note))
    console.print(score_table(f"pipeline '{summary.pipeline}': held-out (greedy)",
                              ("model", "mean reward", "pass rate", "note"), lines))
    verdict = ("[green]passed[/]" if summary.gate_passed else
               "[red]refused: the eval cannot measure this candidate[/]" if summary.refused
               else "[red]not promoted[/]")
    console.print(f"gate: {verdict}")
    for reason in summary.gate_reasons:
        console.print(f"  - {reason}")
    for name, ref in references.items():
        console.print(reference_line(name, ref))
    for warning in summary.warnings:
        console.print(f"[yellow]warning:[/] {warning}")
    if summary.student:
        console.print(f"student: {summary.student}")
    champion = f"champion is version {summary.champion}" if summary.champion else "no champion yet"
    console.print(f"registered: {summary.pipeline} version {summary.version} "
                  f"(aliases: {', '.join(summary.aliases) or 'none'}); {champion}")
    console.print(f"stages run: {', '.join(summary.ran) or 'none'}; cached: {', '.join(summary.cached) or 'none'}"
                  f"; {seconds:.0f}s")
    if summary.seconds:
        console.print(f"stage times, measured (estimated): {times_line(summary.seconds, summary.estimate)}",
                      soft_wrap=True, highlight=False)
    console.print("\nlook at it (each command is one line; `flywheel ui` starts both):")
    for name, command in ui_commands(root).items():
        console.print(f"  {name}:")
        # never folded: a command cut over two lines does not run when pasted
        console.print(f"    {command}", soft_wrap=True, highlight=False, markup=False)


def times_line(seconds: dict[str, float], estimate: dict[str, float]) -> str:
    """Each stage's measured seconds beside `flywheel check`'s estimate and their ratio, e.g. `sft 61s (1:47,
    x0.57)`: what the factor-of-2 target is read from."""
    from flywheel.estimate import clock
    from flywheel.metrics import STAGE_ESTIMATE

    parts = []
    for stage, took in seconds.items():
        guess = estimate.get(STAGE_ESTIMATE.format(stage=stage))
        ratio = f", x{took / guess:.2f}" if guess else ""
        parts.append(f"{stage} {clock(took)}" + (f" ({clock(guess)}{ratio})" if guess is not None else ""))
    total = estimate.get(STAGE_ESTIMATE.format(stage="total"))
    parts.append(f"total {clock(sum(seconds.values()))}" + (f" ({clock(total)})" if total is not None else ""))
    return ", ".join(parts)


def print_eval(result, pipeline: str) -> None:
    """`flywheel eval`'s table: each policy's held-out figures beside the null policy's, then its MLflow run."""
    from rich.console import Console

    lines = [(m.model,
              fmt(m.mean_reward) + ("" if m.low is None else f" [{m.low:.3f}, {m.high:.3f}]"),
              fmt(m.pass_rate), str(m.tasks), fmt(m.cost_per_task_usd, "${:.6f}"),
              f"incomplete: {m.unanswered} task(s) unanswered" if m.unanswered else "")
             for m in result.models.itertuples(index=False)]
    console = Console(width=max(120, Console().width))
    console.print(score_table(f"pipeline '{pipeline}': {result.tasks} held-out tasks (greedy)",
                              ("model", "mean reward [95% CI]", "pass rate", "tasks", "cost per task", "note"),
                              lines))
    for label, what in result.described.items():
        console.print(f"  {label}: {what}", soft_wrap=True)
    for label, count in result.user_errors.items():
        console.print(f"{label}: {count} episode(s) left out: the simulated user failed")
    console.print(f"MLflow run {result.run_id} (experiment '{pipeline}', run name 'eval')")


def terminal_width(default: int = 120) -> int:
    """The columns to print in: COLUMNS when set (a shell exports it), the terminal's own, else `default` (a pipe
    or a file: rich alone would assume 80)."""
    from rich.console import Console

    if os.environ.get("COLUMNS", "").isdigit() or sys.stdout.isatty():
        return Console().width
    return default


def print_status(pipeline: str, state, next_run_line: str) -> None:
    """`flywheel status`: the aliases, the last retrain runs with their gate, the data versions, the schedule;
    in 120 columns (run ids cut to the 8 characters `compare` and `rerun` also take)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=terminal_width())
    models = Table(title=f"{pipeline}: registered model")
    for column in ("alias", "version", "mean reward", "pass rate", "registered", "pipeline run", "gate",
                   "promotion"):
        models.add_column(column, no_wrap=column in ("registered", "pipeline run"))
    for a in state.aliases:
        models.add_row(a.alias, a.version, fmt(a.score), fmt(a.pass_rate),
                       a.registered.strftime("%Y-%m-%d %H:%M UTC"), a.pipeline_run[:8], a.gate, a.promotion)
    console.print(models if state.aliases else f"{pipeline}: no registered version yet")
    runs = Table(title=f"{pipeline}: the last {len(state.runs)} retrain runs")
    for column in ("run", "started", "state", "gate", "version", "stages", "rerun of"):
        runs.add_column(column, overflow="fold", no_wrap=column in ("run", "started"))
    for r in state.runs:
        kinds = {how: [s for s, h in r.stages.items() if h == how] for how in dict.fromkeys(r.stages.values())}
        stages = "; ".join(f"{how}: {' '.join(names)}" for how, names in kinds.items())
        runs.add_row(r.run_id[:8], r.started.strftime("%Y-%m-%d %H:%M UTC"), r.status, r.gate, r.version, stages,
                     r.rerun_of[:8])
    console.print(runs if state.runs else f"{pipeline}: no retrain runs yet (`flywheel run {pipeline}`)")
    data = state.data_versions()
    if not data.empty:
        versions = Table(title="data versions (DVC md5)")
        for column in data.columns:
            versions.add_column(column, overflow="fold")
        for line in data.itertuples(index=False):
            versions.add_row(*[str(v)[:12] if i else str(v) for i, v in enumerate(line)])
        console.print(versions)
    console.print(f"next scheduled run: {next_run_line}")


def print_rerun(report, run_id: str, promote: bool) -> None:
    """`flywheel rerun`: every output's recorded and reproduced md5, every model's scores, the verdict."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(140, Console().width))
    outputs = Table(title=f"rerun {report.rerun_id[:8]} of {run_id[:8]}: outputs (DVC md5)")
    for column in ("stage", "path", "recorded", "reproduced", "", "note"):
        outputs.add_column(column, overflow="fold")
    colour = {"identical": "green", "restored": "cyan", "measured": "yellow", "differs": "red"}
    for o in report.outputs:
        outputs.add_row(o.stage, o.path, o.recorded[:12], o.reproduced[:12],
                        f"[{colour[o.verdict]}]{o.verdict}[/]", o.note)
    console.print(outputs)
    scores = Table(title="held-out mean reward (greedy): recorded and reproduced")
    for column in ("model", "recorded", "reproduced", "difference [interval]", "", "how"):
        scores.add_column(column)
    for s in report.scores:
        interval = f"[{s.low:+.3f}, {s.high:+.3f}]" if s.low is not None else ""
        recorded = "" if s.recorded is None else f"{s.recorded:.3f}"
        diff = "" if s.recorded is None else f"{s.reproduced - s.recorded:+.3f} {interval}"
        scores.add_row(s.model, recorded, f"{s.reproduced:.3f}", diff,
                       "[green]within noise[/]" if s.within_noise else "[red]outside noise[/]", s.how)
    console.print(scores)
    console.print(f"gate: recorded {report.gate_recorded or '?'}, reproduced {report.gate_reproduced}; "
                  f"registered version {report.version}; champion is version {report.champion}"
                  + ("" if promote else " (not moved: --promote offers it to the gate)"))
    if report.code_changes:
        console.print(f"code that differs from the recorded run's: {', '.join(report.code_changes)}")
    for warning in report.warnings:
        console.print(f"[yellow]warning:[/] {warning}")
    verdict = ("datasets and models identical" if report.datasets_identical
               else "[red]datasets or models differ[/]") + ", " + \
        ("scores within noise" if report.scores_within_noise else "[red]scores outside noise[/]")
    console.print(f"{verdict}; workspace {report.workspace}")


def print_reconciled(report: dict, where: str) -> None:
    """The deployments `serve` or `deploy` left in place, each with its schedules, and those it deleted."""
    for name in report["kept"]:
        typer.echo(f"  {name}: {', '.join(report['schedules'][name]) or 'no schedule (started by its sensor)'}")
    for name in report["deleted"]:
        typer.echo(f"  {name}: deleted (no schedule or trigger for it in pipelines.yaml)")
    typer.echo(f"{len(report['kept'])} deployment(s) {where}")
