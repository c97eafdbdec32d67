"""The one episode loop: prompt, assistant turn, tool calls, tool results, until the conversation ends (the agent
answers and the environment's user has nothing more to say, or says STOP) or a budget ends it.

An episode's `stop` says how it ended: "answer" (the agent answered and the user had nothing more to say),
"max_turns", "budget" or "error_turns" (cut: the conversation was still going; counted as conversations_cut), or
"user_error" (the simulated user failed: the episode is counted as user_errors and left out of every score, since
it says nothing about the agent).

The harness owns its limits (`Limits`, made once from the pipeline's `environment:` section): the teacher
(synthesis), the RL actor and its monitors, the evaluator, the dry run and serving's loop are all handed one
`Harness` and call its `run`, so the student is trained in the harness it is judged and deployed in, under the
same limits.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from pathlib import Path

from flywheel.contract import STOP, Environment, Task, ToolError, UserError
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
    stop: str = "max_turns"  # "answer" | "max_turns" | "budget" | "error_turns" | "user_error"
    completions: list[Completion] = field(default_factory=list)
    user_error: str = ""  # why the simulated user failed (stop "user_error")

    @property
    def scored(self) -> bool:
        """Whether the score says something about the agent: not when its simulated user failed."""
        return self.stop != "user_error"

    @property
    def tokens(self) -> int:
        """The tokens the agent generated over the episode."""
        return sum(len(c.token_ids) if c.token_ids is not None else int(c.usage.get("completion_tokens", 0))
                   for c in self.completions)


def call_tool(env: Environment, call: dict, timeout_s: float, state: object = None) -> str:
    """Run one tool call in the episode's state with a timeout; every failure becomes text the model sees."""
    fn = call.get("function", {})
    try:
        arguments = json.loads(fn.get("arguments") or "{}")
    except json.JSONDecodeError as err:
        return f"Error: arguments are not valid JSON: {err}"
    if not isinstance(arguments, dict):
        return "Error: arguments must be a JSON object"
    future = _TOOL_POOL.submit(env.call_tool, fn.get("name", ""), arguments, state)
    try:
        return str(future.result(timeout=timeout_s))
    except FutureTimeout:
        env.count("tool_timeouts")
        return f"Error: tool '{fn.get('name')}' timed out after {timeout_s}s"
    except ToolError as err:
        return f"Error: {err}"
    except Exception as err:  # a tool bug must not end the episode or the stage
        return f"Error: tool '{fn.get('name')}' failed: {type(err).__name__}: {err}"


@dataclass(frozen=True)
class Limits:
    """Where an episode is cut, how long a tool may run and whether tool calls are constrained (the defaults are the
    `environment:` section's)."""

    max_turns: int = 4  # assistant messages per episode
    max_tokens: int | None = None  # tokens the agent generates per episode (None: no limit)
    tool_timeout_s: float = 2.0
    max_error_turns: int | None = None  # assistant turns in a row with a malformed tool call (None: no limit)
    # tool calls decoded under a grammar (environment.constrained_tools): every run's Sampling.constrained
    constrained: bool = False

    @classmethod
    def from_config(cls, cfg) -> Limits:
        """The limits of a pipeline's `environment:` section (flywheel.config.EnvironmentConfig)."""
        return cls(max_turns=cfg.max_turns, max_tokens=cfg.max_episode_tokens, tool_timeout_s=cfg.tool_timeout_s,
                   max_error_turns=cfg.max_error_turns, constrained=cfg.constrained_tools)


@dataclass(frozen=True)
class Harness:
    """The one episode loop over an environment, under its limits; pickles (to RL actor processes) as the env does."""

    env: Environment
    limits: Limits = Limits()

    def run(self, policy: Policy, tasks: Sequence[Task], *, samples: int = 1, sampling: Sampling | None = None,
            on_done: Callable[[Episode], None] | None = None) -> list[Episode]:
        """Run `samples` episodes per task, all conversations advancing together (batched); each is scored, and
        on_done called with it, as soon as it ends (progress while the longer ones go on).

        An episode of a failed simulated user is still returned (stop "user_error"), scored but marked: callers
        leave it out (Episode.scored)."""
        env = self.env
        # the harness, not each caller, says whether tool calls are constrained: one setting for every use
        sampling = replace(sampling or Sampling(), constrained=self.limits.constrained)
        episodes = [Episode(task=t, sample=s, messages=[dict(m) for m in t.prompt])
                    for t in tasks for s in range(samples)]
        tools = env.tools()
        # one state per episode, made before its first turn and torn down after its score: never shared
        states = {id(e): env.start(e.task) for e in episodes}
        scored: set[int] = set()

        def ended(episode: Episode) -> None:
            """Score an episode as soon as it ends (its state is final), so on_done counts progress as it goes."""
            scored.add(id(episode))
            if episode.stop in ("max_turns", "budget", "error_turns"):
                env.count("conversations_cut")
            score = env.score(episode.task, episode.messages, states[id(episode)])
            episode.reward, episode.passed, episode.breakdown = score.reward, score.passed, dict(score.breakdown)
            if on_done:
                on_done(episode)

        try:
            _advance(env, policy, episodes, states, tools, sampling, self.limits, ended)
            for episode in episodes:  # a policy that returned without ending one (none here) still gets it scored
                if id(episode) not in scored:
                    ended(episode)
        finally:
            for state in states.values():
                if state is not None:
                    env.finish(state)
        return episodes


