"""User simulators: the second party of a conversation, who answers the agent until the conversation is over.

After each of the agent's answers (an assistant message without tool calls) the harness asks the environment for
the user's next message (`Environment.user_turn`); None ends the conversation. A simulator is the recorded turns
replayed in order (replay's), a scripted function (the SDK's `Env(user=...)`), or `LLMUser` here: a model over
the OpenAI protocol that plays the customer a scenario text describes. A simulated user ends the conversation by
saying `###STOP###` (contract.STOP), when its goal is done or cannot be done; a message that holds the marker
ends it whatever else it says.

What the LLM user sees is what a customer sees, and nothing more: a system prompt that tells it to play the
customer of the scenario, and the visible conversation with the roles flipped (the agent's visible text as
"user" messages, its own earlier turns as "assistant" ones). Never the agent's system prompt, tool calls, tool
results, the episode's state or the rubric: a user who could read them would hand the agent the answer.

Requests go through the teacher's client (flywheel/policies/openai.py: retries with backoff, the circuit breaker,
the SQLite response cache), sampled greedily with a fixed seed by default, so a rerun asks nothing twice. A
failure after the client's retries is a UserError: the harness leaves that episode out of every score.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

from flywheel.config import UserConfig
from flywheel.contract import STOP, UserError
from flywheel.policies.base import Sampling

__all__ = ["LLMUser", "STOP", "UserError", "visible_conversation", "USER_PROMPT", "SCENARIO_PROMPT"]

# The first line of each prompt is how the test OpenAI server knows what it is asked (tests/openai_server.py).
USER_PROMPT = """You are playing a customer talking to a customer-service agent; you are the customer, never the agent.

Your scenario (who you are, what you want, what you know):
<scenario>
{scenario}
</scenario>

Rules:
- Write one message at a time, as this customer would type it: short, plain text, no lists of everything at once.
- Give the details of the scenario when the agent asks for them or when they are needed, in the scenario's order.
- Never invent facts beyond the scenario (names, ids, numbers, addresses, wishes). If the agent asks for something
  the scenario does not say, say that you do not know it.
- Stay in character: do not do the agent's work for it, and do not mention these instructions.
- When your goal is done, or the agent cannot do it, write {stop} to end the conversation."""

SCENARIO_PROMPT = """You write the instructions for someone who will play a customer in a conversation with a \
customer-service agent.

Below are the customer's own messages from one recorded conversation, in order (the agent's side is left out).
Write the instructions in the second person ("You are ..."): who the customer is, what they want, and the details
they must give (names, ids, numbers, choices, exactly as written), in the order they gave them, and what they say
when asked to confirm. Use only what the messages say. Write the instructions only, as plain text."""

_OPENED_CALL = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)  # closed, or left open at the end


def _text(content) -> str:
    """A message's text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(part.get("text") or "" for part in content if isinstance(part, dict))
    return ""


def visible_conversation(messages: list[dict]) -> list[tuple[str, str]]:
    """(speaker, text) of what both parties saw: "agent" and "user" turns, consecutive ones of a speaker joined.

    Left out: system prompts, tool results, tool calls (structured or written as <tool_call> text), and the
    harness's own "Error: ..." note after an agent turn whose tool call was malformed (a user role message the
    user never wrote)."""
    turns: list[tuple[str, str]] = []
    after_call_text = False
    for message in messages:
        role, text = message.get("role"), _text(message.get("content"))
        if role == "assistant":
            after_call_text = "<tool_call>" in text
            speaker, text = "agent", _OPENED_CALL.sub("", text).strip()
        elif role == "user":
            harness_note = after_call_text and text.startswith("Error: ")
            after_call_text = False
            if harness_note:
                continue
            speaker, text = "user", text.strip()
        else:
            continue
        if not text:
            continue
        if turns and turns[-1][0] == speaker:
            turns[-1] = (speaker, turns[-1][1] + "\n\n" + text)
        else:
            turns.append((speaker, text))
    return turns


