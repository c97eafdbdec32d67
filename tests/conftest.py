"""Shared fixtures that start real components: Prefect's test harness, MLflow on SQLite, a DVC project in git."""

from __future__ import annotations

import ast
import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# pytest-xdist runs a worker a core (`make test`: -n auto): torch's threads, one a core in every worker and in what
# a test starts, would then share each core between threads that wait on each other (a tenth of the suite's time
# lost on 2 cores). One thread each; a test of the thread choice itself sets its own.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# A torch thread that waits for work sleeps instead of spinning (OpenMP's default spins a while): the benchmarks'
# quick forms and the RL tests run two threads, and on cores shared with other workers a spinning thread burns the
# time its peer needs (smol.py's quick form: 50 CPU-seconds alone, 111 in the suite). Read when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Before anything imports Prefect or MLflow: keep their state out of the user's home and out of the repo.
_STATE = Path(tempfile.mkdtemp(prefix="flywheel-tests-"))
atexit.register(shutil.rmtree, _STATE, True)  # when this process (the session or an xdist worker) ends
os.environ["PREFECT_HOME"] = str(_STATE / "prefect")
os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(_STATE / "prefect-results")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "120"
os.environ["PREFECT_LOGGING_LEVEL"] = "WARNING"
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
# DVC's command line sends a report after every command from a detached `dvc daemon analytics` process: 258 of
# them in a suite run, 125 CPU-seconds (5% of the suite), each trying a network this machine may not reach
os.environ["DVC_NO_ANALYTICS"] = "1"
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_STATE / 'mlflow.db'}"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("DO_NOT_TRACK", "1")
# `flywheel check` and `run` time the student once per session, not once per test project (tests/test_estimate.py
# unsets it to test the project's own cache), and once for all of pytest-xdist's workers: the probe's lock makes a
# second worker wait for the first's record
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
os.environ["FLYWHEEL_PROBE_DIR"] = str(Path(tempfile.gettempdir()) / f"flywheel-tests-probe-{_RUN}" if _RUN
                                      else _STATE / "probe")
# and the migrated Prefect database a new project's server starts from (flywheel/settings.py): made by the session's
# first `flywheel run`, not kept in the user's ~/.cache
os.environ["FLYWHEEL_PREFECT_TEMPLATE"] = str(Path(tempfile.gettempdir()) / f"flywheel-tests-prefect-{_RUN}" if _RUN
                                              else _STATE / "prefect-template")

# A pipeline small enough for tests: the same stages and code as the demo, fewer tasks and steps. Its student
# learns nothing in 60 steps (every model scores 0), so the gate's measurability checks, which would refuse it,
# are off: the tests that use it are about the plumbing (tests/test_eval_gate.py turns them on).
SMALL_PIPELINE = """
pipelines:
  small:
    environment: {name: calculator, train_tasks: 600, heldout_tasks: 60, seed: 0, max_turns: 4}
    student:
      model: tiny
      tiny: {hidden_size: 64, layers: 2, heads: 4, vocab_size: 400, seed: 0}
    teacher: {policy: oracle}
    collect: {sources: ["examples/traces/*.jsonl"], heldout_fraction: 0.1, max_bad_fraction: 0.2}
    synthesize: {samples_per_task: 1}
    sft: {steps: 60, batch_size: 16, lr: 3.0e-3, warmup_steps: 5, max_length: 128, seed: 0}
    rl: {steps: 2, tasks_per_step: 4, group_size: 2, temperature: 1.0, lr: 1.0e-5, seed: 0}
    evaluate: {trace_episodes: 8}  # MLflow traces per model: a few keep the many runs of this pipeline fast
    gate: {min_score: 0.0, mode: non_inferior, margin: 0.5, max_slice_regression: 1.0,
           check_null: false, check_ceiling: false, check_flat_slices: false}
"""


