"""Replay: a banking agent's traces (no environment written for them) become tasks served from their record."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import yaml

from flywheel.agent import call_tool, run_episodes
from flywheel.config import ConfigError, ReplayConfig, load_pipeline, load_pipelines
from flywheel.contract import ToolError, prompt_hash
from flywheel.data.catalog import Catalog
from flywheel.envs import load_environment
from flywheel.envs.replay import ReplayEnv

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
from agent_traces import TOOLS, records  # noqa: E402

N_LABELLED, N_SCORED = 36, 6


def pipeline(base_url: str = "http://127.0.0.1:9/v1", **environment) -> dict:
    """A replay pipeline over two sources: outcome labels with schemas, 0/1 scores without schemas."""
    return {"environment": {"name": "replay", "max_turns": 8, **environment},
            "student": {"model": "tiny", "tiny": {"hidden_size": 32, "layers": 1, "heads": 2, "vocab_size": 400,
                                                  "max_position_embeddings": 1024}},
            "teacher": {"policy": "openai", "model": "replayer", "base_url": base_url, "timeout_s": 10.0,
                        "max_retries": 1},
            "collect": {"sources": [{"name": "bank", "path": ["traces/bank/*.jsonl"]},
                                    {"name": "scored", "path": ["traces/scored/*.jsonl"],
                                     "outcome": {"score_threshold": 0.5}}],
                        "heldout_fraction": 0.25},
            "synthesize": {"max_new_tokens": 256},
            "sft": {"steps": 4, "batch_size": 4, "lr": 3.0e-3, "warmup_steps": 0, "max_length": 1024,
                    "eval_fraction": 0.0},
            "rl": {"steps": 1, "tasks_per_step": 2, "group_size": 2, "max_new_tokens": 8, "max_length": 1024,
                   "actors": 0, "max_staleness": 0, "checkpoint_every": 0, "epochs_per_batch": 1},
            "evaluate": {"batch_size": 16},
            "gate": {"min_score": 0.0, "mode": "non_inferior", "margin": 1.0, "max_slice_regression": 1.0}}


def write_project(root: Path, config: dict) -> None:
    """The traces (two sources, a malformed record among them) and pipelines.yaml under `root`."""
    labelled = records(N_LABELLED, seed=0)
    scored = []
    for record in records(N_LABELLED + N_SCORED, seed=1)[N_LABELLED:]:  # other customers: other prompts
        outcome = record.pop("outcome")
        record.pop("tools")  # schemas inferred from the calls
        scored.append({**record, "score": 1.0 if outcome == "accepted" else 0.0})
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "?"}], "outcome": "accepted"}
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


def test_the_agent_is_multi_turn_with_reused_call_ids():
    for record in records(N_LABELLED):
        calls = [c for m in record["messages"] for c in m.get("tool_calls") or []]
        assert 3 <= len(calls) <= 15
        turns = [m for m in record["messages"] if m.get("tool_calls")]
        assert len(turns) >= 3 and all(t["tool_calls"][0]["id"] == "call_0" for t in turns), "ids restart"
    assert len(TOOLS) >= 5
    assert sum(r["outcome"] == "rejected" for r in records(N_LABELLED)) >= 1


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
    # held-out traces are held-out tasks
    split_of_prompt = {}
    for row in accepted.to_dict("records"):
        messages = json.loads(row["messages"])
        split_of_prompt[prompt_hash(messages[:2])] = row["split"]
    assert {t["task_id"]: t["split"] for t in tasks.to_dict("records")} == split_of_prompt
    assert set(tasks["split"]) == {"train", "heldout"}
    # collect quarantined the call with an empty name under its own kind, and logged the count
    assert list(catalog.read("quarantine")["kind"]) == ["empty_tool_name"]
    assert result.metrics["quarantine_empty_tool_name"] == 1
    # a trace without schemas gets them from its calls
    scored = next(t for t in tasks.to_dict("records") if t["slice"] == "replay/scored")
    inferred = {s["function"]["name"]: s for s in json.loads(scored["answer"])["tools"]}
    assert inferred["find_customer"]["function"]["parameters"] == {
        "type": "object", "properties": {"member_number": {"type": "string"}}, "required": ["member_number"]}


def test_a_prompt_another_task_set_has_is_left_out(collected):
    from flywheel.data.tasksets import build_tasks

    root, _ = collected
    cfg = load_pipeline("bank", root / "pipelines.yaml")
    env = load_environment(cfg.environment, root, "bank")
    traces = Catalog(root, "bank").read("traces").to_dict("records")
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


def test_the_rubric_parts(collected):
    root, _ = collected
    cfg = load_pipeline("bank", root / "pipelines.yaml")
    env = load_environment(cfg.environment, root, "bank")
    traces = {prompt_hash(json.loads(m)[:2]): json.loads(m) for m in Catalog(root, "bank").read("traces")["messages"]}
    task, _ = _episode(env)
    recorded = traces[task.task_id]
    assert env.score(task, recorded).breakdown == {"writes": 1.0, "facts": 1.0}
    assert env.score(task, recorded).reward == 1.0 and env.score(task, recorded).passed

    def edited(change) -> list[dict]:
        messages = copy.deepcopy(recorded)
        change(messages)
        return messages

    write_at = next(i for i, m in enumerate(recorded) if any(
        c["function"]["name"] == "transfer_funds" for c in m.get("tool_calls") or []))

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
    assert score.breakdown == {"writes": 1.0, "facts": 0.0} and score.reward == 0.5 and not score.passed
    assert len(task.data["facts"]) >= 3, task.data["facts"]  # ids, the transfer id and the new balance
    unanswered = env.score(task, recorded[:answer_at])
    assert unanswered.breakdown["facts"] == 0.0


def test_the_judge_part_weighs_in_and_an_unparseable_verdict_scores_zero(collected, openai_server):
    import re

    root, _ = collected
    config = pipeline(replay={"judge": {"model": "judge", "base_url": openai_server.url, "weight": 1.0}})
    (root / "pipelines.yaml").write_text(yaml.safe_dump({"pipelines": {"bank": config}}))
    env = load_environment(load_pipeline("bank", root / "pipelines.yaml").environment, root, "bank")
    traces = {prompt_hash(json.loads(m)[:2]): json.loads(m) for m in Catalog(root, "bank").read("traces")["messages"]}
    # a transfer whose conversation goes on with a second request: the judge must see the first answer
    task = next(t for t in env.recorded_tasks() if t.slice == "replay/bank" and any(
        c[0] == "transfer_funds" for c in t.data["calls"]) and sum(
        m["role"] == "user" for m in traces[t.task_id]) == 2)
    recorded = traces[task.task_id]
    reference = task.data["final"]

    asked = []  # (reference, answer) as the judge read them

    def judge(messages):
        prompt = messages[-1]["content"]
        given = re.search(r"^Reference answer: (.*)$", prompt, re.MULTILINE).group(1)
        final = re.search(r"^Assistant's answer: (.*)$", prompt, re.MULTILINE).group(1)
        asked.append((json.loads(given), final))
        if final == reference:
            return "Same transfer, same figures.\nSCORE: 1"
        return "It says less.\nSCORE: 0.25" if final == "Done, the money was moved." else "hard to say"

    openai_server.judge = judge
    answer_at = max(i for i, m in enumerate(recorded) if m["role"] == "assistant" and m.get("content") == reference)

    def answered(text: str) -> list[dict]:
        return recorded[:answer_at] + [{"role": "assistant", "content": text}] + recorded[answer_at + 1:]

    whole = env.score(task, recorded)
    assert whole.breakdown == {"writes": 1.0, "facts": 1.0, "judge": 1.0} and whole.reward == 1.0 and whole.passed
    vague = env.score(task, answered("Done, the money was moved."))
    # (writes 0.5 * 1 + facts 0.5 * 0 + judge 1.0 * 0.25) / 2
    assert vague.breakdown == {"writes": 1.0, "facts": 0.0, "judge": 0.25} and vague.reward == 0.375
    unparseable = env.score(task, answered(reference + " Anything else?"))
    assert unparseable.breakdown == {"writes": 1.0, "facts": 1.0, "judge": 0.0} and unparseable.reward == 0.5
    assert not unparseable.passed
    no_answer = env.score(task, recorded[:answer_at])
    assert no_answer.breakdown["judge"] == 0.0 and no_answer.reward == 0.25
    assert {given for given, _ in asked} == {reference}
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
        episodes = run_episodes(env, teacher, tasks, max_turns=8)
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
        [episode] = run_episodes(env, teacher, [task], max_turns=8)
        teacher.close()
    assert episode.breakdown["writes"] == 0.0 and episode.reward < 1.0
    assert any(m["role"] == "tool" and m["content"].startswith("Error: not available in replay: transfer_funds")
               for m in episode.messages)
    assert env.counters["replay_unmatched"] == 1


@pytest.mark.slow
def test_sft_rl_and_evaluate_run_on_replay_tasks_with_no_user_code(tmp_path, mlflow_store, prefect_server):
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
    assert result["ran"] == ["collect", "synthesize", "sft", "rl", "evaluate", "register"]
    catalog = Catalog(root, "bank")
    synthetic = catalog.read("synthetic")
    train = catalog.read("tasks").query("split == 'train'")
    assert len(synthetic) == len(train) and synthetic["accepted"].all(), "the replayed teacher passes every task"
    evaluated = catalog.read("eval")
    assert set(evaluated["slice"]) <= {"replay/bank", "replay/scored"} and "replay/bank" in set(evaluated["slice"])
    gate = json.loads((root / "data/bank/evaluate/gate.json").read_text())
    assert "replay/bank" in {row["slice"] for row in gate["slice_scores"]}
    assert len(catalog.read("rollouts")) > 0


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


def test_without_a_teacher_the_accepted_traces_are_the_targets(tmp_path, mlflow_store):
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

    config["synthesize"]["include_accepted_traces"] = False
    (tmp_path / "pipelines.yaml").write_text(yaml.safe_dump({"pipelines": {"bank": config}}))
    with pytest.raises(ConfigError, match="teacher.policy none.*include_accepted_traces: true"):
        load_pipeline("bank", tmp_path / "pipelines.yaml")
