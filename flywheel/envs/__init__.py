"""Which environment a pipeline runs: a built-in by name, an installed package's entry point, or any factory.

`environment:` in pipelines.yaml takes `name: calculator` (a module of this package that defines ENVIRONMENT,
or an entry point of the `flywheel.environments` group) or `factory: "package.module:function"` with `args`
passed to it. The project root is importable while resolving, so a project-local `envs/` folder works.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import pkgutil
import sys
from pathlib import Path

from flywheel.contract import Environment, RubricError, Score, Task, ToolError
from flywheel.envs.task_files import FILES_READ, PROJECT_ROOT
from flywheel.errors import UserFacingError

__all__ = ["Environment", "Score", "Task", "ToolError", "RubricError", "EnvironmentLoadError", "get_environment",
           "environment_names", "entry_point_environments", "environment_sources", "load_environment"]

ENTRY_POINT_GROUP = "flywheel.environments"
# modules of this package that are parts of environments, not environments
_PARTS = {"sdk", "tool_schemas", "task_files", "judge", "mcp", "verifiers", "users"}
_BUILTIN_FOLDER = Path(__file__).resolve().parent
# (factory, args, root) -> the task files its factory read when it was last built in this process
_FILES_READ: dict[tuple, list[Path]] = {}


class EnvironmentLoadError(UserFacingError, ValueError):
    """An environment could not be built; the message names the config key, the module and the cause."""


def environment_names() -> list[str]:
    """Names of the built-in environments (modules of this package that define ENVIRONMENT)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in _PARTS)


def entry_point_environments() -> dict[str, str]:
    """Environments advertised by installed packages: name -> "module:function" (group flywheel.environments)."""
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


# The project's own packages (a test project holds copies): never forgotten by _importable
_OWN_PACKAGES = ("flywheel", "tasks", "flows")


def _importable(root: Path | None, module_name: str = "") -> None:
    """The project root first on sys.path, and left there: RL actor processes inherit sys.path and rebuild from
    it. A factory's package that this process imported from elsewhere (another project's root, a process that
    builds two projects' environments) is forgotten when the root holds its own, so `module_name` is this root's."""
    if root is None:
        return
    if str(root) in sys.path:
        sys.path.remove(str(root))
    sys.path.insert(0, str(root))
    top = module_name.partition(".")[0]
    if not top or top in _OWN_PACKAGES or not ((root / top).is_dir() or (root / f"{top}.py").is_file()):
        return
    loaded = [n for n in sys.modules if n == top or n.startswith(f"{top}.")]
    if not all(_located_in(sys.modules[n], root) for n in loaded):
        for name in loaded:
            del sys.modules[name]


def _located_in(module, root: Path) -> bool:
    """The module's file (a namespace package: its first folder) is under root."""
    where = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", None) or []), None)
    return where is None or Path(where).resolve().is_relative_to(root)


def _target(name: str | None, factory: str | None) -> tuple[str, str]:
    """(config key, "module:function") of what is to be built."""
    if factory:
        return "environment.factory", factory
    name = name or "calculator"
    if name in environment_names():
        return "environment.name", f"flywheel.envs.{name}:ENVIRONMENT"
    advertised = entry_point_environments()
    if name in advertised:
        return "environment.name", advertised[name]
    known = ", ".join(environment_names() + sorted(advertised))
    raise EnvironmentLoadError(f"environment.name: unknown environment '{name}' (known: {known}; or set "
                               "environment.factory: \"package.module:function\")")


def get_environment(name: str | None = None, *, factory: str | None = None, args: dict | None = None,
                    root: str | Path | None = None) -> Environment:
    """Build an environment by built-in or entry-point `name`, or from `factory` ("module:function") with `args`."""
    key, target = _target(name, factory)
    module_name, _, attribute = target.partition(":")
    where = f"{key} '{factory or name}'"
    root = Path(root).resolve() if root is not None else None
    _importable(root, module_name if factory else "")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:
        raise EnvironmentLoadError(f"{where}: cannot import module '{module_name}': {type(err).__name__}: {err}"
                                   + ("" if root is None else f" (the project root {root} is on sys.path)")) from err
    fn = getattr(module, attribute, None)
    if not callable(fn):
        raise EnvironmentLoadError(f"{where}: module '{module_name}' ({module.__file__}) has no function "
                                   f"'{attribute}'")
    token, files = PROJECT_ROOT.set(root), FILES_READ.set([])
    try:
        env = fn(**(args or {}))
        _FILES_READ[_built_key(factory, args, root)] = FILES_READ.get()
    except Exception as err:
        raise EnvironmentLoadError(f"{where}: {module_name}.{attribute}(**{args or {}}) raised "
                                   f"{type(err).__name__}: {err}") from err
    finally:
        PROJECT_ROOT.reset(token)
        FILES_READ.reset(files)
    if not isinstance(env, Environment):
        raise EnvironmentLoadError(f"{where}: {module_name}.{attribute} returned {type(env).__name__}, not an "
                                   "environment; return flywheel.envs.sdk.Env, or an instance of a subclass of "
                                   "flywheel.contract.Environment")
    if not env.name or not isinstance(env.name, str):
        raise EnvironmentLoadError(f"{where}: {module_name}.{attribute} returned an environment without a name "
                                   "(set `name`, a string)")
    env._origin = (rebuild_environment, (name, factory, dict(args or {}), None if root is None else str(root)))
    return env


