"""SFT with TRL on the tiny student: real optimiser steps, assistant-only labels, saving, resuming."""

from __future__ import annotations

from itertools import islice

import pytest

from flywheel.agent import run_episodes
from flywheel.config import SFTConfig
from flywheel.envs.calculator import CalculatorEnv
from flywheel.policies.oracle import OraclePolicy
from flywheel.train.checkpoint import encode_conversation, load_student
from flywheel.train.sft import build_sft_trainer, train_sft


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    env = CalculatorEnv()
    episodes = run_episodes(env, OraclePolicy(env), list(islice(env.generate_tasks(11), 64)))
    return [{"messages": e.messages, "tools": env.tools()} for e in episodes]


def small(**overrides) -> SFTConfig:
    return SFTConfig(**{"steps": 8, "batch_size": 8, "lr": 5e-3, "warmup_steps": 1, "max_length": 128,
                        "log_every": 1, **overrides})


def test_labels_are_masked_outside_assistant_tokens(tiny_student, rows, tmp_path):
    trainer, _, counts = build_sft_trainer(tiny_student, rows, tmp_path / "sft", small(eval_fraction=0.0))
    tokenizer = trainer.processing_class
    example = trainer.train_dataset[0]
    ids, mask = encode_conversation(tokenizer, rows[0]["messages"], rows[0]["tools"], max_length=128)
    assert example["input_ids"] == ids
    assert example["labels"] == [t if m else -100 for t, m in zip(ids, mask, strict=True)]
    assert tokenizer.eos_token_id in example["labels"]  # the model learns to stop
    assert not trainer.args.bf16 and not trainer.args.gradient_checkpointing and trainer.args.learning_rate == 5e-3


def test_steps_lower_the_loss_and_the_saved_model_reloads(tiny_student, rows, tmp_path):
    logged = []
    metrics = train_sft(tiny_student, rows, tmp_path / "sft", small(), on_log=lambda step, m: logged.append((step, m)))
    assert [step for step, _ in logged] == list(range(1, 9))
    assert set(logged[0][1]) >= {"loss", "learning_rate", "grad_norm", "tokens_per_s"}
    assert logged[-1][1]["loss"] < logged[0][1]["loss"]
    assert metrics["steps"] == 8 and metrics["tokens"] > 0 and metrics["resumed_from"] is None
    model, tokenizer = load_student(tmp_path / "sft")
    assert (tmp_path / "sft" / "model.safetensors").exists() and tokenizer.chat_template
    assert model.config.vocab_size == len(tokenizer)


def test_a_killed_run_resumes_from_its_last_checkpoint(tiny_student, rows, tmp_path):
    def die_at_step_5(step, _):
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_sft(tiny_student, rows, tmp_path / "sft", small(), on_log=die_at_step_5)
    assert not (tmp_path / "sft").exists()
    metrics = train_sft(tiny_student, rows, tmp_path / "sft", small())
    assert metrics["resumed_from"].endswith("checkpoint-4") and metrics["steps"] == 8
    # Other inputs do not resume from these checkpoints.
    metrics = train_sft(tiny_student, rows[:32], tmp_path / "sft", small())
    assert metrics["resumed_from"] is None
