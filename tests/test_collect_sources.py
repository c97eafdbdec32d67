"""Trace sources: an S3 prefix in moto's server over HTTP, and an MLflow experiment written by MLflow Tracing."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pandas as pd
import pytest

from flywheel.config import CollectConfig
from flywheel.data.collection import collect
from flywheel.data.redaction import Redactor
from flywheel.data.sources import S3Reader, SourceError, readers
from flywheel.envs.calculator import CalculatorEnv

CALL = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'}}
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


def _conversation(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"}, {"role": "assistant", "content": answer}]


def _proxy(question: str, answer: str) -> dict:
    messages = _conversation(question, answer)
    return {"request": {"model": "m", "messages": messages[:3], "tools": TOOLS},
            "response": {"id": f"r-{answer}", "created": 1793700000, "choices": [{"message": messages[3]}]}}


def _jsonl(*records) -> bytes:
    return "\n".join(json.dumps(r) for r in records).encode() + b"\n"


def _parquet(rows: list[dict]) -> bytes:
    buffer = io.BytesIO()
    pd.DataFrame(rows).to_parquet(buffer)
    return buffer.getvalue()


def _read(cfg: CollectConfig, root, since=None):
    return collect(readers(cfg, root), cfg, Redactor(cfg.redact), since=since)


def test_s3_objects_of_every_shape_and_format(s3_bucket, tmp_path):
    client, bucket = s3_bucket
    objects = {
        "agent/2026/11/01/chat.jsonl": _jsonl({"messages": _conversation("6*7?", "a"), "tools": TOOLS,
                                               "outcome": "accepted"}, {"messages": []}),
        "agent/2026/11/01/proxy.jsonl.gz": gzip.compress(_jsonl(_proxy("6*7 please", "b"))),
        "agent/2026/11/02/one-call.json": json.dumps(_proxy("what is 6*7", "c")).encode(),
        "agent/2026/11/02/table.parquet": _parquet([{"messages": json.dumps(_conversation("6 times 7", "d")),
                                                     "tools": json.dumps(TOOLS), "score": 0.9}]),
        "agent/2026/11/02/_SUCCESS": b"",
        "own/events.jsonl": _jsonl({"payload": {"turns": _conversation("6*7 again", "e")}, "ok": True}),
        "elsewhere/ignored.jsonl": _jsonl({"messages": _conversation("not read", "x")}),
    }
    for key, body in objects.items():
        client.put_object(Bucket=bucket, Key=key, Body=body)
    cfg = CollectConfig(sources=[f"s3://{bucket}/agent/",
                                 {"name": "own", "s3": f"s3://{bucket}/own/",
                                  "fields": {"messages": "payload.turns", "outcome": "ok"},
                                  "outcome": {"accepted": [True], "rejected": [False]}}])
    found = _read(cfg, tmp_path)
    by_answer = {json.loads(t["messages"])[-1]["content"]: t for t in found.traces}
    assert set(by_answer) == {"a", "b", "c", "d", "e"}
    assert by_answer["b"]["location"] == f"s3://{bucket}/agent/2026/11/01/proxy.jsonl.gz:1"
    assert by_answer["d"]["score"] == 0.9 and by_answer["e"]["outcome"] == "accepted"
    assert (by_answer["e"]["source"], by_answer["a"]["source"]) == ("own", f"{bucket}/agent")
    assert [(q["location"], q["kind"]) for q in found.quarantine] == \
        [(f"s3://{bucket}/agent/2026/11/01/chat.jsonl:2", "empty")]

    # the next run reads only the object that is new
    client.put_object(Bucket=bucket, Key="agent/2026/11/03/chat.jsonl",
                      Body=_jsonl({"messages": _conversation("6*7 today", "f")}))
    again = _read(cfg, tmp_path, since=found.states)
    assert sum(again.records.values()) == 1
    assert [json.loads(t["messages"])[-1]["content"] for t in again.traces] == ["f"]


def test_the_cache_key_follows_the_s3_listing(s3_bucket, tmp_path):
    from tasks.collect import cache_key

    client, bucket = s3_bucket
    client.put_object(Bucket=bucket, Key="logs/a.jsonl", Body=_jsonl({"messages": _conversation("6*7?", "a")}))
    config = (Path(__file__).parent / "conftest.py").read_text()
    config = config.split('SMALL_PIPELINE = """')[1].split('"""')[0].replace(
        '["examples/traces/*.jsonl"]', f'["s3://{bucket}/logs/"]')
    (tmp_path / "pipelines.yaml").write_text(config)
    params = {"pipeline": "small", "root": str(tmp_path)}
    first = cache_key(None, params)
    assert cache_key(None, params) == first
    client.put_object(Bucket=bucket, Key="logs/b.jsonl", Body=_jsonl({"messages": _conversation("6*8?", "b")}))
    assert cache_key(None, params) != first
    assert cache_key(None, {**params, "full": True}) is None


def test_an_unreachable_bucket_is_a_clear_error(s3_bucket, tmp_path):
    cfg = CollectConfig(sources=["s3://no-such-bucket/logs/"])
    with pytest.raises(SourceError, match="no-such-bucket"):
        S3Reader(cfg.sources[0], cfg.max_record_bytes).listing()


# ---- MLflow Tracing -------------------------------------------------------------------------------------------

@pytest.fixture
def traced_agent(mlflow_store, monkeypatch, tmp_path):
    """A scripted tool-using agent whose runs MLflow Tracing records in the experiment 'support-agent'."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.entities import SpanType

    # trace artifacts under tmp_path, not ./mlruns in whatever folder the tests run from
    experiment = MlflowClient().create_experiment("support-agent", artifact_location=str(tmp_path / "artifacts"))
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", experiment)
    mlflow.tracing.reset()
    env = CalculatorEnv()

    @mlflow.trace(span_type=SpanType.TOOL, name="calculator")
    def calculator(expression: str) -> str:
        return env.call_tool("calculator", {"expression": expression})

    @mlflow.trace(span_type=SpanType.CHAT_MODEL, name="chat")
    def chat(messages: list[dict], tools: list[dict]) -> dict:
        last = messages[-1]
        if last["role"] == "user":
            expression = last["content"].removeprefix("what is ").rstrip("?")
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{len(expression)}", "type": "function",
                 "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}]}
        else:
            message = {"role": "assistant", "content": f"It is {last['content']}."}
        return {"id": "chatcmpl", "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}

    @mlflow.trace(span_type=SpanType.AGENT, name="agent")
    def agent(question: str, forgetful: bool = False, outcome_tag: str | None = None) -> str:
        messages = [{"role": "user", "content": question}]
        reply = chat(messages, TOOLS)["choices"][0]["message"]
        messages.append(reply)
        for call in reply["tool_calls"]:
            result = calculator(**json.loads(call["function"]["arguments"]))
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        # a forgetful agent shows the model only the tool's result: the history comes from the spans
        final = chat(messages[-1:] if forgetful else messages, TOOLS)["choices"][0]["message"]
        if outcome_tag:
            mlflow.update_current_trace(tags={"outcome": outcome_tag})
        return final["content"]

    @mlflow.trace(name="healthcheck")
    def healthcheck() -> str:
        return "ok"

    def run(question: str, feedback: str | None = None, **kwargs) -> str:
        if question == "healthcheck":
            healthcheck()
        else:
            agent(question, **kwargs)
        trace_id = mlflow.get_last_active_trace_id()
        mlflow.flush_trace_async_logging()
        if feedback:
            mlflow.log_feedback(trace_id=trace_id, name="outcome", value=feedback)
        return trace_id

    yield run
    mlflow.tracing.reset()


def test_mlflow_traces_become_chat_messages_with_tool_calls(traced_agent, tmp_path):
    traced_agent("what is 6*7?", outcome_tag="accepted")
    traced_agent("what is 12+30?", forgetful=True, feedback="rejected")
    traced_agent("healthcheck")
    cfg = CollectConfig(sources=["mlflow:support-agent"])
    found = _read(cfg, tmp_path)
    by_question = {json.loads(t["messages"])[0]["content"]: t for t in found.traces}
    assert set(by_question) == {"what is 6*7?", "what is 12+30?"}
    for question, expression, value, outcome in [("what is 6*7?", "6*7", "42", "accepted"),
                                                 ("what is 12+30?", "12+30", "42", "rejected")]:
        trace = by_question[question]
        call_id = f"call_{len(expression)}"
        assert json.loads(trace["messages"]) == [
            {"role": "user", "content": question},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": value},
            {"role": "assistant", "content": f"It is {value}."}]
        assert json.loads(trace["tools"]) == TOOLS
        assert trace["outcome"] == outcome and trace["record_id"].startswith("tr-")
        assert trace["location"] == f"mlflow:support-agent/{trace['record_id']}"
        assert trace["collected_at"].endswith("Z")
    [bad] = found.quarantine
    assert bad["kind"] == "no_chat_span"

    # the next run reads only the trace written since
    traced_agent("what is 2*3?")
    again = _read(cfg, tmp_path, since=found.states)
    assert sum(again.records.values()) == 1
    assert [json.loads(t["messages"])[0]["content"] for t in again.traces] == ["what is 2*3?"]


def test_an_unknown_experiment_is_a_clear_error(mlflow_store, tmp_path):
    cfg = CollectConfig(sources=["mlflow:nobody-logs-here"])
    with pytest.raises(SourceError, match="no MLflow experiment named 'nobody-logs-here'"):
        _read(cfg, tmp_path)
