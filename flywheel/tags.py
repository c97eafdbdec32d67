"""Names of the tags the stages put on MLflow runs and registered versions, and that other parts read back.

Writer and reader both take the names from here (metric names have flywheel/metrics.py). A tag's name is stored
with every run and version it is on, and the registry is searched by some of them: a name here never changes,
or older runs and versions stop being found.
"""

from __future__ import annotations

# --- every run (registry.start_run) ---------------------------------------------------------------------------
PIPELINE_TAG = "flywheel.pipeline"
STAGE_TAG = "flywheel.stage"  # a stage's name, "retrain" (the pipeline run) or "eval" (`flywheel eval`)
GIT_COMMIT_TAG = "git.commit"
PARENT_RUN_TAG = "mlflow.parentRunId"  # MLflow's own: a stage run's pipeline run

# --- the pipeline (retrain) run ----------------------------------------------------------------------------------
FLOW_RUN_TAG = "prefect.flow_run_id"  # the Prefect flow run it ran in; on its registered version too
GIT_DIRTY_TAG = "git.dirty"  # "True"/"False": whether the checkout had uncommitted changes (its code is unknown)
REFRESH_TAG = "flywheel.refresh"  # the run ignored Prefect's cache (`flywheel run --refresh`)
REGISTERED_VERSION_TAG = "flywheel.registered_version"
RERUN_OF_TAG = "flywheel.rerun_of"  # the recorded run a `flywheel rerun` ran again
RERUN_DATASETS_TAG = "flywheel.rerun.datasets"  # "identical" or "differ": the rerun's outputs against the run's
RERUN_SCORES_TAG = "flywheel.rerun.scores"  # "within_noise" or "outside_noise"
TRIGGER_TAG = "flywheel.trigger"  # a Prefect tag, on the retrain flow runs the trace sensor starts
# Prefect tags on the retrain flow run holding its pipeline's slot on a Prefect server (flows/concurrency.py): the
# pipeline, the slot's lease id and the holder's host each follow the prefix
SLOT_TAG_PREFIX = "flywheel.slot:"
SLOT_LEASE_TAG_PREFIX = "flywheel.lease:"
SLOT_HOST_TAG_PREFIX = "flywheel.host:"


def stage_state_tag(stage: str) -> str:
    """The pipeline run's tag saying how a stage came about: "ran", "cached" or "restored" (from DVC)."""
    return f"stage.{stage}"


def stage_run_tag(stage: str) -> str:
    """The pipeline run's tag holding a stage's own MLflow run id."""
    return f"stage.{stage}.run_id"


# --- stage runs ---------------------------------------------------------------------------------------------------
COLLECT_MODE_TAG = "flywheel.collect.mode"  # "full", or "incremental": only records newer than the watermarks
# on the stage run and on the registered version
ADAPTER_BASE_TAG = "flywheel.adapter_base"  # the checkpoint is a LoRA adapter over this base model
REWARD_HACKING_TAG = "flywheel.reward_hacking"  # "flagged" or "clean": the RL monitor's verdict
REWARD_HACKING_REASON_TAG = "flywheel.reward_hacking_reason"
RL_NO_UPDATES_TAG = "flywheel.rl_no_updates"  # RL's word that it changed nothing


# --- MLflow traces (flywheel/tracing.py): an evaluated or RL episode, or a served request -------------------------
TRACE_KIND_TAG = "flywheel.trace"  # "evaluate", "eval" (`flywheel eval`), "rl" or "served"
TRACE_MODEL_TAG = "flywheel.model"  # the model's label in the eval table (null, base, sft, rl, champion, ...)
TRACE_TASK_TAG = "flywheel.task_id"
TRACE_SLICE_TAG = "flywheel.slice"
TRACE_SPLIT_TAG = "flywheel.split"  # "heldout" (evaluate) or "train" (rl)
TRACE_SAMPLE_TAG = "flywheel.sample"  # 0: the greedy episode; 1..k the sampled ones
TRACE_STOP_TAG = "flywheel.stop"  # how the episode ended (flywheel.agent: answer, max_turns, budget, ...)
TRACE_STEP_TAG = "flywheel.rl_step"  # an RL episode: the learner step it was made for
TRACE_VERSION_TAG = "flywheel.behaviour_version"  # an RL episode: the policy version that generated it
TRACES_ERROR_TAG = "flywheel.traces_error"  # on a run: why its episodes' traces could not be written


