"""Publishing the learner's weights to running actors: the last max_staleness + 1 versions in shared memory.

Step s's rollouts are made by exactly version max(s - max_staleness, 0), never "whatever is newest": which
weights generate what then depends on the step alone, not on timing, so an asynchronous run is as
reproducible as a synchronous one (a rerun gives the same rollouts and weights). Keeping max_staleness + 1
versions is enough: version v's slot is next written by version v + max_staleness + 1, which the learner
can only make after it has consumed step v + max_staleness, whose rollouts need version v to be made first.
"""

from __future__ import annotations

import torch


class WeightBoard:
    """A ring of published versions in shared memory; the learner writes, actors read the version they need.

    A publish copies the state dict into its slot under a lock and wakes the actors waiting for it; no actor
    stops for it, and an actor copies weights out under the same lock, so it never sees half of an update.
    Built before the actor processes start (the tensors travel to them as shared memory).
    """

    def __init__(self, state_dict: dict[str, torch.Tensor], ctx, slots: int = 1):
        # on the CPU whatever the learner's device: shared memory reaches actors on any device (or none)
        self.slots = [{k: v.detach().to("cpu", copy=True).contiguous().share_memory_() for k, v in state_dict.items()}
                      for _ in range(slots)]
        self.held = ctx.Array("q", [-1] * slots, lock=False)  # the version in each slot; guarded by cond
        self.version = ctx.Value("q", -1, lock=False)  # the newest published
        self.cond = ctx.Condition()

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Make these weights version `version` and wake every waiting actor."""
        slot = version % len(self.slots)
        with self.cond, torch.no_grad():
            for name, tensor in self.slots[slot].items():
                tensor.copy_(state_dict[name])
            self.held[slot] = version
            self.version.value = max(self.version.value, version)
            self.cond.notify_all()

    def wait_for(self, version: int, timeout_s: float) -> int:
        """Block until `version` is published or the timeout passes; the newest version published now."""
        with self.cond:
            self.cond.wait_for(lambda: self.version.value >= version, timeout=timeout_s)
            return self.version.value

    def load_into(self, policy, version: int) -> int:
        """Copy version `version` into the policy (its load_weights); raises if it is no longer held."""
        slot = version % len(self.slots)
        with self.cond:
            if self.held[slot] != version:
                raise RuntimeError(f"policy version {version} is not on the weight board (slot holds "
                                   f"{self.held[slot]}): the staleness bound was broken")
            policy.load_weights(self.slots[slot])
            return version
