"""MLflow: a parent run per pipeline run, a nested run per stage, model versions, aliases and lineage tags."""

from __future__ import annotations

import gc
import logging
import math
import os
import subprocess
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml
from mlflow import MlflowClient
from mlflow.entities import RunStatus
from mlflow.exceptions import MlflowException

from flywheel.settings import state_dir
from flywheel.tags import GIT_COMMIT_TAG, MODEL_HASH_TAG, PARENT_RUN_TAG, PIPELINE_TAG, STAGE_TAG

log = logging.getLogger(__name__)


def client() -> MlflowClient:
    return MlflowClient(tracking_uri=os.environ.get("MLFLOW_TRACKING_URI"))


def experiment_id(root: Path, pipeline: str) -> str:
    """The experiment named after the pipeline; artifacts under .flywheel/ unless a server decides."""
    c = client()
    found = c.get_experiment_by_name(pipeline)
    if found:
        return found.experiment_id
    location = None
    if os.environ.get("MLFLOW_TRACKING_URI", "").startswith("sqlite:"):
        location = (state_dir(root) / "mlartifacts").as_uri()
    try:
        return c.create_experiment(pipeline, artifact_location=location)
    except MlflowException:  # created by a concurrent run in the meantime
        return c.get_experiment_by_name(pipeline).experiment_id


def git_commit(root: Path) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def git_dirty(root: Path) -> bool | None:
    """Whether tracked code has uncommitted changes; None outside git. pipelines.yaml and dvc.lock do not count:
    a retrain run records both itself."""
    # the whole repository, even from a rerun's workspace inside its ignored .flywheel/
    command = ["git", "status", "--porcelain", "--untracked-files=no", "--", ":(top,exclude,glob)**/pipelines.yaml",
               ":(top,exclude,glob)**/dvc.lock"]
    try:
        out = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


@dataclass
class Run:
    """One MLflow run used through an explicit client, so concurrent stages never share global state."""

    run_id: str

    def params(self, values: dict) -> None:
        flat = _flatten(values)
        c = client()
        for key, value in flat.items():
            c.log_param(self.run_id, key, str(value)[:6000])

    def metrics(self, values: dict, step: int | None = None) -> None:
        c = client()
        stamp = int(time.time() * 1000)
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
                continue
            c.log_metric(self.run_id, key, float(value), timestamp=stamp, step=step or 0)

    def tags(self, values: dict) -> None:
        c = client()
        for key, value in values.items():
            c.set_tag(self.run_id, key, str(value))

    def artifact(self, path: Path, folder: str | None = None) -> None:
        if path.is_dir():
            client().log_artifacts(self.run_id, str(path), folder)
        else:
            client().log_artifact(self.run_id, str(path), folder)

    def text(self, text: str, artifact_file: str) -> None:
        client().log_text(self.run_id, text, artifact_file)

    def image(self, png: bytes, artifact_file: str) -> None:
        """A PNG (flywheel/plots.py) as the run's artifact `artifact_file` (a path under the run's artifacts)."""
        with tempfile.TemporaryDirectory(prefix="flywheel-png-") as tmp:
            path = Path(tmp) / Path(artifact_file).name
            path.write_bytes(png)
            self.artifact(path, str(Path(artifact_file).parent) if "/" in artifact_file else None)

    def history(self, metric: str) -> list[tuple[int, float]]:
        """A metric's values over steps, (step, value) in step order."""
        return sorted((m.step, m.value) for m in client().get_metric_history(self.run_id, metric))

    def artifact_uri(self, folder: str) -> str:
        return client().get_run(self.run_id).info.artifact_uri.rstrip("/") + "/" + folder

    def end(self, ok: bool = True, stopped: bool = False) -> None:
        """FINISHED; FAILED after an error; KILLED when the process was stopped (SIGTERM, Ctrl-C)."""
        status = RunStatus.KILLED if stopped else RunStatus.FINISHED if ok else RunStatus.FAILED
        client().set_terminated(self.run_id, RunStatus.to_string(status))


