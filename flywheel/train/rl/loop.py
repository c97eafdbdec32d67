"""The RL loop: actors roll out scored groups with a policy snapshot while the learner steps and publishes.

    source (work per step) -> actors (processes: episodes, rubric, encode) -> bounded buffer -> learner
    learner: drop stale groups, group advantages, clipped loss with truncated IS, step, publish weights

Step s's rollouts are made by exactly policy version max(s - max_staleness, 0), whichever process makes them and
whenever: `max_staleness: 0` is the synchronous baseline on the same code (an actor starts step s's work only once
version s is published, so it waits while the learner steps), and an asynchronous run is as reproducible as a
synchronous one. `actors: 0` generates in the learner's own process, taking turns with learning: the same
rollouts and weights as actor processes, without the overlap (the reference the tests compare against).
Both are a source in flywheel.train.rl.generation; here: resume, the step loop, checkpoints, metrics, timing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from flywheel.agent import Harness
from flywheel.checkpoints import same_weights
from flywheel.config import RLConfig
from flywheel.contract import Task
from flywheel.metrics import RL_LAST_REWARD, RL_REWARD, RL_SKIPPED_SHARE, RL_UPDATES
from flywheel.train.rl.batch import Group, collate, samples_of
from flywheel.train.rl.checkpoints import Checkpoints, LearnerState, fingerprint
from flywheel.train.rl.generation import Actors, InProcess, Snapshots, actors_for
from flywheel.train.rl.learner import learn_on_batch, learning_rate
from flywheel.train.rl.monitor import Monitor
from flywheel.train.rl.objective import Distill, Reward, objective_of
from flywheel.train.rl.opd import NonFiniteBudget, with_teacher
from flywheel.train.rl.selection import Selection, validation_split
from flywheel.train.rl.source import Work, filtered_work, task_stream, work_items
from flywheel.train.rl.teacher import TeacherUnavailable

__all__ = ["NO_UPDATES_FILE", "no_update_warning", "task_stream", "train_rl"]

NO_UPDATES_FILE = "no_updates.json"  # data/<p>/rl/: why RL changed nothing ("" when it did); evaluate reports it


def _rows(step: int, version: int, groups: list[Group], advantages: dict[int, list[float] | None],
          dropped: set[int]) -> list[dict]:
    rows = []
    for group in groups:
        adv = advantages.get(group.index)
        for i, r in enumerate(group.rollouts):
            rows.append({"step": step, "policy_version": version, "behaviour_version": group.behaviour_version,
                         "task_id": r.task_id, "group": group.index, "sample": r.sample, "reward": r.reward,
                         "advantage": None if adv is None else float(adv[i]), "tokens": r.tokens,
                         "passed": r.passed, "dropped": group.index in dropped, "split": r.split})
    return rows


@dataclass
class _Timing:
    """Where the run's time went: the learner waiting for groups or learning, the actors generating or idle."""

    started: float = field(default_factory=time.perf_counter)
    steps_started: float = 0.0  # once the actors are started: the steps alone
    wait_s: float = 0.0
    learn_s: float = 0.0
    generate_s: float = 0.0
    actor_idle_s: float = 0.0

    def add(self, groups: list[Group], wait_s: float, learn_s: float) -> None:
        """Count one step: the learner's wait and learning, the generating and idling behind its groups."""
        self.wait_s += wait_s
        self.learn_s += learn_s
        self.generate_s += sum(g.generate_s for g in groups)
        self.actor_idle_s += sum(g.idle_s for g in groups)


