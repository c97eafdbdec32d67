"""The promotion gate: a candidate's eval table against the champion's, by the rules in pipelines.yaml.

It fails closed: a missing pair, a NaN, an empty table or any error means no promotion, with the reason. It also
refuses what the eval cannot measure (too few tasks, a null policy or a base model already at the candidate's
level, a slice every model scores the same on): those reasons start with "cannot measure:".
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from flywheel.config import GateConfig
from flywheel.evaluate.stats import bootstrap_mean, paired_bootstrap

COLUMNS = ("task_id", "sample", "reward", "passed", "slice")
KEY = ["task_id", "sample"]
BASELINES = ("null", "base", "sft")  # the eval table's rows beside the candidate that the measurability checks read
REFUSED = "cannot measure: "  # the prefix of a reason the eval cannot measure the candidate
# Scores are means of floats: without a tolerance 0.85 - 0.9 "drops by more than 0.05".
_TOLERANCE = 1e-9


@dataclass
class GateDecision:
    """Whether the candidate may be promoted, every reason, and the numbers behind them."""

    passed: bool
    reasons: list[str] = field(default_factory=list)
    numbers: dict = field(default_factory=dict)
    refusals: list[str] = field(default_factory=list)  # the reasons that say the eval cannot measure it

    def to_json(self) -> str:
        """The decision as JSON text; non-finite numbers become null so the text stays valid JSON."""
        return json.dumps(_finite(asdict(self)), indent=2, sort_keys=True)


def _finite(value):
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer | np.bool_):
        return value.item()
    return value


def _check_table(frame: pd.DataFrame | None, name: str) -> list[str]:
    """What makes an eval table unusable; empty when it is fine."""
    if frame is None:
        return [f"{name}: no eval table"]
    if not isinstance(frame, pd.DataFrame):
        return [f"{name}: expected a pandas DataFrame, got {type(frame).__name__}"]
    missing = [c for c in COLUMNS if c not in frame.columns]
    if missing:
        return [f"{name}: eval table lacks columns {missing}"]
    if frame.empty:
        return [f"{name}: eval table is empty"]
    problems = []
    reward = pd.to_numeric(frame["reward"], errors="coerce")
    if not np.isfinite(reward.to_numpy(dtype=np.float64)).all():
        problems.append(f"{name}: {int((~np.isfinite(reward.to_numpy(dtype=np.float64))).sum())} "
                        "rewards are NaN, infinite or not numbers")
    elif ((reward < 0) | (reward > 1)).any():
        problems.append(f"{name}: rewards outside [0, 1] (min {reward.min()}, max {reward.max()})")
    if frame[KEY].isna().any().any() or frame["slice"].isna().any():
        problems.append(f"{name}: task_id, sample or slice has missing values")
    duplicated = int(frame.duplicated(KEY).sum())
    if duplicated:
        problems.append(f"{name}: {duplicated} duplicated (task_id, sample) rows")
    return problems


def _task_means(frame: pd.DataFrame) -> pd.Series:
    # Samples of one task are correlated: the task, not the row, is the unit the bootstrap resamples.
    return frame.groupby("task_id", sort=True)["reward"].mean()


def _decide(candidate: pd.DataFrame, champion: pd.DataFrame | None, cfg: GateConfig,
            baselines: Mapping[str, pd.DataFrame] | None) -> GateDecision:
    problems = _check_table(candidate, "candidate")
    if champion is not None:
        problems += _check_table(champion, "champion")
    for label, frame in (baselines or {}).items():
        problems += _check_table(frame, label)
    if problems:
        return GateDecision(False, problems)
    boot = {"n": cfg.bootstrap_samples, "alpha": 1.0 - cfg.confidence, "seed": cfg.seed}
    candidate, champion = _floats_of(candidate), None if champion is None else _floats_of(champion)
    decision = _absolute_rules(candidate, cfg, boot)
    if champion is None:
        decision.numbers["slices"] = {str(name): {"candidate": float(rows["reward"].mean()), "rows": len(rows)}
                                      for name, rows in candidate.groupby("slice", sort=True)}
        decision.reasons.append("no champion: only the absolute rule (min_score) applies")
    else:
        decision = _champion_rules(candidate, champion, cfg, boot, decision)
    others = None if baselines is None else {label: _floats_of(frame) for label, frame in baselines.items()}
    refusals, notes = _measurable(candidate, champion, others, cfg, boot, decision.numbers)
    decision.reasons += notes + [REFUSED + r for r in refusals]
    decision.refusals = [REFUSED + r for r in refusals]
    decision.passed = decision.passed and not refusals
    return decision


def _floats_of(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.assign(reward=frame["reward"].astype(np.float64))


def _measurable(candidate: pd.DataFrame, champion: pd.DataFrame | None,
                baselines: dict[str, pd.DataFrame] | None, cfg: GateConfig, boot: dict,
                numbers: dict) -> tuple[list[str], list[str]]:
    """Why the eval cannot tell this candidate apart from doing nothing (refusals), and what it checked (notes).

    baselines None: only the candidate and champion are known, so the checks that read the null and base rows,
    and the flat-slice check over every model, are not applied (the note says so).
    """
    refusals, notes = [], []
    unknown = sorted(set(cfg.report_only_slices) - set(candidate["slice"]))
    if unknown:  # a typo would judge the slice it meant: say so beside the decision
        notes.append(f"gate.report_only_slices names {unknown}, but no held-out task is in that slice")
    tasks = int(candidate["task_id"].nunique())
    if cfg.min_tasks and tasks < cfg.min_tasks:
        refusals.append(f"only {tasks} held-out tasks, fewer than gate.min_tasks {cfg.min_tasks}: an interval over "
                        "so few cannot tell models apart (add held-out tasks)")
    elif cfg.min_tasks:
        notes.append(f"{tasks} held-out tasks >= min_tasks {cfg.min_tasks}")
    if baselines is None:
        if cfg.check_null or cfg.check_ceiling or cfg.check_flat_slices:
            notes.append("no null, base or sft rows given: the null, ceiling and flat-slice checks were not applied")
        return refusals, notes
    own = _task_means(candidate)
    if cfg.check_null:
        refusals += _null_rule(own, baselines.get("null"), cfg, boot, numbers, notes)
    if cfg.check_ceiling:
        refusals += _ceiling_rule(own, baselines.get("base"), cfg, numbers, notes)
    if cfg.check_flat_slices:
        models = {"candidate": candidate, **({} if champion is None else {"champion": champion}), **baselines}
        refusals += _flat_slices(models, numbers, notes, cfg.report_only_slices)
    return refusals, notes


def _covering(own: pd.Series, frame: pd.DataFrame | None, label: str, switch: str) -> tuple[pd.Series | None, str]:
    """The baseline's task means on the candidate's tasks, or why there are none."""
    if frame is None:
        return None, (f"no {label} rows to compare the candidate with (gate.{switch}): evaluate again, or set "
                      f"gate.{switch}: false")
    means = _task_means(frame).reindex(own.index)
    missing = int(means.isna().sum())
    if missing:
        return None, f"the {label} rows miss {missing} of the candidate's {len(own)} tasks (gate.{switch})"
    return means, ""


def _null_rule(own: pd.Series, null: pd.DataFrame | None, cfg: GateConfig, boot: dict, numbers: dict,
               notes: list[str]) -> list[str]:
    """The candidate must beat the null policy (an empty answer) by more than margin, paired lower bound."""
    means, missing = _covering(own, null, "null-policy", "check_null")
    if means is None:
        return [missing]
    diff = paired_bootstrap(own.to_numpy(), means.to_numpy(), **boot)
    numbers["null"] = {"score": float(means.mean()), "pass_rate": float(null["passed"].astype(float).mean()),
                       "diff": diff.estimate, "low": diff.low, "high": diff.high}
    if diff.low > cfg.margin:
        notes.append(f"beats the null policy (an empty answer, {means.mean():.4f}): diff {diff.estimate:+.4f}, "
                     f"lower bound {diff.low:+.4f} > margin {cfg.margin}")
        return []
    return [f"the null policy (an empty answer) scores {means.mean():.4f}, within gate.margin {cfg.margin} of the "
            f"candidate's {own.mean():.4f} (paired lower bound {diff.low:+.4f}): the rubric rewards doing nothing"]


def _ceiling_rule(own: pd.Series, base: pd.DataFrame | None, cfg: GateConfig, numbers: dict,
                  notes: list[str]) -> list[str]:
    """Base must leave room: even a perfect candidate's candidate - base (1 - base) must exceed margin."""
    means, missing = _covering(own, base, "base-model", "check_ceiling")
    if means is None:
        return [missing]
    room = 1.0 - float(means.mean())
    numbers["base"] = {"score": float(means.mean()), "pass_rate": float(base["passed"].astype(float).mean()),
                       "room": room}
    if room > cfg.margin + _TOLERANCE:
        notes.append(f"base scores {means.mean():.4f}: room {room:.4f} > margin {cfg.margin}")
        return []
    return [f"base is already at the ceiling ({means.mean():.4f}): candidate - base is at most {room:.4f}, which "
            f"cannot clear gate.margin {cfg.margin} whatever the candidate does"]


