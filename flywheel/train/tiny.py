"""The tiny demo student: a BPE tokenizer trained on the environment's text and a small random Llama."""

from __future__ import annotations

import itertools
from pathlib import Path

from flywheel.config import TinyModelConfig
from flywheel.contract import Environment

IM_START, IM_END, PAD = "<|im_start|>", "<|im_end|>", "<pad>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END]
CONTROL_TOKENS = [TOOL_CALL_OPEN, TOOL_CALL_CLOSE]

# ChatML like Qwen's, but the tools are one short system line: the model is tiny and a conversation gets 128
# tokens. Each assistant turn's content and its end token sit inside {% generation %} so SFT (assistant-only
# loss) and the RL learner train the model to stop. Tool calls are written exactly as
# flywheel.policies.toolcalls.render_tool_call writes them; arguments given as a JSON string are written
# verbatim, so they must be canonical (json.dumps defaults; flywheel.policies.toolcalls.canonical_messages).
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='', tools='') -%}"
    "{%- if messages and messages[0].role == 'system' -%}{%- set ns.system = messages[0].content or '' -%}"
    "{%- endif -%}"
    "{%- if tools -%}"
    "{%- for tool in tools -%}"
    "{%- set fn = tool.function if tool.function is defined else tool -%}"
    "{%- set params = fn.parameters.properties if fn.parameters is defined and fn.parameters"
    " and fn.parameters.properties is defined else {} -%}"
    "{%- set ns.tools = ns.tools + ('; ' if not loop.first else 'Tools: ') + fn.name + '('"
    " + (params | list | join(', ')) + ')' -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- if ns.system or ns.tools -%}"
    "{{- '<|im_start|>system\\n' + ns.system + ('\\n' if ns.system and ns.tools else '') + ns.tools"
    " + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}"
    "{%- if not loop.first -%}{{- '<|im_start|>system\\n' + (message.content or '') + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}"
    "{{- message.content or '' -}}"
    "{%- if message.tool_calls -%}{%- for call in message.tool_calls -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{{- '<tool_call>{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' -}}"
    "{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}"
    "{{- '}</tool_call>' -}}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>' -}}"
    "{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def render_conversation(messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool = False) -> str:
    """A conversation as the tiny student's chat template writes it (text, before tokenizing); with
    add_generation_prompt, followed by the opening of the assistant's turn, as the student is prompted."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from flywheel.policies.toolcalls import canonical_messages

    rendered, _ = render_jinja_template(conversations=[canonical_messages(messages)], tools=tools or None,
                                        chat_template=CHAT_TEMPLATE, add_generation_prompt=add_generation_prompt)
    return rendered[0]


def environment_corpus(env: Environment, n: int = 2000, seed: int = 0) -> list[str]:
    """Texts of `n` oracle-solved conversations of the environment's generated tasks, to train a tokenizer on."""
    from flywheel.agent import Harness, Limits
    from flywheel.policies.oracle import OraclePolicy

    tasks = list(itertools.islice(env.generate_tasks(seed), n))
    # the default limits, not a pipeline's: the tokenizer's corpus is the same whatever a pipeline cuts at
    episodes = Harness(env, Limits()).run(OraclePolicy(env), tasks)
    tools = env.tools()
    return [render_conversation(e.messages, tools) for e in episodes]


def train_tokenizer(corpus: list[str], vocab_size: int, isolate_spaces: bool = False):
    """A byte-level BPE tokenizer with every digit its own token and the chat markers as single tokens.

    isolate_spaces: every space its own token, so no word token carries a leading space.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if not corpus:
        raise ValueError("the tokenizer corpus is empty: pass rendered conversations (environment_corpus)")
    tokenizer = Tokenizer(models.BPE())
    # Digits one by one: numbers are the payload here, and merged digit runs would make copying a tool result
    # into the answer a lookup of rare multi-digit tokens instead of a digit-by-digit copy.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        *([pre_tokenizers.Split(" ", behavior="isolated")] if isolate_spaces else []),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    # The markers are added before training so the trainer never sees their characters as text to merge.
    tokenizer.add_special_tokens([AddedToken(t, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in CONTROL_TOKENS])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=SPECIAL_TOKENS + CONTROL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=IM_END, pad_token=PAD,
                                   padding_side="left", model_max_length=1 << 16)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_student(corpus: list[str], cfg: TinyModelConfig, out_dir: Path) -> Path:
    """Train the tokenizer on `corpus`, make a randomly initialised small Llama, save both to `out_dir`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = train_tokenizer(corpus, cfg.vocab_size, cfg.isolate_spaces)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=4 * cfg.hidden_size,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True,
        # No BOS: the template starts every sequence with <|im_start|> already.
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(config)
    model.generation_config.bos_token_id = None
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