def start_run(root: Path, pipeline: str, name: str, parent: str | None = None, tags: dict | None = None) -> Run:
    """A new run in the pipeline's experiment, nested under `parent` when given."""
    all_tags = {PIPELINE_TAG: pipeline, STAGE_TAG: name, GIT_COMMIT_TAG: git_commit(root)}
    if parent:
        all_tags[PARENT_RUN_TAG] = parent
    all_tags.update({k: str(v) for k, v in (tags or {}).items()})
    info = client().create_run(experiment_id(root, pipeline), run_name=name, tags=all_tags).info
    return Run(info.run_id)


@contextmanager
def stage_run(root: Path, pipeline: str, stage: str, parent: str | None, params: dict,
              tags: dict | None = None) -> Iterator[Run]:
    """A nested run for one stage: params logged up front, marked FAILED if the stage raises an error, KILLED if a
    signal stops it."""
    run = start_run(root, pipeline, stage, parent, tags)
    run.params(params)
    try:
        yield run
    except BaseException as err:
        if not isinstance(err, Exception):  # a signal: it may have landed inside an MLflow call, whose database
            # connection (a statement half read, a write begun) the traceback keeps alive, and SQLite keeps its lock
            # until it is freed: the KILLED mark below would wait 20 s and fail "database is locked"
            traceback.clear_frames(err.__traceback__)
            gc.collect()
        run.end(ok=False, stopped=not isinstance(err, Exception))
        raise
    run.end(ok=True)


# ---- what a retrain run records so that `flywheel rerun <run-id>` can run it again -----------------------------

RECORD_CONFIG = "flywheel/pipelines.yaml"  # the pipeline's validated config, as a one-pipeline pipelines.yaml
RECORD_LOCK = "flywheel/dvc.lock"  # the pipeline's stages of dvc.lock when the run ended: every data version


def record_config(run: Run, pipeline: str, config: dict) -> None:
    """Keep the config the run used (defaults filled in), so a rerun does not depend on today's pipelines.yaml."""
    run.text(yaml.safe_dump({"pipelines": {pipeline: config}}, sort_keys=False), RECORD_CONFIG)


def record_lock(run: Run, stages: dict, pipeline: str) -> None:
    """Keep the pipeline's dvc.lock entries (md5 of every dataset, model, param and code dep) with the run.

    `stages` is dvc.lock as flywheel.data.dvc.read_lock reads it: the data layer sits above this module."""
    mine = {name: entry for name, entry in stages.items() if name.endswith(f"@{pipeline}")}
    run.text(yaml.safe_dump({"schema": "2.0", "stages": mine}, sort_keys=False), RECORD_LOCK)


def recorded_text(run_id: str, artifact_file: str) -> str | None:
    """A text artifact of the run, or None when the run has none by that name."""
    import mlflow.artifacts

    with tempfile.TemporaryDirectory(prefix="flywheel-record-") as tmp:
        try:
            local = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=artifact_file, dst_path=tmp,
                                                        tracking_uri=os.environ.get("MLFLOW_TRACKING_URI"))
        except (MlflowException, OSError):
            return None
        return Path(local).read_text()


