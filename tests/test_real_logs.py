"""Replay on logs written by others: the conversations they rewarded pass their own rubric, and less does not.

A slice of ToolTalk (tests/data/real_logs/tooltalk, MIT: its LICENSE beside it) read through the config of
examples/real_logs/tooltalk.yaml alone, and one of Schema-Guided Dialogue (tests/data/real_logs/sgd, CC BY-SA 4.0)
through examples/real_logs/sgd.yaml alone; then generated cases of what real logs do that broke replay before:
tools that change nothing but are not named like reads, a retry after a tool error, a hand-off the label does not
list, free text in the agent's own words, a label the rewarded conversation contradicts.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from flywheel.agent import Harness, Limits, load_harness
from flywheel.config import ReplayConfig, load_pipeline
from flywheel.dryrun import dry_run
from flywheel.envs.replay import ReplayEnv
from flywheel.replaycheck import check_replay, drop_last_write, recorded_conversations

HERE = Path(__file__).parent
CONFIG = HERE.parent / "examples" / "real_logs" / "tooltalk.yaml"
SLICE = HERE / "data" / "real_logs" / "tooltalk"
FLYWHEEL = [str(Path(shutil.which("flywheel") or "/work/main/.venv/bin/flywheel"))]


def _project(root: Path, replay: dict | None = None) -> None:
    config = yaml.safe_load(CONFIG.read_text())
    if replay is not None:
        config["pipelines"]["tooltalk"]["environment"]["replay"].update(replay)
    (root / "pipelines.yaml").write_text(yaml.safe_dump(config))
    shutil.copytree(SLICE, root / "logs" / "tooltalk")


def _meets_the_targets(root: Path, name: str) -> tuple[int, int]:
    """The replay check over the collected conversations of `name`: every recorded one passes, null and id-only
    pass none (mean <= 0.05), and each perturbation scores below the conversation it came from; (the recorded
    conversations, the perturbed ones: those with a write)."""
    cfg = load_pipeline(name, root / "pipelines.yaml")
    report = dry_run(name, cfg, load_harness(cfg.environment, root, pipeline=name),
                     conversations=recorded_conversations(root, name))
    check = report.replay
    assert check is not None and not report.errors, report.errors
    recorded = check.arms["recorded"]
    assert recorded.passed == len(recorded.episodes)
    for arm in ("null", "id-only"):
        assert check.arms[arm].mean <= 0.05 and check.arms[arm].passed == 0, arm
    perturbed = {len(check.arms[arm].episodes) for arm in ("drop-last-write", "wrong-argument")}
    for arm in ("drop-last-write", "wrong-argument"):
        assert all(e.reward < recorded.episodes[t].reward for t, e in check.arms[arm].episodes.items()), arm
    assert len(perturbed) == 1, "both perturbations change the same conversations: those with a write"
    return len(recorded.episodes), perturbed.pop()


def test_toolTalk_through_the_config_alone_passes_replay_and_its_perturbations_do_not(tmp_path, mlflow_store, capsys):
    from tasks.collect import collect

    _project(tmp_path)
    result = collect.fn(pipeline="tooltalk", root=str(tmp_path))
    said = capsys.readouterr().out
    assert "collect: kept 8 traces (8 accepted) of 8 records read, 0 quarantined;" in said, said
    assert result.metrics["replay_contradicted"] == 0
    assert result.metrics["records"] == 8 and result.metrics["quarantined"] == 0
    assert result.metrics["outcome_accepted"] == 8, "a reference conversation has no score: `missing: accepted`"
    recorded, perturbed = _meets_the_targets(tmp_path, "tooltalk")
    assert recorded >= 7 and perturbed >= 5, (recorded, perturbed)

    # the same through the command; a rubric blind to writes fails it (exit 1), naming the perturbation
    ok = subprocess.run([*FLYWHEEL, "check", "tooltalk", "--solve"], cwd=tmp_path, capture_output=True,
                        text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "recorded:" in ok.stdout and "drop-last-write:" in ok.stdout and "wrong-argument:" in ok.stdout
    config = yaml.safe_load((tmp_path / "pipelines.yaml").read_text())
    config["pipelines"]["tooltalk"]["environment"]["replay"]["writes_weight"] = 0.0
    (tmp_path / "pipelines.yaml").write_text(yaml.safe_dump(config))
    blind = subprocess.run([*FLYWHEEL, "check", "tooltalk", "--solve"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert blind.returncode == 1, blind.stdout + blind.stderr
    assert "drop-last-write" in blind.stdout and "score as high as the recorded one" in blind.stdout
    capsys.readouterr()
    collect.fn(pipeline="tooltalk", root=str(tmp_path))  # collect replays a sample and warns, it does not fail
    said = capsys.readouterr().out
    assert "collect: warning: replay check on 7 recorded conversations" in said and "drop-last-write: " in said


def test_collected_prompts_over_the_students_context_fail_the_check_and_the_run_before_training(tmp_path,
                                                                                               mlflow_store):
    from flywheel.train.context import ContextError
    from tasks.collect import collect
    from tasks.sft import sft
    from tasks.synthesize import synthesize

    _project(tmp_path)
    config = yaml.safe_load((tmp_path / "pipelines.yaml").read_text())
    config["pipelines"]["tooltalk"]["student"] = {"model": "tiny", "tiny": {"max_position_embeddings": 128}}
    config["pipelines"]["tooltalk"]["sft"] = config["pipelines"]["tooltalk"]["rl"] = {"max_length": 128}
    (tmp_path / "pipelines.yaml").write_text(yaml.safe_dump(config))
    before = subprocess.run([*FLYWHEEL, "check", "tooltalk"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert before.returncode == 0, "before collect there is no prompt to measure: " + before.stdout + before.stderr
    collect.fn(pipeline="tooltalk", root=str(tmp_path))
    after = subprocess.run([*FLYWHEEL, "check", "tooltalk"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
    assert after.returncode != 0
    said = after.stdout + after.stderr
    assert "longest first-turn prompt is" in said and "pipelines.tooltalk.student.tiny.max_position_embeddings" in said
    for stage in (synthesize, sft):  # before a teacher runs, and before training
        with pytest.raises(ContextError, match="over the student's context of 128 tokens"):
            stage.fn(pipeline="tooltalk", root=str(tmp_path))


# --- generated cases


def _call(i: int, name: str, arguments: dict) -> dict:
    return {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def _conversation(calls: list[tuple[str, dict, str]], answer: str = "All done.") -> list[dict]:
    """A system prompt, one user turn, the agent's calls one a turn (each answered), its answer, a user thanks."""
    messages = [{"role": "system", "content": "You are a support agent."},
                {"role": "user", "content": "Please cancel order W100 for user ana_1."}]
    for i, (name, arguments, result) in enumerate(calls):
        messages += [{"role": "assistant", "content": None, "tool_calls": [_call(i, name, arguments)]},
                     {"role": "tool", "tool_call_id": f"c{i}", "content": result}]
    return messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Thanks, bye."},
                       {"role": "assistant", "content": "Goodbye."}]


