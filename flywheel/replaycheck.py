"""Whether replay's rubric scores the recorded accepted conversations as successes, and less than that when
they are changed: `flywheel check --solve` on a replay pipeline, and a sample at the end of collect.

The recorded accepted conversations are replay's natural solver: said turn by turn through the one harness, with
the recorded user, each must pass its own rubric. Beside them: the null policy (an empty answer, no calls), an
id-only policy (asks for the user's id, never acts), and two perturbations of each recorded conversation that
requires a write: the last required write dropped, and one checked argument of it changed. A rubric that scores
a perturbation as high as the conversation it came from rewards doing less (or anything): RL finds that first.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from flywheel.agent import Episode, Harness
from flywheel.contract import Task, opening, prompt_excerpt, prompt_hash
from flywheel.data.catalog import Catalog
from flywheel.policies.base import Completion

RECORDED_TARGET = 0.95  # the share of recorded accepted conversations that must pass their own rubric
ASK_ID = "Could you give me your user id, please?"
SHOWN = 5


def conversation_key(messages: list[dict]) -> str:
    """The id replay gives a conversation's task: the prompt hash of its opening with the run of user messages
    that may follow the first (record.read_record's prompt)."""
    start = opening(messages)
    if start is None:
        raise ValueError("the conversation has no user message, so no prompt to hash")
    end = len(start)
    while end < len(messages) and messages[end].get("role") == "user":
        end += 1
    return prompt_hash(messages[:end])


def recorded_conversations(root: Path, pipeline: str) -> dict[str, list[dict]] | None:
    """The accepted conversations of a pipeline's traces table, by the id of the task replay makes of each;
    None before collect wrote the table."""
    import pyarrow.parquet as pq

    path = Catalog(Path(root), pipeline).table_path("traces")
    if not path.exists():
        return None
    found: dict[str, list[list[dict]]] = {}
    for row in pq.read_table(path, columns=["messages", "outcome"]).to_pylist():
        if row["outcome"] == "accepted":
            messages = json.loads(row["messages"])
            try:
                found.setdefault(conversation_key(messages), []).append(messages)
            except ValueError:
                continue
    tasks = Catalog(Path(root), pipeline).table_path("tasks")
    shared = {key for key, each in found.items() if len(each) > 1}
    if shared and tasks.exists():  # one opening, several conversations: the one the task was made of
        for row in pq.read_table(tasks, columns=["task_id", "env", "answer"]).to_pylist():
            if row["task_id"] in shared and row["env"] == "replay":
                found[row["task_id"]].sort(key=lambda messages: not _made_of(messages, json.loads(row["answer"])))
    return {key: each[0] for key, each in found.items()}


def _made_of(messages: list[dict], data: dict) -> bool:
    """Whether a replay task's data (its answer's JSON) was made of this conversation: the same calls and answers
    (collect makes one task per opening, of the first conversation that has something to check)."""
    from flywheel.envs.replay.record import UnusableRecord, read_record

    try:
        record = read_record(messages, whole=bool(data.get("whole", True)))
    except UnusableRecord:
        return False
    calls = [[c.name, c.arguments, c.result] for c in record.calls]
    return record.answers == data.get("answers") and json.loads(json.dumps(calls)) == data.get("calls")


class Recorded:
    """Says, turn by turn, what the recorded agent said in the conversation the prompt opens (edited by a
    perturbation); "Goodbye." once its turns run out."""

    def __init__(self, conversations: dict[str, list[dict]]):
        self.turns = {key: [m for m in messages if m["role"] == "assistant"] for key, messages in conversations.items()}

    def generate(self, conversations, tools, sampling, **_) -> list[Completion]:
        out = []
        for messages in conversations:
            turns = self.turns.get(conversation_key(messages), [])
            done = sum(m["role"] == "assistant" for m in messages)
            out.append(Completion(message=dict(turns[done]) if done < len(turns) else
                                  {"role": "assistant", "content": "Goodbye."}))
        return out


class Says:
    """Answers every turn with one text and never calls a tool (the null policy says nothing)."""

    def __init__(self, text: str):
        self.text = text

    def generate(self, conversations, tools, sampling, **_) -> list[Completion]:
        return [Completion(message={"role": "assistant", "content": self.text}) for _ in conversations]


def _last_required(env, task: Task, messages: list[dict]) -> tuple[int, int, dict] | None:
    """(message index, call index, arguments) of the last call that makes one of the task's required writes."""
    required = env.agreement(task).required
    if not required:
        return None
    names = {w.name for w in required}
    for i in range(len(messages) - 1, len(task.prompt) - 1, -1):
        calls = messages[i].get("tool_calls") or []
        for j in range(len(calls) - 1, -1, -1):
            fn = calls[j].get("function") or {}
            if fn.get("name") in names:
                return i, j, json.loads(fn.get("arguments") or "{}")
    return None


def drop_last_write(env, task: Task, messages: list[dict]) -> list[dict] | None:
    """The conversation without its last required write (and that call's result); None without one."""
    found = _last_required(env, task, messages)
    if found is None:
        return None
    i, j, _ = found
    out = copy.deepcopy(messages)
    call = out[i]["tool_calls"].pop(j)
    # its result: the first tool message after it with its id (agents reuse ids from turn to turn)
    k = next((k for k in range(i + 1, len(out)) if out[k].get("role") == "tool"
              and out[k].get("tool_call_id") == call.get("id")), None)
    if k is not None:
        del out[k]
    if not out[i]["tool_calls"]:
        del out[i]["tool_calls"]
        if not out[i].get("content"):
            del out[i]
    return out


def change_argument(env, task: Task, messages: list[dict]) -> tuple[list[dict], str] | None:
    """The conversation with one checked argument of its last required write changed, and which; None when
    that write has no argument the rubric checks."""
    found = _last_required(env, task, messages)
    if found is None:
        return None
    i, j, arguments = found
    name = messages[i]["tool_calls"][j]["function"]["name"]
    wanted = next(w for w in env.agreement(task).required if w.name == name)
    checked = [k for k in env.rules.checked(name, arguments) if k in wanted.arguments]
    if not checked:
        return None
    key = checked[0]
    out = copy.deepcopy(messages)
    out[i]["tool_calls"][j]["function"]["arguments"] = json.dumps({**arguments, key: _other(arguments[key])})
    return out, f"{name}.{key}"


def _other(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 7
    if isinstance(value, list):
        return value[:-1] if value else ["x"]
    if isinstance(value, dict):
        return {**value, "changed": True}
    return f"{value}-x" if value else "x"


@dataclass
class Arm:
    """One policy's episodes over the checked tasks."""

    name: str
    episodes: dict[str, Episode] = field(default_factory=dict)  # task id -> its episode

    @property
    def mean(self) -> float:
        return sum(e.reward for e in self.episodes.values()) / len(self.episodes) if self.episodes else 0.0

    @property
    def passed(self) -> int:
        return sum(e.passed for e in self.episodes.values())


@dataclass
class ReplayCheck:
    """What the replay check found: each arm's episodes, the errors (exit 1) and notes, each naming tasks."""

    tasks: int
    arms: dict[str, Arm]
    errors: list[str] = field(default_factory=list)
    changed: dict[str, str] = field(default_factory=dict)  # task id -> the argument the perturbation changed
    unchanged: list[str] = field(default_factory=list)  # tasks whose write has no checked argument to change


def replayable(env) -> bool:
    """Whether the recorded conversations can be said again here: replay with the recorded user turns (an LLM
    user would answer the recorded agent with other words than the ones it answered)."""
    return hasattr(env, "agreement") and env.user.kind == "replay"


def check_replay(env, harness: Harness, tasks: list[Task], conversations: dict[str, list[dict]],
                 describe: Callable[[Task], str] | None = None) -> ReplayCheck:
    """The recorded conversations, null, id-only and both perturbations over `tasks` (those with a recording)."""
    describe = describe or (lambda t: f"task {t.task_id} ({prompt_excerpt(t.prompt)})")
    tasks = [t for t in tasks if t.task_id in conversations and t.data.get("outcome") == "accepted"]
    longest = max((sum(m["role"] == "assistant" for m in conversations[t.task_id]) for t in tasks), default=1)
    harness = replace(harness, limits=replace(harness.limits, max_turns=max(harness.limits.max_turns, longest + 2)))
    report = ReplayCheck(len(tasks), {})
    dropped, changed = {}, {}
    for task in tasks:
        messages = conversations[task.task_id]
        if (less := drop_last_write(env, task, messages)) is not None:
            dropped[task.task_id] = less
        edit = change_argument(env, task, messages)
        if edit is not None:
            changed[task.task_id], report.changed[task.task_id] = edit
        elif task.task_id in dropped:
            report.unchanged.append(describe(task))
    runs = (("recorded", Recorded(conversations), tasks), ("null", Says(""), tasks), ("id-only", Says(ASK_ID), tasks),
            ("drop-last-write", Recorded(dropped), [t for t in tasks if t.task_id in dropped]),
            ("wrong-argument", Recorded(changed), [t for t in tasks if t.task_id in changed]))
    for name, policy, subset in runs:
        arm = report.arms[name] = Arm(name)
        for episode in harness.run(policy, subset) if subset else []:
            arm.episodes[episode.task.task_id] = episode
    _findings(report, {t.task_id: t for t in tasks}, describe)
    return report


def _parts(episode: Episode) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in episode.breakdown.items()) or f"reward {episode.reward:.2f}"


def _findings(report: ReplayCheck, tasks: dict[str, Task], describe) -> None:
    recorded = report.arms["recorded"]
    if recorded.episodes and recorded.passed / len(recorded.episodes) < RECORDED_TARGET:
        failed = [e for e in recorded.episodes.values() if not e.passed]
        report.errors.append(
            f"the recorded accepted conversations pass their own rubric {recorded.passed} of "
            f"{len(recorded.episodes)} times ({recorded.passed / len(recorded.episodes):.0%}, under "
            f"{RECORDED_TARGET:.0%}): " + "; ".join(f"{describe(e.task)}: {_parts(e)}" for e in failed[:SHOWN])
            + (f"; and {len(failed) - SHOWN} more" if len(failed) > SHOWN else ""))
    for name in ("drop-last-write", "wrong-argument"):
        worse = [e for e in report.arms[name].episodes.values() if task_id_of(e) in recorded.episodes
                 and e.reward >= recorded.episodes[task_id_of(e)].reward]
        if worse:
            report.errors.append(
                f"{name}: {len(worse)} of {len(report.arms[name].episodes)} changed conversations score as high as "
                "the recorded one (the rubric does not see the change): " + "; ".join(
                    f"{describe(e.task)}{_what(report, name, e)}: {_parts(e)}" for e in worse[:SHOWN]))


def task_id_of(episode: Episode) -> str:
    return episode.task.task_id


def _what(report: ReplayCheck, name: str, episode: Episode) -> str:
    return f" ({report.changed[episode.task.task_id]} changed)" if name == "wrong-argument" else ""


def render(report: ReplayCheck) -> list[str]:
    """Each arm's mean reward and passes, as terminal lines."""
    lines = [f"  replay check over {report.tasks} recorded accepted conversations:"]
    for arm in report.arms.values():
        if arm.episodes:
            lines.append(f"    {arm.name + ':':<17} mean reward {arm.mean:.3f}, passes {arm.passed} of "
                         f"{len(arm.episodes)}")
    if report.unchanged:
        lines.append(f"    {len(report.unchanged)} task(s) whose last write has no argument the rubric checks, "
                     f"e.g. {report.unchanged[0]}")
    return lines


def summary(report: ReplayCheck) -> dict:
    """The figures as one JSON-able dict: each arm's tasks, mean reward and pass rate; for a perturbation, on how
    many tasks it scored at or above the recorded conversation it came from (the target: none)."""
    recorded = report.arms["recorded"].episodes
    out = {}
    for arm in report.arms.values():
        out[arm.name] = {"tasks": len(arm.episodes), "reward_mean": round(arm.mean, 4),
                         "pass_rate": round(arm.passed / len(arm.episodes), 4) if arm.episodes else None}
        if arm.name in ("drop-last-write", "wrong-argument"):
            out[arm.name]["at_or_above_recorded"] = sum(
                e.reward >= recorded[t].reward for t, e in arm.episodes.items() if t in recorded)
    return out


COLLECT_SAMPLE = 20  # recorded conversations the collect stage replays (seeded): a warning, not a failure


def collect_findings(env, harness: Harness, tasks: list[Task], conversations: dict[str, list[dict]],
                     sample: int = COLLECT_SAMPLE, seed: int = 0) -> tuple[int, list[str]]:
    """At the end of collect: how many replay tasks' labels their rewarded conversation contradicts, and the
    warnings (those, then the replay check over a seeded sample of the recorded accepted conversations)."""
    import random

    env.use_tasks(tasks)
    replayed = [t for t in tasks if t.env == "replay" and t.data.get("outcome") == "accepted"]
    disputed = [(t, env.agreement(t).disputes) for t in replayed]
    disputed = [(t, d) for t, d in disputed if d]
    warnings = []
    if disputed:
        examples = "; ".join(f"task {t.task_id} ({prompt_excerpt(t.prompt)}): {', '.join(d)}" for t, d in disputed[:3])
        warnings.append(f"{len(disputed)} of {len(replayed)} rewarded conversations contradict their expected actions "
                        f"(each scored by what the two agree on), e.g. {examples}")
    chosen = [t for t in replayed if t.task_id in conversations] if replayable(env) else []
    chosen = chosen if len(chosen) <= sample else random.Random(seed).sample(chosen, sample)
    if chosen:
        report = check_replay(env, harness, chosen, conversations)
        warnings += [f"replay check on {len(chosen)} recorded conversations (`flywheel check --solve` checks them "
                     f"all): {e}" for e in report.errors]
    return len(disputed), warnings
