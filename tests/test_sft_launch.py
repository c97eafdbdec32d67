"""SFT under `accelerate launch`: two DDP processes on CPU (gloo) with metrics streamed back; FSDP config parses."""

from __future__ import annotations

from pathlib import Path

import pytest
from family_students import calculator_rows

from flywheel.checkpoints import load_student
from flywheel.config import SFTConfig
from flywheel.train.sft import train_sft

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_ddp_launch_trains_two_processes_and_streams_metrics(tiny_student, tmp_path):
    rows = calculator_rows(64)
    cfg = SFTConfig(steps=6, batch_size=4, lr=5e-3, warmup_steps=1, max_length=128, log_every=1, eval_every=3,
                    eval_fraction=0.1, launcher="ddp", processes=2)
    logged = []
    result = train_sft(tiny_student, rows, tmp_path / "sft", cfg, on_log=lambda step, m: logged.append((step, m)),
                       accelerate_config=REPO / "infra/accelerate/ddp.yaml")
    assert result["steps"] == 6 and result["eval_examples"] > 0 and result["eval_loss"] is not None
    assert [step for step, m in logged if "loss" in m] == [1, 2, 3, 4, 5, 6]
    assert [step for step, m in logged if "eval_loss" in m] == [3, 6]
    assert result["world_size"] == 2  # two processes, gradients averaged over gloo
    model, tokenizer = load_student(tmp_path / "sft")
    assert model.config.vocab_size == len(tokenizer)


def test_accelerate_configs_parse():
    from accelerate.commands.config.config_args import load_config_from_file

    ddp = load_config_from_file(str(REPO / "infra/accelerate/ddp.yaml"))
    fsdp = load_config_from_file(str(REPO / "infra/accelerate/fsdp.yaml"))
    assert ddp.distributed_type == "MULTI_GPU" and fsdp.distributed_type == "FSDP"
    assert fsdp.fsdp_config["fsdp_version"] == 2
    # the stage trains in fp32 on every launcher (bf16=False, fp16=False): no config may ask for mixed precision
    assert ddp.mixed_precision == fsdp.mixed_precision == "no"