def _flatten(values: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# ---- the registry -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Version:
    name: str
    version: str
    model_hash: str
    source: str
    aliases: tuple[str, ...]


def _version(mv) -> Version:
    return Version(mv.name, str(mv.version), mv.tags.get(MODEL_HASH_TAG, ""), mv.source,
                   tuple(mv.aliases or ()))


def get_alias(name: str, alias: str) -> Version | None:
    """The version behind an alias, or None when the model or the alias does not exist yet."""
    try:
        return _version(client().get_model_version_by_alias(name, alias))
    except MlflowException:
        return None


def get_version(name: str, version: str) -> Version:
    """One version of a registered model, with its aliases now."""
    return _version(client().get_model_version(name, str(version)))


# The artifact key, and the folder under a registered model's artifacts/, of the Hugging Face checkpoint
CHECKPOINT = "checkpoint"


def download(version: Version, dst: Path) -> Path:
    """Fetch a version's checkpoint folder into dst (the caller's to remove: a checkpoint is hundreds of MB); loads
    with from_pretrained like any other.

    A version is an MLflow model (the checkpoint under its artifacts/) or, registered before the models were
    MLflow models, the checkpoint folder itself: both give the folder.
    """
    import mlflow.artifacts

    gone = FileNotFoundError(
        f"model '{version.name}' version {version.version}: no files at {version.source}. MLflow keeps the "
        "absolute artifact location a version was registered with: if the project (or its .flywheel/) was moved "
        "or deleted since, move it back, or register the model again")
    try:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=version.source, dst_path=str(dst)))
    except MlflowException as err:
        raise gone from err
    if not any(local.iterdir()) if local.is_dir() else not local.exists():
        # a logged model's dead location: MLflow says so only in a log line, and the checkpoint loader would call
        # the empty folder "not a model checkpoint", naming a temporary path
        raise gone
    return checkpoint_in(local)


def checkpoint_in(folder: Path) -> Path:
    """The Hugging Face checkpoint inside a downloaded version: under artifacts/ for an MLflow model."""
    mlmodel = folder / "MLmodel"
    if not mlmodel.exists():
        return folder
    flavor = (yaml.safe_load(mlmodel.read_text()).get("flavors") or {}).get("python_function") or {}
    path = ((flavor.get("artifacts") or {}).get(CHECKPOINT) or {}).get("path")
    if not path or not (folder / path).is_dir():
        raise FileNotFoundError(f"{mlmodel}: names no '{CHECKPOINT}' artifact folder; not a flywheel student model")
    return folder / path


