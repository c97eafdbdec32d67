"""The trigger sensor counts only records past collect's watermarks and starts one retrain at a time."""

from __future__ import annotations

from pathlib import Path

from conftest import SMALL_PIPELINE

LINE = ('{"messages": [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"}], '
        '"outcome": "accepted"}\n')


def _new(root: Path) -> int:
    from flywheel.config import load_pipeline
    from flywheel.data.arrivals import count_new, saved_watermarks

    cfg = load_pipeline("small", root / "pipelines.yaml")
    return sum(count_new(cfg.collect, root, saved_watermarks(root, "small")).values())


def test_count_new_reads_past_the_watermarks(project, s3_bucket):
    from flywheel.config import CollectConfig
    from flywheel.data.arrivals import count_new
    from tasks.collect import collect

    examples = sorted((project / "examples/traces").glob("*.jsonl"))
    lines = sum(1 for path in examples for line in path.read_text().splitlines() if line.strip())
    assert _new(project) == lines, "before the first collect every record is new"

    collect.fn(pipeline="small", root=str(project))
    assert _new(project) == 0

    with examples[0].open("a") as handle:
        handle.write(LINE * 3 + LINE.rstrip("\n"))  # the last line is still being written: not counted yet
    (project / "examples/traces/new.jsonl").write_text(LINE * 2)
    assert _new(project) == 5

    s3, bucket = s3_bucket
    s3.put_object(Bucket=bucket, Key="logs/a.jsonl", Body=(LINE * 4).encode())
    s3.put_object(Bucket=bucket, Key="logs/b.jsonl", Body=(LINE * 2).encode())
    cfg = CollectConfig(sources=[f"s3://{bucket}/logs/"])
    label = cfg.sources[0].label
    assert count_new(cfg, project, {}) == {label: 6}
    etag = s3.head_object(Bucket=bucket, Key="logs/a.jsonl")["ETag"].strip('"')
    assert count_new(cfg, project, {label: {"objects": {"logs/a.jsonl": etag}}}) == {label: 2}


def test_sensor_starts_one_retrain_until_it_is_done(project, prefect_server):
    from prefect.client.orchestration import get_client
    from prefect.states import Completed

    from flows.deployments import plan, reconcile, runner_deployments
    from flows.sensor import watch_traces
    from flywheel.config import load_pipelines

    (project / "pipelines.yaml").write_text(SMALL_PIPELINE + "    trigger: {min_new_traces: 100}\n")
    wanted = plan(load_pipelines(project / "pipelines.yaml"), project)
    for deployment in runner_deployments(wanted):
        deployment.apply()  # served deployments: runs wait as Scheduled, which is all the sensor looks at
    reconcile(wanted, pool=None, root=project)

    first = watch_traces(pipeline="small", root=str(project))
    assert first["new"] >= 100 and first["started"]
    second = watch_traces(pipeline="small", root=str(project))
    assert second["started"] is None and second["waiting_on"] == first["started"], "one retrain at a time"

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(first["started"])
        assert "flywheel.trigger" in run.tags and run.parameters == {"pipeline": "small", "root": str(project)}
        client.set_flow_run_state(first["started"], Completed(), force=True)
    third = watch_traces(pipeline="small", root=str(project))
    assert third["started"] not in (None, first["started"]), "the records are still new: start another"

    (project / "pipelines.yaml").write_text(SMALL_PIPELINE + "    trigger: {min_new_traces: 100000}\n")
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(third["started"], Completed(), force=True)
    assert watch_traces(pipeline="small", root=str(project))["started"] is None
