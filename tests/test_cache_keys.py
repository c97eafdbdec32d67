"""A stage's cache key cannot miss an input: its code is every project module it imports, its environment's
identity is the factory's folder and the task files it reads; an edited task file makes collect build the tasks
table again, an unedited one leaves every byte as it was."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import yaml
from test_layering import _graph  # the import graph read with `ast` independently of tasks/spec.py

from flywheel.contract import prompt_hash
from flywheel.stages import ORDER
from tasks.spec import PACKAGE_ROOT, STAGES, dvc_yaml, input_key, module_file

REPO = Path(__file__).resolve().parent.parent


def _covered(file: str, code: tuple[str, ...]) -> bool:
    return any(Path(file).is_relative_to(c) for c in code)


def _imported_by(stage: str) -> set[str]:
    """The project modules tasks/<stage>.py imports, transitively, with the packages above each."""
    graph, seen, todo = _graph(), set(), [f"tasks.{stage}"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))] + list(graph.get(name, ()))
    return {m for m in seen if m.partition(".")[0] in ("flywheel", "tasks")}


def test_every_project_module_a_stage_imports_is_in_its_cache_key():
    missing = {}
    for name, spec in STAGES.items():
        files = {str(module_file(m).relative_to(PACKAGE_ROOT)) for m in _imported_by(name)}
        assert len(files) > 10, (name, files)
        missing[name] = sorted(f for f in files if not _covered(f, spec.code))
    assert missing == dict.fromkeys(STAGES, []), "imported, not in the stage's code (tasks/spec.py stage_code)"


def test_importing_a_stage_loads_only_modules_in_its_key():
    """What Python really loads when it imports a stage module (a cross-check on the static reading)."""
    script = ("import importlib, json, sys; importlib.import_module(sys.argv[1]); print(json.dumps(sorted("
              "m.__file__ for n, m in list(sys.modules.items()) if n.partition('.')[0] in ('flywheel', 'tasks') "
              "and getattr(m, '__file__', None))))")
    runs = {name: subprocess.Popen([sys.executable, "-c", script, f"tasks.{name}"], cwd=REPO, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE) for name in STAGES}
    for name, run in runs.items():
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err
        loaded = [str(Path(f).resolve().relative_to(PACKAGE_ROOT)) for f in json.loads(out)]
        assert f"tasks/{name}.py" in loaded
        assert [f for f in loaded if not _covered(f, STAGES[name].code)] == [], name


def test_the_key_follows_imports_inside_functions_and_names_loaded_at_run_time():
    code = {name: spec.code for name, spec in STAGES.items()}
    # the gaps a hand-kept list had: register's `from flywheel.data import dvc`, rl's report table
    assert {"flywheel/data/__init__.py", "flywheel/data/dvc.py", "flywheel/data/catalog.py"} <= set(code["register"])
    assert "tasks/reports.py" in code["rl"]
    # an environment is a module found by name: every stage that reads the environment section has the folder
    # sft: its validation slice runs episodes (sft.validation_tasks)
    assert [s for s in ORDER if "flywheel/envs" in code[s]] == ["collect", "synthesize", "sft", "rl", "evaluate"]
    assert not any(Path(c).is_relative_to("flywheel/envs") for c in code["collect"][:-1]), "the folder stands alone"
    # a policy backend is a module found by kind: synthesize and evaluate call get_policy, register's served
    # model does inside a function (flywheel/serving/chat.py)
    assert [s for s in ORDER if "flywheel/policies" in code[s]] == ["synthesize", "evaluate", "register"]
    # a module a stage does not import is not in its key: an SFT run does not depend on the RL learner
    assert not any(Path(c).is_relative_to("flywheel/train/rl") for c in code["sft"])
    assert all(code[s][0] == f"tasks/{s}.py" for s in ORDER), "dvc.yaml's filler dep is the stage's own module"


# --- the environment's identity -------------------------------------------------------------------------------

ENV = '''
from pathlib import Path

from flywheel.envs.sdk import Env, tasks_from_file

def answer(text: str) -> str:
    """Answer."""
    return text

def make_env(tasks: str = "") -> Env:
    return Env(name="edited", tools=[answer],
               tasks=tasks_from_file(tasks or Path(__file__).parent / "tasks.jsonl"),
               rewards=[lambda task, messages: 1.0])
'''


def _tasks_file(path: Path, word: str, n: int = 8) -> list[str]:
    """n tasks whose prompts say `word`; their task ids."""
    prompts = [f"Say {word} number {i}." for i in range(n)]
    path.write_text("".join(json.dumps({"prompt": p, "answer": f"{word} {i}"}) + "\n"
                            for i, p in enumerate(prompts)))
    return [prompt_hash([{"role": "user", "content": p}]) for p in prompts]


def _project(root: Path, module: str, environment: dict) -> Path:
    """A project with the small pipeline on the example traces and a factory environment `module` of its own."""
    shutil.copytree(REPO / "examples" / "traces", root / "examples" / "traces")
    (root / module).mkdir(parents=True)
    (root / module / "__init__.py").write_text(ENV)
    config = yaml.safe_load((REPO / "tests" / "conftest.py").read_text().split('SMALL_PIPELINE = """')[1]
                            .split('"""')[0])
    config["pipelines"]["small"]["environment"] = {"factory": f"{module}:make_env", "train_tasks": 50,
                                                   "heldout_tasks": 50, **environment}
    (root / "pipelines.yaml").write_text(yaml.safe_dump(config))
    return root