def _flat_slices(models: dict[str, pd.DataFrame], numbers: dict, notes: list[str],
                 report_only: list[str]) -> list[str]:
    """Slices on which every model scored has the same mean reward: they cannot tell models apart (a
    report-only slice is noted, not refused)."""
    means = pd.DataFrame({label: frame.groupby("slice")["reward"].mean() for label, frame in models.items()})
    flat = {str(name): float(row.iloc[0]) for name, row in means.dropna().iterrows()
            if row.max() - row.min() <= _TOLERANCE}
    numbers["flat_slices"] = flat
    unjudged = [n for n in flat if n in report_only]
    for name in unjudged:
        notes.append(f"slice '{name}': every model scores {flat.pop(name):.4f} (gate.report_only_slices: reported, "
                     "not judged)")
    if not flat:
        notes.append(f"every {'other ' if unjudged else ''}slice tells the models apart ({', '.join(models)})")
        return []
    return [f"slice '{name}': every model ({', '.join(models)}) scores {value:.4f}, so it cannot tell them apart"
            for name, value in flat.items()]


def _absolute_rules(candidate: pd.DataFrame, cfg: GateConfig, boot: dict) -> GateDecision:
    """The candidate on its own: min_score on its bootstrap score, and the token and latency limits."""
    score = bootstrap_mean(_task_means(candidate).to_numpy(), **boot)
    numbers: dict = {"candidate": {"score": score.estimate, "low": score.low, "high": score.high,
                                   "pass_rate": float(candidate["passed"].astype(float).mean()),
                                   "rows": len(candidate), "tasks": int(candidate["task_id"].nunique())},
                     "confidence": cfg.confidence, "mode": cfg.mode}
    reasons, passed = [], True
    if score.estimate + _TOLERANCE >= cfg.min_score:
        reasons.append(f"candidate score {score.estimate:.4f} >= min_score {cfg.min_score}")
    else:
        passed = False
        reasons.append(f"candidate score {score.estimate:.4f} is below min_score {cfg.min_score}")

    for column, limit in (("tokens", cfg.max_tokens_per_task), ("latency_s", cfg.max_latency_s)):
        if limit is None:
            continue
        if column not in candidate.columns:
            passed = False
            reasons.append(f"limit on {column} set, but the candidate's eval table has no '{column}' column")
            continue
        mean = float(pd.to_numeric(candidate[column], errors="coerce").mean())  # NaN fails the test below
        numbers["candidate"][column] = mean
        if mean <= limit:
            reasons.append(f"mean {column} per episode {mean:.4g} <= limit {limit}")
        else:
            passed = False
            reasons.append(f"mean {column} per episode {mean:.4g} exceeds limit {limit}")
    return GateDecision(passed, reasons, numbers)


