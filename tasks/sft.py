"""Stage sft: distil the accepted teacher episodes into the student, loss on assistant tokens only."""

from __future__ import annotations

import json
import shutil

from flywheel.checkpoints import adapter_base
from flywheel.data.lineage import dvc_md5, log_dataset
from flywheel.metrics import final_metrics
from flywheel.stages import StageResult
from flywheel.tags import ADAPTER_BASE_TAG
from flywheel.train.context import check_fit, longest_collected
from flywheel.train.sft import train_sft
from flywheel.train.tiny import build_tiny_student, render_conversation
from tasks.kernel import stage_context, stage_task
from tasks.progress import log_curve, progress


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
                     "conversations_from_traces": from_traces})
        template = root_path / cfg.student.chat_template if cfg.student.chat_template else None
        report = progress(run, "sft", cfg.sft.steps, "loss")

        def on_log(step: int, values: dict) -> None:
            if "loss" in values:
                report(step, values)
            else:  # eval losses go to MLflow only: the progress line is about training steps
                run.metrics(values, step=step)

        result = train_sft(catalog.base_model(), rows, catalog.model_dir("sft"), cfg.sft, on_log=on_log,
                           chat_template=template,
                           accelerate_config=root_path / "infra" / "accelerate" / f"{cfg.sft.launcher}.yaml",
                           device=cfg.student.device)
        run.metrics(final_metrics(result))
        log_curve(run, "sft")
        base_of_adapter = adapter_base(catalog.model_dir("sft"))
        if base_of_adapter:
            run.tags({ADAPTER_BASE_TAG: base_of_adapter})
        return stage.done(result)
