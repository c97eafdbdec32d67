"""Episodes as MLflow traces: a replayed multi-turn episode's spans in the conversation's order (user turns, model
turns, tool calls), the rubric's verdict as feedback, the cap with failed episodes first, the messages in the eval
table, and `flywheel eval --show failed` printing them."""

from __future__ import annotations

import json
from itertools import islice

import mlflow
from test_replay import Recorded, collected, recorded_conversations  # noqa: F401 -- `collected` is a fixture
from typer.testing import CliRunner

from flywheel import registry
from flywheel.agent import Harness, Limits
from flywheel.config import CollectConfig, load_pipeline
from flywheel.data.collection import collect
from flywheel.data.mlflow_traces import trace_record
from flywheel.data.redaction import Redactor
from flywheel.data.sources import readers
from flywheel.envs import load_environment
from flywheel.envs.calculator import CalculatorEnv
from flywheel.evaluate.runner import evaluate_policy
from flywheel.evaluate.traces import log_traces
from flywheel.policies.base import Completion
from flywheel.policies.oracle import OraclePolicy


class BadCall:
    """Calls the calculator with an expression it cannot read, then apologises."""

    def generate(self, conversations, tools, sampling, **_):
        out = []
        for messages in conversations:
            done = any(m["role"] == "tool" for m in messages)
            out.append(Completion(message={"role": "assistant", "content": "Sorry."} if done else {
                "role": "assistant", "content": "", "tool_calls": [
                    {"id": "x", "type": "function", "function": {"name": "calculator",
                                                                 "arguments": '{"expression": "1 +"}'}}]}))
        return out


class Wrong:
    """Answers every task at once with a number it did not compute: fails without calling a tool."""

    def generate(self, conversations, tools, sampling, **_):
        return [Completion(message={"role": "assistant", "content": "It is 7."}, usage={"prompt_tokens": 9},
                           token_ids=[1, 2, 3], latency_s=0.01) for _ in conversations]


def _parsed(value):
    try:
        return json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        return value


def _traces(run) -> list:
    experiment = registry.client().get_run(run.run_id).info.experiment_id
    return mlflow.search_traces(locations=[experiment], run_id=run.run_id, return_type="list")


def test_a_replayed_episode_is_a_trace_of_its_turns_in_order_with_the_rubrics_verdict(collected):  # noqa: F811
    root, _ = collected
    cfg = load_pipeline("bank", root / "pipelines.yaml")
    env = load_environment(cfg.environment, root, "bank")
    task = next(t for t in env.recorded_tasks() if t.split == "heldout")
    scored = evaluate_policy(Recorded(recorded_conversations(root)), Harness(env, Limits(max_turns=24)), [task], "rl")
    [episode] = scored.episodes
    assert json.loads(scored.rows[0]["messages"]) == episode.messages, "the eval table keeps the conversation"
    run = registry.start_run(root, "bank", "evaluate")
    assert log_traces({"rl": scored}, run, "bank", env, cap=10) == 1

    [trace] = _traces(run)
    assert trace.info.tags["flywheel.model"] == "rl" and trace.info.tags["flywheel.task_id"] == task.task_id
    assert trace.info.tags["flywheel.slice"] == task.slice and trace.info.tags["flywheel.split"] == "heldout"
    feedback = {a.name: a.value for a in trace.info.assessments}
    assert feedback["reward"] == episode.reward == 1.0 and feedback["passed"] is True
    assert {k: v for k, v in feedback.items() if k.startswith("rubric.")} == {
        f"rubric.{k}": v for k, v in episode.breakdown.items()} and len(episode.breakdown) >= 2
    assert all(a.source.source_type == "CODE" and a.source.source_id == "rubric:replay"
               for a in trace.info.assessments)

    root_span = next(s for s in trace.data.spans if s.parent_id is None)
    spans = sorted((s for s in trace.data.spans if s.parent_id is not None), key=lambda s: s.start_time_ns)
    after_prompt = episode.messages[len(task.prompt):]
    assert root_span.span_type == "AGENT" and root_span.inputs == {"messages": task.prompt}
    assert [s.span_type for s in spans] == [{"assistant": "CHAT_MODEL", "tool": "TOOL", "user": "USER"}[m["role"]]
                                            for m in after_prompt]
    users = [s for s in spans if s.span_type == "USER"]
    assert [s.outputs["content"] for s in users] == [m["content"] for m in task.data["users"]] and len(users) >= 2
    calls = [c for m in after_prompt for c in m.get("tool_calls") or []]
    tools = [s for s in spans if s.span_type == "TOOL"]
    assert len(tools) == len(calls) >= 2
    assert [(s.name, s.inputs) for s in tools] == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                                   for c in calls]
    # a result that is JSON text reads back parsed (MLflow's span outputs)
    assert [_parsed(s.outputs) for s in tools] == [_parsed(m["content"]) for m in after_prompt if m["role"] == "tool"]
    chats = [s for s in spans if s.span_type == "CHAT_MODEL"]
    assert chats[0].inputs == {"messages": task.prompt}  # a model turn sees the conversation so far
    assert chats[-1].outputs["choices"][0]["message"] == [m for m in after_prompt if m["role"] == "assistant"][-1]
    # collect's MLflow source rebuilds the same conversation from the spans; and skips these traces as episodes
    assert trace_record(trace)["messages"] == episode.messages


