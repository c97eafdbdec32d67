"""Promotion: through the gate (compare-and-set under concurrency), forced, rolled back; retried registration."""

from __future__ import annotations

import threading
from pathlib import Path

import pandas as pd
import pytest
from mlflow import MlflowClient
from typer.testing import CliRunner

from flywheel import promotion, registry
from flywheel.config import GateConfig

GATE = GateConfig(min_score=0.5, mode="non_inferior", margin=0.03, max_slice_regression=0.05,
                  bootstrap_samples=500, confidence=0.95, seed=0)


def _eval_table(folder: Path, solved: int, tasks: int = 40, first: int = 0, null_solves: int = 0,
                base_solves: int = 0, champion_solves: int | None = None) -> Path:
    """An eval table whose candidate rows solve the first `solved` of `tasks` held-out tasks (t<first>...); the
    null policy and the base model the first `null_solves` and `base_solves`; the champion, when it was scored
    beside them, the first `champion_solves`."""
    models = [("rl", solved), ("base", base_solves), ("null", null_solves)]
    models += [] if champion_solves is None else [("champion", champion_solves)]
    rows = [{"task_id": f"t{first + i:03d}", "sample": 0, "reward": float(i < solves), "passed": i < solves,
             "slice": "even" if i % 2 == 0 else "odd", "model": model}
            for model, solves in models for i in range(tasks)]
    path = folder / "eval.parquet"
    pd.DataFrame(rows).to_parquet(path, index=False)
    return path


def _version(tmp_path: Path, label: str, solved: int | None, name: str = "p", first: int = 0, tags: dict | None = None,
             **table) -> str:
    """Register a model version with (or without, when solved is None) a stored eval table."""
    folder = tmp_path / label
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "config.json").write_text(f'{{"id": "{label}"}}')
    table = _eval_table(folder, solved, first=first, **table) if solved is not None else None
    run = registry.start_run(tmp_path, name, "register")
    return registry.register(run, name, folder / "model", f"hash-{label}", tags or {}, ["challenger"],
                             eval_table=table).version


def test_first_version_is_judged_by_the_absolute_rule(tmp_path, mlflow_store):
    weak, good = _version(tmp_path, "weak", 10), _version(tmp_path, "good", 36)
    assert not promotion.promote("p", weak, GATE).promoted
    assert registry.get_alias("p", "champion") is None
    outcome = promotion.promote("p", good, GATE)
    assert outcome.promoted and outcome.previous is None
    assert registry.get_alias("p", "champion").version == good


def test_a_worse_version_does_not_replace_the_champion(tmp_path, mlflow_store):
    good, worse = _version(tmp_path, "good", 38), _version(tmp_path, "worse", 30)
    promotion.promote("p", good, GATE)
    outcome = promotion.promote("p", worse, GATE)
    assert not outcome.promoted and outcome.champion == good
    assert any("non-inferiority not shown" in r for r in outcome.reasons), outcome.reasons


def test_a_stale_decision_is_taken_again_against_the_new_champion(tmp_path, mlflow_store):
    best, worse = _version(tmp_path, "best", 40), _version(tmp_path, "worse", 30)
    promotion.promote("p", best, GATE)
    # `worse` passed against no champion at evaluate time, but `best` became champion meanwhile
    passed = promotion.gate_against_champion("p", worse, None, GATE)
    assert passed.passed
    outcome = promotion.promote("p", worse, GATE, decision=passed, judged_against=None)
    assert not outcome.promoted and registry.get_alias("p", "champion").version == best
    assert "gated again" in outcome.reasons[0]


@pytest.mark.parametrize("order", [("better", "worse"), ("worse", "better")])
def test_concurrent_promotions_leave_one_champion_the_better(tmp_path, mlflow_store, order):
    versions = {"better": _version(tmp_path, "better", 39), "worse": _version(tmp_path, "worse", 30)}
    start = threading.Barrier(2)
    outcomes, errors = {}, []

    def attempt(label: str) -> None:
        try:
            start.wait()
            # each judged against "no champion", as two pipeline runs evaluated before either registered
            decision = promotion.gate_against_champion("p", versions[label], None, GATE)
            outcomes[label] = promotion.promote("p", versions[label], GATE, decision=decision,
                                                judged_against=None)
        except Exception as err:  # noqa: BLE001 -- reported below
            errors.append(err)

    threads = [threading.Thread(target=attempt, args=(label,)) for label in order]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    champion = registry.get_alias("p", "champion")
    assert champion.version == versions["better"]
    holders = [v for v in versions.values() if "champion" in registry.get_version("p", v).aliases]
    assert len(holders) == 1


