"""`flywheel compare`: retrain runs made by the real stages, read back from MLflow into one table and an HTML report.

The stage runs are made by the stage functions themselves (collect, synthesize, sft, rl, evaluate on a very small
pipeline), so a metric renamed on the writing side leaves a blank column here and the test fails.
"""

from __future__ import annotations

import io

import yaml
from rich.console import Console
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
    assert [s for s, _ in sorted(losses)] == [1, 2, 4]  # the first step, then every log_every
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
    # a run named by the first characters of its id, as the tables print it, or by all of it; params on request,
    # one per line, every line within the terminal's 100 columns (COLUMNS, as a shell exports it)
    out = CliRunner().invoke(app, ["compare", "small", old[:8], new, "--params", "--root", str(project)],
                             env={"COLUMNS": "100"})
    assert out.exit_code == 0, out.output
    assert max(len(line) for line in out.output.splitlines()) <= 100, out.output
    assert [line.split()[0] for line in out.output.splitlines() if line.startswith((old[:8], new[:8]))][:2] == [
        old[:8], new[:8]]
    steps = [line.split() for line in out.output.splitlines() if line.startswith("sft.steps ")]
    assert steps == [["sft.steps", "4", "4"]], out.output
    assert any(line.startswith("rl.loss_type ") for line in out.output.splitlines()), "every logged param"
    unknown = CliRunner().invoke(app, ["compare", "small", "zzzzzzzz", "--root", str(project)])
    assert unknown.exit_code == 2 and "no retrain run of 'small' has an id starting with 'zzzzzzzz'" in unknown.output
    page = (tmp_path / "r.html").read_text()
    assert "Learning curves" in page and "data:image/png;base64" in page and "candidate score" in page
    # each run's models side by side per slice (null, base, sft, rl): the figure the evaluate run keeps too
    assert f"run {new[:8]}: held-out mean reward by slice, each model" in page
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


def _filled_row(n: int) -> dict:
    """A run with every column of the tables filled, at its widest (a negative reward, an interval, a flag)."""
    import pandas as pd

    m = {f"sft.{metrics.SFT_FINAL_LOSS}": 1.234, f"rl.{metrics.RL_FINAL_REWARD}": -0.25,
         **{f"evaluate.{metrics.score_name(label)}": 0.5 for label in comparison.MODELS},
         **{f"evaluate.{metrics.pass_rate_name(label)}": 0.125 for label in comparison.MODELS},
         "evaluate.gate_candidate_low": 0.1, "evaluate.gate_candidate_high": 0.4,
         "evaluate.gate_diff_estimate": 0.012, "evaluate.gate_diff_low": -0.05,
         f"rl.{metrics.RL_FINAL_AUDIT}": 0.25, f"rl.{metrics.RL_FINAL_GAP}": -0.125,
         f"rl.{metrics.RL_FINAL_HACKING}": 1.0, f"evaluate.{metrics.GATE_COST_SAVING}": 0.31,
         f"evaluate.{metrics.GATE_COST_SAVING_LOW}": 0.22}
    return {"run_id": f"{n}abcdef0123456789abcdef012345678", "started": pd.Timestamp(1.7e12 + n * 1e8, unit="ms"),
            "status": "FINISHED", "version": str(10 + n), "gate": "refused" if n % 2 else "passed",
            "data": {"collect": "01234567", "synthesize": "89abcdef", "rl": "deadbeef", "evaluate": "cafebabe"},
            "params": {"sft.steps": str(600 * n), "sft.lr": "0.001", "gate.mode": "non_inferior",
                       "collect.sources": "[{'name': 'agent', 'path': ['examples/traces/*.jsonl']}]",
                       "evaluate.student_price_output_per_mtok": "0.0"},
            "curves": {}, "slices": [], "reasons": [], "metrics": m}


def _render(table, width: int) -> list[str]:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(table)
    return console.export_text().splitlines()


def _body(lines: list[str]) -> list[str]:
    """The lines under a table's header rule."""
    rule = next(i for i, line in enumerate(lines) if line.strip() and set(line.strip()) == {"─"})
    return lines[rule + 1:]


def test_every_run_is_one_line_in_each_table_at_100_and_160_columns():
    rows = [_filled_row(n) for n in range(1, 6)]
    for width in (100, 160):
        tables = comparison.terminal_tables(rows, "demo", width)
        assert len(tables) == 3  # the runs, their held-out scores, the gate and the RL monitor
        for table in tables:
            lines = _render(table, width)
            assert max(len(line) for line in lines) <= width, "\n".join(lines)
            assert [line[:8] for line in _body(lines)] == [row["run_id"][:8] for row in rows], "\n".join(lines)
        runs, scores, gate = (_body(_render(t, width)) for t in tables)
        # the key columns whole: short id, when, the data versions, training metrics, the gate's decision
        assert runs[0].split() == ["1abcdef0", "2023-11-16", "02:00", "11", "01234567", "89abcdef", "1.234",
                                   "-0.250", "refused"]
        assert "0.500 [0.100, 0.400]" in scores[0] and scores[0].split()[-4:] == ["0.125"] * 4
        assert "+0.012 (low -0.050)" in gate[0] and "31.0% (low 22.0%)" in gate[0] and gate[0].endswith("FLAGGED")
        assert not any("params" in line or "0.001" in line for t in tables for line in _render(t, width))


def test_a_narrow_terminal_folds_but_keeps_the_ids_whole():
    rows = [_filled_row(n) for n in range(1, 4)]
    for table in comparison.terminal_tables(rows, "demo", 70):
        lines = _render(table, 70)
        assert max(len(line) for line in lines) <= 70
        assert [line[:8] for line in _body(lines) if line[:8].strip()] == [row["run_id"][:8] for row in rows]


def test_the_gate_table_shows_only_when_a_run_has_its_numbers():
    import pandas as pd

    row = {"run_id": "abcdef0123", "started": pd.Timestamp(0, unit="ms"), "status": "RUNNING", "version": "",
           "gate": "", "data": {}, "params": {}, "curves": {}, "slices": [], "reasons": [], "metrics": {}}
    runs, _ = comparison.terminal_tables([row], "demo")
    assert _body(_render(runs, 100))[0].split() == ["abcdef01", "1970-01-01", "00:00", "running"]


def test_params_read_down_one_per_line_the_key_ones_first():
    rows = [_filled_row(n) for n in range(1, 6)]
    table = comparison.params_table(rows)
    for width in (100, 160):
        lines = _render(table, width)
        assert max(len(line) for line in lines) <= width
        assert lines[1].split() == ["param", *[row["run_id"][:8] for row in rows]]
        names = [line.split()[0] for line in _body(lines) if not line.startswith(" ")]
        assert names == ["sft.steps", "sft.lr", "gate.mode", "collect.sources",
                         "evaluate.student_price_output_per_mtok"]
        steps = next(line for line in _body(lines) if line.startswith("sft.steps "))
        assert steps.split() == ["sft.steps", "600", "1200", "1800", "2400", "3000"]
    assert [r.style for r in table.rows] == ["bold", None, None, None, None]  # the param that differs stands out
    wide = _render(table, 200)
    assert any("[{'name': 'agent', 'path': ['…" in line for line in wide), "a long value is cut, not folded"
    # the HTML report keeps its one table with the key params
    assert comparison.summary_table(rows).loc[0, "params"] == "gate.mode=non_inferior sft.lr=0.001 sft.steps=600"
