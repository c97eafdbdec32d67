"""`flywheel compare`: retrain runs made by the real stages, read back from MLflow into one table and an HTML report.

The stage runs are made by the stage functions themselves (collect, synthesize, sft, rl, evaluate on a very small
pipeline), so a metric renamed on the writing side leaves a blank column here and the test fails.
"""

from __future__ import annotations

import yaml
from typer.testing import CliRunner

from flywheel import comparison, metrics, registry


def _shrink(project, seed: int) -> None:
    config = yaml.safe_load((project / "pipelines.yaml").read_text())
    small = config["pipelines"]["small"]
    small["environment"] |= {"train_tasks": 60, "heldout_tasks": 16}
    # another seed per run: a second SFT with the same inputs would resume from the first one's last checkpoint
    small["sft"] |= {"steps": 4, "batch_size": 8, "log_every": 2, "eval_fraction": 0.0, "seed": seed}
    small["rl"] |= {"steps": 2, "tasks_per_step": 2, "group_size": 2, "actors": 0, "max_new_tokens": 16,
                    "seed": seed, "monitor_every": seed, "monitor_tasks": 4}  # the second run is monitored
    (project / "pipelines.yaml").write_text(yaml.safe_dump(config))


def _retrain_run(project, stages: list[str], gate_tag: str, version: str) -> str:
    """A retrain run as the flow records it: a parent run whose tags name the stage runs the real stages made."""
    from tasks.collect import collect
    from tasks.evaluate import evaluate
    from tasks.rl import rl
    from tasks.sft import sft
    from tasks.synthesize import synthesize

    functions = {"collect": collect, "synthesize": synthesize, "sft": sft, "rl": rl, "evaluate": evaluate}
    parent = registry.start_run(project, "small", "retrain")
    tags = {"flywheel.gate": gate_tag, "flywheel.registered_version": version,
            "flywheel.dvc.data/small/collect": "0123456789abcdef"}
    for name in stages:
        result = functions[name].fn("small", str(project), parent_run_id=parent.run_id)
        tags[f"stage.{name}.run_id"] = result.run_id
    parent.tags(tags)
    parent.end()
    return parent.run_id


def test_compare_reads_runs_the_stages_made_and_writes_html(project, tmp_path):
    from flywheel.cli import app

    _shrink(project, seed=0)
    old = _retrain_run(project, ["collect", "synthesize", "sft", "rl", "evaluate"], "passed", "1")
    _shrink(project, seed=1)
    new = _retrain_run(project, ["sft", "rl", "evaluate"], "failed", "2")
    rows = comparison.retrain_runs("small", last=5)
    assert [r["run_id"] for r in rows] == [new, old]
    assert rows[0]["data"] == {"collect": "01234567"}

    c = registry.client()
    stage_ids = {name: c.get_run(new).data.tags[f"stage.{name}.run_id"] for name in ("sft", "rl", "evaluate")}
    losses = [(m.step, m.value) for m in c.get_metric_history(stage_ids["sft"], metrics.SFT_LOSS)]
    rewards = [(m.step, m.value) for m in c.get_metric_history(stage_ids["rl"], metrics.RL_REWARD)]
    assert [s for s, _ in sorted(losses)] == [2, 4]
    assert rows[0]["curves"]["sft loss"] == sorted(losses)
    assert rows[0]["curves"]["rl reward_mean"] == sorted(rewards) and len(rewards) == 2

    table = comparison.summary_table(rows)
    # the columns a real run fills: the last logged SFT loss, the last RL step's mean reward, the held-out mean
    # reward and pass rate of every model in columns of their own (the null policy's included)
    assert table.loc[0, "sft loss"] == f"{sorted(losses)[-1][1]:.3f}"
    assert table.loc[0, "rl train reward"] == f"{sorted(rewards)[-1][1]:.3f}"
    scores = c.get_run(stage_ids["evaluate"]).data.metrics
    for label in ("null", "base", "sft"):
        assert table.loc[0, f"{label} reward"] == f"{scores[metrics.score_name(label)]:.3f}"
    for label in ("null", "base", "sft", "rl"):
        assert table.loc[0, f"{label} pass"] == f"{scores[metrics.pass_rate_name(label)]:.3f}"
    assert table.loc[0, "rl reward [95% CI]"].startswith(f"{scores['score_rl']:.3f} [")
    assert scores[metrics.GATE_REFUSED] == 0.0  # the small pipeline's checks are off, its 30 tasks >= min_tasks
    assert table.loc[0, "gate"] == "failed" and table.loc[1, "gate"] == "passed"
    assert all(table.loc[i, column] != "" for i in (0, 1)
               for column in ("sft loss", "rl train reward", "null reward", "base reward", "sft reward", "rl pass"))
    # the reward-hacking monitor's numbers, from the monitored run only
    rl_metrics = c.get_run(stage_ids["rl"]).data.metrics
    assert table.loc[0, "audit"] == f"{rl_metrics[metrics.RL_FINAL_AUDIT]:.3f}"
    assert table.loc[0, "reward-audit gap"] == f"{rl_metrics[metrics.RL_FINAL_GAP]:.3f}"
    assert table.loc[0, "hacking"] == "no" and table.loc[1, "audit"] == table.loc[1, "hacking"] == ""
    assert len(c.get_metric_history(stage_ids["rl"], metrics.AUDIT_PASS)) == 2  # after steps 0 and 1

    out = CliRunner().invoke(app, ["compare", "small", "--last", "1", "--html", str(tmp_path / "r.html"),
                                   "--root", str(project)])
    assert out.exit_code == 0, out.output
    assert new[:8] in out.output and old[:8] not in out.output
    page = (tmp_path / "r.html").read_text()
    assert "Learning curves" in page and "data:image/png;base64" in page and "candidate score" in page
    missing = CliRunner().invoke(app, ["compare", "nothing", "--root", str(project)])
    assert missing.exit_code == 2


