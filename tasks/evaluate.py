"""Stage evaluate: held-out tasks, contamination check first, candidate against the champion, the gate decision."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pandas as pd

from flywheel import registry
from flywheel.checkpoints import saved_chat_template
from flywheel.config import PipelineConfig
from flywheel.contract import Task, prompt_hash
from flywheel.data.catalog import Catalog, content_hash
from flywheel.data.tasksets import row_task
from flywheel.evaluate.gate import GateDecision, decide
from flywheel.evaluate.report import plot_slices, slice_scores
from flywheel.evaluate.runner import check_contamination, evaluate_model, synthetic_prompt_hashes
from flywheel.metrics import GATE_COST_SAVING, GATE_COST_SAVING_LOW
from flywheel.stages import StageResult
from flywheel.train.rl.monitor import MONITOR_FILE
from tasks.caching import by_content
from tasks.kernel import stage_context, stage_task
from tasks.reports import publish_eval_report


def champion_key(pipeline: str, root: Path, cfg: PipelineConfig | None = None) -> str:
    """The champion the candidate is judged against; a champion that IS the candidate counts as none."""
    champion = registry.get_alias(pipeline, "champion")
    candidate = content_hash([Catalog(root, pipeline).model_dir("rl")], root)
    if champion is None or champion.model_hash == candidate:
        return "no-champion"
    return f"champion-{champion.version}-{champion.model_hash}"


@stage_task(cache_key_fn=by_content("evaluate", extra=champion_key))
def evaluate(pipeline: str, root: str = ".", parent_run_id: str | None = None) -> StageResult:
    """Score base, SFT and RL students (and the champion) on the held-out tasks; decide the gate."""
    with stage_context("evaluate", pipeline, root, parent_run_id, params=("evaluate", "gate")) as stage:
        cfg, catalog, root_path, run = stage.cfg, stage.catalog, stage.root, stage.run
        heldout = _heldout(catalog)
        candidate_hash = content_hash([catalog.model_dir("rl")], root_path)
        models, champion = _models(catalog, pipeline, candidate_hash)
        rows = []
        templates = _templates(catalog)
        for label, path in models.items():
            rows += evaluate_model(path, stage.env, heldout, label, max_turns=cfg.environment.max_turns,
                                   tool_timeout_s=cfg.environment.tool_timeout_s,
                                   batch_size=cfg.evaluate.batch_size, samples=cfg.evaluate.samples,
                                   temperature=cfg.evaluate.temperature, seed=cfg.evaluate.seed,
                                   device=cfg.student.device, chat_template=templates.get(label))
        table = pd.DataFrame(rows)
        catalog.write("eval", table)

        by_model = {label: table[table["model"] == label] for label in models}
        decision = decide(by_model["rl"], by_model.get("champion"), cfg.gate, flags=_monitor_flags(catalog))
        # the headline score stays greedy; the gate weighs every row (greedy and sampled) per task
        scores = {f"score_{label}": float(frame.loc[frame["sample"] == 0, "reward"].mean())
                  for label, frame in by_model.items()}
        if cfg.evaluate.samples:
            run.metrics({f"sampled_score_{label}": float(frame.loc[frame["sample"] > 0, "reward"].mean())
                         for label, frame in by_model.items()})
        report = {"passed": decision.passed, "reasons": decision.reasons,
                  "numbers": json.loads(decision.to_json())["numbers"],
                  "scores": scores, "candidate_hash": candidate_hash,
                  "champion_version": champion.version if "champion" in models else None}
        per_slice = slice_scores(table, cfg.gate)
        report["slice_scores"] = per_slice.round(6).to_dict("records")
        gate_path = catalog.write_json("evaluate", "gate.json", report)
        run.metrics(scores | _gate_metrics(decision, report["numbers"]))
        with tempfile.TemporaryDirectory() as tmp:
            plot = plot_slices(per_slice, Path(tmp) / "gate_slices.png", f"{pipeline}: held-out reward by slice")
            if plot is not None:
                run.artifact(plot)
        run.tags({"flywheel.gate": "passed" if decision.passed else "failed",
                  "flywheel.out.evaluate": content_hash([catalog.stage_dir("evaluate")], root_path)})
        run.artifact(gate_path)
        publish_eval_report(pipeline, report, table)
        return stage.done(scores, gate=report)


def _heldout(catalog: Catalog) -> list[Task]:
    """The held-out tasks (written as the heldout table), after checking none leaked into SFT or RL data."""
    tasks = catalog.read("tasks")
    catalog.write("heldout", tasks[tasks["split"] == "heldout"].reset_index(drop=True))
    heldout = [row_task(r) for r in catalog.read("heldout").to_dict("records")]
    prompt_of = {r["task_id"]: prompt_hash(json.loads(r["prompt"])) for r in tasks.to_dict("records")}
    synthetic = catalog.read("synthetic")
    check_contamination(heldout, {
        "sft data (synthetic)": synthetic_prompt_hashes(synthetic.loc[synthetic["accepted"], "messages"]),
        "rl rollouts": [prompt_of.get(t, t) for t in catalog.read("rollouts")["task_id"]],
    })
    return heldout


def _models(catalog: Catalog, pipeline: str, candidate_hash: str) -> tuple[dict[str, Path], registry.Version | None]:
    """Label -> checkpoint of every model to score (the champion unless it is the candidate); the champion."""
    models = {"base": catalog.base_model(), "sft": catalog.model_dir("sft"), "rl": catalog.model_dir("rl")}
    champion = registry.get_alias(pipeline, "champion")
    if champion is not None and champion.model_hash != candidate_hash:
        models["champion"] = registry.download(champion)
    return models, champion


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


def _gate_metrics(decision: GateDecision, numbers: dict) -> dict:
    """The gate's decision and numbers as MLflow metrics: passed, the differences and the candidate's interval."""
    cost = numbers.get("cost") or {}
    return ({"gate_passed": float(decision.passed), "gate_flagged": float(bool(numbers.get("flags")))}
            | ({GATE_COST_SAVING: cost["saving"], GATE_COST_SAVING_LOW: cost["low"]} if cost else {})
            | {f"gate_diff_{k}": v for k, v in (numbers.get("diff") or {}).items() if v is not None}
            | {f"gate_candidate_{k}": numbers.get("candidate", {}).get(k) for k in ("low", "high")
               if numbers.get("candidate", {}).get(k) is not None})