def _trace(messages: list[dict], expected: list[dict] | None = None) -> dict:
    return {"messages": messages, "tools": [], "outcome": "accepted", "source": "logs", "split": "train",
            "expected_actions": json.dumps(expected) if expected is not None else ""}


CANCEL = ("cancel_order", {"order_id": "W100", "reason": "no longer needed"}, '{"status": "cancelled"}')
LOOKUP = ("get_order_details", {"order_id": "W100"}, '{"order_id": "W100", "status": "pending"}')


def _scores(env: ReplayEnv, task, messages) -> tuple[float, float]:
    """(the recorded conversation's reward, the reward with its last required write dropped)."""
    less = drop_last_write(env, task, messages)
    return env.score(task, messages).reward, env.score(task, less).reward if less is not None else -1.0


def test_think_and_calculate_change_nothing_and_an_errored_call_changed_nothing():
    env = ReplayEnv()
    messages = _conversation([LOOKUP, ("think", {"thought": "The order is pending, so it can be cancelled."}, ""),
                              ("calculate", {"expression": "2 + 2"}, "4"),
                              ("cancel_order", {"order_id": "W100", "reason": "ordered by mistake"},
                               "Error: reason must be 'no longer needed' or 'ordered by mistake'"),
                              CANCEL])
    task = env.task_from_trace(_trace(messages))
    assert [w.name for w in env.agreement(task).required] == ["cancel_order"], "one write: the call that worked"
    recorded, dropped = _scores(env, task, messages)
    assert recorded == 1.0 and dropped < recorded


