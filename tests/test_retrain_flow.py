"""The whole loop under Prefect, MLflow and DVC: first run, fully cached rerun, a parameter change."""

from __future__ import annotations

import json

import pytest
import yaml

from flywheel.stages import ORDER


def _set(root, path: str, value) -> None:
    config = yaml.safe_load((root / "pipelines.yaml").read_text())
    node = config
    *parents, leaf = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    (root / "pipelines.yaml").write_text(yaml.safe_dump(config))


def _markdown_artifact(key: str) -> str:
    """The newest Prefect artifact under `key`, as the Prefect UI shows it."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    return max(found, key=lambda a: a.created).data


@pytest.mark.slow
def test_retrain_runs_caches_and_reruns_only_what_changed(project, prefect_server):
    from mlflow import MlflowClient

    from flows.retrain import retrain
    from flywheel import registry
    from flywheel.data import dvc
    from flywheel.data.catalog import Catalog

    first = retrain(pipeline="small", root=str(project))
    assert first.ran == list(ORDER)
    assert first.gate_passed and first.version == "1"
    assert "champion" in first.aliases and "challenger" in first.aliases
    assert set(first.scores) == {"score_null", "score_base", "score_sft", "score_rl"}
    assert dvc.status(project) == {}, "dvc status must be clean after a Prefect run"

    catalog = Catalog(project, "small")
    for table in ("traces", "quarantine", "tasks", "synthetic", "rollouts", "heldout", "eval"):
        assert len(catalog.read(table)) > 0, table
    heldout = catalog.read("tasks").query("split == 'heldout'")
    assert set(catalog.read("eval").query("model == 'rl'")["task_id"]) == set(heldout["task_id"])

    client = MlflowClient()
    experiment = client.get_experiment_by_name("small")
    runs = client.search_runs([experiment.experiment_id])
    parent = next(r for r in runs if r.info.run_name == "retrain")
    children = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert set(children) == set(ORDER)
    assert client.get_metric_history(children["sft"].info.run_id, "loss"), "SFT logs its loss per step"
    version = client.get_model_version("small", "1")
    assert version.tags["flywheel.gate"] == "passed"
    assert any(k.startswith("flywheel.dvc.data/small/synthesize") for k in version.tags)
    assert version.tags["flywheel.promotion"] == "gate" and version.tags["prefect.flow_run_id"]
    evaluated = {a.path for a in client.list_artifacts(children["evaluate"].info.run_id)}
    assert {"gate.json", "gate_slices.png"} <= evaluated
    # the version's page says the decision first, then the held-out table with the null row (docs/model-page.md)
    described = version.description
    assert described.startswith("**Gate: passed.** Version 1 (aliases: `challenger`, `champion`); it is champion.")
    assert "\n| null (empty answer) | 0.000" in described and "| rl (candidate) |" in described
    assert f"runs/{children['evaluate'].info.run_id})" in described and "`data/small/synthesize" in described
    assert not any(k.startswith("flywheel.data.") for k in version.tags), "no copies of the flywheel.dvc.* tags"
    assert not any(k.startswith("flywheel.dvc.") and not k.startswith(("flywheel.dvc.data/", "flywheel.dvc.models/"))
                   for k in version.tags), "the code the version ran is its git commit"
    for stage, png in (("sft", "plots/sft_loss.png"), ("rl", "plots/rl_reward_mean.png")):
        assert png in {a.path for a in client.list_artifacts(children[stage].info.run_id, "plots")}
    assert "summary.md" in {a.path for a in client.list_artifacts(children["register"].info.run_id)}
    model_page = _markdown_artifact("small-model")
    assert model_page.splitlines()[0] == described.splitlines()[0]
    assert model_page.count("](data:image/png;base64,") == 3  # the slices, the SFT loss, the RL reward

    second = retrain(pipeline="small", root=str(project))
    assert second.ran == [] and second.version == "1"

    # One stage's parameter: that stage and the ones after it run again, the ones before come from the cache.
    _set(project, "pipelines.small.sft.lr", 2.0e-3)
    third = retrain(pipeline="small", root=str(project))
    assert third.ran == ["sft", "rl", "evaluate", "register"]
    assert third.version == "2"
    assert registry.get_alias("small", "challenger").version == "2"
    gate = json.loads((project / "data/small/evaluate/gate.json").read_text())
    assert gate["champion_version"] == "1", "the new candidate is judged against the champion"
    assert "score_champion" in gate["scores"]
    assert dvc.status(project) == {}
