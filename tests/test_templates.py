"""Which template a student trains on: TRL's training variant for the families it ships (the real swap, on
Qwen- and Llama-style checkpoints built here), a configured one, or a clear error naming the family."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from family_students import FAMILIES, build_family_student, calculator_rows
from trl.chat_template_utils import (
    llama3_2_chat_template,
    llama3_training_chat_template,
    qwen2_5_training_chat_template,
)

from flywheel.config import SFTConfig
from flywheel.policies.toolcalls import canonical_messages
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
    from flywheel.checkpoints import load_student

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


def _render(template: str, conversations: list[list[dict]], tools=None, generation_prompt=False) -> list[str]:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[canonical_messages(c) for c in conversations], tools=tools,
                                        chat_template=template, add_generation_prompt=generation_prompt)
    return rendered


PLAIN_CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Name a prime.\nJust one."}, {"role": "assistant", "content": "7"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Bonjour"},
     {"role": "assistant", "content": "Bonjour !"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "{{ not a template }} <|im_end|>"}],
]


@pytest.mark.parametrize("generation_prompt", [False, True])
def test_smollm2_training_variant_renders_conversations_without_tools_exactly_as_the_original(generation_prompt):
    from flywheel.train.templates import SMOLLM2_TEMPLATE, SMOLLM2_TRAINING_TEMPLATE

    original = _render(SMOLLM2_TEMPLATE, PLAIN_CONVERSATIONS, generation_prompt=generation_prompt)
    variant = _render(SMOLLM2_TRAINING_TEMPLATE, PLAIN_CONVERSATIONS, generation_prompt=generation_prompt)
    assert variant == original
    assert original[0].startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_smollm2_training_variant_adds_only_the_tools_and_the_calls_the_harness_parses(rows):
    from flywheel.policies.toolcalls import TOOL_CALL, parse_completion, render_tool_call
    from flywheel.train.templates import SMOLLM2_TEMPLATE, SMOLLM2_TRAINING_TEMPLATE

    row = next(r for r in rows if any(m.get("tool_calls") for m in r["messages"]))
    [text] = _render(SMOLLM2_TRAINING_TEMPLATE, [row["messages"]], tools=row["tools"])
    calls = [c for m in row["messages"] if m["role"] == "assistant" for c in m.get("tool_calls") or []]
    system, turns = text[:text.index("<|im_end|>")], text[text.index("<|im_end|>"):]
    assert calls and [m.group(0) for m in TOOL_CALL.finditer(turns)] == [render_tool_call(c) for c in calls]
    assert '{"name": "calculator", "description": "Evaluate an' in system  # the tool's schema, then how to call

    # The non-tool part: drop the tools block and the calls, and what is left is the original's rendering of the
    # same messages with the calls removed (the original writes no calls and cannot take content None).
    tools_block = system[system.index("\n\nYou can call these tools:"):]
    plain = [{**m, "content": m.get("content") or ""} for m in row["messages"]]
    for message in plain:
        message.pop("tool_calls", None)
    [original] = _render(SMOLLM2_TEMPLATE, [plain])
    assert system.removesuffix(tools_block) + TOOL_CALL.sub("", turns) == original

    # What the student writes in a turn with a call, the harness reads back as that call.
    turn = turns.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert parse_completion(turn).message["tool_calls"][0]["function"] == calls[0]["function"]


def test_smollm2_template_gets_the_shipped_training_variant_and_masks_each_assistant_turn(rows):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from flywheel.policies.toolcalls import render_tool_call
    from flywheel.train.encoding import encode_conversation
    from flywheel.train.templates import SMOLLM2_TEMPLATE, SMOLLM2_TRAINING_TEMPLATE

    # A character-level tokenizer with SmolLM2's template: enough to check the choice and the mask, no download.
    chars = sorted({c for r in rows for c in _render(SMOLLM2_TRAINING_TEMPLATE, [r["messages"]], r["tools"])[0]})
    backend = Tokenizer(models.WordLevel({c: i for i, c in enumerate(["<unk>", *chars])}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = SMOLLM2_TEMPLATE
    assert training_template(tokenizer, "smollm2", "llama") == SMOLLM2_TRAINING_TEMPLATE

    row = rows[0]
    ids, mask = encode_conversation(tokenizer, row["messages"], row["tools"], 1 << 20, SMOLLM2_TRAINING_TEMPLATE)
    trained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False)
    answers = [m["content"] + "".join(render_tool_call(c) for c in m.get("tool_calls") or []) + "<|im_end|>"
               for m in row["messages"] if m["role"] == "assistant"]
    assert trained.replace(" ", "") == "".join(answers).replace(" ", "")


COMPACT = Path(__file__).resolve().parents[1] / "templates" / "smollm2-compact-tools.jinja"


@pytest.mark.parametrize("generation_prompt", [False, True])
def test_the_compact_tools_template_renders_what_smollm2s_training_variant_does_but_one_line_a_tool(
        generation_prompt):
    from flywheel.envs.support import make_env
    from flywheel.train.templates import SMOLLM2_TRAINING_TEMPLATE

    compact = COMPACT.read_text()
    assert training_template(None, "smol", configured=COMPACT) == compact  # accepted as student.chat_template
    assert _render(compact, PLAIN_CONVERSATIONS, generation_prompt=generation_prompt) == \
        _render(SMOLLM2_TRAINING_TEMPLATE, PLAIN_CONVERSATIONS, generation_prompt=generation_prompt)

    env = make_env()
    task = next(env.generate_tasks(0))
    [text] = _render(compact, [task.prompt], tools=env.tools(), generation_prompt=generation_prompt)
    [full] = _render(SMOLLM2_TRAINING_TEMPLATE, [task.prompt], tools=env.tools(), generation_prompt=generation_prompt)
    listed = text[text.index("You can call these tools:\n"):].splitlines()[1:8]
    assert listed[0] == "find_user(email): Find a user by email."
    assert listed[4] == "change_shipping(order_id, speed: standard|express): Change an order's shipping speed."
    assert [line.partition("(")[0] for line in listed] == [t["function"]["name"] for t in env.tools()]
    # the rest, from how to call a tool on, is the training variant's text
    assert text[text.index("\nTo call a tool"):] == full[full.index("\nTo call a tool"):]
    assert len(text) < len(full) / 2
