"""Moving `champion`: through the gate against the current champion, compare-and-set; forced; rolled back.

Every move happens under one lock per (MLflow store, model), and the champion is read again right before the
alias is set, so two pipeline runs finishing together leave exactly one champion: the later one is gated
against the earlier one's result. The lock is a file lock: it serialises promotions on one machine (next to a
SQLite store); several machines sharing an MLflow server need one promoter at a time.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from mlflow.exceptions import MlflowException

from flywheel.config import GateConfig
from flywheel.errors import UserFacingError
from flywheel.evaluate.gate import BASELINES, GateDecision, decide
from flywheel.registry import client, get_alias
from flywheel.tags import (
    GATE_CHAMPION_TAG,
    PREVIOUS_CHAMPION_TAG,
    PROMOTION_REASONS_TAG,
    PROMOTION_TAG,
    REWARD_HACKING_REASON_TAG,
    REWARD_HACKING_TAG,
    ROLLED_BACK_TAG,
)

EVAL_ARTIFACT = "eval/eval.parquet"  # where register() stores a version's eval table
CANDIDATE = "rl"  # the rows of the eval table that score the registered model itself


# (version, champion) -> both scored again on the current held-out tasks (with the null policy): (eval rows, where
# the evaluation is recorded); evaluate_now with a project's root and config
Reevaluate = Callable[[str, str], tuple[pd.DataFrame, str]]


class PromotionError(UserFacingError, RuntimeError):
    """A promotion that cannot be attempted (unknown version, nothing to roll back to)."""


@dataclass
class Promotion:
    """What a promotion did: whether `version` is champion now, who was before, and why."""

    promoted: bool
    version: str
    champion: str | None
    previous: str | None
    reasons: list[str] = field(default_factory=list)
    how: str = "gate"  # gate, forced, rollback or unchanged


def _lock_path(name: str) -> Path:
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    folder = Path(uri.removeprefix("sqlite:///")).parent if uri.startswith("sqlite:///") else \
        Path(tempfile.gettempdir())
    digest = hashlib.sha256(f"{uri}|{name}".encode()).hexdigest()[:16]
    return folder / f".flywheel-promote-{digest}.lock"


@contextmanager
def promotion_lock(name: str) -> Iterator[None]:
    """Hold the promotion lock of model `name` on this store (blocks until the holder is done)."""
    path = _lock_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def stored_table(name: str, version: str) -> pd.DataFrame | None:
    """The whole eval table stored with the version at registration (every model scored), or None when none was."""
    import mlflow.artifacts

    mv = client().get_model_version(name, version)
    if not mv.run_id:
        return None
    with tempfile.TemporaryDirectory(prefix="flywheel-eval-") as folder:
        try:
            local = mlflow.artifacts.download_artifacts(run_id=mv.run_id, artifact_path=EVAL_ARTIFACT,
                                                        dst_path=folder)
        except (MlflowException, OSError):
            return None
        return pd.read_parquet(local)


def eval_table(name: str, version: str) -> pd.DataFrame | None:
    """The eval rows of the version's own model as stored at registration, or None when none were stored."""
    frame = stored_table(name, version)
    if frame is None or "model" not in frame.columns:
        return frame
    return frame[frame["model"] == CANDIDATE]


def gate_against_champion(name: str, version: str, champion: str | None, gate: GateConfig,
                          reevaluate: Reevaluate | None = None) -> GateDecision:
    """Decide from the stored eval tables of `version` and `champion`; a missing table fails closed.

    The null policy's and the students' rows stored with the version are its baselines (a table stored without
    them fails the checks that need them). Tables evaluated on other held-out tasks (traffic added tasks between
    the two evaluations) do not pair: then the champion's rows of the version's own evaluation are used when that
    evaluation scored this champion, else `reevaluate` scores both again on the current held-out tasks, else the
    gate refuses, saying how to compare them.
    """
    table = stored_table(name, version)
    if table is None:
        return GateDecision(False, [f"version {version} of '{name}' has no stored eval table ({EVAL_ARTIFACT} in "
                                    "its run); promote it with --force or register it again from a pipeline run"])
    labels = table["model"] if "model" in table.columns else pd.Series(CANDIDATE, index=table.index)
    candidate = table[labels == CANDIDATE]
    baselines = {label: table[labels == label] for label in BASELINES if (labels == label).any()}
    reference, notes = None, []
    if champion is not None:
        reference = eval_table(name, champion)
        if reference is None:
            return GateDecision(False, [f"champion version {champion} of '{name}' has no stored eval table; "
                                        "compare by hand and promote with --force"])
        if not _pair(candidate, reference):
            tags = client().get_model_version(name, version).tags
            scored_then = table[labels == "champion"]
            if tags.get(GATE_CHAMPION_TAG) == champion and _pair(candidate, scored_then):
                reference = scored_then
                notes.append(f"the stored tables of versions {version} and {champion} are on other held-out tasks: "
                             f"gated on version {version}'s own evaluation, which scored champion {champion} on the "
                             "same tasks")
            elif reevaluate is not None:
                again, where = reevaluate(version, champion)
                candidate, reference = again[again["model"] == CANDIDATE], again[again["model"] == "champion"]
                baselines = {"null": again[again["model"] == "null"]}
                # the base model is not registered: its ceiling check stands as taken when the version was evaluated
                gate = gate.model_copy(update={"check_ceiling": False})
                notes.append(f"the stored tables of versions {version} and {champion} are on other held-out tasks: "
                             f"both evaluated again on the current {candidate['task_id'].nunique()} held-out tasks "
                             f"({where}); the base-model ceiling check is the one taken at registration")
    # the RL monitor's verdict, recorded on the version at registration, refuses it whatever its scores
    tags = client().get_model_version(name, version).tags
    flags = [tags.get(REWARD_HACKING_REASON_TAG) or "reward hacking flagged by the RL monitor"] \
        if tags.get(REWARD_HACKING_TAG) == "flagged" else []
    decision = decide(candidate, reference, gate, flags=flags, baselines=baselines)
    decision.reasons[:0] = notes
    if reevaluate is None and any("do not pair" in r for r in decision.reasons):
        decision.reasons.append(f"`flywheel promote {name} {version}` from the project root evaluates both on the "
                                "current held-out tasks")
    return decision


