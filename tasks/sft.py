"""Stage sft: distil the accepted teacher episodes into the student, loss on assistant tokens only."""

from __future__ import annotations

import json
import shutil

from flywheel.agent import Harness
from flywheel.checkpoints import adapter_base
from flywheel.config import ConfigError, SFTConfig
from flywheel.contract import Task
from flywheel.data.catalog import Catalog
from flywheel.data.lineage import dvc_md5, log_dataset
from flywheel.data.tasksets import row_task
from flywheel.metrics import final_metrics
from flywheel.stages import StageResult
from flywheel.tags import ADAPTER_BASE_TAG
from flywheel.train.context import check_fit, longest_collected
from flywheel.train.sft import train_sft
from flywheel.train.sft_validation import Validate, validation_slice
from flywheel.train.tiny import build_tiny_student, render_conversation
from tasks.kernel import stage_context, stage_task
from tasks.progress import log_curve

VALIDATION_BATCH = 64  # episodes generated together at a validation point (evaluate's default batch)


@stage_task()
def sft(pipeline: str, root: str = ".", parent_run_id: str | None = None) -> StageResult:
    """Build (tiny) or locate the base student, then SFT it on the accepted synthetic conversations."""
    with stage_context("sft", pipeline, root, parent_run_id, params=("student", "sft")) as stage:
        cfg, catalog, root_path, run = stage.cfg, stage.catalog, stage.root, stage.run
        if longest_collected(stage.env):  # replay: prompts `flywheel run` could not read before collect wrote them
            check_fit(pipeline, cfg, stage.env, root_path)
        synthetic = catalog.read("synthetic")
        log_dataset(run.run_id, synthetic, f"{pipeline}-synthetic", catalog.stage_dir("synthesize"),
                    dvc_md5(catalog.stage_dir("synthesize")))
        accepted = synthetic[synthetic["accepted"]]
        if accepted.empty:
            raise ValueError(f"{catalog.table_path('synthetic')}: no accepted samples to train on")
        validation = _validation_tasks(catalog, cfg.sft, set(accepted["task_id"]))
        held_back = {t.task_id for t in validation}  # their conversations never train: they pick the checkpoint
        accepted = accepted[~accepted["task_id"].isin(held_back)]
        if accepted.empty:
            raise ConfigError(f"pipelines.yaml: pipelines.{pipeline}.sft.validation_tasks "
                              f"{cfg.sft.validation_tasks}: every accepted sample in "
                              f"{catalog.table_path('synthetic')} is of a validation task, none is left to train on: "
                              "lower it, or give the environment more train tasks")
        rows = [{"messages": json.loads(m), "tools": json.loads(t)}
                for m, t in zip(accepted["messages"], accepted["tools"], strict=True)]
        # accepted production traces enter through synthesize.include_accepted_traces (teacher "trace")
        from_traces = int((accepted["teacher"] == "trace").sum())
        base_dir = catalog.model_dir("base")
        if base_dir.exists():
            shutil.rmtree(base_dir)
        if cfg.student.model == "tiny":
            # the tokenizer learns from training conversations only, never from held-out prompts
            build_tiny_student([render_conversation(r["messages"], r["tools"]) for r in rows],
                               cfg.student.tiny, base_dir)
        else:
            catalog.name_base(cfg.student.model)
        run.metrics({"train_conversations": len(rows), "conversations_from_teacher": len(rows) - from_traces,
                     "conversations_from_traces": from_traces, "validation_tasks": len(validation)})
        template = root_path / cfg.student.chat_template if cfg.student.chat_template else None
        print(f"      sft: {len(rows)} conversations, about {cfg.sft.planned_steps(len(rows))} steps"
              + (f", {len(validation)} validation tasks pick the checkpoint" if validation else ""), flush=True)
        validate = _validator(stage.harness, validation, cfg.sft.precision) if validation else None

        def on_log(step: int, values: dict) -> None:
            run.metrics(values, step=step)  # the trainer prints the progress line itself

        result = train_sft(catalog.base_model(), rows, catalog.model_dir("sft"), cfg.sft, on_log=on_log,
                           chat_template=template,
                           accelerate_config=root_path / "infra" / "accelerate" / f"{cfg.sft.launcher}.yaml",
                           device=cfg.student.device, validate=validate)
        run.metrics(final_metrics(result))
        log_curve(run, "sft")
        base_of_adapter = adapter_base(catalog.model_dir("sft"))
        if base_of_adapter:
            run.tags({ADAPTER_BASE_TAG: base_of_adapter})
        return stage.done(result)


def _validation_tasks(catalog: Catalog, cfg: SFTConfig, targets: set[str]) -> list[Task]:
    """sft.validation_tasks of the train tasks with an accepted conversation, the tasks SFT would otherwise learn
    from (not a slice synthesize.exclude_slices leaves out, nor one the teacher failed): see
    flywheel.train.sft_validation; none when it is 0."""
    if not cfg.validation_tasks:
        return []
    tasks = catalog.read("tasks")
    train = tasks[(tasks["split"] == "train") & tasks["task_id"].isin(targets)]
    return validation_slice([row_task(r) for r in train.to_dict("records")], cfg)


def _validator(harness: Harness, tasks: list[Task], precision: str = "fp32") -> Validate:
    """(live model, tokenizer) -> (pass rate, mean reward): greedy episodes through the harness, as evaluate runs
    them (evaluate_policy), under the precision SFT trains in."""
    from flywheel.evaluate.runner import evaluate_policy
    from flywheel.policies.hf import HFPolicy

    def validate(model, tokenizer) -> tuple[float, float]:
        policy = HFPolicy(model, tokenizer, batch_size=VALIDATION_BATCH, precision=precision)
        rows = evaluate_policy(policy, harness, tasks, "sft validation").rows
        if not rows:
            return 0.0, 0.0
        return (sum(bool(r["passed"]) for r in rows) / len(rows), sum(float(r["reward"]) for r in rows) / len(rows))

    return validate
