"""Stage evaluate: held-out tasks, contamination check first, candidate against the champion, the gate decision."""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path

import pandas as pd

from flywheel import registry
from flywheel.agent import Harness
from flywheel.checkpoints import same_weights, saved_chat_template
from flywheel.config import PipelineConfig
from flywheel.contract import Task, prompt_hash
from flywheel.data.catalog import Catalog, content_hash
from flywheel.data.schemas import Eval
from flywheel.data.tasksets import row_task
from flywheel.evaluate.arms import Arm, checkpoint_arm, null_arm, reference_arm, score_arm
from flywheel.evaluate.gate import BASELINES, GateDecision, decide
from flywheel.evaluate.report import model_scores, reference_shares, slice_scores
from flywheel.evaluate.runner import Scored, check_contamination, require_heldout, synthetic_prompt_hashes
from flywheel.evaluate.traces import log_traces
from flywheel.metrics import GATE_COST_SAVING, GATE_COST_SAVING_LOW, GATE_REFUSED, pass_rate_name, score_name
from flywheel.stages import GateReport, StageResult
from flywheel.tags import GATE_REFUSED_TAG, gate_tag, out_tag
from flywheel.train.rl.loop import NO_UPDATES_FILE
from flywheel.train.rl.monitor import MONITOR_FILE
from tasks.caching import by_content
from tasks.kernel import stage_context, stage_task
from tasks.reports import SLICES_PNG, publish_eval_report, slices_png


def champion_key(pipeline: str, root: Path, cfg: PipelineConfig | None = None) -> str:
    """The champion the candidate is judged against; a champion that IS the candidate counts as none."""
    champion = registry.get_alias(pipeline, "champion")
    candidate = content_hash([Catalog(root, pipeline).model_dir("rl")], root)
    if champion is None or champion.model_hash == candidate:
        return "no-champion"
    return f"champion-{champion.version}-{champion.model_hash}"


@stage_task(cache_key_fn=by_content("evaluate", extra=champion_key))
def evaluate(pipeline: str, root: str = ".", parent_run_id: str | None = None) -> StageResult:
    """Score the null policy, the base, SFT and RL students, the champion and the references on the held-out
    tasks; decide the gate."""
    with stage_context("evaluate", pipeline, root, parent_run_id, params=("evaluate", "gate")) as stage:
        cfg, catalog, root_path, run = stage.cfg, stage.catalog, stage.root, stage.run
        require_heldout(pipeline, catalog.read("tasks")["split"], catalog.table_path("tasks"))
        heldout = _heldout(catalog)
        candidate_hash = content_hash([catalog.model_dir("rl")], root_path)
        with tempfile.TemporaryDirectory(prefix="flywheel-champion-") as downloads:  # while the arms are scored
            arms, champion_version = _arms(cfg, catalog, pipeline, candidate_hash, root_path, Path(downloads))
            scored = _score(arms, _twins(cfg, catalog), stage.harness, heldout, cfg)
        table = pd.DataFrame([row for s in scored.values() for row in s.rows], columns=list(Eval.to_schema().columns))
        catalog.write("eval", table)

        by_model = {label: table[table["model"] == label] for label in scored}
        # references never reach the gate: an endpoint that failed must not decide a promotion
        decision = decide(by_model["rl"], by_model.get("champion"), cfg.gate, flags=_monitor_flags(catalog),
                          baselines={label: by_model[label] for label in BASELINES})
        # the headline numbers stay greedy; the gate weighs every row (greedy and sampled) per task
        greedy = table[table["sample"] == 0]
        scores = {score_name(m): float(f["reward"].mean()) for m, f in greedy.groupby("model", sort=False)}
        pass_rates = {pass_rate_name(m): float(f["passed"].mean()) for m, f in greedy.groupby("model", sort=False)}
        if cfg.evaluate.samples:
            run.metrics({f"sampled_score_{label}": float(frame.loc[frame["sample"] > 0, "reward"].mean())
                         for label, frame in by_model.items() if not frame.empty})
        references = {r.name: reference_shares(table, "rl", r.name, scored[r.name].unanswered, scored[r.name].failure)
                      for r in cfg.evaluate.references}
        unanswered = {label: s.unanswered for label, s in scored.items() if s.unanswered}
        user_errors = {label: s.user_errors for label, s in scored.items() if s.user_errors}
        per_slice = slice_scores(table, cfg.gate)
        report = GateReport(
            passed=decision.passed, reasons=decision.reasons, refused=decision.refusals,
            numbers=json.loads(decision.to_json())["numbers"], scores=scores, pass_rates=pass_rates,
            models=json.loads(model_scores(table, cfg.gate, unanswered).to_json(orient="records")),
            references=references, user_errors=user_errors, warnings=_rl_warnings(catalog),
            candidate_hash=candidate_hash, champion_version=champion_version,
            slice_scores=json.loads(per_slice.round(6).to_json(orient="records")))
        gate_path = catalog.write_json("evaluate", "gate.json", report.to_dict())
        run.metrics(scores | pass_rates | _gate_metrics(decision, report.numbers) | _reference_metrics(references)
                    | {f"user_errors_{label}": n for label, n in user_errors.items()})
        bars = slices_png(pipeline, report)
        if bars is not None:
            run.image(bars, SLICES_PNG)
        run.tags(gate_tag(decision.passed)
                 | {out_tag("evaluate"): content_hash([catalog.stage_dir("evaluate")], root_path)}
                 | ({GATE_REFUSED_TAG: "; ".join(decision.refusals)[:5000]} if decision.refusals else {}))
        run.artifact(gate_path)
        publish_eval_report(pipeline, report)
        log_traces(scored, run, pipeline, stage.env, cfg.evaluate.trace_episodes)  # the episodes, for people to read
        return stage.done(scores, gate=report)


