"""Redaction: each kind replaced by its typed placeholder and counted, everywhere a trace is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flywheel.config import CollectConfig, RedactionConfig
from flywheel.data.collection import collect
from flywheel.data.redaction import Redactor
from flywheel.data.sources import readers

GITHUB = "ghp_" + "A1b2C3d4" * 5


@pytest.mark.parametrize("kind, text", [
    ("email", "write to jane.doe+billing@example.co.uk today"),
    ("phone", "call +1 415-555-0123"),
    ("phone", "or (415) 555-0123"),
    ("phone", "or +44 20 7946 0958"),
    ("phone", "or +14155550123"),
    ("credit_card", "card 4111 1111 1111 1111 exp 12/29"),
    ("credit_card", "card 5500-0000-0000-0004"),
    ("credit_card", "card 378282246310005"),
    ("ip_address", "from 192.168.10.254 at noon"),
    ("ip_address", "from 2001:db8:85a3::8a2e:370:7334"),
    ("api_key", "OPENAI_API sk-proj-Abcdefghijklmnopqrstuvwx12"),
    ("api_key", "aws AKIAIOSFODNN7EXAMPLE"),
    ("api_key", f"gh {GITHUB}"),
    ("api_key", "stripe sk_live_4eC39HqLyjWDarjtT1zdp7dc"),
    ("api_key", "google AIzaSyA-1234567890abcdefghijklmnopqrstu"),
    ("api_key", "hub hf_abcdefghijklmnopqrstuvwxyzABCDEFGH"),
    ("token", "jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"),
    ("token", "Authorization: Bearer abcdef0123456789ABCDEF"),
    ("token", "slack xoxb-123456789012-abcdefABCDEF"),
    ("token", "password=hunter2hunter2"),
    ("private_key", "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXk\n-----END OPENSSH PRIVATE KEY-----"),
])
def test_each_kind_becomes_its_placeholder(kind, text):
    redactor = Redactor(RedactionConfig())
    out = redactor.text(text)
    assert f"<{kind.upper()}>" in out, out
    assert dict(redactor.counts) == {kind: 1}


@pytest.mark.parametrize("text", [
    "What is 80 * (72 * 54)? 80*(72*54) = 311040, and 41 + 65 = 106.",
    "It was 2026-11-01T08:04:16Z, version 3.14.159, 4111111111111112 (not a card), ratio 1:2:3",
    "call_vlrLNve6ZOpFj206yx1D4WMh and id 550e8400-e29b-41d4-a716-446655440000",
    "the key idea, a secret garden, tokens: 12",
])
def test_ordinary_text_is_left_alone(text):
    redactor = Redactor(RedactionConfig())
    assert redactor.text(text) == text and not redactor.counts


def test_custom_patterns_and_chosen_kinds():
    redactor = Redactor(RedactionConfig(kinds=["email"], patterns={"ticket": r"(?i)tkt-\d{5}"}))
    assert redactor.text("tkt-12345 from a@b.io, 10.0.0.1") == "<TICKET> from <EMAIL>, 10.0.0.1"
    assert dict(redactor.counts) == {"ticket": 1, "email": 1}


def test_an_assignment_keeps_its_name_and_a_known_key_keeps_its_kind():
    redactor = Redactor(RedactionConfig())
    assert redactor.text('{"api_key": "sk-abcdefghijklmnopqrstuvwx"}') == '{"api_key": "<API_KEY>"}'
    assert redactor.text("token: s3cr3t-v4lue-xyz") == "token: <TOKEN>"


def test_nothing_written_keeps_a_secret(tmp_path):
    record = {"id": "jane@example.com",
              "messages": [{"role": "user", "content": "I'm jane@example.com, card 4111 1111 1111 1111"},
                           {"role": "assistant", "content": None, "tool_calls": [
                               {"id": "c1", "type": "function",
                                "function": {"name": "lookup", "arguments": '{"phone": "+1 415-555-0123"}'}}]},
                           {"role": "tool", "tool_call_id": "c1", "content": "account on 10.1.2.3"},
                           {"role": "assistant", "content": "Done."}],
              "user": {"api_key": "sk-abcdefghijklmnopqrstuvwx"}}
    twin = json.loads(json.dumps(record).replace("jane@example.com", "john@example.org"))
    broken = json.dumps(record)[:-5]
    (tmp_path / "t.jsonl").write_text("\n".join([json.dumps(record), json.dumps(twin), broken]) + "\n")
    cfg = CollectConfig(sources=["t.jsonl"])
    found = collect(readers(cfg, tmp_path), cfg, Redactor(cfg.redact))
    written = json.dumps(found.traces) + json.dumps(found.quarantine)
    for secret in ("jane@", "john@", "4111", "555-0123", "10.1.2.3", "sk-abc"):
        assert secret not in written, secret
    assert found.duplicates == 1, "two records that differ only in redacted values are one trace"
    [trace] = found.traces
    assert trace["record_id"] == "<EMAIL>"
    assert json.loads(trace["metadata"]) == {"id": "<EMAIL>", "user": {"api_key": "<API_KEY>"}}
    assert "<PHONE>" in trace["messages"] and "<IP_ADDRESS>" in trace["messages"]
    # per written occurrence: the id is written twice (record_id, metadata); the broken line once, as raw text
    assert found.redacted == {"email": 3 + 3 + 2, "credit_card": 3, "phone": 3, "ip_address": 3, "api_key": 3}


def test_an_escaped_secret_in_the_json_text_is_still_found(tmp_path):
    line = '{"messages": [{"role": "user", "content": "mail jane\\u0040example.com"}]}'
    (tmp_path / "t.jsonl").write_text(line + "\n")
    cfg = CollectConfig(sources=["t.jsonl"])
    [trace] = collect(readers(cfg, tmp_path), cfg, Redactor(cfg.redact)).traces
    assert json.loads(trace["messages"])[0]["content"] == "mail <EMAIL>"


def test_an_email_anywhere_in_a_record_is_redacted(tmp_path):
    """Collect gates each record before redacting it: an email in any one part, and nowhere else, still goes."""
    def record(i: int, where: str) -> dict:
        email = f"jane{i}@example.com" if where else ""
        rec = {"id": f"r{i}" + (f" {email}" if where == "id" else ""),
               "messages": [{"role": "system", "content": "You are a calculator."},
                            {"role": "user", "content": f"What is {i} + 1?" + (f" {email}" if where == "user" else "")},
                            {"role": "assistant", "content": None, "tool_calls": [
                                {"id": f"call_{i}" + (email if where == "call id" else ""), "type": "function",
                                 "function": {"name": "calculator", "arguments": json.dumps(
                                     {"expression": f"{i} + 1", **({"to": email} if where == "arguments" else {})})}}]},
                            {"role": "tool", "tool_call_id": f"call_{i}" + (email if where == "call id" else ""),
                             "content": f"{i + 1}" + (f" {email}" if where == "result" else "")},
                            {"role": "assistant", "content": f"{i + 1}" + (f" {email}" if where == "answer" else "")}],
               "tools": [{"type": "function", "function": {
                   "name": "calculator", "description": "Evaluate." + (f" {email}" if where == "tools" else ""),
                   "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]}
        if where == "metadata":
            rec["user"] = {"contact": email}
        return rec

    places = ["user", "answer", "arguments", "result", "call id", "tools", "metadata", "id"]
    # clean records first, so the redactor has remembered their repeated strings as clean before each email comes
    records = [record(i, "") for i in range(5)] + [record(10 + n, where) for n, where in enumerate(places)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = CollectConfig(sources=["t.jsonl"])
    found = collect(readers(cfg, tmp_path), cfg, Redactor(cfg.redact))
    assert len(found.traces) == len(records)
    leaked = [t for t in found.traces if "@example.com" in json.dumps(t)]
    assert not leaked, leaked
    # twice each: the call id (in the call and in its result) and the record id (also kept in the metadata)
    assert found.redacted["email"] == len(places) + 2


def test_a_time_that_is_no_time_is_not_written_as_one(tmp_path):
    good = {"messages": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]}
    records = [good | {"timestamp": "2026-11-01T08:04:16+01:00"},
               json.loads(json.dumps(good).replace("2+3", "2+4")) | {"timestamp": "sent by jane@example.com"}]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = CollectConfig(sources=["t.jsonl"])
    found = collect(readers(cfg, tmp_path), cfg, Redactor(cfg.redact))
    times = {json.loads(t["messages"])[0]["content"]: (t["collected_at"], json.loads(t["metadata"]))
             for t in found.traces}
    # the record's own field stays in the metadata, redacted like every other value there
    assert times["2+3?"] == ("2026-11-01T07:04:16Z", {"timestamp": "2026-11-01T08:04:16+01:00"})
    assert times["2+4?"] == ("", {"timestamp": "sent by <EMAIL>"})


def test_file_names_and_object_keys_are_redacted_in_locations(tmp_path, s3_bucket):
    client, bucket = s3_bucket
    good = {"messages": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]}
    (tmp_path / "exports").mkdir()
    (tmp_path / "exports/jane.doe@example.com.jsonl").write_text(json.dumps(good) + "\n{broken\n")
    client.put_object(Bucket=bucket, Key="users/10.1.2.3/+1 415-555-0123.jsonl",
                      Body=(json.dumps(good).replace("2+3", "2+5") + "\n{broken\n").encode())
    cfg = CollectConfig(sources=["exports/*.jsonl", {"s3": f"s3://{bucket}/users/"}])
    found = collect(readers(cfg, tmp_path), cfg, Redactor(cfg.redact))
    locations = sorted(row["location"] for row in found.traces + found.quarantine)
    # the address pattern takes ".jsonl" as part of the domain: the whole name goes
    assert locations == ["exports/<EMAIL>:1", "exports/<EMAIL>:2",
                         f"s3://{bucket}/users/<IP_ADDRESS>/<PHONE>.jsonl:1",
                         f"s3://{bucket}/users/<IP_ADDRESS>/<PHONE>.jsonl:2"]


def _every_cell(path) -> str:
    """Every value of a Parquet file as text (the file itself is compressed: its bytes would hide a leak)."""
    import pyarrow.parquet as pq

    return json.dumps(pq.read_table(path).to_pylist(), default=str)


def _mlflow_text(run_id: str, folder) -> str:
    """Everything MLflow keeps for a run: params, tags, metric names, dataset inputs, every artifact's text."""
    import mlflow.artifacts
    from mlflow import MlflowClient

    run = MlflowClient().get_run(run_id)
    datasets = [(d.dataset.name, d.dataset.source, d.dataset.profile, d.dataset.schema)
                for d in run.inputs.dataset_inputs]
    text = json.dumps([run.data.params, run.data.tags, list(run.data.metrics), datasets])
    local = mlflow.artifacts.download_artifacts(run_id=run_id, dst_path=str(folder))
    for path in sorted(p for p in Path(local).rglob("*") if p.is_file()):
        text += _every_cell(path) if path.suffix == ".parquet" else path.read_text(errors="replace")
    return text


