"""Feedback on served answers is never lost: a label on an answer that ended in tool calls joins the conversation
that completes it, or stays on that answer's turn when nothing completes it; collected from the traffic folder as
`flywheel serve-model` writes it (TrafficLog), in one run or several."""

from __future__ import annotations

import itertools
import json
import time

import pytest

from flywheel.config import CollectConfig
from flywheel.data.collection import collect
from flywheel.data.redaction import Redactor
from flywheel.data.shapes import PartialTurn, extract
from flywheel.data.sources import readers
from flywheel.policies.openai import completion_from_record
from flywheel.serving.traffic import TrafficLog

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]
SERVED = {"model": "served", "alias": "champion", "version": "1"}


class Agent:
    """An agent loop against the server, as its client sends it: each call the whole conversation so far."""

    _names = itertools.count()

    def __init__(self, log: TrafficLog, question: str):
        self.log, self.messages, self.n = log, [{"role": "user", "content": question}], 0
        self.name = f"agent{next(self._names)}"  # short: a long run of digits reads as a card number (redacted)

    def call(self, answer: str | None = None, expression: str | None = None, result: str = "") -> str:
        """One request answered with a tool call (`expression`, which the tool answers with `result`) or with
        text (`answer`); the response id."""
        self.n += 1
        answer_id = f"chatcmpl-{self.name}x{self.n}"
        message = {"role": "assistant", "content": answer}
        if expression is not None:
            message["tool_calls"] = [{"id": f"call_{answer_id}_0_0", "type": "function", "function": {
                "name": "calculator", "arguments": json.dumps({"expression": expression})}}]
        response = {"id": answer_id, "object": "chat.completion", "created": int(time.time()), "model": "served",
                    "system_fingerprint": "served-v1", "usage": {"prompt_tokens": 9, "completion_tokens": 5},
                    "choices": [{"index": 0, "message": message, "logprobs": None,
                                 "finish_reason": "tool_calls" if expression else "stop"}]}
        self.log.record({"messages": list(self.messages), "tools": TOOLS, "temperature": 0.0}, response, SERVED)
        time.sleep(0.002)  # the server's clock moves between calls (records are stamped to the millisecond)
        # what the client sends next: the answer as the openai policy reads it, then the tool's result
        self.messages.append(completion_from_record({"response": response}).message)
        if expression is not None:
            self.messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                                  "content": result})
        return answer_id

    def say(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})


@pytest.fixture
def log(tmp_path):
    return TrafficLog(tmp_path / "served")


def _collect(tmp_path, before=None):
    cfg = CollectConfig(sources=["served/*.jsonl"], workers=1)
    previous = ([], []) if before is None else (before.traces, before.quarantine)
    return collect(readers(cfg, tmp_path), cfg, Redactor(cfg.redact), previous,
                   None if before is None else before.states)


def _row(found, answer_id: str) -> dict:
    [row] = [r for r in found.traces if json.loads(r["metadata"])["id"] == answer_id]
    return row


def test_a_label_on_a_tool_call_joins_the_conversation_that_completes_it(log, tmp_path):
    agent = Agent(log, "What is 6 * 7 + 1?")
    first = agent.call(expression="6 * 7", result="42")
    agent.call(expression="42 + 1", result="43")  # a second tool call: still the same turn
    final = agent.call(answer="43")
    agent.say("And doubled?")
    after = agent.call(answer="86")  # the next turn: it extends the labelled answer too, but does not complete it
    log.label(first, "rejected", 0.0)  # the client names the first response of the turn
    log.label(final, "accepted", 1.0)  # a later label of the same turn: the first label counts

    found = _collect(tmp_path)
    assert found.partial == 2 and found.labels_joined == 1 and found.labels_on_partial == 0
    row = _row(found, final)
    assert (row["outcome"], row["score"]) == ("rejected", 0.0)
    assert json.loads(row["messages"])[-1] == {"role": "assistant", "content": "43"}
    metadata = json.loads(row["metadata"])
    assert metadata["labelled_answer"] == first and "labelled_at" in metadata and metadata["served"] == SERVED
    assert row["location"].startswith("served/labels-"), "the row sorts where its label does"
    assert len(found.traces) == 2 and _row(found, after)["outcome"] == "unknown", "the next turn has no label"


