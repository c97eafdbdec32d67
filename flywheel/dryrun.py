"""`flywheel check --solve`: an environment's dry run, before anything trains.

Over the tasks collect would draw (each in its split; or a seeded sample of them), the environment's scripted
solver and the null policy (an empty answer, no calls) run through the real harness and rubric. What it tells:
whether the solver solves the tasks (a task it fails is listed with why), what doing nothing scores (a rubric that
rewards it cannot tell a trained model from silence), how each reward part is spread, any reward the rubric must
not give (NaN, outside [0, 1]: an error naming the task's file and row), tool bugs, and the split against what
the config asks. Errors make `flywheel check` exit non-zero, so a user's CI can run it.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from dataclasses import dataclass, field

from flywheel.agent import Episode, Harness
from flywheel.config import PipelineConfig
from flywheel.contract import Environment, RubricError, Task
from flywheel.data.tasksets import own_tasks, short_splits
from flywheel.errors import UserFacingError
from flywheel.policies.null import NullPolicy
from flywheel.policies.oracle import OraclePolicy
from flywheel.replaycheck import ReplayCheck, check_replay, replayable
from flywheel.replaycheck import render as render_replay

NULL_WARNING = 0.2  # a null mean reward above this is a rubric that pays for doing nothing
SHOWN = 5  # tasks listed per finding; the rest are counted
_TOOL_BUG = re.compile(r"Error: tool '[^']*' (failed: |timed out)")  # the harness's text for a tool that broke


@dataclass
class PolicyRun:
    """One policy over the tasks: its scored episodes, and the tasks it could not be scored on and why."""

    name: str
    episodes: list[Episode] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # a reward out of range, a solver or setup that raised
    tool_bugs: list[str] = field(default_factory=list)  # a tool that raised or timed out, with its task
    counters: dict[str, float] = field(default_factory=dict)  # the environment's counts during this run

    @property
    def mean_reward(self) -> float:
        return sum(e.reward for e in self.episodes) / len(self.episodes) if self.episodes else math.nan

    @property
    def passed(self) -> int:
        return sum(e.passed for e in self.episodes)


@dataclass
class DryRun:
    """What `flywheel check --solve` found for one pipeline's environment."""

    pipeline: str
    env: str
    checked: int  # tasks run
    splits: Counter  # every task collect would draw, by split
    asked: dict[str, int]  # what the config asks for, by split (environment.train_tasks, heldout_tasks)
    origin: str  # "own" (the environment's tasks) or "collected" (the pipeline's tasks table)
    solver: PolicyRun | None  # None: the environment has no scripted solver
    null: PolicyRun
    describe: dict[str, str]  # task id -> where the task is (file and row) with its prompt's opening
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    replay: ReplayCheck | None = None  # replay tasks: the recorded conversations and their perturbations


class NoTasksError(UserFacingError, ValueError):
    """The environment has no tasks to dry-run: none of its own, and no collected tasks table yet."""


def dry_run(pipeline: str, cfg: PipelineConfig, harness: Harness, sample: int | None = None,
            seed: int = 0, conversations: dict[str, list[dict]] | None = None) -> DryRun:
    """Run the solver and the null policy in the harness over its environment's tasks (all, or `sample` of them,
    seeded); replay tasks: the recorded accepted `conversations` (by task id) are the solver
    (flywheel/replaycheck.py)."""
    env = harness.env
    tasks = own_tasks(env, cfg.environment, cfg.collect.heldout_fraction)
    origin = "own"
    if not tasks:
        tasks, origin = env.recorded_tasks(), "collected"
    if not tasks:
        raise NoTasksError(f"environment '{env.name}' has no tasks of its own and pipeline '{pipeline}' has no "
                           f"collected tasks yet: run `flywheel stage collect -p {pipeline}` first, then check again")
    splits = Counter(t.split for t in tasks)
    checked = tasks if sample is None or sample >= len(tasks) else random.Random(seed).sample(tasks, sample)
    asked = {"train": cfg.environment.train_tasks, "heldout": cfg.environment.heldout_tasks}
    report = DryRun(pipeline=pipeline, env=env.name, checked=len(checked), splits=splits, asked=asked, origin=origin,
                    solver=None, null=PolicyRun("null"), describe={t.task_id: env.describe_task(t) for t in checked})
    if origin == "own":
        report.warnings += short_splits(env.name, splits, cfg.environment, cfg.collect.heldout_fraction)
    if conversations is not None and replayable(env):
        report.replay = check_replay(env, harness, [t for t in checked if t.env == "replay"], conversations,
                                     lambda t: report.describe[t.task_id])
        report.errors += [f"replay: {e}" for e in report.replay.errors]
    if _has_solver(env, checked[0]):
        report.solver = _run(harness, OraclePolicy(env), "solver", checked, report.describe)
    report.null = _run(harness, NullPolicy(), "null", checked, report.describe)
    _findings(report)
    return report


