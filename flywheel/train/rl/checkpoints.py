"""Resumable RL checkpoints: weights, optimizer, the learner's random state and the rollouts so far.

They live in a folder next to the RL output (`rl-checkpoints`, like `sft-checkpoints`) with a fingerprint of
the starting model, the tasks and the config: a killed run resumes from its last checkpoint, a run with other
inputs starts fresh (and removes the old checkpoints). The task stream position and sampling seeds follow
from the step (flywheel.train.rl.source), so the step is all a resumed run needs to continue the stream.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from flywheel.agent import Limits
from flywheel.checkpoints import load_student, save_student
from flywheel.config import RLConfig
from flywheel.contract import Task

FINGERPRINT = "fingerprint.json"
# How the work is spread over processes and threads changes no result a checkpoint holds.
# Nor does the monitor: greedy audits draw no random numbers and train on nothing.
_EXECUTION_KEYS = {"steps", "checkpoint_every", "actors", "learner_threads", "actor_threads", "generation",
                   "actor_devices", "monitor_every", "monitor_tasks", "max_audit_drop"}


def fingerprint(model_dir: Path, tasks: list[Task], cfg: RLConfig, env_name: str, limits: Limits,
                teacher: str = "") -> str:
    """A hash of what a run's results depend on: the start checkpoint's files, the tasks, the config, the
    environment and the harness's limits, every one (and on-policy distillation's teacher: its checkpoint's bytes,
    or its server and model)."""
    digest = hashlib.sha256(str(model_dir).encode())
    if Path(model_dir).is_dir():
        for file in sorted(Path(model_dir).iterdir()):
            if file.is_file() and file.name.endswith((".safetensors", ".json", ".jinja")):
                digest.update(file.name.encode() + file.read_bytes())
    digest.update(json.dumps([t.task_id for t in tasks]).encode())
    # a decaying learning rate ends at the last step: there the number of steps changes every step's rate
    execution = _EXECUTION_KEYS - ({"steps"} if cfg.lr_schedule != "constant" else set())
    digest.update(json.dumps(cfg.model_dump(exclude=execution), sort_keys=True).encode())
    digest.update(f"{env_name}:{json.dumps(asdict(limits), sort_keys=True)}".encode())
    if teacher:
        digest.update(f"teacher:{teacher}".encode())
    return digest.hexdigest()[:16]


@dataclass
class LearnerState:
    """All a run resumes from, in one record: Checkpoints.save writes it whole and Checkpoints.load returns it.

    The live model, optimizer and minibatch generator, and what the run has produced so far. The task stream
    and sampling seeds follow from `step` (flywheel.train.rl.source), so they need no field."""

    step: int  # the step to do next (the steps done): the weights are version `step`
    model: torch.nn.Module
    tokenizer: object
    optimizer: torch.optim.Optimizer
    shuffle: torch.Generator  # the learner's minibatch order
    rows: list[dict] = field(default_factory=list)  # the rollouts so far
    history: list[dict] = field(default_factory=list)  # each step's metrics
    # the older versions later steps are generated with, by version
    behaviour: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    monitor: list[dict] = field(default_factory=list)  # the reward-hacking monitor's checks (its baseline first)
    validation: list[dict] = field(default_factory=list)  # rl.keep_best's validation checks
    best_state: dict[str, torch.Tensor] | None = None  # and the best version's weights, when it is not this one


class Checkpoints:
    """The checkpoint folder of one RL output; keeps the newest checkpoint only."""

    def __init__(self, folder: Path, fingerprint: str):
        self.folder = Path(folder)
        marker = self.folder / FINGERPRINT
        if self.folder.exists() and (not marker.exists()
                                     or json.loads(marker.read_text())["fingerprint"] != fingerprint):
            shutil.rmtree(self.folder)  # other inputs: resuming would mix two runs
        self.folder.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"fingerprint": fingerprint}))

    def _newest(self) -> Path | None:
        """The newest complete checkpoint's folder, if any."""
        done = sorted((p for p in self.folder.glob("step-*") if (p / "state.pt").exists()),
                      key=lambda p: int(p.name.split("-")[1]))
        return done[-1] if done else None

    def load(self, model_dir: Path, cfg: RLConfig, device: str) -> LearnerState:
        """The state to continue from: the newest checkpoint's, whole, or without one step 0's from model_dir
        (the optimizer and the minibatch order seeded from cfg either way, then given the checkpoint's state)."""
        path = self._newest()
        torch.manual_seed(cfg.seed)
        model, tokenizer = load_student(path / "model" if path else model_dir)
        model.to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        shuffle = torch.Generator().manual_seed(cfg.seed)
        if path is None:
            return LearnerState(0, model, tokenizer, optimizer, shuffle)
        tensors = torch.load(path / "state.pt", weights_only=True)
        progress = json.loads((path / "progress.json").read_text())
        optimizer.load_state_dict(tensors["optimizer"])
        shuffle.set_state(tensors["shuffle"])
        return LearnerState(int(path.name.split("-")[1]), model, tokenizer, optimizer, shuffle, progress["rows"],
                            progress["history"], tensors["behaviour"], progress.get("monitor", []),
                            progress.get("validation", []), tensors.get("best"))

    def save(self, state: LearnerState) -> Path:
        """Write the state after `state.step` steps: a temporary folder renamed into place, so a kill leaves none
        half. The weights as a checkpoint folder, the JSON-able progress as progress.json, tensors as state.pt."""
        final = self.folder / f"step-{state.step}"
        partial = self.folder / f".step-{state.step}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        save_student(state.model, state.tokenizer, partial / "model")
        (partial / "progress.json").write_text(json.dumps({"rows": state.rows, "history": state.history,
                                                              "monitor": state.monitor,
                                                              "validation": state.validation}))
        torch.save({"optimizer": state.optimizer.state_dict(), "shuffle": state.shuffle.get_state(),
                    "behaviour": state.behaviour, "best": state.best_state}, partial / "state.pt")
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for old in self.folder.glob("step-*"):
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def remove(self) -> None:
        """The run finished: its checkpoints are no longer needed."""
        shutil.rmtree(self.folder, ignore_errors=True)
