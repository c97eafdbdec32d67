"""Stage collect: production traces in from every source (validated, redacted, split); the tasks table beside them."""

from __future__ import annotations

from collections import Counter
from functools import partial
from pathlib import Path

import pandas as pd

from flywheel.config import PipelineConfig
from flywheel.data import tasksets, tracetable, watermarks
from flywheel.data.collection import collect as collect_traces
from flywheel.data.collection import gc_paused, system_allocator, table_rows
from flywheel.data.lineage import dvc_md5, log_dataset
from flywheel.data.redaction import Redactor
from flywheel.data.schemas import Quarantine
from flywheel.data.shapes import SourceError
from flywheel.data.sources import readers, remote_fingerprint, unmatched_globs
from flywheel.data.tasksets import made_tasks, row_task, task_table
from flywheel.envs import environment_sources
from flywheel.errors import UserFacingError
from flywheel.replaycheck import collect_findings, recorded_conversations
from flywheel.stages import StageResult
from flywheel.tags import COLLECT_MODE_TAG, out_tag
from tasks.caching import by_content
from tasks.kernel import stage_context, stage_task

WARNINGS_SHOWN = 10  # records kept with something to look at, printed; the count is the `warnings` metric


class TooManyBadRecords(UserFacingError, RuntimeError):
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
        cfg, catalog, root_path, env, run = stage.cfg, stage.catalog, stage.root, stage.env, stage.run
        paths = {name: catalog.table_path(name) for name in ("traces", "quarantine", "tasks")}
        missing, _ = unmatched_globs(pipeline, cfg, root_path)  # (the warnings: `flywheel check` and `run` say them)
        if missing:
            raise SourceError("\n".join(f"{root_path / 'pipelines.yaml'}: {line}" for line in missing))
        sources = readers(cfg.collect, root_path)
        since = None if full else watermarks.load(root_path, pipeline, cfg.collect, paths)
        quarantine = table_rows(catalog.read("quarantine")) if since is not None else []
        with gc_paused(), system_allocator():
            found = collect_traces(sources, cfg.collect, Redactor(cfg.collect.redact), ([], quarantine), since,
                                   tasks_of=partial(made_tasks, env, cfg.collect.heldout_fraction))

        read, bad = sum(found.records.values()), sum(found.bad.values())
        bad_fraction = bad / max(read, 1)
        tasks_recipe = tasksets.recipe(env, cfg.environment, cfg.collect.heldout_fraction,
                                       environment_sources(cfg.environment, root_path), root_path)
        same_tasks = since is not None and watermarks.saved_tasks_recipe(root_path, pipeline) == tasks_recipe
        if read or not same_tasks:
            catalog.write("quarantine", pd.DataFrame(found.quarantine, columns=list(Quarantine.to_schema().columns)))
            if bad_fraction > cfg.collect.max_bad_fraction:
                raise TooManyBadRecords(
                    f"{bad} of {read} records read ({bad_fraction:.0%}) are malformed, over max_bad_fraction "
                    f"{cfg.collect.max_bad_fraction:.0%}; most common: {found.reasons.most_common(3)}; "
                    f"see {catalog.table_path('quarantine')}")
            build = partial(task_table, env, cfg.environment, cfg.collect.heldout_fraction)
            with gc_paused(), system_allocator():
                tables = tracetable.write(catalog, found.table, since is not None, same_tasks, build)
        else:  # nothing new: no table is read whole or written, so the bytes on disk stay as they are
            tables = tracetable.unchanged(catalog)
        if found.states != since or not same_tasks:
            watermarks.save(root_path, pipeline, cfg.collect, paths, found.states, tasks_recipe)

        outcomes, splits = tables.outcomes, Counter(tables.tasks.column("split").to_pylist())
        digest = dvc_md5(catalog.stage_dir("collect"))  # what `dvc commit` will record for this output
        log_dataset(run.run_id, tracetable.to_arrow([]).to_pandas(), f"{pipeline}-traces",
                    catalog.stage_dir("collect"), digest, num_rows=len(outcomes))
        metrics = {"records": read, "traces": len(outcomes), "traces_new": sum(tables.new.values()),
                   "quarantined": bad, "quarantine_total": len(found.quarantine),
                   "duplicates": found.duplicates + tables.duplicates,
                   "partial_turns": found.partial, "bad_fraction": bad_fraction,
                   "tasks_train": splits["train"], "tasks_heldout": splits["heldout"],
                   "tasks_from_traces": Counter(tables.tasks.column("origin").to_pylist())["trace"],
                   # feedback on a call that ended in tool calls: joined to the conversation that completes it, or
                   # kept on the call itself while nothing does (counted over this run's new rows)
                   "labels_joined": found.labels_joined, "labels_on_partial": found.labels_on_partial}
        metrics |= {f"outcome_{k}": v for k, v in Counter(outcomes.to_pylist()).items()}
        metrics |= {f"quarantine_{k}": v for k, v in found.reasons.items()}
        metrics |= {f"redacted_{k}": v for k, v in found.redacted.items()}
        # a field the source names that a record lacks: its task falls back (recorded user turns and writes)
        metrics |= {f"missing_{k}": v for k, v in found.missing.items()}
        warnings = found.warnings + _short_splits(tables.tasks, cfg, env.name)
        if hasattr(env, "agreement"):  # replay: labels its rewarded conversations contradict; a sample replayed
            # the whole table: with nothing new read, `tables` holds only the columns the metrics need
            tasks = [row_task(r) for r in catalog.read("tasks").to_dict("records")]
            contradicted, found_there = collect_findings(env, stage.harness, tasks,
                                                         recorded_conversations(root_path, pipeline) or {})
            metrics["replay_contradicted"] = contradicted
            warnings += found_there
        metrics["warnings"] = len(warnings)
        print(f"      collect: kept {len(outcomes)} traces ({metrics.get('outcome_accepted', 0)} accepted) of {read} "
              f"records read, {bad} quarantined; {splits['train']} train and {splits['heldout']} held-out tasks; "
              f"{len(warnings)} warning(s)", flush=True)
        for line in warnings[:WARNINGS_SHOWN]:
            print(f"      collect: warning: {line}", flush=True)
        if len(warnings) > WARNINGS_SHOWN:
            print(f"      collect: ... and {len(warnings) - WARNINGS_SHOWN} more warnings", flush=True)
        for label in (reader.source.label for reader in sources):
            metrics |= {f"source/{label}/records": found.records[label], f"source/{label}/traces": tables.new[label],
                        f"source/{label}/quarantined": found.bad[label]}
        stage.run.metrics(metrics)
        stage.run.tags({out_tag("collect"): digest, COLLECT_MODE_TAG: "full" if since is None else "incremental"})
        return stage.done(metrics)


def _short_splits(tasks, cfg: PipelineConfig, env_name: str) -> list[str]:
    """A warning per split that got fewer of the environment's own tasks than the config asks for; none for an
    environment with no tasks of its own (tasksets.short_splits)."""
    generated = Counter(split for split, origin in zip(tasks.column("split").to_pylist(),
                                                       tasks.column("origin").to_pylist(), strict=True)
                        if origin == "generated")
    return tasksets.short_splits(env_name, generated, cfg.environment, cfg.collect.heldout_fraction)
