"""The evaluate stage refuses to score held-out tasks that the SFT data or the RL rollouts already contain."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from flywheel.data.catalog import Catalog
from flywheel.evaluate.runner import ContaminationError


def _rollout(task_id: str) -> dict:
    return {"step": 0, "policy_version": 0, "behaviour_version": 0, "task_id": task_id, "group": 0, "sample": 0,
            "reward": 1.0, "advantage": 0.0, "tokens": 5, "passed": True, "dropped": False, "split": False}


@pytest.fixture
def collected(project):
    """The small project after collect and synthesize (the oracle teacher: seconds), with a clean rollouts log."""
    from tasks.collect import collect
    from tasks.synthesize import synthesize

    collect.fn("small", str(project))
    synthesize.fn("small", str(project))
    catalog = Catalog(project, "small")
    tasks = catalog.read("tasks")
    train = tasks[tasks["split"] == "train"]["task_id"].tolist()
    catalog.write("rollouts", pd.DataFrame([_rollout(train[0])]))
    return catalog, tasks


def test_a_held_out_task_in_the_rollouts_or_the_sft_data_stops_evaluation(project, collected):
    from tasks.evaluate import evaluate

    catalog, tasks = collected
    heldout = tasks[tasks["split"] == "heldout"].reset_index(drop=True)
    leaked = heldout["task_id"][0]
    catalog.write("rollouts", pd.DataFrame([_rollout(leaked)]))
    with pytest.raises(ContaminationError, match=f"rl rollouts: 1 held-out task\\(s\\), e.g. {leaked}"):
        evaluate.fn("small", str(project))

    # the same prompt as an accepted SFT conversation (the teacher's answer does not matter, the prompt does)
    catalog.write("rollouts", pd.DataFrame([_rollout(tasks[tasks["split"] == "train"]["task_id"].iloc[0])]))
    synthetic = catalog.read("synthetic")
    first = synthetic.index[synthetic["accepted"]][0]
    prompt = json.loads(heldout["prompt"][1])
    synthetic.loc[first, "messages"] = json.dumps(prompt + [{"role": "assistant", "content": "42"}])
    catalog.write("synthetic", synthetic)
    with pytest.raises(ContaminationError, match=f"sft data \\(synthetic\\): 1 held-out task\\(s\\), e.g. "
                                                 f"{heldout['task_id'][1]}"):
        evaluate.fn("small", str(project))
