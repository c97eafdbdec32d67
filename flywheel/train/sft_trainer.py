"""TRL's SFTTrainer with the model's own loss: imported only where a trainer is built (TRL loads slowly)."""

from __future__ import annotations

import torch
from transformers import TrainerCallback
from trl import SFTTrainer

from flywheel.train.opening import wanted_logits


class PlainLossSFTTrainer(SFTTrainer):
    """SFTTrainer whose loss is the cross-entropy of the assistant's tokens (tokenize_records masks the labels to
    them), summed and divided as the model's own loss is: the same loss as TRL's, without its fused LM head, which
    also works out every position's entropy and log-probability in chunks. On a CPU that head cost about as much
    again as the rest of a step of SmolLM2 (benchmarks/smol.py: the stage against a bare PyTorch loop). Token
    accuracy, which TRL logs and flywheel reports, is counted here from the logits.

    Two readings the loss does not need are skipped, each checked by a test to give the same loss and gradients:
    - the LM head (576 x 49,152 for SmolLM2) runs only at the positions whose next token is trained, not at the
      system prompt, tools, user turns and tool results;
    - where the rows of a batch open with the same untrained tokens (the system prompt and the tools), the
      opening is read once, as one row, into a cache every row then attends to; gradients flow back through the
      cache. On the support desk that is ~310 of each conversation's ~590 tokens."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["labels"]
        wanted = labels != -100
        wanted[:, 0] = False  # nothing predicts a row's first token: the model's own loss skips its label too
        extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "labels")}
        if extra:
            raise ValueError(f"the SFT batch has inputs this trainer does not pass on: {sorted(extra)}")
        logits = wanted_logits(model, inputs["input_ids"], inputs["attention_mask"], wanted)
        targets = labels[wanted]
        loss = torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum")
        if num_items_in_batch is None:
            loss = loss / max(1, targets.numel())
        else:  # as Trainer.compute_loss: the batch's token count, summed over processes that each take a part
            loss = loss / num_items_in_batch
            if self.args.average_tokens_across_devices:
                loss = loss * self.accelerator.num_processes
        with torch.no_grad():
            mode = "train" if model.training else "eval"
            self._metrics[mode]["mean_token_accuracy"].append(
                (logits.argmax(-1) == targets).float().mean().item() if targets.numel() else 0.0)
        return (loss, {"logits": logits}) if return_outputs else loss


class FinishedRun(Exception):
    """The checkpoint a run resumed from is its last step: nothing is left to train (raised by StopIfFinished)."""


class StopIfFinished(TrainerCallback):
    """Ends train() before any step when the checkpoint it resumed from is already at max_steps. Left to itself,
    the Trainer starts again the epoch that run stopped in when max_steps is not a whole number of epochs, and
    takes one step (at a learning rate of 0) and saves one checkpoint past max_steps. on_train_begin comes after
    the checkpoint's weights and state are loaded, so the caller saves them as the finished run did."""

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:
            raise FinishedRun(f"resumed at step {state.global_step} of {state.max_steps}")


class KeepBest(TrainerCallback):
    """At each validation step (flywheel.train.sft_validation) the live student answers the validation tasks
    through `validate`; the selection keeps the best point's weights, which train_sft puts back before saving."""

    def __init__(self, validate, steps: list[int], selection, report, say):
        self.validate, self.steps, self.selection, self.report, self.say = validate, set(steps), selection, report, say

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if state.global_step not in self.steps or not state.is_world_process_zero:
            return
        pass_rate, reward = self.validate(model, processing_class)
        point = self.selection.add(state.global_step, pass_rate, reward, model)
        best = self.selection.best
        self.say(f"      sft validation at step {state.global_step}/{state.max_steps}: pass rate {pass_rate:.3f}, "
                 f"mean reward {reward:.3f} (best so far: step {best['step']})")
        if self.report is not None:
            self.report(state.global_step, {k: v for k, v in point.items() if k != "step"})