class LLMUser:
    """A model over the OpenAI protocol playing the customer of a scenario; counts requests, stops and errors."""

    def __init__(self, model: str, base_url: str | None = None, api_key_env: str | None = None, *,
                 cache: str | Path | None = None, root: str | Path | None = None, seed: int = 0, **settings):
        """settings: UserConfig's (concurrency, timeout_s, max_retries, breaker_failures, temperature,
        max_new_tokens, prices) with its defaults; `cache` (none by default) is read from `root`."""
        if not model:
            raise ValueError("a simulated user needs a model name (environment.user.model)")
        self.cfg = UserConfig(kind="openai", model=model, base_url=base_url, api_key_env=api_key_env,
                              cache=str(cache) if cache else None, **settings)
        self.root = root
        self.sampling = Sampling(temperature=self.cfg.temperature, max_new_tokens=self.cfg.max_new_tokens, seed=seed)
        self.prices = (self.cfg.price_input_per_mtok, self.cfg.price_output_per_mtok)
        self.counters = {"user_requests": 0, "user_failures": 0, "user_stops": 0, "user_scenarios": 0,
                         "user_prompt_tokens": 0, "user_completion_tokens": 0, "user_cost_usd": 0.0}
        self._lock = threading.Lock()
        self._client = None

    @classmethod
    def from_config(cls, cfg: UserConfig, root: str | Path | None = None) -> LLMUser:
        """The simulator a `UserConfig` of kind openai describes; its cache path is read from `root`."""
        if cfg.kind != "openai":
            raise ValueError(f"environment.user.kind is '{cfg.kind}'; an LLM user needs kind 'openai'")
        return cls(**cfg.model_dump(exclude={"kind"}), root=root)

    def __repr__(self) -> str:
        return f"LLMUser(model={self.cfg.model!r}, base_url={self.cfg.base_url!r})"

    # --- the two requests

    def reply(self, scenario: str, messages: list[dict]) -> dict | None:
        """The customer's next message after the agent's answer, or None: the customer ended the conversation."""
        if not (scenario or "").strip():
            self._count(user_failures=1)
            raise UserError("the simulated user has no scenario to play (an empty scenario text)")
        request = [{"role": "system", "content": USER_PROMPT.format(scenario=scenario.strip(), stop=STOP)}]
        for speaker, text in visible_conversation(messages):
            request.append({"role": "assistant" if speaker == "user" else "user", "content": text})
        text = self._ask(request, "reply")
        if STOP in text:
            self._count(user_stops=1)
            return None
        return {"role": "user", "content": text}

    def write_scenario(self, messages: list[dict]) -> str:
        """The scenario of a recorded conversation, written by the model from the customer's messages alone."""
        said = [text for speaker, text in visible_conversation(messages) if speaker == "user"]
        if not said:
            self._count(user_failures=1)
            raise UserError("the recorded conversation has no user message to write a scenario from")
        listed = "\n\n".join(f"Message {i}:\n{text}" for i, text in enumerate(said, 1))
        request = [{"role": "system", "content": SCENARIO_PROMPT}, {"role": "user", "content": listed}]
        scenario = self._ask(request, "scenario").replace(STOP, "").strip()
        self._count(user_scenarios=1)
        return scenario

    def _ask(self, request: list[dict], what: str) -> str:
        from flywheel.policies.openai import TeacherError

        self._count(user_requests=1)
        try:
            (completion,) = self._policy().generate([request], [], self.sampling)
        except TeacherError as err:
            self._count(user_failures=1)
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise UserError(f"the simulated user's model '{self.cfg.model}' wrote no {what}: {reason}") from None
        tokens_in = int(completion.usage.get("prompt_tokens", 0))
        tokens_out = int(completion.usage.get("completion_tokens", 0))
        self._count(user_prompt_tokens=tokens_in, user_completion_tokens=tokens_out,
                    user_cost_usd=(tokens_in * self.prices[0] + tokens_out * self.prices[1]) / 1e6)
        text = (completion.text or "").strip()
        if completion.message.get("tool_calls") or completion.error or "<tool_call>" in text:
            self._count(user_failures=1)
            raise UserError(f"the simulated user's model '{self.cfg.model}' answered with a tool call, not a {what}")
        if not text:
            self._count(user_failures=1)
            raise UserError(f"the simulated user's model '{self.cfg.model}' answered with no text, not a {what}")
        return text

    def _policy(self):
        # built on first use, in the process that runs episodes (an RL actor builds its own)
        with self._lock:
            if self._client is None:
                from flywheel.policies.openai import OpenAIPolicy, TeacherError

                try:
                    self._client = OpenAIPolicy.from_endpoint(self.cfg, self.root)
                except TeacherError as err:  # the key's variable is unset
                    self.counters["user_failures"] += 1
                    raise UserError(f"the simulated user's model cannot be asked: {err}") from None
            return self._client

    def _count(self, **amounts) -> None:
        with self._lock:
            for key, value in amounts.items():
                self.counters[key] += value

    def close(self) -> None:
        """Close the response cache (the client is made again on the next request)."""
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_client")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock(), _client=None)
