"""The promotion gate and the bootstrap statistics it rests on."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from flywheel.config import GateConfig
from flywheel.evaluate.gate import decide
from flywheel.evaluate.stats import bootstrap_mean, paired_bootstrap


def table(rewards, slices=None, samples: int = 1) -> pd.DataFrame:
    """An eval table: rewards[i][s] is task i's sample s (or a flat list with one sample each)."""
    rows = []
    for i, r in enumerate(rewards):
        per_sample = r if isinstance(r, list | tuple) else [r] * samples
        for s, value in enumerate(per_sample):
            rows.append({"task_id": f"t{i:03d}", "sample": s, "reward": float(value), "passed": value >= 1.0,
                         "slice": slices[i] if slices else "all"})
    return pd.DataFrame(rows)


def cfg(**kw) -> GateConfig:
    base = {"min_score": 0.5, "mode": "improve", "margin": 0.02, "max_slice_regression": 0.05,
            "bootstrap_samples": 1000, "confidence": 0.95, "seed": 0}
    return GateConfig(**(base | kw))


RNG = np.random.default_rng(123)
CHAMPION = (RNG.random(200) < 0.7).astype(float)  # 70% solved
BETTER = np.where(RNG.random(200) < 0.6, 1.0, CHAMPION)  # fixes ~60% of the failures, breaks none


def test_clear_improvement_passes():
    d = decide(table(BETTER), table(CHAMPION), cfg())
    assert d.passed, d.reasons
    assert d.numbers["diff"]["low"] > 0.02
    assert d.numbers["candidate"]["score"] == pytest.approx(BETTER.mean())
    assert d.numbers["champion"]["score"] == pytest.approx(CHAMPION.mean())
    json.loads(d.to_json())


def test_below_min_score_fails():
    d = decide(table(BETTER), table(CHAMPION), cfg(min_score=0.99))
    assert not d.passed
    assert any("below min_score" in r for r in d.reasons)


def test_bound_not_cleared_fails_in_improve_mode():
    d = decide(table(CHAMPION), table(CHAMPION), cfg())
    assert not d.passed
    assert any("improvement not shown" in r for r in d.reasons)


def test_non_inferiority_holds_for_an_equal_candidate():
    d = decide(table(CHAMPION), table(CHAMPION), cfg(mode="non_inferior"))
    assert d.passed, d.reasons
    assert d.numbers["diff"] == {"estimate": 0.0, "low": 0.0, "high": 0.0, "bound": -0.02}


def test_non_inferiority_fails_for_a_clearly_worse_candidate():
    worse = np.where(RNG.random(200) < 0.3, 0.0, CHAMPION)
    d = decide(table(worse), table(CHAMPION), cfg(mode="non_inferior", min_score=0.0))
    assert not d.passed
    assert any("non-inferiority not shown" in r for r in d.reasons)


def test_slice_regression_fails_even_when_the_mean_improves():
    slices = ["easy"] * 100 + ["hard"] * 100
    champion = np.r_[np.zeros(100), np.ones(100)]
    candidate = np.r_[np.ones(100), np.r_[np.zeros(10), np.ones(90)]]  # easy +1.0, hard -0.1
    d = decide(table(candidate, slices), table(champion, slices), cfg())
    assert not d.passed
    assert d.numbers["slices"]["hard"]["delta"] == pytest.approx(-0.1)
    assert d.numbers["slices"]["easy"]["delta"] == pytest.approx(1.0)
    assert any("slice 'hard' regressed" in r for r in d.reasons)
    # A drop of exactly the limit is allowed (float noise must not fail it).
    candidate = np.r_[np.ones(100), np.r_[np.zeros(5), np.ones(95)]]
    assert decide(table(candidate, slices), table(champion, slices), cfg()).passed


def test_missing_pairs_fail_closed():
    champion = table(CHAMPION)
    d = decide(table(BETTER).iloc[1:], champion, cfg())
    assert not d.passed
    assert any("do not pair" in r and "1 only in the champion" in r for r in d.reasons)
    other_samples = champion.assign(sample=champion["sample"] + 1)
    assert not decide(table(BETTER), other_samples, cfg()).passed


@pytest.mark.parametrize("who", ["candidate", "champion"])
def test_nan_fails_closed(who):
    frames = {"candidate": table(BETTER), "champion": table(CHAMPION)}
    frames[who].loc[3, "reward"] = float("nan")
    d = decide(frames["candidate"], frames["champion"], cfg())
    assert not d.passed
    assert any(who in r and "NaN" in r for r in d.reasons)
    json.loads(d.to_json())


