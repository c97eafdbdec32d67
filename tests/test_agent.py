"""The one episode loop, driven by the oracle and by policies that misbehave on purpose."""

from __future__ import annotations

import copy
import json
import pickle
import time
from itertools import islice
from pathlib import Path

import pytest

from flywheel.agent import Harness, Limits
from flywheel.contract import STOP, UserError
from flywheel.envs.calculator import CalculatorEnv
from flywheel.policies import get_policy
from flywheel.policies.base import Completion
from flywheel.policies.oracle import OraclePolicy
from flywheel.policies.toolcalls import parse_completion

TRACES = Path(__file__).parents[1] / "examples" / "traces"


@pytest.fixture
def env() -> CalculatorEnv:
    return CalculatorEnv()


def call(arguments: str, name: str = "calculator") -> Completion:
    """A completion that makes one tool call with these raw arguments."""
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": name, "arguments": arguments}}]}
    return Completion(message=message)


class Scripted:
    """Plays the given completions for the first turns, then hands over to the oracle."""

    name = "scripted"

    def __init__(self, env, first: list[Completion]):
        self.first, self.oracle = first, OraclePolicy(env)

    def generate(self, conversations, tools, sampling):
        turn = sum(m["role"] == "assistant" for m in conversations[0])
        if turn < len(self.first):
            # fresh copies: the harness renumbers call ids in the message it is given
            return [copy.deepcopy(self.first[turn]) for _ in conversations]
        return self.oracle.generate(conversations, tools, sampling)


class SlowCalculator(CalculatorEnv):
    """The calculator whose tool hangs longer than the harness waits."""

    def call_tool(self, name, arguments, state=None):
        time.sleep(0.5)
        return super().call_tool(name, arguments, state)


def test_registry_builds_the_oracle(env):
    assert isinstance(get_policy("oracle", env=env), OraclePolicy)
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        get_policy("nope")


def test_oracle_solves_every_task_in_two_turns(env):
    tasks = list(islice(env.generate_tasks(0), 60))
    episodes = Harness(env).run(OraclePolicy(env), tasks, samples=2)
    assert len(episodes) == 120
    for episode in episodes:
        assert episode.reward == 1.0 and episode.passed, episode.messages
        assert episode.turns == 2 and episode.stop == "answer"
        assert [m["role"] for m in episode.messages] == ["user", "assistant", "tool", "assistant"]
        assert episode.breakdown == {"answer": 1.0, "used_tool": 1.0, "valid_tool_calls": 1.0}
    text = episodes[0].completions[0].text
    assert text.startswith("<tool_call>") and parse_completion(text).message["tool_calls"]


def test_each_episode_is_scored_and_reported_as_soon_as_it_ends():
    """on_done (evaluate's progress) hears of an episode when it ends, scored, while longer ones still run: a
    long evaluation counts its episodes as they finish, not all at the very end."""
    from flywheel.envs.support import make_env

    desk = make_env(hard_fraction=0.5)
    tasks = list(islice(desk.generate_tasks(0), 20))
    seen = []
    episodes = Harness(desk, Limits(max_turns=13)).run(OraclePolicy(desk), tasks,
                                                        on_done=lambda e: seen.append((e.turns, e.passed)))
    assert len(seen) == 20 and all(passed for _, passed in seen)  # scored before on_done heard of it
    turns = [t for t, _ in seen]
    # reported in the order they ended (the tasks' order mixes short and long ones), the first while longer ones
    # went on
    assert turns == sorted(turns) and turns[0] < turns[-1]
    assert [e.turns for e in episodes] != turns


def test_turn_limit_stops_an_endless_caller(env):
    task = next(env.generate_tasks(0))
    policy = Scripted(env, [call(json.dumps({"expression": "1 + 1"}))] * 10)
    (episode,) = Harness(env, Limits(max_turns=3)).run(policy, [task])
    assert episode.stop == "max_turns" and episode.turns == 3
    assert episode.reward == 0.0 and not episode.passed
    assert [m["role"] for m in episode.messages].count("tool") == 3


