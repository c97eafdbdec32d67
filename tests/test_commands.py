"""The commands as a user types them (`flywheel run`, `flywheel stage` through `dvc repro`, `dvc status`), each a
subprocess on one project: what runs again after a code change, a moved folder, a new champion, a new param.

The subprocesses import the project's own copy of the code (PYTHONPATH), so editing a file there is a code
change the stages' cache keys and DVC both see. One full run is shared by every test here, in order.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import make_project

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


class Project:
    """The project folder (it moves), its environment, and the commands run in it."""

    def __init__(self, root: Path, state: Path, api_url: str):
        self.root, self.state, self.api_url = root, state, api_url

    def env(self) -> dict:
        return {**os.environ, "PYTHONPATH": str(self.root), "PATH": f"{BIN}:{os.environ['PATH']}",
                "COLUMNS": "200",  # rich wraps at 80 otherwise
                "MLFLOW_TRACKING_URI": f"sqlite:///{self.state / 'mlflow.db'}",
                "PREFECT_HOME": str(self.state / "prefect"),
                "PREFECT_API_URL": self.api_url,  # the session's server: no ephemeral one to start per command
                "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(self.state / "prefect-results")}

    def command(self, *args: str) -> str:
        done = subprocess.run(list(args), cwd=self.root, env=self.env(), capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, f"{args}: {done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout

    def run(self) -> tuple[list[str], list[str]]:
        """`flywheel run small`: (stages that ran, stages answered from the cache)."""
        out = self.command(str(BIN / "flywheel"), "run", "small", "--no-push")
        self.last_out = out
        found = re.search(r"stages run: (.*?); cached: (.*?);", out)
        assert found, out[-3000:]
        ran, cached = (part.split(", ") if part != "none" else [] for part in found.groups())
        return ran, cached

    def dvc(self, *args: str) -> str:
        return self.command(sys.executable, "-m", "dvc", *args)


@pytest.fixture(scope="module")
def ran(tmp_path_factory, prefect_server) -> Project:
    """The small pipeline's project after one full `flywheel run`."""
    from prefect.settings import PREFECT_API_URL

    base = tmp_path_factory.mktemp("commands")
    project = Project(make_project(base / "project", base / "dvc-remote"), base / "state", PREFECT_API_URL.value())
    ran, cached = project.run()
    assert ran == ["collect", "synthesize", "sft", "rl", "evaluate", "register"] and cached == []
    assert "up to date" in project.dvc("status")
    return project


def test_a_moved_project_answers_every_stage_from_the_cache(ran):
    """Cache keys are made of content, never of paths: the same project elsewhere runs nothing.

    The project goes back where it was after: MLflow keeps the absolute artifact location of its experiment and
    of each version (the moved run even writes its artifacts under the old path), so a stage that downloads the
    champion (evaluate) needs the project there; the module's tests are spread over pytest-xdist's workers, and
    none may depend on this one having run before it."""
    home = ran.root
    moved = ran.root.parent / "moved" / "elsewhere"
    moved.parent.mkdir()
    shutil.move(home, moved)
    ran.root = moved
    try:
        done, cached = ran.run()
        assert done == [] and cached == ["collect", "synthesize", "sft", "rl", "evaluate", "register"]
        assert "up to date" in ran.dvc("status")
    finally:
        if home.exists():  # the moved run's own MLflow artifacts, written to the experiment's recorded location
            shutil.rmtree(home)
        shutil.move(moved, home)
        ran.root = home


