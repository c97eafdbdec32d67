"""Serving: the registered version as an MLflow pyfunc model, `flywheel serve-model` over the OpenAI protocol with
the `openai` client, following the alias, bad input, and served traffic coming back through collect.

One small MLflow store for the module: version 1 is a tiny student given 60 SFT steps (enough to call the
calculator tool), version 2 the same student untrained (a different model to move the alias to).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

import httpx
import openai
import pytest

from flywheel.envs.calculator import CalculatorEnv

NAME = "served"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """(tracking URI, folder) with versions 1 (champion, calls tools) and 2 (untrained) of the model 'served'."""
    from family_students import calculator_rows

    from flywheel import registry
    from flywheel.config import SFTConfig, TinyModelConfig
    from flywheel.serving.chat import input_example
    from flywheel.serving.mlflow_model import StudentChatModel
    from flywheel.train.sft import train_sft
    from flywheel.train.tiny import build_tiny_student, environment_corpus

    root = tmp_path_factory.mktemp("serving")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        # hidden 64 and 2 layers: the smallest student that calls the tool after 60 steps
        base = build_tiny_student(environment_corpus(CalculatorEnv(), n=300, seed=0),
                                  TinyModelConfig(hidden_size=64, layers=2, heads=4, vocab_size=400, seed=0),
                                  root / "base")
        trained = root / "trained"
        train_sft(base, calculator_rows(200), trained,
                  SFTConfig(steps=60, batch_size=16, lr=3e-3, warmup_steps=5, max_length=128, eval_fraction=0.0),
                  device="cpu")
        example = input_example(CalculatorEnv())
        for model_dir, model_hash in ((trained, "trained"), (base, "untrained")):
            run = registry.start_run(root, NAME, "register")
            registry.register(run, NAME, model_dir, model_hash, {"flywheel.gate": "passed"}, [],
                              python_model=StudentChatModel(), example=example)
            run.end()
        registry.client().set_registered_model_alias(NAME, "champion", "1")
        yield os.environ["MLFLOW_TRACKING_URI"], root


@pytest.fixture
def uri(store, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store[0])
    from flywheel import registry

    registry.client().set_registered_model_alias(NAME, "champion", "1")  # whatever a test before did
    return store[0]


@pytest.fixture
def server(uri, tmp_path):
    from flywheel.serving.server import ModelServer

    with ModelServer(NAME, traces=tmp_path / "served", poll_s=0.5, device="cpu") as running:
        yield running


def _prompt(seed: int = 3) -> list[dict]:
    return next(CalculatorEnv().generate_tasks(seed)).prompt


def test_pyfunc_loads_the_champion_and_answers_with_parsed_tool_calls(uri, tmp_path):
    import mlflow

    from flywheel import registry
    from flywheel.policies.base import Sampling
    from flywheel.policies.hf import HFPolicy

    model = mlflow.pyfunc.load_model(f"models:/{NAME}@champion")
    assert "tools" in model.metadata.get_input_schema().input_names()
    tools = CalculatorEnv().tools()
    answer = model.predict({"messages": _prompt(), "tools": tools, "temperature": 0.0, "max_tokens": 48})
    message = answer["choices"][0]["message"]
    assert answer["choices"][0]["finish_reason"] == "tool_calls"
    # the harness's own parser on the same checkpoint's greedy text gives the same call
    checkpoint = registry.download(registry.get_alias(NAME, "champion"), tmp_path / "champion")
    expected = HFPolicy(checkpoint, device="cpu").generate([_prompt()], tools, Sampling(max_new_tokens=48))[0]
    assert [c["function"] for c in message["tool_calls"]] == [c["function"] for c in expected.message["tool_calls"]]
    assert message["tool_calls"][0]["function"]["name"] == "calculator"
    # predict_stream: the same answer as chat.completion.chunk dicts (role, tool calls, finish)
    chunks = list(model.predict_stream({"messages": _prompt(), "tools": tools, "temperature": 0.0, "max_tokens": 48}))
    streamed = chunks[1]["choices"][0]["delta"]["tool_calls"]
    assert [c["function"] for c in streamed] == [c["function"] for c in message["tool_calls"]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # the registered version carries a chat-messages input example with tools, and the student's template
    folder = Path(mlflow.artifacts.download_artifacts(f"models:/{NAME}/1", dst_path=str(tmp_path / "v1")))
    example = json.loads((folder / "input_example.json").read_text())
    assert example["messages"][0]["role"] == "user" and example["tools"][0]["function"]["name"] == "calculator"
    assert (checkpoint / "chat_template.jinja").exists()


def test_versions_registered_as_plain_folders_still_download_and_promote(uri, tiny_student, tmp_path):
    from flywheel import promotion, registry
    from flywheel.config import GateConfig
    from flywheel.status import pipeline_status

    old = "oldstyle"
    run = registry.start_run(tmp_path, old, "register")
    run.artifact(tiny_student, "model")  # what register() did before versions were MLflow models
    c = registry.client()
    c.create_registered_model(old)
    c.create_model_version(old, source=run.artifact_uri("model"), run_id=run.run_id,
                           tags={"flywheel.model_hash": "h-old"})
    run.end()
    outcome = promotion.promote(old, "1", GateConfig(), force=True)
    assert outcome.promoted and registry.get_alias(old, "champion").version == "1"
    assert (registry.download(registry.get_alias(old, "champion"), tmp_path / "dl") / "config.json").exists()
    assert pipeline_status(old).aliases[0].version == "1"


def test_a_served_or_scored_version_leaves_no_download_behind(uri, tmp_path, monkeypatch):
    """serve-model loads each version it serves, and `flywheel eval --policy models:/...` each version it scores,
    from a download of the checkpoint (half a GB for SmolLM2): the download goes once the model is loaded, and
    what was loaded still answers."""
    from flywheel.evaluate.arms import spec_arm
    from flywheel.policies.base import Sampling
    from flywheel.serving.chat import parse_request
    from flywheel.serving.server import AliasFollower

    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))  # where tempfile puts what it makes, as TMPDIR would
    follower = AliasFollower(NAME, device="cpu")
    loaded = follower.start()
    assert list(temporary.iterdir()) == []
    request = parse_request({"model": NAME, "messages": _prompt(), "tools": CalculatorEnv().tools(),
                             "temperature": 0.0, "max_tokens": 24})
    assert loaded.answer(request, NAME)["choices"][0]["message"]["role"] == "assistant"

    arm = spec_arm(f"models:/{NAME}@champion", NAME, tmp_path, batch_size=2, device="cpu", endpoint={},
                   prices=(0.0, 0.0))
    policy = arm.make()
    assert list(temporary.iterdir()) == []
    assert policy.generate([_prompt()], CalculatorEnv().tools(), Sampling(max_new_tokens=8))[0].message


def test_openai_client_gets_tool_calls_n_choices_and_a_stream(server):
    client = openai.OpenAI(base_url=server.url, api_key="unused")
    tools = CalculatorEnv().tools()
    answer = client.chat.completions.create(model=NAME, messages=_prompt(), tools=tools, temperature=0.0, n=2,
                                            max_tokens=48)
    assert len(answer.choices) == 2
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls[0].function.name == "calculator"
        json.loads(choice.message.tool_calls[0].function.arguments)
    assert answer.system_fingerprint == f"{NAME}-v1" and answer.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(model=NAME, messages=_prompt(), tools=tools, temperature=0.0,
                                                 max_tokens=48, stream=True))
    streamed = [call for chunk in chunks for call in (chunk.choices[0].delta.tool_calls or [])]
    assert streamed and streamed[0].function.name == "calculator"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [m.id for m in client.models.list().data] == [NAME, f"{NAME}@champion"]
    assert httpx.get(server.url.removesuffix("/v1") + "/health").json()["version"] == "1"


@pytest.mark.parametrize("change, status, param", [
    ({"model": "someone-else"}, 404, "model"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages"),
    ({"messages": [{"role": "tool", "tool_call_id": "x", "content": "1"}]}, 400, "messages"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objet"}}}]}, 400, "tools[0]"),
    ({"messages": [{"role": "user", "content": "1 + 1 " * 400}]}, 400, "messages"),
    ({"n": 0}, 400, "n"),
])
def test_bad_requests_get_an_openai_error_and_nothing_is_recorded(server, change, status, param):
    body = {"model": NAME, "messages": _prompt(), "tools": CalculatorEnv().tools(), "max_tokens": 8} | change
    reply = httpx.post(server.url + "/chat/completions", json=body, timeout=60)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    assert server.traffic.recorded == 0 and not list(server.traffic.folder.glob("*.jsonl"))


def test_the_alias_moving_switches_the_served_version_without_a_restart(server):
    from flywheel import registry

    client = openai.OpenAI(base_url=server.url, api_key="unused")
    registry.client().set_registered_model_alias(NAME, "champion", "2")
    deadline = time.monotonic() + 60
    while server.follower.current.version.version != "2":
        assert time.monotonic() < deadline, "the server never moved to version 2"
        time.sleep(0.2)
    answer = client.chat.completions.create(model=NAME, messages=_prompt(), temperature=0.0, max_tokens=8)
    assert answer.system_fingerprint == f"{NAME}-v2"
    registry.client().set_registered_model_alias(NAME, "champion", "1")  # a rollback: SIGHUP's path, no wait
    server.reload()
    deadline = time.monotonic() + 60
    while httpx.get(server.url.removesuffix("/v1") + "/health").json()["version"] != "1":
        assert time.monotonic() < deadline, "the server never moved back to version 1"
        time.sleep(0.2)
    assert server.follower.swaps == 2


def test_promotion_and_rollback_under_concurrent_load_never_fail_a_request(server):
    """Clients keep asking while the alias moves to version 2 and back: every request is answered (by the version
    it started with), batched or not, and the swapped-out version's batch worker ends with its last answer."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from flywheel import registry

    stop, answered = threading.Event(), []

    def keep_asking(i: int) -> list[int]:
        statuses = []
        while not stop.is_set():
            reply = httpx.post(server.url + "/chat/completions", json={
                "model": NAME, "messages": _prompt(i), "temperature": 0.0, "max_tokens": 6}, timeout=60)
            statuses.append(reply.status_code)
            answered.append(reply.json().get("system_fingerprint"))
        return statuses

    def wait_for(version: str) -> None:
        deadline = time.monotonic() + 60
        while server.follower.current.version.version != version:
            assert time.monotonic() < deadline, f"the server never moved to version {version}"
            time.sleep(0.1)
        seen = len(answered)
        while len(answered) < seen + 4:  # a few answers on this version while the clients keep asking
            assert time.monotonic() < deadline, f"no answers on version {version}"
            time.sleep(0.1)

    with ThreadPoolExecutor(max_workers=4) as clients:
        running = [clients.submit(keep_asking, i) for i in range(4)]
        try:
            old = server.follower.current
            registry.client().set_registered_model_alias(NAME, "champion", "2")
            server.reload()
            wait_for("2")
            registry.client().set_registered_model_alias(NAME, "champion", "1")
            server.reload()
            wait_for("1")
        finally:
            stop.set()
        statuses = [s for future in running for s in future.result(timeout=120)]
    assert statuses and set(statuses) == {200}
    assert {f"{NAME}-v1", f"{NAME}-v2"} <= set(answered)
    deadline = time.monotonic() + 30
    while old.batcher._working:  # no request left on the old load: its worker thread is gone
        assert time.monotonic() < deadline, "the swapped-out version's batch worker never ended"
        time.sleep(0.1)


