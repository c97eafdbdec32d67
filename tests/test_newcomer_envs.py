"""The two environments a newcomer wrote from the README alone (examples/newcomer/, issue 46): `flywheel check
--solve --root` on each project as it is laid out, the scripted solver passing every task and an empty answer
earning nothing.

`pipelines.yaml` states only `environment:`, what issue 46 asks a new environment's pipeline to need: every other
section takes its default (the student `auto`'s, SmolLM2-135M-Instruct for any environment but the calculator).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

NEWCOMER = Path(__file__).resolve().parents[1] / "examples" / "newcomer"
DOMAINS = {"rooms": 120, "library": 107}  # tasks in each (train + held-out)


def _check(tmp_path: Path, domain: str) -> subprocess.CompletedProcess:
    # a copy: the check must not write under the repository; a subprocess: both projects name their package
    # `envs`, which one interpreter would import once
    root = tmp_path / domain
    shutil.copytree(NEWCOMER / domain, root, ignore=shutil.ignore_patterns("data", "models", ".flywheel"))
    # --no-estimate: the time estimate would probe SmolLM2 (the default student), tested in tests/test_estimate.py
    return subprocess.run([str(Path(sys.executable).parent / "flywheel"), "check", domain, "--solve", "--no-estimate",
                           "--root", str(root)], cwd=tmp_path, capture_output=True, text=True, timeout=120)


def _assert_solved(done: subprocess.CompletedProcess, domain: str) -> None:
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    n = DOMAINS[domain]
    assert f"{n} of its own tasks" in out, out
    assert f"solver: passes {n} of {n} tasks (100%), mean reward 1.000" in out, out
    null = re.search(r"null policy \(an empty answer, no calls\): mean reward ([0-9.]+), passes (\d+) of", out)
    assert null, out
    assert float(null.group(1)) <= 0.05 and null.group(2) == "0", out
    assert "refused, 0 malformed or unknown, 0 broke, 0 timed out" in out, out


@pytest.mark.parametrize("domain", sorted(DOMAINS))
def test_newcomer_env_with_only_environment_stated(tmp_path, domain):
    _assert_solved(_check(tmp_path, domain), domain)
