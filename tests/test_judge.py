"""The LLM-judge reward against the real test OpenAI server: template in, strict verdict out, misses counted."""

from __future__ import annotations

import pytest

from flywheel.envs.judge import judge_reward, parse_verdict
from flywheel.envs.sdk import Env, Reward, Task

TEMPLATE = "Question: {prompt}\nExpected: {answer}\nAnswer: {final}\nEnd with a line SCORE: <0..1>."


@pytest.mark.parametrize("text, value", [("ok\nSCORE: 1", 1.0), ("SCORE: 0.25", 0.25), ("SCORE:0", 0.0),
                                         ("score: 1", None), ("SCORE: 1.5", None), ("SCORE: 1\nSCORE: 0", None),
                                         ("I'd say 0.8", None), ("", None)])
def test_verdicts_are_parsed_strictly(text, value):
    assert parse_verdict(text) == value


def test_judge_reward_over_the_protocol(openai_server, tmp_path):
    def judge(messages):
        prompt = messages[-1]["content"]
        if "Answer: 4" in prompt and '"value": 4' in prompt:
            return "Right.\nSCORE: 1"
        return "Wrong.\nSCORE: 0" if "Answer: 5" in prompt else "hmm, maybe"

    openai_server.judge = judge
    reward = judge_reward(TEMPLATE, model="judge", base_url=openai_server.url, cache=tmp_path / "judge.sqlite",
                          timeout_s=2.0, price_input_per_mtok=1.0, price_output_per_mtok=2.0)
    env = Env("judged", tools=[], tasks=lambda seed: iter(()), rewards=[Reward(reward, name="judge")])
    task = Task("t", "judged", [{"role": "user", "content": "2 + 2?"}], '{"value": 4}', "all")
    scores = [env.score(task, task.prompt + [{"role": "assistant", "content": text}]).reward
              for text in ["4", "5", "four", "4"]]
    assert scores == [1.0, 0.0, 0.0, 1.0]
    counters = env.counters
    assert counters["judge_unparseable"] == 1 and counters["judge_calls"] == 4
    assert openai_server.answers == 3  # the repeated question came from the response cache
    assert counters["judge_cost_usd"] > 0 and counters["judge_prompt_tokens"] > 0