def _waiting_tests(rootpath: Path) -> set[str]:
    """The node ids (less any parameters) of the tests marked `waits`, read from the test files' source: xdist's
    controller hands tests out by node id and never sees their markers."""
    found = set()
    for path in Path(__file__).parent.glob("test_*.py"):
        text = path.read_text()
        if "mark.waits" in text:
            found |= {f"{path.relative_to(rootpath)}::{node.name}" for node in ast.walk(ast.parse(text))
                      if isinstance(node, ast.FunctionDef)
                      and any("mark.waits" in ast.unparse(mark) for mark in node.decorator_list)}
    return found


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: a worker more than the cores, and one more for the tests marked `waits` alone (see the
    scheduler). A fifth of the suite's time is spent waiting (servers starting, subprocesses), which left a core
    idle with a worker a core: 18 min against 22 on 2 cores. PYTEST_XDIST_AUTO_NUM_WORKERS still decides where set."""
    cores = os.cpu_count() or 1
    return int(os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS") or cores + 1 + bool(_waiting_tests(config.rootpath)))


def pytest_xdist_make_scheduler(config, log):
    """`--dist load` (`make test`'s), with two changes.

    A module whose tests share a module-scoped fixture goes to one worker whole: handed out one test at a time,
    its fixture was built again on every worker that got one of them (test_commands.py's full run three times:
    80 CPU-seconds more on 2 cores).

    With more workers than a core each and one more (`-n auto`), the last runs only the tests marked `waits` and
    the others never do: the stack's test waits on schedules for four minutes at half a core, and holds none of
    the three workers meanwhile. Measured side by side, 21:08 against 21:31 without it, and 18:07 against 20:04 in
    two fresh clones on another day: within the noise both times, never slower (docs/layout.md). A fourth worker
    for everything looked slower in the one run tried (more heavy tests at once on 2 cores)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScheduling

    shared = {str(path.relative_to(config.rootpath)) for path in Path(__file__).parent.glob("test_*.py")
              if 'scope="module"' in path.read_text()}
    waiting = _waiting_tests(config.rootpath)
    cores = os.cpu_count() or 1

    class Scheduler(LoadScheduling):
        def _takes(self, node, index: int) -> bool:
            if len(self.nodes) <= cores + 1:
                return True
            last = max(self.nodes, key=lambda n: int(n.gateway.id.removeprefix("gw")))  # they start in any order
            return (self.collection[index].split("[")[0] in waiting) == (node is last)

        def _send_tests(self, node, num: int) -> None:
            mine = [i for i in self.pending if self._takes(node, i)]
            sent = mine[:num]
            modules = {self.collection[i].split("::")[0] for i in sent} & shared
            sent += [i for i in mine[num:] if self.collection[i].split("::")[0] in modules]
            if sent:
                taken = set(sent)
                self.pending[:] = [i for i in self.pending if i not in taken]
                self.node2pending[node].extend(sent)
                node.send_runtest_some(sent)
            if not any(self._takes(node, i) for i in self.pending) and not node.shutting_down:
                node.shutdown()  # a worker runs its last test only once it knows no other follows

        def check_schedule(self, node, duration: float = 0) -> None:
            if self.pending and not any(self._takes(node, i) for i in self.pending):
                if not node.shutting_down:
                    node.shutdown()  # nothing left it may take: it ends after what it holds
                return
            super().check_schedule(node, duration)

        def schedule(self) -> None:
            super().schedule()
            for node in self.nodes:  # one that got nothing at first hears nothing more: it is asked now
                if not self.node2pending[node] and not node.shutting_down:
                    self.check_schedule(node)

    return Scheduler(config, log)


def pytest_collection_modifyitems(items):
    """The slow tests first, in their files' order: on `make test`'s workers (tests handed out one at a time:
    --maxschedchunk 1) the minutes-long ones start early and the quick ones fill the end, instead of one long test
    running alone last. Those marked `waits` before them (with `-n auto` their own worker runs them, from the
    start)."""
    items.sort(key=lambda item: (item.get_closest_marker("waits") is None, item.get_closest_marker("slow") is None))


@pytest.fixture(autouse=True)
def _torch_threads_kept():
    """Torch's thread count as the worker had it after every test: one test that set it (test_smol.py set 2) left
    the rest of its worker's tests with twice the threads on shared cores, and an in-process `flywheel check` after
    it timed SmolLM2 again for a thread count no one else uses (three minutes of a 20-minute suite)."""
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch else int(os.environ.get("OMP_NUM_THREADS") or 0)
    yield
    torch = sys.modules.get("torch")
    if torch and threads and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def prefect_server():
    """A real temporary Prefect server (the test harness) for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch) -> str:
    """A fresh MLflow tracking store on SQLite for one test, in the mode a project's store has."""
    from flywheel.settings import write_ahead

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    write_ahead(uri)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def _run(cmd: list[str], cwd: Path) -> None:
    subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True)


# What copying the checkout's folders into a test project leaves out: bytecode, and what a run of an example
# project under examples/ wrote there (its models and state: gigabytes once SmolLM2 has run; git ignores them)
SOURCES_ONLY = shutil.ignore_patterns("__pycache__", "*.pyc", ".flywheel", "models", "mlruns")


_TEMPLATE_REMOTE = Path("/template-remote")


