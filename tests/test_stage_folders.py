"""Stage jobs that share no folder (flows/stage.py): a job pulls its inputs from the DVC remote as the retrain
flow's dvc.lock entries record them, trusts a cached result only where its outputs are, commits, pushes and hands
its entry back, which the retrain flow records without the files.

The `stage` flow runs here in-process on Prefect's test server, in clones of one project that share only the DVC
remote (a local folder) and Prefect's result storage, as workers on two machines share S3;
benchmarks/stack_folders.py runs the same on the stack, two workers each in a clone of its own.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest


def _clone(source: Path, target: Path) -> Path:
    subprocess.run(["git", "clone", "-q", str(source), str(target)], check=True, capture_output=True)
    return target


def _md5s(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _job(name: str, folder: Path, coordinator: Path, push: bool = True):
    """Stage `name` as a worker in `folder` runs it for a retrain flow in `coordinator`: (result, cached)."""
    from flows.stage import handed, received, stage

    outcome = stage(name=name, pipeline="small", root=str(folder), lock_entries=handed(coordinator, "small"),
                    push=push)
    return received(coordinator, name, "small", outcome)


@pytest.mark.slow
def test_stages_in_folders_of_their_own_move_their_data_through_the_dvc_remote(project, prefect_server, tmp_path):
    from flows.stage import StageJobError
    from flywheel.data import dvc

    coordinator, first, second = (_clone(project, tmp_path / name) for name in ("retrain", "one", "two"))

    # collect in one folder, synthesize in another, each from what the retrain flow's dvc.lock says
    result, cached = _job("collect", first, coordinator)
    assert not cached and result.stage == "collect"
    result, cached = _job("synthesize", second, coordinator)
    assert not cached
    assert _md5s(second / "data/small/collect") == _md5s(first / "data/small/collect"), "pulled, byte for byte"
    assert not (first / "data/small/synthesize").exists()
    # the retrain flow's folder holds both stages' entries, as each job committed them, and none of their files
    lock = dvc.read_lock(coordinator)
    assert lock["collect@small"] == dvc.read_lock(first)["collect@small"]
    assert lock["synthesize@small"] == dvc.read_lock(second)["synthesize@small"]
    assert not (coordinator / "data").exists()
    made = _md5s(second / "data/small/synthesize")

    # a new machine in the second one's place (empty folder, empty DVC cache): Prefect's cache holds, and the
    # stage finds its outputs because they are pulled, not because it says so
    for gone in ("data", ".dvc/cache"):
        subprocess.run(["rm", "-rf", str(second / gone)], check=True)
    result, cached = _job("synthesize", second, coordinator)
    assert cached
    assert _md5s(second / "data/small/synthesize") == made
    assert dvc.read_lock(coordinator)["synthesize@small"] == lock["synthesize@small"]

    # a run that did not push: the next stage, elsewhere, cannot get its inputs and says so
    other_remote = tmp_path / "other-remote"
    unpushed, stranded, elsewhere = (_clone(project, tmp_path / name) for name in ("retrain-2", "three", "four"))
    for folder in (stranded, elsewhere):
        subprocess.run([sys.executable, "-m", "dvc", "remote", "add", "--local", "-d", "other", str(other_remote)],
                       cwd=folder, check=True, capture_output=True)
    _job("collect", stranded, unpushed, push=False)
    with pytest.raises(StageJobError, match=r"stage synthesize of small runs in .*four, which lacks its inputs "
                                            r"\(the outputs of collect\), and DVC could not pull them"):
        _job("synthesize", elsewhere, unpushed)


def test_each_stage_pulls_what_it_reads_and_goes_to_its_queue(tmp_path):
    """The stages a job pulls from (tasks/spec.py), and the work queue stages.json sends it to (not a job
    variable): the GPU stages to `gpu`, where only a GPU machine's worker need listen."""
    import json

    from conftest import REPO

    from flows.deployments import DeployError, stage_job_variables
    from flows.stage import QUEUE, upstream

    # sft reads collect too: its validation slice is drawn from the train tasks
    assert upstream("collect") == [] and upstream("sft") == ["collect", "synthesize"]
    assert upstream("evaluate") == ["collect", "synthesize", "sft", "rl"]
    assert upstream("register") == ["collect", "rl", "evaluate"]

    shipped = stage_job_variables(REPO / "infra/k8s/stages.json")
    assert {name: variables.get(QUEUE) for name, variables in shipped.items()} == {
        "collect": None, "synthesize": None, "sft": "gpu", "rl": "gpu", "evaluate": "gpu", "register": None}
    bad = json.loads((REPO / "infra/k8s/stages.json").read_text()) | {"rl": {"work_queue": 1}}
    (tmp_path / "stages.json").write_text(json.dumps(bad))
    with pytest.raises(DeployError, match=r"stages\.json: `work_queue` of stage\(s\) rl is not a queue name"):
        stage_job_variables(tmp_path / "stages.json")
