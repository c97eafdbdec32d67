"""A timed probe of the chosen student on this machine: how fast it trains, reads and writes tokens here.

`flywheel check` turns it into each stage's estimated time (flywheel/estimate.py). The probe loads the student
(the tiny one is built at random from its config: it does not exist before SFT), then times training steps
(forward, backward, optimiser; LoRA when SFT uses it) and forward passes of two shapes, a short row and a larger
part, which draw a line: a fixed cost a step plus a cost a token, so any batch's step follows from it; and
single-token decode steps with a kept cache at three batch sizes. Each is timed in rounds (each round times every
one once). It takes seconds; the result is kept under .flywheel/probe/, keyed by the student, what its step
depends on (LoRA, precision), this machine and torch's thread count, so a second check (or another pipeline with
the same student) reads it.
"""

from __future__ import annotations

import fcntl
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
# after DECODE_CONTEXT tokens read once (a longer context costs a small student's step little: SmolLM2's attention
# over 600 tokens is a tenth of its step; reading 64 rows of 32 tokens was a fifth of its probe).
DECODE_BATCHES = (1, 8, 64)
DECODE_CONTEXT = 8
# Training and forward steps are timed on SHORT (rows, tokens) and PART: a step of any shape is on the line through
# them. Both ends matter: a pretrained student with LoRA pays a large fixed cost a step (SmolLM2's 30 layers: a
# third of a second, whatever the length; scaling one short row by its tokens alone put a 12 s step at 40 s), a
# tiny one almost nothing but that.
SHORT, PART = (1, 64), (2, 256)
PROBE_FORM = 3  # the probe's method: a record an older one kept is measured again
# Rounds of every measurement in turn (_rounds): at least ROUNDS, more while within ROUNDS_S, at most MAX_ROUNDS;
# the fastest of each counts, the least disturbed by whatever else runs here (or by a first call's allocations).
ROUNDS, ROUNDS_S, MAX_ROUNDS = 3, 2.0, 12


@dataclass(frozen=True)
class Speed:
    """The student's measured speed on this machine: a training and a forward step of any shape (a fixed cost a
    step plus a cost a token), decode steps, loading."""

    student: str
    machine: str
    threads: int
    train_fixed_s: float  # forward + backward + optimiser step (LoRA when sft.lora is set): whatever its length ...
    train_token_s: float  # ... plus this a token
    forward_fixed_s: float  # a forward pass, no gradients: the same two parts
    forward_token_s: float
    decode_step_s: dict[int, float]  # one new token for every row of a batch of this size, with a kept cache
    load_s: float  # loading (or building) the student, its libraries already imported
    cached: bool = False  # read from .flywheel/probe/ rather than measured now

    def train_step_s(self, tokens: float) -> float:
        """Seconds for one training step over a batch of `tokens` tokens (padding included)."""
        return self.train_fixed_s + self.train_token_s * tokens

    def train_time(self, tokens: float, steps: float = 1) -> float:
        """Seconds of `steps` training steps over `tokens` tokens in all."""
        return steps * self.train_fixed_s + self.train_token_s * tokens

    def forward_time(self, tokens: float, passes: float = 1) -> float:
        """Seconds of `passes` forward passes over `tokens` tokens in all."""
        return passes * self.forward_fixed_s + self.forward_token_s * tokens

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


