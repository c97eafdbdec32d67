"""`flywheel eval`: any policies scored on a pipeline's held-out tasks, without training.

The same harness, rubric and held-out tasks as the evaluate stage, the null policy's row beside them, intervals over
tasks, and an MLflow run (`eval`) in the pipeline's experiment, so models can be compared before and between
retrains. No gate: nothing is promoted.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from flywheel import registry
from flywheel.agent import load_harness
from flywheel.config import PipelineConfig
from flywheel.data.catalog import Catalog
from flywheel.data.schemas import Eval
from flywheel.data.tasksets import row_task
from flywheel.evaluate.arms import SpecError, null_arm, score_arm, spec_arm
from flywheel.evaluate.report import model_scores
from flywheel.evaluate.runner import NoHeldoutError, require_heldout
from flywheel.evaluate.traces import log_traces
from flywheel.metrics import pass_rate_name, score_name
from flywheel.tags import policy_tag


@dataclass
class AdhocEval:
    """What `flywheel eval` measured: the eval rows, one line per policy, the MLflow run."""

    table: pd.DataFrame
    models: pd.DataFrame  # flywheel.evaluate.report.model_scores
    run_id: str
    tasks: int
    described: dict[str, str]  # label -> what the policy is
    user_errors: dict[str, int]


def evaluate_policies(pipeline: str, root: Path, cfg: PipelineConfig, specs: list[str], endpoint: dict,
                      samples: int | None = None) -> AdhocEval:
    """Score the policies `specs` names (flywheel.evaluate.arms.spec_arm) and the null policy on the held-out tasks.

    endpoint: ReferenceConfig fields for openai:MODEL specs. Raises NoHeldoutError or SpecError before any model
    is loaded.
    """
    catalog = Catalog(root, pipeline)
    path = catalog.table_path("tasks")
    if not path.exists():
        raise NoHeldoutError(f"pipeline '{pipeline}' has no tasks table yet ({path}): run `flywheel run {pipeline}` "
                             f"or `flywheel stage collect -p {pipeline}` first")
    tasks = catalog.read("tasks")
    require_heldout(pipeline, tasks["split"], path)
    heldout = [row_task(r) for r in tasks[tasks["split"] == "heldout"].to_dict("records")]
    prices = (cfg.evaluate.student_price_input_per_mtok, cfg.evaluate.student_price_output_per_mtok)
    arms = [null_arm()] + [spec_arm(s, pipeline, root, batch_size=cfg.evaluate.batch_size, device=cfg.student.device,
                                    endpoint=endpoint, prices=prices) for s in specs]
    labels = [arm.label for arm in arms]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise SpecError(f"--policy: two policies are labelled {twice}; name them apart with LABEL=SPEC")
    harness = load_harness(cfg.environment, root, pipeline)
    samples = cfg.evaluate.samples if samples is None else samples
    described = {arm.label: arm.describe for arm in arms}
    run = registry.start_run(root, pipeline, "eval", tags={policy_tag(k): v for k, v in described.items()})
    try:
        run.params({"policies": " ".join(specs), "heldout_tasks": len(heldout), "samples": samples})
        scored = {arm.label: score_arm(arm, harness, heldout, samples=samples, temperature=cfg.evaluate.temperature,
                                       seed=cfg.evaluate.seed) for arm in arms}
        table = pd.DataFrame([row for s in scored.values() for row in s.rows], columns=list(Eval.to_schema().columns))
        models = model_scores(table, cfg.gate, {label: s.unanswered for label, s in scored.items()})
        greedy = table[table["sample"] == 0]
        run.metrics({score_name(m): float(f["reward"].mean()) for m, f in greedy.groupby("model")}
                    | {pass_rate_name(m): float(f["passed"].mean()) for m, f in greedy.groupby("model")}
                    | {f"env.{k}": v for k, v in harness.env.counters.items()})
        with tempfile.TemporaryDirectory() as tmp:
            table.to_parquet(Path(tmp) / "eval.parquet", index=False)
            (Path(tmp) / "scores.json").write_text(json.dumps(json.loads(models.to_json(orient="records")),
                                                              indent=2))
            run.artifact(Path(tmp), "eval")
        log_traces(scored, run, pipeline, harness.env, cfg.evaluate.trace_episodes, kind="eval")
    except BaseException:
        run.end(ok=False)
        raise
    run.end(ok=True)
    return AdhocEval(table, models, run.run_id, len(heldout), described,
                     {label: s.user_errors for label, s in scored.items() if s.user_errors})