def load_harness(cfg, root: str | Path, pipeline: str | None = None) -> Harness:
    """The harness of a pipeline's `environment:` section: its environment (flywheel.envs.load_environment; with
    replay, `pipeline`'s collected tasks) under its limits."""
    from flywheel.envs import load_environment

    return Harness(load_environment(cfg, root, pipeline), Limits.from_config(cfg))


def _advance(env: Environment, policy: Policy, episodes: list[Episode], states: dict, tools: list[dict],
             sampling: Sampling, limits: Limits, ended: Callable[[Episode], None]) -> None:
    """Advance every episode to its end, `ended(episode)` as each ends: in one batch that each conversation goes
    on in after its turns, where the policy can (continues_turns: the hf policy), else one turn at a time, all
    conversations in one policy batch per turn."""
    errors_in_row = {id(e): 0 for e in episodes}

    def most_tokens(active: list[Episode]) -> Sampling:
        """A turn takes at most what is left of its episode's token budget (the longest left of a batch's)."""
        if limits.max_tokens is None:
            return sampling
        left = max(limits.max_tokens - e.tokens for e in active)
        return replace(sampling, max_new_tokens=max(1, min(sampling.max_new_tokens, left)))

    if getattr(policy, "continues_turns", False) and not getattr(policy, "takes_states", False):
        def then(i: int, completion: Completion) -> tuple[list[dict], int] | None:
            episode = episodes[i]
            if not _after_turn(env, episode, completion, states[id(episode)], limits, errors_in_row):
                ended(episode)
                return None
            return episode.messages, most_tokens([episode]).max_new_tokens

        policy.generate([e.messages for e in episodes], tools, most_tokens(episodes), then=then)
        return
    active = list(episodes)
    # the oracle reads the episode state (a model reads only the conversation)
    with_states = getattr(policy, "takes_states", False)
    while active:
        conversations = [e.messages for e in active]
        turn = most_tokens(active)
        completions = (policy.generate(conversations, tools, turn, states=[states[id(e)] for e in active])
                       if with_states else policy.generate(conversations, tools, turn))
        going_on = []
        for episode, completion in zip(active, completions, strict=True):
            if _after_turn(env, episode, completion, states[id(episode)], limits, errors_in_row):
                going_on.append(episode)
            else:
                ended(episode)
        active = going_on


def _after_turn(env: Environment, episode: Episode, completion: Completion, state: object, limits: Limits,
                errors_in_row: dict[int, int]) -> bool:
    """An assistant turn into its episode: its tool calls run, or the error shown, or the user's reply; whether
    the episode goes on (within max_turns, max_error_turns and the token budget; its `stop` says why not)."""
    turn = episode.turns
    episode.turns = turn + 1
    episode.completions.append(completion)
    message = dict(completion.message)
    # ids unique within the conversation; copies, so the policy's own message is left as it was
    calls = [{**call, "id": f"call_{turn}_{i}"} for i, call in enumerate(message.get("tool_calls") or [])]
    if calls:
        message["tool_calls"] = calls
    episode.messages.append(message)
    errors_in_row[id(episode)] = errors_in_row[id(episode)] + 1 if completion.error else 0
    if completion.error:
        episode.messages.append({"role": "user", "content": f"Error: {completion.error}"})
        if limits.max_error_turns is not None and errors_in_row[id(episode)] >= limits.max_error_turns:
            episode.stop = "error_turns"
            return False
    elif calls:
        for call in calls:
            episode.messages.append({"role": "tool", "tool_call_id": call["id"],
                                     "content": call_tool(env, call, limits.tool_timeout_s, state)})
    elif not _user_speaks(env, episode, state):
        return False
    if limits.max_tokens is not None and episode.tokens >= limits.max_tokens:
        episode.stop = "budget"
        return False
    return episode.turns < limits.max_turns  # past it, the episode's stop stays "max_turns"


def _user_speaks(env: Environment, episode: Episode, state: object) -> bool:
    """After the agent's answer: the user's next message appended (True), or how the conversation ended."""
    try:
        reply = env.user_turn(episode.task, episode.messages, state)
    except UserError as err:
        env.count("user_errors")
        episode.stop, episode.user_error = "user_error", str(err)
        return False
    if reply is None or STOP in str(reply.get("content") or ""):
        episode.stop = "answer"
        return False
    episode.messages.append(reply)  # the user goes on: the conversation is not over
    return True