@functools.cache
def _dvc_template() -> Path:
    """A folder where `dvc init` and `dvc remote add -d local` ran, once a process: a project copies its .dvc/ with
    the remote's URL replaced (two DVC processes for each of some forty projects were 40 CPU-seconds of the suite)."""
    root = Path(tempfile.mkdtemp(prefix="flywheel-dvc-template-"))
    atexit.register(shutil.rmtree, root, True)
    _run(["git", "init", "-q"], root)
    _run([sys.executable, "-m", "dvc", "init", "-q"], root)
    _run([sys.executable, "-m", "dvc", "remote", "add", "-d", "local", str(_TEMPLATE_REMOTE)], root)
    return root


def make_project(root: Path, remote: Path) -> Path:
    """A project checkout at root in a new git repo with DVC (a local remote) and the small pipeline."""
    root.mkdir(parents=True)
    for folder in ("flywheel", "tasks", "flows", "examples"):
        shutil.copytree(REPO / folder, root / folder, ignore=SOURCES_ONLY)
    shutil.copy(REPO / ".dvcignore", root / ".dvcignore")
    (root / "pipelines.yaml").write_text(SMALL_PIPELINE)
    from tasks.spec import dvc_yaml

    (root / "dvc.yaml").write_text(dvc_yaml(root))  # its collect deps follow this pipelines.yaml's sources
    (root / ".gitignore").write_text("/data/\n/models/\n/.flywheel/\n")
    _run(["git", "init", "-q", "-b", "main"], root)
    template = _dvc_template()
    shutil.copytree(template / ".dvc", root / ".dvc", ignore=shutil.ignore_patterns("tmp"))
    config = (template / ".dvc" / "config").read_text()
    (root / ".dvc" / "config").write_text(config.replace(str(_TEMPLATE_REMOTE), str(remote)))
    _run(["git", "add", "-A"], root)
    _run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "project"], root)
    return root


@pytest.fixture
def project(tmp_path, mlflow_store) -> Path:
    """A project checkout in a temporary git repo with DVC (local remote) and the small pipeline."""
    return make_project(tmp_path / "project", tmp_path / "dvc-remote")


@pytest.fixture(scope="session")
def tiny_student(tmp_path_factory) -> Path:
    """A tiny random student (tokenizer trained on 300 oracle calculator conversations), built once."""
    from flywheel.config import TinyModelConfig
    from flywheel.envs.calculator import CalculatorEnv
    from flywheel.train.tiny import build_tiny_student, environment_corpus

    corpus = environment_corpus(CalculatorEnv(), n=300, seed=0)
    cfg = TinyModelConfig(hidden_size=32, layers=1, heads=2, vocab_size=400, seed=0)
    return build_tiny_student(corpus, cfg, tmp_path_factory.mktemp("tiny-student"))


def leaning_to_tool_calls(checkpoint: Path, eos_bias: float = 0.0):
    """The tiny student with its head leaning to `<tool_call>` (and to its end token by eos_bias): sampled turns
    often open a call they never close (a real model, its weights set). (model, tokenizer)."""
    import torch

    from flywheel.checkpoints import load_student

    model, tokenizer = load_student(checkpoint)
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.get_output_embeddings().weight)
        head.bias.zero_()
        head.bias[tokenizer.convert_tokens_to_ids("<tool_call>")] = 4.0
        head.bias[tokenizer.eos_token_id] = eos_bias
    model.lm_head = head
    return model, tokenizer


@pytest.fixture(scope="session")
def serve_tiny(tiny_student, tmp_path_factory):
    """serve_tiny(name, **server options): a context manager running `serve-model` on `name`@champion, version 1
    being the tiny random student, in an MLflow store of its own (MLFLOW_TRACKING_URI set while it runs)."""
    from contextlib import contextmanager

    from flywheel import registry
    from flywheel.serving.server import ModelServer

    @contextmanager
    def serving(name: str, **options):
        root = tmp_path_factory.mktemp(name)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
            run = registry.start_run(root, name, "register")
            registry.register(run, name, tiny_student, "tiny", {}, [])
            run.end()
            registry.client().set_registered_model_alias(name, "champion", "1")
            with ModelServer(name, traces=root / "served", poll_s=600, device="cpu", **options) as running:
                yield running

    return serving


@pytest.fixture
def openai_server():
    """A real OpenAI-compatible HTTP server (the calculator oracle) on a free port, with fault injection."""
    from openai_server import OracleServer

    with OracleServer(retry_after="0.2", hang_s=3.0) as server:
        yield server


@pytest.fixture(scope="session")
def moto_endpoint():
    """moto's S3 server over HTTP on a free port, started once (`moto_server`), stopped at the end."""
    import socket
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError("moto_server did not start") from None
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}"
    server.terminate()
    server.wait(timeout=10)