def test_the_collect_stage_writes_no_secret_to_its_tables_or_mlflow(tmp_path, mlflow_store):
    """Read back what the stage wrote (both Parquet tables, the MLflow run), not what collect() returned."""
    from flywheel.data.catalog import Catalog
    from tasks.collect import collect as stage

    root = tmp_path / "project"
    (root / "logs").mkdir(parents=True)
    secrets = {"jane.doe@example.com", "4111 1111 1111 1111", "+1 415-555-0123", "10.1.2.3", GITHUB,
               "sk-abcdefghijklmnopqrstuvwx", "mary@example.org"}
    record = {"id": "jane.doe@example.com", "timestamp": "from mary@example.org",
              "messages": [{"role": "user", "content": "I'm jane.doe@example.com, card 4111 1111 1111 1111"},
                           {"role": "assistant", "content": None, "tool_calls": [
                               {"id": "c1", "type": "function",
                                "function": {"name": "lookup", "arguments": '{"phone": "+1 415-555-0123"}'}}]},
                           {"role": "tool", "tool_call_id": "c1", "content": f"on 10.1.2.3 with {GITHUB}"},
                           {"role": "assistant", "content": "Done."}],
              "user": {"api_key": "sk-abcdefghijklmnopqrstuvwx"}}
    broken = json.dumps(record)[:-5]
    (root / "logs/jane.doe@example.com.jsonl").write_text(json.dumps(record) + "\n" + broken + "\n")
    (root / "pipelines.yaml").write_text(
        "pipelines:\n  p:\n    environment: {name: calculator, train_tasks: 10, heldout_tasks: 4}\n"
        "    collect: {sources: ['logs/*.jsonl'], max_bad_fraction: 1.0}\n"
        + "".join(f"    {section}: {{}}\n" for section in ("student", "teacher", "synthesize", "sft", "rl",
                                                             "evaluate", "gate")))
    result = stage.fn(pipeline="p", root=str(root))

    catalog = Catalog(root, "p")
    traces, quarantine = catalog.table_path("traces"), catalog.table_path("quarantine")
    assert len(catalog.read("traces")) == 1 and len(catalog.read("quarantine")) == 1  # something was written
    written = {"traces": _every_cell(traces), "quarantine": _every_cell(quarantine),
               "mlflow": _mlflow_text(result.run_id, tmp_path / "artifacts")}
    for where, text in written.items():
        for secret in secrets:
            assert secret not in text and secret.replace(" ", "") not in text, (where, secret)
    assert "<EMAIL>" in written["traces"] and "<EMAIL>" in written["quarantine"]
    assert result.metrics["redacted_email"] > 0