def test_bad_tables_fail_closed_and_never_raise():
    empty = table(BETTER).iloc[:0]
    assert not decide(empty, None, cfg()).passed
    assert not decide(table(BETTER).drop(columns="slice"), None, cfg()).passed
    assert not decide(None, None, cfg()).passed
    assert not decide("not a frame", table(CHAMPION), cfg()).passed
    dup = pd.concat([table(BETTER), table(BETTER).iloc[:1]])
    assert not decide(dup, table(CHAMPION), cfg()).passed
    d = decide(table(BETTER), table(CHAMPION), object())  # a broken config: the error is the reason
    assert not d.passed and d.reasons[0].startswith("gate error: AttributeError")


def test_no_champion_uses_the_absolute_rule_only():
    assert decide(table(CHAMPION), None, cfg(min_score=0.6)).passed
    d = decide(table(CHAMPION), None, cfg(min_score=0.8))
    assert not d.passed
    assert "diff" not in d.numbers
    assert d.numbers["slices"] == {"all": {"candidate": pytest.approx(CHAMPION.mean()), "rows": 200}}


def test_samples_are_averaged_per_task_before_resampling():
    champion = table([[0.0, 1.0]] * 50 + [[1.0, 1.0]] * 50)
    candidate = table([[1.0, 1.0]] * 100)
    d = decide(candidate, champion, cfg())
    per_task = paired_bootstrap(np.ones(100), np.r_[np.full(50, 0.5), np.ones(50)], n=1000, seed=0)
    assert d.numbers["diff"]["low"] == pytest.approx(per_task.low)
    assert d.numbers["diff"]["estimate"] == pytest.approx(0.25)


def test_identical_differences_give_a_point_interval():
    a, b = np.full(30, 0.75), np.full(30, 0.5)
    assert paired_bootstrap(a, b, n=500, seed=1) == (0.25, 0.25, 0.25)


def test_paired_bootstrap_matches_a_hand_computation():
    a = np.array([1.0, 0.0, 1.0, 1.0, 0.5, 1.0, 0.0, 1.0])
    b = np.array([0.0, 0.0, 1.0, 0.0, 0.5, 1.0, 1.0, 0.0])
    got = paired_bootstrap(a, b, n=4000, alpha=0.1, seed=7)
    # Independently: one resample of the 8 differences at a time from the same seeded generator.
    rng = np.random.default_rng(7)
    d = a - b
    means = [np.mean([d[i] for i in rng.integers(0, len(d), size=len(d))]) for _ in range(4000)]
    assert got.estimate == pytest.approx(0.25)
    assert got.low == pytest.approx(np.percentile(means, 5))
    assert got.high == pytest.approx(np.percentile(means, 95))
    assert got.low < 0 < got.high  # 8 tasks cannot show this +0.25 is real


def test_bootstrap_mean_is_close_to_the_normal_interval():
    x = np.random.default_rng(0).random(400)
    got = bootstrap_mean(x, n=5000, alpha=0.05, seed=0)
    half = 1.96 * x.std() / np.sqrt(len(x))
    assert got.estimate == pytest.approx(x.mean())
    assert got.low == pytest.approx(x.mean() - half, abs=0.005)
    assert got.high == pytest.approx(x.mean() + half, abs=0.005)


def test_cost_and_latency_limits():
    frame = table(BETTER).assign(tokens=120, latency_s=0.5)
    assert decide(frame, table(CHAMPION), cfg(max_tokens_per_task=200, max_latency_s=1.0)).passed
    over = decide(frame, table(CHAMPION), cfg(max_tokens_per_task=100))
    assert not over.passed and any("tokens per episode 120 exceeds limit 100" in r for r in over.reasons)
    slow = decide(frame.assign(latency_s=float("nan")), None, cfg(max_latency_s=1.0))
    assert not slow.passed, "a NaN latency cannot pass a latency limit"
    missing = decide(table(BETTER), None, cfg(max_latency_s=1.0))
    assert not missing.passed and any("no 'latency_s' column" in r for r in missing.reasons)


def _costed(frame: pd.DataFrame, tokens: np.ndarray) -> pd.DataFrame:
    return frame.assign(tokens=tokens[frame.index.to_numpy() % len(tokens)])