def test_a_run_records_each_stage_time_beside_its_estimate(ran):
    """`flywheel run` prints the estimate before it starts, and records it (params estimate.<stage>_s) beside
    each stage's measured seconds (metrics seconds.<stage>) on the pipeline's run; the summary shows both."""
    from mlflow import MlflowClient

    out = " ".join(ran.last_out.split())
    assert "estimated time" in out and "stage times, measured (estimated): collect" in out
    assert re.search(r"sft \d+:\d\d \(\d+:\d\d, x\d+\.\d\d\)", out), out[-2000:]
    client = MlflowClient(tracking_uri=ran.env()["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("small").experiment_id],
                              "tags.mlflow.runName = 'retrain'", order_by=["start_time DESC"], max_results=1)
    params, metrics = runs[0].data.params, runs[0].data.metrics
    for stage in ("synthesize", "sft", "rl", "evaluate", "total"):
        assert float(params[f"estimate.{stage}_s"]) >= 0
    assert all(metrics[f"seconds.{stage}"] >= 0 for stage in ("collect", "synthesize", "sft", "rl", "evaluate"))


def test_a_changed_code_file_runs_its_stage_and_those_after_it(ran):
    """A comment in tasks/evaluate.py: evaluate runs (its code changed) and register after it (evaluate's
    output changed: the eval table holds measured latency); the stages before come from the cache."""
    path = ran.root / "tasks/evaluate.py"
    path.write_text(path.read_text() + "\n# a change to the stage's code\n")
    assert "tasks/evaluate.py" in ran.dvc("status")  # DVC sees the same change
    done, cached = ran.run()
    assert done == ["evaluate", "register"] and cached == ["collect", "synthesize", "sft", "rl"]
    assert "up to date" in ran.dvc("status")


def test_a_new_champion_alone_reruns_evaluate_and_register(ran, monkeypatch):
    """Nothing in the project changes, only who is champion: evaluate scores the candidate against the new
    one; register runs too, because it reads evaluate's output (the gate decision), which changed."""
    from flywheel import promotion, registry
    from flywheel.config import GateConfig

    monkeypatch.setenv("MLFLOW_TRACKING_URI", ran.env()["MLFLOW_TRACKING_URI"])
    before = registry.get_alias("small", "champion").version
    model = ran.root.parent / "other-champion"
    shutil.copytree(ran.root / "models/small/sft", model)  # a real checkpoint, not the candidate
    record = registry.start_run(ran.root, "small", "register")
    other = registry.register(record, "small", model, "hash-other-champion", {}, []).version
    record.end(ok=True)
    assert promotion.promote("small", other, GateConfig(), force=True).promoted and other != before

    done, cached = ran.run()
    assert done == ["evaluate", "register"] and cached == ["collect", "synthesize", "sft", "rl"]
    gate = yaml.safe_load((ran.root / "data/small/evaluate/gate.json").read_text())
    assert gate["champion_version"] == other


def test_dvc_repro_runs_flywheel_stage_for_what_changed(ran):
    """`dvc repro` after a gate parameter change: the commands in dvc.yaml (`flywheel stage evaluate`,
    `flywheel stage register`) run, and nothing else."""
    config = yaml.safe_load((ran.root / "pipelines.yaml").read_text())
    config["pipelines"]["small"]["gate"]["margin"] = 0.4
    (ran.root / "pipelines.yaml").write_text(yaml.safe_dump(config))
    out = ran.dvc("repro")
    ran_stages = re.findall(r"Running stage '(\w+)@small'", out)
    assert ran_stages == ["evaluate", "register"], out[-3000:]
    assert "evaluate: done (MLflow run" in out and "register: done (MLflow run" in out  # `flywheel stage`
    assert "up to date" in ran.dvc("status")
    assert "Data and pipelines are up to date" in ran.dvc("repro")


def test_dvc_asks_about_one_pipeline_where_another_never_ran(ran):
    """docs/pipeline.md's per-pipeline `dvc status --with-deps` and `dvc repro --dry` work beside a pipeline that
    never ran, where a bare `dvc repro --dry` fails (DVC hashes the deps a dry run does not write) and a bare `dvc
    status` lists every stage of the pipeline that never ran. Without --with-deps, `dvc status register@small`
    looks at register alone: a changed file upstream (here collect's code) is not in its answer."""
    from tasks.spec import dvc_yaml

    files = {name: (ran.root / name).read_text() for name in ("pipelines.yaml", "dvc.yaml", "tasks/collect.py")}
    try:
        config = yaml.safe_load(files["pipelines.yaml"])
        config["pipelines"]["never"] = copy.deepcopy(config["pipelines"]["small"])
        (ran.root / "pipelines.yaml").write_text(yaml.safe_dump(config))
        (ran.root / "dvc.yaml").write_text(dvc_yaml(ran.root))
        assert "up to date" in ran.dvc("status", "--with-deps", "register@small")
        assert "collect@never" in ran.dvc("status") and "collect@small" not in ran.dvc("status")
        (ran.root / "tasks/collect.py").write_text(files["tasks/collect.py"] + "\n# an edit upstream\n")
        assert "up to date" in ran.dvc("status", "register@small")  # register's own deps did not change
        upstream = ran.dvc("status", "--with-deps", "register@small")
        assert "collect@small" in upstream and "tasks/collect.py" in upstream, upstream
        (ran.root / "tasks/collect.py").write_text(files["tasks/collect.py"])
        dry = ran.dvc("repro", "--dry", "register@small")
        assert "Running stage" not in dry and "Data and pipelines are up to date" in dry, dry
        bare = subprocess.run([sys.executable, "-m", "dvc", "repro", "--dry"], cwd=ran.root, env=ran.env(),
                              capture_output=True, text=True, timeout=300)
        assert bare.returncode != 0 and "data/never/collect" in bare.stdout + bare.stderr
    finally:
        for name, text in files.items():
            (ran.root / name).write_text(text)


def test_on_policy_distillation_through_the_stage(ran, monkeypatch):
    """rl.objective opd with a local teacher checkpoint (here the SFT model's copy, so the tokenizer is the
    student's), with the exact forward KL: the rl stage runs and logs the per-token KL to the teacher (sampled,
    and the exact term) in MLflow each step."""
    import mlflow

    from tasks.spec import dvc_yaml

    teacher = ran.root / "teachers" / "small"
    shutil.copytree(ran.root / "models/small/sft", teacher)
    config = yaml.safe_load((ran.root / "pipelines.yaml").read_text())
    config["pipelines"]["small"]["rl"] |= {"objective": "opd", "group_size": 1,
                                           "opd": {"teacher": "teachers/small", "kl_coef": 1.0,
                                                   "divergence": "forward"}}
    (ran.root / "pipelines.yaml").write_text(yaml.safe_dump(config))
    (ran.root / "dvc.yaml").write_text(dvc_yaml(ran.root))
    done, cached = ran.run()
    assert done == ["rl", "evaluate", "register"] and cached == ["collect", "synthesize", "sft"]
    assert "up to date" in ran.dvc("status")

    monkeypatch.setenv("MLFLOW_TRACKING_URI", ran.env()["MLFLOW_TRACKING_URI"])
    run = mlflow.search_runs(search_all_experiments=True, filter_string="tags.`flywheel.stage` = 'rl'",
                             order_by=["start_time DESC"], output_format="list")[0]
    kl = mlflow.MlflowClient().get_metric_history(run.info.run_id, "teacher_kl")
    assert [m.step for m in kl] == [0, 1] and all(m.value == m.value for m in kl)  # logged, not NaN
    exact = mlflow.MlflowClient().get_metric_history(run.info.run_id, "teacher_divergence")
    assert [m.step for m in exact] == [0, 1] and all(m.value >= 0 for m in exact)
    assert run.data.metrics["final_teacher_tokens"] > 0 and run.data.metrics["final_teacher_failed_groups"] == 0

    # new teacher bytes are a new rl key: tests/test_cache_keys.py (a rerun here would cost the suite 30 s)
