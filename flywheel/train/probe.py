"""A timed probe of the chosen student on this machine: how fast it trains, reads and writes tokens here.

`flywheel check` turns it into each stage's estimated time (flywheel/estimate.py). The probe loads the student
(the tiny one is built at random from its config: it does not exist before SFT), then times a training step
(forward, backward, optimiser; LoRA when SFT uses it) and a forward pass of SFT's batch shape, and single-token
decode steps with a kept cache at three batch sizes, in rounds (each round times every one once). It takes
seconds; the result is kept under .flywheel/probe/,
keyed by the student, what its step depends on (LoRA, precision, the batch's shape), this machine and torch's
thread count, so a second check reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from flywheel.config import PipelineConfig

PROBE_DIR = ".flywheel/probe"  # under the project root; FLYWHEEL_PROBE_DIR names another folder (a test session's)
# Decode steps are timed at these batch sizes (64: the hf policy's batch), between them on a straight line, each
# after DECODE_CONTEXT tokens read once.
DECODE_BATCHES = (1, 8, 64)
DECODE_CONTEXT = 32
# A training (or forward) step is timed at SFT's width with its whole batch, or, where that step would take longer
# than STEP_BUDGET_S, with the largest power-of-two part of the batch that does not (one row cut shorter if even
# one full row would), scaled up by the tokens: a large student is compute-bound (its time grows with the
# tokens), a tiny one is bound by each call's fixed cost (and then timed whole).
STEP_BUDGET_S = 0.5
# Rounds of every measurement in turn (_rounds): a warm-up, then at least ROUNDS, more while within ROUNDS_S, at
# most MAX_ROUNDS; the fastest of each counts, the least disturbed by whatever else runs here.
ROUNDS, ROUNDS_S, MAX_ROUNDS = 3, 2.0, 12


@dataclass(frozen=True)
class Speed:
    """The student's measured speed on this machine: a training and a forward step of SFT's shape, decode steps,
    loading."""

    student: str
    machine: str
    threads: int
    batch: int  # SFT's batch ...
    width: int  # ... of rows this many tokens long: the step timed
    train_step_s: float  # forward + backward + optimiser step of that batch (LoRA when sft.lora is set)
    forward_step_s: float  # a forward pass of that batch, no gradients
    timed_rows: int  # the rows actually timed, each timed_width tokens (the step scaled up from them by the tokens
    timed_width: int  # when fewer than batch x width)
    decode_step_s: dict[int, float]  # one new token for every row of a batch of this size, with a kept cache
    load_s: float  # loading (or building) the student, its libraries already imported
    cached: bool = False  # read from .flywheel/probe/ rather than measured now

    @property
    def train_tokens_per_s(self) -> float:
        return self.batch * self.width / self.train_step_s

    @property
    def forward_tokens_per_s(self) -> float:
        return self.batch * self.width / self.forward_step_s

    def train_time(self, tokens: float) -> float:
        """Seconds of training steps over `tokens` tokens (at the timed step's rate)."""
        return tokens / self.train_tokens_per_s

    def forward_time(self, tokens: float) -> float:
        """Seconds of forward passes over `tokens` tokens."""
        return tokens / self.forward_tokens_per_s

    def decode_s(self, batch: int) -> float:
        """Seconds for one decode step of a batch of `batch` rows: on the straight line between the two measured
        batch sizes around it (past the largest, the last two's line)."""
        points = sorted(self.decode_step_s.items())
        (b1, t1), (b2, t2) = next(((p, q) for p, q in zip(points, points[1:], strict=False) if batch <= q[0]),
                                  points[-2:])
        return max(min(t1, t2), t1 + (t2 - t1) / (b2 - b1) * (batch - b1))


def machine() -> str:
    """This machine as the probe's cache knows it: host, CPU model, cores."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()} | {cpu} | {os.cpu_count()} cores"


def probe_key(cfg: PipelineConfig, threads: int, width: int) -> str:
    """What a measurement depends on: the student (its tiny config), LoRA, precision, SFT's batch and width, the
    machine, the threads."""
    student = cfg.student.model_dump(mode="json", include={"model", "tiny"} if cfg.student.model == "tiny"
                                     else {"model"})
    lora = cfg.sft.lora.model_dump(mode="json", include={"r", "target_modules"}) if cfg.sft.lora else None
    text = json.dumps([student, lora, cfg.sft.precision, cfg.sft.batch_size, width, machine(), threads,
                       DECODE_BATCHES, DECODE_CONTEXT], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def measure(cfg: PipelineConfig, root: Path, width: float, refresh: bool = False) -> Speed:
    """The student's speed here (cfg with `auto` resolved) on SFT batches of rows `width` tokens long: from
    .flywheel/probe/ when measured before."""
    import torch

    threads = torch.get_num_threads()
    width = max(8, round(width / 8) * 8)  # (a few tokens more or less is the same probe)
    folder = Path(os.environ.get("FLYWHEEL_PROBE_DIR") or Path(root) / PROBE_DIR)
    path = folder / f"{probe_key(cfg, threads, width)}.json"
    if path.is_file() and not refresh:
        try:
            data = json.loads(path.read_text())
            data["decode_step_s"] = {int(k): v for k, v in data["decode_step_s"].items()}
            return Speed(**(data | {"cached": True}))
        except (ValueError, TypeError, KeyError):
            pass  # a damaged or older record: measured again
    speed = _timed(cfg, root, threads, width)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(speed), indent=1, sort_keys=True))
    tmp.replace(path)
    return speed


def _timed(cfg: PipelineConfig, root: Path, threads: int, width: int) -> Speed:
    import torch
    import transformers  # noqa: F401 - imported once a process: not part of loading the student

    if cfg.sft.lora is not None:
        import peft  # noqa: F401
    started = time.perf_counter()
    model = _student(cfg, root)
    load_s = time.perf_counter() - started
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.sft.precision == "bf16")
    optimiser = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)

    def forward(ids) -> float:
        started = time.perf_counter()
        with torch.no_grad(), autocast:
            model(input_ids=ids)
        return time.perf_counter() - started

    def train_step(ids) -> float:
        started = time.perf_counter()
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimiser.step()
        optimiser.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    batch = cfg.sft.batch_size
    model.train()
    short = min(width, 64)
    one = torch.randint(0, vocab, (1, short), generator=generator)
    train_step(one)  # the first step also allocates: a warm-up
    row_s = train_step(one) * width / short  # one row of the full width, about
    rows, timed_width = 1, width
    if row_s * batch <= 2 * STEP_BUDGET_S:
        rows = batch  # the whole batch is close enough: timed whole
    elif row_s <= STEP_BUDGET_S:
        while rows * 2 <= batch and row_s * rows * 2 <= STEP_BUDGET_S:
            rows *= 2
    else:  # a large student: one row, cut to what fits the budget (its time grows with the tokens)
        timed_width = max(short, int(width * STEP_BUDGET_S / row_s) // 8 * 8)
    ids = torch.randint(0, vocab, (rows, timed_width), generator=generator)
    scale = batch * width / (rows * timed_width)
    model.eval()
    caches = {b: _decode_cache(model, vocab, b, generator) for b in DECODE_BATCHES}
    steps = {"train": lambda: train_step(ids), "forward": lambda: forward(ids),
             **{b: lambda b=b: _decode_step(model, caches, b, vocab, generator) for b in DECODE_BATCHES}}
    fastest = _rounds(steps, model)
    train_s = fastest["train"] * scale
    forward_s = min(fastest["forward"], fastest["train"]) * scale  # (no forward is slower than a step)
    # more rows never take less time a step: a smaller batch measured slower was disturbed, and is bounded
    decode = {b: min(fastest[c] for c in DECODE_BATCHES if c >= b) for b in DECODE_BATCHES}
    return Speed(student=cfg.student.model, machine=machine(), threads=threads, batch=batch, width=width,
                 train_step_s=train_s, forward_step_s=forward_s, timed_rows=rows, timed_width=timed_width,
                 decode_step_s=decode,
                 load_s=load_s)


def _rounds(steps: dict, model) -> dict:
    """The fastest time of each step (which times itself) over rounds that take each in turn: something else
    running on the machine for a second slows one round of every step, not every repeat of one step. At least
    ROUNDS rounds, more while they add up to under ROUNDS_S, at most MAX_ROUNDS; the first round is a warm-up."""
    fastest = dict.fromkeys(steps, float("inf"))
    started, done = time.perf_counter(), -1
    while done < ROUNDS or (time.perf_counter() - started < ROUNDS_S and done < MAX_ROUNDS):
        for key, step in steps.items():
            model.train(key == "train")
            took = step()
            if done >= 0:
                fastest[key] = min(fastest[key], took)
        done += 1
    model.eval()
    return fastest


def _decode_cache(model, vocab: int, batch: int, generator):
    """The keys and values of DECODE_CONTEXT tokens in `batch` rows, read once: decode steps extend it."""
    import torch

    with torch.no_grad():
        return model(input_ids=torch.randint(0, vocab, (batch, DECODE_CONTEXT), generator=generator),
                     use_cache=True).cache


def _decode_step(model, caches: dict, batch: int, vocab: int, generator) -> float:
    """Seconds for one new token for every row of the kept cache of `batch` rows (which grows by it)."""
    import torch

    token = torch.randint(0, vocab, (batch, 1), generator=generator)
    with torch.no_grad():
        started = time.perf_counter()
        caches[batch] = model(input_ids=token, cache=caches[batch], use_cache=True).cache
        return time.perf_counter() - started


def _student(cfg: PipelineConfig, root: Path):
    """The model SFT will train: the tiny student built at random from student.tiny (its tokenizer is trained in
    SFT: the vocabulary is the config's), else the named checkpoint; LoRA over it when sft.lora is set."""
    import torch

    if cfg.student.model == "tiny":
        from transformers import LlamaConfig, LlamaForCausalLM

        tiny = cfg.student.tiny
        torch.manual_seed(tiny.seed)
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=tiny.vocab_size, hidden_size=tiny.hidden_size, intermediate_size=4 * tiny.hidden_size,
            num_hidden_layers=tiny.layers, num_attention_heads=tiny.heads, num_key_value_heads=tiny.heads,
            max_position_embeddings=tiny.max_position_embeddings, tie_word_embeddings=True, bos_token_id=None))
    else:
        from flywheel.checkpoints import load_student
        from flywheel.data.catalog import named_model

        model, _ = load_student(named_model(root, cfg.student.model))
    if cfg.sft.lora is not None:
        from peft import LoraConfig, get_peft_model

        lora = cfg.sft.lora
        model = get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=lora.target_modules,
                                                 task_type="CAUSAL_LM"))
    return model
