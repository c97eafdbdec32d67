"""Distillation SFT: TRL's SFTTrainer on conversations, loss on assistant tokens only, resumable."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from flywheel.config import SFTConfig
from flywheel.train.checkpoint import canonical_messages, load_student, save_student

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


def _fingerprint(base_dir: Path | str, records: list[dict], cfg: SFTConfig) -> str:
    digest = hashlib.sha256(str(base_dir).encode())
    if Path(base_dir).is_dir():  # the base's weights and config, not only its name: a rebuilt base is new
        for file in sorted(Path(base_dir).iterdir()):
            if file.name.endswith((".safetensors", ".json", ".jinja")):
                digest.update(file.name.encode() + file.read_bytes())
    digest.update(json.dumps(records, sort_keys=True).encode())
    digest.update(cfg.model_dump_json().encode())
    return digest.hexdigest()[:16]


def _resume_point(checkpoints: Path, fingerprint: str) -> str | None:
    """The last checkpoint of an interrupted run with the same inputs; checkpoints of other inputs are removed."""
    from transformers.trainer_utils import get_last_checkpoint

    marker = checkpoints / FINGERPRINT
    if checkpoints.exists() and (not marker.exists() or json.loads(marker.read_text())["fingerprint"] != fingerprint):
        shutil.rmtree(checkpoints)  # a different model, data or config: resuming would mix runs
    checkpoints.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"fingerprint": fingerprint}))
    return get_last_checkpoint(str(checkpoints))


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


def train_sft(base_dir: Path | str, rows: list[dict], out_dir: Path, cfg: SFTConfig,
              on_log: Callable[[int, dict], None] | None = None) -> dict:
    """Fine-tune the checkpoint in base_dir on rows of {messages, tools}; save to out_dir; return final metrics."""
    out_dir = Path(out_dir)
    with _quiet_progress():
        trainer, resume = build_sft_trainer(base_dir, rows, out_dir, cfg, on_log)
        started = time.perf_counter()
        result = trainer.train(resume_from_checkpoint=resume)
        runtime = time.perf_counter() - started
        save_student(trainer.model, trainer.processing_class, out_dir)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    tokens = trainer.state.num_input_tokens_seen - trainer.tokens_at_start
    return {"train_loss": float(result.training_loss), "final_loss": float(losses[-1]) if losses else None,
            "steps": int(trainer.state.global_step), "runtime_s": runtime, "tokens": int(tokens),
            "tokens_per_s": tokens / runtime if runtime > 0 else 0.0, "resumed_from": resume}


def build_sft_trainer(base_dir: Path | str, rows: list[dict], out_dir: Path, cfg: SFTConfig,
                      on_log: Callable[[int, dict], None] | None = None):
    """The configured SFTTrainer (dataset tokenized, labels masked) and the checkpoint to resume from, if any."""
    import datasets
    import torch
    from transformers import PrinterCallback, TrainerCallback
    from trl import SFTConfig as TRLConfig
    from trl import SFTTrainer

    out_dir = Path(out_dir)
    if not rows:
        raise ValueError("train_sft got no rows: the synthetic dataset is empty")
    model, tokenizer = load_student(base_dir)
    records = sft_records(rows)
    checkpoints = out_dir.parent / "sft-checkpoints"
    resume = _resume_point(checkpoints, _fingerprint(base_dir, records, cfg))

    args = TRLConfig(
        output_dir=str(checkpoints), max_steps=cfg.steps, per_device_train_batch_size=cfg.batch_size,
        learning_rate=cfg.lr, lr_scheduler_type="cosine", warmup_steps=cfg.warmup_steps, seed=cfg.seed,
        data_seed=cfg.seed, max_length=cfg.max_length, assistant_only_loss=True, packing=False,
        # TRL's defaults are for GPUs: bf16 and activation checkpointing on. Off here (fp32).
        use_cpu=not torch.cuda.is_available(), bf16=False, fp16=False, gradient_checkpointing=False,
        activation_checkpointing=False, logging_steps=cfg.log_every,
        # About five checkpoints a run, at most 100 steps apart: a killed run loses little.
        save_strategy="steps", save_steps=max(1, min(100, cfg.steps // 5)), save_total_limit=2,
        report_to="none", disable_tqdm=True, include_num_input_tokens_seen="non_padding",
        dataloader_num_workers=0,
    )

    class Forward(TrainerCallback):
        """Pass each logging step's numbers (with tokens/s over the step window) to the caller."""

        last = (0.0, 0)

        def on_train_begin(self, args, state, control, **kwargs):
            # called after a resumed run's state is loaded: rates count this session's tokens only
            self.last = (time.perf_counter(), state.num_input_tokens_seen)
            trainer.tokens_at_start = state.num_input_tokens_seen

        def on_log(self, args, state, control, logs=None, **kwargs):
            if on_log is None or not logs or "loss" not in logs:
                return
            now, tokens = time.perf_counter(), state.num_input_tokens_seen
            metrics = {"loss": logs["loss"], "learning_rate": logs.get("learning_rate", 0.0),
                       "grad_norm": logs.get("grad_norm", 0.0),
                       "token_accuracy": logs.get("mean_token_accuracy", 0.0),
                       "tokens_per_s": (tokens - self.last[1]) / max(now - self.last[0], 1e-9)}
            self.last = (now, tokens)
            on_log(state.global_step, {k: float(v) for k, v in metrics.items()})

    trainer = SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(records),
                         processing_class=tokenizer, callbacks=[Forward()])
    trainer.tokens_at_start = 0
    trainer.remove_callback(PrinterCallback)  # it prints every log dict; on_log is the one outlet
    return trainer, resume
