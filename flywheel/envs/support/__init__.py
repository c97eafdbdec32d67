"""The support desk: a stateful customer-service environment in the style of tau-bench's retail domain.

A seeded SQLite database of users, orders, refunds and tickets (db.py); seven typed tools over each episode's
own copy of it (tools.py); requests with the policy as the system prompt, and what the policy makes of each
(tasks.py); a rubric that compares the final database with the expected one, checks the policy and the
answer's facts (rubric.py); a scripted oracle that follows the policy step by step (solver.py).
"""

from __future__ import annotations

import functools
import json
import sqlite3

from flywheel.contract import Task
from flywheel.envs.sdk import Env, Reward
from flywheel.envs.support import db as database
from flywheel.envs.support import multi_turn
from flywheel.envs.support.rubric import db_matches, facts_stated, policy_kept, resolved
from flywheel.envs.support.solver import _text, solve
from flywheel.envs.support.tasks import generate, task_from_text
from flywheel.envs.support.tools import TOOLS

NAME = "support"
MODES = ("single_turn", "multi_turn")


def open_episode(task: Task) -> sqlite3.Connection:
    """The episode's own in-memory copy of the database its task was posed against."""
    return database.fresh(json.loads(task.answer)["db_seed"])


def close_episode(state: sqlite3.Connection) -> None:
    """Drop the episode's database."""
    state.close()


def task_from_messages(messages: list[dict], db_seed: int = 0) -> Task | None:
    """The task behind a recorded support conversation: its first user message, read as a generated one is."""
    first = next((_text(m.get("content")) for m in messages if m.get("role") == "user"), None)
    return task_from_text(first, db_seed, NAME) if first else None


def make_env(db_seed: int = 0, user: dict | None = None, hard_fraction: float = 0.0,
             mode: str = "single_turn") -> Env:
    """The support desk over the database of `db_seed` (tasks, tools, rubric and oracle all read that one).

    `hard_fraction`: the share of generated tasks that are hard (slice "hard": 2-4 requests on different orders in
    one message, 5-12 tool calls; an episode needs environment.max_turns of one more than its calls).
    `user`: a model that plays the customer after each answer (flywheel.envs.users.LLMUser's options: model,
    base_url, api_key_env, ...), from the task's request, until it says ###STOP###; pipelines.yaml:
    `environment: {name: support, args: {user: {model: ..., base_url: ...}}}`. None: the conversation ends at
    the agent's first answer.
    `mode`: "single_turn" (the default: every request whole in the first message) or "multi_turn"
    (multi_turn.py: the first message leaves something out and a scripted customer gives it when asked, changes
    their mind on some tasks and ends with ###STOP###; the rubric scores the whole conversation)."""
    from flywheel.envs.users import LLMUser

    if mode not in MODES:
        raise ValueError(f"environment.args.mode must be one of {', '.join(MODES)}; got {mode!r}")
    if mode == "multi_turn":
        if user or hard_fraction:
            raise ValueError("environment.args: mode multi_turn has its own scripted customer and no hard tasks; "
                             "leave out 'user' and 'hard_fraction'")
        return _multi_turn_env(db_seed)

    if isinstance(hard_fraction, bool) or not isinstance(hard_fraction, (int, float)) or \
            not 0.0 <= hard_fraction < 1.0:
        raise ValueError(f"environment.args.hard_fraction must be a number from 0 (no hard tasks) up to, not "
                         f"including, 1 (the share of generated support tasks that are hard); got {hard_fraction!r}")
    return Env(
        name=NAME,
        tools=TOOLS,
        tasks=functools.partial(generate, db_seed=db_seed, env=NAME, hard_fraction=float(hard_fraction)),
        # the reward is `resolved` alone; the parts are logged beside it (weight 0) to show what went wrong
        rewards=[Reward(resolved, weight=1.0), Reward(db_matches, weight=0.0), Reward(policy_kept, weight=0.0),
                 Reward(facts_stated, weight=0.0)],
        passed=1.0,
        setup=open_episode,
        teardown=close_episode,
        solver=solve,
        task_from_messages=functools.partial(task_from_messages, db_seed=db_seed),
        user=LLMUser(**user) if user else None,
    )


def _multi_turn_env(db_seed: int) -> Env:
    """The desk in multi_turn mode: its tasks, scripted customer, oracle and whole-conversation rubric."""
    return Env(
        name=NAME,
        tools=TOOLS,
        tasks=functools.partial(multi_turn.generate, db_seed=db_seed, env=NAME),
        rewards=[Reward(multi_turn.resolved_conversation, weight=1.0, name="resolved"),
                 Reward(db_matches, weight=0.0), Reward(policy_kept, weight=0.0),
                 Reward(facts_stated, weight=0.0), Reward(multi_turn.asked, weight=0.0)],
        passed=1.0,
        setup=open_episode,
        teardown=close_episode,
        solver=multi_turn.solve,
        task_from_messages=functools.partial(multi_turn.task_from_messages, db_seed=db_seed),
        user=multi_turn.customer,
    )


ENVIRONMENT = make_env
