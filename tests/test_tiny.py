"""The tiny student: its tokenizer, its chat template, its assistant mask, and loading it back."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from flywheel.checkpoints import CheckpointError, load_student
from flywheel.config import TinyModelConfig
from flywheel.policies.toolcalls import parse_completion, render_tool_call
from flywheel.train.encoding import encode_conversation
from flywheel.train.tiny import CHAT_TEMPLATE, build_tiny_student

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def call(expression: str, call_id: str = "call_0_0", as_dict: bool = False) -> dict:
    arguments = {"expression": expression}
    return {"id": call_id, "type": "function",
            "function": {"name": "calculator", "arguments": arguments if as_dict else json.dumps(arguments)}}


# Two tool rounds, the shape of the calculator environment's episodes (and tool_calls None as datasets give it).
CONVERSATION = [
    {"role": "user", "content": "What is 37 * 12 + 5?"},
    {"role": "assistant", "content": "", "tool_calls": [call("37 * 12")]},
    {"role": "tool", "tool_call_id": "call_0_0", "content": "444"},
    {"role": "assistant", "content": None, "tool_calls": [call("444 + 5", "call_1_0")]},
    {"role": "tool", "tool_call_id": "call_1_0", "content": "449"},
    {"role": "assistant", "content": "The answer is 449.", "tool_calls": None},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_student):
    return load_student(tiny_student)[1]


def assistant_text(message: dict) -> str:
    """What a model writes for this assistant message (before its end token)."""
    return (message.get("content") or "") + "".join(render_tool_call(c) for c in message.get("tool_calls") or [])


def test_saved_student_reloads_with_from_pretrained(tiny_student):
    tokenizer = AutoTokenizer.from_pretrained(tiny_student)
    model = AutoModelForCausalLM.from_pretrained(tiny_student, use_safetensors=True)
    assert (tiny_student / "model.safetensors").exists()
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert model.config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id is not None
    assert model.config.bos_token_id is None and model.config.tie_word_embeddings
    assert model.config.vocab_size == len(tokenizer)


def test_markers_are_single_tokens_and_digits_are_split(tokenizer):
    for marker in ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<pad>"]:
        assert len(tokenizer(marker, add_special_tokens=False)["input_ids"]) == 1, marker
    ids = tokenizer("12345 + 67890", add_special_tokens=False)["input_ids"]
    digits = [t for t in tokenizer.convert_ids_to_tokens(ids) if any(c.isdigit() for c in t)]
    assert digits == list("1234567890")
    assert tokenizer.decode(ids) == "12345 + 67890"


def test_template_renders_tools_calls_and_results(tokenizer):
    text = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert text == (
        "<|im_start|>system\nTools: calculator(expression)<|im_end|>\n"
        "<|im_start|>user\nWhat is 37 * 12 + 5?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "calculator", "arguments": {"expression": "37 * 12"}}'
        "</tool_call><|im_end|>\n"
        "<|im_start|>tool\n444<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "calculator", "arguments": {"expression": "444 + 5"}}'
        "</tool_call><|im_end|>\n"
        "<|im_start|>tool\n449<|im_end|>\n"
        "<|im_start|>assistant\nThe answer is 449.<|im_end|>\n")
    # The text of a call is exactly what render_tool_call writes, whether arguments are JSON text or a dict.
    assert render_tool_call(call("37 * 12")) in text
    as_dict = [dict(m, tool_calls=[call("37 * 12", as_dict=True)]) if i == 1 else m
               for i, m in enumerate(CONVERSATION)]
    assert tokenizer.apply_chat_template(as_dict, tools=TOOLS, tokenize=False) == text
    # A system prompt and the tool line share one system turn; no tools, no tool line.
    with_system = [{"role": "system", "content": "Be brief."}] + CONVERSATION[:1]
    assert tokenizer.apply_chat_template(with_system, tools=TOOLS, tokenize=False).startswith(
        "<|im_start|>system\nBe brief.\nTools: calculator(expression)<|im_end|>\n<|im_start|>user\n")
    assert tokenizer.apply_chat_template(CONVERSATION[:1], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nWhat is 37 * 12 + 5?<|im_end|>\n<|im_start|>assistant\n")


def test_assistant_mask_is_exactly_assistant_content_and_end_token(tokenizer):
    ids, mask = encode_conversation(tokenizer, CONVERSATION, TOOLS, max_length=512)
    tokens = tokenizer.convert_ids_to_tokens(ids)
    # Walk the tokens: a turn opens with <|im_start|> ROLE \n; an assistant turn's body and its <|im_end|>
    # are the only tokens that may carry loss.
    expected, role, i = [], None, 0
    while i < len(tokens):
        if tokens[i] == "<|im_start|>":
            role = tokens[i + 1]
            expected += [0, 0, 0]  # <|im_start|>, the role, the newline
            i += 3
            continue
        expected.append(int(role == "assistant"))
        if tokens[i] == "<|im_end|>":
            role = None
        i += 1
    assert mask == expected
    assert sum(mask) > 0 and tokens[-1] == "Ċ" and mask[-1] == 0
    masked = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert masked == "".join(assistant_text(m) + "<|im_end|>" for m in CONVERSATION if m["role"] == "assistant")


def test_generation_prompt_plus_generated_text_is_the_full_template(tokenizer):
    """The harness's view (prompt, then what the model generated) and SFT's view agree token for token."""
    for i, message in enumerate(CONVERSATION):
        if message["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(CONVERSATION[:i], tools=TOOLS, add_generation_prompt=True)["input_ids"]
        generated = tokenizer(assistant_text(message) + "<|im_end|>", add_special_tokens=False)["input_ids"]
        full = tokenizer.apply_chat_template(CONVERSATION[:i + 1], tools=TOOLS)["input_ids"]
        assert prompt + generated == full[:len(prompt) + len(generated)]
        # ...and the same after the harness parses the generated text back into a message.
        parsed = parse_completion(assistant_text(message), turn_id=f"call_{i}").message
        again = tokenizer.apply_chat_template(CONVERSATION[:i] + [parsed], tools=TOOLS)["input_ids"]
        assert again == full


def test_encode_conversation_truncates(tokenizer):
    ids, mask = encode_conversation(tokenizer, CONVERSATION, TOOLS, max_length=40)
    assert len(ids) == len(mask) == 40


def test_build_from_a_small_corpus_and_reload(tmp_path):
    corpus = ["<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\nThe answer is 3.<|im_end|>\n"] * 20
    path = build_tiny_student(corpus, TinyModelConfig(hidden_size=16, layers=1, heads=2, vocab_size=300), tmp_path)
    model, tokenizer = load_student(path)
    assert tokenizer.padding_side == "left" and not model.training
    assert model.num_parameters() < 50_000


def test_load_student_says_what_is_wrong(tmp_path, tiny_student):
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        load_student(tmp_path / "missing")
    broken = tmp_path / "no-template"
    broken.mkdir()
    for f in tiny_student.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    config = json.loads((broken / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (broken / "tokenizer_config.json").write_text(json.dumps(config))
    (broken / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match="no chat template"):
        load_student(broken)


def test_isolated_spaces_make_a_word_one_token_after_a_space_or_a_quote():
    """The support desk's email: `Hi! yara.fox@...` in the message, `"yara.fox@..."` in the tool call. By default
    the word after a space is another token (with the space) than after a quote; with isolate_spaces it is one."""
    from flywheel.train.tiny import train_tokenizer

    corpus = [f'Hi! {name}.fox@mail.com here. {{"email": "{name}.fox@mail.com"}}' for name in
              ["yara", "leo", "ana", "hugo"] * 20]

    def pieces(tok, text):
        return tok.convert_ids_to_tokens(tok(text)["input_ids"])

    plain, isolated = train_tokenizer(corpus, 400), train_tokenizer(corpus, 400, isolate_spaces=True)
    assert "yara" not in pieces(plain, "Hi! yara") and "yara" in pieces(plain, '"yara')
    assert "yara" in pieces(isolated, "Hi! yara") and "yara" in pieces(isolated, '"yara')
    for text in ['Hi! yara.fox@mail.com here. {"email": "yara.fox@mail.com"}', "order W9906, total 68.45"]:
        assert isolated.decode(isolated(text)["input_ids"]) == text  # nothing lost: spaces come back
