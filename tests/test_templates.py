"""Which template a student trains on: TRL's training variant for the families it ships (the real swap, on
Qwen- and Llama-style checkpoints built here), a configured one, or a clear error naming the family."""

from __future__ import annotations

import re

import pytest
from family_students import FAMILIES, build_family_student, calculator_rows
from trl.chat_template_utils import (
    llama3_2_chat_template,
    llama3_training_chat_template,
    qwen2_5_training_chat_template,
)

from flywheel.config import SFTConfig
from flywheel.train.checkpoint import canonical_messages
from flywheel.train.sft import build_sft_trainer, train_sft
from flywheel.train.templates import ChatTemplateError, training_template

TRAINING = {"qwen": qwen2_5_training_chat_template, "llama": llama3_training_chat_template}
# Where each family's template writes an assistant turn's trained part: after the header, through the end token.
ASSISTANT = {"qwen": re.compile(r"<\|im_start\|>assistant(.*?<\|im_end\|>\n)", re.DOTALL),
             "llama": re.compile(r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n(.*?<\|eot_id\|>)", re.DOTALL)}


@pytest.fixture(scope="module")
def rows():
    return calculator_rows(32)


def small(**overrides) -> SFTConfig:
    return SFTConfig(**{"steps": 2, "batch_size": 4, "lr": 1e-3, "warmup_steps": 0, "max_length": 1024,
                        "eval_fraction": 0.0, "log_every": 1, **overrides})


@pytest.mark.parametrize("family", ["qwen", "llama"])
def test_trl_training_variant_is_swapped_in_and_masks_assistant_tokens_only(family, rows, tmp_path):
    base = build_family_student(family, tmp_path / "base", rows)
    trainer, _, counts = build_sft_trainer(base, rows, tmp_path / "sft", small())
    tokenizer = trainer.processing_class
    assert tokenizer.chat_template == TRAINING[family] and counts["train_examples"] == len(rows)

    # Token by token, against the spans the family's ORIGINAL template writes for assistant turns.
    row = rows[0]
    text = tokenizer.apply_chat_template(canonical_messages(row["messages"]), tools=row["tools"], tokenize=False,
                                         chat_template=FAMILIES[family][0])
    spans = [m.span(1) for m in ASSISTANT[family].finditer(text)]
    assert len(spans) == sum(m["role"] == "assistant" for m in row["messages"]) == 2
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    expected = [t if any(s <= a and b <= e for s, e in spans) else -100
                for t, (a, b) in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True)]
    example = trainer.train_dataset[0]
    assert example["input_ids"] == encoded["input_ids"]
    assert example["labels"] == expected
    assert tokenizer.eos_token_id in example["labels"]  # the end-of-turn token is trained: the model learns to stop

    # The saved student carries the training template; the harness then renders what SFT trained on.
    train_sft(base, rows, tmp_path / "out", small())
    assert training_template(trainer.processing_class, "x") == TRAINING[family]
    from flywheel.train.checkpoint import load_student

    assert load_student(tmp_path / "out")[1].chat_template == TRAINING[family]


def test_an_unknown_template_without_a_configured_one_fails_naming_the_family(rows, tmp_path):
    # Llama 3.2's template: a real one, but TRL ships no training version of it.
    base = build_family_student("llama", tmp_path / "base", rows, template=llama3_2_chat_template)
    with pytest.raises(ChatTemplateError) as err:
        build_sft_trainer(base, rows, tmp_path / "sft", small())
    message = str(err.value)
    assert "family 'llama'" in message and "student.chat_template" in message and "{% generation %}" in message

    # A configured template without markers is refused; one with markers is used.
    plain = tmp_path / "plain.jinja"
    plain.write_text(llama3_2_chat_template)
    with pytest.raises(ChatTemplateError, match="no \\{% generation %\\} markers"):
        build_sft_trainer(base, rows, tmp_path / "sft", small(), chat_template=plain)
    marked = tmp_path / "marked.jinja"
    marked.write_text(llama3_training_chat_template)
    trainer, _, _ = build_sft_trainer(base, rows, tmp_path / "sft", small(), chat_template=marked)
    assert trainer.processing_class.chat_template == llama3_training_chat_template
    assert any(label != -100 for label in trainer.train_dataset[0]["labels"])
