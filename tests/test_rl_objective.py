"""rl.objective: the config's variants (flywheel/config/training.py), written as before, and the one class chosen
for each (flywheel/train/rl/objective.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from flywheel import config
from flywheel.config import OPDObjective, RewardObjective, RewardOPDObjective, RLConfig
from flywheel.train.rl.batch import Group, Rollout
from flywheel.train.rl.objective import OBJECTIVES, Distill, Reward, RewardAndDistill, objective_of

OPD = {"teacher": "models/t", "reward_coef": 0.5}


def test_the_objective_is_written_as_before_and_read_as_one_variant():
    cfg = RLConfig(objective="reward+opd", opd=OPD)
    assert isinstance(cfg.objective, RewardOPDObjective) and cfg.objective.opd.reward_coef == 0.5
    assert isinstance(RLConfig(objective="opd", opd=OPD).objective, OPDObjective)
    dumped = cfg.model_dump()  # what the config hash, MLflow's params and a run's recorded config read
    keys = list(dumped)
    assert dumped["objective"] == "reward+opd" and keys[keys.index("objective") + 1] == "opd"
    assert dumped["opd"]["teacher"] == "models/t"
    assert RLConfig.model_validate(dumped) == cfg == RLConfig.model_validate_json(cfg.model_dump_json())
    # `grpo` names the reward objective; an rl.opd beside `reward` would never be read: an error, as an unknown key
    assert RLConfig(objective="grpo") == RLConfig() == RLConfig(objective="reward", opd=None)
    with pytest.raises(ValidationError, match="rl.opd is set, but objective 'reward' has no teacher"):
        RLConfig(objective="reward", opd=OPD)
    assert isinstance(RLConfig().objective, RewardObjective)
    assert {k: RLConfig().model_dump()[k] for k in ("objective", "opd")} == {"objective": "reward", "opd": None}


def test_an_opd_objective_cannot_be_built_without_its_teacher():
    for kind in ("opd", "reward+opd"):
        with pytest.raises(ValidationError, match=rf"objective '{kind.replace('+', '.')}' needs rl.opd with a "
                                                  "teacher: a checkpoint folder"):
            RLConfig(objective=kind)
    for variant in (OPDObjective, RewardOPDObjective):
        with pytest.raises(ValidationError, match=r"opd\n  Field required"):
            variant()
    with pytest.raises(ValidationError, match=r"objective 'ppo': use reward \(or grpo\), opd or reward\+opd"):
        RLConfig(objective="ppo")


def _group(*rewards: float) -> Group:
    return Group(0, 0, 0, [Rollout(f"t{i}", i, r, r > 0, []) for i, r in enumerate(rewards)])


def test_each_objective_is_one_class_chosen_once_from_the_config():
    assert set(OBJECTIVES) == set(config.OBJECTIVES)
    reward = objective_of(RLConfig())
    opd = objective_of(RLConfig(objective="opd", group_size=1, opd=OPD))
    both = objective_of(RLConfig(objective="reward+opd", opd=OPD))
    assert (type(reward), type(opd), type(both)) == (Reward, Distill, RewardAndDistill)

    # no teacher under `reward`; the distilling ones hold rl.opd, and weigh the reward beside it or not at all
    assert reward.opd is None and reward.load_teacher() is None
    assert opd.opd.teacher == both.opd.teacher == "models/t"
    assert (opd.reward_coef, both.reward_coef) == (0.0, 0.5)
    # rewards make advantages under `reward` and `reward+opd`; only `reward` skips a group of equal rewards
    signal, equal = _group(1.0, 0.0), _group(1.0, 1.0)
    assert reward.advantages(signal, "dr_grpo") == both.advantages(signal, "dr_grpo") == [0.5, -0.5]
    assert opd.advantages(signal, "grpo") is None and reward.advantages(equal, "grpo") is None
    assert reward.skips_equal_groups and not opd.skips_equal_groups and not both.skips_equal_groups

    # the teacher's metrics, only where there is a teacher
    stats = {"teacher_kl": 0.25, "teacher_logprob": -1.0, "teacher_tokens": 8, "teacher_divergence": 0.5}
    assert reward.metrics(stats) == {} and reward.summary([stats]) == {}
    step = both.metrics(stats)
    assert step == {"teacher_kl": 0.25, "teacher_logprob": -1.0, "teacher_tokens": 8,
                    "teacher_nonfinite_tokens": 0, "teacher_failed_groups": 0, "teacher_divergence": 0.5}
    assert opd.summary([step, step | {"teacher_kl": 0.125, "teacher_divergence": 0.25}]) == {
        "teacher_divergence_first": 0.5, "teacher_divergence_last": 0.25, "teacher_kl_first": 0.25,
        "teacher_kl_last": 0.125, "teacher_tokens": 16, "teacher_nonfinite_tokens": 0, "teacher_failed_groups": 0}
