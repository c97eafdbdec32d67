"""The policies an eval scores, each an arm: a student checkpoint, the null policy, a reference, or whatever
`flywheel eval --policy` names (a folder, a registered version or alias, an OpenAI-compatible endpoint).

An arm is built only when it is scored, so a bad spec or an empty held-out set is an error before any model loads.
A reference over HTTP is scored a chunk of tasks at a time: past the endpoint's retries and breaker, the rest of
its tasks are counted unanswered and its row is marked incomplete; nothing else depends on it.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flywheel import registry
from flywheel.agent import Harness
from flywheel.config import ReferenceConfig
from flywheel.contract import Task
from flywheel.errors import UserFacingError
from flywheel.evaluate.runner import Scored, evaluate_policy
from flywheel.policies import Policy, get_policy


class SpecError(UserFacingError, ValueError):
    """A `--policy` spec that names nothing usable; the message says which forms exist."""


@dataclass
class Arm:
    """One policy to score on the held-out tasks, and how."""

    label: str  # its rows' `model` in the eval table
    make: Callable[[], Policy]
    describe: str  # what it is, for people: a folder, a model URI, an endpoint
    prices: tuple[float, float] = (0.0, 0.0)  # USD per million prompt and completion tokens
    remote: bool = False  # over HTTP: scored in chunks, an endpoint that fails leaves its row incomplete
    chunk: int | None = None
    deterministic: bool = False  # the null policy: one greedy episode per task says all


def null_arm() -> Arm:
    """The null policy: an empty answer, no tool calls."""
    return Arm("null", lambda: get_policy("null"), "an empty answer, no tool calls", deterministic=True)


def checkpoint_arm(label: str, path: Path, *, batch_size: int, device: str, chat_template: str | None = None,
                   prices: tuple[float, float] = (0.0, 0.0), describe: str = "", precision: str = "fp32") -> Arm:
    """A Hugging Face checkpoint folder, run with transformers (the students)."""

    def make() -> Policy:
        policy = get_policy("hf", model_or_path=path, batch_size=batch_size, device=device, precision=precision)
        if chat_template:
            policy.tokenizer.chat_template = chat_template
        return policy

    return Arm(label, make, describe or str(path), prices)


def reference_arm(ref: ReferenceConfig, root: Path, batch_size: int = 64) -> Arm:
    """A reference of evaluate.references: an OpenAI-compatible endpoint (retried like the teacher), or a local
    checkpoint with transformers or vLLM."""
    prices = (ref.price_input_per_mtok, ref.price_output_per_mtok)
    if ref.policy == "openai":
        def make() -> Policy:
            from flywheel.policies.openai import OpenAIPolicy

            return OpenAIPolicy.from_endpoint(ref, root)

        return Arm(ref.name, make, f"{ref.model} at {ref.base_url or 'OPENAI_BASE_URL'}", prices, remote=True,
                   chunk=ref.concurrency)
    if ref.policy == "vllm":
        return Arm(ref.name, lambda: get_policy("vllm", model=ref.model, device=ref.device), ref.model, prices)
    return checkpoint_arm(ref.name, Path(ref.model), batch_size=batch_size, device=ref.device, prices=prices)


def score_arm(arm: Arm, harness: Harness, tasks: list[Task], *, samples: int = 0, temperature: float = 1.0,
              seed: int = 0) -> Scored:
    """The arm's eval rows on the tasks; a remote arm that cannot be reached or fails midway is counted unanswered."""
    failures: tuple[type[BaseException], ...] = ()
    if arm.remote:
        from flywheel.policies.openai import TeacherError

        failures = (TeacherError,)
    try:
        policy = arm.make()
    except failures as err:  # e.g. its key's variable is not set
        return Scored([], unanswered=len(tasks), failure=f"{type(err).__name__}: {err}")
    try:
        return evaluate_policy(policy, harness, tasks, arm.label, samples=0 if arm.deterministic else samples,
                               temperature=temperature, seed=seed, prices=arm.prices, chunk=arm.chunk,
                               failures=failures)
    finally:
        if arm.remote:
            policy.close()  # its response cache


