"""What each stage reads, which config sections and code it depends on, what it writes: cache keys and checks."""

from __future__ import annotations

import ast
import hashlib
import json
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path

import flywheel
from flywheel.checkpoints import CheckpointError, file_md5, gguf_file, is_gguf
from flywheel.config import PipelineConfig, load_pipeline, load_pipelines, read_pipelines_file
from flywheel.data.catalog import content_hash
from flywheel.data.sources import local_files
from flywheel.envs import environment_sources
from flywheel.stages import ORDER
from flywheel.train.students import resolve_student

PACKAGE_ROOT = Path(flywheel.__file__).resolve().parent.parent
CODE_FILE = "flywheel-code.yaml"  # a project outside this repository: each stage's code hash, dvc.yaml's params
REGENERATE = "flywheel dvc-yaml"  # what writes dvc.yaml (and CODE_FILE): flywheel/cli/pipeline.py


@dataclass(frozen=True)
class StageSpec:
    name: str
    deps: tuple[str, ...]  # paths under the project root; "{p}" is the pipeline
    config: tuple[str, ...]  # sections of the pipeline's config
    outs: tuple[str, ...]

    @cached_property
    def code(self) -> tuple[str, ...]:
        """Source paths under the package root: the stage module and what it imports (stage_code)."""
        return stage_code(self.name, self.config)

    def dep_paths(self, root: Path, pipeline: str, cfg: PipelineConfig) -> list[Path]:
        paths = [root / d.format(p=pipeline) for d in self.deps]
        if self.name == "collect":
            paths += local_files(cfg.collect, root)  # remote sources: see tasks/collect.py cache_key
        if self.name == "sft" and cfg.student.chat_template:
            paths.append(root / cfg.student.chat_template)  # its text, not only its name, is an input
        if "environment" in self.config:
            paths += [root / d for d in env_deps(cfg, root)]  # an absolute path stays itself
        if self.name == "rl":
            paths += [root / d for d in teacher_deps(cfg)]
        return paths

    def out_paths(self, root: Path, pipeline: str) -> list[Path]:
        return [root / o.format(p=pipeline) for o in self.outs]


def _in_order(specs: list[StageSpec]) -> dict[str, StageSpec]:
    """name -> spec in the order of flywheel/stages.py's ORDER, the one list of stages: one spec for each name."""
    names = [s.name for s in specs]
    missing = [n for n in ORDER if n not in names]
    extra = sorted({n for n in names if n not in ORDER or names.count(n) > 1})
    if missing or extra:
        raise RuntimeError(f"tasks/spec.py: no StageSpec for {missing}, a StageSpec not in ORDER or given twice "
                           f"for {extra}: every name in flywheel/stages.py ORDER needs exactly one StageSpec here")
    return {name: next(s for s in specs if s.name == name) for name in ORDER}


STAGES: dict[str, StageSpec] = _in_order([
    StageSpec("collect", (), ("environment", "collect"), ("data/{p}/collect",)),
    StageSpec("synthesize", ("data/{p}/collect",), ("environment", "teacher", "synthesize"), ("data/{p}/synthesize",)),
    # environment and collect's tasks: the validation slice of train tasks (sft.validation_tasks) runs episodes
    StageSpec("sft", ("data/{p}/collect", "data/{p}/synthesize"), ("environment", "student", "sft"),
              ("models/{p}/base", "models/{p}/sft")),
    StageSpec("rl", ("data/{p}/collect", "models/{p}/sft"), ("environment", "rl"), ("models/{p}/rl", "data/{p}/rl")),
    StageSpec("evaluate", ("data/{p}/collect", "data/{p}/synthesize", "data/{p}/rl", "models/{p}/base",
                           "models/{p}/sft", "models/{p}/rl"), ("environment", "evaluate", "gate"),
              ("data/{p}/evaluate",)),
    # collect: the input example is one of the tasks (a replay environment's come from the collected traces)
    StageSpec("register", ("data/{p}/collect", "models/{p}/rl", "data/{p}/evaluate"), ("gate",),
              ("data/{p}/register",)),
])

# --- a stage's code: the project's modules its module imports ------------------------------------------------

PROJECT_PACKAGES = ("flywheel", "tasks")
# Modules loaded by name at run time, which no import statement names, so the closure below cannot see them: the
# environment `environment.name` names (flywheel/envs get_environment), built by every stage that reads the
# `environment` section, and a policy backend by kind (flywheel/policies get_policy), by every stage whose code
# imports get_policy. Such a stage depends on the whole folder: a new or edited module there may be the one it
# loads (and what those modules import is followed like the rest).
_ENVIRONMENTS, _POLICIES = "flywheel/envs", "flywheel/policies"
_GET_POLICY = "flywheel.policies.get_policy"


