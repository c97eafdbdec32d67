"""A verifiers environment (prime-rl's library, pinned 0.3.1, its classic `vf.SingleTurnEnv`/`vf.ToolEnv` API) run
through this project's harness: its dataset becomes tasks, its tools the agent's tools, its rubric the score.

In pipelines.yaml:

    environment:
      factory: "flywheel.envs.verifiers:from_verifiers"
      args: {load: "envs.my_vf_env:load_environment", args: {difficulty: 2}}

`load` names a function returning a `vf.Environment` (a module alone means its `load_environment`, the verifiers
convention). Only the dataset, tools and rubric are used: episodes run in flywheel.agent, not in verifiers'
rollout loop, so the student is trained and judged in the one harness. The rubric's weighted sum is divided by
the total weight of its reward functions (zero-weight metrics stay in the breakdown only), so it lies in [0, 1]
when each reward function does; `passed` is the environment's own `pass_threshold`.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import itertools
import json
import math
import random
from collections.abc import Iterator

from flywheel.contract import Environment, Score, Task, ToolError, prompt_hash


class VerifiersEnv(Environment):
    """The harness's Environment over a verifiers SingleTurnEnv or ToolEnv (stateless: state is always None, and
    there is no scripted solver: the oracle teacher cannot run in it)."""

    def __init__(self, vf_env, name: str | None = None, split: str = "train"):
        import verifiers as vf

        if not isinstance(vf_env, vf.Environment):
            raise TypeError(f"expected a verifiers Environment, got {type(vf_env).__name__}")
        if isinstance(vf_env, vf.StatefulToolEnv):
            # its tools take arguments injected from verifiers' own rollout state, which this harness has not got
            raise TypeError(f"{type(vf_env).__name__} is a StatefulToolEnv: not supported; use a ToolEnv, or "
                            "flywheel.envs.sdk.Env with setup() for per-episode state")
        self.vf_env = vf_env
        self.name = name or vf_env.env_id or type(vf_env).__name__.lower()
        dataset = vf_env.get_dataset() if split == "train" else vf_env.get_eval_dataset()
        if dataset is None or len(dataset) == 0:
            raise ValueError(f"verifiers environment {self.name} has no {split} dataset")
        self._rows = [dict(row) for row in dataset]
        self._tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                         "parameters": dict(t.parameters)}}
                       for t in (vf_env.tool_defs or [])]
        self._by_hash = {}
        for index, row in enumerate(self._rows):
            self._by_hash.setdefault(prompt_hash(_prompt(row)), index)

    def _init_runtime(self) -> None:
        super()._init_runtime()
        self._counts = {"tool_errors": 0}

    def tools(self) -> list[dict]:
        """The verifiers environment's tools as OpenAI function schemas (none for a SingleTurnEnv)."""
        return copy.deepcopy(self._tools)

    def generate_tasks(self, seed: int) -> Iterator[Task]:
        """The dataset's rows in a seeded order, passing over them again when they run out (endless)."""
        order = list(range(len(self._rows)))
        random.Random(seed).shuffle(order)
        for index in itertools.cycle(order):
            yield self._task(index)

    def task_from_messages(self, messages: list[dict]) -> Task | None:
        """The dataset row whose prompt starts this conversation, if any."""
        for cut in range(len(messages), 0, -1):
            index = self._by_hash.get(prompt_hash(messages[:cut]))
            if index is not None:
                return self._task(index)
        return None

    def call_tool(self, name: str, arguments: dict, state: object = None) -> str:
        """Run the verifiers tool; its exception is a ToolError worded by the environment's error_formatter."""
        tool = getattr(self.vf_env, "tool_map", {}).get(name)
        if tool is None:
            raise ToolError(f"unknown tool '{name}' (tools: {', '.join(t['function']['name'] for t in self._tools)})")
        try:
            result = tool(**arguments)
            if asyncio.iscoroutine(result):
                result = asyncio.run(result)
        except Exception as err:
            self.count("tool_errors")
            raise ToolError(self.vf_env.error_formatter(err)) from err
        return result if isinstance(result, str) else str(result)

    def score(self, task: Task, messages: list[dict], state: object = None) -> Score:
        """The verifiers rubric on the conversation, its weighted sum normalised into [0, 1]."""
        from verifiers.types import State
        from verifiers.utils.message_utils import normalize_messages

        row = copy.deepcopy(self._rows[json.loads(task.answer)["row"]])
        prompt = task.prompt
        vf_state = State(input=row)
        vf_state["prompt"] = normalize_messages(prompt, field_name="prompt")
        vf_state["completion"] = normalize_messages(messages[len(prompt):], field_name="completion")
        vf_state.update(trajectory=[], reward=None, metrics=None, error=None, tool_defs=[])
        asyncio.run(self.vf_env.rubric.score_rollout(vf_state))
        total = _total_weight(self.vf_env.rubric)
        raw = float(vf_state["reward"] or 0.0)
        reward = raw / total if total > 0 else raw
        if math.isnan(reward) or not 0.0 <= reward <= 1.0:
            raise ValueError(f"verifiers environment {self.name}: rubric gave reward {raw} (normalised {reward}) "
                             f"for task {task.task_id}, outside [0, 1]; check its reward functions and weights")
        breakdown = {key: float(value) for key, value in (vf_state["metrics"] or {}).items()}
        return Score(reward=reward, passed=reward >= self.vf_env.pass_threshold, breakdown=breakdown)

    def _task(self, index: int) -> Task:
        row = self._rows[index]
        prompt = _prompt(row)
        answer = {"row": index, "answer": row.get("answer"), "info": row.get("info")}
        return Task(task_id=prompt_hash(prompt), env=self.name, prompt=prompt,
                    answer=json.dumps(answer, ensure_ascii=False, default=str),
                    slice=str(row.get("task") or "verifiers"))


def from_verifiers(load: str, args: dict | None = None, name: str | None = None, split: str = "train") -> VerifiersEnv:
    """The factory for pipelines.yaml: `load` is "module:function" or a module with `load_environment`."""
    module_name, _, function_name = load.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"verifiers environment '{load}': cannot import {module_name}: {err}") from err
    function_name = function_name or "load_environment"
    loader = getattr(module, function_name, None)
    if loader is None:
        raise ValueError(f"verifiers environment '{load}': {module_name} has no function {function_name}")
    return VerifiersEnv(loader(**(args or {})), name=name, split=split)


def _prompt(row: dict) -> list[dict]:
    """A dataset row's prompt as plain chat messages (Arrow fills absent keys with None: dropped)."""
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{k: v for k, v in dict(m).items() if v is not None} for m in prompt]


def _total_weight(rubric) -> float:
    """The most a rubric's weighted sum can reach when each reward function gives at most 1."""
    if hasattr(rubric, "rubrics"):  # a RubricGroup sums its members
        return sum(_total_weight(r) for r in rubric.rubrics)
    return sum(w for f, w in zip(rubric.funcs, rubric.weights, strict=False)
               if w > 0 and not rubric._is_group_func(f))
