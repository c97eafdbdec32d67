"""Record shapes (chat, proxy logs, mapped fields), outcome rules, and the file formats a source may hold."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pandas as pd
import pytest

from flywheel.config import CollectConfig, ConfigError, load_pipelines
from flywheel.data.collection import collect
from flywheel.data.redaction import Redactor
from flywheel.data.shapes import BadRecord, PartialTurn, extract, get_path, timestamp
from flywheel.data.sources import readers

CALL = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'}}
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
ASK = [{"role": "system", "content": "You are a calculator agent."}, {"role": "user", "content": "6*7?"}]
CHAT = {"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "42"},
                     {"role": "assistant", "content": "42"}], "tools": TOOLS, "outcome": "accepted"}
# An OpenAI-compatible proxy logs each model call: the first ends in a tool call, the second answers.
PROXY_FIRST = {"id": "req-1", "timestamp": "2026-11-03T10:00:00+01:00",
               "request": {"model": "gpt-x", "messages": ASK, "tools": TOOLS, "temperature": 0},
               "response": {"id": "chatcmpl-1", "created": 1793700000,
                            "choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [CALL]},
                                         "finish_reason": "tool_calls"}], "usage": {"total_tokens": 30}}}
PROXY_LAST = {"request": {"model": "gpt-x", "messages": CHAT["messages"][:4], "tools": TOOLS},
              "response": {"id": "chatcmpl-2", "created": 1793700001,
                           "choices": [{"message": {"role": "assistant", "content": "42", "refusal": None},
                                        "finish_reason": "stop"}]},
              "feedback": {"thumbs_up": True}}
# A team's own format: the conversation and its labels in nested fields.
OWN = {"event": {"uuid": "e-7", "at": 1793700002123, "body": {"turns": CHAT["messages"], "fns": TOOLS}},
       "labels": {"resolved": "yes", "csat": 0.4}}


def _cfg(**source) -> CollectConfig:
    return CollectConfig(sources=[{"path": ["*"], **source}], max_record_bytes=4096)


def test_chat_records():
    parts = extract(CHAT, _cfg().sources[0])
    assert parts.messages == CHAT["messages"] and parts.tools == TOOLS and parts.outcome == "accepted"


def test_proxy_logs_keep_the_whole_turn_and_skip_the_partial_call():
    source = _cfg().sources[0]
    with pytest.raises(PartialTurn):
        extract(PROXY_FIRST, source)
    parts = extract(PROXY_LAST, source)
    assert parts.messages[-1] == {"role": "assistant", "content": "42", "refusal": None}
    assert parts.tools == TOOLS and parts.record_id == "chatcmpl-2" and parts.time == "2026-11-03T10:00:01Z"
    assert parts.metadata["request"] == {"model": "gpt-x"} and "choices" not in parts.metadata["response"]
    assert parts.outcome == "unknown"


def test_mapped_fields_with_nested_paths_and_a_flag_rule():
    source = _cfg(fields={"messages": "event.body.turns", "tools": "event.body.fns", "outcome": "labels.resolved",
                          "score": "labels.csat", "id": "event.uuid", "time": "event.at"},
                  outcome={"accepted": ["yes"], "rejected": ["no"]}).sources[0]
    parts = extract(OWN, source)
    assert parts.messages == CHAT["messages"] and parts.tools == TOOLS
    assert (parts.outcome, parts.score, parts.record_id) == ("accepted", 0.4, "e-7")
    assert parts.time == "2026-11-03T10:00:02.123Z"
    assert parts.metadata == {"event": {"uuid": "e-7", "at": 1793700002123, "body": {}}, "labels": {}}


@pytest.mark.parametrize("rule, record, outcome", [
    ({}, {"outcome": "Accepted"}, "accepted"),
    ({}, {}, "unknown"),
    ({"accepted": [True], "rejected": [False]}, {"outcome": True}, "accepted"),
    ({"accepted": [True], "rejected": [False]}, {"outcome": False}, "rejected"),
    ({"accepted": [1], "rejected": [0]}, {"outcome": True}, "bad_outcome"),  # a flag is not a number
    ({"score_threshold": 0.5}, {"score": 0.7}, "accepted"),
    ({"score_threshold": 0.5}, {"score": 0.2}, "rejected"),
    ({"score_threshold": 0.5}, {"score": 0.2, "outcome": "accepted"}, "accepted"),  # the field decides first
    ({"score_threshold": 0.5}, {}, "unknown"),
])
def test_outcome_rules(rule, record, outcome):
    source = _cfg(outcome=rule).sources[0]
    try:
        assert extract({**CHAT, "outcome": None, **record}, source).outcome == outcome
    except BadRecord as bad:
        assert bad.kind == outcome


def test_paths_and_times():
    assert get_path({"a": [{"b": 1}]}, "a.0.b") == 1 and get_path({"a": [{"b": 1}]}, "a.-1.b") == 1
    assert timestamp(1793700000) == timestamp(1793700000000) == timestamp("2026-11-03T11:00:00+01:00") \
        == "2026-11-03T10:00:00Z"
    assert timestamp("2026-11-03 11:00:00.5+01:00") == "2026-11-03T10:00:00.500Z"
    assert timestamp("last tuesday") == "last tuesday" and timestamp(None) == ""


def test_every_file_format(tmp_path):
    lines = "\n".join(json.dumps(r) for r in (CHAT, PROXY_FIRST, PROXY_LAST)) + "\n"
    (tmp_path / "a.jsonl").write_text(lines)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (tmp_path / "c.json").write_text(json.dumps([OWN | {"messages": CHAT["messages"][:2] + [
        {"role": "assistant", "content": "about 42"}]}]))
    frame = pd.DataFrame([{"messages": json.dumps(CHAT["messages"][:2] + [{"role": "assistant", "content": "42!"}]),
                           "tools": json.dumps(TOOLS), "outcome": "rejected", "score": 0.0}])
    frame.to_parquet(tmp_path / "d.parquet")
    (tmp_path / "e.parquet").write_bytes(b"PAR1 not really")
    (tmp_path / "f.csv").write_text("a,b\n")
    cfg = _cfg()
    found = collect(readers(cfg, tmp_path), cfg, Redactor(cfg.redact))
    # the proxy's last call is the chat record's conversation again; the gzip file is a copy of the first
    assert {t["location"] for t in found.traces} == {"a.jsonl:1", "c.json:1", "d.parquet:1"}
    assert found.duplicates == 3 and found.partial == 2, "the calls that ended in tool calls are skipped"
    assert {(q["location"], q["kind"]) for q in found.quarantine} == {("e.parquet", "unreadable"),
                                                                      ("f.csv", "unsupported_format")}
    nested = pd.DataFrame([{"messages": CHAT["messages"], "tools": TOOLS}])  # lists of structs, not JSON text
    nested.to_parquet(tmp_path / "g.parquet")
    cfg = CollectConfig(sources=["g.parquet"])
    [trace] = collect(readers(cfg, tmp_path), cfg, Redactor(cfg.redact)).traces
    assert json.loads(trace["messages"])[2]["tool_calls"][0]["id"] == "call_1"


@pytest.mark.parametrize("source, message", [
    ({"path": "x", "s3": "s3://b/p"}, "exactly one of path, s3, mlflow"),
    ({"s3": "bucket/prefix"}, "s3://bucket/prefix"),
    ({"path": "x", "shape": "mapped"}, "needs fields.messages"),
    ({"path": "x", "fields": {"message": "a"}},
     "pipelines.p.collect.sources.0.fields.message: unknown key; did you mean 'messages'"),
    ({"path": "x", "outcome": {"score_threshold": "high"}}, "score_threshold"),
])
def test_bad_source_config_names_the_key(tmp_path, source, message):
    config = {"pipelines": {"p": {k: {} for k in ("environment", "student", "teacher", "synthesize", "sft", "rl",
                                                    "evaluate", "gate")} | {"collect": {"sources": [source]}}}}
    (tmp_path / "pipelines.yaml").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_pipelines(tmp_path / "pipelines.yaml")


def test_bad_redaction_pattern_and_duplicate_names_are_config_errors():
    with pytest.raises(ValueError, match="not a valid regex"):
        CollectConfig(redact={"patterns": {"ticket": "TICKET-(\\d+"}})
    with pytest.raises(ValueError, match="more than once"):
        CollectConfig(sources=["logs/*.jsonl", "logs/*.json"])
    assert [s.label for s in CollectConfig(sources=["s3://b/logs/", "mlflow:agent", "x/**/*.jsonl"]).sources] == \
        ["b/logs", "mlflow:agent", "x"]


def test_strings_stay_shorthands(tmp_path: Path):
    cfg = CollectConfig(sources=["s3://bucket/logs/2026/", "mlflow:support-agent", "logs/*.jsonl"])
    assert (cfg.sources[0].s3, cfg.sources[1].mlflow, cfg.sources[2].path) == \
        ("s3://bucket/logs/2026/", "support-agent", ["logs/*.jsonl"])
