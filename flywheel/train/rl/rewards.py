"""The seam for a TRL backend later: the environment's rubric as a TRL reward function.

TRL's GRPO trainers call reward functions as `f(prompts, completions, **columns) -> list[float]`, with the
dataset's extra columns as keyword lists. A dataset of tasks with a `task_id` column and this function give
TRL the same reward the actors here and the evaluator use: the rubric, never a copy of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flywheel.envs.base import Environment, Task


def reward_function(env: Environment, tasks: Sequence[Task]) -> Callable[..., list[float]]:
    """A TRL reward function scoring each (prompt, completion) conversation with env.score on its task."""
    by_id = {task.task_id: task for task in tasks}

    def rubric_reward(prompts, completions, task_id, **_columns) -> list[float]:
        missing = sorted(set(task_id) - by_id.keys())
        if missing:
            raise KeyError(f"reward for unknown task_id(s) {missing[:3]}: the dataset and the tasks differ")
        return [env.score(by_id[t], [*prompt, *completion]).reward
                for prompt, completion, t in zip(prompts, completions, task_id, strict=True)]

    rubric_reward.__name__ = f"{env.name}_rubric"  # TRL logs rewards under the function's name
    return rubric_reward