def rebuild_environment(name: str | None, factory: str | None, args: dict, root: str | None) -> Environment:
    """The same environment built again (how an SDK environment crosses into another process)."""
    return get_environment(name, factory=factory, args=args, root=root)


def load_environment(cfg, root: str | Path, pipeline: str | None = None) -> Environment:
    """The environment of a pipeline's `environment:` section (flywheel.config.EnvironmentConfig).

    With `replay:` (or `name: replay`) it is the replay environment, beside the named one unless that is replay;
    `pipeline` names whose collected tasks it offers the tools of (flywheel/envs/replay)."""
    if cfg.replay is None:
        return get_environment(cfg.name, factory=cfg.factory, args=cfg.args, root=root)
    from flywheel.data.catalog import Catalog
    from flywheel.envs import replay

    base = None if cfg.name == "replay" else get_environment(cfg.name, factory=cfg.factory, args=cfg.args, root=root)
    table = Catalog(Path(root).resolve(), pipeline).table_path("tasks") if pipeline else None
    return replay.build(cfg.replay, base, Path(root).resolve(), table, cfg.user)


def environment_sources(cfg, root: str | Path) -> list[Path]:
    """The files an environment's behaviour comes from, for cache keys, collect's stored state and dvc.yaml deps:
    the folder of the package holding a factory's module (or the module file when it is top-level), with the task
    files it reads there, every file or folder its `args` name (a task file given as an argument), and every task
    file the factory reads wherever it is (a path written in its code). Built-ins add only what their args name:
    flywheel/envs is in the code of every stage that builds an environment."""
    key, target = _target(cfg.name, cfg.factory)
    module_name = target.partition(":")[0]
    root = Path(root).resolve()
    _importable(root, module_name if cfg.factory else "")
    try:
        spec = importlib.util.find_spec(module_name)
    except Exception as err:
        raise EnvironmentLoadError(f"{key} '{cfg.factory or cfg.name}': cannot find module '{module_name}': "
                                   f"{type(err).__name__}: {err}") from err
    if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
        raise EnvironmentLoadError(f"{key} '{cfg.factory or cfg.name}': no module '{module_name}' (looked in the "
                                   f"project root {root} and the installed packages)")
    origin = Path(spec.origin).resolve()
    if spec.submodule_search_locations is not None:  # a package: its whole folder
        path = origin.parent
    elif "." in module_name:  # a module inside a package: its siblings and data files count too
        path = origin.parent
    else:
        path = origin
    found = [] if path == _BUILTIN_FOLDER or path.is_relative_to(_BUILTIN_FOLDER) else [path]
    for named in _named_paths(cfg.args, root) + _task_files(cfg, root):
        # one inside another listed adds nothing (and DVC refuses overlapping deps)
        if not any(named.is_relative_to(p) for p in found):
            found = [p for p in found if not p.is_relative_to(named)] + [named]
    return found


def _built_key(factory: str | None, args: dict | None, root: Path | None) -> tuple:
    return factory, json.dumps(args or {}, sort_keys=True, default=str), root


def _task_files(cfg, root: Path) -> list[Path]:
    """The task files a factory reads (tasks_from_file) wherever they are, e.g. a hard-coded path outside its
    folder: from when it was built in this process, else by building it now. Built-ins and entry points read
    none of the project's but what their args name."""
    if not cfg.factory:
        return []
    key = _built_key(cfg.factory, cfg.args, root)
    if key not in _FILES_READ:
        get_environment(factory=cfg.factory, args=cfg.args, root=root)
    return [p for p in _FILES_READ[key] if p.exists() and not root.is_relative_to(p)]


def _named_paths(value, root: Path) -> list[Path]:
    """The existing files and folders that strings in `args` (at any depth) name, as the task file reader finds
    them (from the project root); never the root itself or a folder above it."""
    if isinstance(value, dict):
        return [p for v in value.values() for p in _named_paths(v, root)]
    if isinstance(value, (list, tuple)):
        return [p for v in value for p in _named_paths(v, root)]
    if not isinstance(value, str) or not value.strip() or "\n" in value:
        return []
    try:
        path = (root / value).resolve()
        exists = path.exists()
    except (OSError, ValueError):  # not a path at all (too long, a NUL byte)
        return []
    return [path] if exists and not root.is_relative_to(path) else []
