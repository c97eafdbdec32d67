"""The example environment out of the package (examples/envs/shop) through `factory:`, end to end."""

from __future__ import annotations

import pytest
import yaml

from flywheel.stages import ORDER


@pytest.mark.slow
def test_a_pipeline_on_the_example_env_runs_end_to_end_and_logs_env_counters(project, prefect_server):
    from mlflow import MlflowClient

    from flows.retrain import retrain
    from flywheel.data.catalog import Catalog
    from tasks.spec import dvc_yaml

    config = yaml.safe_load((project / "pipelines.yaml").read_text())
    config["pipelines"]["small"]["environment"] = {"factory": "examples.envs.shop:make_env", "train_tasks": 60,
                                                   "heldout_tasks": 10, "max_turns": 4}
    (project / "pipelines.yaml").write_text(yaml.safe_dump(config))
    (project / "dvc.yaml").write_text(dvc_yaml(project))

    first = retrain(pipeline="small", root=str(project))
    assert first.ran == list(ORDER)
    catalog = Catalog(project, "small")
    tasks = catalog.read("tasks")
    assert set(tasks["env"]) == {"shop"} and set(tasks["slice"]) == {"status", "refund"}
    synthetic = catalog.read("synthetic")
    assert len(synthetic) > 0 and synthetic["accepted"].all()  # the scripted solver passes every task
    client = MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name("small").experiment_id])
    synthesize = next(r for r in runs if r.info.run_name == "synthesize")
    assert synthesize.data.metrics["env.tool_calls"] > 0 and synthesize.data.metrics["env.tool_errors"] == 0
    assert "env.tool_calls" in next(r for r in runs if r.info.run_name == "evaluate").data.metrics

    assert retrain(pipeline="small", root=str(project)).ran == []  # every stage cached
