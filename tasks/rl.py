"""Stage rl: improve the SFT student with asynchronous GRPO-family RL (actor processes + learner) on the train tasks,
from the task reward, a teacher's per-token log-probabilities (on-policy distillation), or both (rl.objective)."""

from __future__ import annotations

import shutil

import pandas as pd

from flywheel.data.schemas import Rollouts
from flywheel.data.tasksets import row_task
from flywheel.errors import UserFacingError
from flywheel.metrics import RL_UPDATES, final_metrics
from flywheel.stages import StageResult
from flywheel.tags import (
    REWARD_HACKING_REASON_TAG,
    REWARD_HACKING_TAG,
    RL_NO_UPDATES_TAG,
    TRACE_STEP_TAG,
    TRACE_VERSION_TAG,
)
from flywheel.tracing import log_episodes, spread
from flywheel.train.rl.generation import actors_for
from flywheel.train.rl.loop import NO_UPDATES_FILE, no_update_warning, train_rl
from flywheel.train.rl.monitor import MONITOR_FILE, Monitor, audit_sample
from flywheel.train.rl.objective import objective_of
from tasks.kernel import stage_context, stage_task
from tasks.progress import log_curve, progress
from tasks.reports import publish_monitor_report


class NoUpdatesError(UserFacingError, RuntimeError):
    """RL changed nothing and rl.fail_on_no_updates asks for an error instead of a warning."""


@stage_task()
def rl(pipeline: str, root: str = ".", parent_run_id: str | None = None) -> StageResult:
    """RL from the SFT checkpoint: the RL checkpoint, the rollouts table and the monitor's report."""
    with stage_context("rl", pipeline, root, parent_run_id, params=("rl",)) as stage:
        cfg, catalog, harness, run = stage.cfg, stage.catalog, stage.harness, stage.run
        table = catalog.read("tasks")
        tasks = [row_task(r) for r in table.to_dict("records") if r["split"] == "train"]
        out_dir = catalog.model_dir("rl")
        monitor = None
        if cfg.rl.monitor_every and cfg.rl.steps:  # audited on held-out tasks, which it never trains on
            heldout = [row_task(r) for r in table.to_dict("records") if r["split"] == "heldout"]
            monitor = Monitor(harness, audit_sample(heldout, cfg.rl.monitor_tasks), cfg.rl)
        traced: list = []  # (step, version, episode) of each step's first task: MLflow traces at the end
        if cfg.rl.steps == 0:  # RL switched off: the candidate is the SFT model itself
            shutil.rmtree(out_dir, ignore_errors=True)
            shutil.copytree(catalog.model_dir("sft"), out_dir)
            rows, summary = [], {"steps": 0}
        else:
            # on-policy distillation's teacher: a checkpoint folder under the project root, or a server
            teacher = objective_of(cfg.rl).load_teacher(stage.root)
            actors = actors_for(cfg.rl)  # rl.actors `auto` decided for this machine: a param of its own
            run.params({"rl": {"actors_resolved": actors}})
            limits = harness.limits
            ends = [f"{limits.max_error_turns} malformed turn(s) in a row" if limits.max_error_turns is not None
                    else None, f"{limits.max_tokens} generated tokens" if limits.max_tokens is not None else None]
            print(f"      rl: {actors} actor process(es) (rl.actors: {cfg.rl.actors}), learner threads "
                  f"{cfg.rl.learner_threads}; episodes end after {limits.max_turns} turns"
                  + "".join(f" or {end}" for end in ends if end), flush=True)
            rows, summary = train_rl(catalog.model_dir("sft"), harness, tasks,
                                     cfg.rl.model_copy(update={"actors": actors}), out_dir,
                                     device=cfg.student.device,
                                     on_step=progress(run, "rl", cfg.rl.steps, "reward_mean"), monitor=monitor,
                                     teacher=teacher, traced=traced)
        catalog.write("rollouts", pd.DataFrame(rows, columns=list(Rollouts.to_schema().columns)))
        report_path = catalog.stage_dir("rl") / MONITOR_FILE
        report_path.unlink(missing_ok=True)
        if monitor is not None:
            report = monitor.report()
            catalog.write_json("rl", MONITOR_FILE, report)
            run.tags({REWARD_HACKING_TAG: "flagged" if report["flagged"] else "clean"}
                     | ({REWARD_HACKING_REASON_TAG: report["reason"][:5000]} if report["flagged"] else {}))
            publish_monitor_report(pipeline, report)
        run.metrics(final_metrics(summary))
        log_episodes([("rl", episode, {TRACE_STEP_TAG: step, TRACE_VERSION_TAG: version})
                      for step, version, episode in spread(traced, cfg.rl.trace_rollouts)],
                     run, pipeline, stage.env, kind="rl", split="train")
        log_curve(run, "rl")
        if cfg.rl.steps:
            print(f"      rl: {summary.get(RL_UPDATES, 0)} optimiser updates in {summary.get('steps', 0)} steps; "
                  f"{summary.get('skipped_groups', 0)} groups skipped (equal rewards: no signal), "
                  f"{summary.get('dropped_groups', 0)} dropped (stale)", flush=True)
        # RL switched off (steps 0) is asked for; RL that ran and changed nothing is said, or an error if asked
        warning = no_update_warning(summary, catalog.model_dir("sft"), out_dir) if cfg.rl.steps else ""
        catalog.write_json("rl", NO_UPDATES_FILE, {"warning": warning})
        if warning:
            run.tags({RL_NO_UPDATES_TAG: warning[:5000]})
            if cfg.rl.fail_on_no_updates:
                raise NoUpdatesError(f"pipeline '{pipeline}': {warning} (rl.fail_on_no_updates is true)")
        return stage.done(summary)