@pytest.mark.parametrize("split", ["before the completion", "after the completion", "between the labels"])
def test_collected_in_several_runs_the_labels_land_as_in_one(log, tmp_path, split):
    """However the traffic is cut between collect runs, the incremental table is the full one."""
    runs = []
    agent = Agent(log, "What is 12 * 12?")
    first = agent.call(expression="12 * 12", result="144")
    log.label(first, "accepted", 0.9)
    if split == "before the completion":  # the label's turn is still open: kept on its own
        runs.append(_collect(tmp_path, runs[-1] if runs else None))
        assert runs[-1].labels_on_partial == 1 and runs[-1].labels_joined == 0
    final = agent.call(answer="144")
    if split == "after the completion":
        runs.append(_collect(tmp_path))
    other = Agent(log, "What is 5 - 8?")
    answer = other.call(answer="-3")
    if split == "between the labels":
        runs.append(_collect(tmp_path))
    log.label(answer, "rejected")
    runs.append(_collect(tmp_path, runs[-1]))
    full = _collect(tmp_path)
    assert runs[-1].traces == full.traces and runs[-1].quarantine == full.quarantine == []
    assert (full.labels_joined, full.labels_on_partial) == (1, 0) == (runs[-1].labels_joined,
                                                                      runs[-1].labels_on_partial)
    assert (_row(full, final)["outcome"], _row(full, final)["score"]) == ("accepted", 0.9)
    assert _row(full, answer)["outcome"] == "rejected"


def test_a_label_on_a_turn_never_completed_is_kept_on_that_turn(log, tmp_path):
    agent = Agent(log, "What is 2 ** 10?")
    labelled = agent.call(expression="2 ** 10", result="1024")
    log.label(labelled, "rejected", 0.2)  # the agent stopped here: nothing completes the turn
    Agent(log, "What is 3 * 3?").call(expression="3 * 3", result="9")  # an unlabelled tool call: skipped, as before

    found = _collect(tmp_path)
    assert found.partial == 2, "the unlabelled copies of both calls are skipped"
    assert (found.labels_joined, found.labels_on_partial) == (0, 1)
    assert found.quarantine == []
    row = _row(found, labelled)
    assert (row["outcome"], row["score"]) == ("rejected", 0.2)
    call = {"id": f"call_{labelled}_0_0", "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "2 ** 10"}'}}
    assert json.loads(row["messages"]) == [{"role": "user", "content": "What is 2 ** 10?"},
                                           {"role": "assistant", "content": None, "tool_calls": [call]}]
    # as a record: the label keeps the turn; without one, the turn is the next call's
    record = json.loads(next((tmp_path / "served").glob("labels-*.jsonl")).read_text().splitlines()[0])
    source = CollectConfig(sources=["*"]).sources[0]
    assert extract(record, source).partial
    with pytest.raises(PartialTurn):
        extract({k: v for k, v in record.items() if k not in ("outcome", "score")}, source)


def test_a_label_on_an_answer_is_on_its_conversation_as_before(log, tmp_path):
    agent = Agent(log, "What is 7 + 8?")
    agent.call(expression="7 + 8", result="15")
    final = agent.call(answer="15")
    first = _collect(tmp_path)
    assert _row(first, final)["outcome"] == "unknown" and first.partial == 1
    log.label(final, "accepted", 1.0)
    again = _collect(tmp_path, first)
    row = _row(again, final)
    assert (row["outcome"], row["score"]) == ("accepted", 1.0) and len(again.traces) == 1
    assert "labelled_answer" not in json.loads(row["metadata"])
    assert (again.labels_joined, again.labels_on_partial) == (0, 0)
    assert again.traces == _collect(tmp_path).traces
