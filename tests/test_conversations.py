"""Records of whole conversations: ids of several fields, scenarios and expected actions, attempts split by group."""

from __future__ import annotations

import json

import pytest

from flywheel.config import CollectConfig
from flywheel.contract import Task, prompt_hash
from flywheel.data.collection import collect
from flywheel.data.redaction import Redactor
from flywheel.data.sources import readers
from flywheel.evaluate.runner import ContaminationError, check_contamination

OPENINGS = ["Hi, I need to move money.", "Hello! Can you help me with a transfer?", "Good morning, a transfer please.",
            "Hey there, I want to send money to my savings.", "I'd like to make a transfer today."]


def attempt(scenario: int, trial: int, **extra) -> dict:
    """One logged attempt at a scenario: the opening differs per attempt, the task id does not."""
    call = {"id": "call_0", "type": "function",
            "function": {"name": "transfer_funds", "arguments": json.dumps({"amount": 10 * scenario})}}
    messages = [{"role": "system", "content": "You are a bank's agent."},
                {"role": "user", "content": f"{OPENINGS[trial % len(OPENINGS)]} (ref {scenario}-{trial})"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": json.dumps({"transfer_id": f"TR-{scenario}"})},
                {"role": "assistant", "content": f"Done: transfer TR-{scenario}."}]
    return {"task_id": f"s-{scenario}", "trial": trial, "messages": messages, "reward": 1.0,
            "info": {"goal": f"You want to move {10 * scenario} EUR.",
                     "actions": [{"name": "transfer_funds", "arguments": {"amount": 10 * scenario}}]}, **extra}


FIELDS = {"id": ["task_id", "trial"], "score": "reward", "scenario": "info.goal", "expected_actions": "info.actions"}


def run_collect(tmp_path, records: list[dict], **options):
    (tmp_path / "logs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    source = {"path": ["logs.jsonl"], "fields": FIELDS, "outcome": {"score_threshold": 1.0}}
    cfg = CollectConfig(sources=[source], heldout_fraction=0.3, workers=1, **options)
    return collect(readers(cfg, tmp_path), cfg, Redactor(cfg.redact))


def test_an_id_of_several_fields_is_joined_and_scenario_and_expected_actions_have_their_columns(tmp_path):
    found = run_collect(tmp_path, [attempt(1, 0), attempt(1, 1)], group_by="task_id")
    rows = sorted(found.traces, key=lambda r: r["record_id"])
    assert [r["record_id"] for r in rows] == ["s-1:0", "s-1:1"]
    assert rows[0]["scenario"] == "You want to move 10 EUR." and rows[0]["group"] == "s-1"
    assert json.loads(rows[0]["expected_actions"]) == [{"name": "transfer_funds", "arguments": {"amount": 10}}]
    assert json.loads(rows[0]["metadata"]) == {"task_id": "s-1", "trial": 0, "info": {}}  # consumed, not copied
    assert not found.missing and not found.warnings


def test_group_by_keeps_every_attempt_of_a_scenario_in_one_split_and_without_it_held_out_leaks(tmp_path):
    records = [attempt(s, t) for s in range(40) for t in range(3)]
    grouped = run_collect(tmp_path, records, group_by="task_id").traces
    splits: dict[str, set[str]] = {}
    for row in grouped:
        splits.setdefault(row["group"], set()).add(row["split"])
    assert all(len(s) == 1 for s in splits.values()) and {"train", "heldout"} == set().union(*splits.values())

    loose = run_collect(tmp_path, records).traces  # split by each attempt's opening: the leak
    by_scenario: dict[str, set[str]] = {}
    for row in loose:
        by_scenario.setdefault(json.loads(row["metadata"])["task_id"], set()).add(row["split"])
    leaked = [s for s, seen in by_scenario.items() if seen == {"train", "heldout"}]
    assert len(leaked) >= 5, "without group_by other attempts of a held-out scenario train"
    assert all(row["group"] == "" for row in loose)


def test_missing_fields_are_counted_and_unknown_expected_tools_warned_and_bad_ones_quarantined(tmp_path):
    bare = attempt(2, 0)
    bare["info"] = {}
    foreign = attempt(3, 0)
    foreign["info"]["actions"] = [{"name": "close_account", "arguments": {"id": "A-3"}}]
    broken = attempt(4, 0)
    broken["info"]["actions"] = [{"name": "transfer_funds", "arguments": "not json"}]
    no_group = attempt(5, 0)
    del no_group["task_id"]
    found = run_collect(tmp_path, [attempt(1, 0), bare, foreign, broken, no_group], group_by="task_id")
    assert found.missing == {"scenario": 1, "expected_actions": 1, "group": 1}
    assert len(found.warnings) == 1 and "logs.jsonl:3" in found.warnings[0] and "close_account" in found.warnings[0]
    assert [q["kind"] for q in found.quarantine] == ["bad_expected_actions"]
    assert len(found.traces) == 4  # the bare and foreign records are kept: their tasks fall back


def test_the_contamination_check_refuses_a_scenario_trained_on_in_another_attempt():
    held = Task("t-held", "replay", [{"role": "user", "content": "Hi, a transfer please."}], "{}", "replay/x",
                "heldout", group="s-7")
    other = [{"role": "user", "content": "Hello, can you move money for me?"}]
    check_contamination([held], {"sft": [prompt_hash(other)]}, groups={"sft": ["s-8"]})  # another scenario: fine
    with pytest.raises(ContaminationError, match="scenario trained on .*s-7.*t-held"):
        check_contamination([held], {"sft": [prompt_hash(other)]}, groups={"sft": ["s-7"]})

