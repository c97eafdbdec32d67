"""Running a recorded retrain run again: what it recorded, a workspace of its own, its data from DVC, the verdict.

A rerun works from the run id alone plus the DVC cache or remote. The run recorded its validated config
(`flywheel/pipelines.yaml`) and its stages of dvc.lock (`flywheel/dvc.lock`, the md5 of every dataset and
model). The rerun copies today's code into `.flywheel/reruns/<run-id>/`, writes the recorded config and lock
there, shares the project's DVC cache and remotes, and checks out the outputs of the stages whose inputs lie
outside the project (collect reads files, S3 and MLflow traces, which may have changed since) instead of
running them. The stages after run with the recorded config; every output's md5 is then compared with the
recorded one, and the held-out scores with the recorded ones by a paired bootstrap on the same tasks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from mlflow.exceptions import MlflowException

from flywheel import registry
from flywheel.config import ConfigError, load_pipeline
from flywheel.data import dvc
from flywheel.data.lineage import dvc_md5
from flywheel.errors import UserFacingError
from flywheel.evaluate.stats import paired_bootstrap
from flywheel.settings import state_dir
from flywheel.tags import GATE_TAG, GIT_COMMIT_TAG, GIT_DIRTY_TAG, PARENT_RUN_TAG, PIPELINE_TAG, STAGE_TAG

SCORED = ("base", "sft", "rl")  # the models a retrain run itself produces; a champion row is another model
MEASURED = "evaluate"  # its eval table holds measured latency: compared by scores, not bytes
MEASURED_FILES = {"eval.parquet", "gate.json"}  # the files of that stage that may differ (latency, its limit)
# never copied into a rerun's workspace: generated, or the state the rerun shares with the project
_NOT_COPIED_TOP = {".git", ".venv", ".flywheel", "data", "models", "mlruns", "mlartifacts"}
_NOT_COPIED = {"__pycache__", ".pytest_cache", ".ruff_cache"}


class RerunError(UserFacingError, RuntimeError):
    """The run cannot be reproduced as asked; the message says why and what to do."""


@dataclass(frozen=True)
class Recorded:
    """What a finished retrain run recorded: its pipeline, config snapshot, dvc.lock snapshot, commit, scores."""

    run_id: str
    pipeline: str
    config_text: str
    lock: dict  # "stage@pipeline" -> dvc.lock entry
    commit: str
    dirty: str  # "True", "False" or "" (not recorded)
    gate: str
    scores: dict[str, float]

    def outs(self, stage: str) -> dict[str, str]:
        """path -> md5 of a stage's outputs as the run recorded them."""
        entry = self.lock.get(f"{stage}@{self.pipeline}", {})
        return {o["path"]: o.get("md5", "") for o in entry.get("outs", [])}


def _retrain_run_starting(prefix: str):
    """The one retrain run whose id starts with `prefix`, in any experiment; a RerunError for none or several."""
    c = registry.client()
    experiments = [e.experiment_id for e in c.search_experiments()]
    found = [r for r in c.search_runs(experiments, f"tags.`{STAGE_TAG}` = 'retrain'")
             if r.info.run_id.startswith(prefix)] if experiments and prefix else []
    if len(found) != 1:
        raise RerunError(f"{'no' if not found else len(found)} retrain run(s) in "
                         f"{os.environ.get('MLFLOW_TRACKING_URI')} with an id starting '{prefix}'; "
                         "`flywheel compare PIPELINE` lists them")
    return found[0]