@pytest.mark.parametrize("arguments, name, error", [
    (json.dumps({"expression": "__import__('os')"}), "calculator", "Error: "),
    (json.dumps({"expr": "1 + 1"}), "calculator", "Error: calculator needs a string argument 'expression'"),
    ("{not json", "calculator", "Error: arguments are not valid JSON"),
    ("[1, 2]", "calculator", "Error: arguments must be a JSON object"),
    (json.dumps({"expression": "1 + 1"}), "python", "Error: unknown tool 'python'"),
])
def test_tool_errors_are_shown_and_the_episode_goes_on(env, arguments, name, error):
    task = next(env.generate_tasks(0))
    (episode,) = Harness(env).run(Scripted(env, [call(arguments, name)]), [task])
    tool_result = episode.messages[2]
    assert tool_result["role"] == "tool" and tool_result["content"].startswith(error)
    assert episode.passed and episode.turns == 2 and episode.breakdown["valid_tool_calls"] == 0.0


def test_malformed_tool_call_is_shown_as_a_user_message(env):
    task = next(env.generate_tasks(0))
    broken = parse_completion("<tool_call>{bad json</tool_call>")
    assert broken.error
    (episode,) = Harness(env).run(Scripted(env, [broken]), [task])
    feedback = episode.messages[2]
    assert feedback["role"] == "user" and feedback["content"].startswith("Error: tool call 0 is not valid JSON")
    assert episode.passed and episode.turns == 3


def test_malformed_tool_calls_in_a_row_end_the_episode_at_max_error_turns(env):
    task = next(env.generate_tasks(0))
    broken = parse_completion("<tool_call>{bad json</tool_call>")
    good = call(json.dumps({"expression": "1 + 1"}))
    # an error, a good call, then errors: only turns in a row count, so the second pair ends it (turn 4)
    policy = Scripted(env, [broken, good, broken, broken, broken, broken])
    (episode,) = Harness(env, Limits(max_turns=10, max_error_turns=2)).run(policy, [task])
    assert episode.stop == "error_turns" and episode.turns == 4 and not episode.passed
    assert env.counters["conversations_cut"] == 1  # counted as a cut, like the turn and token limits
    (unlimited,) = Harness(env, Limits(max_turns=10)).run(policy, [task])  # by default errors never end it
    assert unlimited.stop == "answer" and unlimited.turns == 7


def test_limits_come_from_the_environment_section_and_the_harness_travels_whole(slow_tool_harness):
    from flywheel.config import EnvironmentConfig

    assert Limits.from_config(EnvironmentConfig()) == Limits()  # the defaults agree: an unset key changes nothing
    section = EnvironmentConfig(max_turns=7, max_episode_tokens=100, tool_timeout_s=0.5, max_error_turns=3)
    assert Limits.from_config(section) == Limits(max_turns=7, max_tokens=100, tool_timeout_s=0.5, max_error_turns=3)
    # load_harness: the factory's environment under the section's limits; pickled (to an RL actor process), the
    # environment is built again by its factory and the limits come along
    assert slow_tool_harness.env.name == "slow"
    assert slow_tool_harness.limits == Limits(max_turns=8, max_tokens=10, tool_timeout_s=0.05)
    again = pickle.loads(pickle.dumps(slow_tool_harness))
    assert again.limits == slow_tool_harness.limits and again.env is not slow_tool_harness.env
    assert again.env.name == "slow" and again.env.tools() == slow_tool_harness.env.tools()


def test_slow_tool_times_out(env):
    slow = SlowCalculator()
    task = next(slow.generate_tasks(0))
    (episode,) = Harness(slow, Limits(tool_timeout_s=0.1)).run(OraclePolicy(slow), [task])
    assert episode.messages[2]["content"] == "Error: tool 'calculator' timed out after 0.1s"
    # the oracle answers from its own computation, so the episode still ends with an answer
    assert episode.passed and episode.breakdown["valid_tool_calls"] == 0.0


