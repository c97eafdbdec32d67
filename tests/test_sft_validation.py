"""SFT's length from the data and its validation slice (flywheel/train/sft_validation.py): train tasks only, whole
groups, left out of SFT's data; the checkpoint kept is the best validation point; a progress line from step 1."""

from __future__ import annotations

import re
from itertools import islice

import pytest

from flywheel.agent import Harness
from flywheel.checkpoints import load_student
from flywheel.config import SFTConfig
from flywheel.contract import Task
from flywheel.envs.calculator import CalculatorEnv
from flywheel.metrics import SFT_VAL_PASS_RATE
from flywheel.policies.oracle import OraclePolicy
from flywheel.train.sft import train_sft
from flywheel.train.sft_validation import validation_slice, validation_steps


def _task(i: int, group: str = "", split: str = "train") -> Task:
    return Task(task_id=f"t{i:03d}", env="calculator", prompt=[{"role": "user", "content": str(i)}], answer=str(i),
                slice="s", split=split, group=group)


def test_the_slice_is_seeded_train_tasks_in_whole_groups():
    tasks = [_task(i, group=f"g{i // 3}") for i in range(60)]  # 20 groups of 3 attempts at one scenario
    chosen = validation_slice(tasks, SFTConfig(validation_tasks=0.1, seed=0))
    assert 6 <= len(chosen) <= 8 and len(chosen) % 3 == 0
    groups = {t.group for t in chosen}
    assert {t.task_id for t in tasks if t.group in groups} == {t.task_id for t in chosen}  # whole groups
    assert chosen == validation_slice(tasks, SFTConfig(validation_tasks=0.1, seed=0))  # the same on a rerun
    assert chosen != validation_slice(tasks, SFTConfig(validation_tasks=0.1, seed=1))
    assert len(validation_slice(tasks, SFTConfig(validation_tasks=12))) == 12  # a count
    assert validation_slice(tasks, SFTConfig(validation_tasks=0)) == []
    assert len(validation_slice(tasks[:3], SFTConfig(validation_tasks=50))) == 0  # one group: none left to train
    with pytest.raises(ValueError, match="train tasks only"):
        validation_slice(tasks + [_task(99, split="heldout")], SFTConfig(validation_tasks=5))


def test_validation_points_are_epoch_ends_and_the_last_step():
    cfg = SFTConfig(epochs=2.5, batch_size=8)
    assert cfg.planned_steps(20) == 8 and validation_steps(cfg, 20, 8) == [3, 6, 8]
    assert validation_steps(SFTConfig(steps=10, validate_every=4), 20, 10) == [4, 8, 10]


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    env = CalculatorEnv()
    episodes = Harness(env).run(OraclePolicy(env), list(islice(env.generate_tasks(5), 20)))
    return [{"messages": e.messages, "tools": env.tools()} for e in episodes]


def test_the_kept_checkpoint_is_the_best_validation_point(tiny_student, rows, tmp_path, capsys):
    import torch

    # 20 conversations, batch 8: 3 steps a pass, 2 passes; points at steps 3 and 6 (epoch ends)
    cfg = SFTConfig(epochs=2, batch_size=8, lr=5e-3, warmup_steps=0, max_length=128, log_every=2,
                    eval_fraction=0.0)
    snapshots, logged = [], []
    scores = iter([(0.75, 0.8), (0.5, 0.9)])  # the first point passes more: it is kept though later is not

    def validate(model, tokenizer):
        snapshots.append({n: p.detach().clone() for n, p in model.named_parameters()})
        return next(scores)

    result = train_sft(tiny_student, rows, tmp_path / "sft", cfg, on_log=lambda s, m: logged.append((s, m)),
                       validate=validate)
    assert result["steps"] == 6 == result["planned_steps"] and result["sft.val_kept_step"] == 3
    assert [(s, m[SFT_VAL_PASS_RATE]) for s, m in logged if SFT_VAL_PASS_RATE in m] == [(3, 0.75), (6, 0.5)]
    saved, _ = load_student(tmp_path / "sft")
    kept, last = snapshots
    for name, value in saved.named_parameters():
        assert torch.equal(value, kept[name]), name
    assert any(not torch.equal(kept[n], last[n]) for n in kept), "training went on past the kept point"
    out = capsys.readouterr().out
    assert re.search(r"sft step 1/6  loss \d+\.\d{3}  \d+s elapsed, ~\d+s left", out), out  # from the first step
    assert "sft validation at step 3/6: pass rate 0.750, mean reward 0.800 (best so far: step 3)" in out
    assert "sft keeps step 3 of 6" in out


