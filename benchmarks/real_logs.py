"""Replay on real logs written by others: do the conversations they rewarded pass, and does less pass too?

    .venv/bin/python benchmarks/real_logs.py CONFIG LOGS... [--pipeline NAME] [--quick]

CONFIG is a pipelines.yaml (examples/real_logs/*.yaml) whose source reads `logs/<pipeline>/...`; LOGS are the
log files, or folders of them (a clone's data folder, e.g. ToolTalk's data/tooltalk). `--quick` reads the small
slice of the same set committed in tests/data/real_logs/<CONFIG's name>/ instead of LOGS (the same code on a few
records; the tests run it so). In a temporary project the
collect stage reads them through the config alone, then the check `flywheel check --solve` runs on a replay
pipeline (flywheel/replaycheck.py) scores, over every collected accepted conversation: the recorded agent said
turn by turn, the null policy, an id-only policy, the last required write dropped and one write argument changed.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("logs", type=Path, nargs="+")
    parser.add_argument("--pipeline", default=None)
    parser.add_argument("--quick", action="store_true", help="read the committed slice of the set instead of LOGS")
    args = parser.parse_args()
    logs = [REPO / "tests/data/real_logs" / args.config.stem] if args.quick else args.logs
    if missing := [str(path) for path in logs if not path.exists()]:
        parser.error(f"no such file or folder: {', '.join(missing)} (docs/real-logs.md says where each set is)")
    config = yaml.safe_load(args.config.read_text())
    name = args.pipeline or next(iter(config["pipelines"]))
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "pipelines.yaml").write_text(yaml.safe_dump(config))
        into = root / "logs" / name
        into.mkdir(parents=True)
        for path in logs:
            if path.is_dir():
                shutil.copytree(path, into, dirs_exist_ok=True)
            else:
                shutil.copy2(path, into)
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        figures = measure(root, name)
    print(json.dumps(figures))


def measure(root: Path, name: str) -> dict:
    """Collect `name` in the project at `root`, then the replay check over every collected task."""
    from flywheel.agent import load_harness
    from flywheel.config import load_pipeline
    from flywheel.dryrun import dry_run, render
    from flywheel.replaycheck import recorded_conversations
    from tasks.collect import collect

    result = collect.fn(pipeline=name, root=str(root))
    cfg = load_pipeline(name, root / "pipelines.yaml")
    report = dry_run(name, cfg, load_harness(cfg.environment, root, pipeline=name),
                     conversations=recorded_conversations(root, name))
    for line in render(report):
        print(line, file=sys.stderr)
    from flywheel.replaycheck import summary

    return {"pipeline": name, "records": result.metrics["records"], "tasks": report.checked,
            "contradicted": result.metrics.get("replay_contradicted", 0), **summary(report.replay)}


if __name__ == "__main__":
    main()
