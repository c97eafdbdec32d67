"""A run that learned nothing, through the real flow with every measurability check on: the small student scores 0
like the null policy and its RL makes no update, so the gate refuses and names why, the version stays challenger,
and the summary says RL did nothing; two reference arms through the test OpenAI server (one dies midway) are in
the summary, MLflow and the registry tags with the candidate's shares of their pass rate and cost."""

from __future__ import annotations

import pytest
import yaml
from openai_server import OracleServer


def _configure(project, healthy: OracleServer, dying: OracleServer) -> None:
    config = yaml.safe_load((project / "pipelines.yaml").read_text())
    small = config["pipelines"]["small"]
    small["environment"] |= {"train_tasks": 60, "heldout_tasks": 24}
    small["sft"] |= {"steps": 4, "batch_size": 8, "log_every": 2, "eval_fraction": 0.0}
    small["rl"] |= {"steps": 2, "tasks_per_step": 2, "group_size": 2, "actors": 0, "max_new_tokens": 16}
    small["gate"] = {"min_score": 0.0, "mode": "non_inferior", "margin": 0.05}  # the checks at their defaults: on
    small["evaluate"] = {
        "student_price_input_per_mtok": 0.1, "student_price_output_per_mtok": 0.4,
        "references": [
            {"name": "oracle", "model": "oracle", "base_url": healthy.url, "price_input_per_mtok": 2.5,
             "price_output_per_mtok": 10.0, "cache": None},
            {"name": "dying", "model": "oracle", "base_url": dying.url, "concurrency": 4, "max_retries": 1,
             "breaker_failures": 2, "timeout_s": 5, "cache": None}]}
    (project / "pipelines.yaml").write_text(yaml.safe_dump(config))