def _champion_rules(candidate: pd.DataFrame, champion: pd.DataFrame, cfg: GateConfig, boot: dict,
                    absolute: GateDecision) -> GateDecision:
    """Against the champion, paired by (task_id, sample): the improvement (or non-inferiority) bound, slices."""
    passed, reasons, numbers = absolute.passed, absolute.reasons, absolute.numbers
    pairs = candidate.merge(champion[KEY + ["reward"]], on=KEY, how="outer", suffixes=("", "_champion"),
                            indicator=True)
    only_candidate = int((pairs["_merge"] == "left_only").sum())
    only_champion = int((pairs["_merge"] == "right_only").sum())
    if only_candidate or only_champion:
        reason = (f"tables do not pair by (task_id, sample): {only_candidate} rows only in the candidate's, "
                  f"{only_champion} only in the champion's (evaluate both on the same held-out tasks)")
        return GateDecision(False, reasons + [reason], numbers)

    champ_score = float(_task_means(champion).mean())
    by_task = pairs.groupby("task_id", sort=True)[["reward", "reward_champion"]].mean()
    diff = paired_bootstrap(by_task["reward"].to_numpy(), by_task["reward_champion"].to_numpy(), **boot)
    bound = cfg.margin if cfg.mode == "improve" else -cfg.margin  # cost_aware: non-inferior in quality
    numbers["champion"] = {"score": champ_score,
                           "pass_rate": float(champion["passed"].astype(float).mean())}
    numbers["diff"] = {"estimate": diff.estimate, "low": diff.low, "high": diff.high, "bound": bound}
    rule = "improvement" if cfg.mode == "improve" else "non-inferiority"
    if diff.low > bound:
        reasons.append(f"{rule}: diff {diff.estimate:+.4f}, lower bound {diff.low:+.4f} > {bound:+.4f}")
    else:
        passed = False
        reasons.append(f"{rule} not shown: diff {diff.estimate:+.4f}, lower bound {diff.low:+.4f} "
                       f"does not exceed {bound:+.4f}")

    if cfg.mode == "cost_aware":
        passed = _cost_rule(candidate, champion, cfg, boot, reasons, numbers) and passed

    slices = {}
    for name, rows in pairs.groupby("slice", sort=True):
        cand, champ = float(rows["reward"].mean()), float(rows["reward_champion"].mean())
        slices[str(name)] = {"candidate": cand, "champion": champ, "delta": cand - champ, "rows": len(rows)}
    numbers["slices"] = slices
    regressed = {name: s["delta"] for name, s in slices.items()
                 if s["delta"] < -cfg.max_slice_regression - _TOLERANCE and name not in cfg.report_only_slices}
    if regressed:
        passed = False
        for name, delta in regressed.items():
            reasons.append(f"slice '{name}' regressed by {-delta:.4f} > max_slice_regression "
                           f"{cfg.max_slice_regression}")
    else:
        reasons.append(f"no slice regressed by more than {cfg.max_slice_regression}")
    return GateDecision(passed, reasons, numbers)