def test_a_promotion_waits_for_one_that_read_the_champion_before_it(tmp_path, mlflow_store, monkeypatch):
    """The interleaving forced: `worse` reads "no champion" and pauses before setting the alias; `better` then
    tries. With the lock `better` cannot read until `worse` is done, so it is gated against `worse`; without
    it both would act on "no champion" and one would overwrite (or trip over) the other."""
    versions = {"worse": _version(tmp_path, "worse", 30), "better": _version(tmp_path, "better", 39)}
    real_get_alias = promotion.get_alias
    first_read, second_read = threading.Event(), threading.Event()
    state = threading.local()

    def get_alias_then_pause(name: str, alias: str):
        found = real_get_alias(name, alias)
        if not getattr(state, "read", False):  # the read in promote(), not the check in _set_champion
            state.read = True
            if threading.current_thread().name == "worse":
                first_read.set()
                second_read.wait(timeout=3)  # time enough for `better` to read, unless the lock holds it
            else:
                second_read.set()
        return found

    monkeypatch.setattr(promotion, "get_alias", get_alias_then_pause)
    outcomes, errors = {}, []

    def attempt(label: str) -> None:
        try:
            decision = promotion.gate_against_champion("p", versions[label], None, GATE)
            outcomes[label] = promotion.promote("p", versions[label], GATE, decision=decision,
                                                judged_against=None)
        except Exception as err:  # noqa: BLE001 -- reported below
            errors.append(err)

    worse = threading.Thread(target=attempt, args=("worse",), name="worse")
    worse.start()
    assert first_read.wait(timeout=60)
    better = threading.Thread(target=attempt, args=("better",), name="better")
    better.start()
    for thread in (worse, better):
        thread.join(timeout=120)
    assert not errors, errors
    assert outcomes["worse"].promoted and outcomes["worse"].previous is None
    assert outcomes["better"].promoted and outcomes["better"].previous == versions["worse"]
    assert "gated again" in outcomes["better"].reasons[0], "judged against the champion `worse` had just set"
    assert registry.get_alias("p", "champion").version == versions["better"]
    tags = MlflowClient().get_model_version("p", versions["better"]).tags
    assert tags["flywheel.previous_champion"] == versions["worse"]


def test_regating_fails_closed_when_the_held_out_sets_differ(tmp_path, mlflow_store):
    """Two runs evaluated on other held-out tasks: their stored tables do not pair, so no promotion."""
    champion = _version(tmp_path, "champion", 30)
    other = _version(tmp_path, "other", 40, first=100)  # better, on tasks t100..t139
    promotion.promote("p", champion, GATE)
    passed = promotion.gate_against_champion("p", other, None, GATE)
    assert passed.passed, "alone it clears the absolute rule"
    outcome = promotion.promote("p", other, GATE, decision=passed, judged_against=None)
    assert not outcome.promoted and registry.get_alias("p", "champion").version == champion
    assert "gated again" in outcome.reasons[0]
    assert any("do not pair by (task_id, sample): 40 rows only in the candidate's, 40 only in the champion's" in r
               for r in outcome.reasons), outcome.reasons
    assert not promotion.promote("p", other, GATE).promoted  # gated from the stored tables directly: the same
    assert outcome.reasons[-1] == f"`flywheel promote p {other}` from the project root evaluates both on the " \
        "current held-out tasks"


def test_tables_on_other_tasks_gate_on_the_champion_the_version_was_scored_beside(tmp_path, mlflow_store):
    """Traffic added held-out tasks between two evaluations; the later one scored the champion on its own tasks:
    after a rollback the later version is promoted again from that evaluation, with no new one."""
    first = _version(tmp_path, "first", 30)
    promotion.promote("p", first, GATE)
    later = _version(tmp_path, "later", 38, first=100, champion_solves=30, tags={"flywheel.gate_champion": first})
    assert promotion.promote("p", later, GATE).promoted
    assert promotion.rollback("p").champion == first
    again = promotion.promote("p", later, GATE)
    assert again.promoted, again.reasons
    assert again.reasons[0].startswith(f"the stored tables of versions {later} and {first} are on other held-out "
                                       f"tasks: gated on version {later}'s own evaluation")
    assert any("non-inferiority: diff +0.2000" in r for r in again.reasons), again.reasons


def test_tables_on_other_tasks_are_scored_again_when_a_way_is_given(tmp_path, mlflow_store):
    """No evaluation scored both on the same tasks: `reevaluate` scores them again; the gate reads that."""
    champion = _version(tmp_path, "champion", 30)
    other = _version(tmp_path, "other", 40, first=100)
    promotion.promote("p", champion, GATE)
    asked = []

    def reevaluate(version: str, against: str) -> tuple[pd.DataFrame, str]:
        asked.append((version, against))
        frame = pd.read_parquet(_eval_table(tmp_path / "other", 36, first=200, champion_solves=30, tasks=40))
        return frame, "MLflow run abc"

    outcome = promotion.promote("p", other, GATE, reevaluate=reevaluate)
    assert asked == [(other, champion)]
    assert outcome.promoted, outcome.reasons
    assert outcome.reasons[0] == (f"the stored tables of versions {other} and {champion} are on other held-out "
                                  "tasks: both evaluated again on the current 40 held-out tasks (MLflow run abc); "
                                  "the base-model ceiling check is the one taken at registration")


