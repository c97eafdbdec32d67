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
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from flywheel.agent import Limits
from flywheel.checkpoints import save_student
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
class Resumed:
    """What a run resumes from: the step to do next, its weights folder and the learner state."""

    step: int
    model_dir: Path
    optimizer: dict
    shuffle: torch.Tensor
    rows: list[dict]
    history: list[dict]
    behaviour: dict[int, dict[str, torch.Tensor]]  # older versions later steps are generated with, by version
    monitor: list[dict]  # the reward-hacking monitor's checks so far (its baseline is the first)
    validation: list[dict]  # rl.keep_best's validation checks so far
    best_state: dict[str, torch.Tensor] | None  # and the best version's weights, when it is not this one


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

    def latest(self) -> Resumed | None:
        """The newest complete checkpoint, if any."""
        done = sorted((p for p in self.folder.glob("step-*") if (p / "state.pt").exists()),
                      key=lambda p: int(p.name.split("-")[1]))
        if not done:
            return None
        path = done[-1]
        state = torch.load(path / "state.pt", weights_only=True)
        extra = json.loads((path / "progress.json").read_text())
        return Resumed(int(path.name.split("-")[1]), path / "model", state["optimizer"], state["shuffle"],
                       extra["rows"], extra["history"], state["behaviour"], extra.get("monitor", []),
                       extra.get("validation", []), state.get("best"))

    def save(self, step: int, model, tokenizer, optimizer, shuffle: torch.Generator, rows: list[dict],
             history: list[dict], behaviour: dict[int, dict[str, torch.Tensor]],
             monitor: list[dict] | None = None, validation: list[dict] | None = None,
             best_state: dict[str, torch.Tensor] | None = None) -> Path:
        """Write the state after `step` steps: a temporary folder renamed into place, so a kill leaves none half."""
        final = self.folder / f"step-{step}"
        partial = self.folder / f".step-{step}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        save_student(model, tokenizer, partial / "model")
        (partial / "progress.json").write_text(json.dumps({"rows": rows, "history": history,
                                                              "monitor": monitor or [],
                                                              "validation": validation or []}))
        torch.save({"optimizer": optimizer.state_dict(), "shuffle": shuffle.get_state(), "behaviour": behaviour,
                    "best": best_state}, partial / "state.pt")
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for old in self.folder.glob("step-*"):
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def remove(self) -> None:
        """The run finished: its checkpoints are no longer needed."""
        shutil.rmtree(self.folder, ignore_errors=True)