def module_file(name: str) -> Path | None:
    """The source file of project module `name` (a package's __init__.py); None if it is none (or a name in one)."""
    base = PACKAGE_ROOT.joinpath(*name.split("."))
    return next((f for f in (base / "__init__.py", base.with_suffix(".py")) if f.is_file()), None)


@cache
def _imported(name: str) -> tuple[str, ...]:
    """Every dotted name an import statement of module `name` names, anywhere in it (the project imports inside
    functions too): `from a import b` names a.b (a module, or a name in a) and a."""
    file = module_file(name)
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per dot after the first
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return tuple(found)


def imported_modules(roots: list[str]) -> tuple[set[str], set[str]]:
    """(the project modules `roots` import, transitively, with the packages above each, whose __init__ runs
    first; every dotted name their imports name, modules or not)."""
    modules: set[str] = set()
    names: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in modules or name.partition(".")[0] not in PROJECT_PACKAGES or module_file(name) is None:
            continue
        modules.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))] + list(_imported(name))
        names.update(_imported(name))
    return modules, names


def _folder_modules(folder: str) -> list[str]:
    return [".".join(p.relative_to(PACKAGE_ROOT).with_suffix("").parts).removesuffix(".__init__")
            for p in sorted((PACKAGE_ROOT / folder).rglob("*.py"))]


@cache
def stage_code(stage: str, config: tuple[str, ...]) -> tuple[str, ...]:
    """A stage's code, derived: tasks/<stage>.py, then the project modules it imports (transitively, see
    imported_modules) and the folders of what it loads by name, as paths under the package root."""
    folders = [_ENVIRONMENTS] if "environment" in config else []
    roots = [f"tasks.{stage}"] + [m for folder in folders for m in _folder_modules(folder)]
    modules, names = imported_modules(roots)
    if _GET_POLICY in names:
        folders.append(_POLICIES)
        modules, names = imported_modules(roots + _folder_modules(_POLICIES))
    files = {str(module_file(m).relative_to(PACKAGE_ROOT)) for m in modules}
    own = f"tasks/{stage}.py"
    return (own, *sorted(f for f in files if f != own and not any(Path(f).is_relative_to(d) for d in folders)),
            *folders)


def code_hash(spec: StageSpec) -> str:
    return content_hash([PACKAGE_ROOT / c for c in spec.code], PACKAGE_ROOT)


def input_key(stage: str, pipeline: str, root: Path, cfg: PipelineConfig | None = None) -> str:
    """The content of a stage's inputs, config sections and code: equal keys mean equal work."""
    spec = STAGES[stage]
    cfg = cfg or load_pipeline(pipeline, root / "pipelines.yaml")
    # the student `auto` picks and its profile's settings, not the word: another pick is other work
    cfg, _ = resolve_student(cfg, root)
    parts = [stage, pipeline, content_hash(spec.dep_paths(root, pipeline, cfg), root),
             cfg.section_hash(*spec.config), code_hash(spec)]
    if stage == "sft" and is_gguf(cfg.student.model):
        parts.append(gguf_identity(cfg.student.model, root))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def gguf_identity(model: str, root: Path) -> str:
    """A GGUF student's bytes (md5), wherever its package put it: a new file with the same name is a new base."""
    try:
        file = gguf_file(model, root)
    except CheckpointError:
        return f"missing:{model}"  # the stage itself then fails, naming what to install
    return file_md5(file)


def output_hashes(stage: str, pipeline: str, root: Path) -> dict[str, str]:
    """Content hash of each of a stage's outputs, by its path under the root: what a cache hit must find."""
    return {out.format(p=pipeline): content_hash([root / out.format(p=pipeline)], root) for out in STAGES[stage].outs}


def env_deps(cfg: PipelineConfig, root: Path) -> list[str]:
    """The environment's own files (a factory's module or package folder, the files its `args` name: see
    flywheel.envs.environment_sources), relative to the root when inside it.

    A built-in environment adds only what its args name: flywheel/envs is in the code of every stage that reads
    the `environment` section (stage_code)."""
    root = Path(root).resolve()
    return [str(p.relative_to(root)) if p.is_relative_to(root) else str(p)
            for p in environment_sources(cfg.environment, root)]


def teacher_deps(cfg: PipelineConfig) -> list[str]:
    """On-policy distillation's local teacher checkpoint (rl.opd.teacher without base_url): its weights are an
    input of the rl stage. A served teacher is its URL and model name, which the rl config section holds."""
    opd = cfg.rl.objective.opd  # none unless the objective distils
    return [opd.teacher] if opd is not None and not opd.base_url else []


