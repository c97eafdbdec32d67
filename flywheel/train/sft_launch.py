"""The SFT job as a process of its own: what `accelerate launch` starts on every rank (and what a test kills).

    python -m flywheel.train.sft_launch JOB.json

The job file names the base, the rows (JSON lines), the output folder and the SFT config. Rank 0 appends each
logged step to metrics.jsonl beside the job (the launching process forwards them to MLflow) and writes the final
metrics to result.json.
"""

from __future__ import annotations

import json
import sys
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


def run_job(job_path: Path) -> dict:
    """Train as the job file says, in this process (one rank of a launch, or alone)."""
    from flywheel.train.sft import train_sft

    job_path = Path(job_path)
    job = json.loads(job_path.read_text())
    rows = [json.loads(line) for line in (job_path.parent / "rows.jsonl").read_text().splitlines()]
    log = job_path.parent / JOB_LOG

    def append(step: int, metrics: dict) -> None:
        with log.open("a") as f:  # whole lines only: the reader forwards complete lines
            f.write(json.dumps({"step": step, "metrics": metrics}) + "\n")

    result = train_sft(job["base_dir"], rows, Path(job["out_dir"]), SFTConfig(**job["cfg"]), on_log=append,
                       chat_template=job["chat_template"])
    if _is_rank_zero():
        (job_path.parent / JOB_RESULT).write_text(json.dumps(result))
    return result


def _is_rank_zero() -> bool:
    import os

    return int(os.environ.get("RANK", "0")) == 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m flywheel.train.sft_launch JOB.json")
    run_job(Path(sys.argv[1]))
