"""Write the sample production traces in examples/traces/, seeded: `python -m examples.make_traces`."""

from __future__ import annotations

import json
import random
import string
from datetime import datetime, timedelta
from itertools import islice
from pathlib import Path

from flywheel.envs.calculator import CalculatorEnv

SEED = 2026  # not the demo's seed 0, so the traces are not copies of the generated tasks
DAYS = ["2026-11-01", "2026-11-02"]
PER_DAY = 75  # records per file, malformed ones included
MALFORMED = ["invalid_json", "unknown_role", "call_without_result", "orphan_result", "empty", "string"]
OUT = Path(__file__).parent / "traces"

# Phrasings real users write, unlike the environment's own: the adapter must still find the expression.
ASKS = ["hey, what's {}?", "Can you work out {} for me?", "quick one: {}", "I need {} for an invoice, please.",
        "what does {} come to?", "pls calculate {}", "How much is {} exactly?", "{}", "{} =", "Total of {}?"]
ANSWERS = ["The answer is {v}.", "{e} = {v}.", "That comes to {v}.", "It's {v}.", "Result: {v}"]


def call_id(rng: random.Random) -> str:
    """An OpenAI-style tool call id."""
    return "call_" + "".join(rng.choices(string.ascii_letters + string.digits, k=24))


def conversation(env: CalculatorEnv, rng: random.Random, expression: str, value: int, outcome: str) -> list[dict]:
    """A user question and the agent's turns: right with the tool, or wrong (bad copy or no tool at all)."""
    if rng.random() < 0.4:
        expression = expression.replace(" ", "")
    messages = [{"role": "user", "content": rng.choice(ASKS).format(expression)}]
    answer = rng.choice(ANSWERS)
    if outcome == "rejected" and rng.random() < 0.5:  # guessed without the tool, and wrong
        guess = value + rng.choice([-10, -2, -1, 1, 2, 10, 100])
        return messages + [{"role": "assistant", "content": answer.format(e=expression, v=guess)}]
    cid = call_id(rng)
    result = env.call_tool("calculator", {"expression": expression})
    shown = result if outcome == "accepted" else str(int(result) + rng.choice([-1, 1, 10]))  # a copying slip
    return messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function",
             "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}]},
        {"role": "tool", "tool_call_id": cid, "content": result},
        {"role": "assistant", "content": answer.format(e=expression, v=shown)},
    ]


def break_record(record: dict, kind: str, rng: random.Random) -> str:
    """One malformed line of a kind the collect stage must quarantine with a reason."""
    messages = record["messages"]
    if kind == "invalid_json":  # a write cut off mid-record
        text = json.dumps(record)
        return text[: len(text) // 2]
    if kind == "unknown_role":
        messages[-1]["role"] = "bot"
    elif kind == "call_without_result":
        record["messages"] = [m for m in messages if m["role"] != "tool"]
    elif kind == "orphan_result":
        next(m for m in messages if m["role"] == "tool")["tool_call_id"] = call_id(rng)
    elif kind == "empty":
        record["messages"] = []
    elif kind == "string":
        record["messages"] = messages[0]["content"]
    return json.dumps(record)


def main() -> None:
    """Write one JSONL file per day."""
    rng = random.Random(SEED + 1)  # its own stream, apart from the task generator's
    env = CalculatorEnv()
    tasks = env.generate_tasks(SEED)
    broken = dict(zip(rng.sample(range(len(DAYS) * PER_DAY), len(MALFORMED)), MALFORMED, strict=True))
    OUT.mkdir(exist_ok=True)
    for d, day in enumerate(DAYS):
        clock = datetime.fromisoformat(day + "T08:00:00")
        lines = []
        for i, task in enumerate(islice(tasks, PER_DAY)):
            n = d * PER_DAY + i
            # the broken tool-call kinds need a tool call to break, so their records use the tool correctly
            outcome = "accepted" if n in broken or rng.random() < 0.75 else "rejected"
            answer = json.loads(task.answer)
            messages = conversation(env, rng, answer["expression"], answer["value"], outcome)
            clock += timedelta(seconds=rng.randint(60, 900))
            record = {"id": f"tr_{rng.getrandbits(64):016x}", "timestamp": clock.strftime("%Y-%m-%dT%H:%M:%SZ"),
                      "messages": messages, "tools": env.tools(), "outcome": outcome,
                      "score": env.score(env.task_from_messages(messages), messages).reward}
            if record["score"] != (1.0 if outcome == "accepted" else 0.0):
                raise AssertionError(f"record {n}: outcome {outcome} but rubric score {record['score']}")
            lines.append(break_record(record, broken[n], rng) if n in broken else json.dumps(record))
        path = OUT / f"support-agent-{day}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        print(f"wrote {path} ({len(lines)} records)")


if __name__ == "__main__":
    main()
