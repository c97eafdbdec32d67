"""MLflow on SQLite: nested stage runs, idempotent registration, aliases and their history."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient

from flywheel import registry


def _model(tmp_path: Path, content: str) -> Path:
    folder = tmp_path / f"model-{content}"
    folder.mkdir()
    (folder / "config.json").write_text(f'{{"id": "{content}"}}')
    return folder


def test_stage_runs_nest_under_the_pipeline_run(tmp_path, mlflow_store):
    parent = registry.start_run(tmp_path, "p", "retrain")
    with registry.stage_run(tmp_path, "p", "sft", parent.run_id, {"sft": {"lr": 0.1}}) as run:
        run.metrics({"loss": 1.0}, step=1)
        run.metrics({"loss": 0.5, "ignored": float("nan")}, step=2)
    stored = MlflowClient().get_run(run.run_id)
    assert stored.data.tags["mlflow.parentRunId"] == parent.run_id
    assert stored.data.params["sft.lr"] == "0.1"
    assert [m.value for m in MlflowClient().get_metric_history(run.run_id, "loss")] == [1.0, 0.5]
    assert stored.info.status == "FINISHED"


def test_a_failing_stage_marks_its_run_failed(tmp_path, mlflow_store):
    with pytest.raises(RuntimeError, match="boom"):  # the stage's error goes on to the caller, unchanged
        with registry.stage_run(tmp_path, "p", "rl", None, {}) as run:
            raise RuntimeError("boom")
    assert MlflowClient().get_run(run.run_id).info.status == "FAILED"


def test_registration_is_idempotent_and_aliases_move(tmp_path, mlflow_store):
    from flywheel.config import GateConfig
    from flywheel.promotion import promote

    run = registry.start_run(tmp_path, "p", "register")
    first = registry.register(run, "p", _model(tmp_path, "a"), "hash-a", {"flywheel.gate": "passed"},
                              ["challenger"])
    promote("p", first.version, GateConfig(), force=True)
    again = registry.register(run, "p", _model(tmp_path, "a2"), "hash-a", {}, ["challenger"])
    assert first.version == again.version == "1", "a retried registration makes no second version"
    second = registry.register(run, "p", _model(tmp_path, "b"), "hash-b", {}, ["challenger"])
    assert second.version == "2"
    assert registry.get_alias("p", "champion").version == "1"
    assert registry.get_alias("p", "challenger").version == "2"
    third = registry.register(run, "p", _model(tmp_path, "c"), "hash-c", {}, ["challenger"])
    promote("p", third.version, GateConfig(), force=True)
    assert registry.get_alias("p", "champion").version == third.version == "3"
    tags = MlflowClient().get_model_version("p", "3").tags
    assert tags["flywheel.previous_champion"] == "1" and tags["flywheel.model_hash"] == "hash-c"
    downloaded = registry.download(registry.get_alias("p", "champion"), tmp_path / "dl")
    assert (downloaded / "config.json").read_text() == '{"id": "c"}'


def test_a_version_whose_artifacts_moved_away_is_a_clear_error(tmp_path, mlflow_store):
    """MLflow finds nothing at a dead artifact location and only logs it; the download says what happened."""
    import shutil
    from urllib.parse import urlparse

    run = registry.start_run(tmp_path, "p", "register")
    version = registry.register(run, "p", _model(tmp_path, "a"), "hash-a", {}, ["challenger"])
    source = Path(urlparse(registry.get_alias("p", "challenger").source).path)
    stored = next(parent for parent in [source, *source.parents] if parent.name == "mlartifacts")
    shutil.move(stored, tmp_path / "moved-away")
    with pytest.raises(FileNotFoundError, match=f"model 'p' version {version.version}: no files at .*moved"):
        registry.download(registry.get_alias("p", "challenger"), tmp_path / "dl")


def test_no_model_no_alias(mlflow_store):
    assert registry.get_alias("nothing-here", "champion") is None


def test_two_registrations_of_one_model_racing_past_the_check_leave_one_version(tmp_path, mlflow_store, monkeypatch):
    """Both look before either creates (a barrier forces it), both create; the later removes itself."""
    import threading

    run = registry.start_run(tmp_path, "p", "register")
    checked = threading.Barrier(2, timeout=30)
    holding = registry._holding
    first_look = threading.local()

    def look_then_wait(c, name, model_hash):
        found = holding(c, name, model_hash)
        if not getattr(first_look, "done", False):  # each racer's check, then both go on to create
            first_look.done = True
            checked.wait()
        return found

    monkeypatch.setattr(registry, "_holding", look_then_wait)
    results, errors = [], []

    def racer(content: str) -> None:
        try:
            results.append(registry.register(run, "p", _model(tmp_path, content), "hash-same", {}, ["challenger"]))
        except Exception as err:  # surfaced below: a thread's exception is otherwise lost
            errors.append(err)

    threads = [threading.Thread(target=racer, args=(c,)) for c in ("x", "y")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    versions = MlflowClient().search_model_versions("name = 'p'")
    assert [str(v.version) for v in versions] == ["1"], "exactly one version holds the model"
    assert [r.version for r in results] == ["1", "1"], "both registrations name the surviving version"
    assert registry.get_alias("p", "challenger").version == "1"


def test_an_alias_another_registration_inserted_first_is_set_again_and_other_errors_stand(tmp_path, mlflow_store):
    """Two registrations at once that set one new alias both find none and insert it: the later insert fails on
    the unique key (seen once in a full suite run: UNIQUE constraint failed, from the racing test above). The
    race cannot be forced on demand, so the client's first call fails as MLflow's store then does; the
    second, real call sets the alias. A failure of another kind is not retried."""
    from mlflow.exceptions import MlflowException

    run = registry.start_run(tmp_path, "p", "register")
    registry.register(run, "p", _model(tmp_path, "x"), "hash-x", {}, [])
    real = MlflowClient()

    class Racing:
        def __init__(self, message: str):
            self.message, self.calls = message, 0

        def set_registered_model_alias(self, name, alias, version):
            self.calls += 1
            if self.calls == 1:
                raise MlflowException(self.message)
            real.set_registered_model_alias(name, alias, version)

    raced = Racing("(sqlite3.IntegrityError) UNIQUE constraint failed: registered_model_aliases.workspace, "
                   "registered_model_aliases.name, registered_model_aliases.alias")
    registry.set_alias(raced, "p", "challenger", "1")
    assert raced.calls == 2 and registry.get_alias("p", "challenger").version == "1"
    other = Racing("RESOURCE_DOES_NOT_EXIST: Model Version (name=p, version=9) not found")
    with pytest.raises(MlflowException, match="not found"):
        registry.set_alias(other, "p", "champion", "9")
    assert other.calls == 1