@pytest.fixture
def s3_bucket(moto_endpoint, monkeypatch, tmp_path):
    """(boto3 client, bucket name): a fresh bucket in moto's server, reached through the usual AWS variables."""
    import uuid

    import boto3

    env = {"AWS_ENDPOINT_URL": moto_endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
           "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
           # nobody's own ~/.aws settings
           "AWS_CONFIG_FILE": str(tmp_path / "aws-config"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "aws-creds")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    client = boto3.session.Session().client("s3")
    bucket = f"traces-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    return client, bucket


def _wait_http(url: str, process: subprocess.Popen, what: str, log: Path, timeout_s: float = 180) -> None:
    from flows.deployments import serving

    if not serving(url, process, timeout_s):
        raise RuntimeError(f"{what} did not start: {log.read_text()[-3000:]}")


def _stop(process: subprocess.Popen) -> None:
    """Stop a server started by a fixture, and its children (it leads its own process group)."""
    from flows.deployments import stop_process_group

    stop_process_group(process)


@pytest.fixture
def prefect_api(tmp_path) -> str:
    """A real `prefect server start` on SQLite (its own PREFECT_HOME) on a free loopback port; yields the API URL."""
    from flows.deployments import local_server

    with local_server(tmp_path / "prefect-server-home") as url:
        yield url


@pytest.fixture
def mlflow_server(tmp_path, s3_bucket) -> tuple[str, str]:
    """(tracking URL, bucket): `mlflow server` on SQLite whose artifacts go to the moto S3 bucket under mlflow/."""
    from flows.deployments import free_port

    _, bucket = s3_bucket
    port = free_port()
    log = tmp_path / "mlflow-server.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
             "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow-server.db'}",
             "--artifacts-destination", f"s3://{bucket}/mlflow", "--workers", "1"],
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},  # its job runners cost CPU
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", server, "mlflow server", log)
        yield f"http://127.0.0.1:{port}", bucket
    finally:
        _stop(server)


@pytest.fixture
def process_worker(tmp_path):
    """start(pool, env) -> a `prefect worker start --type process` subprocess; every one started is stopped."""
    started = []

    def start(pool: str, env: dict) -> subprocess.Popen:
        log = tmp_path / f"worker-{pool}.log"
        with log.open("wb") as out:
            worker = subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool",
                                       pool, "--type", "process"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        _stop(worker)


SLOW_TOOL_ENV = '''
import time

from flywheel.envs.sdk import Env, Task


def lookup(key: str) -> str:
    """Look the key up, slowly."""
    time.sleep(0.3)
    return key


def make_env() -> Env:
    tasks = [Task(f"slow-{i}", "slow", [{"role": "user", "content": f"Look up {i}."}], "{}", "all", "train")
             for i in range(2)]
    return Env(name="slow", tools=[lookup], tasks=lambda seed: iter(tasks), rewards=[lambda task, messages: 1.0])
'''


@pytest.fixture
def slow_tool_harness(tmp_path):
    """The harness (flywheel.agent.load_harness) of a factory environment whose one tool sleeps 0.3 s, under an
    `environment:` section with a tool timeout of 0.05 s and a budget of 10 generated tokens in up to 8 turns: a
    ToolCaller (5 tokens a turn) is cut by the budget after 2 turns, each of its tool calls timed out."""
    from flywheel.agent import load_harness
    from flywheel.config import EnvironmentConfig

    module = f"slowtool_{uuid.uuid4().hex[:8]}"  # its own module name: a module imported once stays cached
    (tmp_path / f"{module}.py").write_text(SLOW_TOOL_ENV)
    cfg = EnvironmentConfig(factory=f"{module}:make_env", max_turns=8, max_episode_tokens=10, tool_timeout_s=0.05)
    return load_harness(cfg, tmp_path)


class ToolCaller:
    """A policy that calls the environment's first tool every turn, spending 5 generated tokens a turn (with the
    token ids and log-probabilities RL encodes); `turns` counts the turns it was asked for."""

    name = "tool-caller"

    def __init__(self):
        self.turns = 0

    def generate(self, conversations, tools, sampling, **_):
        from flywheel.policies.base import Completion

        self.turns += 1
        call = {"id": "x", "type": "function",
                "function": {"name": tools[0]["function"]["name"], "arguments": '{"key": "a"}'}}
        return [Completion(message={"role": "assistant", "content": "", "tool_calls": [call]}, token_ids=[5] * 5,
                           logprobs=[-0.5] * 5) for _ in conversations]


@pytest.fixture
def tool_caller() -> ToolCaller:
    return ToolCaller()
