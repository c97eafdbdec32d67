"""Distillation SFT: TRL's SFTTrainer on conversations, loss on assistant tokens only, resumable.

The conversations are tokenised here, with the training template the student will ship (flywheel.train.templates)
and the RL learner's encode_conversation, so SFT, RL and the harness see the same tokens; long ones are cut or
dropped by sft.long_conversations and counted. Full fine-tuning or LoRA/QLoRA (peft); in this process or under
`accelerate launch` (DDP/FSDP, flywheel.train.sft_launch).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from flywheel.checkpoints import load_student, save_student
from flywheel.config import SFTConfig
from flywheel.metrics import SFT_LAST_LOSS
from flywheel.policies.toolcalls import canonical_messages
from flywheel.train.encoding import encode_conversation
from flywheel.train.sft_validation import Validate
from flywheel.train.templates import training_template

FINGERPRINT = "flywheel-sft.json"


def sft_records(rows: list[dict]) -> list[dict]:
    """Rows as the SFT dataset holds them: canonical messages, and tools as JSON text."""
    records = []
    for i, row in enumerate(rows):
        if not row.get("messages"):
            raise ValueError(f"SFT row {i} has no 'messages'")
        tools = row.get("tools") or []
        # Arrow would unify every row's tool schemas into one struct type (filling absent keys with None), so
        # tools travel as text; TRL's tokenize step json.loads a string `tools` column.
        records.append({"messages": canonical_messages(row["messages"]),
                        "tools": tools if isinstance(tools, str) else json.dumps(tools, ensure_ascii=False)})
    return records


def _fingerprint(base_dir: Path | str, records: list[dict], cfg: SFTConfig, template: str) -> str:
    digest = hashlib.sha256(str(base_dir).encode() + template.encode())
    if Path(base_dir).is_dir():  # the base's weights and config, not only its name: a rebuilt base is new
        for file in sorted(Path(base_dir).iterdir()):
            if file.name.endswith((".safetensors", ".json", ".jinja")):
                digest.update(file.name.encode() + file.read_bytes())
    digest.update(json.dumps(records, sort_keys=True).encode())
    # how the run is launched does not change what it computes: a DDP rerun may resume a single-process one
    digest.update(cfg.model_dump_json(exclude={"launcher", "processes"}).encode())
    return digest.hexdigest()[:16]


def _resume_point(checkpoints: Path, fingerprint: str) -> str | None:
    """The last checkpoint of an interrupted run with the same inputs; checkpoints of other inputs are removed."""
    from transformers.trainer_utils import get_last_checkpoint

    marker = checkpoints / FINGERPRINT
    if checkpoints.exists() and (not marker.exists() or json.loads(marker.read_text())["fingerprint"] != fingerprint):
        shutil.rmtree(checkpoints)  # a different model, data or config: resuming would mix runs
    checkpoints.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"fingerprint": fingerprint}))
    for partial in _partial_checkpoints(checkpoints):
        shutil.rmtree(partial, ignore_errors=True)  # ranks clear them together: one may find it already gone
    return get_last_checkpoint(str(checkpoints))


def _partial_checkpoints(checkpoints: Path) -> list[Path]:
    """Checkpoints a kill cut short. The Trainer writes trainer_state.json last; until it parses, the save was not
    whole, and resuming from it would fail or mix a half-written optimizer state into the run."""
    partial = []
    for checkpoint in checkpoints.glob("checkpoint-*"):
        try:
            json.loads((checkpoint / "trainer_state.json").read_text())["global_step"]
        except (OSError, ValueError, KeyError, TypeError):
            partial.append(checkpoint)
    return partial


@contextmanager
def _quiet_progress():
    """No per-step or per-file progress bars from datasets/transformers: the caller prints through on_log."""
    import datasets
    from transformers.utils import logging as hf_logging

    bars = datasets.is_progress_bar_enabled(), hf_logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars[0]:
            datasets.enable_progress_bars()
        if bars[1]:
            hf_logging.enable_progress_bar()



@dataclass
class Examples:
    """Tokenised conversations (input_ids, labels) split into train and held-out, with what the length rule did."""

    train: list[dict] = field(default_factory=list)
    heldout: list[dict] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)


def is_heldout(record: dict, fraction: float) -> bool:
    """Held out by a stable hash of the conversation's content, never by its position in the table."""
    digest = hashlib.sha256(json.dumps(record, sort_keys=True, ensure_ascii=False).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def tokenize_records(tokenizer, records: list[dict], cfg: SFTConfig, chat_template: str) -> Examples:
    """Token ids and assistant-only labels, the RL learner's tokenisation; long ones cut or dropped, counted."""
    examples = Examples(counts={"conversations": len(records), "truncated": 0, "dropped_long": 0,
                                "dropped_no_target": 0})
    longest_prompt = 0  # tokens before a conversation's first assistant token, the longest: what max_length must pass
    for i, record in enumerate(records):
        try:
            ids, mask = encode_conversation(tokenizer, record["messages"], json.loads(record["tools"]) or None,
                                            max_length=1 << 30, chat_template=chat_template)
        except ValueError as err:
            raise ValueError(f"SFT row {i}: {err}") from err
        longest_prompt = max(longest_prompt, mask.index(1))
        if len(ids) > cfg.max_length:
            if cfg.long_conversations == "drop":
                examples.counts["dropped_long"] += 1
                continue
            examples.counts["truncated"] += 1
            ids, mask = ids[:cfg.max_length], mask[:cfg.max_length]
            if 1 not in mask:  # the cut left no assistant token: nothing to learn from it
                examples.counts["dropped_no_target"] += 1
                continue
        example = {"input_ids": ids, "labels": [t if m else -100 for t, m in zip(ids, mask, strict=True)]}
        (examples.heldout if is_heldout(record, cfg.eval_fraction) else examples.train).append(example)
    examples.counts |= {"train_examples": len(examples.train), "eval_examples": len(examples.heldout)}
    if not examples.train:
        raise ValueError(f"no SFT conversation left to train on: {examples.counts}: "
                         f"{_why_none_left(examples.counts, cfg, longest_prompt)}")
    return examples


def _why_none_left(counts: dict[str, int], cfg: SFTConfig, longest_prompt: int) -> str:
    """What emptied the training set, and the setting that brings conversations back."""
    if counts["dropped_long"]:  # long_conversations: drop
        left_out = (f"{counts['dropped_long']} conversation(s) longer than sft.max_length {cfg.max_length} were left "
                    "out (sft.long_conversations: drop)")
        if longest_prompt < cfg.max_length:  # every prompt fits: the cut keeps an answer of each
            return (f"{left_out}: set sft.long_conversations: truncate to train on their first {cfg.max_length} "
                    "tokens, or raise sft.max_length")
        return (f"{left_out}: raise sft.max_length above the longest prompt before a first assistant token, "
                f"{longest_prompt} tokens (truncating at {cfg.max_length} would keep no answer of it)")
    if counts["dropped_no_target"]:
        return (f"{counts['dropped_no_target']} conversation(s) were cut at sft.max_length {cfg.max_length} before "
                f"their first assistant token, leaving nothing to learn: raise sft.max_length above the longest "
                f"prompt before a first assistant token, {longest_prompt} tokens")
    return (f"every conversation was held out for the eval loss (sft.eval_fraction {cfg.eval_fraction}): lower "
            "sft.eval_fraction, or give SFT more conversations")


def train_sft(base_dir: Path | str, rows: list[dict], out_dir: Path, cfg: SFTConfig,
              on_log: Callable[[int, dict], None] | None = None, chat_template: str | Path | None = None,
              accelerate_config: Path | None = None, device: str = "auto", validate: Validate | None = None) -> dict:
    """Fine-tune the checkpoint in base_dir on rows of {messages, tools}; save to out_dir; return final metrics.

    chat_template: a .jinja file to train with (student.chat_template); accelerate_config: the file for
    `accelerate launch` when cfg.launcher is not "single" (default infra/accelerate/<launcher>.yaml), which
    then places the processes; device: student.device for the single launcher (auto: CUDA when present);
    validate: (model, tokenizer) -> (pass rate, mean reward) on the validation tasks (flywheel.train.sft_validation),
    called at each validation point; the best point's weights are saved, not the last (single launcher only).
    """
    if cfg.launcher != "single":
        if validate is not None:
            raise ValueError(f"sft.validation_tasks picks the checkpoint in this process; sft.launcher: {cfg.launcher} "
                             "trains in others: set sft.validation_tasks: 0 with it")
        return launch_sft(base_dir, rows, out_dir, cfg, on_log, chat_template, accelerate_config)
    from flywheel.train.sft_log import tokens_this_session
    from flywheel.train.sft_trainer import FinishedRun, KeepBest

    out_dir = Path(out_dir)
    with _quiet_progress():
        trainer, resume, counts = build_sft_trainer(base_dir, rows, out_dir, cfg, on_log, chat_template, device,
                                                    validate)
        started = time.perf_counter()
        try:
            train_loss = float(trainer.train(resume_from_checkpoint=resume).training_loss)
        except FinishedRun:  # the checkpoint is the run's last step: its weights are saved as they are
            train_loss = None  # (the loss of the steps trained in this session: none)
        runtime = time.perf_counter() - started
        keeper = next((c for c in trainer.callback_handler.callbacks if isinstance(c, KeepBest)), None)
        if keeper is not None:
            kept = keeper.selection.restore(trainer.model)
            counts |= keeper.selection.summary()
            if kept is not None:
                print(f"      sft keeps step {kept} of {trainer.state.global_step} (best validation pass rate)",
                      flush=True)
        eval_loss = _final_eval_loss(trainer)
        _save(trainer, out_dir, base_dir, cfg)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    tokens = tokens_this_session(trainer)
    return {"train_loss": train_loss, SFT_LAST_LOSS: float(losses[-1]) if losses else None,
            "eval_loss": eval_loss, "steps": int(trainer.state.global_step), "runtime_s": runtime,
            "tokens": int(tokens), "tokens_per_s": tokens / runtime if runtime > 0 else 0.0,
            "resumed_from": resume, "world_size": int(trainer.args.world_size), **counts}


def _final_eval_loss(trainer) -> float | None:
    """The held-out loss of the final weights: the last step's eval if it ran there, else one more eval."""
    if trainer.eval_dataset is None:
        return None
    last = [e for e in trainer.state.log_history if "eval_loss" in e]
    if last and last[-1]["step"] == trainer.state.global_step:
        return float(last[-1]["eval_loss"])
    return float(trainer.evaluate()["eval_loss"])


def _save(trainer, out_dir: Path, base_dir: Path | str, cfg: SFTConfig) -> None:
    """The student as cfg.lora.save says: a full checkpoint (merged) or the adapter naming its base."""
    model, tokenizer = trainer.model, trainer.processing_class
    merge = cfg.lora is not None and cfg.lora.save == "merged"
    adapter = out_dir.parent / "sft-adapter"
    if trainer.is_fsdp_enabled:
        # Every rank takes part in gathering the shards; the trainer writes the full model (tokenizer beside it),
        # or with LoRA the adapter, which rank 0 then folds into its base: `merged` must never leave an adapter.
        trainer.save_model(str(adapter if merge else out_dir))
        if merge and trainer.is_world_process_zero():
            _merge_adapter(adapter, base_dir, tokenizer, out_dir)
        return
    if not trainer.is_world_process_zero():
        return
    if merge and cfg.lora.quantize:  # merge into a full-precision base, never into the quantised one
        save_student(model, tokenizer, adapter)
        _merge_adapter(adapter, base_dir, tokenizer, out_dir)
        return
    save_student(model.merge_and_unload() if merge else model, tokenizer, out_dir)


def _merge_adapter(adapter: Path, base_dir: Path | str, tokenizer, out_dir: Path) -> None:
    """Fold a saved LoRA adapter into a full-precision copy of its base; save the plain checkpoint to out_dir."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_student(base_dir)[0], str(adapter)).merge_and_unload()
    save_student(model, tokenizer, out_dir)


def build_sft_trainer(base_dir: Path | str, rows: list[dict], out_dir: Path, cfg: SFTConfig,
                      on_log: Callable[[int, dict], None] | None = None, chat_template: str | Path | None = None,
                      device: str = "auto", validate: Validate | None = None):
    """The configured SFTTrainer (dataset tokenized, labels masked), the checkpoint to resume from, and counts.
    Its length is cfg.planned_steps of the training conversations; with `validate`, a KeepBest callback."""
    import datasets
    from transformers import PrinterCallback

    from flywheel.train.sft_log import StepLog
    from flywheel.train.sft_trainer import KeepBest, PlainLossSFTTrainer, StopIfFinished
    from flywheel.train.sft_validation import Selection, validation_steps

    out_dir = Path(out_dir)
    if not rows:
        raise ValueError("train_sft got no rows: the synthetic dataset is empty")
    on_cpu = sft_device(device) == "cpu"
    model, tokenizer = load_student(base_dir, **_load_options(cfg, on_cpu))
    template = training_template(tokenizer, str(base_dir), getattr(model.config, "model_type", None),
                                 configured=chat_template)
    # The student ships the template it was trained with: the harness then renders exactly these tokens.
    tokenizer.chat_template = template
    records = sft_records(rows)
    examples = tokenize_records(tokenizer, records, cfg, template)
    checkpoints = out_dir.parent / "sft-checkpoints"
    resume = _resume_point(checkpoints, _fingerprint(base_dir, records, cfg, template))
    heldout = bool(examples.heldout)
    steps = cfg.planned_steps(len(examples.train))
    examples.counts["planned_steps"] = steps
    callbacks = [StepLog(on_log), StopIfFinished()]
    if validate is not None:
        callbacks.append(KeepBest(validate, validation_steps(cfg, len(examples.train), steps), Selection(), on_log,
                                  lambda line: print(line, flush=True)))
    trainer = PlainLossSFTTrainer(model=model, args=_training_args(cfg, checkpoints, on_cpu, heldout, steps),
                                  train_dataset=datasets.Dataset.from_list(examples.train),
                                  eval_dataset=datasets.Dataset.from_list(examples.heldout) if heldout else None,
                                  processing_class=tokenizer, callbacks=callbacks, peft_config=_peft_config(cfg))
    trainer.remove_callback(PrinterCallback)  # it prints every log dict; on_log is the one outlet
    return trainer, resume, examples.counts


def _training_args(cfg: SFTConfig, checkpoints: Path, on_cpu: bool, heldout: bool, steps: int):
    """TRL's SFTConfig for cfg and `steps` optimiser steps: checkpoints saved to `checkpoints`, evaluation only
    with a held-out slice, a log (and a progress line) at the first step."""
    from trl import SFTConfig as TRLConfig

    return TRLConfig(
        output_dir=str(checkpoints), max_steps=steps, per_device_train_batch_size=cfg.micro_batch_size(),
        gradient_accumulation_steps=cfg.batch_size // cfg.micro_batch_size(),
        per_device_eval_batch_size=cfg.micro_batch_size(), learning_rate=cfg.lr, lr_scheduler_type="cosine",
        warmup_steps=cfg.warmup_steps, seed=cfg.seed, data_seed=cfg.seed, max_length=cfg.max_length,
        # labels are built by tokenize_records (assistant tokens only), so TRL neither re-tokenises nor re-masks
        assistant_only_loss=False, completion_only_loss=False, packing=False,
        # TRL's defaults are for GPUs: bf16 and activation checkpointing on. Here bf16 (autocast over fp32
        # weights) only where sft.precision asks for it; checkpointing off.
        use_cpu=on_cpu, bf16=cfg.precision == "bf16", fp16=False, gradient_checkpointing=False,
        activation_checkpointing=False, logging_steps=cfg.log_every, logging_first_step=True,
        eval_strategy="steps" if heldout else "no", eval_steps=cfg.eval_every,
        # About five checkpoints a run, at most 100 steps apart: a killed run loses little.
        save_strategy="steps", save_steps=max(1, min(100, steps // 5)), save_total_limit=2,
        report_to="none", disable_tqdm=True, include_num_input_tokens_seen="non_padding",
        dataloader_num_workers=0, ddp_find_unused_parameters=False,
        train_sampling_strategy="group_by_length" if cfg.group_by_length else "random",
    )


def sft_device(device: str) -> str:
    """student.device for the Trainer: cpu or cuda (the Trainer takes cuda:0; another GPU via CUDA_VISIBLE_DEVICES)."""
    from flywheel.devices import gpu_index, resolve_device

    resolved = resolve_device(device, "student.device (sft)")
    if gpu_index(resolved):
        raise ValueError(f"student.device: {device!r}: the SFT trainer runs on cuda:0 of the GPUs it sees; set "
                         f"CUDA_VISIBLE_DEVICES={gpu_index(resolved)} and student.device: cuda")
    return "cpu" if resolved == "cpu" else "cuda"


def _load_options(cfg: SFTConfig, on_cpu: bool = False) -> dict:
    """from_pretrained options: a quantised base for QLoRA (CUDA and bitsandbytes only)."""
    if cfg.lora is None or cfg.lora.quantize is None:
        return {}
    import importlib.util

    import torch

    if on_cpu or not torch.cuda.is_available() or importlib.util.find_spec("bitsandbytes") is None:
        raise RuntimeError(f"sft.lora.quantize: {cfg.lora.quantize} (QLoRA) needs a CUDA GPU and the "
                           "bitsandbytes package (the `gpu` extra), with student.device not cpu; on this machine "
                           "use sft.lora.quantize: null (plain LoRA) or full fine-tuning (sft.lora: null)")
    from transformers import BitsAndBytesConfig

    if cfg.lora.quantize == "4bit":
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                          bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=True)
    else:
        quantization = BitsAndBytesConfig(load_in_8bit=True)
    return {"model_kwargs": {"quantization_config": quantization, "device_map": {"": 0}}}


def _peft_config(cfg: SFTConfig):
    if cfg.lora is None:
        return None
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                      target_modules=cfg.lora.target_modules, task_type="CAUSAL_LM")


def launch_sft(base_dir: Path | str, rows: list[dict], out_dir: Path, cfg: SFTConfig,
               on_log: Callable[[int, dict], None] | None = None, chat_template: str | Path | None = None,
               accelerate_config: Path | None = None) -> dict:
    """Run train_sft under `accelerate launch` (DDP or FSDP); per-step metrics stream back to on_log."""
    from flywheel.train.sft_job import JOB_LOG, JOB_RESULT, write_job

    out_dir = Path(out_dir)
    config = Path(accelerate_config or Path("infra/accelerate") / f"{cfg.launcher}.yaml")
    if not config.is_file():
        raise FileNotFoundError(f"sft.launcher: {cfg.launcher} needs the accelerate config {config} "
                                "(infra/accelerate/ddp.yaml and fsdp.yaml ship with the project)")
    # Checkpoints of other inputs are cleared here, once: every rank clearing them itself would race.
    _resume_point(out_dir.parent / "sft-checkpoints",
                  _fingerprint(base_dir, sft_records(rows), cfg, _template_of(base_dir, chat_template)))
    job = write_job(out_dir.parent / "sft-job", base_dir, rows, out_dir,
                    cfg.model_copy(update={"launcher": "single"}), chat_template)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--num_processes", str(cfg.processes), "-m", "flywheel.train.sft_launch", str(job)]
    log = job.parent / JOB_LOG
    seen = 0
    with subprocess.Popen(command) as process:
        while True:
            done = process.poll() is not None
            seen = _forward(log, seen, on_log)
            if done:
                break
            time.sleep(0.5)
    if process.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` exited with {process.returncode} (its output is above); the "
                           "checkpoints are kept, so a rerun resumes")
    return json.loads((job.parent / JOB_RESULT).read_text())


def _template_of(base_dir: Path | str, chat_template: str | Path | None) -> str:
    """The training template build_sft_trainer will choose, from the tokenizer and config alone (no weights)."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base_dir), trust_remote_code=False)
    model_type = getattr(AutoConfig.from_pretrained(str(base_dir), trust_remote_code=False), "model_type", None)
    return training_template(tokenizer, str(base_dir), model_type, configured=chat_template)


def _forward(log: Path, seen: int, on_log: Callable[[int, dict], None] | None) -> int:
    """Pass the complete lines the training processes appended since `seen` bytes; return the new offset."""
    if not log.exists():
        return seen
    with log.open("rb") as f:
        f.seek(seen)
        chunk = f.read()
    complete = chunk[:chunk.rfind(b"\n") + 1]
    for line in complete.decode().splitlines():
        entry = json.loads(line)
        if on_log is not None:
            on_log(entry["step"], entry["metrics"])
    return seen + len(complete)