def recorded_run(run_id: str) -> Recorded:
    """Read what the run recorded; a clear error for an unknown id, another kind of run, or an older record."""
    c = registry.client()
    try:
        run = c.get_run(run_id)
    except MlflowException:
        run = _retrain_run_starting(run_id)  # the first characters of an id, as `flywheel compare` prints it
        run_id = run.info.run_id
    tags = run.data.tags
    pipeline, stage = tags.get(PIPELINE_TAG), tags.get(STAGE_TAG)
    if stage != "retrain" or not pipeline:
        parent = tags.get(PARENT_RUN_TAG)
        hint = f"; its pipeline run is {parent}" if parent else ""
        raise RerunError(f"run {run_id} is {'a ' + repr(stage) if stage else 'not a flywheel'} run, not a retrain "
                         f"run: pass the id of a `retrain` run{hint}")
    if run.info.status != "FINISHED":
        raise RerunError(f"run {run_id} did not finish ({run.info.status}): only a finished run recorded the data "
                         "of every stage")
    config_text = registry.recorded_text(run_id, registry.RECORD_CONFIG)
    lock_text = registry.recorded_text(run_id, registry.RECORD_LOCK)
    if config_text is None:
        raise RerunError(f"run {run_id} was recorded by an older version: no config snapshot "
                         f"({registry.RECORD_CONFIG}); to run it again, check out its commit "
                         f"{tags.get(GIT_COMMIT_TAG, 'unknown')} and its dvc.lock, then `dvc repro`")
    if lock_text is None:
        raise RerunError(f"run {run_id} recorded no dvc.lock ({registry.RECORD_LOCK}): it ran outside a DVC "
                         "project, so its data versions are unknown")
    lock = dvc.parse_lock(lock_text, f"the dvc.lock recorded on run {run_id} ({registry.RECORD_LOCK})",
                          "the record is damaged: rerun another retrain run")
    scores = {k: v for k, v in run.data.metrics.items() if k.startswith("score_")}
    return Recorded(run_id, pipeline, config_text, lock, tags.get(GIT_COMMIT_TAG, "unknown"),
                    tags.get(GIT_DIRTY_TAG, ""), tags.get(GATE_TAG, ""), scores)


def warnings(recorded: Recorded, root: Path) -> list[str]:
    """What makes this rerun run other code than the recorded run did."""
    found = []
    head = registry.git_commit(root)
    if recorded.commit != head:
        found.append(f"the run was recorded at commit {recorded.commit[:12]}, this checkout is at {head[:12]}: "
                     "today's code runs (the code deps below say what changed)")
    if recorded.dirty == "True":
        found.append("the recorded run's checkout had uncommitted changes: its exact code is not known")
    elif not recorded.dirty:
        found.append("the run did not record whether its checkout had uncommitted changes")
    if registry.git_dirty(root):
        found.append("this checkout has uncommitted changes: they run too")
    return found


@dataclass(frozen=True)
class Workspace:
    """Where a rerun runs, and the DVC cache and remotes it shares with the project."""

    path: Path
    cache: Path
    remotes: dict[str, str]


def workspace(root: Path, run_id: str) -> Path:
    """The folder a rerun of `run_id` runs in: generated state under the project's .flywheel/."""
    return state_dir(root) / "reruns" / run_id


def prepare_workspace(root: Path, recorded: Recorded, order: Sequence[str]) -> Workspace:
    """A fresh copy of today's code with the recorded config and dvc.lock, sharing the project's DVC cache."""
    root = root.resolve()
    if not dvc.is_repo(root):
        raise RerunError(f"{root} is not a DVC project (.dvc/ and dvc.yaml): a rerun takes its data from DVC")
    ws = workspace(root, recorded.run_id)
    if ws.exists():
        shutil.rmtree(ws)  # an earlier rerun of the same run: generated, and what it found is in MLflow
    for relative in _project_files(root):
        target = ws / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / relative, target)
    (ws / "pipelines.yaml").write_text(recorded.config_text)
    try:
        load_pipeline(recorded.pipeline, ws / "pipelines.yaml")
    except ConfigError as err:
        raise RerunError(f"the config recorded on run {recorded.run_id} does not validate with today's code "
                         f"(check out its commit {recorded.commit[:12]} to rerun it):\n{err}") from None
    dvc.write_lock(ws, {k: recorded.lock[k] for k in _ordered(recorded.lock, order)})
    local = ws / ".dvc" / "config.local"
    if (root / ".dvc" / "config.local").exists():
        shutil.copy2(root / ".dvc" / "config.local", local)
    # no git inside the workspace (it lies in the project's ignored .flywheel/); one cache for both checkouts
    cache, remotes = dvc.cache_dir(root), dvc.remotes(root)
    dvc.set_local(ws, "core.no_scm", "true")
    dvc.set_local(ws, "cache.dir", str(cache))
    for name, url in remotes.items():
        if "://" not in url:  # a local folder: DVC resolves relative paths against the config, so pin it
            dvc.set_local(ws, "remote", name, "url", url)
    _share_teacher_cache(root, ws, recorded)
    return Workspace(ws, cache, remotes)


def _project_files(root: Path) -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, text=True, check=False)
    if listed.returncode == 0:
        names = [n for n in listed.stdout.split("\0") if n]
    else:  # not a git checkout: everything but what is generated
        names = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]
    return sorted(n for n in names if (root / n).is_file() and Path(n).parts[0] not in _NOT_COPIED_TOP
                  and not _NOT_COPIED & set(Path(n).parts) and n not in ("pipelines.yaml", "dvc.lock"))