def train_rl(model_dir: Path, harness: Harness, tasks: list[Task], cfg: RLConfig, out_dir: Path,
             on_step: Callable[[int, dict], None] | None = None,
             checkpoint_dir: Path | None = None, device: str = "auto",
             monitor: Monitor | None = None, teacher=None,
             traced: list | None = None) -> tuple[list[dict], dict]:
    """GRPO-family RL from the checkpoint in model_dir; saves to out_dir; returns (rollout rows, summary).

    Checkpoints go to checkpoint_dir (default: `rl-checkpoints` beside out_dir); a killed run resumes there.
    device: the learner's (student.device; auto: CUDA when present); each actor's is cfg.actor_devices[i] or it.
    monitor: audits the live policy every cfg.monitor_every steps (flywheel/train/rl/monitor.py); its checks
    stay on it for the caller's report, and its numbers join the step metrics and the summary.
    cfg.keep_best: the output is the version that did best on a validation sample of `tasks`, which RL then
    never draws (flywheel/train/rl/selection.py), not the last. harness: the environment and the limits the
    rollouts and the validation run under. teacher: on-policy distillation's (rl.objective opd or reward+opd;
    default: the one rl.opd names, a relative checkpoint path read from the working directory). traced: gets
    (step, behaviour version, episode) for each episode kept for an MLflow trace (cfg.trace_rollouts).
    """
    from flywheel.checkpoints import load_student, save_student
    from flywheel.devices import resolve_device

    learner_device = resolve_device(device, "student.device (the RL learner)")
    cfg = cfg.model_copy(update={"actors": actors_for(cfg)})  # `auto` decided once, for this machine
    timing = _Timing()
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.learner_threads)
    validation, tasks = validation_split(tasks, cfg)
    objective = objective_of(cfg)
    if teacher is None:
        teacher = objective.load_teacher()
    checkpoints = Checkpoints(checkpoint_dir or Path(out_dir).parent / "rl-checkpoints",
                              fingerprint(Path(model_dir), tasks, cfg, harness.env.name, harness.limits,
                                          teacher.identity() if teacher is not None else ""))
    run = checkpoints.load(model_dir, cfg, learner_device)
    first = run.step  # 0, or where a killed run stopped
    # the starting checkpoint, for the KL penalty (kl_beta > 0): no resumable state
    reference = load_student(model_dir)[0].to(learner_device) if cfg.kl_beta > 0 else None
    model, tokenizer, rows, history = run.model, run.tokenizer, run.rows, run.history
    distill = None
    if teacher is not None:
        teacher.check(tokenizer, str(model_dir))  # before any rollout: another tokenizer, no log-probabilities
        distill = _Distill(teacher, NonFiniteBudget.of(objective.opd, teacher.name, history))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if cfg.difficulty_filter:  # the steps whose draw depends only on outcomes learned before this run's first
        ahead = range(first, min(first + cfg.max_staleness + 1, cfg.steps))
        work = [filtered_work(tasks, cfg, s, rows) for s in ahead]
    else:
        work = work_items(tasks, cfg.tasks_per_step, cfg.seed, first, cfg.steps)
    pending = {item.step: item for item in work}
    snapshots = Snapshots(cfg.max_staleness, model, first, run.behaviour)
    source = (Actors(model_dir, harness, model, cfg, snapshots, first, work, device,
                     final=len(work) == cfg.steps - first) if cfg.actors
              else InProcess(harness, model, tokenizer, cfg, snapshots, first))
    watch = _Watch(monitor, model, tokenizer, run.monitor)
    selection = _Select(harness, validation, cfg, model, tokenizer, run)
    if first == 0:
        watch.check(0, history)
        selection.check(0)

    timing.steps_started = time.perf_counter()
    learn_s = 0.0
    try:
        for step in range(first, cfg.steps):
            version = step  # the learner's weights at this step are version `step`
            item: Work = pending.pop(step)
            groups, stale, wait_s = source.take(item, learn_s)
            learning = time.perf_counter()
            for group in run.optimizer.param_groups:
                group["lr"] = learning_rate(cfg, step)
            advantages, stats, failed = _learn(run, reference, groups, objective, cfg, pad_id, distill, step)
            snapshots.add(model, version + 1)
            source.publish(model, version + 1)
            everything = sorted(groups + stale, key=lambda g: g.index)
            rows.extend(_rows(step, version, everything, advantages, {g.index for g in stale + failed}))
            if traced is not None:
                traced += [(g.step, g.behaviour_version, r.episode) for g in everything for r in g.rollouts
                           if r.episode is not None]
            following = step + cfg.max_staleness + 1  # its draw needed this step's outcomes
            if cfg.difficulty_filter and following < cfg.steps:
                pending[following] = filtered_work(tasks, cfg, following, rows)
                source.dispatch(pending[following], final=following == cfg.steps - 1)
            learn_s = time.perf_counter() - learning
            metrics = _metrics(groups, stale, stats, objective, cfg, wait_s, learn_s, version + 1)
            metrics["lr"] = learning_rate(cfg, step)
            history.append(metrics)
            metrics |= watch.check(version + 1, history)
            metrics |= selection.check(version + 1)
            if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
                validated, best_state = selection.kept
                checkpoints.save(replace(run, step=step + 1, behaviour=snapshots.up_to(step), monitor=watch.checks,
                                         validation=validated, best_state=best_state))
            timing.add(groups + stale, wait_s, learn_s)
            if on_step:
                on_step(step, metrics)
    finally:
        source.close()
        if teacher is not None:
            teacher.close()
        torch.set_num_threads(threads)

    selection.restore()
    save_student(model, tokenizer, out_dir)
    checkpoints.remove()
    return rows, (_summary(cfg, objective, rows, history, timing, first) | watch.summary(history)
                  | selection.summary())


