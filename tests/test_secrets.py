"""A teacher's API key reaches the teacher's server and nothing else: not stdout or stderr, not Python or Prefect
logs, not Prefect's persisted results, not MLflow (params, tags, metric names, artifacts), not the data."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from test_synthesize import KEY, KEY_ENV, openai_teacher, root, write_pipeline  # noqa: F401 -- root: a fixture

WRONG = "sk-wrong-0ther-k3y-91b2d7"


def _mlflow_text(run_id: str, folder: Path) -> str:
    import mlflow.artifacts
    import pyarrow.parquet as pq
    from mlflow import MlflowClient

    run = MlflowClient().get_run(run_id)
    text = json.dumps([run.data.params, run.data.tags, list(run.data.metrics),
                       [(d.dataset.name, d.dataset.source, d.dataset.profile) for d in run.inputs.dataset_inputs]])
    local = Path(mlflow.artifacts.download_artifacts(run_id=run_id, dst_path=str(folder)))
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        text += json.dumps(pq.read_table(path).to_pylist(), default=str) if path.suffix == ".parquet" else \
            path.read_text(errors="replace")
    return text


def _prefect_logs(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # logs go to the API from a background worker: send what is queued
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return [log.message for log in logs]


def _new_files_text(folder: Path, since: float) -> tuple[int, bytes]:
    files = [p for p in folder.rglob("*") if p.is_file() and p.stat().st_mtime >= since]
    return len(files), b"".join(p.read_bytes() for p in files)


def test_the_teacher_key_is_nowhere_but_on_the_wire(root, openai_server, monkeypatch, capfd, caplog,  # noqa: F811
                                                    prefect_server, tmp_path):
    from mlflow import MlflowClient
    from prefect import flow
    from prefect.runtime import flow_run

    from flywheel.data.catalog import Catalog
    from tasks.synthesize import synthesize

    caplog.set_level("DEBUG")
    openai_server.api_key = KEY
    write_pipeline(root, openai_teacher(openai_server, api_key_env=KEY_ENV), {"samples_per_task": 1})

    @flow(name="secrets-check", persist_result=True)
    def run_stage() -> tuple[str, dict | None, str]:
        try:
            return str(flow_run.id), synthesize("t", str(root)), ""
        except Exception as err:  # noqa: BLE001 -- the failure is what is checked
            return str(flow_run.id), None, f"{type(err).__name__}: {err}"

    # a refused key: the stage fails, and Prefect logs the task's exception with its traceback
    monkeypatch.setenv(KEY_ENV, WRONG)
    refused_id, result, error = run_stage()
    assert result is None and "refused the key in $" + KEY_ENV in error
    refused_logs = _prefect_logs(refused_id)
    assert any("refused the key" in m for m in refused_logs), refused_logs  # the logs were read
    failed = MlflowClient().search_runs([MlflowClient().get_experiment_by_name("t").experiment_id],
                                        "attributes.status = 'FAILED'")
    assert len(failed) == 1

    # the right key: the stage runs, its result persisted by Prefect
    monkeypatch.setenv(KEY_ENV, KEY)
    started = time.time() - 1
    ok_id, result, error = run_stage()
    assert result is not None, error
    assert openai_server.received, "the key went to the server"
    results_dir = Path(os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"])
    written, results = _new_files_text(results_dir, started)
    assert written > 0, "Prefect persisted the stage's result"

    out, err = capfd.readouterr()
    assert "synthesize [" in out  # the stage's progress was captured
    places = {
        "stdout": out, "stderr": err, "python logs": caplog.text,
        "prefect logs": "\n".join(refused_logs + _prefect_logs(ok_id)),
        "prefect results": results.decode("utf-8", "replace"),
        "mlflow (refused run)": _mlflow_text(failed[0].info.run_id, tmp_path / "a"),
        "mlflow (stage run)": _mlflow_text(result.run_id, tmp_path / "b"),
        "data": json.dumps(Catalog(root, "t").read("synthetic").to_dict("records"), default=str),
    }
    for where, text in places.items():
        for key in (KEY, WRONG):
            assert key not in text, f"{key} in {where}"
    assert places["mlflow (stage run)"].count(KEY_ENV) >= 1, "the variable's name is logged, not its value"


def test_a_key_pasted_as_eval_api_key_env_is_refused_without_echoing_it(tmp_path):
    import shutil

    from typer.testing import CliRunner

    from flywheel.cli import app

    shutil.copy(Path(__file__).resolve().parent.parent / "pipelines.yaml", tmp_path / "pipelines.yaml")
    pasted = "sk-proj-Pasted0Key1On2The3Command4Line"
    result = CliRunner().invoke(app, ["eval", "demo", "--policy", "openai:m", "--api-key-env", pasted,
                                      "--root", str(tmp_path)])
    assert result.exit_code == 2 and "api_key_env" in result.output and "never the key itself" in result.output
    assert "Pasted0Key" not in result.output