def probe_key(cfg: PipelineConfig, threads: int) -> str:
    """What a measurement depends on: the student (its tiny config), LoRA, precision, the machine, the threads."""
    student = cfg.student.model_dump(mode="json", include={"model", "tiny"} if cfg.student.model == "tiny"
                                     else {"model"})
    lora = cfg.sft.lora.model_dump(mode="json", include={"r", "target_modules"}) if cfg.sft.lora else None
    text = json.dumps([student, lora, cfg.sft.precision, machine(), threads, SHORT, PART, DECODE_BATCHES,
                       DECODE_CONTEXT, PROBE_FORM], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def measure(cfg: PipelineConfig, root: Path, refresh: bool = False) -> Speed:
    """The student's speed here (cfg with `auto` resolved): from .flywheel/probe/ when measured before."""
    import torch

    threads = torch.get_num_threads()
    folder = Path(os.environ.get("FLYWHEEL_PROBE_DIR") or Path(root) / PROBE_DIR)
    path = folder / f"{probe_key(cfg, threads)}.json"
    folder.mkdir(parents=True, exist_ok=True)
    # One probe of a student at a time: a second check started meanwhile waits and reads its record (two probes
    # at once would also slow each other, and both would be kept slow).
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file() and not refresh:
            try:
                data = json.loads(path.read_text())
                data["decode_step_s"] = {int(k): v for k, v in data["decode_step_s"].items()}
                return Speed(**(data | {"cached": True}))
            except (ValueError, TypeError, KeyError):
                pass  # a damaged or older record: measured again
        speed = _timed(cfg, root, threads)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(speed), indent=1, sort_keys=True))
        tmp.replace(path)
        return speed


def _timed(cfg: PipelineConfig, root: Path, threads: int) -> Speed:
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

    short, part = (torch.randint(0, vocab, shape, generator=generator) for shape in (SHORT, PART))
    model.train()
    train_step(short)  # the first step also allocates: a warm-up
    model.eval()
    caches = {b: _decode_cache(model, vocab, b, generator) for b in DECODE_BATCHES}
    steps = {"train_short": lambda: train_step(short), "train_part": lambda: train_step(part),
             "forward_short": lambda: forward(short), "forward_part": lambda: forward(part),
             **{b: lambda b=b: _decode_step(model, caches, b, vocab, generator) for b in DECODE_BATCHES}}
    fastest = _rounds(steps, model)
    train = _line(fastest["train_short"], fastest["train_part"])
    reading = _line(fastest["forward_short"], fastest["forward_part"])
    reading = (min(reading[0], train[0]), min(reading[1], train[1]))  # no forward pass is slower than a step
    # more rows never take less time a step: a smaller batch measured slower was disturbed, and is bounded
    decode = {b: min(fastest[c] for c in DECODE_BATCHES if c >= b) for b in DECODE_BATCHES}
    return Speed(student=cfg.student.model, machine=machine(), threads=threads, train_fixed_s=train[0],
                 train_token_s=train[1], forward_fixed_s=reading[0], forward_token_s=reading[1],
                 decode_step_s=decode, load_s=load_s)


def _line(short_s: float, part_s: float) -> tuple[float, float]:
    """(fixed seconds a step, seconds a token) through the SHORT step's time and the PART step's. Where they draw
    no rising line with a fixed cost of 0 or more (disturbed, or all fixed cost), all is a cost a token at the
    part's rate, the larger figure for the larger steps a stage takes."""
    small, large = SHORT[0] * SHORT[1], PART[0] * PART[1]
    if part_s <= short_s:
        return 0.0, part_s / large
    per_token = (part_s - short_s) / (large - small)
    fixed = short_s - per_token * small
    return (fixed, per_token) if fixed >= 0 else (0.0, part_s / large)


def _rounds(steps: dict, model) -> dict:
    """The fastest time of each step (which times itself) over rounds that take each in turn: something else
    running on the machine for a second slows one round of every step, not every repeat of one step. At least
    ROUNDS rounds, more while they add up to under ROUNDS_S, at most MAX_ROUNDS. The first round counts too: a first
    call's allocations make it slower, never faster, and the fastest is kept (a warm-up round of its own was a
    quarter of a pretrained student's probe)."""
    fastest = dict.fromkeys(steps, float("inf"))
    started, done = time.perf_counter(), 0
    while done < ROUNDS or (time.perf_counter() - started < ROUNDS_S and done < MAX_ROUNDS):
        for key, step in steps.items():
            model.train(str(key).startswith("train"))
            fastest[key] = min(fastest[key], step())
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
