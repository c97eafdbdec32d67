"""The openai policy against a real OpenAI-compatible HTTP server (the calculator oracle) that misbehaves on cue."""

from __future__ import annotations

import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from itertools import islice

import pytest

from flywheel.agent import Harness, Limits
from flywheel.envs.calculator import CalculatorEnv
from flywheel.policies import get_policy
from flywheel.policies.base import Sampling
from flywheel.policies.cache import ResponseCache, sample_indexes
from flywheel.policies.openai import OpenAIPolicy, TeacherError, _retry_after_s

ENV = CalculatorEnv()


def tasks(n: int) -> list:
    return list(islice(ENV.generate_tasks(0), n))


def policy(server, **options) -> OpenAIPolicy:
    """Short timeouts and backoffs: the faults below must cost tests fractions of a second."""
    settings = {"concurrency": 4, "timeout_s": 1.0, "backoff_s": 0.02, "max_backoff_s": 0.2} | options
    return OpenAIPolicy("oracle", server.url, **settings)


@pytest.mark.parametrize("mode", ["tools", "text"])
def test_episodes_through_the_protocol(openai_server, mode):
    openai_server.mode = mode  # "text": a model served without a tool parser writes <tool_call> in its text
    teacher = policy(openai_server)
    episodes = Harness(ENV).run(teacher, tasks(6))
    assert all(e.passed and e.turns == 2 for e in episodes)
    assert episodes[0].messages[1]["tool_calls"][0]["function"]["name"] == "calculator"
    first = episodes[0].completions[0]
    assert first.usage["prompt_tokens"] > 0 and first.usage["completion_tokens"] > 0 and first.latency_s > 0
    assert first.text.startswith("<tool_call>")
    assert teacher.stats["requests"] == teacher.stats["answers"] == 12


@pytest.mark.parametrize("mode", ["tools", "text"])
def test_malformed_tool_call_json_is_shown_to_the_model(openai_server, mode):
    openai_server.mode = mode
    openai_server.inject("malformed")
    (episode,) = Harness(ENV).run(policy(openai_server), tasks(1))
    assert "not valid JSON" in episode.completions[0].error
    assert "tool_calls" not in episode.messages[1]  # an unanswered call would make the next request invalid
    feedback = episode.messages[2]
    assert feedback["role"] == "user" and feedback["content"].startswith("Error: tool call 0 is not valid JSON")
    assert episode.passed and episode.turns == 3


def test_faults_are_retried_and_no_sample_is_lost_or_duplicated(openai_server):
    openai_server.inject("429", "500", "hang", "drop", "500", "drop")
    teacher = policy(openai_server)
    episodes = Harness(ENV).run(teacher, tasks(10), samples=2, sampling=Sampling(temperature=1.0, seed=0))
    assert len(episodes) == 20 and all(e.passed and e.turns == 2 for e in episodes)
    assert openai_server.seen_faults == Counter({"500": 2, "drop": 2, "429": 1, "hang": 1})
    stats = teacher.stats
    faults = (stats["rate_limited"], stats["server_errors"], stats["timeouts"], stats["connection_errors"])
    assert faults == (1, 2, 1, 2)
    assert stats["retries"] == 6 and stats["answers"] == 40
    # every distinct request answered exactly once: none lost, none sent again after it was answered
    assert openai_server.answers == 40 and set(openai_server.answered.values()) == {1}


def test_retry_after_is_honoured(openai_server):
    openai_server.retry_after = "1"
    openai_server.inject("429")
    started = time.monotonic()
    (episode,) = Harness(ENV, Limits(max_turns=1)).run(policy(openai_server), tasks(1))
    assert time.monotonic() - started >= 1.0
    assert episode.messages[1]["tool_calls"]