def test_no_version_behind_the_alias_refuses_to_start(uri):
    from flywheel.serving.server import ModelServer, ServeError

    with pytest.raises(ServeError, match=f"'{NAME}'.*'nobody'"):
        with ModelServer(NAME, alias="nobody"):
            pass


def test_served_traffic_is_collected_with_its_version_and_labels(server, tmp_path):
    from flywheel.agent import Harness, Limits
    from flywheel.config import CollectConfig
    from flywheel.data.collection import collect
    from flywheel.data.redaction import Redactor
    from flywheel.data.sources import readers
    from flywheel.policies.base import Sampling
    from flywheel.policies.openai import OpenAIPolicy

    env = CalculatorEnv()
    policy = OpenAIPolicy(model=NAME, base_url=server.url, concurrency=2, max_retries=0)
    episodes = Harness(env, Limits(max_turns=3)).run(policy, list(islice(env.generate_tasks(7), 3)),
                                                     sampling=Sampling(temperature=0.0, max_new_tokens=48))
    assert server.traffic.recorded >= 3 and all(e.turns >= 1 for e in episodes)
    finals = [json.loads(line) for line in next(server.traffic.folder.glob("traffic-*.jsonl")).read_text().splitlines()
              if not json.loads(line)["response"]["choices"][0]["message"].get("tool_calls")]
    assert finals, "no episode ended with an answer; the tiny student should answer after the tool result"

    cfg = CollectConfig(sources=[str(server.traffic.folder.relative_to(tmp_path) / "*.jsonl")])
    first = collect(readers(cfg, tmp_path), cfg, Redactor(cfg.redact))
    assert len(first.traces) == len({json.dumps(f["request"]["messages"]) for f in finals})
    row = first.traces[0]
    assert json.loads(row["metadata"])["served"] == {"model": NAME, "alias": "champion", "version": "1"}
    assert row["outcome"] == "unknown" and first.partial >= 1  # the tool-call turns live inside the final ones

    # a label that arrives after that collect replaces the unlabelled row in the next one
    labelled = finals[0]
    reply = httpx.post(server.url + "/feedback", json={"id": labelled["id"], "outcome": "accepted", "score": 1.0})
    assert reply.status_code == 200, reply.text
    assert httpx.post(server.url + "/feedback", json={"id": "chatcmpl-none", "outcome": "accepted"}).status_code == 404
    assert httpx.post(server.url + "/feedback", json={"id": labelled["id"], "outcome": "great"}).status_code == 400
    again = collect(readers(cfg, tmp_path), cfg, Redactor(cfg.redact), previous=(first.traces, first.quarantine))
    row = next(r for r in again.traces if json.loads(r["metadata"])["id"] == labelled["id"])
    assert (row["outcome"], row["score"]) == ("accepted", 1.0), (row, again.traces)
    assert len(again.traces) == len(first.traces)


