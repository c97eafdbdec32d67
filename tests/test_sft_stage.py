"""The sft stage's MLflow record: per-step loss, learning rate, tokens/s and eval loss, the data as an input
(its digest the DVC hash), conversations counted by origin (teacher or accepted production trace)."""

from __future__ import annotations

import pytest

from flywheel.data.lineage import dvc_md5


@pytest.mark.slow
def test_sft_stage_logs_steps_eval_loss_inputs_and_origins(project):
    from mlflow import MlflowClient

    from flywheel.data.catalog import Catalog
    from tasks.collect import collect
    from tasks.sft import sft
    from tasks.synthesize import synthesize

    config = project / "pipelines.yaml"
    text = config.read_text()
    text = text.replace("synthesize: {samples_per_task: 1}", "synthesize: {samples_per_task: 1, "
                        "include_accepted_traces: true}")
    text = text.replace("sft: {steps: 60,", "sft: {eval_every: 5, eval_fraction: 0.1, log_every: 2, steps: 10,")
    config.write_text(text)
    collect.fn("small", str(project))
    synthesize.fn("small", str(project))
    result = sft.fn("small", str(project))

    client = MlflowClient()
    run = client.get_run(result.run_id)
    for metric in ("loss", "learning_rate", "tokens_per_s", "eval_loss"):
        assert client.get_metric_history(run.info.run_id, metric), metric
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 4, 6, 8, 10]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval_loss")] == [5, 10]
    metrics = run.data.metrics
    synthetic = Catalog(project, "small").read("synthetic")
    accepted = synthetic[synthetic["accepted"]]
    assert metrics["conversations_from_traces"] == (accepted["teacher"] == "trace").sum() > 0
    assert metrics["conversations_from_teacher"] + metrics["conversations_from_traces"] == len(accepted)
    # every accepted conversation is accounted for: trained on, held out for the eval loss, or dropped
    assert metrics["final_conversations"] == len(accepted)
    assert metrics["final_train_examples"] + metrics["final_eval_examples"] + metrics["final_dropped_long"] + \
        metrics["final_dropped_no_target"] == len(accepted)
    assert metrics["final_eval_examples"] > 0 and metrics["final_train_examples"] > 0
    assert metrics["final_dropped_no_target"] <= metrics["final_truncated"], "only a cut can leave no target"
    [data] = run.inputs.dataset_inputs
    assert data.dataset.name == "small-synthetic"
    assert data.dataset.digest == dvc_md5(project / "data" / "small" / "synthesize")
