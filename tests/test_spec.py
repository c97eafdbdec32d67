"""dvc.yaml and the Prefect cache keys (tasks/spec.py) describe the same stages, deps, params and outs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from flywheel.config import read_pipelines_file
from flywheel.stages import ORDER
from tasks.spec import STAGES, dvc_yaml, source_deps

REPO = Path(__file__).resolve().parent.parent


def test_dvc_yaml_is_generated_from_the_stage_specs():
    assert (REPO / "dvc.yaml").read_text() == dvc_yaml(REPO), "run `flywheel dvc-yaml`"
    stages = yaml.safe_load(dvc_yaml())["stages"]
    assert list(stages) == list(ORDER)
    written = {name: set(raw) for name, raw in read_pipelines_file(REPO / "pipelines.yaml").items()}
    for name, spec in STAGES.items():
        params = stages[name]["do"].get("params", [{}])[0].get("pipelines.yaml", [])
        if params != [f"pipelines.${{key}}.{section}" for section in spec.config]:
            # a pipeline that leaves a section out names only those it writes (DVC refuses a missing key)
            assert params == [f"${{item.params[{i}]}}" for i in range(len(spec.config))], name
            for pipeline, item in stages[name]["foreach"].items():
                named = {f"pipelines.{pipeline}.{s}" for s in spec.config if s in written[pipeline]}
                # none written: `environment` (always written) fills the slots
                assert set(item["params"]) == (named or {f"pipelines.{pipeline}.environment"}), (name, pipeline)


def test_every_code_dependency_exists():
    for spec in STAGES.values():
        for path in spec.code:
            assert (REPO / path).exists(), f"{spec.name}: {path}"


def test_generating_needs_the_pipelines_file_it_follows(tmp_path):
    from flywheel.config import ConfigError

    with pytest.raises((ConfigError, FileNotFoundError)):
        dvc_yaml(tmp_path)


def test_source_deps_are_the_folders_before_the_first_wildcard():
    from flywheel.config import CollectConfig

    cfg = SimpleNamespace(collect=CollectConfig(sources=[
        "logs/a/*.jsonl", "logs/a/deep/**/*.jsonl", "exports/2026-*/x.json", "one/file.jsonl",
        {"s3": "s3://bucket/prefix/"}]))
    assert source_deps(cfg) == ["exports", "logs/a", "one/file.jsonl"]


def _two_pipelines(project: Path) -> None:
    """Pipeline `one` reads logs/one, `two` logs/two and an S3 prefix, `three` only S3."""
    config = yaml.safe_load((project / "pipelines.yaml").read_text())
    small = config["pipelines"].pop("small")
    for name, sources in (("one", ["logs/one/*.jsonl"]), ("two", ["logs/two/*.jsonl", {"s3": "s3://b/t/"}]),
                          ("three", [{"s3": "s3://b/t/"}])):
        config["pipelines"][name] = {**small, "collect": {**small["collect"], "sources": sources}}
        (project / "data" / name / "collect").mkdir(parents=True)
        (project / "data" / name / "collect" / "traces.parquet").write_text(name)  # stands for the output
    for name in ("one", "two"):
        (project / "logs" / name).mkdir(parents=True)
        (project / "logs" / name / "a.jsonl").write_text("{}\n")
    (project / "pipelines.yaml").write_text(yaml.safe_dump(config))


def test_each_pipelines_collect_stage_depends_on_its_own_sources_in_real_dvc(project):
    """dvc.yaml generated for three pipelines, read by the real `dvc`: a change under one pipeline's sources
    makes only that pipeline's collect stage stale."""
    _two_pipelines(project)
    (project / "dvc.yaml").write_text(dvc_yaml(project))
    stages = yaml.safe_load((project / "dvc.yaml").read_text())["stages"]
    assert stages["collect"]["foreach"] == {"one": {"sources": ["logs/one"]}, "two": {"sources": ["logs/two"]},
                                            "three": {"sources": ["tasks/collect.py"]}}

    def dvc(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=project, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout

    for name in ("one", "two", "three"):
        dvc("commit", "--force", f"collect@{name}")
    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    deps = {key: [d["path"] for d in entry["deps"]] for key, entry in lock.items()}
    assert "logs/one" in deps["collect@one"] and "logs/two" not in deps["collect@one"]
    assert "logs/two" in deps["collect@two"] and "logs/one" not in deps["collect@two"]
    assert not any(d.startswith(("logs", "examples")) for d in deps["collect@three"])
    assert json.loads(dvc("status", "--json", "collect@one", "collect@two", "collect@three")) == {}

    (project / "logs/two/b.jsonl").write_text("{}\n")  # a new file of pipeline two only
    stale = json.loads(dvc("status", "--json", "collect@one", "collect@two", "collect@three"))
    assert set(stale) == {"collect@two"}, stale


def test_every_stage_in_order_needs_exactly_one_spec():
    from tasks.spec import _in_order

    specs = list(STAGES.values())
    assert list(_in_order(specs[::-1])) == list(ORDER), "the specs are listed in ORDER's order, however written"
    with pytest.raises(RuntimeError, match=r"no StageSpec for \['rl'\]"):
        _in_order([s for s in specs if s.name != "rl"])
    with pytest.raises(RuntimeError, match=r"given twice for \['sft'\]"):
        _in_order([*specs, STAGES["sft"]])


def _dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    # no analytics (tests/conftest.py turns them off): DVC's daemon would write into .dvc/ after the command returns
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, capture_output=True, text=True, timeout=120)


