"""What the SFT trainer logs, passed on: each logging step's numbers to the caller's on_log, with tokens/s, and a
progress line on stdout from the first step on (step k/N, loss, elapsed, ETA), then at every logging step.

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

    def __init__(self, on_log: Callable[[int, dict], None] | None, say: Callable[[str], None] | None = None):
        self.send = on_log  # not self.on_log: that is the callback's own event method
        self.say = say or (lambda line: print(line, flush=True))
        self.last = (0.0, 0)  # (time, tokens seen) at the last logging step
        self.tokens_at_start = 0  # tokens a resumed run had seen before this session
        self.started, self.first_step = 0.0, 0

    def on_train_begin(self, args, state, control, **kwargs):
        # called after a resumed run's state is loaded: rates count this session's tokens only
        self.last = (time.perf_counter(), state.num_input_tokens_seen)
        self.tokens_at_start = state.num_input_tokens_seen
        self.started, self.first_step = time.perf_counter(), state.global_step

    def progress(self, state, loss: float) -> None:
        """The terminal's line: step k/N, loss, elapsed and the time left at this session's pace."""
        if not state.is_world_process_zero:
            return
        elapsed = time.perf_counter() - self.started
        done = max(state.global_step - self.first_step, 1)
        left = elapsed / done * (state.max_steps - state.global_step)
        self.say(f"      sft step {state.global_step}/{state.max_steps}  loss {loss:.3f}  {elapsed:.0f}s elapsed, "
                 f"~{left:.0f}s left")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        if "loss" in logs:
            self.progress(state, float(logs["loss"]))
        if self.send is None:
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