def test_served_answers_as_mlflow_traces_bring_feedback_given_in_mlflow_back_through_collect(uri, tmp_path):
    import mlflow
    from mlflow.entities import AssessmentSource

    from flywheel import registry
    from flywheel.agent import Harness, Limits
    from flywheel.config import CollectConfig
    from flywheel.data.collection import collect
    from flywheel.data.redaction import Redactor
    from flywheel.data.sources import readers
    from flywheel.policies.base import Sampling
    from flywheel.policies.openai import OpenAIPolicy
    from flywheel.serving.server import ModelServer

    env = CalculatorEnv()
    with ModelServer(NAME, poll_s=60, device="cpu", mlflow_experiment="served-traces", root=tmp_path) as running:
        policy = OpenAIPolicy(model=NAME, base_url=running.url, concurrency=2, max_retries=0)
        episodes = Harness(env, Limits(max_turns=3)).run(policy, list(islice(env.generate_tasks(7), 3)),
                                                         sampling=Sampling(temperature=0.0, max_new_tokens=48))
        health = httpx.get(running.url.removesuffix("/v1") + "/health").json()
        requests = sum(e.turns for e in episodes)
        assert health["mlflow_traces"] == requests and health["recorded"] == 0  # no folder given: MLflow only
        experiment = registry.client().get_experiment_by_name("served-traces").experiment_id
        traces = mlflow.search_traces(locations=[experiment], return_type="list")
        assert len(traces) == requests and {t.info.tags["flywheel.model"] for t in traces} == {"v1"}
        answered = [e for e in episodes if e.stop == "answer"]
        assert answered, "no episode ended with an answer; the tiny student should answer after the tool result"
        episode = answered[0]

        def said(trace) -> dict:
            return next(s for s in trace.data.spans if s.span_type == "CHAT_MODEL").outputs["choices"][0]["message"]

        final = next(t for t in traces if said(t).get("content") == episode.messages[-1]["content"]
                     and next(s for s in t.data.spans if s.span_type == "CHAT_MODEL").inputs["messages"]
                     == episode.messages[:-1])
        assert final.info.client_request_id.startswith("chatcmpl-")

        # a reviewer's verdict given in MLflow's UI is an assessment on the trace: the client logs the same;
        # the server's /v1/feedback writes one too (a score here), without any traffic folder
        mlflow.log_feedback(trace_id=final.info.trace_id, name="outcome", value="rejected",
                            source=AssessmentSource(source_type="HUMAN", source_id="reviewer@example.com"),
                            rationale="the answer does not say the tool's result")
        labelled = httpx.post(running.url + "/feedback", json={"id": final.info.client_request_id, "score": 0.25})
        assert labelled.status_code == 200, labelled.text
        unknown = httpx.post(running.url + "/feedback", json={"id": "chatcmpl-none", "outcome": "accepted"})
        assert unknown.status_code == 404
    cfg = CollectConfig(sources=["mlflow:served-traces"])
    found = collect(readers(cfg, tmp_path), cfg, Redactor(cfg.redact))
    row = next(r for r in found.traces if r["record_id"] == final.info.trace_id)

    def plain(messages: list[dict]) -> list[dict]:  # the client sends a tool-call turn's empty content as null
        return [{**m, "content": m.get("content") or ""} for m in messages]

    assert (row["outcome"], row["score"]) == ("rejected", 0.25)
    assert plain(json.loads(row["messages"])) == plain(episode.messages)
    assert [r["outcome"] for r in found.traces].count("rejected") == 1, found.traces