class _Select:
    """rl.keep_best's validation, if on, run on the learner's live weights (greedy: no random numbers drawn)."""

    def __init__(self, harness: Harness, tasks: list[Task], cfg: RLConfig, model: torch.nn.Module, tokenizer,
                 run: LearnerState):
        self.model = model
        self.selection = None
        if cfg.keep_best:
            from flywheel.policies.hf import HFPolicy

            self.selection = Selection(harness, tasks, cfg, list(run.validation), run.best_state)
            self.policy = HFPolicy(model, tokenizer)

    @property
    def kept(self) -> tuple[list[dict], dict[str, torch.Tensor] | None]:
        """What a checkpoint keeps: the checks so far and the best version's weights."""
        if self.selection is None:
            return [], None
        return self.selection.checks, self.selection.best_state

    def check(self, version: int) -> dict:
        """The validation metrics when `version` is due; else none."""
        if self.selection is None or not self.selection.due(version):
            return {}
        return self.selection.check(version, self.policy, self.model)

    def restore(self) -> None:
        """The best version's weights into the learner's model, for saving."""
        if self.selection is not None:
            self.selection.restore(self.model)

    def summary(self) -> dict:
        return self.selection.summary() if self.selection is not None else {}


class _Watch:
    """The monitor, if any, run on the learner's live weights (greedy: no random numbers drawn)."""

    def __init__(self, monitor: Monitor | None, model: torch.nn.Module, tokenizer, checks: list[dict]):
        self.monitor = monitor
        if monitor is not None:
            from flywheel.policies.hf import HFPolicy

            monitor.checks = list(checks)  # a resumed run keeps its baseline
            self.policy = HFPolicy(model, tokenizer)

    @property
    def checks(self) -> list[dict]:
        """The checks so far (what a checkpoint keeps)."""
        return self.monitor.checks if self.monitor is not None else []

    def check(self, version: int, history: list[dict]) -> dict:
        """The monitor's metrics when `version` is due for an audit; else none."""
        if self.monitor is None or not self.monitor.due(version):
            return {}
        return self.monitor.check(version, self.policy, history)

    def summary(self, history: list[dict]) -> dict:
        """The monitor's numbers for the run summary."""
        return self.monitor.summary(history) if self.monitor is not None else {}


@dataclass
class _Distill:
    """On-policy distillation's teacher and the run's count of its unusable log-probabilities."""

    teacher: object
    budget: NonFiniteBudget


def _learn(run: LearnerState, reference: torch.nn.Module | None, groups: list[Group], objective: Reward | Distill,
           cfg: RLConfig, pad_id: int, distill: _Distill | None,
           step: int) -> tuple[dict[int, list[float] | None], dict, list[Group]]:
    """One learner step on the groups: (reward advantages by group, None for a group without that signal; loss
    stats; the groups dropped because the teacher failed on them).

    Under on-policy distillation every group trains (each token has the teacher's signal), with its reward
    advantages under `reward+opd` (zeros where the rewards were equal) and none under `opd`."""
    advantages = {g.index: objective.advantages(g, cfg.loss_type) for g in groups}
    if objective.skips_equal_groups:
        samples = [s for g in groups if advantages[g.index] is not None for s in samples_of(g, advantages[g.index])]
    else:
        samples = [s for g in groups for s in samples_of(g, advantages[g.index] or [0.0] * len(g.rollouts))]
    if not samples:
        return advantages, {}, []
    batch, counts = collate(samples, pad_id), {}
    if distill is not None:
        try:
            batch, counts = with_teacher(batch, distill.teacher)
        except TeacherUnavailable as err:
            print(f"rl step {step}: {distill.teacher.name} failed ({err}); the step's {len(groups)} groups are "
                  "dropped, not trained on", flush=True)
            return advantages, {"teacher_failed_groups": len(groups)}, groups
        distill.budget.add(counts["teacher_tokens"], counts["teacher_nonfinite_tokens"], step)
    stats = learn_on_batch(run.model, run.optimizer, batch, cfg, run.shuffle, reference,
                           distill.teacher if distill is not None else None)
    return advantages, stats | counts | {"trained_tokens": int(batch["loss_mask"].sum())}, []


