"""DVC as its command line runs it (in the project root): commit a stage as `dvc repro` would, status, push."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from flywheel.errors import UserFacingError
from flywheel.tags import dvc_tag

LOCK_FILE = "dvc.lock"  # in the project root: every stage's deps, params and outs with their md5, as DVC keeps them
# libyaml's safe loader where PyYAML has it: a run reads dvc.lock tens of times, 7x faster than the pure-Python one
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# DVC holds one lock per repo and a second process fails after ~3 s: serialise our own calls, retry theirs.
_LOCK = threading.Lock()


class DvcError(UserFacingError, RuntimeError):
    """A DVC command failed; the message carries the command and DVC's own words."""


def is_repo(root: Path) -> bool:
    return (root / ".dvc").is_dir() and (root / "dvc.yaml").exists()


def _dvc(root: Path, *args: str, attempts: int = 4) -> str:
    # DVC resolves stage targets and run-cache paths against the working directory, so run it in the root.
    command = [sys.executable, "-m", "dvc", *args]
    with _LOCK:
        for attempt in range(attempts):
            done = subprocess.run(command, cwd=root, capture_output=True, text=True, check=False)
            if done.returncode == 0:
                return done.stdout
            if "Unable to acquire lock" not in done.stderr or attempt == attempts - 1:
                raise DvcError(f"`dvc {' '.join(args)}` in {root} failed: {done.stderr.strip() or done.stdout}")
            time.sleep(1 + attempt)
    raise AssertionError("unreachable")


def commit(root: Path, stage: str, pipeline: str) -> None:
    """Record `stage@pipeline`'s deps, params and outs in dvc.lock and the cache, exactly as `dvc repro` would."""
    _dvc(root, "commit", "--force", f"{stage}@{pipeline}")


def status(root: Path) -> dict:
    """`dvc status`: an empty dict means data and pipelines are up to date."""
    return json.loads(_dvc(root, "status", "--json") or "{}")


def push(root: Path, stage: str | None = None, pipeline: str = "") -> None:
    """Push committed outputs to the default remote: every one, or only those of `stage@pipeline`."""
    _dvc(root, "push", *([f"{stage}@{pipeline}"] if stage else []))


def checkout(root: Path, stage: str, pipeline: str) -> None:
    """Put `stage@pipeline`'s outputs as dvc.lock records them into the workspace, from the cache."""
    _dvc(root, "checkout", "--force", f"{stage}@{pipeline}")


def pull(root: Path, stage: str, pipeline: str, *more: str) -> None:
    """Fetch `stage@pipeline`'s outputs (and those of the `more` stages) as dvc.lock records them from the remote,
    then check them out over whatever the workspace holds there."""
    _dvc(root, "pull", "--force", *[f"{name}@{pipeline}" for name in (stage, *more)])


def fetch(root: Path, stage: str, pipeline: str) -> None:
    """Bring `stage@pipeline`'s recorded outputs into the cache (from the remote), without checking them out."""
    _dvc(root, "fetch", f"{stage}@{pipeline}")


def cache_dir(root: Path) -> Path:
    """The repo's DVC cache folder, absolute."""
    return Path(_dvc(root, "cache", "dir").strip())


def remotes(root: Path) -> dict[str, str]:
    """name -> URL of every remote the repo knows (all config levels); local paths come back absolute.

    From `dvc config --list`, one `remote.NAME.url=URL` a line: `dvc remote list` is a table for people, which
    wraps a long URL onto lines of its own."""
    found = {}
    for line in _dvc(root, "config", "--list").splitlines():
        key, _, value = line.partition("=")
        if key.startswith("remote.") and key.endswith(".url"):
            found[key.removeprefix("remote.").removesuffix(".url")] = value
    return found


def set_local(root: Path, *setting: str) -> None:
    """`dvc config --local KEY VALUE` or `dvc remote modify --local NAME KEY VALUE`: this checkout only."""
    if setting[0] == "remote":
        _dvc(root, "remote", "modify", "--local", *setting[1:])
    else:
        _dvc(root, "config", "--local", *setting)


def read_lock(root: Path) -> dict[str, dict]:
    """`stage@pipeline` -> its entry in the project's dvc.lock (deps, params, outs); {} when there is none."""
    path = root / LOCK_FILE
    return parse_lock(path.read_text(), str(path)) if path.exists() else {}


def parse_lock(text: str, source: str,
               fix: str = "restore it from git (`git checkout -- dvc.lock`) or run `dvc commit` again") -> dict:
    """The stages of a dvc.lock's text; a DvcError naming `source` (where the text came from) and `fix` if broken."""
    try:
        lock = yaml.load(text, Loader=SAFE_LOADER) or {}
    except yaml.YAMLError as err:
        raise DvcError(f"{source}: not valid YAML, so not a dvc.lock DVC wrote ({err}); {fix}") from None
    stages = lock.get("stages") or {} if isinstance(lock, dict) else None
    if not isinstance(stages, dict):
        raise DvcError(f"{source}: not a dvc.lock (no mapping of stages); {fix}")
    return stages


def write_lock(root: Path, stages: dict[str, dict]) -> Path:
    """Write a dvc.lock holding these stages' entries, as DVC writes one (schema 2.0, in the order given)."""
    path = root / LOCK_FILE
    path.write_text(yaml.safe_dump({"schema": "2.0", "stages": stages}, sort_keys=False))
    return path


def record(root: Path, entries: dict[str, dict]) -> None:
    """Put these `stage@pipeline` entries into the project's dvc.lock, the others kept as they are: how an entry
    committed in another folder (a stage job's) is recorded here, without its outputs. Under DVC's own repo lock,
    so that no `dvc commit` of another run writes the file meanwhile."""
    from dvc.repo import Repo

    with _LOCK, Repo(str(root)) as repo, repo.lock:
        write_lock(root, read_lock(root) | entries)


def pipeline_entries(root: Path, pipeline: str) -> dict[str, dict]:
    """The dvc.lock entries of one pipeline's stages (`collect@<pipeline>`, ...)."""
    return {key: entry for key, entry in read_lock(root).items() if key.endswith(f"@{pipeline}")}


def lock_hashes(root: Path, stage: str, pipeline: str) -> dict[str, str]:
    """path -> md5 of a stage's deps and outs as dvc.lock records them (lineage tags); empty if not locked."""
    entry = read_lock(root).get(f"{stage}@{pipeline}", {})
    return {item["path"]: item.get("md5", "") for kind in ("deps", "outs") for item in entry.get(kind, [])}


def lineage_tags(root: Path, pipeline: str, stages: list[str] | tuple[str, ...]) -> dict[str, str]:
    """`flywheel.dvc.<path>` -> md5 of every dataset and model the stages read or wrote, as dvc.lock records them."""
    hashes = {}
    for name in stages:
        hashes |= lock_hashes(root, name, pipeline)
    return {dvc_tag(path): md5 for path, md5 in sorted(hashes.items()) if md5}