def test_the_backend_is_transformers_without_vllm_and_a_gpu():
    from flywheel.serving.server import ServeError, choose_backend

    assert choose_backend("hf") == "hf"
    assert choose_backend("auto") == "hf"  # no vllm, no GPU here
    with pytest.raises(ServeError, match="vllm"):
        choose_backend("vllm")


def _readme_serve_command() -> str:
    """The `mlflow models serve` command the README or a docs/ page shows, its lines joined, as a user copies it."""
    repo = Path(__file__).resolve().parent.parent
    pages = [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]
    blocks = [b for page in pages for b in re.findall(r"^```bash\n(.*?)^```", page.read_text(), flags=re.M | re.S)]
    lines = [line.strip() for block in blocks for line in re.sub(r"\\\n\s*", " ", block).splitlines()]
    commands = [line for line in lines if "mlflow models serve" in line]
    assert len(commands) == 1, f"README.md and docs/ should show one `mlflow models serve` command, show {commands}"
    return commands[0]


# A tool whose parameters use JSON-Schema keywords MLflow's own chat types refuse
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look an order up.",
    "parameters": {"type": "object", "required": ["order"], "additionalProperties": False, "properties": {
        "order": {"type": "integer", "minimum": 0},
        "note": {"type": "string", "maxLength": 40},
        "filter": {"type": "object", "properties": {"status": {"type": "string", "enum": ["open", "closed"]},
                                                    "lines": {"type": "array", "items": {"type": "integer"}}}}}}}}


