"""The collect stage: traces validated, malformed records quarantined with reasons, split by content hash."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import SOURCES_ONLY

from flywheel.config import CollectConfig, ConfigError, load_pipeline
from flywheel.contract import prompt_hash, split_of
from flywheel.data.catalog import Catalog, DataError
from flywheel.data.collection import collect
from flywheel.data.redaction import Redactor
from flywheel.data.sources import readers

REPO = Path(__file__).resolve().parent.parent
CALL = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}
CALL2 = {"id": "c2", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'}}
USER = {"role": "user", "content": "What is 2+3?"}
GOOD = {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                     {"role": "tool", "tool_call_id": "c1", "content": "5"},
                     {"role": "assistant", "content": "The answer is 5."}], "outcome": "accepted", "score": 1.0}


def _chat(*messages, **extra) -> dict:
    return {"messages": list(messages), **extra}


def _calls(*calls) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": list(calls)}


def _result(call_id: str, content: str = "5") -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


# Every way a record can be bad, with the kind it must be quarantined as (42 records).
MALFORMED = [
    (b"{not json", "invalid_json"),
    (b'{"messages": [{"role": "user", "content": "cut off', "invalid_json"),
    (b'{"messages": "[{\\"role\\": "}', "invalid_json"),  # JSON text that is not JSON
    (b"\xff\xfe bad bytes", "not_utf8"),
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "not_utf8"),  # Latin-1
    ([1, 2], "wrong_type"),
    ("just a string", "wrong_type"),
    (42, "wrong_type"),
    (_chat(), "empty"),
    ({"messages": "hello"}, "wrong_type"),
    (_chat({"role": "robot", "content": "hi"}), "unknown_role"),
    (_chat({"content": "no role"}), "unknown_role"),
    (_chat(USER, {"role": "function", "name": "f", "content": "5"}), "unknown_role"),
    (_chat(USER, _calls(CALL)), "unanswered_tool_call"),
    (_chat(USER, _calls(CALL), USER, {"role": "assistant", "content": "5"}), "unanswered_tool_call"),
    (_chat(USER, _calls(CALL, CALL2), _result("c1"), {"role": "assistant", "content": "5"}), "unanswered_tool_call"),
    (_chat(USER, _result("c1")), "orphan_tool_result"),
    (_chat(USER, _calls(CALL), _result("zz")), "orphan_tool_result"),
    (_chat(USER, _calls(CALL), _result("c1"), _result("c1"), {"role": "assistant", "content": "5"}),
     "orphan_tool_result"),
    (_chat({"role": "user", "content": 5}), "wrong_type"),
    (_chat({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}), "wrong_type"),
    (_chat(USER, "not an object"), "wrong_type"),
    (_chat(USER, {"role": "assistant", "content": None, "tool_calls": "calculator"}), "wrong_type"),
    ({**GOOD, "tools": {"name": "calculator"}}, "wrong_type"),
    ({**GOOD, "score": "high"}, "wrong_type"),
    ({**GOOD, "score": True}, "wrong_type"),
    ({**GOOD, "outcome": "great"}, "bad_outcome"),
    (_chat({"role": "assistant", "content": "hi"}), "no_user_message"),
    (_chat(USER, _calls({"type": "function", "function": {"name": "calculator"}})), "bad_tool_call"),
    (_chat(USER, _calls({"id": "c9", "function": {"arguments": "{}"}})), "bad_tool_call"),
    (_chat(USER, _calls(CALL, CALL)), "bad_tool_call"),
    # a target with such a call would teach the model to emit it (and replay could not serve it)
    (_chat(USER, _calls({"id": "c1", "function": {"name": "", "arguments": "{}"}}), _result("c1"),
           {"role": "assistant", "content": "5"}), "empty_tool_name"),
    (_chat(USER, _calls({"id": "c1", "function": {"name": "calculator", "arguments": "[1, 2]"}}), _result("c1"),
           {"role": "assistant", "content": "5"}), "tool_arguments_not_object"),
    (_chat(USER, _calls({"id": "c1", "function": {"name": "calculator", "arguments": '{"expression": "2+'}}),
           _result("c1"), {"role": "assistant", "content": "5"}), "tool_arguments_not_object"),
    (_chat(USER, _calls({"id": "c1", "function": {"name": "calculator", "arguments": ["2+3"]}}), _result("c1"),
           {"role": "assistant", "content": "5"}), "tool_arguments_not_object"),
    (_chat(USER, {"role": "assistant", "content": "x" * 3000}), "oversize"),
    ({"event": "login", "user": "u1"}, "unknown_shape"),
    ({"request": {"messages": [USER]}, "response": {"error": "rate limited"}}, "no_response"),
    (b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "score": Infinity}',
     "schema"),  # json.loads takes it; the pandera contract (finite scores) does not
    # an unpaired UTF-16 surrogate: JSON's escapes allow it, but it is no Unicode text (Parquet, hashing refuse it)
    (b'{"messages": [{"role": "user", "content": "hi \\ud800"}, {"role": "assistant", "content": "yo"}]}',
     "not_unicode"),
    (b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "user": "\\udfff"}',
     "not_unicode"),  # in the metadata
    ({"messages": '[{"role": "user", "content": "hi \\ud83d"}, {"role": "assistant", "content": "yo"}]'},
     "not_unicode"),  # in JSON text inside the record
]


def _lines(tmp_path: Path, lines: list, name: str = "traces.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(b"\n".join(x if isinstance(x, bytes) else json.dumps(x).encode() for x in lines) + b"\n")
    return path


def _collect(root: Path, heldout_fraction: float = 0.1, **config):
    cfg = CollectConfig(**{"sources": ["*.jsonl"], "heldout_fraction": heldout_fraction, "max_record_bytes": 2048,
                           **config})
    return collect(readers(cfg, root), cfg, Redactor(cfg.redact))


def test_the_corpus_has_every_kind():
    assert len(MALFORMED) >= 30
    kinds = {kind for _, kind in MALFORMED}
    assert kinds >= {"invalid_json", "not_utf8", "wrong_type", "empty", "unknown_role", "unanswered_tool_call",
                     "orphan_tool_result", "oversize", "bad_outcome", "schema", "empty_tool_name",
                     "tool_arguments_not_object", "not_unicode"}


@pytest.mark.parametrize("record, kind", MALFORMED, ids=[f"{i}-{k}" for i, (_, k) in enumerate(MALFORMED)])
def test_malformed_records_are_quarantined_with_their_kind(tmp_path, record, kind):
    _lines(tmp_path, [GOOD, record])
    found = _collect(tmp_path)
    assert len(found.traces) == 1, "the valid neighbour is kept"
    assert [q["kind"] for q in found.quarantine] == [kind], found.quarantine
    assert found.quarantine[0]["location"] == "traces.jsonl:2"
    assert found.quarantine[0]["reason"] and found.quarantine[0]["raw"]


def test_duplicates_are_dropped_and_split_follows_the_prompt_hash(tmp_path):
    _lines(tmp_path, [GOOD, GOOD])
    found = _collect(tmp_path, 0.5)
    assert len(found.traces) == 1 and found.duplicates == 1
    assert found.traces[0]["location"] == "traces.jsonl:1", "the earliest copy is kept"
    expected = split_of(prompt_hash(GOOD["messages"][:1]), 0.5)
    assert found.traces[0]["split"] == expected


def test_duplicates_are_found_on_normalised_content(tmp_path):
    variant = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is 2+3?"}]},
                            {"role": "assistant", "content": "", "tool_calls": [
                                {"id": "c1", "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}],
                             "refusal": None},
                            {"role": "tool", "tool_call_id": "c1", "content": "5", "name": "calculator"},
                            {"role": "assistant", "content": "The answer is 5."}],
               "outcome": "rejected", "timestamp": 1793520000}
    _lines(tmp_path, [GOOD, variant])
    found = _collect(tmp_path)
    assert found.duplicates == 1 and len(found.traces) == 1
    assert json.loads(found.traces[0]["messages"])[1]["tool_calls"][0]["function"]["arguments"] == \
        '{"expression": "2+3"}'


def test_tool_results_are_paired_with_their_calls_in_call_order(tmp_path):
    both = _chat(USER, _calls(CALL, CALL2), _result("c2", "2"), _result("c1", "5"),
                 {"role": "developer", "content": "be brief"}, {"role": "assistant", "content": "5 and 2"})
    _lines(tmp_path, [both])
    messages = json.loads(_collect(tmp_path).traces[0]["messages"])
    assert [m.get("tool_call_id") for m in messages[2:4]] == ["c1", "c2"]
    assert messages[4] == {"role": "system", "content": "be brief"}


def test_the_example_traces():
    cfg = CollectConfig(sources=["examples/traces/*.jsonl"])
    found = collect(readers(cfg, REPO), cfg, Redactor(cfg.redact))
    outcomes = {t["outcome"] for t in found.traces}
    assert outcomes == {"accepted", "rejected"}
    assert 4 <= len(found.quarantine) <= 10
    assert {"invalid_json", "unknown_role"} <= {q["kind"] for q in found.quarantine}
    assert all(t["collected_at"].startswith("2026-11-0") for t in found.traces)


def _project(tmp_path: Path, collect_section: str | None = None) -> None:
    shutil.copytree(REPO / "examples", tmp_path / "examples", ignore=SOURCES_ONLY)
    config = (REPO / "tests/conftest.py").read_text().split('SMALL_PIPELINE = """')[1].split('"""')[0]
    if collect_section:
        config = "\n".join(f"    collect: {collect_section}" if line.strip().startswith("collect:") else line
                           for line in config.splitlines())
    (tmp_path / "pipelines.yaml").write_text(config)


def test_collect_stage_writes_valid_tables(tmp_path, mlflow_store):
    from mlflow import MlflowClient

    from tasks.collect import TooManyBadRecords
    from tasks.collect import collect as stage

    _project(tmp_path)
    result = stage.fn(pipeline="small", root=str(tmp_path))
    catalog = Catalog(tmp_path, "small")
    tasks = catalog.read("tasks")
    assert (tasks["split"] == "train").sum() >= 600 and (tasks["split"] == "heldout").sum() >= 60
    assert set(tasks["origin"]) == {"generated", "trace"}
    assert tasks["task_id"].is_unique
    assert result.metrics["quarantined"] == len(catalog.read("quarantine"))
    assert result.metrics["source/examples/traces/records"] == 150

    run = MlflowClient().get_run(result.run_id)
    [dataset] = run.inputs.dataset_inputs
    assert dataset.dataset.digest == run.data.tags["flywheel.out.collect"]
    assert dataset.dataset.name == "small-traces"
    assert json.loads(dataset.dataset.profile)["num_rows"] == len(catalog.read("traces"))

    (tmp_path / "examples/traces/zz-broken.jsonl").write_text("{broken\n" * 200)
    with pytest.raises(TooManyBadRecords, match="invalid_json"):
        stage.fn(pipeline="small", root=str(tmp_path))


def test_no_malformed_record_crashes_the_stage(tmp_path, mlflow_store):
    from tasks.collect import collect as stage

    _project(tmp_path, "{sources: [logs/*.json*], max_bad_fraction: 1.0, max_record_bytes: 2048}")
    lines = [x for record, _ in MALFORMED for x in (record, GOOD)]
    (tmp_path / "logs").mkdir()
    _lines(tmp_path / "logs", lines)
    # a .json file's elements are quarantined as JSON text made again: a lone surrogate must survive that too
    (tmp_path / "logs/list.json").write_text('[{"messages": [{"role": "user", "content": "\\ud800"}]}, "\\udfff"]')
    result = stage.fn(pipeline="small", root=str(tmp_path))
    quarantine = Catalog(tmp_path, "small").read("quarantine")
    expected = {f"traces.jsonl:{2 * i + 1}": kind for i, (_, kind) in enumerate(MALFORMED)}
    expected |= {"list.json:1": "not_unicode", "list.json:2": "wrong_type"}
    assert dict(zip(quarantine["location"].str.removeprefix("logs/"), quarantine["kind"], strict=True)) == expected
    assert result.metrics["traces"] == 1 and result.metrics["duplicates"] == len(MALFORMED) - 1
    assert result.metrics["quarantine_unanswered_tool_call"] == 3
    assert result.metrics["quarantine_empty_tool_name"] == 1
    assert result.metrics["quarantine_tool_arguments_not_object"] == 3


def test_the_output_hash_is_the_one_dvc_records(project):
    from mlflow import MlflowClient

    from flywheel.data import dvc
    from tasks.collect import collect as stage

    result = stage.fn(pipeline="small", root=str(project))
    dvc.commit(project, "collect", "small")
    logged = MlflowClient().get_run(result.run_id).data.tags["flywheel.out.collect"]
    assert dvc.lock_hashes(project, "collect", "small")["data/small/collect"] == logged


def test_catalog_refuses_a_table_that_breaks_its_contract(tmp_path):
    catalog = Catalog(tmp_path, "p")
    bad = pd.DataFrame([{"model": "m", "task_id": "t", "sample": 0, "reward": 1.5, "passed": True, "slice": "s"}])
    with pytest.raises(DataError, match="Eval contract"):
        catalog.write("eval", bad)
    assert not catalog.table_path("eval").exists()
    with pytest.raises(DataError, match="run the stage 'collect' first"):
        catalog.read("traces")


def test_the_record_gate_never_skips_what_a_kind_gate_would_search():
    """Redactor.needed (one record, digit kinds gated per run) says yes wherever any kind's own gate does."""
    import random

    from flywheel.config import RedactionConfig
    from flywheel.data.redaction import _GATES

    redactor = Redactor(RedactionConfig())
    rng = random.Random(1)
    alphabet = "0123456789 .-()+:abcdefABCDEF@x\"{}[],"
    pieces = ["+1 415-555-0123", "4111 1111 1111 1111", "192.168.0.1", "fe80::1", "2001:db8:0:0:1:0:0:1",
              "(415) 555-0123", "+4915112345678", "12.34.56.78", "a:b:c:d", "1-2-3-4-5-6-7-8-9-0-1-2-3"]
    missed = []
    for _ in range(20_000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        at = rng.randint(0, len(text))
        text = text[:at] + rng.choice(pieces) + text[at:] if rng.random() < 0.3 else text
        if any(_GATES[kind](text) for kind in redactor._kinds) and not redactor.needed(text):
            missed.append(text)
    assert len(redactor._kinds) == len(_GATES) and not missed, missed[:5]


def test_the_values_gate_never_skips_what_redaction_would_change():
    """Redactor.needed_in (strings gated as one text, clean ones remembered) is yes wherever value() redacts."""
    import random

    from flywheel.config import RedactionConfig

    gate, redactor = Redactor(RedactionConfig()), Redactor(RedactionConfig())
    rng = random.Random(2)
    alphabet = "0123456789 .-()+:abcdefABCDEF@x\"{}[],\n"
    pieces = ["+1 415-555-0123", "4111 1111 1111 1111", "192.168.0.1", "fe80::1", "jane@example.com",
              "sk-proj-abcdefghijklmnopqrstuvwx", "Bearer abcdefghijklmnop1234", "(415) 555-0123", "token=abc12345xyz"]
    common = ["user", "assistant", "calculator", "Evaluate an arithmetic expression."]  # repeated: cached clean

    def text():
        body = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        at = rng.randint(0, len(body))
        return body[:at] + rng.choice(pieces) + body[at:] if rng.random() < 0.1 else body

    def value(depth=0):
        roll = rng.random()
        if depth > 2 or roll < 0.4:
            return rng.choice(common) if rng.random() < 0.3 else text()
        if roll < 0.7:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {f"k{i}": value(depth + 1) for i in range(rng.randint(0, 3))}

    missed, skipped = [], 0
    for _ in range(5_000):
        record = [value(), value()]
        changed = redactor.value(record) != record
        if not gate.needed_in(*record):
            skipped += 1
            if changed:
                missed.append(record)
    assert not missed, missed[:3]
    assert skipped > 1_000 and gate._clean  # the gate does skip, and remembers clean strings


def test_prompt_hash_hashes_the_json_text_it_always_did():
    """prompt_hash writes its canonical text without json.dumps: the bytes (so every split) must not move."""
    import hashlib
    import random

    from flywheel.contract import prompt_hash

    def reference(prompt):
        canonical = json.dumps([{"role": m["role"], "content": m.get("content") or ""} for m in prompt],
                               sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    rng = random.Random(3)
    chars = 'ab"\\\n\t\x00\x1f \u00e9\u20ac\U0001f600\u2028/<>'
    prompts = [[], [{"role": "user", "content": None}], [{"role": "user"}], [{"role": "user", "content": 5}],
               [{"role": "user", "content": [{"type": "text", "text": "x"}]}]]
    prompts += [[{"role": rng.choice(["system", "user"]), "content": "".join(rng.choices(chars, k=rng.randint(0, 20)))}
                 for _ in range(rng.randint(1, 3))] for _ in range(2_000)]
    assert all(prompt_hash(p) == reference(p) for p in prompts)


def test_tool_lists_kept_json_text_is_what_json_writes_for_each():
    """orjson writes null for NaN and infinities and one text per value: the kept text must still be json's."""
    from flywheel.data.shapes import timestamp
    from flywheel.data.trace_rows import _tools_text

    for value in (float("nan"), None, float("inf"), 1, 1.0, True, 2**70, "\u00e9"):
        tools = [{"type": "function", "function": {"name": "f", "x": value}}]
        assert _tools_text(tools) == json.dumps(tools, ensure_ascii=False)
        assert _tools_text(json.loads(json.dumps(tools))) == json.dumps(tools, ensure_ascii=False)
    # a time already in the form timestamp() writes is given back as it is; a near miss is still parsed
    assert timestamp("2026-02-28T23:59:59Z") == "2026-02-28T23:59:59Z"
    assert timestamp("2026-02-30T00:00:00Z") == "2026-02-30T00:00:00Z"
    assert timestamp("2026-02-28T23:59:59.000Z") == "2026-02-28T23:59:59Z"


def test_an_environment_with_its_own_tasks_needs_no_trace_source(tmp_path, mlflow_store):
    """`collect: {sources: []}`: the tasks are the environment's own; collect writes empty traces, dvc.yaml and
    the cache key name no source; a pipeline whose tasks or targets come from traces still needs one."""
    from tasks.collect import collect as stage
    from tasks.spec import dvc_yaml, input_key

    _project(tmp_path, "{sources: []}")
    config_text = (tmp_path / "pipelines.yaml").read_text()
    result = stage.fn(pipeline="small", root=str(tmp_path))
    catalog = Catalog(tmp_path, "small")
    tasks = catalog.read("tasks")
    assert len(catalog.read("traces")) == 0 and set(tasks["origin"]) == {"generated"}
    assert (tasks["split"] == "heldout").sum() > 0 and result.metrics["records"] == 0
    assert "collect" in dvc_yaml(tmp_path)
    assert input_key("collect", "small", tmp_path)  # nothing to fingerprint: still a key

    replay = {"environment": {"name": "replay"}, "collect": {"sources": []}, "teacher": {"policy": "none"},
              "synthesize": {"include_accepted_traces": True},
              **{section: {} for section in ("student", "sft", "rl", "evaluate", "gate")}}
    (tmp_path / "pipelines.yaml").write_text(yaml.safe_dump({"pipelines": {"r": replay}}))
    with pytest.raises(ConfigError, match="collect.sources is empty, but this pipeline's tasks"):
        load_pipeline("r", tmp_path / "pipelines.yaml")
    watched = yaml.safe_load(config_text)
    watched["pipelines"]["small"]["trigger"] = {"min_new_traces": 10}
    (tmp_path / "pipelines.yaml").write_text(yaml.safe_dump(watched))
    with pytest.raises(ConfigError, match="trigger watches the trace sources"):
        load_pipeline("small", tmp_path / "pipelines.yaml")


def test_fewer_tasks_than_asked_is_a_warning_with_both_numbers(tmp_path, mlflow_store, capsys):
    from tasks.collect import collect as stage

    _project(tmp_path, "{sources: []}")
    # a factory of its own, named for this test: a shared name would stay imported from this folder for the
    # next test in the process
    (tmp_path / "few_tasks_env").mkdir()
    (tmp_path / "few_tasks_env" / "__init__.py").write_text(
        "from pathlib import Path\n\nfrom flywheel.envs.sdk import Env, tasks_from_file\n\n\n"
        "def answer(text: str) -> str:\n    \"\"\"Answer.\"\"\"\n    return text\n\n\n"
        "def make_env() -> Env:\n    return Env(name='few', tools=[answer], rewards=[lambda task, messages: 1.0],\n"
        "               tasks=tasks_from_file(Path(__file__).parent / 'tasks.jsonl'))\n")
    (tmp_path / "few_tasks_env" / "tasks.jsonl").write_text(
        "".join(json.dumps({"prompt": f"Say {i}.", "answer": str(i)}) + "\n" for i in range(80)))
    config = yaml.safe_load((tmp_path / "pipelines.yaml").read_text())
    config["pipelines"]["small"]["environment"] = {"factory": "few_tasks_env:make_env", "train_tasks": 1000,
                                                   "heldout_tasks": 5}  # a task file of 80
    (tmp_path / "pipelines.yaml").write_text(yaml.safe_dump(config))
    result = stage.fn(pipeline="small", root=str(tmp_path))
    tasks = Catalog(tmp_path, "small").read("tasks")
    printed = capsys.readouterr().out
    assert result.metrics["warnings"] == 1 and (tasks["split"] == "heldout").sum() == 5
    assert f"gives {(tasks['split'] == 'train').sum()} train tasks, fewer than environment.train_tasks 1000" in printed
