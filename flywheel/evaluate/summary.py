"""One markdown summary of a candidate, for people: the gate's decision first, why, the held-out table with the null
row, the references and warnings, the data versions and the runs.

The register stage writes it as the registered version's description (the top of its page in MLflow's UI) and as
the Prefect markdown artifact `<pipeline>-model` (there with the plots as images); the evaluate stage's
`<pipeline>-gate` artifact is the same summary before a version exists. docs/model-page.md shows one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from flywheel.evaluate.report import reference_line
from flywheel.stages import GateReport

# what each model row is, in the words of the run summary (flywheel/cli/render.py)
NAMES = {"null": "null (empty answer)", "rl": "rl (candidate)", "champion": "champion (before this run)"}


@dataclass(frozen=True)
class Registration:
    """What register made of the candidate: its version, the aliases after promotion, why champion moved or not."""

    version: str
    aliases: Sequence[str]
    promoted: bool
    reasons: Sequence[str] = ()
    champion: str | None = None  # the champion's version after promotion


@dataclass(frozen=True)
class Links:
    """The MLflow runs behind the summary: name (pipeline, sft, rl, evaluate, register) -> run id, and the
    experiment they are in (links in MLflow's UI are `#/experiments/<id>/runs/<run id>`)."""

    experiment_id: str = ""
    runs: Mapping[str, str] = field(default_factory=dict)


def verdict(report: GateReport) -> str:
    """The gate's decision in one word, as every command and page says it: passed, refused or failed."""
    return "passed" if report.passed else "refused" if report.refused else "failed"


def headline(report: GateReport, registration: Registration | None) -> str:
    """The first line: the decision and what it did to the registry."""
    what = {"passed": "passed", "refused": "REFUSED: the eval cannot measure this candidate",
            "failed": "failed: not promoted"}[verdict(report)]
    line = f"**Gate: {what}.**"
    if registration is None:
        return line
    aliases = ", ".join(f"`{a}`" for a in registration.aliases) or "none"
    champion = ("it is champion" if registration.promoted
                else f"champion stays version {registration.champion}" if registration.champion
                else "there is no champion")
    return f"{line} Version {registration.version} (aliases: {aliases}); {champion}."


def render(pipeline: str, report: GateReport, registration: Registration | None = None,
           data: Mapping[str, str] | None = None, links: Links | None = None,
           images: Sequence[tuple[str, str]] = ()) -> str:
    """The summary as markdown. `data`: dataset or model path -> DVC md5; `images`: (title, URL or data URI)."""
    lines = [headline(report, registration), "", "Why:", *[f"- {r}" for r in report.reasons]]
    if registration is not None and registration.reasons and list(registration.reasons) != list(report.reasons):
        # promotion said more than the gate did (a champion that moved since evaluate, a rerun not offered)
        lines += ["", "Promotion:", *[f"- {r}" for r in registration.reasons]]
    lines += ["", f"### Held-out, greedy ({pipeline})", "", *_models_table(report)]
    if report.references:
        lines += ["", "### References", *[f"- {reference_line(n, r)}" for n, r in report.references.items()]]
    flags = report.numbers.get("flags") or []
    if report.warnings or flags or report.user_errors:
        lines += ["", "### Warnings", *[f"- {w}" for w in report.warnings],
                  *[f"- reward hacking flagged: {f}" for f in flags],
                  *[f"- {label}: {n} episode(s) left out, the simulated user failed"
                    for label, n in report.user_errors.items()]]
    if data:
        lines += ["", "### Data versions (DVC md5)", "", "| dataset or model | md5 |", "|---|---|",
                  *[f"| `{path}` | `{md5[:12]}` |" for path, md5 in sorted(data.items())]]
    if links and links.runs:
        lines += ["", "### Runs (MLflow)", *[f"- {name}: {_run_link(links, run_id)}"
                                             for name, run_id in links.runs.items() if run_id]]
    for title, url in images:
        lines += ["", f"### {title}", "", f"![{title}]({url})"]
    return "\n".join(lines) + "\n"


def _models_table(report: GateReport) -> list[str]:
    rows = ["| model | mean reward [95% CI] | pass rate | tasks |", "|---|---|---|---|"]
    for m in report.models:
        if m.get("mean_reward") is None:
            rows.append(f"| {NAMES.get(m['model'], m['model'])} | no task answered | | 0 |")
            continue
        interval = "" if m.get("low") is None else f" [{m['low']:.3f}, {m['high']:.3f}]"
        rows.append(f"| {NAMES.get(m['model'], m['model'])} | {m['mean_reward']:.3f}{interval} | "
                    f"{m['pass_rate']:.3f} | {m['tasks']} |")
    if not report.models:  # a report written before the per-model rows: its scores alone
        rows += [f"| {label.removeprefix('score_')} | {value:.3f} | | |" for label, value in report.scores.items()]
    return rows


def _run_link(links: Links, run_id: str) -> str:
    if not links.experiment_id:
        return f"`{run_id}`"
    return f"[`{run_id[:8]}`](#/experiments/{links.experiment_id}/runs/{run_id})"
