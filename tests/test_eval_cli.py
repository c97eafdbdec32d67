"""`flywheel eval`: any policy scored on a pipeline's held-out tasks without training, beside the null policy, with
intervals and an MLflow run; an empty held-out set or a bad spec is an error before any model is loaded."""

from __future__ import annotations

import pandas as pd
from typer.testing import CliRunner

from flywheel import registry
from flywheel.cli import app
from flywheel.data.catalog import Catalog


def _collected(project) -> Catalog:
    from tasks.collect import collect

    collect.fn("small", str(project))
    return Catalog(project, "small")


def test_eval_prints_the_table_with_the_null_row_and_logs_a_run(project, tiny_student, openai_server):
    catalog = _collected(project)
    heldout = int((catalog.read("tasks")["split"] == "heldout").sum())
    out = CliRunner().invoke(app, ["eval", "small", "--policy", str(tiny_student), "--policy", "prod=openai:oracle",
                                   "--base-url", openai_server.url, "--price-input", "2.5", "--price-output", "10",
                                   "--show", "failed", "-n", "1", "--root", str(project)])
    assert out.exit_code == 0, out.output
    text = out.output
    assert f"pipeline 'small': {heldout} held-out tasks (greedy)" in text
    assert "mean reward [95% CI]" in text and "pass rate" in text and "cost per task" in text
    assert "│ null " in text and "0.000 [0.000, 0.000]" in text and "null: an empty answer, no tool calls" in text
    assert f"{tiny_student.name}: {tiny_student}" in text and f"prod: oracle at {openai_server.url}" in text
    assert "1.000 [1.000, 1.000]" in text, "the oracle behind the endpoint solves every held-out task"
    run_id = text.split("MLflow run ")[1].split()[0]

    run = registry.client().get_run(run_id)
    assert run.info.run_name == "eval" and run.info.status == "FINISHED"
    metrics = run.data.metrics
    assert metrics["score_null"] == metrics["pass_rate_null"] == 0.0
    assert metrics["pass_rate_prod"] == metrics["score_prod"] == 1.0
    assert f"score_{tiny_student.name}" in metrics and f"pass_rate_{tiny_student.name}" in metrics
    assert run.data.tags["flywheel.policy.prod"].startswith("oracle at http://127.0.0.1")
    import mlflow.artifacts

    table = pd.read_parquet(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="eval/eval.parquet"))
    assert set(table["model"]) == {"null", tiny_student.name, "prod"}
    assert (table.groupby("model")["task_id"].nunique() == heldout).all()
    assert (table.loc[table["model"] == "prod", "cost_usd"] > 0).all()
    assert (table.loc[table["model"] != "prod", "cost_usd"] == 0).all()  # the students are unpriced here

    # --show failed: one failed conversation (the untrained student's; the oracle fails none), then the count
    failed = table[~table["passed"] & (table["model"] != "null")]
    assert text.count(" · task ") == 1 and f"── {tiny_student.name} · task " in text and "(failed)" in text
    assert f"1 of {len(failed)} failed episode(s) shown from MLflow run {run_id}" in text
    # each episode an MLflow trace of the eval run, up to evaluate.trace_episodes per model, failed first
    import mlflow

    traces = mlflow.search_traces(locations=[run.info.experiment_id], run_id=run_id, return_type="list")
    counts = table.groupby("model").size().clip(upper=8).to_dict()  # the small pipeline's evaluate.trace_episodes
    assert pd.Series([t.info.tags["flywheel.model"] for t in traces]).value_counts().to_dict() == counts
    assert {t.info.tags["flywheel.trace"] for t in traces} == {"eval"}


def test_eval_refuses_an_empty_held_out_set_and_bad_specs_before_loading_a_model(project):
    runner = CliRunner()
    missing = runner.invoke(app, ["eval", "small", "--policy", "null", "--root", str(project)])
    assert missing.exit_code == 2 and "pipeline 'small' has no tasks table yet" in missing.output

    catalog = _collected(project)
    tasks = catalog.read("tasks")
    catalog.write("tasks", tasks.assign(split="train"))
    # the checkpoint named does not exist: the held-out set is checked first, so that is not what is said
    empty = runner.invoke(app, ["eval", "small", "--policy", "no/such/checkpoint", "--root", str(project)])
    assert empty.exit_code == 2, empty.output
    assert (f"pipeline 'small' has no held-out tasks to evaluate on: {catalog.table_path('tasks')} holds "
            f"{len(tasks)} task(s), none in split 'heldout'") in empty.output

    catalog.write("tasks", tasks)
    for spec, said in (("no/such/checkpoint", "is not a checkpoint folder (no config.json)"),
                       ("models:/small@champion", "the registry has no model 'small' with alias 'champion'"),
                       ("models:/small", "name a version or an alias"),
                       ("openai:", "openai: needs a model name")):
        bad = runner.invoke(app, ["eval", "small", "--policy", spec, "--root", str(project)])
        assert bad.exit_code == 2 and said in bad.output, (spec, bad.output)
    twice = runner.invoke(app, ["eval", "small", "--policy", "null", "--policy", "null", "--root", str(project)])
    assert twice.exit_code == 2 and "two policies are labelled ['null']" in twice.output