def test_episodes_on_example_trace_prompts(env):
    tasks = []
    for path in sorted(TRACES.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                messages = json.loads(line)["messages"]
            except json.JSONDecodeError:
                continue
            task = env.task_from_messages(messages) if isinstance(messages, list) else None
            if task is not None:
                tasks.append(task)
    assert len(tasks) >= 140
    episodes = Harness(env).run(OraclePolicy(env), tasks[:40])
    assert all(e.passed and e.turns == 2 for e in episodes)
    assert {t.slice for t in tasks} == {"add", "mul", "mixed"}


class FollowUp(CalculatorEnv):
    """The calculator whose user asks one follow-up question after the first answer, then ends the conversation."""

    def start(self, task):
        return {"seen": []}  # each episode's own record of what its user was shown

    def user_turn(self, task, messages, state=None):
        state["seen"].append(messages[-1]["content"])
        return {"role": "user", "content": "And what is 2 + 2?"} if len(state["seen"]) == 1 else None


class Says:
    """Answers every conversation with a fixed text, no tool calls."""

    name = "says"

    def __init__(self, text: str):
        self.text = text

    def generate(self, conversations, tools, sampling):
        return [Completion(message={"role": "assistant", "content": self.text}) for _ in conversations]


def test_the_environments_user_keeps_the_conversation_going_until_it_ends_it():
    env = FollowUp()
    task = next(env.generate_tasks(0))
    (episode,) = Harness(env, Limits(max_turns=5)).run(Says("4"), [task])
    assert [m["role"] for m in episode.messages] == ["user", "assistant", "user", "assistant"]
    assert episode.messages[2]["content"] == "And what is 2 + 2?"
    assert episode.stop == "answer" and episode.turns == 2
    (cut,) = Harness(env, Limits(max_turns=1)).run(Says("4"), [task])  # the turn limit ends it first
    assert cut.stop == "max_turns" and [m["role"] for m in cut.messages] == ["user", "assistant", "user"]


def test_by_default_the_conversation_ends_at_the_first_answer(env):
    (episode,) = Harness(env, Limits(max_turns=5)).run(Says("4"), [next(env.generate_tasks(0))])
    assert [m["role"] for m in episode.messages] == ["user", "assistant"] and episode.stop == "answer"


class Talkative(FollowUp):
    """A user who never runs out of things to say, says STOP on request, or fails on its second turn."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode

    def user_turn(self, task, messages, state=None):
        state["seen"].append(messages[-1]["content"])
        if self.mode == "stop" and len(state["seen"]) == 2:
            return {"role": "user", "content": f"Thanks, that is all. {STOP}"}
        if self.mode == "fail" and len(state["seen"]) == 2:
            raise UserError("the user's model is down (3 retries)")
        return {"role": "user", "content": "And once more?"}


def test_a_stop_marker_ends_the_conversation_and_the_marked_line_is_not_added():
    env = Talkative("stop")
    (episode,) = Harness(env, Limits(max_turns=10)).run(Says("4"), [next(env.generate_tasks(0))])
    assert episode.stop == "answer" and episode.turns == 2 and episode.scored
    assert [m["role"] for m in episode.messages] == ["user", "assistant", "user", "assistant"]
    assert "conversations_cut" not in env.counters


def test_a_conversation_that_never_ends_is_cut_by_the_turn_or_token_budget_and_counted():
    env = Talkative("forever")
    tasks = [next(env.generate_tasks(0))]
    (cut,) = Harness(env, Limits(max_turns=6)).run(Says("4"), tasks)
    assert cut.stop == "max_turns" and cut.turns == 6
    assert env.counters["conversations_cut"] == 1

    class Counted(Says):  # each answer costs 5 tokens: a budget of 12 ends it after the third
        def generate(self, conversations, tools, sampling):
            return [Completion(message={"role": "assistant", "content": "4"}, usage={"completion_tokens": 5})
                    for _ in conversations]

    (budget,) = Harness(env, Limits(max_turns=30, max_tokens=12)).run(Counted("4"), tasks)
    assert budget.stop == "budget" and budget.turns == 3 and budget.tokens == 15
    assert env.counters["conversations_cut"] == 2


def test_a_failing_user_marks_the_episode_user_error_never_the_agents_failure():
    env = Talkative("fail")
    (episode,) = Harness(env, Limits(max_turns=10)).run(Says("4"), [next(env.generate_tasks(0))])
    assert episode.stop == "user_error" and not episode.scored
    assert "down" in episode.user_error and env.counters["user_errors"] == 1
    assert episode.messages[-1]["role"] == "assistant"  # nothing the user did not say was added