def _metrics(groups: list[Group], stale: list[Group], stats: dict, objective: Reward | Distill, cfg: RLConfig,
             wait_s: float, learn_s: float, version: int) -> dict:
    rollouts = [r for g in groups for r in g.rollouts]
    rewards = np.array([r.reward for r in rollouts] or [0.0], dtype=np.float64)
    staleness = [version - 1 - g.behaviour_version for g in groups]
    generate_s = sum(g.generate_s for g in groups + stale)
    idle_s = sum(g.idle_s for g in groups + stale)
    step_s = wait_s + learn_s
    # groups whose rewards were all equal carry no reward signal (on-policy distillation trains them all)
    skipped = sum(len({r.reward for r in g.rollouts}) == 1 for g in groups) if objective.skips_equal_groups else 0
    metrics = {RL_REWARD: float(rewards.mean()), "reward_std": float(rewards.std()),
               "pass_rate": float(np.mean([r.passed for r in rollouts])) if rollouts else 0.0,
               "groups": len(groups), "dropped_groups": len(stale),
               "skipped_groups": skipped,
               # groups whose rewards were all equal carry no signal: at 1.0 the step learned nothing
               RL_SKIPPED_SHARE: skipped / len(groups) if groups else 1.0,
               "split_rollouts": sum(r.split for r in rollouts),
               **{f"staleness_{k}": staleness.count(k) for k in range(cfg.max_staleness + 1)},
               "loss": stats.get("loss", float("nan")), "clip_fraction": stats.get("clip_fraction", 0.0),
               "ratio_mean": stats.get("ratio_mean", 1.0), "ratio_max": stats.get("ratio_max", 1.0),
               "is_weight_mean": stats.get("is_weight_mean", 1.0), "is_weight_max": stats.get("is_weight_max", 1.0),
               "kl_behaviour": stats.get("kl_behaviour", 0.0),
               "grad_norm": stats.get("grad_norm", 0.0), RL_UPDATES: stats.get("updates", 0),
               "learner_idle_fraction": wait_s / max(step_s, 1e-9),
               "actor_idle_fraction": idle_s / max(idle_s + generate_s, 1e-9),
               # assistant tokens generated (and learned from) per second of the learner's step
               "tokens_per_s": sum(r.tokens for r in rollouts) / max(step_s, 1e-9),
               "wait_s": wait_s, "learn_s": learn_s, "generate_s": generate_s, "step_time_s": step_s,
               "policy_version": version}
    if "kl" in stats:
        metrics["kl"] = stats["kl"]
    metrics["trained_tokens"] = stats.get("trained_tokens", 0)
    return metrics | objective.metrics(stats)


def _summary(cfg: RLConfig, objective: Reward | Distill, rows: list[dict], history: list[dict], timing: _Timing,
             first: int) -> dict:
    now = time.perf_counter()
    summary = {"steps": cfg.steps, "policy_version": cfg.steps, "episodes": len(rows), "actors": cfg.actors,
               "resumed_from_step": first, "wall_time_s": now - timing.started,
               "steps_wall_s": now - timing.steps_started,
               "generate_s": timing.generate_s, "learn_s": timing.learn_s, "wait_s": timing.wait_s,
               "learner_idle_fraction": timing.wait_s / max(timing.wait_s + timing.learn_s, 1e-9),
               "actor_idle_fraction": timing.actor_idle_s / max(timing.actor_idle_s + timing.generate_s, 1e-9)}
    if history:
        summary |= {"reward_mean_first": history[0][RL_REWARD], RL_LAST_REWARD: history[-1][RL_REWARD],
                    "pass_rate_mean": float(np.mean([m["pass_rate"] for m in history])),
                    "skipped_groups": int(sum(m["skipped_groups"] for m in history)),
                    RL_SKIPPED_SHARE: float(sum(m["skipped_groups"] for m in history))
                    / max(sum(m["groups"] for m in history), 1),
                    RL_UPDATES: int(sum(m[RL_UPDATES] for m in history)),
                    "dropped_groups": int(sum(m["dropped_groups"] for m in history)),
                    "split_rollouts": int(sum(m["split_rollouts"] for m in history)),
                    "trained_tokens": int(sum(m.get("trained_tokens", 0) for m in history)),
                    "generated_tokens": sum(r["tokens"] for r in rows)} | objective.summary(history)
    return summary


def no_update_warning(summary: dict, model_dir: Path, out_dir: Path) -> str:
    """Why an RL run changed nothing, or "": no optimiser update (every group's rewards were equal), or weights
    byte-identical to the checkpoint it started from."""
    if summary.get(RL_UPDATES) == 0:
        share = summary.get(RL_SKIPPED_SHARE)
        groups = "" if share is None else f"; {share:.0%} of its groups had equal rewards, so no signal"
        return f"RL made 0 optimiser updates in {summary.get('steps', 0)} steps{groups}: the RL model is the SFT model"
    if same_weights(model_dir, out_dir):
        return "RL's output weights are byte-identical to its input (the SFT checkpoint): RL changed nothing"
    return ""
