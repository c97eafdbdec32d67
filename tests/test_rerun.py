"""`flywheel rerun <run-id>`: a recorded run again from its config and DVC data; clear errors when it cannot be."""

from __future__ import annotations

import hashlib
import json

import pytest
import yaml
from conftest import SMALL_PIPELINE


def _new_traces(root) -> None:
    # traces the recorded run never saw: a rerun that collected again would get other tables
    source = (root / "examples/traces/support-agent-2026-11-01.jsonl").read_text().splitlines()[:5]
    records = [json.loads(line) for line in source]
    for n, record in enumerate(records):
        record["id"] = f"tr_new_{n}"
        record["messages"][0]["content"] += " Thanks!"
    (root / "examples/traces/support-agent-2026-12-01.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records))


def _files(root) -> dict:
    files = [p for folder in ("data", "models") for p in (root / folder).rglob("*") if p.is_file()]
    return {str(p.relative_to(root)): p.read_bytes() for p in files} | \
        {name: (root / name).read_bytes() for name in ("pipelines.yaml", "dvc.lock")}


@pytest.mark.slow
def test_a_rerun_reproduces_the_recorded_datasets_byte_for_byte(project, prefect_server):
    from mlflow import MlflowClient
    from typer.testing import CliRunner

    from flows.retrain import retrain
    from flywheel import registry
    from flywheel.cli import app
    from flywheel.data.catalog import Catalog
    from flywheel.status import pipeline_status

    first = retrain(pipeline="small", root=str(project))
    recorded = first.run_id
    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    heldout = len(Catalog(project, "small").read("heldout"))
    # today's project is not the recorded one: new traces at the source, another config
    _new_traces(project)
    config = yaml.safe_load((project / "pipelines.yaml").read_text())
    config["pipelines"]["small"]["sft"]["lr"] = 2.0e-3
    (project / "pipelines.yaml").write_text(yaml.safe_dump(config))
    before = _files(project)

    done = CliRunner().invoke(app, ["rerun", recorded, "--root", str(project)])
    assert done.exit_code == 0, done.output

    client = MlflowClient()
    experiment = client.get_experiment_by_name("small").experiment_id
    rerun = client.search_runs([experiment], f"tags.`flywheel.rerun_of` = '{recorded}'")[0]
    assert rerun.data.tags["stage.collect"] == "restored" and rerun.data.tags["flywheel.rerun.datasets"] == "identical"
    report = json.loads(registry.recorded_text(rerun.info.run_id, "flywheel/rerun.json"))
    outputs = {o["path"]: o for o in report["outputs"]}
    assert outputs["data/small/collect"]["verdict"] == "restored"
    # every dataset and every model the recorded run wrote, byte for byte (the eval table aside: latency)
    recorded_outs = {o["path"] for entry in lock.values() for o in entry.get("outs", [])
                     if not o["path"].startswith("data/small/register")}
    assert recorded_outs == {f"data/small/{s}" for s in ("collect", "synthesize", "rl", "evaluate")} | \
        {f"models/small/{m}" for m in ("base", "sft", "rl")}
    assert set(outputs) == recorded_outs
    for path in sorted(recorded_outs - {"data/small/evaluate"}):
        assert outputs[path]["reproduced"] == outputs[path]["recorded"] == lock_md5(lock, path), path
        assert outputs[path]["verdict"] in ("identical", "restored"), outputs[path]
    assert report["datasets_identical"] and report["reproduced"]
    assert outputs["data/small/evaluate"]["verdict"] in ("identical", "measured")  # eval holds measured latency
    assert {s["model"] for s in report["scores"]} == {"base", "sft", "rl"}
    assert all(s["within_noise"] and s["low"] <= 0 <= s["high"] and s["how"] == f"paired on {heldout} tasks"
               for s in report["scores"]), report["scores"]
    assert "identical" in done.output and "within noise" in done.output

    assert _files(project) == before, "the rerun ran in its own workspace: the project is as it was"
    workspace = project / ".flywheel/reruns" / recorded
    assert yaml.safe_load((workspace / "pipelines.yaml").read_text())["pipelines"]["small"]["sft"]["lr"] == 3.0e-3
    assert registry.get_alias("small", "champion").version == first.champion, "a rerun does not promote"

    # status from the same store: the rerun first, the champion from the recorded run, its data versions
    state = pipeline_status("small")
    assert [r.run_id for r in state.runs] == [rerun.info.run_id, recorded]
    assert state.runs[0].rerun_of == recorded and state.runs[1].stages["sft"] == "ran"
    champion = next(a for a in state.aliases if a.alias == "champion")
    assert champion.pipeline_run == recorded and champion.score == round(first.scores["score_rl"], 4)
    versions = state.data_versions().set_index("path")
    assert versions.loc["data/small/collect", f"champion v{champion.version}"] == lock_md5(lock, "data/small/collect")
    shown = CliRunner().invoke(app, ["status", "small", "--root", str(project)])
    assert shown.exit_code == 0, shown.output
    assert recorded[:8] in shown.output and "not deployed" in shown.output  # ids cut to 8 in 120 columns


def lock_md5(lock: dict, path: str) -> str:
    return next(o["md5"] for entry in lock.values() for o in entry.get("outs", []) if o["path"] == path)


def _retrain_record(project, lock: dict | None, config: bool = True) -> str:
    """A finished retrain run as the flow records it, without running the stages."""
    from flywheel import registry
    from flywheel.data import dvc

    run = registry.start_run(project, "small", "retrain")
    if config:
        registry.record_config(run, "small", yaml.safe_load(SMALL_PIPELINE)["pipelines"]["small"])
    if lock is not None:
        (project / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": lock}))
        registry.record_lock(run, dvc.read_lock(project), "small")
        (project / "dvc.lock").unlink()
    run.end(ok=True)
    return run.run_id


def test_runs_that_cannot_be_rerun_are_refused_clearly(project):
    from flows.rerun import rerun
    from flywheel import registry
    from flywheel.reproduce import RerunError

    with pytest.raises(RerunError, match="no retrain run.* with an id starting 'f00d'"):
        rerun("f00d", root=str(project))
    stage = registry.start_run(project, "small", "sft")
    with pytest.raises(RerunError, match="is a 'sft' run, not a retrain run"):
        rerun(stage.run_id, root=str(project))
    older = _retrain_record(project, lock=None, config=False)
    with pytest.raises(RerunError, match="recorded by an older version: no config snapshot"):
        rerun(older, root=str(project))
    with pytest.raises(RerunError, match=f"run {older} was recorded by an older version"):
        rerun(older[:8], root=str(project))  # the first characters, as `flywheel compare` prints an id
    failed = registry.start_run(project, "small", "retrain")
    failed.end(ok=False)
    with pytest.raises(RerunError, match="did not finish"):
        rerun(failed.run_id, root=str(project))
    with pytest.raises(RerunError, match="first stages in order"):
        rerun(older, root=str(project), restore=("synthesize",))

    # data in neither the DVC cache nor the remote: the error names the path and md5 and says to push
    missing = "0123456789abcdef0123456789abcdef.dir"
    lock = {"collect@small": {"cmd": "flywheel stage collect --pipeline small",
                              "outs": [{"path": "data/small/collect", "hash": "md5", "md5": missing,
                                        "size": 10, "nfiles": 3}]}}
    with pytest.raises(RerunError) as err:
        rerun(_retrain_record(project, lock), root=str(project))
    assert missing in str(err.value) and "data/small/collect" in str(err.value) and "dvc push" in str(err.value)
    assert not (project / "data").exists(), "nothing was written into the project"


def _folder(cache, md5: str, files: dict[str, str]) -> dict:
    """A folder version in a DVC cache: its listing under md5 (what `dvc commit` writes), and its lock entry."""
    listing = cache / "files" / "md5" / md5[:2] / md5[2:]
    listing.parent.mkdir(parents=True, exist_ok=True)
    listing.write_text(json.dumps([{"md5": m, "relpath": name} for name, m in sorted(files.items())]))
    return {"hash": "md5", "md5": md5}


def test_verdicts_name_what_differs_and_scores_are_paired(tmp_path):
    import pandas as pd

    from flywheel.reproduce import Recorded, RerunReport, compare_outputs, compare_scores

    cache, ws = tmp_path / "cache", tmp_path / "ws"
    ws.mkdir()

    def lock(synthetic: str, eval_table: str, heldout: str) -> dict:
        # a folder's md5 stands for its files' md5s, as in DVC
        synthesize = {"synthetic.parquet": synthetic}
        evaluate = {"eval.parquet": eval_table, "heldout.parquet": heldout, "gate.json": "g"}
        return {f"{stage}@p": {"outs": [{"path": f"data/p/{stage}", **_folder(
                    cache, hashlib.md5(json.dumps(files).encode()).hexdigest() + ".dir", files)}]}
                for stage, files in (("synthesize", synthesize), ("evaluate", evaluate))}

    recorded = Recorded("r", "p", "", lock("s1", "e1", "h1"), "c", "False", "passed", {"score_rl": 0.5})
    (ws / "dvc.lock").write_text(yaml.safe_dump({"stages": lock("s2", "e2", "h1")}))
    checks = {c.path: c for c in compare_outputs(recorded, ws, cache, ["synthesize", "evaluate"], [])}
    assert checks["data/p/synthesize"].verdict == "differs" and "synthetic.parquet" in checks["data/p/synthesize"].note
    assert checks["data/p/evaluate"].verdict == "measured", "only the eval table (latency) differs"
    report = RerunReport("r", "n", "p", ws, list(checks.values()), [])
    assert not report.datasets_identical and not report.reproduced

    (ws / "dvc.lock").write_text(yaml.safe_dump({"stages": lock("s1", "e2", "h2")}))
    checks = {c.path: c for c in compare_outputs(recorded, ws, cache, ["synthesize", "evaluate"], [])}
    assert checks["data/p/synthesize"].verdict == "identical"
    assert checks["data/p/evaluate"].verdict == "differs" and "heldout.parquet" in checks["data/p/evaluate"].note

    # a model counts as much as a dataset: identical data and one model that differs is no reproduction
    recorded.lock["sft@p"] = {"outs": [{"path": "models/p/sft", **_folder(cache, "a" * 32 + ".dir",
                                                                          {"model.safetensors": "m1"})}]}
    (ws / "dvc.lock").write_text(yaml.safe_dump({"stages": {
        **lock("s1", "e1", "h1"), "sft@p": {"outs": [{"path": "models/p/sft", **_folder(
            cache, "b" * 32 + ".dir", {"model.safetensors": "m2"})}]}}}))
    checks = compare_outputs(recorded, ws, cache, ["synthesize", "sft", "evaluate"], [])
    assert {c.path: c.verdict for c in checks} == {"data/p/synthesize": "identical", "models/p/sft": "differs",
                                                  "data/p/evaluate": "identical"}
    assert "model.safetensors" in checks[1].note
    assert not RerunReport("r", "n", "p", ws, checks, []).datasets_identical
    assert not RerunReport("r", "n", "p", ws, [], []).datasets_identical, "nothing compared is no verdict"

    # scores: the same rewards are within noise; a model that now fails a third of the tasks is not
    tasks = [f"t{i}" for i in range(60)]
    before = pd.DataFrame({"model": "rl", "task_id": tasks, "sample": 0, "reward": 1.0})
    same = compare_scores(recorded, before, before.copy(), 0.95, 500, 0)
    worse = compare_scores(recorded, before, before.assign(reward=[0.0 if i % 3 == 0 else 1.0 for i in range(60)]),
                           0.95, 500, 0)
    assert same[0].within_noise and same[0].low == same[0].high == 0.0
    assert not worse[0].within_noise and worse[0].high < 0
    unpaired = compare_scores(recorded, None, before.assign(reward=0.5), 0.95, 500, 0)
    assert unpaired[0].within_noise and "not in DVC" in unpaired[0].how


def test_a_reruns_workspace_shares_remotes_however_long_their_urls(tmp_path):
    """`dvc remote list` wraps a long URL onto its own line (as it did under a deeper pytest tmp folder): the
    remotes are read from `dvc config --list` instead, whole, relative paths made absolute."""
    import subprocess
    import sys

    from flywheel.data import dvc

    root = tmp_path / "repo"
    root.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    long = tmp_path / ("a-remote-whose-path-is-longer-than-a-terminal-line-" * 3) / "dvc"
    for args in (["init", "-q"], ["remote", "add", "-d", "near", "../near"], ["remote", "add", "long", str(long)],
                 ["remote", "add", "s3", "s3://bucket/dvc"], ["remote", "add", "--local", "mine", "/srv/dvc"]):
        subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, check=True, capture_output=True)
    assert dvc.remotes(root) == {"near": str(tmp_path / "near"), "long": str(long), "s3": "s3://bucket/dvc",
                                 "mine": "/srv/dvc"}