def test_the_cap_traces_failed_episodes_first_tagged_by_model_and_a_tool_error_is_an_error_span(tmp_path,
                                                                                                 mlflow_store):
    env = CalculatorEnv()
    tasks = list(islice(env.generate_tasks(0), 6))
    harness = Harness(env)
    scored = {"oracle": evaluate_policy(OraclePolicy(env), harness, tasks, "oracle"),
              "wrong": evaluate_policy(Wrong(), harness, tasks, "wrong"),
              "bad": evaluate_policy(BadCall(), harness, tasks[:1], "bad")}
    run = registry.start_run(tmp_path, "calc", "evaluate")
    assert log_traces(scored, run, "calc", env, cap=4) == 9
    traces = _traces(run)
    by_model: dict[str, list] = {}
    for trace in traces:
        by_model.setdefault(trace.info.tags["flywheel.model"], []).append(trace)
    assert {m: len(t) for m, t in by_model.items()} == {"oracle": 4, "wrong": 4, "bad": 1}
    assert all({a.name: a.value for a in t.info.assessments}["passed"] is False for t in by_model["wrong"])
    assert all({a.name: a.value for a in t.info.assessments}["passed"] is True for t in by_model["oracle"])
    wrong = by_model["wrong"][0]
    [turn] = [s for s in wrong.data.spans if s.span_type == "CHAT_MODEL"]
    assert turn.get_attribute("mlflow.chat.tokenUsage") == {"input_tokens": 9, "output_tokens": 3,
                                                             "total_tokens": 12}
    assert turn.get_attribute("mlflow.chat.tools") == env.tools()
    [tool] = [s for s in by_model["bad"][0].data.spans if s.span_type == "TOOL"]
    assert tool.status.status_code == "ERROR" and tool.outputs.startswith("Error:")
    assert tool.inputs == {"expression": "1 +"}
    # held-out episodes never become training data, even from a source that reads the pipeline's experiment
    cfg = CollectConfig(sources=["mlflow:calc"])
    assert collect(readers(cfg, tmp_path), cfg, Redactor(cfg.redact)).traces == []
    # none: nothing written; the run says how many when there are some
    assert log_traces(scored, registry.start_run(tmp_path, "calc", "evaluate"), "calc", env, cap=0) == 0
    assert registry.client().get_run(run.run_id).data.metrics["traces"] == 9


def test_eval_show_failed_prints_the_failed_conversations_of_the_stage_table(project):
    from flywheel.data.catalog import Catalog
    from flywheel.data.schemas import Eval

    env = CalculatorEnv()
    tasks = list(islice(env.generate_tasks(0), 4))
    rows = (evaluate_policy(OraclePolicy(env), Harness(env), tasks, "sft").rows
            + evaluate_policy(Wrong(), Harness(env), tasks, "rl").rows)
    import pandas as pd

    Catalog(project, "small").write("eval", pd.DataFrame(rows, columns=list(Eval.to_schema().columns)))
    out = CliRunner().invoke(app_(), ["eval", "small", "--show", "failed", "-n", "2", "--root", str(project)])
    assert out.exit_code == 0, out.output
    text = out.output
    assert text.count("── rl · task ") == 2 and "(failed)" in text and "(passed)" not in text
    assert tasks[0].prompt[0]["content"] in text and "It is 7." in text
    assert "2 of 4 failed episode(s) shown" in text and "-n 4 shows them all" in text
    passed = CliRunner().invoke(app_(), ["eval", "small", "--show", "passed", "--model", "sft", "--root",
                                         str(project)])
    assert passed.exit_code == 0 and "-> calculator(" in passed.output and "tool calculator:" in passed.output
    bad = CliRunner().invoke(app_(), ["eval", "small", "--show", "failed", "--model", "nope", "--root", str(project)])
    assert bad.exit_code == 2 and "--model nope" in bad.output
    neither = CliRunner().invoke(app_(), ["eval", "small", "--root", str(project)])
    assert neither.exit_code == 2 and "--show failed" in neither.output


def app_():
    from flywheel.cli import app

    return app
