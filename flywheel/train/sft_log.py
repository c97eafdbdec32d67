"""What the SFT trainer logs, passed on: each logging step's numbers to the caller's on_log, with tokens/s.

A TrainerCallback, apart from flywheel.train.sft so that importing the trainer's module does not import
transformers; build_sft_trainer adds one StepLog to every trainer it builds.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from transformers import TrainerCallback

from flywheel.metrics import SFT_LOSS


class StepLog(TrainerCallback):
    """Pass each logging step's numbers (with tokens/s over the step window) to on_log, on the main process."""

    def __init__(self, on_log: Callable[[int, dict], None] | None):
        self.send = on_log  # not self.on_log: that is the callback's own event method
        self.last = (0.0, 0)  # (time, tokens seen) at the last logging step
        self.tokens_at_start = 0  # tokens a resumed run had seen before this session

    def on_train_begin(self, args, state, control, **kwargs):
        # called after a resumed run's state is loaded: rates count this session's tokens only
        self.last = (time.perf_counter(), state.num_input_tokens_seen)
        self.tokens_at_start = state.num_input_tokens_seen

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.send is None or not logs or not state.is_world_process_zero:
            return
        if "eval_loss" in logs:
            self.send(state.global_step, {"eval_loss": float(logs["eval_loss"])})
        if "loss" not in logs:
            return
        now, tokens = time.perf_counter(), state.num_input_tokens_seen
        metrics = {SFT_LOSS: logs["loss"], "learning_rate": logs.get("learning_rate", 0.0),
                   "grad_norm": logs.get("grad_norm", 0.0),
                   "token_accuracy": logs.get("mean_token_accuracy", 0.0),
                   "tokens_per_s": (tokens - self.last[1]) / max(now - self.last[0], 1e-9)}
        self.last = (now, tokens)
        self.send(state.global_step, {k: float(v) for k, v in metrics.items()})


def tokens_this_session(trainer) -> int:
    """The input tokens trainer trained on in this session: a resumed run's earlier ones are not counted."""
    log = next(c for c in trainer.callback_handler.callbacks if isinstance(c, StepLog))
    return trainer.state.num_input_tokens_seen - log.tokens_at_start