def test_summary_keys_are_logged_once_prefixed():
    assert metrics.final_metrics({"final_loss": 0.5, "reward_mean_last": 0.2}) == {
        "final_loss": 0.5, "final_reward_mean_last": 0.2}
    assert metrics.SFT_FINAL_LOSS == "final_loss" and metrics.RL_FINAL_REWARD == "final_reward_mean_last"


def test_cost_saving_and_a_flag_show_in_the_table():
    import pandas as pd

    row = {"run_id": "abcdef0123", "started": pd.Timestamp(0, unit="ms"), "status": "FINISHED", "version": "3",
           "gate": "failed", "data": {}, "params": {}, "curves": {}, "slices": [], "reasons": [],
           "metrics": {f"rl.{metrics.RL_FINAL_HACKING}": 1.0, f"rl.{metrics.RL_FINAL_AUDIT}": 0.25,
                       f"evaluate.{metrics.GATE_COST_SAVING}": 0.31, f"evaluate.{metrics.GATE_COST_SAVING_LOW}": 0.22}}
    table = comparison.summary_table([row])
    assert table.loc[0, "hacking"] == "FLAGGED" and table.loc[0, "audit"] == "0.250"
    assert table.loc[0, "cost saving"] == "31.0% (low 22.0%)"


def test_a_refused_gate_and_both_columns_show_in_the_table():
    import pandas as pd

    row = {"run_id": "abcdef0123", "started": pd.Timestamp(0, unit="ms"), "status": "FINISHED", "version": "4",
           "gate": "failed", "data": {}, "params": {}, "curves": {}, "slices": [], "reasons": [],
           "metrics": {f"evaluate.{metrics.GATE_REFUSED}": 1.0, "evaluate.score_null": 0.7,
                       "evaluate.pass_rate_null": 0.0, "evaluate.score_rl": 0.262, "evaluate.pass_rate_rl": 0.0}}
    table = comparison.summary_table([row])
    assert table.loc[0, "gate"] == "refused"
    assert table.loc[0, "null reward"] == "0.700" and table.loc[0, "null pass"] == "0.000"
    assert table.loc[0, "rl reward [95% CI]"] == "0.262" and table.loc[0, "rl pass"] == "0.000"