def test_a_hand_off_is_judged_against_the_expected_actions_and_a_contradiction_is_reported():
    env = ReplayEnv()
    transfer = ("transfer_to_human_agents", {"summary": "The user wants a refund to a gift card, which I cannot do."},
                '"Transfer successful"')
    # another record of the logs expects a hand-off: the tool is a write, judged like any other
    other = env.task_from_trace(_trace(_conversation([transfer]), [{"name": "transfer_to_human_agents",
                                                                     "kwargs": {"summary": "Refund to gift card."}}]))
    assert other is not None and env.score(other, _conversation([transfer])).passed, "free text: its own words"
    messages = _conversation([LOOKUP, CANCEL, transfer])
    expected = [{"name": "cancel_order", "kwargs": {"order_id": "W100", "reason": "no longer needed"}},
                {"name": "modify_address", "kwargs": {"order_id": "W100", "zip": "10001"}}]
    task = env.task_from_trace(_trace(messages, expected))
    agreed = env.agreement(task)
    assert agreed.disputes == ["expected modify_address was never made", "transfer_to_human_agents made, not expected"]
    assert [w.name for w in agreed.required] == ["cancel_order"] and agreed.allowed == ["transfer_to_human_agents"]
    recorded, dropped = _scores(env, task, messages)
    assert recorded == 1.0 and dropped < recorded
    wrong = _conversation([LOOKUP, ("cancel_order", {"order_id": "W101", "reason": "no longer needed"}, "{}"),
                           transfer])
    assert env.score(task, wrong).breakdown["writes"] == 0.0


def test_free_text_arguments_follow_their_rule():
    messages = _conversation([("send_email", {"to": "ana_1", "body": "Your order W100 was cancelled today."}, "{}")])
    reworded = _conversation([("send_email", {"to": "ana_1", "body": "We cancelled order W100 for you today."}, "{}")])
    loose = ReplayEnv()
    task = loose.task_from_trace(_trace(messages))
    assert loose.score(task, reworded).breakdown["writes"] == 1.0, "free text in its own words: not compared"
    cancelled = loose.task_from_trace(_trace(_conversation([LOOKUP, CANCEL])))
    mistaken = _conversation([LOOKUP, ("cancel_order", {"order_id": "W100", "reason": "ordered by mistake"}, "{}")])
    assert loose.score(cancelled, mistaken).breakdown["writes"] == 0.0, "a short option is no free text: compared"
    strict = ReplayEnv(ReplayConfig(arguments={"send_email.body": "normalised"}))
    task = strict.task_from_trace(_trace(messages))
    assert strict.score(task, reworded).breakdown["writes"] == 0.0
    assert strict.score(task, json.loads(json.dumps(messages).replace("Your order", "your  ORDER"))).passed


def test_the_check_names_the_tasks_whose_recorded_conversation_fails_and_a_perturbation_that_scores():
    env = ReplayEnv(ReplayConfig(writes_weight=0.0))  # a rubric blind to writes: dropping one costs nothing
    messages = _conversation([LOOKUP, CANCEL], answer="Order W100 is cancelled.")
    task = env.task_from_trace(_trace(messages))
    conversations = {task.task_id: messages}
    check = check_replay(env, Harness(env, Limits(max_turns=4)), [task], conversations)
    assert any(e.startswith("drop-last-write: 1 of 1") for e in check.errors), check.errors
    half = {task.task_id: messages[:2] + [{"role": "assistant", "content": "Hello."}]}
    check = check_replay(ReplayEnv(), Harness(ReplayEnv(), Limits()), [task], half)
    assert any("pass their own rubric 0 of 1" in e for e in check.errors), check.errors


