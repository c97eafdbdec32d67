"""TRL's SFTTrainer with the model's own loss: imported only where a trainer is built (TRL loads slowly)."""

from __future__ import annotations

import torch
from trl import SFTTrainer

# A batch whose rows open with this many identical tokens, none of them trained on, reads that opening once (a
# support desk conversation's first ~310 of ~590 tokens are the system prompt and the tools, the same in every
# row); a shorter opening is not worth the second forward pass. The same threshold as the hf policy's.
SHARED_OPENING_MIN = 32


def shared_opening(inputs: dict) -> int:
    """How many leading positions every row of the batch has in common and reads before its first trained token
    (labels -100 up to and including that position): 0 when under SHARED_OPENING_MIN or the batch has one row."""
    ids, labels = inputs["input_ids"], inputs["labels"]
    if ids.shape[0] < 2 or ids.shape[1] < 2:
        return 0
    same = (ids == ids[:1]).all(0) & (labels == -100).all(0)
    if "attention_mask" in inputs:
        same &= inputs["attention_mask"].bool().all(0)
    # position p may end the opening only if the token after it is not trained on either: its prediction is read
    # from p's output, which the opening's pass does not keep
    same[:-1] &= (labels[:, 1:] == -100).all(0)
    same[-1] = False  # every row keeps at least its last token for the second pass
    length = int(same.long().cumprod(0).sum())
    return length if length >= SHARED_OPENING_MIN else 0


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
        opening = shared_opening(inputs)
        if opening:
            inputs = self._after_opening(model, inputs, opening)
            labels = labels[:, opening:]
        targets = labels[:, 1:]
        scored = targets != -100  # [B, T-1]: the positions whose next token is trained
        keep = torch.cat([scored, torch.zeros_like(scored[:, :1])], dim=1)
        model_inputs = {k: v for k, v in inputs.items() if k != "labels"}
        outputs = model(**model_inputs, use_cache=False, logits_to_keep=keep)
        logits = outputs.logits.reshape(-1, outputs.logits.shape[-1])  # [scored positions, vocab], row by row
        wanted = targets[scored]
        loss = torch.nn.functional.cross_entropy(logits.float(), wanted, reduction="sum")
        if num_items_in_batch is None:
            loss = loss / max(1, wanted.numel())
        else:  # as Trainer.compute_loss: the batch's token count, summed over processes that each take a part
            loss = loss / num_items_in_batch
            if self.args.average_tokens_across_devices:
                loss = loss * self.accelerator.num_processes
        with torch.no_grad():
            mode = "train" if model.training else "eval"
            self._metrics[mode]["mean_token_accuracy"].append(
                (logits.argmax(-1) == wanted).float().mean().item() if wanted.numel() else 0.0)
        return (loss, outputs) if return_outputs else loss

    @staticmethod
    def _after_opening(model, inputs: dict, opening: int) -> dict:
        """The batch's rows after their shared opening, with the opening read once (first row) into a cache
        repeated for every row; the attention mask stays whole, positions continue from the opening."""
        ids = inputs["input_ids"]
        cache = model(input_ids=ids[:1, :opening], use_cache=True, logits_to_keep=1).cache
        cache.batch_repeat_interleave(ids.shape[0])  # differentiable: the rows' gradients meet in the opening
        rest = {key: value[:, opening:] for key, value in inputs.items()
                if key in ("input_ids", "labels", "position_ids")}
        return {**inputs, **rest, "cache": cache}
