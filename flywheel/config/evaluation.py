"""The `evaluate:` and `gate:` sections: what is scored beside the candidate and what promotion needs."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from flywheel.config.sections import EndpointConfig, Section
from flywheel.devices import DEVICE_PATTERN


class ReferenceConfig(EndpointConfig):
    """A policy scored beside the candidate on the same held-out tasks (evaluate.references); never gated on.
    openai: retried like the teacher; past the retries (or the breaker) its row is marked incomplete."""

    where: ClassVar[str] = "evaluate.references"
    name: str = Field(pattern=r"^[A-Za-z][A-Za-z0-9_.-]*$")  # its row in the eval table; not a model's label
    policy: Literal["openai", "hf", "vllm"] = "openai"
    model: str  # openai: the served model name; hf and vllm: a checkpoint folder or hub id
    price_input_per_mtok: float = Field(0.0, ge=0)  # USD per million prompt tokens
    price_output_per_mtok: float = Field(0.0, ge=0)  # USD per million completion tokens
    cache: str | None = ".flywheel/reference-cache.sqlite"  # under the project root; null: none
    device: str = Field("auto", pattern=DEVICE_PATTERN)  # hf and vllm


class EvaluateConfig(Section):
    # Greedy decoding on every held-out task (sample 0), plus `samples` episodes per task at `temperature`
    # (samples 1..k, seeded, so candidate and champion draw with the same seeds). The gate pairs every row.
    batch_size: int = Field(64, ge=1)
    # bf16: the students generate under bfloat16 autocast (flywheel/policies/hf.py), about twice as fast on a CPU
    # with native bf16; every arm (base, sft, rl, champion) alike, so the gate compares like with like
    precision: Literal["fp32", "bf16"] = "fp32"
    samples: int = Field(0, ge=0)
    temperature: float = Field(1.0, gt=0)
    seed: int = 0
    # Other policies scored on the same tasks (typically the production model the traces came from): the summary
    # and the registry tags say what share of a reference's pass rate the candidate reaches, at what share of its
    # cost per task. The students' cost per task uses these prices (USD per million tokens; 0: unpriced).
    references: list[ReferenceConfig] = []
    # Each episode scored becomes an MLflow trace linked to the evaluate run (docs/traces.md): at most this many
    # per model, failed episodes first, written together at the end of the stage; 0: none
    trace_episodes: int = Field(100, ge=0)
    student_price_input_per_mtok: float = Field(0.0, ge=0)
    student_price_output_per_mtok: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _distinct_references(self) -> EvaluateConfig:
        names = [r.name for r in self.references]
        models = ("null", "base", "sft", "rl", "champion")  # the rows evaluate scores itself
        taken = sorted({n for n in names if names.count(n) > 1 or n in models})
        if taken:
            raise ValueError(f"references {taken}: each needs its own name, other than {', '.join(models)}")
        return self


class GateConfig(Section):
    min_score: float = Field(0.8, ge=0, le=1)
    # "improve": the bootstrap lower bound of (candidate - champion) must exceed margin;
    # "non_inferior": it must exceed -margin;
    # "cost_aware": non-inferior, and cheaper than the champion in mean `cost_metric` per task: the lower bound
    # of the relative saving (1 - candidate / champion) must reach min_token_saving.
    mode: Literal["improve", "non_inferior", "cost_aware"] = "non_inferior"
    min_token_saving: float = Field(0.1, ge=0, lt=1)
    cost_metric: Literal["tokens", "latency_s"] = "tokens"
    margin: float = Field(0.03, ge=0, le=1)
    max_slice_regression: float = Field(0.05, ge=0, le=1)
    bootstrap_samples: int = Field(2000, ge=100)
    confidence: float = Field(0.95, gt=0.5, lt=1)
    seed: int = 0
    # Optional limits on the candidate's mean per task (eval columns `tokens` and `latency_s`); off when unset.
    max_tokens_per_task: float | None = Field(None, gt=0)
    max_latency_s: float | None = Field(None, gt=0)
    # The gate refuses what the eval cannot measure (each check on by default): fewer held-out tasks than
    # min_tasks (0: off); the null policy (an empty answer) within `margin` of the candidate (paired lower bound);
    # base so near 1 that candidate - base cannot clear `margin` even for a perfect candidate; a slice where
    # every model (null, base, sft, candidate, champion) scores the same.
    min_tasks: int = Field(20, ge=0)
    check_null: bool = True
    check_ceiling: bool = True
    check_flat_slices: bool = True
    # Slices the gate reports but does not judge on their own (a harder slice no model solves yet, kept in the
    # held-out set to be measured): the flat-slice check and max_slice_regression skip them; their tasks still
    # count in every overall figure.
    report_only_slices: list[str] = Field(default_factory=list)
