"""Names of the metrics one part logs and another reads back: the stages write them, `flywheel compare` reads them.

A training stage logs its per-step metrics under their bare names (the learning curves) and its end-of-run
summary once, each key as `final_<key>` (final_metrics). Writer and reader both take the names from here, so a
renamed key breaks the test that reads real stage runs instead of leaving a blank column.
"""

from __future__ import annotations

FINAL = "final_"  # the prefix of a training stage's end-of-run summary

SFT_LOSS = "loss"  # per SFT logging step: the training loss (the SFT learning curve)
RL_REWARD = "reward_mean"  # per RL step: the mean reward of the step's rollouts (the RL learning curve)
# the learning curve each training stage logs per step: a PNG of its run, a figure in `flywheel compare --html`
CURVES = {"sft": SFT_LOSS, "rl": RL_REWARD}
# SFT's validation slice (flywheel/train/sft_validation.py): per validation point, at its step
SFT_VAL_PASS_RATE = "sft.val_pass_rate"  # share of the validation tasks the rubric passes
SFT_VAL_REWARD = "sft.val_reward"  # their mean reward
SFT_LAST_LOSS = "final_loss"  # train_sft's summary: the last logged training loss
RL_LAST_REWARD = "reward_mean_last"  # train_rl's summary: the last step's reward_mean


def final_name(key: str) -> str:
    """The name a summary key is logged under: `final_<key>`, the prefix once (final_loss stays final_loss)."""
    return key if key.startswith(FINAL) else FINAL + key


def final_metrics(summary: dict) -> dict:
    """A training run's summary as its stage logs it (final_name on every key)."""
    return {final_name(key): value for key, value in summary.items()}


SFT_FINAL_LOSS = final_name(SFT_LAST_LOSS)  # what `flywheel compare` shows as "sft loss"
RL_FINAL_REWARD = final_name(RL_LAST_REWARD)  # what `flywheel compare` shows as "rl reward"

# The reward-hacking monitor (flywheel/train/rl/monitor.py): per check, logged at the policy version audited;
# the RL summary carries `<name>_first`, `<name>_last`, `<name>_trend` (change per step) and the flag.
AUDIT_PASS = "audit_pass"  # share of the fixed held-out audit sample passing the environment's audit checks
REWARD_AUDIT_GAP = "reward_audit_gap"  # mean rubric reward on that sample minus audit_pass
REWARD_HACKING = "reward_hacking"  # 1.0: training reward rose while audit_pass fell past rl.max_audit_drop
RL_FINAL_AUDIT = final_name(f"{AUDIT_PASS}_last")  # what `flywheel compare` shows as "audit"
RL_FINAL_GAP = final_name(f"{REWARD_AUDIT_GAP}_last")  # "reward-audit gap"
RL_FINAL_HACKING = final_name(REWARD_HACKING)  # "hacking"
# The cost-aware gate (flywheel/evaluate/gate.py): the relative saving 1 - candidate/champion and its interval.
GATE_COST_SAVING = "gate_cost_saving"
GATE_COST_SAVING_LOW = "gate_cost_saving_low"
GATE_REFUSED = "gate_refused"  # 1.0: the gate refused because the eval cannot measure the candidate

# Held-out scores of every model evaluate scores (null, base, sft, rl, champion, references), greedy: the mean
# reward and the pass rate are two numbers, never one shown for the other.
SCORE = "score_"  # + label: the mean reward
PASS_RATE = "pass_rate_"  # + label: the share of tasks passed


def score_name(label: str) -> str:
    """The metric of a model's mean held-out reward."""
    return SCORE + label


def pass_rate_name(label: str) -> str:
    """The metric of a model's held-out pass rate."""
    return PASS_RATE + label


# RL that did nothing: per step, the share of groups skipped because every reward in them was equal; in the
# summary, the optimiser updates made over the run.
RL_SKIPPED_SHARE = "skipped_group_share"
RL_UPDATES = "updates"

# A pipeline run's times (flows/retrain.py): each stage's measured wall seconds as a metric of the pipeline's run,
# beside `flywheel check`'s estimate of it as a param (flywheel/estimate.py, Estimate.params).
STAGE_SECONDS = "seconds.{stage}"
STAGE_ESTIMATE = "estimate.{stage}_s"