def _share_teacher_cache(root: Path, ws: Path, recorded: Recorded) -> None:
    # The teacher's response cache replays the recorded answers: a paid endpoint is not asked again.
    cache = load_pipeline(recorded.pipeline, ws / "pipelines.yaml").teacher.cache
    if cache and not Path(cache).is_absolute() and (root / cache).exists():
        (ws / cache).parent.mkdir(parents=True, exist_ok=True)
        (ws / cache).symlink_to(root / cache)


def _ordered(lock: dict, order: Sequence[str]) -> list[str]:
    return sorted(lock, key=lambda k: order.index(k.split("@")[0]) if k.split("@")[0] in order else len(order))


def restore(ws: Workspace, recorded: Recorded, stage: str) -> None:
    """Check out a stage's recorded outputs from the cache, or pull them from the remote; verify their md5."""
    outs = recorded.outs(stage)
    if not outs:
        raise RerunError(f"run {recorded.run_id} recorded no outputs of stage '{stage}' in its dvc.lock")
    try:
        dvc.checkout(ws.path, stage, recorded.pipeline)
    except dvc.DvcError:
        try:
            dvc.pull(ws.path, stage, recorded.pipeline)
        except dvc.DvcError as err:
            missing = ", ".join(f"{path} (md5 {md5})" for path, md5 in outs.items())
            raise RerunError(
                f"the data of stage '{stage}' recorded on run {recorded.run_id} is in neither the DVC cache "
                f"({ws.cache}) nor the remote ({', '.join(ws.remotes.values()) or 'none'}): "
                f"{missing}. Run `dvc push` in the checkout where the run ran (commit {recorded.commit[:12]}), "
                f"then rerun.\nDVC said: {err}") from None
    for path, md5 in outs.items():
        found = dvc_md5(ws.path / path)
        if found != md5:
            raise RerunError(f"{path}: checked out md5 {found}, but the run recorded {md5}")


def fetch_recorded(ws: Workspace, recorded: Recorded, stage: str) -> bool:
    """Bring a stage's recorded outputs into the cache for comparison; False when they are nowhere."""
    try:
        dvc.fetch(ws.path, stage, recorded.pipeline)
        return True
    except dvc.DvcError:
        return False


# ---- the verdict --------------------------------------------------------------------------------------------

@dataclass
class OutputCheck:
    """One output of one stage: its recorded and reproduced md5 and what differs."""

    stage: str
    path: str
    recorded: str
    reproduced: str
    verdict: str  # identical, restored, measured (only measured latency differs), differs
    note: str = ""


@dataclass
class ScoreCheck:
    """One model's held-out score, recorded and reproduced, and the paired interval of the difference."""

    model: str
    recorded: float | None
    reproduced: float
    low: float | None
    high: float | None
    within_noise: bool
    how: str


@dataclass
class RerunReport:
    """What a rerun reproduced: every output, every score, the gate, and what ran differently."""

    run_id: str
    rerun_id: str
    pipeline: str
    workspace: Path
    outputs: list[OutputCheck]
    scores: list[ScoreCheck]
    code_changes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    gate_recorded: str = ""
    gate_reproduced: str = ""
    version: str = ""  # the registered version of the reproduced model (the recorded one if byte-identical)
    champion: str | None = None  # after the rerun

    @property
    def datasets_identical(self) -> bool:
        """Every dataset and every model (data/ and models/, the measured eval table aside) has the recorded md5."""
        return bool(self.outputs) and all(o.verdict != "differs" for o in self.outputs)

    @property
    def scores_within_noise(self) -> bool:
        """Every model's paired difference to its recorded score has an interval holding 0."""
        return all(s.within_noise for s in self.scores)

    @property
    def reproduced(self) -> bool:
        """The issue's bar: identical datasets and scores within noise."""
        return self.datasets_identical and self.scores_within_noise

    def to_json(self) -> str:
        """The report as the rerun's MLflow artifact `flywheel/rerun.json` keeps it."""
        payload = {k: v for k, v in self.__dict__.items() if k not in ("outputs", "scores", "workspace")}
        payload |= {"workspace": str(self.workspace), "outputs": [o.__dict__ for o in self.outputs],
                    "scores": [s.__dict__ for s in self.scores], "datasets_identical": self.datasets_identical,
                    "scores_within_noise": self.scores_within_noise, "reproduced": self.reproduced}
        return json.dumps(payload, indent=2)