@pytest.mark.parametrize(("table", "why"), [
    ({"null_solves": 40}, "cannot measure: the null policy (an empty answer) scores 1.0000, within gate.margin 0.03"),
    ({"base_solves": 40}, "cannot measure: base is already at the ceiling (1.0000): candidate - base is at most"),
    ({"tasks": 10}, "cannot measure: only 10 held-out tasks, fewer than gate.min_tasks 20"),
])
def test_what_the_eval_cannot_measure_stays_challenger(tmp_path, mlflow_store, table, why):
    """A candidate that solves everything, on an eval that cannot tell it from doing nothing: refused, named why."""
    version = _version(tmp_path, "perfect", table.get("tasks", 40), **table)
    outcome = promotion.promote("p", version, GATE)
    assert not outcome.promoted and any(r.startswith(why) for r in outcome.reasons), outcome.reasons
    assert registry.get_alias("p", "champion") is None
    assert registry.get_alias("p", "challenger").version == version


def test_a_stored_table_without_the_null_row_fails_closed(tmp_path, mlflow_store):
    folder = tmp_path / "old"
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "config.json").write_text("{}")
    frame = pd.read_parquet(_eval_table(folder, 40))
    frame[frame["model"] == "rl"].to_parquet(folder / "eval.parquet", index=False)  # registered before the null row
    run = registry.start_run(tmp_path, "p", "register")
    version = registry.register(run, "p", folder / "model", "hash-old", {}, ["challenger"],
                                eval_table=folder / "eval.parquet").version
    outcome = promotion.promote("p", version, GATE)
    assert not outcome.promoted
    assert any("no null-policy rows to compare the candidate with (gate.check_null)" in r for r in outcome.reasons)


def test_forced_promotion_is_tagged_and_rollback_returns(tmp_path, mlflow_store):
    good, untested = _version(tmp_path, "good", 38), _version(tmp_path, "untested", None)
    promotion.promote("p", good, GATE)
    refused = promotion.promote("p", untested, GATE)
    assert not refused.promoted and "no stored eval table" in refused.reasons[0]
    forced = promotion.promote("p", untested, GATE, force=True)
    assert forced.promoted and forced.how == "forced"
    tags = MlflowClient().get_model_version("p", untested).tags
    assert tags["flywheel.promotion"] == "forced" and tags["flywheel.previous_champion"] == good
    back = promotion.rollback("p")
    assert back.champion == good and registry.get_alias("p", "champion").version == good
    assert MlflowClient().get_model_version("p", untested).tags["flywheel.rolled_back"] == "true"
    with pytest.raises(promotion.PromotionError, match="records no previous champion"):
        promotion.rollback("p")


def test_promote_command(project, tmp_path):
    from flywheel.cli import app

    good, untested = _version(tmp_path, "good", 38, "small"), _version(tmp_path, "untested", None, "small")
    runner = CliRunner()
    ok = runner.invoke(app, ["promote", "small", good, "--root", str(project)])
    assert ok.exit_code == 0, ok.output
    refused = runner.invoke(app, ["promote", "small", untested, "--root", str(project)])
    assert refused.exit_code == 1
    forced = runner.invoke(app, ["promote", "small", untested, "--force", "--root", str(project)])
    assert forced.exit_code == 0 and "forced" in forced.output
    back = runner.invoke(app, ["promote", "small", "--rollback", "--root", str(project)])
    assert back.exit_code == 0 and f"champion is version {good}" in back.output


def test_registration_is_idempotent_under_a_prefect_retry(tmp_path, mlflow_store, prefect_server):
    from prefect import flow, task

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    attempts = []

    @task(retries=1, retry_delay_seconds=0)
    def register_then_fail_once() -> str:
        run = registry.start_run(tmp_path, "p", "register")
        version = registry.register(run, "p", model, "hash-retried", {}, ["challenger"])
        attempts.append(version.version)
        if len(attempts) == 1:
            raise RuntimeError("worker lost after registering")
        return version.version

    @flow
    def retried() -> str:
        return register_then_fail_once()

    assert retried() == "1"
    assert attempts == ["1", "1"]
    assert len(MlflowClient().search_model_versions("name = 'p'")) == 1


def test_concurrent_promotions_from_two_processes(tmp_path, mlflow_store):
    import subprocess
    import sys

    versions = {"better": _version(tmp_path, "better", 39), "worse": _version(tmp_path, "worse", 30)}
    script = ("import sys; from flywheel import promotion; from tests.test_promotion import GATE; "
              "d = promotion.gate_against_champion('p', sys.argv[1], None, GATE); "
              "print(promotion.promote('p', sys.argv[1], GATE, decision=d, judged_against=None).promoted)")
    root = Path(__file__).resolve().parents[1]
    procs = [subprocess.Popen([sys.executable, "-c", script, v], cwd=root, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for v in versions.values()]
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-2000:]
    assert registry.get_alias("p", "champion").version == versions["better"]
    assert [v for v in versions.values() if "champion" in registry.get_version("p", v).aliases] == \
        [versions["better"]]
