"""The sections that make the student: student, teacher, synthesize, sft, rl (with its objective)."""

from __future__ import annotations

import math
import re
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, Field, model_serializer, model_validator

from flywheel.config.sections import EndpointConfig, Section
from flywheel.devices import DEVICE_PATTERN


class TinyModelConfig(Section):
    hidden_size: int = Field(128, ge=16)
    layers: int = Field(2, ge=1)
    heads: int = Field(4, ge=1)
    vocab_size: int = Field(512, ge=300)
    max_position_embeddings: int = Field(512, ge=64)
    # Spaces as tokens of their own, so a word is the same token after a space as after a quote: a name copied
    # from "Hi, I'm ana.lee@..." into {"email": "ana.lee@..."} is then a copy, not a learned per-name mapping.
    isolate_spaces: bool = False
    seed: int = 0

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> TinyModelConfig:
        if self.hidden_size % self.heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by heads {self.heads}")
        return self


class StudentConfig(Section):
    # "auto" picks the tiny student for the calculator demo and SmolLM2-135M-Instruct (LoRA) for every other
    # environment; "tiny" builds the demo student from scratch; anything else is a checkpoint folder, a hub id or a
    # GGUF file. The chosen student's profile fills the keys a pipeline leaves unset (flywheel/train/students.py).
    model: str = "auto"
    tiny: TinyModelConfig = TinyModelConfig()
    # A .jinja file (under the project root) with {% generation %} markers, for a student whose own template has
    # none and is not one TRL ships a training version of. When set it is used in place of the student's own.
    chat_template: str | None = None
    # Where the student trains and runs in sft, rl (the learner; actors too unless rl.actor_devices) and evaluate:
    # auto (a CUDA GPU when one is visible, else the CPU), cpu, cuda or cuda:N (sft: cuda:0 only; pick another GPU
    # with CUDA_VISIBLE_DEVICES). Naming a GPU the machine lacks is an error, never a fall back to the CPU.
    device: str = Field("auto", pattern=DEVICE_PATTERN)


class TeacherConfig(EndpointConfig):
    where: ClassVar[str] = "teacher"
    # none: no teacher at all; the accepted traces are the only targets (synthesize.include_accepted_traces)
    policy: Literal["oracle", "openai", "vllm", "hf", "none"] = "oracle"
    # openai: the served model name; vllm and hf: a checkpoint folder or hub id
    model: str | None = None
    price_input_per_mtok: float = Field(0.0, ge=0)  # USD per million prompt tokens
    price_output_per_mtok: float = Field(0.0, ge=0)  # USD per million completion tokens
    # SQLite response cache under the project root (null: none): reruns make no calls, a killed run resumes
    cache: str | None = ".flywheel/teacher-cache.sqlite"
    # hf and vllm teachers (local models): auto, cpu, cuda or cuda:N, as student.device; vllm needs a GPU
    device: str = Field("auto", pattern=DEVICE_PATTERN)
    # oracle only, an imperfect teacher as real ones are: this fraction of its final answers is wrong (a number
    # in it is off), chosen by a hash of (error_seed, conversation), so reruns make the same mistakes. The rubric
    # rejects them, so the student sees fewer targets where the teacher errs. error_slices: only tasks of these
    # slices (as the environment's task_from_messages reads them); empty: every slice.
    error_rate: float = Field(0.0, ge=0, le=1)
    error_slices: list[str] = []
    error_seed: int = 0

    @model_validator(mode="after")
    def _usable(self) -> TeacherConfig:
        if self.policy not in ("oracle", "none") and not self.model:
            raise ValueError(f"teacher policy '{self.policy}' needs 'model' (the served model name, "
                             "or a checkpoint for vllm and hf)")
        if self.policy != "oracle" and (self.error_rate or self.error_slices):
            raise ValueError(f"error_rate and error_slices make the oracle imperfect; teacher policy "
                             f"'{self.policy}' makes its own mistakes (set them only with policy: oracle)")
        if self.policy == "vllm" and self.device == "cpu":
            raise ValueError("teacher policy 'vllm' runs on a GPU only: device cpu is not possible (use hf on "
                             "the CPU, or openai against a vLLM server)")
        return self

