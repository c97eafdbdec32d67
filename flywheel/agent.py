"""The one episode loop: prompt, assistant turn, tool calls, tool results, until an answer or the turn limit.

The teacher (synthesis), the RL actor and the evaluator all call run_episodes, so the student is trained in
the harness it is judged and deployed in.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from flywheel.envs.base import Environment, Task, ToolError
from flywheel.policies.base import Completion, Policy, Sampling

_TOOL_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tool")


@dataclass
class Episode:
    task: Task
    sample: int
    messages: list[dict]
    reward: float = 0.0
    passed: bool = False
    breakdown: dict[str, float] = field(default_factory=dict)
    turns: int = 0
    stop: str = "max_turns"  # "answer" | "max_turns"
    completions: list[Completion] = field(default_factory=list)


def call_tool(env: Environment, call: dict, timeout_s: float) -> str:
    """Run one tool call with a timeout; every failure becomes text the model sees, never an exception."""
    fn = call.get("function", {})
    try:
        arguments = json.loads(fn.get("arguments") or "{}")
    except json.JSONDecodeError as err:
        return f"Error: arguments are not valid JSON: {err}"
    if not isinstance(arguments, dict):
        return "Error: arguments must be a JSON object"
    future = _TOOL_POOL.submit(env.call_tool, fn.get("name", ""), arguments)
    try:
        return str(future.result(timeout=timeout_s))
    except FutureTimeout:
        return f"Error: tool '{fn.get('name')}' timed out after {timeout_s}s"
    except ToolError as err:
        return f"Error: {err}"
    except Exception as err:  # a tool bug must not end the episode or the stage
        return f"Error: tool '{fn.get('name')}' failed: {type(err).__name__}: {err}"


def run_episodes(env: Environment, policy: Policy, tasks: Sequence[Task], *, samples: int = 1,
                 sampling: Sampling | None = None, max_turns: int = 4, tool_timeout_s: float = 2.0,
                 on_done: Callable[[Episode], None] | None = None) -> list[Episode]:
    """Run `samples` episodes per task, all conversations advancing together one turn at a time (batched)."""
    sampling = sampling or Sampling()
    episodes = [Episode(task=t, sample=s, messages=[dict(m) for m in t.prompt])
                for t in tasks for s in range(samples)]
    tools = env.tools()
    active = list(episodes)
    for turn in range(max_turns):
        if not active:
            break
        completions = policy.generate([e.messages for e in active], tools, sampling)
        still_active = []
        for episode, completion in zip(active, completions, strict=True):
            episode.turns = turn + 1
            episode.completions.append(completion)
            message = dict(completion.message)
            # ids unique within the conversation; copies, so the policy's own message is left as it was
            calls = [{**call, "id": f"call_{turn}_{i}"} for i, call in enumerate(message.get("tool_calls") or [])]
            if calls:
                message["tool_calls"] = calls
            episode.messages.append(message)
            if completion.error:
                episode.messages.append({"role": "user", "content": f"Error: {completion.error}"})
                still_active.append(episode)
            elif calls:
                for call in calls:
                    episode.messages.append({"role": "tool", "tool_call_id": call["id"],
                                             "content": call_tool(env, call, tool_timeout_s)})
                still_active.append(episode)
            else:
                episode.stop = "answer"
        active = still_active
    for episode in episodes:
        score = env.score(episode.task, episode.messages)
        episode.reward, episode.passed, episode.breakdown = score.reward, score.passed, dict(score.breakdown)
        if on_done:
            on_done(episode)
    return episodes