def _heldout(catalog: Catalog) -> list[Task]:
    """The held-out tasks (written as the heldout table), after checking none leaked into SFT or RL data."""
    tasks = catalog.read("tasks")
    catalog.write("heldout", tasks[tasks["split"] == "heldout"].reset_index(drop=True))
    heldout = [row_task(r) for r in catalog.read("heldout").to_dict("records")]
    prompt_of = {r["task_id"]: prompt_hash(json.loads(r["prompt"])) for r in tasks.to_dict("records")}
    group_of = {r["task_id"]: r["group"] for r in tasks.to_dict("records") if r["group"]}
    synthetic = catalog.read("synthetic")
    trained = synthetic.loc[synthetic["accepted"]]
    rollouts = catalog.read("rollouts")["task_id"]
    check_contamination(heldout, {
        "sft data (synthetic)": synthetic_prompt_hashes(trained["messages"]),
        "rl rollouts": [prompt_of.get(t, t) for t in rollouts],
    }, groups={"sft data (synthetic)": [group_of[t] for t in trained["task_id"] if t in group_of],
               "rl rollouts": [group_of[t] for t in rollouts if t in group_of]})
    return heldout


def _arms(cfg: PipelineConfig, catalog: Catalog, pipeline: str, candidate_hash: str, root: Path,
          downloads: Path) -> tuple[list[Arm], str | None]:
    """What to score: the null policy, base, SFT and RL, the champion unless it is the candidate (its checkpoint
    downloaded into `downloads`), the references; and the champion's version when it is scored."""
    models = {"base": catalog.base_model(), "sft": catalog.model_dir("sft"), "rl": catalog.model_dir("rl")}
    champion = registry.get_alias(pipeline, "champion")
    if champion is not None and champion.model_hash != candidate_hash:
        models["champion"] = registry.download(champion, downloads)
    templates = _templates(catalog)
    prices = (cfg.evaluate.student_price_input_per_mtok, cfg.evaluate.student_price_output_per_mtok)
    students = [checkpoint_arm(label, path, batch_size=cfg.evaluate.batch_size, device=cfg.student.device,
                               chat_template=templates.get(label), prices=prices, precision=cfg.evaluate.precision)
                for label, path in models.items()]
    references = [reference_arm(r, root, cfg.evaluate.batch_size) for r in cfg.evaluate.references]
    return [null_arm(), *students, *references], champion.version if "champion" in models else None


