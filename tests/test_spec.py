"""dvc.yaml and the Prefect cache keys (tasks/spec.py) describe the same stages, deps, params and outs."""

from __future__ import annotations

from pathlib import Path

import yaml

from tasks.spec import ORDER, STAGES, dvc_yaml

REPO = Path(__file__).resolve().parent.parent


def test_dvc_yaml_is_generated_from_the_stage_specs():
    assert (REPO / "dvc.yaml").read_text() == dvc_yaml(), "run `python -m tasks.spec > dvc.yaml`"
    stages = yaml.safe_load(dvc_yaml())["stages"]
    assert list(stages) == ORDER
    for name, spec in STAGES.items():
        params = stages[name]["do"].get("params", [{}])[0].get("pipelines.yaml", [])
        assert params == [f"pipelines.${{key}}.{section}" for section in spec.config], name


def test_every_code_dependency_exists():
    for spec in STAGES.values():
        for path in spec.code:
            assert (REPO / path).exists(), f"{spec.name}: {path}"