def pip_requirements() -> list[str]:
    """What loading the model needs, pinned to what is installed (MLflow's own inference would look for
    torchvision here); the flywheel package itself must be importable where it loads."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    wanted = ["mlflow", "torch", "transformers", "tokenizers", "safetensors", "jinja2", "jsonschema", "pandas",
              "pandera", "peft"]
    pins = []
    for package in wanted:
        try:
            pins.append(f"{package}=={installed(package).split('+')[0]}")  # torch's +cpu is a local build
        except PackageNotFoundError:
            continue
    return pins


def log_student(run: Run, model_dir: Path, name: str, python_model, example: dict | None, tags: dict) -> str:
    """Log the checkpoint as a pyfunc model in the run (the model's own signature, input example); its model id."""
    import mlflow

    inside = f"artifacts/{model_dir.name}"  # where MLflow puts the artifact folder
    metadata = {PIPELINE_TAG: name, "checkpoint": inside,  # the model's metadata names its pipeline as runs do
                # the template the student was trained with travels in its tokenizer files
                "chat_template": f"{inside}/chat_template.jinja" if (model_dir / "chat_template.jinja").exists()
                else f"{inside}/tokenizer_config.json"}
    with warnings.catch_warnings(), mlflow.start_run(run_id=run.run_id):  # thread-local: no other stage's run
        warnings.simplefilter("ignore")  # MLflow's notes on pickled models and on the unused params schema
        # the model's signature, not one inferred from the example: that would type each tool's JSON Schema
        info = mlflow.pyfunc.log_model(name="model", python_model=python_model, signature=python_model.signature,
                                       artifacts={CHECKPOINT: str(model_dir)}, input_example=example,
                                       pip_requirements=pip_requirements(), metadata=metadata,
                                       model_config={"model_name": name},
                                       tags={k: str(v)[:5000] for k, v in tags.items()})
    return info.model_id


# MLflow's SQL stores keep a version's description in a column of 5000 characters (PostgreSQL enforces it)
DESCRIPTION_CHARS = 5000


def describe(name: str, version: str, markdown: str) -> None:
    """Set a version's description (markdown, shown at the top of its page in MLflow's UI)."""
    if len(markdown) > DESCRIPTION_CHARS:
        note = "\n\n(cut at MLflow's 5000 characters: the whole summary is the register run's artifact)"
        markdown = markdown[:DESCRIPTION_CHARS - len(note)].rsplit("\n", 1)[0] + note
    client().update_model_version(name, str(version), description=markdown)


def _holding(c, name: str, model_hash: str) -> list:
    """The versions of `name` tagged with model_hash, oldest (lowest number) first."""
    found = c.search_model_versions(f"name = '{name}' and tags.`{MODEL_HASH_TAG}` = '{model_hash}'")
    return sorted(found, key=lambda mv: int(mv.version))


def _settle(c, name: str, model_hash: str, mine):
    """One version per model hash, even when two registrations of one model raced past the check (two workers,
    a schedule firing during a manual run): the lowest-numbered holder wins, and a later one removes itself.

    The later of two creations always sees the earlier one (it searches after its own creation, which came after
    the other's), so exactly one survives without a lock shared between machines."""
    holders = _holding(c, name, model_hash)
    winner = holders[0] if holders else mine
    if str(winner.version) != str(mine.version):
        log.warning("model %s: version %s duplicated version %s's model %s (a concurrent registration); "
                    "it is deleted", name, mine.version, winner.version, model_hash)
        c.delete_model_version(name, str(mine.version))
    return winner


def register(run: Run, name: str, model_dir: Path, model_hash: str, tags: dict,
             aliases: list[str], eval_table: Path | None = None, python_model=None,
             example: dict | None = None) -> Version:
    """Register the checkpoint as a new version, or return the one already holding this model_hash (idempotent).

    With `python_model` (flywheel.serving.mlflow_model.StudentChatModel: how a student answers is serving's) the
    version is an MLflow pyfunc chat model over the checkpoint, `example` (a chat request with messages and tools)
    its input example, which MLflow answers once while logging; without one it is the checkpoint folder alone, as
    versions were before (tests' stand-in folders that cannot answer).
    """
    if "champion" in aliases:  # it moves under the promotion lock, compare-and-set, never as a side effect
        raise ValueError("register() does not set 'champion': use flywheel.promotion.promote")
    c = client()
    try:
        c.create_registered_model(name, description=f"Student models of the '{name}' pipeline")
    except MlflowException:
        pass  # it exists
    existing = _holding(c, name, model_hash)
    if existing:
        mv = existing[0]
    else:
        version_tags = {MODEL_HASH_TAG: model_hash, **{k: str(v) for k, v in tags.items()}}
        if python_model is not None:
            model_id = log_student(run, model_dir, name, python_model, example, tags)
            source = {"source": f"models:/{model_id}", "model_id": model_id}
        else:
            run.artifact(model_dir, "model")
            source = {"source": run.artifact_uri("model")}
        if eval_table is not None:  # kept with the version so a later promotion can gate it again
            run.artifact(eval_table, "eval")
        mv = c.create_model_version(name, run_id=run.run_id, tags=version_tags, **source)
        mv = _settle(c, name, model_hash, mv)
    for alias in aliases:
        set_alias(c, name, alias, str(mv.version))
    return _version(c.get_model_version(name, str(mv.version)))


def set_alias(c, name: str, alias: str, version: str, attempts: int = 3) -> None:
    """Point `alias` at `version`. MLflow's SQL stores look for the alias, then insert it: two registrations at
    once that both set a new alias (two racers of one model, both `challenger`) can both find none, and the later
    insert fails on the alias's unique key (SQLite: UNIQUE constraint failed; PostgreSQL: duplicate key). The alias
    exists by then, so setting it again updates it."""
    for attempt in range(attempts):
        try:
            c.set_registered_model_alias(name, alias, version)
            return
        except MlflowException as err:
            text = str(err).lower()
            if attempt == attempts - 1 or not ("unique constraint" in text or "duplicate key" in text):
                raise
