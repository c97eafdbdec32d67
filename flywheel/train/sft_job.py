"""The SFT job's files: what the launching process writes for `accelerate launch` and what rank 0 writes back.

A job folder holds job.json (base, output folder, SFT config, chat template), rows.jsonl (the conversations),
metrics.jsonl (one line per logged step, appended by rank 0; the launcher forwards them to MLflow) and
result.json (the final metrics). flywheel/train/sft.py writes and reads them around a launch,
flywheel/train/sft_launch.py on every rank.
"""

from __future__ import annotations

import json
from pathlib import Path

from flywheel.config import SFTConfig

JOB_LOG, JOB_RESULT = "metrics.jsonl", "result.json"


def write_job(folder: Path, base_dir: Path | str, rows: list[dict], out_dir: Path, cfg: SFTConfig,
              chat_template: str | Path | None = None) -> Path:
    """Write the job file and its rows under `folder` (emptied first); return the job file's path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in (JOB_LOG, JOB_RESULT):
        (folder / stale).unlink(missing_ok=True)
    with (folder / "rows.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps({"messages": row["messages"], "tools": row.get("tools")}, ensure_ascii=False) + "\n")
    job = {"base_dir": str(base_dir), "out_dir": str(Path(out_dir).resolve()), "cfg": cfg.model_dump(mode="json"),
           "chat_template": str(chat_template) if chat_template else None}
    (folder / "job.json").write_text(json.dumps(job, indent=1))
    return folder / "job.json"


def read_job(job_path: Path) -> tuple[dict, list[dict]]:
    """The job file's settings (`cfg` as an SFTConfig) and its rows."""
    job_path = Path(job_path)
    job = json.loads(job_path.read_text())
    rows = [json.loads(line) for line in (job_path.parent / "rows.jsonl").read_text().splitlines()]
    return job | {"cfg": SFTConfig(**job["cfg"])}, rows


def append_step(job_path: Path, step: int, metrics: dict) -> None:
    """Append one logged step to the job's metrics.jsonl."""
    with (Path(job_path).parent / JOB_LOG).open("a") as f:  # whole lines only: the reader forwards complete lines
        f.write(json.dumps({"step": step, "metrics": metrics}) + "\n")


def write_result(job_path: Path, result: dict) -> None:
    """Write the job's final metrics to result.json."""
    (Path(job_path).parent / JOB_RESULT).write_text(json.dumps(result))