def test_evaluate_says_how_many_episodes_are_done_while_a_model_runs(monkeypatch, capsys):
    import time

    from flywheel.evaluate import runner
    from flywheel.replaycheck import Says

    class Slow(Says):
        def generate(self, conversations, tools, sampling, **kw):
            time.sleep(0.05)
            return super().generate(conversations, tools, sampling, **kw)

    monkeypatch.setattr(runner, "PROGRESS_EVERY_S", 0.02)
    env = ReplayEnv()
    tasks = [env.task_from_trace(_trace(_conversation([LOOKUP, CANCEL])))]
    scored = runner.evaluate_policy(Slow("Hello."), Harness(env, Limits(max_turns=6)), tasks * 3, "slow-model",
                                    chunk=1)
    assert len(scored.rows) == 3
    said = [line for line in capsys.readouterr().out.splitlines() if "evaluate: slow-model: " in line]
    assert said and all(" of 3 episodes done" in line for line in said)
    assert len({line.split(": ")[2] for line in said}) >= 2, "the count moves as episodes finish"


def test_a_log_whose_calls_have_no_function_wrapper_reads_through_turns_alone():
    """tau2-bench's simulation layout: calls {id, name, arguments}, each result a `tool` message naming its call
    at `id`, expected actions {name, arguments}; a message role the log adds (`system` notes) left out."""
    from flywheel.config import CollectConfig, SourceConfig
    from flywheel.data.redaction import Redactor
    from flywheel.data.trace_rows import to_trace

    cancel = {"order_id": "#W100", "reason": "no longer needed"}
    record = {"task_id": "7", "trial": 0, "reward_info": {"reward": 1.0}, "messages": [
        {"role": "assistant", "content": "Hi! How can I help you today?"},
        {"role": "user", "content": "Cancel my order #W100, I no longer need it."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "t1", "name": "cancel_pending_order", "arguments": cancel, "requestor": "assistant"}]},
        {"role": "tool", "id": "t1", "content": '{"status": "cancelled"}', "requestor": "assistant"},
        {"role": "assistant", "content": "Order #W100 is cancelled."}],
        "task": {"evaluation_criteria": {"actions": [{"action_id": "a", "name": "cancel_pending_order",
                                                      "arguments": cancel}]}}}
    source = SourceConfig(path=["logs/*.json"], fields={"messages": "messages", "score": "reward_info.reward",
                                                        "id": ["task_id", "trial"],
                                                        "expected_actions": "task.evaluation_criteria.actions"},
                          turns={"result_id": "id"}, outcome={"score_threshold": 1.0})
    cfg = CollectConfig(sources=[source])
    row = to_trace(record, source, "logs/x.json:1", cfg, Redactor(cfg.redact))
    assert row["outcome"] == "accepted" and json.loads(row["expected_actions"])[0]["name"] == "cancel_pending_order"
    env = ReplayEnv()
    task = env.task_from_trace({**row, "messages": json.loads(row["messages"])})
    messages = json.loads(row["messages"])
    assert env.score(task, messages).passed and not env.agreement(task).disputes
    assert not env.score(task, drop_last_write(env, task, messages)).passed


def test_free_text_can_be_judged_by_the_replay_judge(openai_server):
    def judge(messages):
        prompt = messages[-1]["content"]
        if prompt.startswith("You compare two values of one argument"):
            said = prompt.split("The value to judge:", 1)[1]
            return "Same news.\nSCORE: 1" if "cancelled" in said else "Other news.\nSCORE: 0"
        return "The conversation is fine.\nSCORE: 1"

    openai_server.judge = judge
    with pytest.raises(ValueError, match="the `judge` rule needs replay.judge"):
        ReplayConfig(free_text="judge")
    env = ReplayEnv(ReplayConfig(free_text="judge", judge={"model": "judge", "base_url": openai_server.url,
                                                           "timeout_s": 10.0, "cache": None}))
    messages = _conversation([("send_email", {"to": "ana_1", "body": "Your order W100 was cancelled today."}, "{}")])
    task = env.task_from_trace(_trace(messages))
    reworded = _conversation([("send_email", {"to": "ana_1", "body": "We cancelled order W100 for you today."}, "{}")])
    shipped = _conversation([("send_email", {"to": "ana_1", "body": "We shipped order W100 for you today, ok."}, "{}")])
    assert env.score(task, reworded).breakdown["writes"] == 1.0
    assert env.score(task, shipped).breakdown["writes"] == 0.0
    assert env.counters["judge_calls"] >= 2


SGD_CONFIG = HERE.parent / "examples" / "real_logs" / "sgd.yaml"
SGD_SLICE = HERE / "data" / "real_logs" / "sgd"


