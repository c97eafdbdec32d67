"""The `hf` policy: transformers `generate` on a local checkpoint or a live model, batched, with logprobs."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from flywheel.policies.base import Completion, Sampling
from flywheel.policies.toolcalls import parse_completion


class HFPolicy:
    """Assistant turns from a causal LM through its chat template: a checkpoint it loads, or a live model it shares."""

    name = "hf"

    def __init__(self, model_or_path, tokenizer=None, batch_size: int = 64, device: str = "auto",
                 precision: str = "fp32"):
        """A checkpoint path is loaded onto `device` (auto: CUDA when present); a live model stays where it is.

        precision: bf16 generates under bfloat16 autocast (the weights stay as they are): on a CPU with native
        bf16 about twice the tokens a second of fp32 (benchmarks/smol.py), greedy turns that may differ from
        fp32's where two tokens are nearly tied."""
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"precision: {precision!r} (fp32 or bf16)")
        if isinstance(model_or_path, (str, Path)):
            from flywheel.checkpoints import load_student
            from flywheel.devices import resolve_device

            target = resolve_device(device, f"hf policy for {model_or_path}")  # before loading: fail fast
            model, loaded_tokenizer = load_student(model_or_path)
            model_or_path = model.to(target)
            tokenizer = tokenizer or loaded_tokenizer
        if tokenizer is None:
            raise ValueError("HFPolicy needs a tokenizer when given a model object (or pass a checkpoint path)")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token: generation would never know where a turn ends")
        self.model = model_or_path
        self.tokenizer = tokenizer
        self.tokenizer.padding_side = "left"  # new tokens are appended on the right of every row
        self.batch_size = batch_size
        self.precision = precision

    def load_weights(self, state_dict) -> None:
        """Copy published weights (an RL learner's state dict) into the model in place."""
        self.model.load_state_dict(state_dict)

    def generate(self, conversations: Sequence[list[dict]], tools: list[dict],
                 sampling: Sampling) -> list[Completion]:
        """One completion per conversation, with the generated token ids and their sampling logprobs."""
        import torch

        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        completions: list[Completion] = []
        try:
            # fork_rng: a seeded call must not reset the caller's global random state
            with torch.inference_mode(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                if sampling.seed is not None:
                    torch.manual_seed(sampling.seed)
                for start in range(0, len(conversations), self.batch_size):
                    chunk = conversations[start:start + self.batch_size]
                    started = time.perf_counter()
                    generated = self._generate_chunk(chunk, tools, sampling, device)
                    # a batch shares its wall time: each turn is charged its share of it
                    for completion in generated:
                        completion.latency_s = (time.perf_counter() - started) / len(generated)
                    completions.extend(generated)
        finally:
            self.model.train(was_training)
        return completions

    def _generate_chunk(self, conversations: Sequence[list[dict]], tools: list[dict], sampling: Sampling,
                        device) -> list[Completion]:
        import torch

        from flywheel.policies.toolcalls import canonical_messages

        tok = self.tokenizer
        rendered = tok.apply_chat_template([canonical_messages(c) for c in conversations], tools=tools or None,
                                           add_generation_prompt=True, tokenize=True, return_dict=True)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        batch = _batch(rendered["input_ids"], pad, device)
        prefix = batch.pop("prefix", None)
        options: dict = {"do_sample": False}
        if sampling.temperature > 0:
            # Every knob explicit: a checkpoint's generation_config (top_k 50, a repetition penalty) must not
            # change the distribution behind the logprobs that the RL learner corrects against.
            options = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p,
                       "top_k": 0, "repetition_penalty": 1.0}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16"):
            cache = None
            if prefix is not None:  # the rows' common opening, read once for all of them
                cache = self.model(input_ids=prefix, use_cache=True).cache
                cache.batch_repeat_interleave(len(conversations))
            out = self.model.generate(
                **batch, cache=cache, max_new_tokens=sampling.max_new_tokens,
                eos_token_id=tok.eos_token_id, pad_token_id=pad, output_scores=True, return_dict_in_generate=True,
                **options)
        new_tokens = out.sequences[:, batch["input_ids"].shape[1]:]
        # out.scores are the processed logits (temperature and top_p applied): the distribution sampled from.
        logprobs = torch.stack([torch.log_softmax(s.float(), dim=-1).gather(1, new_tokens[:, i:i + 1]).squeeze(1)
                                for i, s in enumerate(out.scores)], dim=1)
        completions = []
        prompts = batch["attention_mask"].sum(dim=1).tolist()
        for row, row_logprobs, prompt in zip(new_tokens.tolist(), logprobs.tolist(), prompts, strict=True):
            ended = tok.eos_token_id in row
            length = row.index(tok.eos_token_id) + 1 if ended else len(row)
            ids = row[:length]
            text = tok.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
            completion = parse_completion(text)
            completion.token_ids = ids
            completion.logprobs = row_logprobs[:length]
            completion.usage = {"prompt_tokens": int(prompt), "completion_tokens": len(ids)}
            completions.append(completion)
        return completions


# Rows sharing an opening this long have it read once (a support desk prompt's first ~310 tokens are the policy
# and the tools); shorter ones are not worth a second forward pass.
SHARED_PREFIX_MIN = 32


def _batch(rows: list[list[int]], pad: int, device) -> dict:
    """The rows as one left-padded batch. Where they share an opening of SHARED_PREFIX_MIN tokens or more (the
    system prompt and the tools, in every turn of every episode), it is laid out as that opening, then each row's
    padding, then the rest of the row, and the opening is also given alone as `prefix`, to be read once into a
    cache for every row. Positions come from the attention mask, so a row's rest follows the opening as it would
    unpadded."""
    import torch

    shared = _common_prefix(rows)
    head = rows[0][:shared] if len(rows) > 1 and shared >= SHARED_PREFIX_MIN else []
    rests = [row[len(head):] for row in rows]
    width = max(len(r) for r in rests)
    ids = [head + [pad] * (width - len(r)) + r for r in rests]
    mask = [[1] * len(head) + [0] * (width - len(r)) + [1] * len(r) for r in rests]
    batch = {"input_ids": torch.tensor(ids, device=device), "attention_mask": torch.tensor(mask, device=device)}
    if head:
        batch["prefix"] = torch.tensor([head], device=device)
    return batch


def _common_prefix(rows: list[list[int]]) -> int:
    """How many leading tokens every row has in common, leaving each row at least its last token to read."""
    shortest = min(len(r) for r in rows)
    n = 0
    while n < shortest - 1 and all(r[n] == rows[0][n] for r in rows):
        n += 1
    return n