_GLOB = set("*?[")


def source_deps(cfg: PipelineConfig) -> list[str]:
    """The DVC deps that stand for a pipeline's local trace sources: each glob's folder before its first wildcard.

    DVC deps cannot be globs, so a folder stands for the files its glob matches (a file there that the glob
    does not match also counts as a change: a rerun too many, never one too few). S3 and MLflow sources are no
    DVC deps: the Prefect cache key fingerprints them (tasks/collect.py).
    """
    found: list[str] = []
    for source in cfg.collect.sources:
        for pattern in source.path or []:
            parts = Path(pattern).parts
            static = next((i for i, part in enumerate(parts) if _GLOB & set(part)), len(parts))
            found.append(str(Path(*parts[:static])) if static else ".")
    # a folder inside another one listed adds nothing (and DVC refuses overlapping deps)
    found = sorted(set(found))
    return [d for d in found if not any(d != o and Path(d).is_relative_to(o) for o in found)]


def dvc_yaml(root: Path = PACKAGE_ROOT) -> str:
    """dvc.yaml as these specs and root/pipelines.yaml imply it (`flywheel dvc-yaml` writes it, with dvc_files).

    Every stage is a `foreach` over the pipelines, so `collect@demo`, `sft@demo`, ... Collect's deps differ per
    pipeline (its own sources), as do those of every stage that runs episodes when a pipeline's environment is
    a factory's (its code), and a `foreach` template has one deps list for all: such a stage iterates over a
    table written here, pipeline -> its own deps, each in a slot of the template. tests/test_spec.py
    checks the project's dvc.yaml against this; after changing a pipeline's sources or adding a pipeline,
    generate it again.

    The stages' code is a dep only where it lies under the root (a checkout of this repository); a project
    elsewhere runs the installed package, whose files are no paths of its own: there each stage's code hash is
    a param read from CODE_FILE (code_params), which dvc_files writes next to dvc.yaml.
    """
    pipelines = load_pipelines(root / "pipelines.yaml")
    own_code = holds_the_code(root)
    written = {name: set(raw) for name, raw in read_pipelines_file(root / "pipelines.yaml").items()}
    envs = {name: env_deps(cfg, root) for name, cfg in pipelines.items()}
    lines = [
        "# One DVC stage per pipeline stage and per pipeline in pipelines.yaml (`collect@demo`, `sft@demo`, ...).",
        "# Prefect runs the same stage functions (`flywheel run`); after each it commits the outputs here as",
        "# `dvc repro` would, so `dvc status` is clean after a run and `dvc repro` reruns only what changed.",
        "# Generated from tasks/spec.py (the Prefect cache keys) and pipelines.yaml: `flywheel dvc-yaml` again after",
        "# adding a pipeline, changing a pipeline's collect sources or its environment.",
        "vars:", "  - pipelines.yaml", "", "stages:"]
    for spec in STAGES.values():
        lines.append(f"  {spec.name}:")
        extra: list[str] = []
        # deps that differ per pipeline: collect's source folders, the environment's own code (a factory's)
        if spec.name == "collect":
            table = {name: source_deps(cfg) + envs[name] for name, cfg in pipelines.items()}
        elif spec.name == "rl":
            table = {name: envs[name] + teacher_deps(cfg) for name, cfg in pipelines.items()}
        elif "environment" in spec.config:
            table = envs
        else:
            table = {}
        # params: the sections each pipeline writes (one it leaves out takes defaults, and DVC refuses a params key
        # missing from the file); when they differ, each pipeline names its own in slots as the deps are
        params = {name: [f"pipelines.{name}.{s}" for s in spec.config if s in written[name]] for name in pipelines}
        own_params = any(len(found) < len(spec.config) for found in params.values())
        slots = max((len(deps) for deps in table.values()), default=0)
        if spec.name == "collect" and not own_code:
            slots = max(slots, 1)  # collect has no other deps there: DVC wants a list that is not empty
        if slots or spec.name == "collect" or own_params:
            # a `foreach` template has one deps list for all pipelines: each pipeline fills every slot, one with
            # fewer deps repeats its first (DVC accepts a path twice), one with none names a dep the stage has anyway
            slot_name = "sources" if spec.name == "collect" else "env"
            lines.append("    foreach:")
            for name in pipelines:
                lines.append(f"      {name}:")
                if slots or spec.name == "collect":
                    filled = table.get(name) or [spec.code[0] if own_code else CODE_FILE]
                    filled = filled + filled[:1] * (slots - len(filled))
                    lines.append(f"        {slot_name}: {json.dumps(filled)}")
                if own_params:  # `environment` is always written: it fills the slots of the sections left out
                    named = params[name] or [f"pipelines.{name}.environment"]
                    named = named + named[:1] * (len(spec.config) - len(named))
                    lines.append(f"        params: {json.dumps(named)}")
            if slots or spec.name == "collect":
                extra = [f"${{item.{slot_name}[{i}]}}" for i in range(slots)]
        else:
            lines.append("    foreach: ${pipelines}")
        lines += ["    do:", f"      cmd: flywheel stage {spec.name} --pipeline ${{key}}", "      deps:"]
        code = list(spec.code) if own_code else []
        lines += [f"        - {d}" for d in extra + [d.replace("{p}", "${key}") for d in spec.deps] + code]
        lines += ["      params:"] if spec.config or not own_code else []
        if spec.config:
            lines += ["        - pipelines.yaml:"]
            lines += [f"            - ${{item.params[{i}]}}" if own_params
                      else f"            - pipelines.${{key}}.{section}" for i, section in enumerate(spec.config)]
        if not own_code:
            lines += [f"        - {CODE_FILE}:", f"            - {spec.name}"]
        lines.append("      outs:")
        for out in spec.outs:
            # the registration record is tiny and names MLflow state: tracked in dvc.lock, not cached
            lines += [f"        - {out.replace('{p}', '${key}')}" + (":\n            cache: false"
                                                                   if spec.name == "register" else "")]
        lines.append("")
    return "\n".join(lines)


