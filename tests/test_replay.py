"""Replay: a banking agent's traces (no environment written for them) become tasks served from their record."""

from __future__ import annotations

import copy
import gzip
import json
import sys
from pathlib import Path

import pytest
import yaml

from flywheel.agent import Harness, Limits, call_tool
from flywheel.config import ConfigError, ReplayConfig, UserConfig, load_pipeline, load_pipelines
from flywheel.contract import ToolError, conversation_hash, prompt_hash, split_of
from flywheel.data.catalog import Catalog
from flywheel.envs import load_environment
from flywheel.envs.replay import ReplayEnv
from flywheel.replaycheck import Recorded, Says, conversation_key

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
from agent_traces import TOOLS, records  # noqa: E402

N_LABELLED, N_SCORED = 36, 9  # 12 scenarios of 3 attempts with their labels; 3 more with a score only
ASK_ID = "Could you give me your member number, please?"
FIELDS = {"id": ["task_id", "trial"], "score": "reward", "scenario": "info.user_goal",
          "expected_actions": "info.expected_actions"}


def pipeline(base_url: str = "http://127.0.0.1:9/v1", **environment) -> dict:
    """A replay pipeline over two sources: a benchmark's logs with scenarios and expected actions (mapped), and
    0/1 scores without schemas, scenarios or expected actions."""
    return {"environment": {"name": "replay", "max_turns": 24, **environment},
            "student": {"model": "tiny", "tiny": {"hidden_size": 32, "layers": 1, "heads": 2, "vocab_size": 400,
                                                  "max_position_embeddings": 4096}},
            "teacher": {"policy": "openai", "model": "replayer", "base_url": base_url, "timeout_s": 10.0,
                        "max_retries": 1},
            "collect": {"sources": [{"name": "bank", "path": ["traces/bank/*.jsonl"], "fields": FIELDS,
                                     "outcome": {"score_threshold": 1.0}},
                                    {"name": "scored", "path": ["traces/scored/*.jsonl"],
                                     "fields": {"id": ["task_id", "trial"], "score": "reward"},
                                     "outcome": {"score_threshold": 0.5}}],
                        "group_by": "task_id", "heldout_fraction": 0.25},
            "synthesize": {"max_new_tokens": 256},
            "sft": {"steps": 4, "batch_size": 4, "lr": 3.0e-3, "warmup_steps": 0, "max_length": 4096,
                    "eval_fraction": 0.0},
            "rl": {"steps": 1, "tasks_per_step": 2, "group_size": 2, "max_new_tokens": 8, "max_length": 4096,
                   "actors": 0, "max_staleness": 0, "checkpoint_every": 0, "epochs_per_batch": 1},
            "evaluate": {"batch_size": 16},
            "gate": {"min_score": 0.0, "mode": "non_inferior", "margin": 1.0, "max_slice_regression": 1.0}}


