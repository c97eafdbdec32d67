"""What each stage reads, which config sections and code it depends on, what it writes: cache keys and checks."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import flywheel
from flywheel.config import PipelineConfig, load_pipeline
from flywheel.data.catalog import content_hash
from flywheel.data.sources import local_files
from flywheel.stages import ORDER as STAGE_ORDER

PACKAGE_ROOT = Path(flywheel.__file__).resolve().parent.parent


@dataclass(frozen=True)
class StageSpec:
    name: str
    deps: tuple[str, ...]  # paths under the project root; "{p}" is the pipeline
    config: tuple[str, ...]  # sections of the pipeline's config
    code: tuple[str, ...]  # source paths under the package root
    outs: tuple[str, ...]

    def dep_paths(self, root: Path, pipeline: str, cfg: PipelineConfig) -> list[Path]:
        paths = [root / d.format(p=pipeline) for d in self.deps]
        if self.name == "collect":
            paths += local_files(cfg.collect, root)  # remote sources: see tasks/collect.py cache_key
        if self.name == "sft" and cfg.student.chat_template:
            paths.append(root / cfg.student.chat_template)  # its text, not only its name, is an input
        return paths

    def out_paths(self, root: Path, pipeline: str) -> list[Path]:
        return [root / o.format(p=pipeline) for o in self.outs]


_EPISODES = ("flywheel/agent.py", "flywheel/envs", "flywheel/policies")
STAGES: dict[str, StageSpec] = {s.name: s for s in [
    StageSpec("collect", (), ("environment", "collect"),
              ("tasks/collect.py", "flywheel/data", "flywheel/envs"), ("data/{p}/collect",)),
    StageSpec("synthesize", ("data/{p}/collect",), ("environment", "teacher", "synthesize"),
              ("tasks/synthesize.py", "tasks/progress.py", "flywheel/synthesis.py", "flywheel/data", *_EPISODES),
              ("data/{p}/synthesize",)),
    StageSpec("sft", ("data/{p}/synthesize",), ("student", "sft"),
              ("tasks/sft.py", "tasks/progress.py", "flywheel/data", "flywheel/train"),
              ("models/{p}/base", "models/{p}/sft")),
    StageSpec("rl", ("data/{p}/collect", "models/{p}/sft"), ("environment", "rl"),
              ("tasks/rl.py", "tasks/progress.py", "flywheel/data", "flywheel/train", *_EPISODES),
              ("models/{p}/rl", "data/{p}/rl")),
    StageSpec("evaluate", ("data/{p}/collect", "data/{p}/synthesize", "data/{p}/rl", "models/{p}/base",
                           "models/{p}/sft", "models/{p}/rl"), ("environment", "evaluate", "gate"),
              ("tasks/evaluate.py", "tasks/reports.py", "flywheel/data", "flywheel/evaluate", "flywheel/train",
               *_EPISODES), ("data/{p}/evaluate",)),
    StageSpec("register", ("models/{p}/rl", "data/{p}/evaluate"), ("gate",),
              ("tasks/register.py", "flywheel/registry.py", "flywheel/promotion.py", "flywheel/evaluate"),
              ("data/{p}/register",)),
]}
if tuple(STAGES) != STAGE_ORDER:
    raise RuntimeError(f"tasks/spec.py STAGES {list(STAGES)} and flywheel/stages.py ORDER {list(STAGE_ORDER)} "
                       "differ: a stage is one entry in each, in the same order")
ORDER = list(STAGES)


def code_hash(spec: StageSpec) -> str:
    return content_hash([PACKAGE_ROOT / c for c in spec.code], PACKAGE_ROOT)


def input_key(stage: str, pipeline: str, root: Path, cfg: PipelineConfig | None = None) -> str:
    """The content of a stage's inputs, config sections and code: equal keys mean equal work."""
    spec = STAGES[stage]
    cfg = cfg or load_pipeline(pipeline, root / "pipelines.yaml")
    parts = [stage, pipeline, content_hash(spec.dep_paths(root, pipeline, cfg), root),
             cfg.section_hash(*spec.config), code_hash(spec)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def output_hashes(stage: str, pipeline: str, root: Path) -> dict[str, str]:
    """Content hash of each of a stage's outputs, by its path under the root: what a cache hit must find."""
    return {out.format(p=pipeline): content_hash([root / out.format(p=pipeline)], root) for out in STAGES[stage].outs}


def dvc_yaml() -> str:
    """dvc.yaml as these specs imply it (`python -m tasks.spec > dvc.yaml`); tests/test_spec.py compares."""
    lines = [
        "# One DVC stage per pipeline stage and per pipeline in pipelines.yaml (`collect@demo`, `sft@demo`, ...).",
        "# Prefect runs the same stage functions (`flywheel run`); after each it commits the outputs here as",
        "# `dvc repro` would, so `dvc status` is clean after a run and `dvc repro` reruns only what changed.",
        "# Generated from tasks/spec.py (the Prefect cache keys): `python -m tasks.spec > dvc.yaml`.",
        "# collect also reads the files its `sources` match; DVC deps cannot be globs, so the folder is named.",
        "vars:", "  - pipelines.yaml", "", "stages:"]
    for spec in STAGES.values():
        lines += [f"  {spec.name}:", "    foreach: ${pipelines}", "    do:",
                  f"      cmd: flywheel stage {spec.name} --pipeline ${{key}}", "      deps:"]
        extra = ["examples/traces"] if spec.name == "collect" else []
        lines += [f"        - {d}" for d in extra + [d.replace("{p}", "${key}") for d in spec.deps] + list(spec.code)]
        if spec.config:
            lines += ["      params:", "        - pipelines.yaml:"]
            lines += [f"            - pipelines.${{key}}.{section}" for section in spec.config]
        lines.append("      outs:")
        for out in spec.outs:
            # the registration record is tiny and names MLflow state: tracked in dvc.lock, not cached
            lines += [f"        - {out.replace('{p}', '${key}')}" + (":\n            cache: false"
                                                                   if spec.name == "register" else "")]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(dvc_yaml(), end="")