def _has_solver(env: Environment, task: Task) -> bool:
    state = env.start(task)
    try:
        env.solve([dict(m) for m in task.prompt], state)
    except NotImplementedError:
        return False
    except Exception:  # noqa: BLE001 - it has one; the run below reports what it raises, task by task
        return True
    finally:
        if state is not None:
            env.finish(state)
    return True


def _run(harness: Harness, policy, name: str, tasks: list[Task], describe: dict[str, str]) -> PolicyRun:
    """The policy on each task alone through the harness: one task's broken reward or solver is that task's
    error, and the others still run."""
    run = PolicyRun(name)
    before = harness.env.counters
    for task in tasks:
        where = describe[task.task_id]
        try:
            (episode,) = harness.run(policy, [task])
        except RubricError as err:
            run.errors.append(str(err))
            continue
        except Exception as err:  # noqa: BLE001 - the environment's own code raised: named per task, not a crash
            run.errors.append(f"{where}: the {name} episode raised {type(err).__name__}: {err}")
            continue
        if not episode.scored:
            run.errors.append(f"{where}: the simulated user failed: {episode.user_error}")
            continue
        run.episodes.append(episode)
        for message in episode.messages:
            if message.get("role") == "tool" and _TOOL_BUG.match(str(message.get("content") or "")):
                run.tool_bugs.append(f"{where}: {message['content'].removeprefix('Error: ')}")
    after = harness.env.counters
    run.counters = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return run


def _findings(report: DryRun) -> None:
    """The errors (exit non-zero) and warnings of a dry run, each naming tasks."""
    for run in filter(None, (report.solver, report.null)):
        report.errors += [f"{run.name}: {e}" for e in run.errors]
        if run.tool_bugs:
            report.errors.append(f"{run.name}: {len(run.tool_bugs)} tool call(s) broke (a tool raised or timed out: "
                                 f"a bug in the tool, not the agent's mistake), e.g. " + "; ".join(run.tool_bugs[:3]))
    null = report.null
    paid = [e for e in null.episodes if e.reward > 0]
    if null.episodes and null.mean_reward > NULL_WARNING:
        examples = "; ".join(f"{report.describe[e.task.task_id]}: {_parts(e)}" for e in paid[:3])
        report.warnings.append(
            f"the rubric rewards doing nothing on {len(paid)} of {len(null.episodes)} tasks: an empty answer with "
            f"no tool calls scores a mean reward of {null.mean_reward:.3f} (over {NULL_WARNING}), and passes "
            f"{null.passed}; the gate refuses a model that does not beat it. E.g. {examples}")
    if report.solver is None and report.replay is None:
        report.warnings.append(f"environment '{report.env}' has no scripted solver (Env(solver=...)): only the null "
                               "policy ran, so nothing shows the tasks can be solved")
    elif report.solver is not None and report.solver.episodes and report.solver.passed < len(report.solver.episodes):
        failed = len(report.solver.episodes) - report.solver.passed
        report.warnings.append(f"the solver fails {failed} of {len(report.solver.episodes)} tasks (listed above): "
                               "a task, the solver or the rubric is wrong")


def _parts(episode: Episode) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in episode.breakdown.items()) or f"reward {episode.reward:.2f}"