def out_tag(output: str) -> str:
    """The tag holding the content hash of a stage's output (a path under the root) or a stage's whole folder."""
    return f"flywheel.out.{output}"


def policy_tag(label: str) -> str:
    """`flywheel eval`'s run: what the policy labelled `label` is (its spec, described)."""
    return f"flywheel.policy.{label}"


# --- the gate: on the evaluate run, the pipeline run and the registered version ----------------------------------
GATE_TAG = "flywheel.gate"  # "passed" or "failed" (gate_tag)
GATE_REFUSED_TAG = "flywheel.gate_refused"  # why the eval cannot measure the candidate, when it cannot
GATE_REASONS_TAG = "flywheel.gate_reasons"
GATE_CHAMPION_TAG = "flywheel.gate_champion"  # the champion version the gate judged against, or "none"


def gate_verdict(passed: bool) -> str:
    """The gate's decision as the gate tag says it."""
    return "passed" if passed else "failed"


def gate_tag(passed: bool) -> dict[str, str]:
    """The gate tag, as the evaluate run, the pipeline run and the registered version each carry it."""
    return {GATE_TAG: gate_verdict(passed)}


def gate_word(tags: dict[str, str]) -> str:
    """The gate's decision as a run's or version's tags say it: passed, failed, or refused (the eval could not
    measure the candidate: the gate tag says failed, the refused tag why); "" when there is no gate tag."""
    return "refused" if tags.get(GATE_REFUSED_TAG) else tags.get(GATE_TAG, "")


def gate_diff_tag(key: str) -> str:
    """The version's tag of the gate's candidate-minus-champion difference `key` (estimate, low, high)."""
    return f"flywheel.gate.{key}"


# --- the registered version ---------------------------------------------------------------------------------------
MODEL_HASH_TAG = "flywheel.model_hash"  # the checkpoint's content hash: one version per hash (registry.register)
CONFIG_HASH_TAG = "flywheel.config_hash"
PIPELINE_RUN_TAG = "mlflow.pipeline_run_id"  # the pipeline run that registered the version
PROMOTION_TAG = "flywheel.promotion"  # how it became champion: "gate", "forced" or "rollback"
PROMOTION_REASONS_TAG = "flywheel.promotion_reasons"
PREVIOUS_CHAMPION_TAG = "flywheel.previous_champion"  # what `flywheel rollback` returns champion to
ROLLED_BACK_TAG = "flywheel.rolled_back"  # "true" on a champion that was rolled back


def score_tag(metric: str) -> str:
    """The version's held-out score `metric` (score_<label>, flywheel/metrics.py): flywheel.score.score_rl."""
    return f"flywheel.score.{metric}"


def pass_rate_tag(label: str) -> str:
    """The version's held-out pass rate of the model labelled `label` (rl, sft, null...)."""
    return f"flywheel.pass_rate.{label}"


def reference_tag(name: str, key: str | None = None) -> str:
    """The version's tag of reference `name`: its line, or with `key` one of its numbers (pass_share...)."""
    return f"flywheel.reference.{name}" + (f".{key}" if key else "")


# --- lineage: on the pipeline run and the registered version ------------------------------------------------------
# + a path: its md5 as dvc.lock records it. The pipeline run has every dep and out of its stages (code too); the
# version only its datasets and models (data/, models/): its code is its git commit. (Versions registered before
# 2026-12-06 also carry `flywheel.data.<path>`, the RL stage's deps again: nothing reads them.)
DVC_PREFIX = "flywheel.dvc."


def dvc_tag(path: str) -> str:
    """The lineage tag of a dataset or model (a path under the root)."""
    return DVC_PREFIX + path
