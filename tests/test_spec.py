"""dvc.yaml and the Prefect cache keys (tasks/spec.py) describe the same stages, deps, params and outs."""

from __future__ import annotations

from pathlib import Path

import yaml

from tasks.spec import ORDER, STAGES

REPO = Path(__file__).resolve().parent.parent


def test_dvc_yaml_matches_the_stage_specs():
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    assert list(stages) == ORDER
    for name, spec in STAGES.items():
        body = stages[name]["do"]
        assert body["cmd"] == f"flywheel stage {name} --pipeline ${{key}}"
        deps = [d.replace("{p}", "${key}") for d in spec.deps] + list(spec.code)
        assert [d for d in body["deps"] if d != "examples/traces"] == deps, name
        params = body.get("params", [{}])[0].get("pipelines.yaml", [])
        assert params == [f"pipelines.${{key}}.{section}" for section in spec.config], name
        outs = [o if isinstance(o, str) else next(iter(o)) for o in body["outs"]]
        assert outs == [o.replace("{p}", "${key}") for o in spec.outs], name


def test_every_code_dependency_exists():
    for spec in STAGES.values():
        for path in spec.code:
            assert (REPO / path).exists(), f"{spec.name}: {path}"
