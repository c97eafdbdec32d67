"""A SIGKILLed SFT run resumes from its last checkpoint to the same final weights as an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch
from family_students import calculator_rows

from flywheel.checkpoints import load_student
from flywheel.config import SFTConfig
from flywheel.metrics import SFT_LAST_LOSS
from flywheel.train.sft import train_sft
from flywheel.train.sft_job import write_job

# 200 steps saving every 40: the kill lands mid-run with a checkpoint on disk.
CFG = SFTConfig(steps=200, batch_size=8, lr=3e-3, warmup_steps=5, max_length=128, eval_fraction=0.1, eval_every=50,
                log_every=10)


def test_a_killed_run_resumes_to_the_same_weights(tiny_student, tmp_path):
    rows = calculator_rows(64)
    straight = train_sft(tiny_student, rows, tmp_path / "straight" / "sft", CFG)

    job = write_job(tmp_path / "killed" / "job", tiny_student, rows, tmp_path / "killed" / "sft", CFG)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen([sys.executable, "-m", "flywheel.train.sft_launch", str(job)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoints = tmp_path / "killed" / "sft-checkpoints"
    deadline = time.monotonic() + 120
    while not any(checkpoints.glob("checkpoint-*/trainer_state.json")):  # written last: the checkpoint is whole
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before any checkpoint"
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL and not (tmp_path / "killed" / "sft").exists()

    resumed = train_sft(tiny_student, rows, tmp_path / "killed" / "sft", CFG)
    assert resumed["resumed_from"] and resumed["steps"] == 200
    assert int(resumed["resumed_from"].rsplit("-", 1)[1]) < 200
    a = dict(load_student(tmp_path / "straight" / "sft")[0].named_parameters())
    b = dict(load_student(tmp_path / "killed" / "sft")[0].named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=1e-5, atol=1e-6), name
    assert abs(resumed["eval_loss"] - straight["eval_loss"]) < 1e-5


def test_a_checkpoint_cut_short_by_the_kill_is_removed_and_the_whole_one_before_it_resumes(tmp_path):
    from flywheel.train.sft import _resume_point

    checkpoints = tmp_path / "sft-checkpoints"
    assert _resume_point(checkpoints, "abc") is None
    whole, cut = checkpoints / "checkpoint-40", checkpoints / "checkpoint-80"
    whole.mkdir()
    (whole / "trainer_state.json").write_text('{"global_step": 40}')
    cut.mkdir()
    (cut / "model.safetensors").write_bytes(b"\0" * 8)
    (cut / "trainer_state.json").write_text("")  # the kill landed while the Trainer wrote it
    assert _resume_point(checkpoints, "abc") == str(whole)
    assert not cut.exists() and whole.exists()


def test_a_finished_run_resumed_writes_nothing_new(tiny_student, tmp_path):
    """A rerun that finds the last checkpoint at max_steps (the stage killed after training, or its model folder
    gone) saves that checkpoint's weights: the model an uninterrupted run wrote, no step and no checkpoint past
    max_steps. The Trainer would take one (at a learning rate of 0) when max_steps is not a whole number of epochs."""
    import math
    import shutil

    cfg = CFG.model_copy(update={"steps": 22, "eval_every": 10})
    rows = calculator_rows(32)
    out = tmp_path / "sft"
    first = train_sft(tiny_student, rows, out, cfg)
    assert cfg.steps % math.ceil(first["train_examples"] / cfg.batch_size), "max_steps must end mid-epoch"
    written = {p.name: p.read_bytes() for p in out.iterdir()}
    checkpoints = sorted(p.name for p in (tmp_path / "sft-checkpoints").glob("checkpoint-*"))
    assert checkpoints[-1] == "checkpoint-22"

    shutil.rmtree(out)
    again = train_sft(tiny_student, rows, out, cfg)
    assert again["resumed_from"].endswith("checkpoint-22") and again["steps"] == 22
    assert again["train_loss"] is None and again["tokens"] == 0  # no step trained in this session
    assert sorted(p.name for p in (tmp_path / "sft-checkpoints").glob("checkpoint-*")) == checkpoints
    assert {p.name: p.read_bytes() for p in out.iterdir()} == written
    assert again["eval_loss"] == first["eval_loss"] and again[SFT_LAST_LOSS] == first[SFT_LAST_LOSS]
