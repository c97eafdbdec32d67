"""A verifiers environment (defined here, its dataset built in memory) run through this project's harness."""

from __future__ import annotations

import copy
import json
import sys
import types

import pytest
import verifiers as vf
from datasets import Dataset

from flywheel.agent import Harness, Limits
from flywheel.contract import ToolError
from flywheel.envs.verifiers import VerifiersEnv, from_verifiers
from flywheel.policies.base import Completion

CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Peru": "Lima"}


def exact_answer(completion, answer) -> float:
    """1 when the last message is exactly the answer."""
    return float((completion[-1].content or "").strip() == answer)


def short(completion) -> float:
    """A small bonus for a short final answer."""
    return float(len(completion[-1].content or "") <= 10)


def capital_of(country: str) -> str:
    """Look up the capital city of a country.

    Args:
        country: the country's English name
    """
    if country not in CAPITALS:
        raise KeyError(f"no such country: {country}")
    return CAPITALS[country]


def load_environment(tools: bool = True, **kwargs) -> vf.Environment:
    """A tiny verifiers environment: name a country's capital (with a lookup tool, or from memory)."""
    dataset = Dataset.from_list([{"question": f"What is the capital of {country}?", "answer": city,
                                  "task": "capitals"} for country, city in CAPITALS.items()])
    rubric = vf.Rubric(funcs=[exact_answer, short], weights=[1.0, 0.25])
    if tools:
        return vf.ToolEnv(dataset=dataset, tools=[capital_of], rubric=rubric, system_prompt="Answer in one word.",
                          max_turns=4, **kwargs)
    return vf.SingleTurnEnv(dataset=dataset, rubric=rubric, system_prompt="Answer in one word.", **kwargs)


class Scripted:
    """Looks up the country in the question with the tool (when it has tools), then answers with the result."""

    name = "scripted"

    def __init__(self, wrong: bool = False):
        self.wrong = wrong

    def generate(self, conversations, tools, sampling):
        out = []
        for messages in conversations:
            country = messages[-1]["content"].rsplit(" ", 1)[-1].rstrip("?") if messages[-1]["role"] == "user" \
                else None
            if tools and country:
                message = {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "x", "type": "function",
                     "function": {"name": "capital_of", "arguments": json.dumps({"country": country})}}]}
            elif tools:
                message = {"role": "assistant", "content": "Atlantis" if self.wrong else messages[-1]["content"]}
            else:
                message = {"role": "assistant", "content": CAPITALS[country]}
            out.append(Completion(message=copy.deepcopy(message)))
        return out


@pytest.fixture(scope="module")
def tool_env() -> VerifiersEnv:
    return VerifiersEnv(load_environment(tools=True), name="capitals")


def test_dataset_tools_and_rubric_come_across(tool_env):
    tasks = list(zip(range(6), tool_env.generate_tasks(seed=1), strict=False))
    assert len({t.task_id for _, t in tasks[:3]}) == 3  # every row once, then again
    task = tasks[0][1]
    assert task.env == "capitals" and task.slice == "capitals"
    assert task.prompt[0] == {"role": "system", "content": "Answer in one word."}
    assert task.prompt[1]["role"] == "user" and task.prompt[1]["content"].startswith("What is the capital of")
    assert [t.task_id for _, t in tasks] == [t.task_id for _, t in zip(range(6), tool_env.generate_tasks(seed=1),
                                                                          strict=False)]
    (schema,) = tool_env.tools()
    assert schema["type"] == "function" and schema["function"]["name"] == "capital_of"
    assert schema["function"]["parameters"]["properties"]["country"]["type"] == "string"
    assert tool_env.call_tool("capital_of", {"country": "Peru"}) == "Lima"
    with pytest.raises(ToolError, match="no such country: Atlantis"):
        tool_env.call_tool("capital_of", {"country": "Atlantis"})
    assert tool_env.counters["tool_errors"] == 1
    # a recorded conversation is traced back to its task
    assert tool_env.task_from_messages(task.prompt + [{"role": "assistant", "content": "x"}]) == task


def test_a_tool_env_runs_in_the_harness_and_its_rubric_scores(tool_env):
    tasks = [t for _, t in zip(range(3), tool_env.generate_tasks(seed=0), strict=False)]
    episodes = Harness(tool_env, Limits(max_turns=4)).run(Scripted(), tasks)
    for episode in episodes:
        city = CAPITALS[episode.task.prompt[-1]["content"].rsplit(" ", 1)[-1].rstrip("?")]
        assert [m["content"] for m in episode.messages if m["role"] == "tool"] == [city]
        assert episode.messages[-1] == {"role": "assistant", "content": city}
        assert episode.reward == 1.0 and episode.passed
        assert episode.breakdown["exact_answer"] == 1.0 and episode.breakdown["short"] == 1.0
        assert episode.breakdown["capital_of_calls"] == 1.0  # the ToolEnv's own call-count metric
    wrong = Harness(tool_env, Limits(max_turns=4)).run(Scripted(wrong=True), tasks)
    for episode in wrong:
        assert episode.breakdown["exact_answer"] == 0.0
        assert episode.reward == pytest.approx(0.25 / 1.25) and not episode.passed  # normalised, under 0.5


def test_a_single_turn_env_through_the_factory(monkeypatch):
    module = types.ModuleType("my_vf_capitals")
    module.load_environment = load_environment
    monkeypatch.setitem(sys.modules, "my_vf_capitals", module)
    env = from_verifiers("my_vf_capitals", args={"tools": False})
    assert env.tools() == [] and env.name == "singleturnenv"
    tasks = [t for _, t in zip(range(3), env.generate_tasks(seed=0), strict=False)]
    episodes = Harness(env, Limits(max_turns=2)).run(Scripted(), tasks)
    assert all(e.turns == 1 and e.reward == 1.0 and e.passed for e in episodes)
    with pytest.raises(ValueError, match="my_vf_capitals has no function load_env"):
        from_verifiers("my_vf_capitals:load_env")
    with pytest.raises(ValueError, match="cannot import no_such_vf_module"):
        from_verifiers("no_such_vf_module")


def test_a_rubric_outside_0_1_is_an_error_naming_the_env():
    def overshoot(completion) -> float:
        return 3.0

    dataset = Dataset.from_list([{"question": "What is the capital of Peru?", "answer": "Lima"}])
    env = VerifiersEnv(vf.SingleTurnEnv(dataset=dataset, rubric=vf.Rubric(funcs=[overshoot])), name="bad")
    task = next(env.generate_tasks(seed=0))
    with pytest.raises(ValueError, match=r"verifiers environment bad: rubric gave reward 3\.0 .*outside \[0, 1\]"):
        env.score(task, task.prompt + [{"role": "assistant", "content": "Lima"}])