def _cost_rule(candidate: pd.DataFrame, champion: pd.DataFrame, cfg: GateConfig, boot: dict, reasons: list[str],
               numbers: dict) -> bool:
    """cost_aware: the candidate's relative saving in mean cost_metric per task, 1 - candidate / champion, must
    have a paired-bootstrap lower bound of at least min_token_saving."""
    column = cfg.cost_metric
    missing = [who for who, frame in (("candidate", candidate), ("champion", champion)) if column not in frame.columns]
    if missing:
        reasons.append(f"cost_aware gate: the {' and '.join(missing)} eval table has no '{column}' column")
        return False
    cost = candidate[KEY + [column]].merge(champion[KEY + [column]], on=KEY, suffixes=("", "_champion"))
    by_task = cost.groupby("task_id", sort=True)[[column, f"{column}_champion"]].mean().astype(np.float64)
    champion_mean = float(by_task[f"{column}_champion"].mean())
    if not champion_mean > 0:
        reasons.append(f"cost_aware gate: the champion's mean {column} is {champion_mean}: no saving to measure")
        return False
    diff = paired_bootstrap(by_task[f"{column}_champion"].to_numpy(), by_task[column].to_numpy(), **boot)
    # the saving relative to the champion's mean: the paired interval of the difference, scaled
    saving = {"metric": column, "candidate": float(by_task[column].mean()), "champion": champion_mean,
              "saved": diff.estimate, "saved_low": diff.low, "saved_high": diff.high,
              "saving": diff.estimate / champion_mean, "low": diff.low / champion_mean,
              "high": diff.high / champion_mean, "min_saving": cfg.min_token_saving}
    numbers["cost"] = saving
    if saving["low"] >= cfg.min_token_saving - _TOLERANCE:
        reasons.append(f"cheaper: mean {column} {saving['candidate']:.4g} vs champion {champion_mean:.4g}, saving "
                       f"{saving['saving']:.1%} (lower bound {saving['low']:.1%}) >= min_token_saving "
                       f"{cfg.min_token_saving:.1%}")
        return True
    reasons.append(f"not cheaper enough: mean {column} {saving['candidate']:.4g} vs champion {champion_mean:.4g}, "
                   f"saving {saving['saving']:.1%} (lower bound {saving['low']:.1%}) < min_token_saving "
                   f"{cfg.min_token_saving:.1%}")
    return False


def decide(candidate: pd.DataFrame, champion: pd.DataFrame | None, cfg: GateConfig,
           flags: list[str] | tuple[str, ...] = (),
           baselines: Mapping[str, pd.DataFrame] | None = None) -> GateDecision:
    """Apply the gate rules; never raises: any error is a failed decision that says what went wrong.

    flags: reasons the candidate is refused whatever its scores (the RL reward-hacking monitor's verdict).
    baselines: label -> eval rows of the models scored beside it on the same tasks (BASELINES: null, base, sft),
    which the measurability checks read; a label they need that is missing fails closed.
    """
    try:
        decision = _decide(candidate, champion, cfg, baselines)
        if flags:
            decision.passed = False
            decision.reasons.extend(f"flagged: {flag}" for flag in flags)
            decision.numbers["flags"] = list(flags)
        # Last line of defence: a NaN that slipped through must not read as a pass.
        if decision.passed and not all(math.isfinite(v) for v in _floats(decision.numbers)):
            reasons = decision.reasons + ["a gate number is NaN or infinite"]
            return GateDecision(False, reasons, decision.numbers, decision.refusals)
        return decision
    except Exception as err:  # noqa: BLE001 -- fail closed: an error in the gate means no promotion
        return GateDecision(False, [f"gate error: {type(err).__name__}: {err}"])


def _floats(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _floats(v)
    elif isinstance(value, float | np.floating):
        yield float(value)
