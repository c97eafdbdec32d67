"""Environments by config: built-in name, factory with args, entry points, errors at `flywheel check`, cache keys."""

from __future__ import annotations

import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flywheel.envs import entry_point_environments, get_environment

REPO = Path(__file__).resolve().parent.parent

MODULE = '''
from flywheel.envs.sdk import Env, Task

def echo(text: str) -> str:
    """Echo the text."""
    return text

def make_env(greeting: str = "hi") -> Env:
    task = Task("", "", [{"role": "user", "content": greeting}], "{}", "all")
    return Env(name="echo", tools=[echo], tasks=lambda seed: iter([task]), rewards=[lambda t, m: 1.0])

def broken() -> Env:
    raise RuntimeError("no database at /nowhere")

class Lookalike:  # every required member, but not an Environment: callers could not rely on the rest
    name = "lookalike"
    def tools(self): return []
    def generate_tasks(self, seed): return iter(())
    def call_tool(self, name, arguments, state=None): return ""
    def score(self, task, messages, state=None): return None

def lookalike() -> Lookalike:
    return Lookalike()

def unnamed() -> Env:
    env = make_env()
    env.name = ""
    return env
'''


def _project(root: Path, environment: str) -> Path:
    """A project root with pipelines.yaml whose `environment:` is `environment` and a local envs/ package."""
    (root / "envs" / "echo").mkdir(parents=True)
    (root / "envs" / "echo" / "__init__.py").write_text(MODULE)
    config = yaml.safe_load((REPO / "tests" / "conftest.py").read_text().split('SMALL_PIPELINE = """')[1]
                            .split('"""')[0])
    config["pipelines"]["small"]["environment"] = yaml.safe_load(environment)
    (root / "pipelines.yaml").write_text(yaml.safe_dump(config))
    return root


def test_a_factory_from_the_project_root_with_args(tmp_path):
    _project(tmp_path, "{}")
    env = get_environment(factory="envs.echo:make_env", args={"greeting": "hello"}, root=tmp_path)
    assert env.name == "echo" and next(env.generate_tasks(0)).prompt[0]["content"] == "hello"
    assert env.tools()[0]["function"]["name"] == "echo"
    again = pickle.loads(pickle.dumps(env))  # how an RL actor process gets it: built again by the factory
    assert again is not env and next(again.generate_tasks(0)).prompt[0]["content"] == "hello"


@pytest.mark.parametrize("factory, expected", [
    ("envs.echo:lookalike", "returned Lookalike, not an environment; return flywheel.envs.sdk.Env, or an instance of "
                            "a subclass of flywheel.contract.Environment"),
    ("envs.echo:unnamed", "returned an environment without a name"),
])
def test_a_factory_must_return_a_named_environment(tmp_path, factory, expected):
    from flywheel.envs import EnvironmentLoadError

    _project(tmp_path, "{}")
    with pytest.raises(EnvironmentLoadError, match=re.escape(expected)):
        get_environment(factory=factory, root=tmp_path)


def _check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flywheel.cli", "check", "--root", str(root)], capture_output=True,
                          text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("environment, expected", [
    ('{factory: "envs.nope:make_env"}', "pipelines.small.environment.factory 'envs.nope:make_env': cannot import "
                                        "module 'envs.nope': ModuleNotFoundError"),
    ('{factory: "envs.echo:make_nothing"}', "module 'envs.echo' (" ),
    ('{factory: "envs.echo:broken"}', "envs.echo.broken(**{}) raised RuntimeError: no database at /nowhere"),
    ('{factory: "envs.echo:make_env", args: {colour: red}}', "raised TypeError"),
    ('{name: chess}', "pipelines.small.environment.name: unknown environment 'chess' (known: calculator"),
])
def test_a_bad_environment_fails_flywheel_check_naming_key_module_and_cause(tmp_path, environment, expected):
    ran = _check(_project(tmp_path, environment))
    errors = [line for line in ran.stderr.splitlines() if line.startswith("error: ")]
    assert ran.returncode == 1 and expected in errors[0], ran.stderr


def test_an_untyped_tool_fails_check_naming_function_and_parameter(tmp_path):
    _project(tmp_path, '{factory: "envs.echo:make_env"}')
    path = tmp_path / "envs" / "echo" / "__init__.py"
    path.write_text(path.read_text().replace("def echo(text: str)", "def echo(text)"))
    ran = _check(tmp_path)
    assert ran.returncode == 1 and "tool 'echo': parameter 'text' has no type hint" in ran.stderr, ran.stderr


