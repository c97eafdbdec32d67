"""`flywheel loop`: retrain, serve the champion, drive the agent against it, and the next retrain collects it."""

from __future__ import annotations

import json
import re

import pytest
import yaml


def test_the_loop_on_a_factory_pipeline_runs_its_environment_under_its_limits(tmp_path):
    from test_envs_factory import _project

    from flywheel.agent import Limits
    from flywheel.serving.loop import round_harness, round_tasks

    _project(tmp_path, '{factory: "envs.echo:make_env", args: {greeting: hello}, max_turns: 3, '
                       'max_episode_tokens: 50, tool_timeout_s: 0.5}')
    harness = round_harness("small", tmp_path)
    assert harness.env.name == "echo" and harness.limits == Limits(max_turns=3, max_tokens=50, tool_timeout_s=0.5)
    assert [t.prompt[0]["content"] for t in round_tasks(harness.env, 3, seed=1001)] == ["hello"]


def test_the_loop_on_a_replay_pipeline_serves_its_collected_train_tasks(tmp_path, mlflow_store):
    from test_replay import pipeline, write_project

    from flywheel.serving.loop import round_harness, round_tasks
    from tasks.collect import collect

    write_project(tmp_path, pipeline())
    collect.fn(pipeline="bank", root=str(tmp_path))
    harness = round_harness("bank", tmp_path)
    recorded = {t.task_id: t for t in harness.env.recorded_tasks()}
    assert harness.env.name == "replay" and harness.limits.max_turns == 24 and recorded
    tasks = round_tasks(harness.env, 5, seed=1001)
    assert len(tasks) == 5 and all(recorded[t.task_id].split == "train" for t in tasks)
    assert round_tasks(harness.env, 5, seed=1001) == tasks  # seeded


@pytest.mark.slow
def test_two_rounds_serve_the_champion_and_collect_its_traffic(project, prefect_server):
    from typer.testing import CliRunner

    from flywheel.cli import app
    from flywheel.data.catalog import Catalog

    config = yaml.safe_load((project / "pipelines.yaml").read_text())
    config["pipelines"]["small"]["collect"]["sources"] = [
        {"name": "agent", "path": ["examples/traces/*.jsonl", "traces/served/small/*.jsonl"]}]
    (project / "pipelines.yaml").write_text(yaml.safe_dump(config))

    result = CliRunner().invoke(app, ["loop", "small", "--rounds", "2", "--episodes", "6", "--no-push",
                                      "--root", str(project)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    rounds = re.findall(r"round (\d): champion version (\d+); held-out mean reward ([\d.]+); "
                        r"new traces collected (\d+); served (\d+) answers to (\d+) episodes", result.output)
    assert [r[0] for r in rounds] == ["1", "2"], result.output
    assert int(rounds[0][4]) >= 6 and int(rounds[0][5]) == 6
    assert int(rounds[1][3]) > 0  # round 2's collect read what round 1 served

    traces = Catalog(project, "small").read("traces")
    served = [json.loads(m)["served"] for m in traces["metadata"] if "served" in json.loads(m)]
    assert served and {s["version"] for s in served} == {rounds[0][1]}
    assert set(traces.loc[traces["metadata"].str.contains('"served"'), "outcome"]) <= {"accepted", "rejected"}

    # a rollback, then the rolled-back version promoted again: its stored evaluation is on the held-out tasks of
    # round 2, the first version's on round 1's (fewer: traffic added tasks), yet it pairs with the champion
    _rollback_and_promote_again(project, rounds[1][1])

    # without the traffic folder among the sources the loop refuses before doing anything
    config["pipelines"]["small"]["collect"]["sources"] = ["examples/traces/*.jsonl"]
    (project / "pipelines.yaml").write_text(yaml.safe_dump(config))
    refused = CliRunner().invoke(app, ["loop", "small", "--root", str(project)])
    assert refused.exit_code == 2 and "traces/served/small/*.jsonl" in refused.output


def _rollback_and_promote_again(project, latest: str) -> None:
    from mlflow import MlflowClient
    from typer.testing import CliRunner

    from flywheel import promotion, registry
    from flywheel.cli import app
    from flywheel.config import load_pipeline

    previous = MlflowClient().get_model_version("small", latest).tags.get("flywheel.previous_champion")
    assert previous, "round 2 promoted its version over round 1's"
    runner = CliRunner()
    back = runner.invoke(app, ["promote", "small", "--rollback", "--root", str(project)])
    assert back.exit_code == 0 and f"champion is version {previous}" in back.output, back.output
    again = runner.invoke(app, ["promote", "small", latest, "--root", str(project)])
    assert again.exit_code == 0, again.output
    assert f"champion is version {latest} (gate; was {previous})" in again.output
    assert "do not pair" not in again.output
    # both scored again on today's held-out tasks, as promote does when no evaluation scored them side by side
    cfg = load_pipeline("small", project / "pipelines.yaml")
    table, where = promotion.evaluate_now("small", latest, previous, project, cfg)
    heldout = registry.client().search_runs(
        [registry.client().get_experiment_by_name("small").experiment_id], "attributes.run_name = 'eval'")
    assert set(table["model"]) == {"null", "rl", "champion"} and where.startswith("MLflow run ")
    assert heldout and int(heldout[0].data.params["heldout_tasks"]) == table["task_id"].nunique()