def _remove(folder: Path, deadline_s: float = 30.0) -> None:
    """rmtree that outlasts a process still writing into the folder for a moment (DVC's background work)."""
    until = time.monotonic() + deadline_s
    while folder.exists():
        shutil.rmtree(folder, ignore_errors=True)
        assert time.monotonic() < until, f"{folder} could not be removed in {deadline_s} s"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_project_outside_this_repository_gets_deps_that_exist_in_real_dvc(tmp_path):
    """A user's own root (the newcomer's rooms project, in a new git repo with DVC): `flywheel dvc-yaml` writes
    dvc.yaml, whose deps are all the project's own paths, and flywheel-code.yaml, each stage's code hash as a
    param; `dvc repro --dry` runs, a changed code hash makes that stage stale, and check names either file stale."""
    from typer.testing import CliRunner

    from flywheel.cli import app
    from tasks.spec import CODE_FILE, code_params, holds_the_code, stale

    root = tmp_path / "rooms"
    shutil.copytree(REPO / "examples/newcomer/rooms", root, ignore=shutil.ignore_patterns("data", "models", ".*"))
    # its pipelines.yaml as the newcomer wrote it: only `environment:` (collect's default: no sources, no folder)
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=root, check=True)
    assert _dvc(root, "init", "-q").returncode == 0
    assert holds_the_code(REPO) and not holds_the_code(root)
    assert stale(root) and "does not exist" in stale(root) and "flywheel dvc-yaml" in stale(root)

    done = CliRunner().invoke(app, ["dvc-yaml", "--root", str(root)])
    assert done.exit_code == 0, done.output
    assert f"wrote {root.resolve() / CODE_FILE}" in done.output
    assert stale(root) is None
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        deps = stage["do"]["deps"]
        assert not any(d.startswith(("tasks/", "flywheel/", "examples/")) for d in deps), (name, deps)
        assert stage["do"]["params"][-1] == {CODE_FILE: [name]}
        for item in stage["foreach"].values() if isinstance(stage["foreach"], dict) else []:
            assert all((root / d).exists() for key, slot in item.items() if key != "params" for d in slot), \
                (name, item)
    dry = _dvc(root, "repro", "--dry", "collect@rooms")
    assert dry.returncode == 0, dry.stderr

    (root / "data/rooms/collect").mkdir(parents=True)
    (root / "data/rooms/collect/tasks.parquet").write_text("stands for the output")
    assert _dvc(root, "commit", "--force", "collect@rooms").returncode == 0
    assert json.loads(_dvc(root, "status", "--json", "collect@rooms").stdout or "{}") == {}
    other = code_params().replace("\ncollect: ", "\ncollect: 0")  # another flywheel's collect code
    (root / CODE_FILE).write_text(other)
    assert set(json.loads(_dvc(root, "status", "--json", "collect@rooms").stdout)) == {"collect@rooms"}
    assert f"{root / CODE_FILE} is out of date" in stale(root)
    (root / CODE_FILE).unlink()  # a dvc.yaml written by `python -m tasks.spec > dvc.yaml` alone
    assert f"{root / CODE_FILE} does not exist" in stale(root)

    _remove(root / ".dvc")
    (root / "dvc.yaml").unlink()
    assert stale(root) is None  # no DVC here: nothing to be out of date (check prints a note)
    done = CliRunner().invoke(app, ["check", "--root", str(root), "--no-estimate"])  # about DVC, not time
    assert done.exit_code == 0 and "is no DVC project" in done.output, done.output


def test_a_builtin_environment_without_sources_outside_this_repository_gets_a_dep_in_real_dvc(tmp_path):
    """Collect with no source folder and no environment files of its own (the calculator, `sources: []`) still
    has one dep, flywheel-code.yaml, which DVC also reads as params."""
    from tasks.spec import CODE_FILE, write_dvc_files

    sections = dict.fromkeys(("student", "teacher", "synthesize", "sft", "rl", "evaluate", "gate"), {})
    (tmp_path / "pipelines.yaml").write_text(yaml.safe_dump({"pipelines": {"calc": {
        "environment": {"name": "calculator", "train_tasks": 20, "heldout_tasks": 5},
        "collect": {"sources": []}, **sections}}}))
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=tmp_path, check=True)
    assert _dvc(tmp_path, "init", "-q").returncode == 0
    write_dvc_files(tmp_path)
    collect = yaml.safe_load((tmp_path / "dvc.yaml").read_text())["stages"]["collect"]
    assert collect["foreach"] == {"calc": {"sources": [CODE_FILE]}} and collect["do"]["deps"] == ["${item.sources[0]}"]
    dry = _dvc(tmp_path, "repro", "--dry", "collect@calc")
    assert dry.returncode == 0, dry.stderr


def test_a_pipeline_of_only_its_environment_commits_in_real_dvc(project):
    """DVC refuses to commit a stage whose params name a key missing from pipelines.yaml: a pipeline that leaves
    sections out names only those it writes."""
    config = yaml.safe_load((project / "pipelines.yaml").read_text())
    config["pipelines"]["bare"] = {"environment": {"name": "calculator", "train_tasks": 20, "heldout_tasks": 5}}
    (project / "pipelines.yaml").write_text(yaml.safe_dump(config))
    (project / "dvc.yaml").write_text(dvc_yaml(project))
    for out in STAGES["sft"].outs:  # the stage's outputs, as a run would leave them
        (project / out.format(p="bare")).mkdir(parents=True)
        (project / out.format(p="bare") / "weights").write_text("w")
    (project / "data/bare/synthesize").mkdir(parents=True)
    (project / "data/bare/collect").mkdir(parents=True)
    done = subprocess.run([sys.executable, "-m", "dvc", "commit", "--force", "sft@bare"], cwd=project,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]["sft@bare"]
    assert list(lock["params"]["pipelines.yaml"]) == ["pipelines.bare.environment"]