def test_cost_aware_passes_an_equal_but_cheaper_candidate_and_reports_both_differences():
    spend = np.random.default_rng(7).integers(80, 120, 200).astype(float)
    champion = _costed(table(CHAMPION), spend)
    cheaper = _costed(table(CHAMPION), spend * 0.7)  # the same answers, 30% fewer tokens
    d = decide(cheaper, champion, cfg(mode="cost_aware", margin=0.03, min_token_saving=0.2))
    assert d.passed, d.reasons
    assert d.numbers["diff"]["estimate"] == 0.0
    cost = d.numbers["cost"]
    assert cost["metric"] == "tokens" and cost["saving"] == pytest.approx(0.3)
    assert cost["low"] <= cost["saving"] <= cost["high"] and cost["low"] >= 0.2
    assert any(r.startswith("cheaper:") for r in d.reasons), d.reasons
    json.loads(d.to_json())


def test_cost_aware_refuses_a_saving_below_the_minimum_or_a_worse_quality():
    spend = np.random.default_rng(7).integers(80, 120, 200).astype(float)
    champion = _costed(table(CHAMPION), spend)
    slightly = decide(_costed(table(CHAMPION), spend * 0.95), champion, cfg(mode="cost_aware", min_token_saving=0.2))
    assert not slightly.passed and any("not cheaper enough" in r for r in slightly.reasons), slightly.reasons
    worse = (RNG.random(200) < 0.4).astype(float)
    cheap_but_worse = decide(_costed(table(worse), spend * 0.5), champion, cfg(mode="cost_aware", margin=0.03))
    assert not cheap_but_worse.passed
    assert any("non-inferiority not shown" in r for r in cheap_but_worse.reasons), cheap_but_worse.reasons
    latency = decide(table(CHAMPION).assign(latency_s=1.0), table(CHAMPION).assign(latency_s=2.0),
                     cfg(mode="cost_aware", cost_metric="latency_s", min_token_saving=0.4))
    assert latency.passed and latency.numbers["cost"]["saving"] == pytest.approx(0.5), latency.reasons
    no_column = decide(table(CHAMPION), champion, cfg(mode="cost_aware"))
    assert not no_column.passed and any("no 'tokens' column" in r for r in no_column.reasons)


def test_a_flag_refuses_a_candidate_whatever_its_scores():
    reason = "reward hacking: training reward rose while audit_pass fell"
    d = decide(table(BETTER), table(CHAMPION), cfg(), flags=[reason])
    assert not d.passed and f"flagged: {reason}" in d.reasons and d.numbers["flags"] == [reason]
    assert decide(table(BETTER), table(CHAMPION), cfg(), flags=[]).passed


# ---- what the eval cannot measure: refused, whatever the scores -------------------------------------------------

SLICES = ["add"] * 100 + ["mul"] * 100


def baselines(null=None, base=None, sft=None) -> dict[str, pd.DataFrame]:
    """The rows scored beside the candidate: by default the null policy and base solve nothing, SFT as champion."""
    zeros = np.zeros(200)
    return {"null": table(zeros if null is None else null, SLICES),
            "base": table(zeros if base is None else base, SLICES),
            "sft": table(CHAMPION if sft is None else sft, SLICES)}


def test_a_measurable_candidate_passes_every_check_and_says_so():
    d = decide(table(BETTER, SLICES), table(CHAMPION, SLICES), cfg(), baselines=baselines())
    assert d.passed and d.refusals == [], d.reasons
    assert any(r.startswith("beats the null policy") for r in d.reasons)
    assert any(r.startswith("base scores 0.0000: room 1.0000") for r in d.reasons)
    assert "every slice tells the models apart (candidate, champion, null, base, sft)" in d.reasons
    assert d.numbers["null"]["score"] == 0.0 and d.numbers["base"]["room"] == 1.0 and d.numbers["flat_slices"] == {}
    json.loads(d.to_json())


def test_a_null_policy_as_good_as_the_candidate_is_refused():
    """An empty answer scoring what the candidate does: the rubric rewards doing nothing."""
    d = decide(table(BETTER, SLICES), None, cfg(), baselines=baselines(null=BETTER))
    assert not d.passed
    assert d.refusals == [r for r in d.reasons if r.startswith("cannot measure: ")]
    assert any("the null policy (an empty answer) scores" in r and "within gate.margin 0.02" in r
               for r in d.refusals), d.reasons
    # a null policy a little below the candidate, within the margin, is refused as well
    close = np.where(np.arange(200) < 2, 0.0, BETTER)
    assert any("null policy" in r for r in decide(table(BETTER, SLICES), None, cfg(),
                                                  baselines=baselines(null=close)).refusals)
    assert decide(table(BETTER, SLICES), None, cfg(check_null=False, check_flat_slices=False),
                  baselines=baselines(null=BETTER)).passed


