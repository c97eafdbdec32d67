"""Stage rl: improve the SFT student with asynchronous GRPO-family RL (actor processes + learner) on the train tasks."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
from prefect import task

from flywheel.config import load_pipeline
from flywheel.data.catalog import Catalog
from flywheel.data.schemas import Rollouts
from flywheel.data.tasksets import row_task
from flywheel.envs import get_environment
from flywheel.metrics import final_metrics
from flywheel.registry import stage_run
from flywheel.train.rl.loop import train_rl
from tasks.caching import by_content
from tasks.progress import progress
from tasks.spec import output_hashes


@task(name="rl", cache_key_fn=by_content("rl"), persist_result=True)
def rl(pipeline: str, root: str = ".", parent_run_id: str | None = None) -> dict:
    """RL from the SFT checkpoint: the RL checkpoint and the rollouts table."""
    root_path = Path(root).resolve()
    cfg = load_pipeline(pipeline, root_path / "pipelines.yaml")
    catalog = Catalog(root_path, pipeline)
    env = get_environment(cfg.environment.name)
    with stage_run(root_path, pipeline, "rl", parent_run_id, cfg.model_dump(include={"rl"})) as run:
        tasks = [row_task(r) for r in catalog.read("tasks").to_dict("records") if r["split"] == "train"]
        out_dir = catalog.model_dir("rl")
        if cfg.rl.steps == 0:  # RL switched off: the candidate is the SFT model itself
            shutil.rmtree(out_dir, ignore_errors=True)
            shutil.copytree(catalog.model_dir("sft"), out_dir)
            rows, summary = [], {"steps": 0}
        else:
            rows, summary = train_rl(catalog.model_dir("sft"), env, tasks, cfg.rl, out_dir,
                                     max_turns=cfg.environment.max_turns, device=cfg.student.device,
                                     on_step=progress(run, "rl", cfg.rl.steps, "reward_mean"))
        catalog.write("rollouts", pd.DataFrame(rows, columns=list(Rollouts.to_schema().columns)))
        run.metrics(final_metrics(summary))
        outputs = output_hashes("rl", pipeline, root_path)
        run.tags({f"flywheel.out.{k}": v for k, v in outputs.items()})
    return {"stage": "rl", "run_id": run.run_id, "metrics": summary, "outputs": outputs}
