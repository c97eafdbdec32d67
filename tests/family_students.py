"""Random-init small checkpoints of real families (Qwen2, Llama) whose tokenizers carry the chat template text
TRL ships for matching, so SFT runs TRL's real template swap. Built in the test; nothing is downloaded."""

from __future__ import annotations

from itertools import islice
from pathlib import Path

from trl.chat_template_utils import llama3_chat_template, qwen2_5_chat_template

# name -> (template, special tokens, added non-special tokens, eos, pad, bos)
FAMILIES = {
    "qwen": (qwen2_5_chat_template, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], ["<tool_call>", "</tool_call>"],
             "<|im_end|>", "<|endoftext|>", None),
    "llama": (llama3_chat_template, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                     "<|finetune_right_pad_id|>"], [],
              "<|eot_id|>", "<|finetune_right_pad_id|>", "<|begin_of_text|>"),
}


def calculator_rows(n: int = 64, seed: int = 11) -> list[dict]:
    """Oracle-solved calculator conversations (two tool rounds for some), as the synthetic table holds them."""
    from flywheel.agent import Harness
    from flywheel.envs.calculator import CalculatorEnv
    from flywheel.policies.oracle import OraclePolicy

    env = CalculatorEnv()
    episodes = Harness(env).run(OraclePolicy(env), list(islice(env.generate_tasks(seed), n)))
    return [{"messages": e.messages, "tools": env.tools()} for e in episodes]


def build_family_student(family: str, out_dir: Path, rows: list[dict], template: str | None = None,
                         vocab_size: int = 600) -> Path:
    """A BPE tokenizer (the family's special tokens, trained on these conversations) and a random tiny model."""
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils.chat_template_utils import render_jinja_template

    from flywheel.policies.toolcalls import canonical_messages

    own, special, added, eos, pad, bos = FAMILIES[family]
    template = template or own
    corpus, _ = render_jinja_template(conversations=[canonical_messages(r["messages"]) for r in rows],
                                      tools=rows[0]["tools"], chat_template=template, bos_token=bos or "")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens([AddedToken(t, normalized=False) for t in special])
    bpe.add_tokens([AddedToken(t, normalized=False, special=False) for t in added])
    bpe.train_from_iterator(corpus, trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special + added, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=eos, pad_token=pad, bos_token=bos,
                                        model_max_length=1 << 16)
    tokenizer.chat_template = template
    shape = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                 tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                 bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**shape)) if family == "qwen" else LlamaForCausalLM(LlamaConfig(**shape))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