def test_a_base_model_at_the_ceiling_is_refused():
    """Base solves 199 of 200: even a perfect candidate is at most 0.005 above it, under the margin."""
    base = np.r_[np.zeros(1), np.ones(199)]
    d = decide(table(np.ones(200), SLICES), None, cfg(margin=0.02), baselines=baselines(base=base))
    assert not d.passed
    assert any("base is already at the ceiling (0.9950): candidate - base is at most 0.0050, which cannot clear "
               "gate.margin 0.02" in r for r in d.refusals), d.reasons
    assert d.numbers["base"]["room"] == pytest.approx(0.005)
    assert decide(table(np.ones(200), SLICES), None, cfg(check_ceiling=False),
                  baselines=baselines(base=base)).passed


def test_too_few_held_out_tasks_are_refused():
    few = table(np.ones(12))
    d = decide(few, None, cfg(min_tasks=20))
    assert not d.passed
    assert d.refusals == ["cannot measure: only 12 held-out tasks, fewer than gate.min_tasks 20: an interval over so "
                          "few cannot tell models apart (add held-out tasks)"]
    assert decide(few, None, cfg(min_tasks=0)).passed
    assert decide(table(np.ones(20)), None, cfg(min_tasks=20)).passed


def test_a_slice_every_model_scores_the_same_on_is_refused():
    """'mul' is solved by nobody, not even the candidate: it cannot tell any model from another."""
    candidate = np.r_[np.ones(100), np.zeros(100)]
    d = decide(table(candidate, SLICES), None, cfg(min_score=0.0, margin=0.0),
               baselines=baselines(sft=np.r_[np.full(100, 0.5), np.zeros(100)]))
    assert not d.passed
    assert d.refusals == ["cannot measure: slice 'mul': every model (candidate, null, base, sft) scores 0.0000, so it "
                          "cannot tell them apart"]
    assert d.numbers["flat_slices"] == {"mul": 0.0}
    assert decide(table(candidate, SLICES), None, cfg(min_score=0.0, margin=0.0, check_flat_slices=False),
                  baselines=baselines(sft=np.r_[np.full(100, 0.5), np.zeros(100)])).passed
    report_only = decide(table(candidate, SLICES), None, cfg(min_score=0.0, margin=0.0, report_only_slices=["mul"]),
                         baselines=baselines(sft=np.r_[np.full(100, 0.5), np.zeros(100)]))
    assert report_only.passed and report_only.refusals == []
    assert "slice 'mul': every model scores 0.0000 (gate.report_only_slices: reported, not judged)" \
        in report_only.reasons
    assert "every other slice tells the models apart (candidate, null, base, sft)" in report_only.reasons


def test_a_report_only_slice_may_regress_and_still_counts_overall():
    champion = np.r_[np.full(100, 0.6), np.full(100, 0.5)]
    candidate = np.r_[np.full(100, 0.9), np.full(100, 0.3)]  # 'mul' down 0.2, the whole up 0.05
    assert not decide(table(candidate, SLICES), table(champion, SLICES), cfg(margin=0.0, min_score=0.0)).passed
    d = decide(table(candidate, SLICES), table(champion, SLICES),
               cfg(margin=0.0, min_score=0.0, report_only_slices=["mul"]))
    assert d.passed and d.numbers["slices"]["mul"]["delta"] == pytest.approx(-0.2)
    assert d.numbers["candidate"]["score"] == pytest.approx(0.6)  # the slice's tasks stay in the overall score
    typo = decide(table(candidate, SLICES), None, cfg(min_score=0.0, report_only_slices=["mull"]))
    assert "gate.report_only_slices names ['mull'], but no held-out task is in that slice" in typo.reasons


def test_missing_baselines_fail_closed_and_none_given_is_said():
    only_sft = {"sft": table(CHAMPION, SLICES)}
    d = decide(table(BETTER, SLICES), None, cfg(), baselines=only_sft)
    assert not d.passed
    assert any("no null-policy rows to compare the candidate with (gate.check_null)" in r for r in d.refusals)
    assert any("no base-model rows" in r and "gate.check_ceiling" in r for r in d.refusals)
    partial = baselines() | {"null": table(np.zeros(150), SLICES[:150])}
    assert any("the null-policy rows miss 50 of the candidate's 200 tasks" in r
               for r in decide(table(BETTER, SLICES), None, cfg(), baselines=partial).refusals)
    broken = baselines() | {"null": table(np.zeros(200), SLICES).assign(reward=float("nan"))}
    assert not decide(table(BETTER, SLICES), None, cfg(), baselines=broken).passed
    unknown = decide(table(BETTER, SLICES), None, cfg())
    assert unknown.passed and "no null, base or sft rows given: the null, ceiling and flat-slice checks were not " \
                              "applied" in unknown.reasons