@pytest.mark.slow
def test_a_run_that_learned_nothing_is_refused_and_says_so(project, prefect_server, capsys):
    from flows.retrain import retrain
    from flywheel import registry
    from flywheel.cli.render import print_summary
    from tasks.rl import NoUpdatesError, rl

    with OracleServer(retry_after="0.1") as healthy, OracleServer(retry_after="0.1") as dying:
        dying.down_after = 12  # answers 12 requests (a few tasks), then drops every connection
        _configure(project, healthy, dying)
        summary = retrain(pipeline="small", root=str(project))

    # refused, named why: the null policy is at the candidate's level and no slice tells the models apart
    assert not summary.gate_passed
    assert summary.scores["score_null"] == summary.pass_rates["pass_rate_null"] == 0.0
    assert summary.scores["score_rl"] == 0.0
    refused = summary.refused
    assert any(r.startswith("cannot measure: the null policy (an empty answer) scores 0.0000") for r in refused)
    assert any(r.startswith("cannot measure: slice 'add': every model (candidate, null, base, sft)") for r in refused)
    assert set(refused) <= set(summary.gate_reasons)
    # RL made no update (every group's rewards were 0): said in the summary
    assert summary.warnings == ["RL made 0 optimiser updates in 2 steps; 100% of its groups had equal rewards, "
                                "so no signal: the RL model is the SFT model"]
    # the references: the healthy one whole, the dying one incomplete, neither in the gate
    oracle, broken = summary.references["oracle"], summary.references["dying"]
    assert oracle["pass_rate"] > 0.9 and not oracle["incomplete"] and oracle["unanswered"] == 0
    assert oracle["pass_share"] == 0.0 and 0 < oracle["cost_share"] < 1  # the student is cheaper, and fails
    assert broken["incomplete"] and broken["unanswered"] > 0 and broken["tasks"] > 0
    assert "TeacherError" in broken["failure"]
    assert not any("oracle" in r or "dying" in r for r in summary.gate_reasons), "the gate never reads them"

    # the version is challenger, not champion; its tags say all of it
    version = registry.client().get_model_version("small", summary.version)
    assert list(version.aliases) == ["challenger"] and registry.get_alias("small", "champion") is None
    tags = version.tags
    assert tags["flywheel.gate"] == "failed" and "the null policy (an empty answer)" in tags["flywheel.gate_refused"]
    assert tags["flywheel.pass_rate.null"] == "0.0" and tags["flywheel.score.score_null"] == "0.0"
    assert tags["flywheel.reference.oracle.pass_share"] == "0.0"
    assert float(tags["flywheel.reference.oracle.cost_share"]) == pytest.approx(oracle["cost_share"], abs=1e-6)
    assert tags["flywheel.reference.oracle"].startswith("reference 'oracle': pass rate 1.000; the candidate "
                                                        "reaches 0.0% of it at ")
    assert f"INCOMPLETE: {broken['unanswered']} task(s) unanswered" in tags["flywheel.reference.dying"]
    assert tags["flywheel.rl_no_updates"] == summary.warnings[0]

    # MLflow: the evaluate run's metrics and the rl run's tag and per-step share
    client = registry.client()
    parent = client.get_run(summary.run_id)
    evaluated = client.get_run(parent.data.tags["stage.evaluate.run_id"]).data
    assert evaluated.metrics["gate_refused"] == 1.0 and evaluated.metrics["pass_rate_null"] == 0.0
    assert evaluated.metrics["reference_oracle_pass_share"] == 0.0
    assert evaluated.metrics["reference_oracle_cost_share"] == pytest.approx(oracle["cost_share"])
    assert evaluated.metrics["reference_dying_unanswered"] == broken["unanswered"]
    assert "the null policy" in evaluated.tags["flywheel.gate_refused"]

    # every held-out episode of every arm is an MLflow trace of the evaluate run, with the rubric's verdict
    import mlflow

    from flywheel.data.catalog import Catalog

    evaluate_run = parent.data.tags["stage.evaluate.run_id"]
    table = Catalog(project, "small").read("eval")
    # RL's output is SFT's checkpoint byte for byte: evaluate gives it SFT's episodes (their latencies too),
    # not the same greedy episodes generated twice
    sft_rows, rl_rows = (table[table["model"] == m].drop(columns="model").reset_index(drop=True) for m in ("sft", "rl"))
    assert len(rl_rows) == (table["model"] == "null").sum() and rl_rows.equals(sft_rows)
    traces = mlflow.search_traces(locations=[parent.info.experiment_id], run_id=evaluate_run, return_type="list")
    assert sorted((t.info.tags["flywheel.model"], t.info.tags["flywheel.task_id"]) for t in traces) == sorted(
        zip(table["model"], table["task_id"], strict=True))
    assert {t.info.tags["flywheel.split"] for t in traces} == {"heldout"}
    passed = dict(zip(zip(table["model"], table["task_id"], strict=True), table["passed"], strict=True))
    for trace in traces:
        verdict = {a.name: a.value for a in trace.info.assessments}
        assert verdict["passed"] == passed[trace.info.tags["flywheel.model"], trace.info.tags["flywheel.task_id"]]
        assert "reward" in verdict and any(name.startswith("rubric.") for name in verdict)
    assert evaluated.metrics["traces"] == len(table)
    rl_run = parent.data.tags["stage.rl.run_id"]
    assert client.get_run(rl_run).data.tags["flywheel.rl_no_updates"] == summary.warnings[0]
    assert [m.value for m in client.get_metric_history(rl_run, "skipped_group_share")] == [1.0, 1.0]

    # the printed summary: both columns, the null and reference rows, the refusal, the warning
    print_summary(summary, project, 1.0)
    shown = capsys.readouterr().out
    for text in ("mean reward", "pass rate", "null (empty answer)", "oracle (reference)", "dying (reference)",
                 "incomplete: ", "refused: the eval cannot measure this candidate",
                 "reference 'oracle': pass rate 1.000; the candidate reaches 0.0% of it",
                 "warning: RL made 0 optimiser updates"):
        assert text in shown, (text, shown)

    # asked to, RL that changed nothing fails its stage
    config = yaml.safe_load((project / "pipelines.yaml").read_text())
    config["pipelines"]["small"]["rl"]["fail_on_no_updates"] = True
    (project / "pipelines.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(NoUpdatesError, match=r"pipeline 'small': RL made 0 optimiser updates .*"
                                             r"\(rl.fail_on_no_updates is true\)"):
        rl.fn("small", str(project))
