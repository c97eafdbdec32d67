"""Publishing the learner's weights to running actors: one shared-memory copy and a version counter."""

from __future__ import annotations

import torch


class WeightBoard:
    """The latest published weights in shared memory with their version; the learner writes, actors read.

    A publish copies the state dict in place under a lock and wakes the actors waiting for a newer version;
    no actor stops for it, and an actor copies the weights out under the same lock, so it never sees half of
    an update. Built before the actor processes start (the tensors travel to them as shared memory).
    """

    def __init__(self, state_dict: dict[str, torch.Tensor], ctx):
        self.tensors = {k: v.detach().clone().contiguous().share_memory_() for k, v in state_dict.items()}
        self.version = ctx.Value("q", -1, lock=False)  # guarded by the condition's lock
        self.cond = ctx.Condition()

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """Make the model's current weights version `version` and wake every waiting actor."""
        state = model.state_dict()
        with self.cond, torch.no_grad():
            for name, tensor in self.tensors.items():
                tensor.copy_(state[name])
            self.version.value = version
            self.cond.notify_all()

    def wait_for(self, version: int, timeout_s: float) -> int:
        """Block until at least `version` is published or the timeout passes; the version published now."""
        with self.cond:
            self.cond.wait_for(lambda: self.version.value >= version, timeout=timeout_s)
            return self.version.value

    def load_into(self, policy) -> int:
        """Copy the published weights into the policy (its load_weights); the version copied."""
        with self.cond:
            policy.load_weights(self.tensors)
            return self.version.value
