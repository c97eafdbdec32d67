"""The `hf` policy: a causal LM on a local checkpoint or a live model, batched, with logprobs, through the project's
own decode loop (flywheel.policies.decoding): finished rows leave the batch, and a conversation's next turn reads
only what its kept cache does not hold."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from flywheel.policies.base import Completion, Sampling
from flywheel.policies.continuing import Next, decode_episodes
from flywheel.policies.decoding import Decoded, DecodeStats, KeptCaches, Source, decode, plain_model
from flywheel.policies.shared_prefix import SharedPrefix, use_shared_prefix
from flywheel.policies.toolcalls import parse_completion

# Kept caches between calls. A token costs 2 x layers x kv_heads x head_dim x 4 bytes in fp32 (2 in bf16, where
# the cache is kept in autocast's dtype): SmolLM2-135M 46 KB, so 1 GiB holds ~23,000 tokens, 32 support-desk
# conversations of ~700 tokens (a turn's batch in evaluate and RL; twice that in bf16); the tiny student 2-8 KB,
# thousands of conversations. Rows past it are read whole again.
KEPT_BYTES = 1 << 30


class HFPolicy:
    """Assistant turns from a causal LM through its chat template: a checkpoint it loads, or a live model it shares."""

    name = "hf"

    def __init__(self, model_or_path, tokenizer=None, batch_size: int = 64, device: str = "auto",
                 precision: str = "fp32", kept_bytes: int = KEPT_BYTES, continuous: bool = True,
                 shared_prefix: bool = True):
        """A checkpoint path is loaded onto `device` (auto: CUDA when present); a live model stays where it is.

        precision: bf16 generates under bfloat16 autocast (the weights stay as they are, cast once a call; the
        cache kept in bf16): on a CPU with native bf16 about twice the tokens a second of fp32
        (benchmarks/smol.py), greedy turns that may differ from fp32's where two tokens are nearly tied.
        kept_bytes: the most memory finished rows' caches keep between calls for the next turn of their
        conversation (0: every turn is read whole). continuous: the harness's episodes go on in one batch from
        turn to turn (continues_turns; not with kept_bytes 0). shared_prefix: on a CPU, the opening a batch's rows
        share (the system prompt and tools) is held once and attended to once for all rows
        (flywheel.policies.shared_prefix), not copied into every row's cache."""
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
        self.tokenizer.padding_side = "left"  # as a batch of the tokenizer is laid out (the loop pads itself)
        self.batch_size = batch_size
        self.precision = precision
        # A model with sliding-window or linear layers gets neither kept caches nor the opening read once.
        self.plain = plain_model(self.model)
        self.kept = KeptCaches(kept_bytes if self.plain else 0)
        self.continuous = continuous and self.plain and kept_bytes > 0
        self.shared_prefix = shared_prefix and self.plain and use_shared_prefix(self.model)
        self.stats = DecodeStats()
        self._lock = threading.Lock()

    def load_weights(self, state_dict) -> None:
        """Copy published weights (an RL learner's state dict) into the model in place; the kept caches go."""
        self.model.load_state_dict(state_dict)
        self.forget()

    def forget(self) -> None:
        """Drop the kept caches (they are also dropped whenever the model's parameters change)."""
        with self._lock:
            self.kept.clear()

    @property
    def continues_turns(self) -> bool:
        """Whether `generate` takes `then`: whole episodes in one batch (flywheel.policies.continuing)."""
        return self.continuous

    def generate(self, conversations: Sequence[list[dict]], tools: list[dict], sampling: Sampling,
                 then: Callable[[int, Completion], tuple[list[dict], int] | None] | None = None
                 ) -> list[Completion]:
        """One completion per conversation, with the generated token ids and their sampling logprobs.

        then(i, completion): the harness's answer to conversation i's turn, its conversation as it now reads to
        go on with (the turn, its tool results, the user's reply) and the most tokens the next turn may take, or
        None where the episode is over; given it,
        every conversation goes on in the same batch until its episode ends (continues_turns), and the last
        completion of each is returned."""
        import torch

        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        completions: list[Completion] = []
        with self._lock:
            self.kept.start(self.model)
        try:
            # fork_rng: a seeded call must not reset the caller's global random state. no_grad, not
            # inference_mode: under inference_mode autocast casts every weight again at every linear call (its cache
            # of cast weights is off there), which was most of a bf16 decode step's time on a CPU.
            with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                if sampling.seed is not None:
                    torch.manual_seed(sampling.seed)
                if then is not None:
                    return self._episodes(conversations, tools, sampling, device, then)
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
            with self._lock:
                self.kept.finish()
        return completions

    def _generate_chunk(self, conversations: Sequence[list[dict]], tools: list[dict], sampling: Sampling,
                        device) -> list[Completion]:
        import torch

        tok = self.tokenizer
        rows = self._render(conversations, tools)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        constraints = self._constraints(tools, sampling, len(rows))

        def keep(row: int, ids: list[int], layers) -> None:
            with self._lock:
                self.stats.kept_rows += self.kept.add(ids, layers)

        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16"):
            sources, prefix = self._sources(rows, device)
            decoded = decode(self.model, sources, sampling, tok.eos_token_id, pad, constraints, self.stats,
                             keep=keep if self.kept.max_bytes else None, prefix=prefix)
        return [self._completion(len(ids_in), row) for ids_in, row in zip(rows, decoded, strict=True)]

    def _render(self, conversations: Sequence[list[dict]], tools: list[dict]) -> list[list[int]]:
        """Each conversation's token ids through the chat template, up to the assistant's next turn."""
        from flywheel.policies.toolcalls import canonical_messages

        return self.tokenizer.apply_chat_template([canonical_messages(c) for c in conversations],
                                                  tools=tools or None, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"]

    def _completion(self, prompt_tokens: int, row: Decoded) -> Completion:
        tok = self.tokenizer
        ended = row.token_ids[-1] == tok.eos_token_id
        completion = parse_completion(tok.decode(row.token_ids[:-1] if ended else row.token_ids,
                                                 skip_special_tokens=False))
        completion.token_ids, completion.logprobs = row.token_ids, row.logprobs
        completion.masks = row.masks or None
        completion.usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(row.token_ids)}
        return completion

    def _episodes(self, conversations: Sequence[list[dict]], tools: list[dict], sampling: Sampling, device,
                  then: Callable[[int, Completion], tuple[list[dict], int] | None]) -> list[Completion]:
        """Every conversation to the end of its episode in one batch of at most batch_size rows (generate's
        `then`)."""
        import torch

        if not conversations:
            return []
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        rows = self._render(conversations, tools)
        constraints = self._constraints(tools, sampling, len(rows)) or [None] * len(rows)
        sources, prefix = self._sources(rows, device)
        prompts, started = [len(r) for r in rows], [time.perf_counter()] * len(rows)
        last: list[Completion | None] = [None] * len(rows)

        def ended(key: int, decoded: Decoded) -> Next | None:
            completion = self._completion(prompts[key], decoded)
            completion.latency_s = time.perf_counter() - started[key]
            last[key] = completion
            going_on = then(key, completion)
            if going_on is None:
                return None
            conversation, max_new_tokens = going_on
            [ids] = self._render([conversation], tools)
            prompts[key], started[key] = len(ids), time.perf_counter()
            return Next(ids, max_new_tokens, (self._constraints(tools, sampling, 1) or [None])[0])

        first = min(len(rows), self.batch_size)
        waiting = deque((i, sources[i], constraints[i]) for i in range(first, len(rows)))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16"):
            decode_episodes(self.model, sources[:first], constraints[:first], sampling, tok.eos_token_id, pad,
                            self.stats, ended, waiting, prefix)
        return last

    def _sources(self, rows: list[list[int]], device) -> tuple[list[Source], SharedPrefix | None]:
        """Each row with the longest kept cache it begins with; rows that share an opening longer than theirs (the
        system prompt and tools) read it once for all of them. With shared_prefix, that opening is the batch's
        prefix, held once, and each source is the row after it (None where no opening is shared)."""
        sources = []
        for ids in rows:
            with self._lock:
                entry, n = self.kept.best(ids) if self.kept.max_bytes else (None, 0)
            sources.append(Source(ids, n, entry.layers if entry is not None else None))
        shared = _common_prefix(rows)
        if not (self.plain and len(rows) > 1 and shared >= SHARED_PREFIX_MIN):
            return sources, None
        if self.shared_prefix:
            return self._after_prefix(sources, shared, device)
        if any(s.reuse < shared for s in sources):
            opening = self._read_opening(rows[0][:shared], device)
            for source in sources:
                if source.reuse < shared:
                    source.reuse, source.layers = shared, opening
        return sources, None

    def _read_opening(self, ids: list[int], device) -> list[tuple]:
        """The opening's keys and values per layer [kv_heads, len(ids), head_dim], read in one forward pass."""
        import torch

        cache = self.model(input_ids=torch.tensor([ids], device=device), use_cache=True).cache
        self.stats.read_tokens += len(ids)
        return [(layer.keys[0], layer.values[0]) for layer in cache.layers]

    def _after_prefix(self, sources: list[Source], shared: int, device) -> tuple[list[Source], SharedPrefix]:
        """The rows' opening as the batch's prefix (from a kept cache that holds it, else read once), and each row
        after it: its kept cache's part past the opening, where it has one."""
        import torch

        holder = next((s for s in sources if s.reuse >= shared), None)
        opening = ([(k[..., :shared, :], v[..., :shared, :]) for k, v in holder.layers] if holder is not None
                   else self._read_opening(sources[0].ids[:shared], device))
        # in the dtype attention reads it in (bf16 under autocast), once, not at every layer of every step
        dtype = torch.bfloat16 if self.precision == "bf16" else opening[0][0].dtype
        prefix = SharedPrefix(list(sources[0].ids[:shared]), [(k[None].to(dtype), v[None].to(dtype))
                                                              for k, v in opening])
        after = []
        for source in sources:
            own = source.reuse - shared
            layers = [(k[..., shared:source.reuse, :], v[..., shared:source.reuse, :]) for k, v in source.layers
                      ] if own > 0 else None
            after.append(Source(source.ids[shared:], max(own, 0), layers))
        return after, prefix

    def _constraints(self, tools: list[dict], sampling: Sampling, n_rows: int) -> list | None:
        """The rows' tool-call constraints (flywheel.policies.constrained) when sampling asks for them."""
        if not sampling.constrained:
            return None
        from flywheel.policies.constrained import row_constraints  # llguidance: loaded only when asked for

        vocab = self.model.get_output_embeddings().weight.shape[0]
        return row_constraints(self.tokenizer, tools, sampling.tool_choice, n_rows, vocab)


# Rows sharing an opening this long have it read once (a support desk prompt's first ~310 tokens are the policy
# and the tools); shorter ones are not worth a second forward pass.
SHARED_PREFIX_MIN = 32


def _common_prefix(rows: list[list[int]]) -> int:
    """How many leading tokens every row has in common, leaving each row at least its last token to read."""
    shortest = min(len(r) for r in rows)
    n = 0
    while n < shortest - 1 and all(r[n] == rows[0][n] for r in rows):
        n += 1
    return n
