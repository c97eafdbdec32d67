"""The SFT job as a process of its own: what `accelerate launch` starts on every rank (and what a test kills).

    python -m flywheel.train.sft_launch JOB.json

The job file (flywheel/train/sft_job.py) names the base, the rows, the output folder and the SFT config. Rank 0
appends each logged step to metrics.jsonl beside the job (the launching process forwards them to MLflow) and
writes the final metrics to result.json.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from flywheel.train.sft import train_sft
from flywheel.train.sft_job import append_step, read_job, write_result


def run_job(job_path: Path) -> dict:
    """Train as the job file says, in this process (one rank of a launch, or alone)."""
    job, rows = read_job(job_path)
    result = train_sft(job["base_dir"], rows, Path(job["out_dir"]), job["cfg"],
                       on_log=lambda step, metrics: append_step(job_path, step, metrics),
                       chat_template=job["chat_template"])
    if _is_rank_zero():
        write_result(job_path, result)
    return result


def _is_rank_zero() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m flywheel.train.sft_launch JOB.json")
    run_job(Path(sys.argv[1]))
