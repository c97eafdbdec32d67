"""`flywheel loop`: retrain, serve the champion, drive the agent against it, and the next retrain collects it."""

from __future__ import annotations

import json
import re

import pytest
import yaml


@pytest.mark.slow
def test_two_rounds_serve_the_champion_and_collect_its_traffic(project, prefect_server):
    from typer.testing import CliRunner

    from flywheel.cli import app
    from flywheel.data.catalog import Catalog

    config = yaml.safe_load((project / "pipelines.yaml").read_text())
    config["pipelines"]["small"]["collect"]["sources"] = [
        {"name": "agent", "path": ["examples/traces/*.jsonl", "traces/served/small/*.jsonl"]}]
    (project / "pipelines.yaml").write_text(yaml.safe_dump(config))

    result = CliRunner().invoke(app, ["loop", "small", "--rounds", "2", "--episodes", "6", "--no-push",
                                      "--root", str(project)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    rounds = re.findall(r"round (\d): champion version (\d+); held-out mean reward ([\d.]+); "
                        r"new traces collected (\d+); served (\d+) answers to (\d+) episodes", result.output)
    assert [r[0] for r in rounds] == ["1", "2"], result.output
    assert int(rounds[0][4]) >= 6 and int(rounds[0][5]) == 6
    assert int(rounds[1][3]) > 0  # round 2's collect read what round 1 served

    traces = Catalog(project, "small").read("traces")
    served = [json.loads(m)["served"] for m in traces["metadata"] if "served" in json.loads(m)]
    assert served and {s["version"] for s in served} == {rounds[0][1]}
    assert set(traces.loc[traces["metadata"].str.contains('"served"'), "outcome"]) <= {"accepted", "rejected"}

    # without the traffic folder among the sources the loop refuses before doing anything
    config["pipelines"]["small"]["collect"]["sources"] = ["examples/traces/*.jsonl"]
    (project / "pipelines.yaml").write_text(yaml.safe_dump(config))
    refused = CliRunner().invoke(app, ["loop", "small", "--root", str(project)])
    assert refused.exit_code == 2 and "traces/served/small/*.jsonl" in refused.output
