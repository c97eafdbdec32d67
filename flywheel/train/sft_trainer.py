"""TRL's SFTTrainer with the model's own loss: imported only where a trainer is built (TRL loads slowly)."""

from __future__ import annotations

import torch
from transformers import Trainer
from trl import SFTTrainer


class PlainLossSFTTrainer(SFTTrainer):
    """SFTTrainer whose loss is the model's own cross-entropy over the labels (tokenize_records masks them to the
    assistant's tokens): the same loss as TRL's, without its fused LM head, which also works out every position's
    entropy and log-probability in chunks. On a CPU that head cost about as much again as the rest of a step of
    SmolLM2 (benchmarks/smol.py: the stage against a bare PyTorch loop). Token accuracy, which TRL logs and
    flywheel reports, is counted here from the logits."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = Trainer.compute_loss(self, model, {**inputs, "use_cache": False}, return_outputs=True,
                                             num_items_in_batch=num_items_in_batch)
        with torch.no_grad():
            labels = inputs["labels"][:, 1:]
            scored = labels != -100
            correct = (outputs.logits[:, :-1].argmax(-1) == labels) & scored
            mode = "train" if model.training else "eval"
            self._metrics[mode]["mean_token_accuracy"].append(
                (correct.sum() / scored.sum()).item() if scored.any() else 0.0)
        return (loss, outputs) if return_outputs else loss
