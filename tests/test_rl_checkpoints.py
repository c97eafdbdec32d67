"""RL checkpoints (flywheel/train/rl/checkpoints.py): the learner's state is one record, saved and loaded whole."""

from __future__ import annotations

from dataclasses import fields, replace

import torch

from flywheel.checkpoints import load_student
from flywheel.config import RLConfig
from flywheel.train.rl.checkpoints import Checkpoints, LearnerState
from flywheel.train.rl.generation import snapshot


def _same(a, b) -> bool:
    """Equal, tensors and live objects by their state."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, torch.nn.Module | torch.optim.Optimizer):
        return _same(a.state_dict(), b.state_dict())
    if isinstance(a, torch.Generator):
        return torch.equal(a.get_state(), b.get_state())
    if hasattr(a, "get_vocab"):  # a tokenizer
        return a.get_vocab() == b.get_vocab()
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_a_checkpoint_holds_the_learner_state_whole(tiny_student, tmp_path):
    cfg = RLConfig(seed=5, lr=1e-3)
    fresh = Checkpoints(tmp_path / "ck", "inputs").load(tiny_student, cfg, "cpu")
    assert fresh.step == 0 and fresh.rows == fresh.history == fresh.monitor == fresh.validation == []
    assert fresh.behaviour == {} and fresh.best_state is None

    # a state a run has moved on: weights and optimizer stepped, minibatch order drawn from, progress made
    ids = torch.tensor([[1, 2, 3, 4]])
    fresh.model(input_ids=ids).logits.float().pow(2).mean().backward()
    fresh.optimizer.step()
    torch.randperm(7, generator=fresh.shuffle)
    weights = snapshot(fresh.model)
    state = replace(fresh, step=3, rows=[{"step": 0, "reward": 1.0, "advantage": None}], history=[{"loss": 0.5}],
                    behaviour={2: weights}, monitor=[{"version": 0, "audit_pass": 1.0}],
                    validation=[{"version": 0, "validation_pass": 0.5}], best_state=weights)
    Checkpoints(tmp_path / "ck", "inputs").save(state)

    loaded = Checkpoints(tmp_path / "ck", "inputs").load(tiny_student, cfg, "cpu")
    assert [f.name for f in fields(LearnerState) if not _same(getattr(state, f.name), getattr(loaded, f.name))] == []
    assert not _same(loaded.model, load_student(tiny_student)[0])  # the checkpoint's weights, not the start's
    # the minibatch order goes on where it stopped
    assert torch.equal(torch.randperm(7, generator=loaded.shuffle), torch.randperm(7, generator=state.shuffle))
    # other inputs: the checkpoint is not resumed from (and is removed)
    assert Checkpoints(tmp_path / "ck", "other inputs").load(tiny_student, cfg, "cpu").step == 0
    assert not list((tmp_path / "ck").glob("step-*"))