def _said(answer: dict) -> list:
    """What each choice says (content, calls, finish), without the ids that differ between two answers."""
    return [(c["message"]["content"], [t["function"] for t in c["message"].get("tool_calls", [])], c["finish_reason"])
            for c in answer["choices"]]


@pytest.mark.slow
def test_the_readme_mlflow_models_serve_command_answers_and_streams(uri, store, tmp_path):
    import mlflow

    from flows.deployments import free_port, serving, stop_process_group

    port = free_port()
    command = _readme_serve_command()
    mine = command.replace("models:/demo@champion", f"models:/{NAME}@champion").replace("-p 5001", f"-p {port}")
    assert mine.count(NAME) == 1 and str(port) in mine, f"the documented command changed shape: {command}"
    # a checkout after `make demo` (its .venv, its MLflow store), in a shell with no venv activated
    venv_bin = Path(sys.executable).parent
    checkout = tmp_path / "checkout"
    (checkout / ".flywheel").mkdir(parents=True)
    (checkout / ".flywheel" / "mlflow.db").symlink_to(store[1] / "mlflow.db")
    (checkout / ".venv").symlink_to(venv_bin.parent)
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and Path(p).resolve() != venv_bin.resolve()]
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "VIRTUAL_ENV")}
    log = tmp_path / "models-serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen(["bash", "-c", mine], cwd=checkout, env=env | {"PATH": os.pathsep.join(path)},
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert serving(f"{url}/ping", process, 180), log.read_text()[-3000:]
        body = {"messages": _prompt(), "tools": CalculatorEnv().tools(), "temperature": 0.0, "max_tokens": 48,
                "seed": None, "model": NAME}  # null and unknown keys as some OpenAI clients send them
        reply = httpx.post(f"{url}/invocations", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["object"] == "chat.completion" and answer["choices"][0]["finish_reason"] == "tool_calls"
        call = answer["choices"][0]["message"]["tool_calls"][0]
        assert call["function"]["name"] == "calculator"

        # any JSON Schema in a tool's parameters: the answer is the one the loaded model gives (greedy)
        rich = body | {"tools": body["tools"] + [LOOKUP]}
        reply = httpx.post(f"{url}/invocations", json=rich, timeout=120)
        assert reply.status_code == 200, reply.text
        local = mlflow.pyfunc.load_model(f"models:/{NAME}@champion").predict(rich)
        assert _said(reply.json()) == _said(local) and reply.json()["model"] == NAME

        chunks = httpx.post(f"{url}/invocations", json=body | {"stream": True}, timeout=120).json()
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert deltas[0]["role"] == "assistant" and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        assert [d["tool_calls"][0]["function"] for d in deltas if "tool_calls" in d] == [call["function"]]

        bad = body | {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]}
        refused = httpx.post(f"{url}/invocations", json=bad, timeout=60)
        assert refused.status_code == 400 and "tools[0].function.parameters" in refused.json()["message"]
    finally:
        stop_process_group(process)