def test_a_set_smaller_than_a_batch_trains_its_epochs(tiny_student, rows, tmp_path):
    cfg = SFTConfig(epochs=3, batch_size=8, lr=5e-3, warmup_steps=0, max_length=128, eval_fraction=0.0)
    result = train_sft(tiny_student, rows[:3], tmp_path / "sft", cfg)
    assert result["steps"] == 3 == result["planned_steps"] and result["train_examples"] == 3


def test_the_sft_stage_validates_on_train_tasks_left_out_of_its_data(project, capsys):
    from mlflow import MlflowClient

    from flywheel.data.catalog import Catalog
    from tasks.collect import collect
    from tasks.sft import sft
    from tasks.synthesize import synthesize

    config = project / "pipelines.yaml"
    config.write_text(config.read_text()
                      .replace("environment: {name: calculator, train_tasks: 600, heldout_tasks: 60,",
                               "environment: {name: calculator, train_tasks: 60, heldout_tasks: 10,")
                      .replace("sft: {steps: 60,", "sft: {validation_tasks: 8, validate_every: 2, steps: 4,"))
    collect.fn("small", str(project))
    synthesize.fn("small", str(project))
    result = sft.fn("small", str(project))

    catalog = Catalog(project, "small")
    tasks = catalog.read("tasks")
    train = tasks[tasks["split"] == "train"]
    from flywheel.data.tasksets import row_task

    synthetic = catalog.read("synthetic")
    accepted = synthetic[synthetic["accepted"]]
    taught = train[train["task_id"].isin(accepted["task_id"])]  # train tasks SFT would otherwise learn from
    chosen = validation_slice([row_task(r) for r in taught.to_dict("records")], SFTConfig(validation_tasks=8, seed=0))
    chosen_ids = {t.task_id for t in chosen}
    assert len(chosen_ids) == 8 and not chosen_ids & set(tasks.loc[tasks["split"] == "heldout", "task_id"])
    client = MlflowClient()
    metrics = client.get_run(result.run_id).data.metrics
    assert metrics["validation_tasks"] == 8
    assert metrics["train_conversations"] == (~accepted["task_id"].isin(chosen_ids)).sum() < len(accepted)
    points = client.get_metric_history(result.run_id, SFT_VAL_PASS_RATE)
    assert sorted(m.step for m in points) == [2, 4] and metrics["final_sft.val_kept_step"] in (2, 4)
    out = capsys.readouterr().out
    assert "sft: " in out and "8 validation tasks pick the checkpoint" in out and "sft step 1/4" in out


def test_a_lora_student_is_validated_live_through_the_harness(tiny_student, rows, tmp_path):
    from flywheel.config import LoRAConfig
    from tasks.sft import _validator

    env = CalculatorEnv()
    tasks = list(islice(env.generate_tasks(99), 4))
    seen = []
    validate = _validator(Harness(env), tasks)

    def recorded(model, tokenizer):
        seen.append(type(model).__name__)
        return validate(model, tokenizer)

    cfg = SFTConfig(steps=2, batch_size=8, lr=5e-3, warmup_steps=0, max_length=128, eval_fraction=0.0,
                    validate_every=1, lora=LoRAConfig(r=4, alpha=8))
    result = train_sft(tiny_student, rows, tmp_path / "sft", cfg, validate=recorded)
    assert seen == ["PeftModelForCausalLM"] * 2 and result["sft.val_points"] == 2
    assert 0.0 <= result["sft.val_pass_rate_kept"] <= 1.0
    assert (tmp_path / "sft" / "model.safetensors").exists()  # merged after the kept weights went back