class SynthesizeConfig(Section):
    samples_per_task: int = Field(1, ge=1)  # rejection sampling: n teacher episodes per train task
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(512, ge=1)  # per assistant turn
    keep_best_only: bool = False  # accept at most one passing sample per task (highest reward, then shortest)
    include_accepted_traces: bool = False  # train traces with outcome 'accepted' become targets too
    # Train tasks of these slices get no teacher conversation: SFT never sees them; they stay RL tasks and held-out
    # slices. support-smol leaves out `hard` (several requests in one message): its conversations taught the
    # student to call get_order again on the desk's single requests, and they were 27% of SFT's tokens.
    exclude_slices: list[str] = Field(default_factory=list)


class LoRAConfig(Section):
    r: int = Field(16, ge=1)
    alpha: int = Field(32, ge=1)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: str | list[str] = "all-linear"
    # QLoRA: the frozen base loaded in 4 or 8 bits (bitsandbytes, CUDA only); None keeps it in full precision.
    quantize: Literal["4bit", "8bit"] | None = None
    # "merged": the adapter is folded into the base and the student is a plain checkpoint;
    # "adapter": the student is the adapter folder, registered with its base named.
    save: Literal["merged", "adapter"] = "merged"


class SFTConfig(Section):
    # The optimiser steps; unset: `epochs` passes over the training conversations (planned_steps).
    steps: int | None = Field(None, ge=1)
    epochs: float = Field(3.0, gt=0)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(1e-3, gt=0)  # at 2e-3 the tiny student learns digit copying late or not (by seed)
    warmup_steps: int = Field(30, ge=0)
    max_length: int = Field(128, ge=16)
    # Batches of conversations of about one length (transformers' LengthGroupedSampler: a random set of up to 50
    # batches' worth, sorted by length, cut into batches; new sets each epoch), so a batch pads less: on
    # support-mt's conversations 19% fewer tokens an epoch than random batches (SmolLM2's profile turns it on;
    # the tiny student's calculator conversations are all about one length). false: random batches.
    group_by_length: bool = False
    # A batch is read in equal micro-batches of at most this many tokens (conversations x max_length, the widest
    # a micro-batch can be), their gradients added into the one optimiser step: the same step in less memory.
    # Activations grow with a pass's tokens: SmolLM2 at 8 x 1,024 peaked at 13.5 GB, at 8 x 1,536 it passed
    # 24 GiB and the kernel killed the run. Lower it where a bigger student or less memory is the case.
    micro_batch_tokens: int = Field(8192, ge=16)
    seed: int = 0
    log_every: int = Field(10, ge=1)
    # A conversation longer than max_length is cut to it ("truncate") or left out ("drop"); either is counted.
    long_conversations: Literal["truncate", "drop"] = "truncate"
    # Fraction of the conversations held out (by content hash) for an eval loss every eval_every steps; 0: none.
    eval_fraction: float = Field(0.02, ge=0, lt=0.5)
    eval_every: int = Field(100, ge=1)
    lora: LoRAConfig | None = None  # None: full fine-tuning (the default for small students)
    # bf16: forward and backward under bfloat16 autocast (weights, gradients and optimiser state stay fp32). On
    # a CPU with native bf16 (AVX-512 BF16 or AMX) a LoRA step of SmolLM2 runs 2.1x faster, its loss within 0.04
    # of fp32's (benchmarks/smol.py); elsewhere bf16 is emulated and slower: keep fp32 there.
    precision: Literal["fp32", "bf16"] = "fp32"
    # "single": in this process; "ddp"/"fsdp": `accelerate launch` with infra/accelerate/<launcher>.yaml.
    launcher: Literal["single", "ddp", "fsdp"] = "single"
    processes: int = Field(2, ge=1)  # processes accelerate starts (one per GPU; gloo on CPU)
    # A validation slice of TRAIN tasks that picks the checkpoint: a count (1 or more) or a fraction of the train
    # tasks (below 1), chosen by a seeded hash of their ids (sft.seed), their conversations left out of SFT's
    # data. At every validation point the live student answers them greedily through the harness (evaluate's
    # code) and the best pass rate is kept (ties: mean reward, then the later step). 0: off, the last step kept.
    validation_tasks: float = Field(0, ge=0)
    # Steps between validation points; unset: at the end of each epoch. The last step is always a point.
    validate_every: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _validation_in_process(self) -> SFTConfig:
        if self.validation_tasks and self.launcher != "single":
            raise ValueError(f"validation_tasks picks the checkpoint in the training process; launcher "
                             f"'{self.launcher}' trains in others: set validation_tasks: 0 with it, or "
                             "launcher: single")
        return self

    def planned_steps(self, n_examples: int) -> int:
        """The optimiser steps SFT takes on n_examples training conversations: `steps` when set, else `epochs`
        passes of ceil(n_examples / batch_size) batches each (the last batch of a pass may be short, so a set
        smaller than one batch is still a step a pass), rounded up."""
        if self.steps is not None:
            return self.steps
        if n_examples <= 0:
            return 0
        return max(1, math.ceil(self.epochs * self.steps_per_epoch(n_examples)))

    def micro_batch_size(self) -> int:
        """The conversations one forward pass reads: the largest divisor of batch_size whose micro-batches of
        max_length tokens fit micro_batch_tokens (at least one conversation)."""
        fits = max(1, self.micro_batch_tokens // self.max_length)
        return max(d for d in range(1, min(fits, self.batch_size) + 1) if self.batch_size % d == 0)

    def steps_per_epoch(self, n_examples: int) -> int:
        """The batches one pass over n_examples conversations takes."""
        return math.ceil(n_examples / self.batch_size)


class OPDConfig(EndpointConfig):
    """On-policy distillation (rl.objective opd or reward+opd): the teacher judges every token the student wrote.
    `sampled`: its log-probability of the sampled token gives that token the advantage -kl_coef * (log p_student
    - log p_teacher); `reverse` / `forward`: kl_coef times the exact KL over the vocabulary is a loss term."""

    # A checkpoint folder (under the project root, or absolute) whose tokenizer is the student's; with base_url,
    # the model name a server over the OpenAI protocol serves (vLLM: its completions API with prompt_logprobs).
    # A server is retried like the teacher's client (429, 5xx, timeouts); past the retries the step's groups are
    # dropped and counted, never trained on without the teacher.
    where: ClassVar[str] = "rl.opd"
    teacher: str
    kl_coef: float = Field(1.0, gt=0)  # the weight of the per-token divergence from the teacher
    # sampled: the reverse KL estimated at the token the student sampled, as that token's advantage (any teacher);
    # reverse / forward: the exact KL(student || teacher) / KL(teacher || student) over the whole vocabulary at
    # each position the student wrote, a loss term beside the policy loss (a local checkpoint only: a server
    # gives the sampled token's log-probability, not the distribution)
    divergence: Literal["sampled", "reverse", "forward"] = "sampled"
    reward_coef: float = Field(1.0, ge=0)  # reward+opd: the weight of the group advantage of the task reward
    device: str = Field("auto", pattern=DEVICE_PATTERN)  # a local teacher's (the learner runs it)
    # a token whose teacher log-probability is NaN or infinite leaves the loss (counted); past this share of
    # the run's tokens the run stops with an error
    max_nonfinite_fraction: float = Field(0.01, ge=0, le=1)

    @model_validator(mode="after")
    def _whole_distribution_is_local(self) -> OPDConfig:
        if self.divergence != "sampled" and self.base_url:
            raise ValueError(
                f"divergence '{self.divergence}' takes the teacher's whole distribution at every token, which only "
                f"a local checkpoint gives; the server at {self.base_url} returns the log-probability of the token "
                "the student sampled (prompt_logprobs). Use divergence: sampled with a server, or a checkpoint "
                "folder as rl.opd.teacher without rl.opd.base_url")
        return self


class RewardObjective(Section):
    """rl.objective reward (grpo): GRPO-family group advantages of the task reward; no teacher."""

    kind: Literal["reward"] = "reward"
    opd: None = None  # every objective has `opd`: the teacher's settings, or none


class OPDObjective(Section):
    """rl.objective opd: on-policy distillation alone; the teacher judges every token, the reward is unused."""

    kind: Literal["opd"] = "opd"
    opd: OPDConfig


class RewardOPDObjective(Section):
    """rl.objective reward+opd: the reward's group advantage (times opd.reward_coef) beside the teacher's."""

    kind: Literal["reward+opd"] = "reward+opd"
    opd: OPDConfig


# What the learner's advantages come from; flywheel/train/rl/objective.py holds what each one does.
Objective = Annotated[RewardObjective | OPDObjective | RewardOPDObjective, Field(discriminator="kind")]
OBJECTIVES = ("reward", "opd", "reward+opd")


class RLConfig(Section):
    steps: int = Field(10, ge=0)
    tasks_per_step: int = Field(16, ge=1)
    group_size: int = Field(4, ge=1)  # reward objectives need 2 or more: a group is scored against itself
    # What the learner's advantages come from: the task reward (GRPO-family group advantages; `grpo` names it
    # too), the teacher's per-token judgement of the student's own samples (on-policy distillation, `opd`), or
    # both. Written `objective: opd` with the teacher's settings beside it (`opd: {teacher: ...}`); read as one
    # variant that holds them (cfg.objective.opd), so an OPD objective without its teacher cannot be built.
    objective: Objective = RewardObjective()
    temperature: float = Field(1.0, gt=0)
    max_new_tokens: int = Field(64, ge=1)  # per assistant turn
    lr: float = Field(3e-5, gt=0)  # 2e-4 and above break the tiny student's digit copying (measured)
    clip_eps: float = Field(0.2, gt=0)
    epochs_per_batch: int = Field(2, ge=1)
    minibatch_size: int = Field(32, ge=1)
    max_grad_norm: float = Field(1.0, gt=0)
    # grpo: mean per sequence, then over sequences; dr_grpo: token sum / (sequences * max_length), advantages
    # not divided by the group std; dapo: mean over every assistant token of the minibatch.
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = "grpo"
    max_length: int = Field(128, ge=16)
    seed: int = 0
    # Asynchronous rollouts: actor processes generate while the learner steps. Step s learns from groups made
    # by exactly policy version max(s - max_staleness, 0) (reproducible); 0 is the synchronous baseline (actors
    # wait for each new version). actors: 0 generates in the learner's own process, taking turns with learning;
    # auto: 0 where an actor cannot overlap the learner (max_staleness 0) or the machine has no core to spare for
    # one (2 cores or fewer), else 1; one per actor_devices entry; 1 under vllm (flywheel/train/rl/generation.py).
    actors: Annotated[int, Field(ge=0)] | Literal["auto"] = "auto"
    max_staleness: int = Field(1, ge=0)
    tis_cap: float = Field(2.0, gt=0)  # truncated importance sampling: weights pi_old/pi_behaviour capped here
    kl_beta: float = Field(0.0, ge=0)  # KL to the starting checkpoint (frozen reference); 0: no reference kept
    # torch threads of the learner and of each actor: on a small machine one actor + the learner must not
    # oversubscribe the cores, or overlapping them is slower than taking turns.
    learner_threads: int = Field(1, ge=1)
    actor_threads: int = Field(1, ge=1)
    # The actors' engine: transformers (CPU/GPU) or vLLM (GPU; needs actors >= 1: it runs in an actor process).
    generation: Literal["hf", "vllm"] = "hf"
    # One device per actor (auto, cpu, cuda, cuda:N), e.g. [cuda:1, cuda:2] beside a learner on cuda:0;
    # empty: every actor on student.device.
    actor_devices: list[str] = []
    checkpoint_every: int = Field(5, ge=0)  # learner steps between resumable checkpoints; 0: none
    # MLflow traces of RL episodes linked to the rl run (docs/traces.md): the samples of each step's first task,
    # spread over the run, at most this many; 0: none
    trace_rollouts: int = Field(32, ge=0)
    # The learning rate over the run: constant, or after `warmup_steps` (linear from 0) a cosine or linear decay
    # to lr * min_lr_ratio at the last step. Per learner step, so a resumed run continues the same schedule.
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    # Online difficulty filtering (DAPO, prime-rl): a task whose last `filter_window` groups were all-pass or
    # all-fail (no signal) is drawn with weight `filter_weight` instead of 1. Step s's tasks depend only on the
    # seed and the groups of steps before s - max_staleness, so reruns and resumed runs draw the same tasks.
    difficulty_filter: bool = False
    filter_window: int = Field(1, ge=1)
    filter_weight: float = Field(0.1, ge=0, le=1)
    # Reward-hacking monitor: every `monitor_every` steps (and before the first) the current policy answers a
    # fixed sample of `monitor_tasks` held-out tasks greedily; audit_pass is the share that passes the
    # environment's audit checks (its rubric's `passed` when it declares none). A run whose training reward
    # rose while audit_pass fell by more than `max_audit_drop` from its first value is flagged. 0: off.
    monitor_every: int = Field(0, ge=0)
    monitor_tasks: int = Field(32, ge=1)
    max_audit_drop: float = Field(0.1, ge=0, le=1)
    # Early stopping: `validate_tasks` train tasks (the first by task id; at most half of them) are taken out of
    # the tasks RL draws from; every `validate_every` steps (and before the first) the policy answers them
    # greedily, and the run's output is the version that passed the most (ties: the higher mean reward, then the
    # earlier version; version 0 is the starting checkpoint), not the last. Off: the last version.
    keep_best: bool = False
    validate_every: int = Field(10, ge=1)
    validate_tasks: int = Field(64, ge=1)
    # RL that changed nothing (0 optimiser updates: every group had equal rewards, or an output byte-identical to
    # the SFT checkpoint) is a warning in the run's summary and an MLflow tag; true: the stage fails instead.
    fail_on_no_updates: bool = False

    @model_validator(mode="before")
    @classmethod
    def _objective_as_written(cls, data):
        """`objective: <name>` with `opd: {...}` beside it, as pipelines.yaml says it, into one variant."""
        if not isinstance(data, dict) or isinstance(data.get("objective"), dict | BaseModel):
            return data  # a variant already (or not a mapping: the model's own error says so)
        data = dict(data)
        kind = data.pop("objective", "reward")
        kind = "reward" if kind == "grpo" else kind  # the name the GRPO family goes by elsewhere (prime-rl)
        opd = data.pop("opd", None)
        if kind not in OBJECTIVES:
            raise ValueError(f"objective {kind!r}: use reward (or grpo), opd or reward+opd")
        if kind == "reward" and opd is not None:  # a section nothing reads is as wrong as an unknown key
            raise ValueError("rl.opd is set, but objective 'reward' has no teacher and would never read it: set "
                             "objective: opd or reward+opd, or remove rl.opd")
        if kind != "reward" and opd is None:
            raise ValueError(f"objective '{kind}' needs rl.opd with a teacher: a checkpoint folder with "
                             "the student's tokenizer, or a served model name and base_url")
        return data | {"objective": {"kind": kind} | ({"opd": opd} if kind != "reward" else {})}

    @model_serializer(mode="wrap")
    def _written_back(self, handler) -> dict:
        """Dumped as written (`objective: <name>`, then `opd`), so a dumped config loads back and its hash and
        recorded copy read as before the objective became a variant."""
        written = {}
        for name, value in handler(self).items():
            if name == "objective":
                written["objective"] = value["kind"]
                if "opd" in value:  # (not when exclude_none leaves it out)
                    written["opd"] = value["opd"]
            else:
                written[name] = value
        return written

    @model_validator(mode="after")
    def _actors_fit(self) -> RLConfig:
        if self.objective.kind != "opd" and self.group_size < 2:
            raise ValueError(f"group_size {self.group_size}: objective '{self.objective.kind}' scores each task's "
                             "samples against each other, so it needs 2 or more (only 'opd' can take 1)")
        if self.generation == "vllm" and self.actors == 0:  # (auto is 1 under vllm)
            raise ValueError("generation 'vllm' needs actors >= 1: the vLLM engine runs in an actor process, and "
                             "with actors 0 the learner generates with transformers itself")
        bad = [d for d in self.actor_devices if not re.fullmatch(DEVICE_PATTERN, d)]
        if bad:
            raise ValueError(f"actor_devices {bad}: use auto, cpu, cuda or cuda:N")
        if self.actor_devices and self.actors != "auto" and len(self.actor_devices) != self.actors:
            raise ValueError(f"actor_devices names {len(self.actor_devices)} device(s) for {self.actors} actor(s): "
                             "give one per actor, or none (every actor on student.device)")
        if self.generation == "vllm" and "cpu" in self.actor_devices:
            raise ValueError("generation 'vllm' runs on a GPU only: an actor on cpu is not possible")
        return self