def test_schema_guided_dialogues_through_the_config_alone_pass_replay_and_their_perturbations_do_not(
        tmp_path, mlflow_store, capsys):
    """A second public set, another layout: a dialogue's `turns` by `speaker` with an `utterance`, each system
    turn's calls held in its `frames` (only some frames hold a `service_call`: `call_if`), results inline. Its
    slice: a reservation, one that failed (empty results: still the write the user asked for), two in one
    dialogue, a search alone (no write), a ride (`GetRide`: a write the read pattern alone would call a look-up),
    and a two-domain dialogue with two writes."""
    from tasks.collect import collect

    (tmp_path / "pipelines.yaml").write_text(SGD_CONFIG.read_text())
    shutil.copytree(SGD_SLICE, tmp_path / "logs" / "sgd")
    result = collect.fn(pipeline="sgd", root=str(tmp_path))
    said = capsys.readouterr().out
    assert "collect: kept 6 traces (6 accepted) of 6 records read, 0 quarantined;" in said, said
    assert result.metrics["replay_contradicted"] == 0
    assert _meets_the_targets(tmp_path, "sgd") == (6, 5), "6 tasks, every dialogue but the search has a write"


def test_calls_held_among_other_entries_of_a_turn_are_read_where_call_if_says():
    from flywheel.config import TurnLayout
    from flywheel.data.turns import chat_messages

    dialogue = json.loads((SGD_SLICE / "dialogues.json").read_text())[0]  # 1_00000: one ReserveRestaurant
    layout = TurnLayout(role="speaker", content="utterance", roles={"USER": "user", "SYSTEM": "assistant"},
                        calls="frames", call_if="service_call", call_name="service_call.method",
                        call_arguments="service_call.parameters", call_id=None, call_result="service_results")
    messages = chat_messages(dialogue["turns"], layout)
    calls = [c["function"] for m in messages for c in m.get("tool_calls") or []]
    assert [c["name"] for c in calls] == ["ReserveRestaurant"]
    assert json.loads(calls[0]["arguments"])["restaurant_name"] == "Sino"
    at = next(i for i, m in enumerate(messages) if m.get("tool_calls"))
    assert messages[at + 1]["role"] == "tool" and "408-247-8880" in messages[at + 1]["content"]
    assert messages[at + 2]["content"].startswith("Your reservation has been made")
    # a system turn whose frames hold no call is one plain message, as many as the dialogue has turns
    assert sum(m["role"] in ("user", "assistant") and not m.get("tool_calls") for m in messages) == \
        len(dialogue["turns"])
    # without call_if every frame is a call: the frames with no service call become calls with no name
    unnamed = chat_messages(dialogue["turns"], layout.model_copy(update={"call_if": None}))
    assert any(c["function"]["name"] is None for m in unnamed for c in m.get("tool_calls") or [])


def test_the_recorded_conversation_of_a_task_is_the_one_it_was_made_of_when_others_open_the_same_way(
        tmp_path, mlflow_store):
    """Two dialogues open with the same user turn; the first has nothing to check (no task), the second makes
    the task. The check replays the second (once it said the first, and the reservation was never made)."""
    from tasks.collect import collect

    reservation = json.loads((SGD_SLICE / "dialogues.json").read_text())[0]
    opening = reservation["turns"][0]
    nothing = {"dialogue_id": "0_00000", "services": reservation["services"], "turns": [
        opening, {"speaker": "SYSTEM", "utterance": "What city do you want to dine in?", "frames": []},
        {"speaker": "USER", "utterance": "Never mind, thank you.", "frames": []},
        {"speaker": "SYSTEM", "utterance": "Have a good day.", "frames": []}]}
    (tmp_path / "pipelines.yaml").write_text(SGD_CONFIG.read_text())
    (tmp_path / "logs" / "sgd").mkdir(parents=True)
    (tmp_path / "logs" / "sgd" / "dialogues.json").write_text(json.dumps([nothing, reservation]))
    collect.fn(pipeline="sgd", root=str(tmp_path))
    (said,) = recorded_conversations(tmp_path, "sgd").values()
    assert any(m.get("tool_calls") for m in said), "the reservation's conversation, not the one with no task"
    assert _meets_the_targets(tmp_path, "sgd") == (1, 1)