def holds_the_code(root: Path) -> bool:
    """Whether every stage's code file lies under root (a checkout of this repository): then dvc.yaml names them."""
    return all((Path(root) / path).is_file() or (Path(root) / path).is_dir()
               for spec in STAGES.values() for path in spec.code)


def code_params() -> str:
    """CODE_FILE's text: the installed flywheel's version and each stage's code hash (code_hash, the hash its
    Prefect cache key holds), which dvc.yaml reads as params where the code is no path under the root."""
    lines = ["# The flywheel's code each stage runs, as the hash of its files: dvc.yaml reads these as params, so",
             "# `dvc repro` reruns a stage whose code changed. Generated with dvc.yaml by `flywheel dvc-yaml`; after",
             "# installing another flywheel, `flywheel check` fails until you run it again.",
             f"flywheel: {json.dumps(flywheel.__version__)}"]
    return "\n".join(lines + [f"{name}: {code_hash(spec)}" for name, spec in STAGES.items()]) + "\n"


def dvc_files(root: Path) -> dict[str, str]:
    """The files `flywheel dvc-yaml` writes under root, name -> text: dvc.yaml, and CODE_FILE where the stages'
    code is not under the root (holds_the_code)."""
    return {"dvc.yaml": dvc_yaml(root)} | ({} if holds_the_code(root) else {CODE_FILE: code_params()})


def stale(root: Path) -> str | None:
    """Why root's dvc.yaml (or CODE_FILE) differs from what dvc_files would write, or None. A DVC project (a
    .dvc/ folder) without dvc.yaml is named too: its runs would version nothing; a root without DVC is none."""
    root = Path(root)
    if not (root / "dvc.yaml").exists():
        if not (root / ".dvc").is_dir():
            return None
        return (f"{root / '.dvc'} makes {root} a DVC project, but {root / 'dvc.yaml'} does not exist, so no stage's "
                f"output is versioned; write it: {REGENERATE} --root {root}")
    wanted = dvc_files(root)
    missing = [root / name for name in wanted if not (root / name).is_file()]
    differ = [root / name for name, text in wanted.items() if root / name not in missing
              and (root / name).read_text() != text]
    if not missing and not differ:
        return None
    said = []
    if differ:
        said.append(f"{' and '.join(map(str, differ))} {'is' if len(differ) == 1 else 'are'} out of date with "
                    f"{root / 'pipelines.yaml'} (a pipeline or its collect sources changed, or the stages' code did)")
    if missing:
        said.append(f"{', '.join(map(str, missing))} does not exist (dvc.yaml reads it)")
    return f"{'; '.join(said)}, so `dvc repro` would track the wrong inputs; regenerate: {REGENERATE} --root {root}"


def write_dvc_files(root: Path) -> list[Path]:
    """Write dvc_files(root) under root; the paths written."""
    written = []
    for name, text in dvc_files(root).items():
        (Path(root) / name).write_text(text)
        written.append(Path(root) / name)
    return written


if __name__ == "__main__":
    import sys

    print(dvc_yaml(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")), end="")
