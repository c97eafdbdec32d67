"""Stage collect: production traces in from every source (validated, redacted, split); the tasks table beside them."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from flywheel.config import PipelineConfig
from flywheel.data import watermarks
from flywheel.data.lineage import dvc_md5, log_dataset
from flywheel.data.redaction import Redactor
from flywheel.data.schemas import Quarantine, Traces
from flywheel.data.shapes import SourceError
from flywheel.data.sources import FileReader, readers, remote_fingerprint
from flywheel.data.tasksets import build_tasks
from flywheel.data.traces import collect as collect_traces
from flywheel.data.traces import table_rows
from flywheel.stages import StageResult
from tasks.caching import by_content
from tasks.kernel import stage_context, stage_task


class TooManyBadRecords(RuntimeError):
    """More than max_bad_fraction of the records read were quarantined."""


def _remote(pipeline: str, root: Path, cfg: PipelineConfig) -> str:
    return remote_fingerprint(cfg.collect, root)


_by_content = by_content("collect", extra=_remote)


def cache_key(context, parameters: dict) -> str | None:
    """Local files by content, S3 by its listing's ETags, MLflow by its trace ids and states; `full`: no cache."""
    if parameters.get("full"):
        return None
    try:
        return _by_content(context, parameters)
    except SourceError:
        return None  # unreachable now: run, and let the stage say what is wrong


@stage_task(cache_key_fn=cache_key)
def collect(pipeline: str, root: str = ".", parent_run_id: str | None = None, full: bool = False) -> StageResult:
    """Read what is new in the trace sources into the traces table (bad records quarantined); build the tasks."""
    with stage_context("collect", pipeline, root, parent_run_id, params=("collect",)) as stage:
        cfg, catalog, root_path = stage.cfg, stage.catalog, stage.root
        tables = {name: catalog.table_path(name) for name in ("traces", "quarantine")}
        sources = readers(cfg.collect, root_path)
        for reader in sources:
            if isinstance(reader, FileReader) and not reader.files():
                raise FileNotFoundError(f"pipelines.{pipeline}.collect.sources: '{reader.source.label}' matches no "
                                        f"file ({reader.source.path} under {root_path})")
        since = None if full else watermarks.load(root_path, pipeline, cfg.collect, tables)
        previous = (table_rows(catalog.read("traces")), table_rows(catalog.read("quarantine"))) \
            if since is not None else ([], [])
        found = collect_traces(sources, cfg.collect, Redactor(cfg.collect.redact), previous, since)

        read, bad = sum(found.records.values()), sum(found.bad.values())
        bad_fraction = bad / max(read, 1)
        catalog.write("quarantine", pd.DataFrame(found.quarantine, columns=list(Quarantine.to_schema().columns)))
        if bad_fraction > cfg.collect.max_bad_fraction:
            raise TooManyBadRecords(
                f"{bad} of {read} records read ({bad_fraction:.0%}) are malformed, over max_bad_fraction "
                f"{cfg.collect.max_bad_fraction:.0%}; most common: {found.reasons.most_common(3)}; "
                f"see {catalog.table_path('quarantine')}")
        traces = pd.DataFrame(found.traces, columns=list(Traces.to_schema().columns))
        catalog.write("traces", traces)
        tasks = build_tasks(stage.env, cfg.environment, cfg.collect.heldout_fraction, found.traces)
        catalog.write("tasks", pd.DataFrame(tasks))
        watermarks.save(root_path, pipeline, cfg.collect, tables, found.states)

        digest = dvc_md5(catalog.stage_dir("collect"))  # what `dvc commit` will record for this output
        log_dataset(stage.run.run_id, traces, f"{pipeline}-traces", catalog.stage_dir("collect"), digest)
        metrics = {"records": read, "traces": len(found.traces), "traces_new": sum(found.new.values()),
                   "quarantined": bad, "quarantine_total": len(found.quarantine), "duplicates": found.duplicates,
                   "partial_turns": found.partial, "bad_fraction": bad_fraction,
                   "tasks_train": sum(t["split"] == "train" for t in tasks),
                   "tasks_heldout": sum(t["split"] == "heldout" for t in tasks),
                   "tasks_from_traces": sum(t["origin"] == "trace" for t in tasks)}
        metrics |= {f"outcome_{k}": int(v) for k, v in traces["outcome"].value_counts().items()}
        metrics |= {f"quarantine_{k}": v for k, v in found.reasons.items()}
        metrics |= {f"redacted_{k}": v for k, v in found.redacted.items()}
        for label in (reader.source.label for reader in sources):
            metrics |= {f"source/{label}/records": found.records[label], f"source/{label}/traces": found.new[label],
                        f"source/{label}/quarantined": found.bad[label]}
        stage.run.metrics(metrics)
        stage.run.tags({"flywheel.out.collect": digest,
                        "flywheel.collect.mode": "full" if since is None else "incremental"})
        return stage.done(metrics)
