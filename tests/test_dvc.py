"""Reading dvc.lock: one reader for the flow, register, the run record and reruns."""

from __future__ import annotations

import pytest
import yaml

from flywheel.data import dvc


def test_the_lock_is_read_written_and_absent_as_empty(tmp_path):
    assert dvc.read_lock(tmp_path) == {}
    stages = {"sft@p": {"cmd": "flywheel stage sft --pipeline p",
                        "outs": [{"path": "models/p/sft", "md5": "abc.dir"}], "deps": []}}
    dvc.write_lock(tmp_path, stages)
    assert yaml.safe_load((tmp_path / "dvc.lock").read_text()) == {"schema": "2.0", "stages": stages}
    assert dvc.read_lock(tmp_path) == stages
    assert dvc.lock_hashes(tmp_path, "sft", "p") == {"models/p/sft": "abc.dir"}
    assert dvc.lock_hashes(tmp_path, "rl", "p") == {}
    (tmp_path / "dvc.lock").write_text("schema: '2.0'\nstages:\n")  # no stages locked yet
    assert dvc.read_lock(tmp_path) == {}


def test_a_broken_lock_is_named(tmp_path):
    (tmp_path / "dvc.lock").write_text("stages: [unclosed\n")
    with pytest.raises(dvc.DvcError, match=r"dvc\.lock: not valid YAML"):
        dvc.read_lock(tmp_path)
    (tmp_path / "dvc.lock").write_text("- a list\n")
    with pytest.raises(dvc.DvcError, match=r"dvc\.lock: not a dvc\.lock"):
        dvc.read_lock(tmp_path)