def _score(arms: list[Arm], twins: dict[str, str], harness: Harness, heldout: list[Task],
           cfg: PipelineConfig) -> dict[str, Scored]:
    """Each arm's episodes on the held-out tasks; an arm with a twin (`_twins`) takes its twin's episodes."""
    scored = {}
    for arm in arms:
        if arm.label in twins:  # the same weights and template as an arm already scored: the same episodes
            twin = scored[twins[arm.label]]
            scored[arm.label] = replace(twin, rows=[row | {"model": arm.label} for row in twin.rows])
            print(f"      evaluate: {arm.label}: the {twins[arm.label]} checkpoint byte for byte (greedy): "
                  f"its episodes", flush=True)
            continue
        scored[arm.label] = score_arm(arm, harness, heldout, samples=cfg.evaluate.samples,
                                      temperature=cfg.evaluate.temperature, seed=cfg.evaluate.seed)
    return scored


def _twins(cfg: PipelineConfig, catalog: Catalog) -> dict[str, str]:
    """{"rl": "sft"} when RL's output is SFT's checkpoint byte for byte under the same template (RL kept version
    0, or made no update) and evaluate decodes greedily only: its episodes would be SFT's, token for token, so
    they are not generated twice. Otherwise {}."""
    if cfg.evaluate.samples or not same_weights(catalog.model_dir("sft"), catalog.model_dir("rl")):
        return {}
    templates = _templates(catalog)
    return {"rl": "sft"} if templates.get("rl") == templates.get("sft") else {}


def _monitor_flags(catalog: Catalog) -> list[str]:
    """The RL reward-hacking monitor's verdict (data/<p>/rl/monitor.json), when it ran and flagged the run."""
    path = catalog.stage_dir("rl") / MONITOR_FILE
    if not path.exists():
        return []
    report = json.loads(path.read_text())
    return [report["reason"]] if report.get("flagged") else []


def _templates(catalog: Catalog) -> dict[str, str]:
    """A named base checkpoint is judged in the format its trained versions are: the template SFT trained with.

    Its own template may not render tools at all (SmolLM2's), and then the comparison would measure the prompt,
    not the training; the training variants render everything else as the original does.
    """
    if catalog.base_source() is None:
        return {}  # built here (tiny): its own template is the one SFT trained with
    return {"base": saved_chat_template(catalog.model_dir("sft"))}


def _rl_warnings(catalog: Catalog) -> list[str]:
    """The RL stage's word that it changed nothing (data/<p>/rl/no_updates.json), when it ran and said so."""
    path = catalog.stage_dir("rl") / NO_UPDATES_FILE
    warning = json.loads(path.read_text()).get("warning") if path.exists() else ""
    return [warning] if warning else []


def _gate_metrics(decision: GateDecision, numbers: dict) -> dict:
    """The gate's decision and numbers as MLflow metrics: passed, refused, the differences and intervals."""
    cost = numbers.get("cost") or {}
    return ({"gate_passed": float(decision.passed), "gate_flagged": float(bool(numbers.get("flags"))),
             GATE_REFUSED: float(bool(decision.refusals))}
            | ({GATE_COST_SAVING: cost["saving"], GATE_COST_SAVING_LOW: cost["low"]} if cost else {})
            | {f"gate_diff_{k}": v for k, v in (numbers.get("diff") or {}).items() if v is not None}
            | {f"gate_null_{k}": v for k, v in (numbers.get("null") or {}).items() if k in ("diff", "low")
               and v is not None}
            | ({"gate_base_room": numbers["base"]["room"]} if numbers.get("base") else {})
            | {f"gate_candidate_{k}": numbers.get("candidate", {}).get(k) for k in ("low", "high")
               if numbers.get("candidate", {}).get(k) is not None})


def _reference_metrics(references: dict) -> dict:
    """Each reference's pass rate, cost per task, the candidate's shares of them and its unanswered tasks."""
    keys = ("pass_rate", "cost_per_task_usd", "pass_share", "cost_share", "unanswered")
    return {f"reference_{name}_{k}": float(ref[k]) for name, ref in references.items() for k in keys
            if ref.get(k) is not None}