def write_project(root: Path, config: dict) -> None:
    """The traces (two sources, a malformed record among them) and pipelines.yaml under `root`."""
    labelled = records(N_LABELLED, seed=0)
    scored = []
    for record in records(N_LABELLED + N_SCORED, seed=1)[N_LABELLED:]:  # other customers: other prompts
        record.pop("tools")  # schemas inferred from the calls
        record.pop("info")  # no scenario, no expected actions: the recorded turns and writes are the target
        scored.append(record)
    bad = {"task_id": "bad", "trial": 0, "reward": 1.0, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "?"}]}
    for folder, rows in (("bank", labelled + [bad]), ("scored", scored)):
        (root / "traces" / folder).mkdir(parents=True, exist_ok=True)
        (root / "traces" / folder / "agent.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "pipelines.yaml").write_text(yaml.safe_dump({"pipelines": {"bank": config}}))


@pytest.fixture
def collected(tmp_path, mlflow_store):
    """A project whose traces were collected into replay tasks: (root, the collect stage's result)."""
    from tasks.collect import collect

    write_project(tmp_path, pipeline())
    return tmp_path, collect.fn(pipeline="bank", root=str(tmp_path))


def recorded_conversations(root: Path) -> dict[str, list[dict]]:
    """Each collected conversation by its task's id (the prompt hash of its opening)."""
    return {conversation_key(json.loads(m)): json.loads(m) for m in Catalog(root, "bank").read("traces")["messages"]}


def test_the_agent_is_multi_turn_with_attempts_at_each_scenario():
    written = records(N_LABELLED)
    for record in written:
        calls = [c for m in record["messages"] for c in m.get("tool_calls") or []]
        assert 5 <= len(calls) <= 15
        assert 3 <= sum(m["role"] == "user" for m in record["messages"]) <= 8
        turns = [m for m in record["messages"] if m.get("tool_calls")]
        assert all(t["tool_calls"][0]["id"] == "call_0" for t in turns), "ids restart"
        assert record["info"]["user_goal"] and record["info"]["expected_actions"] is not None
    by_scenario: dict[str, list[dict]] = {}
    for record in written:
        by_scenario.setdefault(record["task_id"], []).append(record)
    assert all(len(attempts) == 3 for attempts in by_scenario.values())
    for attempts in by_scenario.values():
        openings = {a["messages"][1]["content"] for a in attempts}
        assert len(openings) == 3, "each attempt opens in its own words"
    assert len(TOOLS) >= 5 and sum(r["reward"] == 0.0 for r in written) >= 3


def test_the_committed_logs_are_the_generators_and_hold_out_40_scenarios():
    """examples/traces/bank: what agent_traces.py writes with its defaults; the replay pipeline's split (by
    scenario) holds out at least 40 scenarios with an accepted attempt, and every request kind is in them."""
    with gzip.open(REPO / "examples/traces/bank/nordbank-agent.jsonl.gz", "rt") as f:
        committed = [json.loads(line) for line in f]
    assert committed == json.loads(json.dumps(records(len(committed))))
    collect = load_pipeline("replay", REPO / "pipelines.yaml").collect
    assert collect.group_by == "task_id"
    held = {r["task_id"] for r in committed
            if r["reward"] == 1.0 and split_of(r["task_id"], collect.heldout_fraction) == "heldout"}
    assert len(held) >= 40
    kinds = {call["name"] for r in committed for call in r["info"]["expected_actions"]}
    assert kinds == {"transfer_funds", "block_card", "create_ticket"}
    goals = " ".join(r["info"]["user_goal"] for r in committed if r["task_id"] in held)
    for wish in ("move", "dispute", "balances", "blocked", "how much you paid", "no cash"):
        assert wish in goals, wish


def test_every_accepted_trace_is_a_task_in_its_split(collected):
    root, result = collected
    catalog = Catalog(root, "bank")
    traces, tasks = catalog.read("traces"), catalog.read("tasks")
    accepted = traces[traces["outcome"] == "accepted"]
    assert len(traces) == N_LABELLED + N_SCORED
    assert len(accepted) == len(tasks) == result.metrics["tasks_from_traces"]
    assert (traces["outcome"] == "rejected").sum() >= 2, "rejected traces are never targets"
    assert set(tasks["origin"]) == {"trace"} and set(tasks["env"]) == {"replay"}
    assert set(tasks["slice"]) == {"replay/bank", "replay/scored"}
    # held-out traces are held-out tasks, and every attempt at a scenario is in one split
    split_of_prompt = {conversation_hash(json.loads(row["messages"])): row["split"]
                       for row in accepted.to_dict("records")}
    assert {t["task_id"]: t["split"] for t in tasks.to_dict("records")} == split_of_prompt
    assert set(tasks["split"]) == {"train", "heldout"}
    assert (traces.groupby("group")["split"].nunique() == 1).all() and (tasks["group"] != "").all()
    assert set(traces["record_id"]) >= {"bank-0:0", "bank-0:1", "bank-0:2"}, "task_id and trial make the id"
    assert not any(k.startswith("missing_") for k in result.metrics) and result.metrics["warnings"] == 0
    # collect quarantined the call with an empty name under its own kind, and logged the count
    assert list(catalog.read("quarantine")["kind"]) == ["empty_tool_name"]
    assert result.metrics["quarantine_empty_tool_name"] == 1
    # a trace without schemas gets them from its calls
    scored = next(t for t in tasks.to_dict("records") if t["slice"] == "replay/scored")
    inferred = {s["function"]["name"]: s for s in json.loads(scored["answer"])["tools"]}
    assert inferred["find_customer"]["function"]["parameters"] == {
        "type": "object", "properties": {"member_number": {"type": "string"}}, "required": ["member_number"]}
    # collected again with no new trace: the tables as they were, the same findings (it read them whole)
    from tasks.collect import collect

    again = collect.fn(pipeline="bank", root=str(root))
    assert again.metrics["tasks_from_traces"] == result.metrics["tasks_from_traces"]
    assert again.metrics["replay_contradicted"] == result.metrics["replay_contradicted"]


def test_a_prompt_another_task_set_has_is_left_out(collected):
    from flywheel.data.tasksets import build_tasks

    root, _ = collected
    cfg = load_pipeline("bank", root / "pipelines.yaml")
    env = load_environment(cfg.environment, root, "bank")
    traces = [t for t in Catalog(root, "bank").read("traces").to_dict("records") if t["outcome"] == "accepted"]
    first = build_tasks(env, cfg.environment, 0.25, traces)
    again = build_tasks(env, cfg.environment, 0.25, traces[:3], known={prompt_hash(json.loads(first[0]["prompt"]))})
    assert first[0]["task_id"] not in {r["task_id"] for r in again} and len(again) == 2


def _episode(env: ReplayEnv, slice_: str = "replay/bank", kind: str = "transfer_funds"):
    task = next(t for t in env.recorded_tasks() if t.slice == slice_ and any(c[0] == kind for c in t.data["calls"]))
    return task, env.start(task)


def test_tools_are_served_from_the_record_and_unmatched_calls_are_errors(collected):
    root, _ = collected
    cfg = load_pipeline("bank", root / "pipelines.yaml")
    env = load_environment(cfg.environment, root, "bank")
    assert {s["function"]["name"] for s in env.tools()} == {s["function"]["name"] for s in TOOLS}

    task, state = _episode(env)
    calls = task.data["calls"]
    name, arguments, result = next(c for c in calls if c[0] == "transfer_funds")
    # key order, whitespace, case and the string form of a number do not matter
    reordered = {"amount": f" {arguments['amount']:.2f} ", "to_account": arguments["to_account"].lower(),
                 "from_account": arguments["from_account"]}
    reordered = dict(reversed(list(reordered.items())))
    assert env.call_tool(name, reordered, state) == result
    find = next(c for c in calls if c[0] == "find_customer")
    assert env.call_tool("find_customer", find[1], state) == find[2]
    assert env.call_tool("find_customer", find[1], state) == find[2], "a repeated read gets the same answer"

    with pytest.raises(ToolError, match=r"^not available in replay: list_accounts\(.*was not recorded"):
        env.call_tool("list_accounts", {"customer_id": "C-999999"}, state)
    with pytest.raises(ToolError, match="not available in replay: no call of 'wire_money' was recorded"):
        env.call_tool("wire_money", {"amount": 5}, state)
    message = call_tool(env, {"function": {"name": "transfer_funds", "arguments": json.dumps(
        {**arguments, "amount": arguments["amount"] + 1})}}, 2.0, state)
    assert message.startswith("Error: not available in replay: transfer_funds(")
    assert env.counters["replay_unmatched"] == 3 and env.counters["replay_served"] == 3
    assert len(state.unmatched) == 3

    # free text matches by word overlap (the configured threshold), ids never do
    ticket_task, ticket_state = _episode(env, kind="create_ticket")
    _, ticket_args, ticket_result = next(c for c in ticket_task.data["calls"] if c[0] == "create_ticket")
    reworded = {**ticket_args, "summary": ticket_args["summary"].replace("payment", "payment,") + " please"}
    assert env.call_tool("create_ticket", reworded, ticket_state) == ticket_result
    strict = ReplayEnv(ReplayConfig(fuzzy=1.0), tasks_table=env.tasks_table)
    with pytest.raises(ToolError, match="not available in replay"):
        strict.call_tool("create_ticket", reworded, strict.start(ticket_task))


def test_the_rubric_scores_every_turn_of_the_whole_conversation(collected):
    root, _ = collected
    cfg = load_pipeline("bank", root / "pipelines.yaml")
    env = load_environment(cfg.environment, root, "bank")
    conversations = recorded_conversations(root)
    task, _ = _episode(env)
    recorded = conversations[task.task_id]
    assert env.score(task, recorded).breakdown == {"writes": 1.0, "facts": 1.0}
    assert env.score(task, recorded).reward == 1.0 and env.score(task, recorded).passed

    def edited(change) -> list[dict]:
        messages = copy.deepcopy(recorded)
        change(messages)
        return messages

    write_at = next(i for i, m in enumerate(recorded) if any(
        c["function"]["name"] == "transfer_funds" for c in m.get("tool_calls") or []))
    assert sum(m["role"] == "user" for m in recorded[:write_at]) >= 3, "the write comes in the third turn or later"

    def wrong_amount(messages):
        call = messages[write_at]["tool_calls"][0]["function"]
        call["arguments"] = json.dumps({**json.loads(call["arguments"]), "amount": 1.0})

    def no_write(messages):
        del messages[write_at:write_at + 2]

    def twice(messages):
        messages[write_at]["tool_calls"].append({**messages[write_at]["tool_calls"][0], "id": "call_9"})

    def a_read_more(messages):
        messages[write_at]["tool_calls"].append({"id": "call_9", "type": "function", "function": {
            "name": "get_balance", "arguments": '{"account_id": "x"}'}})

    answer_at = next(i for i, m in enumerate(recorded) if i > write_at and m["role"] == "assistant")

    def vague(messages):
        messages[answer_at]["content"] = "Done, the money was moved."

    for change, writes in ((wrong_amount, 0.0), (no_write, 0.0), (twice, 0.0), (a_read_more, 1.0)):
        assert env.score(task, edited(change)).breakdown["writes"] == writes, change.__name__
    score = env.score(task, edited(vague))
    assert score.breakdown["writes"] == 1.0 and 0.0 < score.breakdown["facts"] < 1.0 and not score.passed
    assert len(task.data["facts"]) >= 4, task.data["facts"]  # ids, the transfer id, balances, the date
    assert env.score(task, recorded[:answer_at]).breakdown["facts"] < 1.0, "the answers after it count too"


def test_expected_actions_are_the_target_writes_where_the_record_has_them(collected):
    root, _ = collected
    cfg = load_pipeline("bank", root / "pipelines.yaml")
    env = load_environment(cfg.environment, root, "bank")
    traces = Catalog(root, "bank").read("traces")
    row = next(r for r in traces.to_dict("records") if r["outcome"] == "accepted" and r["expected_actions"]
               and "transfer_funds" in r["expected_actions"])
    messages = json.loads(row["messages"])
    assert env.score(env.task_from_trace(row, 0.25), messages).breakdown["writes"] == 1.0
    expected = json.loads(row["expected_actions"])
    moved = [{**a, "arguments": {**a["arguments"], "amount": a["arguments"]["amount"] + 10}}
             if a["name"] == "transfer_funds" else a for a in expected]
    labelled = env.task_from_trace({**row, "expected_actions": json.dumps(moved)}, 0.25)
    # the rewarded conversation contradicts its label: scored by what the two agree on (the accounts, not the amount)
    assert env.agreement(labelled).disputes == ["transfer_funds made with other amount than expected"]
    assert env.score(labelled, messages).breakdown["writes"] == 1.0
    write_at = next(i for i, m in enumerate(messages) if any(
        c["function"]["name"] == "transfer_funds" for c in m.get("tool_calls") or []))
    other = copy.deepcopy(messages)
    call = other[write_at]["tool_calls"][0]["function"]
    call["arguments"] = json.dumps({**json.loads(call["arguments"]), "to_account": "ACC-0000"})
    assert env.score(labelled, other).breakdown["writes"] == 0.0, "what both agree on is still required"
    assert env.score(labelled, messages[:write_at]).breakdown["writes"] == 0.0, "and must be made"
    # without expected actions (the scored source) the recorded writes are the target
    scored = next(t for t in env.recorded_tasks() if t.slice == "replay/scored")
    assert scored.data["expected"] is None and env.score(scored, recorded_conversations(root)[scored.task_id]).passed


def test_replayed_with_the_recorded_user_the_agent_passes_and_doing_nothing_scores_nothing(collected):
    root, _ = collected
    cfg = load_pipeline("bank", root / "pipelines.yaml")
    env = load_environment(cfg.environment, root, "bank")
    tasks = env.recorded_tasks()
    episodes = Harness(env, Limits(max_turns=24)).run(Recorded(recorded_conversations(root)), tasks)
    assert [e.reward for e in episodes] == [1.0] * len(tasks) and all(e.stop == "answer" for e in episodes)
    assert env.counters["replay_unmatched"] == 0
    # the whole conversation went by: every recorded user turn was said, in order
    for episode in episodes:
        said = [m["content"] for m in episode.messages[len(episode.task.prompt):] if m["role"] == "user"]
        assert said == [m["content"] for m in episode.task.data["users"]] and len(said) >= 2
    for policy in (Says(""), Says(ASK_ID)):
        nothing = Harness(env, Limits(max_turns=24)).run(policy, tasks)
        assert max(e.reward for e in nothing) <= 0.1 and not any(e.passed for e in nothing), policy.text
        assert all(e.stop == "answer" for e in nothing), "the recorded user ran out of turns: it ended"
    single = ReplayEnv(tasks_table=env.tasks_table, user=UserConfig(kind="none"))  # the first exchange only
    (first,) = Harness(single, Limits(max_turns=24)).run(Says(ASK_ID), [tasks[0]])
    assert first.turns == 1 and first.stop == "answer"


def test_the_judge_part_sees_the_whole_conversation_and_an_unparseable_verdict_scores_zero(collected, openai_server):
    import re

    root, _ = collected
    config = pipeline(replay={"judge": {"model": "judge", "base_url": openai_server.url, "weight": 1.0}})
    (root / "pipelines.yaml").write_text(yaml.safe_dump({"pipelines": {"bank": config}}))
    env = load_environment(load_pipeline("bank", root / "pipelines.yaml").environment, root, "bank")
    task, _ = _episode(env)
    recorded = recorded_conversations(root)[task.task_id]
    reference = task.data["answers"]
    write_at = next(i for i, m in enumerate(recorded) if any(
        c["function"]["name"] == "transfer_funds" for c in m.get("tool_calls") or []))
    answer_at = next(i for i, m in enumerate(recorded) if i > write_at and m["role"] == "assistant")

    asked = []  # the accepted answers the judge was shown

    def judge(messages):
        prompt = messages[-1]["content"]
        given = json.loads(re.search(r"^The accepted assistant's answers, in order: (.*)$", prompt, re.M).group(1))
        conversation = prompt.split("The conversation to judge:\n", 1)[1]
        asked.append(given)
        if "Done, the money was moved." in conversation:
            return "It says less.\nSCORE: 0.25"
        if all(f"assistant: {answer}" in conversation for answer in given):
            return "Same outcome, same figures.\nSCORE: 1"
        return "hard to say"

    openai_server.judge = judge

    def answered(at: int, text: str) -> list[dict]:
        return recorded[:at] + [{"role": "assistant", "content": text}] + recorded[at + 1:]

    whole = env.score(task, recorded)
    assert whole.breakdown == {"writes": 1.0, "facts": 1.0, "judge": 1.0} and whole.reward == 1.0 and whole.passed
    vague = env.score(task, answered(answer_at, "Done, the money was moved."))
    facts = vague.breakdown["facts"]
    assert vague.breakdown == {"writes": 1.0, "facts": facts, "judge": 0.25} and facts < 1.0
    assert vague.reward == pytest.approx((0.5 * 1.0 + 0.5 * facts + 1.0 * 0.25) / 2)
    goodbye = max(i for i, m in enumerate(recorded) if m["role"] == "assistant")
    unparseable = env.score(task, answered(goodbye, "Bye. Anything else?"))  # the last turn, not the first
    assert unparseable.breakdown == {"writes": 1.0, "facts": 1.0, "judge": 0.0} and not unparseable.passed
    nothing = env.score(task, task.prompt)
    assert nothing.breakdown == {"writes": 0.0, "facts": 0.0, "judge": 0.0} and nothing.reward == 0.0
    assert asked == [reference] * 3
    counters = env.counters
    assert counters["judge_calls"] == 3 and counters["judge_unparseable"] == 1, counters
    assert openai_server.answers == 3, "no answer, no question to the judge"
    again = env.score(task, recorded)  # a rescore is answered from the judge's cache under the project root
    assert again.reward == 1.0 and openai_server.answers == 3 and (root / ".flywheel/judge-cache.sqlite").exists()


def test_rejected_traces_can_be_inverted_eval_tasks(tmp_path, mlflow_store):
    from tasks.collect import collect

    write_project(tmp_path, pipeline(replay={"rejected": "eval"}))
    collect.fn(pipeline="bank", root=str(tmp_path))
    catalog = Catalog(tmp_path, "bank")
    tasks = catalog.read("tasks")
    rejected = tasks[tasks["slice"].str.startswith("replay-rejected/")]
    assert len(rejected) == (catalog.read("traces")["outcome"] == "rejected").sum() >= 2
    assert set(rejected["split"]) == {"heldout"}, "rejected traces are never targets"
    cfg = load_pipeline("bank", tmp_path / "pipelines.yaml")
    env = load_environment(cfg.environment, tmp_path, "bank")
    task = next(t for t in env.recorded_tasks() if t.slice.startswith("replay-rejected/"))
    traces = {prompt_hash(json.loads(m)[:2]): json.loads(m) for m in catalog.read("traces")["messages"]}
    assert env.score(task, traces[task.task_id]).reward == 0.0, "repeating the rejected trace scores 0"


def test_the_oracle_cannot_teach_replay(tmp_path):
    config = pipeline()
    config["teacher"] = {"policy": "oracle"}
    (tmp_path / "pipelines.yaml").write_text(yaml.safe_dump({"pipelines": {"bank": config}}))
    with pytest.raises(ConfigError, match="oracle cannot teach replay"):
        load_pipelines(tmp_path / "pipelines.yaml")
    config = pipeline()
    config["environment"]["args"] = {"x": 1}
    (tmp_path / "pipelines.yaml").write_text(yaml.safe_dump({"pipelines": {"bank": config}}))
    with pytest.raises(ConfigError, match="environment.replay"):
        load_pipelines(tmp_path / "pipelines.yaml")


def test_an_openai_teacher_replaying_the_trace_scores_one_and_a_wrong_write_zero(collected):
    from openai_server import OracleServer, TraceReplayer

    from flywheel.policies import get_policy

    root, _ = collected
    cfg = load_pipeline("bank", root / "pipelines.yaml")
    env = load_environment(cfg.environment, root, "bank")
    conversations = [json.loads(m) for m in Catalog(root, "bank").read("traces")["messages"]]
    tasks = env.recorded_tasks()
    with OracleServer() as server:
        server.replay = TraceReplayer(conversations)
        teacher = get_policy("openai", model="replayer", base_url=server.url, cache=None)
        episodes = Harness(env, Limits(max_turns=24)).run(teacher, tasks)
        assert [e.reward for e in episodes] == [1.0] * len(tasks)
        assert all(e.breakdown == {"writes": 1.0, "facts": 1.0} for e in episodes)
        assert env.counters["replay_unmatched"] == 0

        # the same conversations, one write's amount changed: that write finds no record, the write part is 0
        task = next(t for t in tasks if any(c[0] == "transfer_funds" for c in t.data["calls"]))
        wrong = copy.deepcopy(conversations)
        for messages in wrong:
            for m in messages:
                for call in m.get("tool_calls") or []:
                    if call["function"]["name"] == "transfer_funds":
                        arguments = json.loads(call["function"]["arguments"])
                        call["function"]["arguments"] = json.dumps({**arguments, "amount": arguments["amount"] + 5})
        server.replay = TraceReplayer(wrong)
        [episode] = Harness(env, Limits(max_turns=24)).run(teacher, [task])
        teacher.close()
    assert episode.breakdown["writes"] == 0.0 and episode.reward < 1.0
    assert any(m["role"] == "tool" and m["content"].startswith("Error: not available in replay: transfer_funds")
               for m in episode.messages)
    assert env.counters["replay_unmatched"] == 1


@pytest.mark.slow
def test_sft_rl_and_evaluate_run_on_replay_tasks_with_no_user_code(tmp_path, mlflow_store, prefect_server, capsys):
    from conftest import make_project
    from openai_server import OracleServer, TraceReplayer

    from flows.retrain import retrain
    from flywheel.config import RedactionConfig
    from flywheel.data.redaction import Redactor
    from flywheel.data.trace_rows import normalise_messages
    from tasks.spec import dvc_yaml

    root = make_project(tmp_path / "project", tmp_path / "dvc-remote")
    redactor = Redactor(RedactionConfig())
    with OracleServer() as server:
        write_project(root, pipeline(base_url=server.url))
        (root / "dvc.yaml").write_text(dvc_yaml(root))
        # the teacher knows the conversations as collect will store them (redacted)
        written = [json.loads(line) for folder in ("bank", "scored")
                   for line in (root / "traces" / folder / "agent.jsonl").read_text().splitlines()]
        server.replay = TraceReplayer([redactor.value(normalise_messages(r["messages"])) for r in written
                                       if r["messages"][-1]["role"] == "assistant"])
        result = retrain(pipeline="bank", root=str(root))
    assert result.ran == ["collect", "synthesize", "sft", "rl", "evaluate", "register"]
    catalog = Catalog(root, "bank")
    synthetic = catalog.read("synthetic")
    train = catalog.read("tasks").query("split == 'train'")
    assert len(synthetic) == len(train) and synthetic["accepted"].all(), "the replayed teacher passes every task"
    evaluated = catalog.read("eval")
    assert set(evaluated["slice"]) <= {"replay/bank", "replay/scored"} and "replay/bank" in set(evaluated["slice"])
    gate = json.loads((root / "data/bank/evaluate/gate.json").read_text())
    assert "replay/bank" in {row["slice"] for row in gate["slice_scores"]}
    assert len(catalog.read("rollouts")) > 0
    # every held-out episode an MLflow trace of the evaluate run, the user's turns among its spans; RL's first
    # task of each step (its group of 2) traces of the rl run
    import mlflow

    from flywheel import registry

    parent = registry.client().get_run(result.run_id)
    evaluated_traces, rl_traces = (
        mlflow.search_traces(locations=[parent.info.experiment_id], run_id=parent.data.tags[f"stage.{stage}.run_id"],
                             return_type="list") for stage in ("evaluate", "rl"))
    assert len(evaluated_traces) == len(evaluated)
    assert any(s.span_type == "USER" for t in evaluated_traces for s in t.data.spans)
    assert len(rl_traces) == 2 and {t.info.tags["flywheel.split"] for t in rl_traces} == {"train"}
    assert {t.info.tags["flywheel.rl_step"] for t in rl_traces} == {"0"}
    assert all({"reward", "passed"} <= {a.name for a in t.info.assessments} for t in rl_traces)
    said = capsys.readouterr().out
    assert "collect: kept " in said and "synthesize: " in said and " teacher samples accepted" in said
    assert "rl: " in said and " optimiser updates in 1 steps; " in said and " groups skipped (equal rewards" in said


def test_beside_another_environment_its_verifiable_traces_stay_its_own(tmp_path, mlflow_store):
    import pickle
    import shutil

    from flywheel.data.tasksets import row_task
    from tasks.collect import collect

    config = pipeline(name="calculator", train_tasks=20, heldout_tasks=4, replay={})
    config["collect"]["sources"].append({"name": "calc", "path": ["traces/calc/*.jsonl"]})
    write_project(tmp_path, config)
    shutil.copytree(REPO / "examples" / "traces", tmp_path / "traces" / "calc")
    result = collect.fn(pipeline="bank", root=str(tmp_path))
    tasks = Catalog(tmp_path, "bank").read("tasks")
    by_env = tasks.groupby(["env", "origin"]).size().to_dict()
    assert by_env[("calculator", "generated")] == 24 and by_env[("calculator", "trace")] > 0
    assert by_env[("replay", "trace")] == result.metrics["tasks_from_traces"] - by_env[("calculator", "trace")]
    assert not tasks[tasks["env"] == "replay"]["slice"].str.startswith("replay/calc").any(), \
        "the calculator verifies its own traces"

    cfg = load_pipeline("bank", tmp_path / "pipelines.yaml")
    env = load_environment(cfg.environment, tmp_path, "bank")
    assert env.name == "calculator+replay"
    names = [s["function"]["name"] for s in env.tools()]
    assert names[0] == "calculator" and {"transfer_funds", "find_customer"} <= set(names)
    task = row_task(next(r for r in tasks.to_dict("records") if r["env"] == "calculator"))
    state = env.start(task)
    assert env.call_tool("calculator", {"expression": "2 + 3"}, state) == "5"
    assert env.score(task, task.prompt + [{"role": "assistant", "content": "no idea"}], state).reward == 0.0
    # RL actor processes get the environment pickled: the copy serves the same record
    copy_ = pickle.loads(pickle.dumps(env))
    replayed, _ = _episode(copy_)
    name, arguments, result_ = replayed.data["calls"][0]
    assert copy_.call_tool(name, arguments, copy_.start(replayed)) == result_
    assert copy_.counters["replay_served"] == 1


def test_without_a_teacher_the_accepted_traces_are_the_targets(tmp_path, mlflow_store, capsys):
    """`teacher.policy: none`: synthesize samples nothing (the teacher URL here answers nothing) and the
    accepted train traces, re-scored by their own replay rubric, are the SFT targets; held-out ones never."""
    from tasks.collect import collect
    from tasks.synthesize import synthesize

    config = pipeline()
    config["teacher"] = {"policy": "none"}
    config["synthesize"]["include_accepted_traces"] = True
    write_project(tmp_path, config)
    collect.fn(pipeline="bank", root=str(tmp_path))
    result = synthesize.fn(pipeline="bank", root=str(tmp_path))
    catalog = Catalog(tmp_path, "bank")
    traces, synthetic = catalog.read("traces"), catalog.read("synthetic")
    accepted_train = traces.query("outcome == 'accepted' and split == 'train'")
    assert len(synthetic) == len(accepted_train) > 0 and (synthetic["teacher"] == "trace").all()
    assert synthetic["accepted"].all() and (synthetic["reward"] == 1.0).all(), "each scores 1 under its own rubric"
    assert result.metrics["samples"] == 0 and result.metrics["traces_accepted"] == len(accepted_train)
    n = len(accepted_train)
    assert (f"synthesize: 0 of 0 teacher samples accepted; {n} of {n} accepted traces kept, 0 failed their own "
            "rubric") in capsys.readouterr().out

    config["synthesize"]["include_accepted_traces"] = False
    (tmp_path / "pipelines.yaml").write_text(yaml.safe_dump({"pipelines": {"bank": config}}))
    with pytest.raises(ConfigError, match="teacher.policy none.*include_accepted_traces: true"):
        load_pipeline("bank", tmp_path / "pipelines.yaml")


def test_an_sft_row_from_a_trace_renders_as_rl_and_evaluate_show_its_task(collected, tiny_student):
    """One harness: the tokens SFT trains on for a trace (logged with no schemas) are the tokens the episode loop
    feeds for the same task at every turn: the same tools (inferred), system prompt and template."""
    from transformers import AutoTokenizer

    from flywheel.policies.toolcalls import canonical_messages
    from flywheel.synthesis import trace_rows
    from flywheel.train.encoding import encode_conversation

    root, _ = collected
    cfg = load_pipeline("bank", root / "pipelines.yaml")
    env = load_environment(cfg.environment, root, "bank")
    traces = Catalog(root, "bank").read("traces")
    row = next(r for r in trace_rows(traces, env, set(), 0.25) if r["sample_id"].startswith("trace-")
               and json.loads(traces.set_index("trace_id").loc[r["sample_id"][6:], "tools"]) == [])
    assert json.loads(row["tools"]) == env.tools() != [], "the tools RL and evaluate show, not the logged []"
    task = next(t for t in env.recorded_tasks() if t.task_id == row["task_id"])
    (episode,) = Harness(env, Limits(max_turns=24)).run(Recorded(recorded_conversations(root)), [task])
    assert episode.passed

    tokenizer = AutoTokenizer.from_pretrained(tiny_student)
    ids, _ = encode_conversation(tokenizer, json.loads(row["messages"]), json.loads(row["tools"]), 1 << 20)
    turns = [i for i, m in enumerate(episode.messages) if m["role"] == "assistant"]
    assert len(turns) >= 5
    for turn in turns:  # what HFPolicy feeds at this turn, with the generation prompt
        fed = tokenizer.apply_chat_template(canonical_messages(episode.messages[:turn]), tools=env.tools(),
                                            add_generation_prompt=True, tokenize=True, return_dict=True)
        assert ids[:len(fed["input_ids"])] == list(fed["input_ids"]), f"turn {turn}"
    logged = tokenizer.apply_chat_template(canonical_messages(task.prompt), tools=None, add_generation_prompt=True,
                                           tokenize=True, return_dict=True)
    assert ids[:len(logged["input_ids"])] != list(logged["input_ids"]), "with the logged tools it would differ"


def test_an_llm_user_plays_the_records_scenario_or_one_written_once_and_cached(tmp_path, mlflow_store,
                                                                               openai_server):
    from tasks.collect import collect

    user = {"kind": "openai", "model": "user-model", "base_url": openai_server.url, "timeout_s": 2.0,
            "max_retries": 1}
    write_project(tmp_path, pipeline(user=user))
    collect.fn(pipeline="bank", root=str(tmp_path))
    env = load_environment(load_pipeline("bank", tmp_path / "pipelines.yaml").environment, tmp_path, "bank")
    tasks = env.recorded_tasks()
    by: dict[str, set[str]] = {}
    for t in tasks:
        by.setdefault(t.slice, set()).add(t.data["scenario_by"])
    assert by == {"replay/bank": {"record"}, "replay/scored": {"written"}}
    written = [t for t in tasks if t.slice == "replay/scored"]
    asked = openai_server.answers
    assert asked == len(written) > 0, "one scenario written per trace without one, none for the rest"
    first_user = [m["content"] for m in written[0].prompt if m["role"] == "user"][0]
    assert written[0].data["scenario"].splitlines()[0] == first_user  # the test server lists the user's lines

    collect.fn(pipeline="bank", root=str(tmp_path), full=True)  # everything again: the scenarios are cached
    assert openai_server.answers == asked

    task = next(t for t in tasks if t.slice == "replay/bank")
    (episode,) = Harness(env, Limits(max_turns=24)).run(Says("Could you tell me more?"), [task])
    said = [m["content"] for m in episode.messages[len(task.prompt):] if m["role"] == "user"]
    assert said and all(line in task.data["scenario"] for line in said), "the user plays its scenario"
    assert episode.stop == "answer" and episode.scored and episode.reward == 0.0  # it said STOP; nothing done
    assert env.counters["user_stops"] == 1 and env.counters["user_requests"] == len(said) + 1

    openai_server.down_after = 0  # the user's model is down: the episode is the user's failure, not the agent's
    fresh = load_environment(load_pipeline("bank", tmp_path / "pipelines.yaml").environment, tmp_path, "bank")
    (broken,) = Harness(fresh, Limits(max_turns=24)).run(Says("Anything else?"), [task])
    assert broken.stop == "user_error" and not broken.scored and fresh.counters["user_errors"] == 1
