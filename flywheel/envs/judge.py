"""An LLM-judge reward over the OpenAI protocol: a prompt template in, a strictly parsed `SCORE: x` out.

The requests go through the teacher's client (flywheel/policies/openai.py: concurrency, retries with backoff,
the circuit breaker, the response cache), so a rerun asks nothing twice. A verdict without exactly one
`SCORE: <number in [0, 1]>` line scores 0 and is counted (`judge_unparseable`), never guessed at.
Deterministic rewards stay the default; a judge is for what code cannot check (tone, helpfulness).
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

from flywheel.config import ReplayJudgeConfig
from flywheel.contract import Task
from flywheel.policies.base import Sampling

VERDICT = re.compile(r"^\s*SCORE:\s*([01](?:\.\d+)?|\.\d+)\s*$", re.MULTILINE)


def parse_verdict(text: str) -> float | None:
    """The score of a verdict with exactly one `SCORE: x` line, x in [0, 1]; None otherwise."""
    found = VERDICT.findall(text or "")
    if len(found) != 1:
        return None
    value = float(found[0])
    return value if 0.0 <= value <= 1.0 else None


def render(template: str, task: Task, messages: list[dict]) -> str:
    """The judge's prompt: `template` with {prompt}, {answer}, {final}, {conversation} filled in ({{ }}: braces)."""
    final = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
    first_user = next((m.get("content") or "" for m in task.prompt if m.get("role") == "user"), "")
    conversation = "\n".join(f"{m.get('role')}: {m.get('content') or ''}"
                             + "".join(f" [call {c['function']['name']}({c['function'].get('arguments', '')})]"
                                       for c in m.get("tool_calls") or []) for m in messages)
    return template.format(prompt=first_user, answer=json.dumps(task.data, ensure_ascii=False), final=final,
                           conversation=conversation)


class JudgeReward:
    """A reward fn(task, messages, state) asking a model for a verdict; counts what it could not parse."""

    def __init__(self, template: str, *, model: str, base_url: str | None = None, api_key_env: str | None = None,
                 name: str = "judge", cache: str | Path | None = None, root: str | Path | None = None,
                 price_input_per_mtok: float = 0.0, price_output_per_mtok: float = 0.0, max_new_tokens: int = 256,
                 **settings):
        """settings: the endpoint's limits (concurrency, timeout_s, max_retries, breaker_failures), with
        ReplayJudgeConfig's defaults; `cache` (none by default) is read from `root`."""
        self.template, self.__name__ = template, name
        self.cfg = ReplayJudgeConfig(model=model, base_url=base_url, api_key_env=api_key_env,
                                     cache=str(cache) if cache else None, **settings)
        self.root = root
        self.prices = (price_input_per_mtok, price_output_per_mtok)
        self.sampling = Sampling(temperature=0.0, max_new_tokens=max_new_tokens)
        self.counters = {"judge_calls": 0, "judge_unparseable": 0, "judge_prompt_tokens": 0,
                         "judge_completion_tokens": 0, "judge_cost_usd": 0.0}
        self._lock = threading.Lock()
        self._client = None
        render(template, Task("t", "", [{"role": "user", "content": ""}], "{}", ""), [])  # a bad field fails now

    @classmethod
    def from_config(cls, template: str, cfg: ReplayJudgeConfig, root: str | Path | None = None) -> JudgeReward:
        """The judge environment.replay.judge describes; its cache path is read from `root`."""
        return cls(template, **cfg.model_dump(exclude={"weight"}), root=root)

    def _policy(self):
        # built on first use, in the process that scores (an RL actor builds its own)
        if self._client is None:
            from flywheel.policies.openai import OpenAIPolicy

            self._client = OpenAIPolicy.from_endpoint(self.cfg, self.root)
        return self._client

    def __call__(self, task: Task, messages: list[dict], state: object = None) -> float:
        """The judged score in [0, 1]; 0 when the verdict cannot be parsed."""
        prompt = render(self.template, task, messages)
        (completion,) = self._policy().generate([[{"role": "user", "content": prompt}]], [], self.sampling)
        value = parse_verdict(completion.message.get("content") or "")
        tokens_in = int(completion.usage.get("prompt_tokens", 0))
        tokens_out = int(completion.usage.get("completion_tokens", 0))
        with self._lock:
            self.counters["judge_calls"] += 1
            self.counters["judge_unparseable"] += value is None
            self.counters["judge_prompt_tokens"] += tokens_in
            self.counters["judge_completion_tokens"] += tokens_out
            self.counters["judge_cost_usd"] += (tokens_in * self.prices[0] + tokens_out * self.prices[1]) / 1e6
        return 0.0 if value is None else value

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_client")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock(), _client=None)


def judge_reward(template: str, *, model: str, base_url: str | None = None, api_key_env: str | None = None,
                 **options) -> JudgeReward:
    """A reward function judged by a model over the OpenAI protocol; `template` uses {prompt}, {answer},
    {final} and {conversation}, and must ask for a last line `SCORE: <0..1>`."""
    return JudgeReward(template, model=model, base_url=base_url, api_key_env=api_key_env, **options)