def why_failed(episode: Episode) -> str:
    """Why a solver's episode did not pass: its reward, the parts under 1, how it ended, the tool errors it met."""
    low = [f"{k} {v:.2f}" for k, v in episode.breakdown.items() if v < 1.0]
    said = [f"reward {episode.reward:.2f}"] + low
    if episode.stop != "answer":
        said.append(f"cut by {episode.stop.replace('_', ' ')} after {episode.turns} turn(s)")
    errors = [m["content"] for m in episode.messages
              if m.get("role") == "tool" and str(m.get("content") or "").startswith("Error:")]
    if errors:
        said.append(f"{len(errors)} tool error(s), first: {errors[0][:100]}")
    return "; ".join(said)


def render(report: DryRun) -> list[str]:
    """The report as terminal lines: the split, the solver, the null policy, the reward parts, then findings."""
    lines = []
    counts = ", ".join(f"{report.splits[s]} {s}" for s in ("train", "heldout"))
    where = "its own" if report.origin == "own" else "the collected tasks table's"
    sampled = f"; {report.checked} sampled" if report.checked < sum(report.splits.values()) else ""
    asked = f"; the config asks {report.asked['train']} and {report.asked['heldout']}" if report.origin == "own" else ""
    lines.append(f"pipeline '{report.pipeline}', environment '{report.env}': {sum(report.splits.values())} of "
                 f"{where} tasks ({counts}{asked}){sampled}")
    solver = report.solver
    if solver is not None and solver.episodes:
        share = solver.passed / len(solver.episodes)
        lines.append(f"  solver: passes {solver.passed} of {len(solver.episodes)} tasks ({share:.0%}), mean reward "
                     f"{solver.mean_reward:.3f}")
        failed = [e for e in solver.episodes if not e.passed]
        for episode in failed[:SHOWN]:
            lines.append(f"    failed: {report.describe[episode.task.task_id]}: {why_failed(episode)}")
        if len(failed) > SHOWN:
            lines.append(f"    ... and {len(failed) - SHOWN} more")
        count = {k: f"{solver.counters.get(k, 0):.0f}" for k in
                 ("tool_calls", "tool_refusals", "bad_calls", "tool_errors", "tool_timeouts")}
        lines.append(f"    tool calls: {count['tool_calls']} ({count['tool_refusals']} refused, {count['bad_calls']} "
                     f"malformed or unknown, {count['tool_errors']} broke, {count['tool_timeouts']} timed out)")
    if report.null.episodes:
        lines.append(f"  null policy (an empty answer, no calls): mean reward {report.null.mean_reward:.3f}, passes "
                     f"{report.null.passed} of {len(report.null.episodes)}")
    lines += render_replay(report.replay) if report.replay is not None else []
    lines += _parts_table(report)
    lines += [f"  error: {e}" for e in report.errors]
    lines += [f"  warning: {w}" for w in report.warnings]
    return lines


def _parts_table(report: DryRun) -> list[str]:
    """Each reward part's mean and how often it is 0 and 1, for the solver and the null policy."""
    runs = [r for r in (report.solver, report.null) if r is not None and r.episodes]
    labels = list(dict.fromkeys(k for r in runs for e in r.episodes for k in e.breakdown))
    if not labels:
        return []
    width = max(12, *(len(k) for k in labels))
    lines = ["  reward parts".ljust(width + 4) + "".join(f"{r.name + ': mean':>14} {'at 0':>5} {'at 1':>5}"
                                                         for r in runs)]
    for label in labels:
        cells = []
        for run in runs:
            values = [e.breakdown[label] for e in run.episodes if label in e.breakdown]
            if not values:
                cells.append(f"{'-':>14} {'':>5} {'':>5}")
                continue
            zero, one = sum(v == 0 for v in values) / len(values), sum(v >= 1 for v in values) / len(values)
            cells.append(f"{sum(values) / len(values):>14.3f} {zero:>5.0%} {one:>5.0%}")
        lines.append(f"    {label}".ljust(width + 4) + "".join(cells))
    return lines