def _pair(candidate: pd.DataFrame, reference: pd.DataFrame) -> bool:
    """Whether two eval tables hold the same (task_id, sample) rows: the gate's paired comparison needs it."""
    key = ["task_id", "sample"]
    return set(map(tuple, candidate[key].to_numpy())) == set(map(tuple, reference[key].to_numpy()))


def evaluate_now(name: str, version: str, champion: str, root: Path, cfg) -> tuple[pd.DataFrame, str]:
    """Score version `version` (as the candidate), champion `champion` and the null policy on the pipeline's
    current held-out tasks (`flywheel eval`'s harness; an MLflow run records what was scored): (rows, where)."""
    from flywheel.evaluate.adhoc import evaluate_policies

    endpoint = {"base_url": None, "api_key_env": None, "price_input_per_mtok": 0.0, "price_output_per_mtok": 0.0,
                "cache": None}
    result = evaluate_policies(name, root, cfg, [f"{CANDIDATE}=models:/{name}/{version}",
                                                  f"champion=models:/{name}/{champion}"], endpoint)
    return result.table, f"MLflow run {result.run_id}, run name 'eval'"


def _set_champion(name: str, version: str, previous: str | None, how: str, reasons: list[str]) -> None:
    c = client()
    if get_alias(name, "champion") and get_alias(name, "champion").version != previous:
        # cannot happen while every writer holds the lock; if one did not, do not overwrite its move
        raise PromotionError(f"champion of '{name}' moved while version {version} was being promoted; retry")
    if previous and previous != version and how != "rollback":
        c.set_model_version_tag(name, version, PREVIOUS_CHAMPION_TAG, previous)
    c.set_model_version_tag(name, version, PROMOTION_TAG, how)
    c.set_model_version_tag(name, version, PROMOTION_REASONS_TAG, "; ".join(reasons)[:5000])
    c.set_registered_model_alias(name, "champion", version)


def promote(name: str, version: str, gate: GateConfig, force: bool = False,
            decision: GateDecision | None = None, judged_against: str | None = None,
            reevaluate: Reevaluate | None = None) -> Promotion:
    """Make `version` champion if it passes the gate against the champion of this moment (compare-and-set).

    `decision` is a gate already taken against champion `judged_against` (None: there was none); it is used
    only if that is still the champion, else the stored eval tables are gated again against the new one
    (`reevaluate`: how to score both again when those tables do not pair, gate_against_champion).
    """
    version = str(version)
    try:
        client().get_model_version(name, version)
    except MlflowException as err:
        raise PromotionError(f"model '{name}' has no version {version}") from err
    with promotion_lock(name):
        current = get_alias(name, "champion")
        previous = current.version if current else None
        if previous == version:
            return Promotion(True, version, version, previous, [f"version {version} is already champion"],
                             "unchanged")
        if force:
            reasons = ["forced: the gate was not run"]
            _set_champion(name, version, previous, "forced", reasons)
            return Promotion(True, version, version, previous, reasons, "forced")
        if decision is None or judged_against != previous:
            stale = decision is not None
            decision = gate_against_champion(name, version, previous, gate, reevaluate)
            if stale:
                decision.reasons.insert(0, f"judged against {judged_against or 'no champion'}, but the champion "
                                           f"is now {previous or 'none'}: gated again")
        if not decision.passed:
            return Promotion(False, version, previous, previous, decision.reasons)
        _set_champion(name, version, previous, "gate", decision.reasons)
        return Promotion(True, version, version, previous, decision.reasons)


def rollback(name: str) -> Promotion:
    """Return `champion` to the version recorded as the current champion's flywheel.previous_champion."""
    with promotion_lock(name):
        current = get_alias(name, "champion")
        if current is None:
            raise PromotionError(f"model '{name}' has no champion to roll back")
        tags = client().get_model_version(name, current.version).tags
        previous = tags.get(PREVIOUS_CHAMPION_TAG)
        if not previous:
            raise PromotionError(f"champion version {current.version} of '{name}' records no previous champion")
        reasons = [f"rolled back from version {current.version}"]
        client().set_model_version_tag(name, current.version, ROLLED_BACK_TAG, "true")
        _set_champion(name, previous, current.version, "rollback", reasons)
        return Promotion(True, previous, previous, current.version, reasons, "rollback")