def compare_outputs(recorded: Recorded, ws: Path, cache: Path, order: Sequence[str],
                    restored: list[str]) -> list[OutputCheck]:
    """Each recorded output of each stage against the workspace's dvc.lock after the rerun, file by file."""
    lock = dvc.read_lock(ws)
    checks = []
    for key in _ordered(recorded.lock, order):
        stage = key.split("@")[0]
        if stage == "register":  # the registration record names MLflow state (versions, aliases), not data
            continue
        now = {o["path"]: o.get("md5", "") for o in lock.get(key, {}).get("outs", [])}
        for path, md5 in recorded.outs(stage).items():
            found = now.get(path, "")
            if found == md5:
                verdict, note = ("restored", "checked out from DVC") if stage in restored else ("identical", "")
            else:
                files = _differing_files(cache, md5, found)
                verdict, note = "differs", f"differ: {', '.join(files)}" if files else ""
                if stage == MEASURED and set(files or MEASURED_FILES) <= MEASURED_FILES:
                    verdict = "measured"
                    note = (note + "; " if note else "") + "the eval table holds measured latency: see the scores"
            checks.append(OutputCheck(stage, path, md5, found, verdict, note))
    return checks


def code_changes(recorded: Recorded, ws: Path) -> list[str]:
    """Code and files the stages depend on whose md5 differs from the recorded run's."""
    lock = dvc.read_lock(ws)
    changes = set()
    for key, entry in recorded.lock.items():
        now = {d["path"]: d.get("md5", "") for d in lock.get(key, {}).get("deps", [])}
        for dep in entry.get("deps", []):
            path = dep["path"]
            if not path.startswith(("data/", "models/")) and path in now and now[path] != dep.get("md5", ""):
                changes.add(path)
    return sorted(changes)


def _manifest(cache: Path, md5: str) -> dict[str, str] | None:
    path = cache / "files" / "md5" / md5[:2] / md5[2:]
    if not md5.endswith(".dir") or not path.exists():
        return None
    return {entry["relpath"]: entry["md5"] for entry in json.loads(path.read_text())}


def _differing_files(cache: Path, recorded: str, reproduced: str) -> list[str]:
    """The files of two versions of a folder whose md5 differ; empty when either listing is not in the cache."""
    before, after = _manifest(cache, recorded), _manifest(cache, reproduced)
    if before is None or after is None:
        return []
    return sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))


def recorded_eval(recorded: Recorded, cache: Path) -> pd.DataFrame | None:
    """The recorded run's eval table, from the DVC cache by its md5; None when it is not there."""
    for md5 in recorded.outs(MEASURED).values():
        files = _manifest(cache, md5) or {}
        if "eval.parquet" in files:
            table = cache / "files" / "md5" / files["eval.parquet"][:2] / files["eval.parquet"][2:]
            if table.exists():
                return pd.read_parquet(table)
    return None


def compare_scores(recorded: Recorded, before: pd.DataFrame | None, after: pd.DataFrame,
                   confidence: float, samples: int, seed: int) -> list[ScoreCheck]:
    """Greedy held-out score per model: the paired bootstrap interval of (reproduced - recorded) on the same
    tasks must contain 0; without the recorded table, the recorded score must lie in the reproduced interval."""
    from flywheel.evaluate.stats import bootstrap_mean

    checks = []
    alpha = 1 - confidence
    for model in SCORED:
        now = after[(after["model"] == model) & (after["sample"] == 0)]
        if now.empty:
            continue
        score = float(now["reward"].mean())
        was = recorded.scores.get(f"score_{model}")
        if before is not None and not before[(before["model"] == model) & (before["sample"] == 0)].empty:
            old = before[(before["model"] == model) & (before["sample"] == 0)]
            paired = now.merge(old, on="task_id", suffixes=("", "_recorded"))
            interval = paired_bootstrap(paired["reward"], paired["reward_recorded"], n=samples, alpha=alpha,
                                        seed=seed)
            inside = len(paired) == len(now) == len(old) and interval.low <= 0 <= interval.high
            checks.append(ScoreCheck(model, was if was is not None else float(old["reward"].mean()), score,
                                     interval.low, interval.high, inside, f"paired on {len(paired)} tasks"))
        else:
            # the interval of the reproduced mean, shifted by the recorded score: it holds 0 iff it holds that score
            interval = bootstrap_mean(now["reward"], n=samples, alpha=alpha, seed=seed)
            low, high = (interval.low - was, interval.high - was) if was is not None else (None, None)
            checks.append(ScoreCheck(model, was, score, low, high, was is not None and low <= 0 <= high,
                                     "recorded eval table not in DVC: the reproduced score's interval"))
    return checks