def test_retry_after_forms():
    assert _retry_after_s({"retry-after": "2"}) == 2.0
    assert _retry_after_s({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    # an HTTP date has whole seconds: the wait is that moment less the clock at the call, whatever the load
    when = (datetime.now(UTC) + timedelta(seconds=30)).replace(microsecond=0)
    before = datetime.now(UTC)
    wait = _retry_after_s({"retry-after": format_datetime(when, usegmt=True)})
    after = datetime.now(UTC)
    assert (when - after).total_seconds() <= wait <= (when - before).total_seconds()
    assert _retry_after_s({"retry-after": "soon"}) is None and _retry_after_s({}) is None


def test_circuit_breaker_stops_a_dead_endpoint_fast(openai_server):
    openai_server.stop()  # nothing listens on the port any more
    teacher = policy(openai_server, backoff_s=0.5, max_backoff_s=5.0, max_retries=6, breaker_failures=5)
    with pytest.raises(TeacherError, match=r"looks down: 5 attempts in a row failed .* connection failed"):
        teacher.generate([t.prompt for t in tasks(20)], ENV.tools(), Sampling())
    # without the breaker: 20 requests x 7 attempts (140), with up to ~30 s of backoff each; counted, not timed
    # (timings are in benchmarks/, where a loaded machine cannot fail a test)
    # requests still in flight when the breaker trips are cancelled, not failed: they count as requests only
    assert 5 <= teacher.stats["connection_errors"] <= teacher.stats["requests"] <= 8, teacher.stats


def test_an_open_breaker_does_not_wait_for_requests_still_hanging(openai_server):
    openai_server.hang_s = 30.0
    openai_server.inject("hang", *["500"] * 10)
    teacher = policy(openai_server, timeout_s=30.0, breaker_failures=3)
    with pytest.raises(TeacherError, match="3 attempts in a row failed .* HTTP 500"):
        teacher.generate([t.prompt for t in tasks(4)], ENV.tools(), Sampling())
    # the hanging request was cancelled when the breaker opened: waited out (30 s), it would end as a timeout
    # or as the server's late 504, one more error
    assert teacher.stats["timeouts"] == 0 and teacher.stats["server_errors"] == 3
    assert openai_server.seen_faults["hang"] == 1


def test_a_refused_key_stops_with_a_clear_error_that_hides_the_key(openai_server, monkeypatch):
    right, wrong = "sk-right-0123456789abcdef", "sk-wrong-0123456789abcdef"
    openai_server.api_key = right
    monkeypatch.setenv("FLYWHEEL_TEST_TEACHER_KEY", wrong)
    teacher = policy(openai_server, api_key_env="FLYWHEEL_TEST_TEACHER_KEY")
    with pytest.raises(TeacherError, match=r"refused the key in \$FLYWHEEL_TEST_TEACHER_KEY \(HTTP 401\)") as err:
        teacher.generate([t.prompt for t in tasks(12)], ENV.tools(), Sampling())
    assert wrong not in str(err.value) and wrong not in repr(teacher)
    assert teacher.stats["requests"] <= 4 and teacher.stats["retries"] == 0  # fails fast: no retrying a 401

    monkeypatch.setenv("FLYWHEEL_TEST_TEACHER_KEY", right)
    (episode,) = Harness(ENV).run(policy(openai_server, api_key_env="FLYWHEEL_TEST_TEACHER_KEY"), tasks(1))
    assert episode.passed

    monkeypatch.delenv("FLYWHEEL_TEST_TEACHER_KEY")
    with pytest.raises(TeacherError, match=r"\$FLYWHEEL_TEST_TEACHER_KEY, which is not set"):
        policy(openai_server, api_key_env="FLYWHEEL_TEST_TEACHER_KEY")


def test_cache_replays_without_calls_and_keeps_samples_apart(openai_server, tmp_path):
    cache = tmp_path / "cache.sqlite"
    sampling = Sampling(temperature=1.0, seed=7)
    first = Harness(ENV).run(policy(openai_server, cache=cache), tasks(4), samples=3, sampling=sampling)
    assert len(openai_server.received) == 24 and len(ResponseCache(cache)) == 24
    # the 3 samples of a task are 3 requests with 3 seeds, not one answer copied 3 times
    assert Counter(body["seed"] for body in openai_server.received) == {7: 8, 8: 8, 9: 8}

    replay = policy(openai_server, cache=cache)
    again = Harness(ENV).run(replay, tasks(4), samples=3, sampling=sampling)
    assert len(openai_server.received) == 24 and replay.stats["cache_hits"] == 24 and replay.stats["requests"] == 0
    assert [e.messages for e in again] == [e.messages for e in first]
    assert [c.latency_s for e in again for c in e.completions] == [c.latency_s for e in first for c in e.completions]


def test_tool_choice_goes_to_the_endpoint_and_answers_cached_before_it_existed_are_found(openai_server, tmp_path):
    import dataclasses

    from flywheel.policies.cache import request_key

    conversation, tools = tasks(1)[0].prompt, ENV.tools()
    cache = ResponseCache(tmp_path / "cache.sqlite")
    # an answer cached by a version whose Sampling had neither tool_choice nor constrained
    before = {k: v for k, v in dataclasses.asdict(Sampling()).items() if k not in ("tool_choice", "constrained")}
    record = {"response": {"choices": [{"message": {"role": "assistant", "content": "from the cache"}}]},
              "latency_s": 0.0}
    cache.put(request_key("oracle", conversation, tools, before, 0), "oracle", record)
    cached = policy(openai_server, cache=cache)
    for sampling in (Sampling(), Sampling(constrained=True)):  # the switch is this side's: the same answer
        assert cached.generate([conversation], tools, sampling)[0].message["content"] == "from the cache"
    assert openai_server.received == []
    named = {"type": "function", "function": {"name": "calculator"}}
    cached.generate([conversation], tools, Sampling(tool_choice=named))  # another request: sent, with its choice
    cached.generate([conversation], [], Sampling(tool_choice="none"))  # no tools: no tool_choice either
    assert [body.get("tool_choice") for body in openai_server.received] == [named, None]


def test_an_endpoint_that_dies_half_way_loses_nothing_and_resends_nothing(openai_server, tmp_path):
    cache = tmp_path / "cache.sqlite"
    openai_server.down_after = 10  # then every request has its connection dropped
    with pytest.raises(TeacherError, match="looks down") as err:
        Harness(ENV).run(policy(openai_server, cache=cache, breaker_failures=4), tasks(12))
    assert f"cached in {cache}" in str(err.value)
    assert openai_server.answers == 10 and len(ResponseCache(cache)) == 10

    openai_server.down_after = None
    episodes = Harness(ENV).run(policy(openai_server, cache=cache), tasks(12))
    assert all(e.passed for e in episodes)
    assert openai_server.answers == 24 and set(openai_server.answered.values()) == {1}


def test_sample_indexes_count_identical_conversations():
    a, b = [{"role": "user", "content": "1 + 1"}], [{"role": "user", "content": "2 + 2"}]
    assert sample_indexes([a, a, b, a, b]) == [0, 1, 0, 2, 1]


def test_vllm_policy_is_lazy_and_names_what_it_needs():
    # no CUDA here: the policy says so before it would import vLLM (where CUDA is, a missing vLLM names the extra)
    with pytest.raises((ImportError, RuntimeError), match="CUDA GPU only|GPU host"):
        get_policy("vllm", model="any")


def _teacher(cfg, root):
    from tasks.synthesize import build_teacher

    return build_teacher(cfg, ENV, root)


def _user(cfg, root):
    from flywheel.envs.users import LLMUser

    return LLMUser.from_config(cfg, root)._policy()


def _judge(cfg, root):
    from flywheel.envs.judge import JudgeReward

    return JudgeReward.from_config("Answer: {final}\nSCORE: <0..1>", cfg, root)._policy()


def _reference(cfg, root):
    from flywheel.evaluate.arms import reference_arm

    return reference_arm(cfg, root).make()


def _opd_teacher(cfg, root):
    from flywheel.train.rl.teacher import ServerTeacher

    return ServerTeacher(cfg).client


# Each endpoint section, the code that builds its client, and the client's limits when the section sets none
# (concurrency, timeout_s, max_retries, breaker_failures): the values each of them had before EndpointConfig.
ENDPOINTS = {
    "teacher": ("TeacherConfig", {"policy": "openai", "model": "m"}, _teacher, (16, 120.0, 6, 10)),
    "environment.user": ("UserConfig", {"kind": "openai", "model": "m"}, _user, (8, 60.0, 4, 10)),
    "environment.replay.judge": ("ReplayJudgeConfig", {"model": "m"}, _judge, (4, 60.0, 6, 10)),
    "evaluate.references": ("ReferenceConfig", {"name": "ref", "model": "m"}, _reference, (16, 120.0, 6, 10)),
    "rl.opd": ("OPDConfig", {"teacher": "m"}, _opd_teacher, (16, 120.0, 6, 10)),
}


@pytest.mark.parametrize("section", ENDPOINTS)
def test_every_endpoint_section_builds_its_client_from_its_own_settings(section, tmp_path, monkeypatch):
    import flywheel.config

    name, required, build, defaults = ENDPOINTS[section]
    cls = getattr(flywheel.config, name)
    default = build(cls(**required), tmp_path)
    assert (default.concurrency, default.timeout_s, default.max_retries, default.breaker_failures) == defaults
    assert default.model == "m" and default.base_url is None and default.section == section
    default.close()

    monkeypatch.setenv("ENDPOINT_TEST_KEY", "sk-endpoint-test-0123456789")
    settings = {"base_url": "http://127.0.0.1:9/v1", "api_key_env": "ENDPOINT_TEST_KEY", "concurrency": 3,
                "timeout_s": 7.5, "max_retries": 2, "breaker_failures": 5}
    has_cache = "cache" in cls.model_fields
    client = build(cls(**required, **settings, **({"cache": "caches/c.sqlite"} if has_cache else {})), tmp_path)
    assert {key: getattr(client, key) for key in settings} == settings
    assert client._api_key == "sk-endpoint-test-0123456789"
    cache = client.cache.path if client.cache is not None else None
    assert cache == (tmp_path / "caches/c.sqlite" if has_cache else None)
    client.close()