SPEC_FORMS = ("a checkpoint folder", "models:/NAME/VERSION", "models:/NAME@ALIAS", "@ALIAS (this pipeline's model)",
              "openai:MODEL (with --base-url, --api-key-env, --price-input, --price-output)", "null")


def spec_arm(spec: str, pipeline: str, root: Path, *, batch_size: int, device: str, endpoint: dict,
             prices: tuple[float, float]) -> Arm:
    """The arm a `--policy [LABEL=]SPEC` names; the registry is asked now, a checkpoint is loaded only when scored.

    endpoint: ReferenceConfig fields for openai:MODEL (base_url, api_key_env, prices, ...); prices: the students'.
    """
    label, sep, body = spec.partition("=")
    if not sep or not label or _label(label) != label:  # no LABEL= in front: the whole spec names the policy
        label, body = "", spec
    if not body:
        raise SpecError(f"--policy {spec!r} names no policy; use one of: {'; '.join(SPEC_FORMS)}")
    if body == "null":
        return Arm(label or "null", null_arm().make, null_arm().describe, deterministic=True)
    if body.startswith("openai:"):
        model = body.removeprefix("openai:")
        if not model:
            raise SpecError(f"--policy {spec!r}: openai: needs a model name, e.g. openai:gpt-4o-mini")
        return reference_arm(ReferenceConfig(name=_label(label or model), model=model, **endpoint), root, batch_size)
    if body.startswith(("models:/", "@")):
        version = _registered(body, pipeline)

        def make() -> Policy:
            with tempfile.TemporaryDirectory(prefix=f"flywheel-arm-{version.name}-v{version.version}-") as folder:
                # the hf policy reads the checkpoint whole when made: the download goes once it is loaded
                return get_policy("hf", model_or_path=registry.download(version, Path(folder)), batch_size=batch_size,
                                  device=device)

        alias = body.rpartition("@")[2] if "@" in body else f"v{version.version}"
        return Arm(label or (alias if body.startswith("@") else _label(f"{version.name}.{alias}")), make,
                   f"{body} (version {version.version} of '{version.name}')", prices)
    path = Path(body) if Path(body).exists() else root / body  # as typed, else under the project root
    if not (path / "config.json").exists():
        raise SpecError(f"--policy {spec!r}: {path} is not a checkpoint folder (no config.json); use one of: "
                        f"{'; '.join(SPEC_FORMS)}")
    return checkpoint_arm(label or _label(path.name), path, batch_size=batch_size, device=device, prices=prices)


def _label(name: str) -> str:
    """A name as a label: letters, digits, _ . - (what a reference's name and an MLflow metric name allow)."""
    cleaned = "".join(c if c.isalnum() or c in "_.-" else "-" for c in name)
    return cleaned if cleaned[:1].isalpha() else f"m-{cleaned}"


def _registered(body: str, pipeline: str) -> registry.Version:
    """The registered version models:/NAME/VERSION, models:/NAME@ALIAS or @ALIAS (of the pipeline's model) names."""
    if body.startswith("@"):
        name, alias, number = pipeline, body[1:], ""
    else:
        rest = body.removeprefix("models:/")
        name, _, alias = rest.partition("@")
        number = ""
        if not alias:
            name, _, number = rest.partition("/")
    if not name or not (alias or number):
        raise SpecError(f"--policy {body}: name a version or an alias: models:/NAME/VERSION, models:/NAME@ALIAS or "
                        "@ALIAS")
    try:
        found = registry.get_alias(name, alias) if alias else registry.get_version(name, number)
    except Exception as err:  # noqa: BLE001 -- MLflow's errors for an unknown model or version vary
        raise SpecError(f"--policy {body}: the registry has no such version ({type(err).__name__}: {err})") from None
    if found is None:
        raise SpecError(f"--policy {body}: the registry has no model '{name}' with alias '{alias}'")
    return found
