"""Stage collect: production traces in, validated and split; the environment's tasks beside them."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pandas as pd
from prefect import task

from flywheel.config import load_pipeline
from flywheel.data.catalog import Catalog, content_hash, expand
from flywheel.data.tasksets import build_tasks
from flywheel.data.traces import collect_files
from flywheel.envs import get_environment
from flywheel.registry import stage_run
from tasks.caching import by_content


class TooManyBadRecords(RuntimeError):
    """More than max_bad_fraction of the records were quarantined."""


@task(name="collect", cache_key_fn=by_content("collect"), persist_result=True)
def collect(pipeline: str, root: str = ".", parent_run_id: str | None = None) -> dict:
    """Read the trace sources into the traces table (bad records quarantined) and build the tasks table."""
    root_path = Path(root).resolve()
    cfg = load_pipeline(pipeline, root_path / "pipelines.yaml")
    catalog = Catalog(root_path, pipeline)
    env = get_environment(cfg.environment.name)
    with stage_run(root_path, pipeline, "collect", parent_run_id, cfg.model_dump(include={"collect"})) as run:
        files = expand(root_path, cfg.collect.sources)
        if not files:
            raise FileNotFoundError(f"pipelines.{pipeline}.collect.sources: no file matches "
                                    f"{cfg.collect.sources} under {root_path}")
        found = collect_files(files, root_path, cfg.collect.heldout_fraction)
        total = len(found.traces) + len(found.quarantine) + found.duplicates
        reasons = Counter(q["kind"] for q in found.quarantine)
        bad_fraction = len(found.quarantine) / max(total, 1)
        catalog.write("quarantine", pd.DataFrame(found.quarantine, columns=["source", "location", "kind", "reason", "raw"]))
        if bad_fraction > cfg.collect.max_bad_fraction:
            raise TooManyBadRecords(
                f"{len(found.quarantine)} of {total} records ({bad_fraction:.0%}) are malformed, over "
                f"max_bad_fraction {cfg.collect.max_bad_fraction:.0%}; most common: {reasons.most_common(3)}; "
                f"see {catalog.table_path('quarantine')}")
        catalog.write("traces", pd.DataFrame(found.traces))
        tasks = build_tasks(env, cfg.environment, cfg.collect.heldout_fraction, found.traces)
        catalog.write("tasks", pd.DataFrame(tasks))

        traces = pd.DataFrame(found.traces)
        metrics = {"records": total, "traces": len(found.traces), "quarantined": len(found.quarantine),
                   "duplicates": found.duplicates, "bad_fraction": bad_fraction,
                   "tasks_train": sum(t["split"] == "train" for t in tasks),
                   "tasks_heldout": sum(t["split"] == "heldout" for t in tasks),
                   "tasks_from_traces": sum(t["origin"] == "trace" for t in tasks)}
        metrics |= {f"outcome_{k}": int(v) for k, v in traces["outcome"].value_counts().items()}
        metrics |= {f"quarantine_{k}": v for k, v in reasons.items()}
        run.metrics(metrics)
        outputs = {"collect": content_hash([catalog.stage_dir("collect")], root_path)}
        run.tags({f"flywheel.out.{k}": v for k, v in outputs.items()})
    return {"stage": "collect", "run_id": run.run_id, "metrics": metrics, "outputs": outputs}