def test_an_edited_task_file_changes_the_key_of_every_stage_that_runs_the_environment(tmp_path):
    """In the factory's folder or named by `args` outside it: the keys of collect, synthesize, rl and evaluate
    change, SFT's and register's own do not (register reruns only on evaluate's new output); an edit elsewhere
    changes nothing."""
    root = _project(tmp_path, "keyed_env", {"args": {"tasks": "data_in/tasks.jsonl"}})
    (root / "data_in").mkdir()
    _tasks_file(root / "keyed_env" / "tasks.jsonl", "in")
    _tasks_file(root / "data_in" / "tasks.jsonl", "out")
    stages = yaml.safe_load(dvc_yaml(root))["stages"]
    assert stages["rl"]["foreach"]["small"] == {"env": ["keyed_env", "data_in/tasks.jsonl"]}
    runs_env = {s for s in ORDER if "environment" in STAGES[s].config}
    before = {stage: input_key(stage, "small", root) for stage in ORDER}
    for edited in (root / "keyed_env" / "tasks.jsonl", root / "data_in" / "tasks.jsonl"):
        _tasks_file(edited, "edited")
        after = {stage: input_key(stage, "small", root) for stage in ORDER}
        assert {s for s in ORDER if after[s] != before[s]} == runs_env == {"collect", "synthesize", "sft", "rl",
                                                                           "evaluate"}, edited
        before = after
    (root / "notes.txt").write_text("not the environment's")
    assert {stage: input_key(stage, "small", root) for stage in ORDER} == before


def test_a_local_opd_teacher_is_an_input_of_the_rl_stage(tmp_path):
    """Its bytes key rl (and DVC's deps name it); a served teacher is its URL and name, in the rl section."""
    root = _project(tmp_path, "opd_env", {})  # a module name no other test imports
    _tasks_file(root / "opd_env" / "tasks.jsonl", "in")
    config = yaml.safe_load((root / "pipelines.yaml").read_text())
    config["pipelines"]["small"]["rl"] |= {"objective": "opd", "opd": {"teacher": "models/opd-teacher"}}
    (root / "pipelines.yaml").write_text(yaml.safe_dump(config))
    teacher = root / "models" / "opd-teacher"
    teacher.mkdir(parents=True)
    (teacher / "model.safetensors").write_bytes(b"weights 1")
    stages = yaml.safe_load(dvc_yaml(root))["stages"]
    assert stages["rl"]["foreach"]["small"] == {"env": ["opd_env", "models/opd-teacher"]}
    before = {stage: input_key(stage, "small", root) for stage in ORDER}
    (teacher / "model.safetensors").write_bytes(b"weights 2")
    after = {stage: input_key(stage, "small", root) for stage in ORDER}
    assert {s for s in ORDER if after[s] != before[s]} == {"rl"}

    config["pipelines"]["small"]["rl"]["opd"] = {"teacher": "big-teacher", "base_url": "http://127.0.0.1:9/v1"}
    (root / "pipelines.yaml").write_text(yaml.safe_dump(config))
    assert yaml.safe_load(dvc_yaml(root))["stages"]["rl"]["foreach"]["small"] == {"env": ["opd_env"]}
    served = input_key("rl", "small", root)
    config["pipelines"]["small"]["rl"]["opd"]["teacher"] = "bigger-teacher"
    (root / "pipelines.yaml").write_text(yaml.safe_dump(config))
    assert input_key("rl", "small", root) != served


def _md5s(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.parquet"))}


def test_an_edited_task_file_rebuilds_the_tasks_table_even_when_collect_runs_incrementally(tmp_path, mlflow_store):
    from mlflow import MlflowClient

    from flywheel.data import watermarks
    from flywheel.data.catalog import Catalog
    from tasks.collect import collect

    root = _project(tmp_path, "rebuilt_env", {})
    task_file = root / "rebuilt_env" / "tasks.jsonl"
    old = _tasks_file(task_file, "old")
    out = Catalog(root, "small").stage_dir("collect")

    def generated() -> set[str]:
        table = pq.read_table(out / "tasks.parquet").to_pylist()
        return {row["task_id"] for row in table if row["origin"] == "generated"}

    first = collect.fn(pipeline="small", root=str(root))
    assert generated() == set(old) and watermarks.state_path(root, "small").exists()
    traces = _md5s(out)["traces.parquet"]

    new = _tasks_file(task_file, "new")
    edited = collect.fn(pipeline="small", root=str(root))
    assert MlflowClient().get_run(edited.run_id).data.tags["flywheel.collect.mode"] == "incremental"
    assert edited.metrics["records"] == 0, "the traces' watermark still holds: no record read again"
    assert generated() == set(new), "the tasks of the edited file, none of the old ones"
    assert _md5s(out)["traces.parquet"] == traces and edited.outputs != first.outputs

    tables = _md5s(out)
    again = collect.fn(pipeline="small", root=str(root))
    assert again.metrics["records"] == 0 and again.outputs == edited.outputs
    assert _md5s(out) == tables, "nothing edited: every table byte for byte as it was"
    assert collect.fn(pipeline="small", root=str(root), full=True).outputs == edited.outputs, \
        "the rebuilt table is the one a full collect writes"


def test_registering_into_another_registry_is_not_a_cache_hit(project, monkeypatch):
    """A version registered in the embedded MLflow is not one in a team's server: pointing MLFLOW_TRACKING_URI at
    another registry changes register's key (seen: a cached register returned version 1 of the SQLite store to a
    run on the stack's server, which had none)."""
    from tasks.register import cache_key

    parameters = {"pipeline": "small", "root": str(project)}
    here = cache_key(None, parameters)
    assert cache_key(None, parameters) == here
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert cache_key(None, parameters) != here