def test_entry_points_are_listed_and_resolve_by_name(tmp_path, monkeypatch):
    dist = tmp_path / "site" / "acme_envs-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-envs\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[flywheel.environments]\nacme = acme_envs:make_env\n")
    (tmp_path / "site" / "acme_envs.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert entry_point_environments() == {"acme": "acme_envs:make_env"}
    assert get_environment("acme").name == "echo"
    listed = subprocess.run([sys.executable, "-m", "flywheel.cli", "envs"], capture_output=True, text=True,
                            env={"PYTHONPATH": f"{REPO}:{tmp_path / 'site'}", "PATH": "/usr/bin:/bin"})
    assert listed.returncode == 0, listed.stderr
    assert "calculator\tbuilt-in" in listed.stdout and "acme\tentry point (flywheel.environments)\tacme_envs:make_env" \
        in listed.stdout


def test_the_envs_code_is_a_dep_and_cache_key_part_of_exactly_the_stages_that_run_it(tmp_path):
    from flywheel.stages import ORDER
    from tasks.spec import STAGES, dvc_yaml, input_key

    root = tmp_path / "project"
    shutil.copytree(REPO / "examples" / "envs", root / "examples" / "envs",
                    ignore=shutil.ignore_patterns("__pycache__"))
    _project(root, '{factory: "examples.envs.shop:make_env", train_tasks: 60, heldout_tasks: 10}')
    (root / "data" / "small").mkdir(parents=True)
    stages = yaml.safe_load(dvc_yaml(root))["stages"]
    for name in ("collect", "synthesize", "sft", "rl", "evaluate"):
        table = stages[name]["foreach"]["small"]
        assert "examples/envs/shop" in table.get("env", table.get("sources")), (name, table)
    assert stages["register"]["foreach"] == "${pipelines}"
    before = {stage: input_key(stage, "small", root) for stage in ORDER}
    module = root / "examples" / "envs" / "shop" / "__init__.py"
    module.write_text(module.read_text().replace('"refunded"', "'refunded'"))
    after = {stage: input_key(stage, "small", root) for stage in ORDER}
    changed = {stage for stage in ORDER if before[stage] != after[stage]}
    assert changed == {s for s in ORDER if "environment" in STAGES[s].config} == {"collect", "synthesize", "sft",
                                                                                   "rl", "evaluate"}
    (root / "examples" / "envs" / "shop" / "tasks.jsonl").write_text(
        (root / "examples" / "envs" / "shop" / "tasks.jsonl").read_text()[:-1] + "\n\n")
    assert input_key("rl", "small", root) != after["rl"] and input_key("register", "small", root) == after["register"]


READS_OUTSIDE = '''
from flywheel.envs.sdk import Env, tasks_from_file

def echo(text: str) -> str:
    """Echo the text."""
    return text

def make_env() -> Env:  # a task file named in its code, outside its own folder
    return Env(name="echo", tools=[echo], tasks=tasks_from_file("data_in/tasks.jsonl"), rewards=[lambda t, m: 1.0])
'''


def test_a_task_file_the_factory_reads_outside_its_folder_is_one_of_its_files(tmp_path):
    """A path written in the factory's code: a dvc.yaml dep and part of collect's key; editing it is a change."""
    from flywheel.config import EnvironmentConfig
    from flywheel.envs import environment_sources
    from tasks.spec import input_key

    root = tmp_path / "project"
    package = f"reads_{tmp_path.name.replace('-', '_')}"  # its own module: sys.modules keeps every test's
    (root / package).mkdir(parents=True)
    (root / package / "__init__.py").write_text(READS_OUTSIDE)
    (root / "data_in").mkdir()
    (root / "data_in" / "tasks.jsonl").write_text('{"prompt": "say hi", "answer": "hi"}\n')
    _project(root, f'{{factory: "{package}:make_env"}}')
    sources = environment_sources(EnvironmentConfig(factory=f"{package}:make_env"), root)
    assert sources == [(root / package).resolve(), (root / "data_in" / "tasks.jsonl").resolve()]
    before = input_key("collect", "small", root)
    (root / "data_in" / "tasks.jsonl").write_text('{"prompt": "say bye", "answer": "bye"}\n')
    assert input_key("collect", "small", root) != before


def test_one_process_building_two_projects_environments_gets_each_projects_own_module(tmp_path):
    """A factory's package imported from one project's root is not the one a second project's root holds: the
    second build (and its dvc.yaml deps) come from the second root, whatever the first left in sys.modules."""
    from flywheel.config import EnvironmentConfig
    from flywheel.envs import environment_sources

    factory = "envs.echo:make_env"
    built = {}
    for name, greeting in (("first", "hello"), ("second", "bonjour")):
        root = _project(tmp_path / name, f'{{factory: "{factory}"}}')
        module = root / "envs" / "echo" / "__init__.py"
        module.write_text(module.read_text().replace('greeting: str = "hi"', f'greeting: str = "{greeting}"'))
        built[name] = get_environment(factory=factory, root=root)
        assert environment_sources(EnvironmentConfig(factory=factory), root) == [module.parent.resolve()]
    [first], [second] = (list(env.generate_tasks(0)) for env in built.values())
    assert (first.prompt[0]["content"], second.prompt[0]["content"]) == ("hello", "bonjour")
