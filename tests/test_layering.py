"""The import graph, read from the source with `ast`: no cycles, and the arrows point one way.

`cli -> flows -> tasks -> flywheel -> libraries` (/work/shared/DESIGN.md, docs/layout.md): nothing in
flywheel/ but flywheel/cli/ imports Prefect, tasks/ or flows/, and tasks/ never imports flows/. An import inside a
function counts like one at the top of the module: moving an import into a function defers it, it does not
remove the dependency, so a cycle through one is still a cycle (what `flywheel stage` or a worker imports
first decides whether it breaks). Implicit imports of parent packages (`flywheel.data` before
`flywheel.data.sources`) are not edges: Python runs a package's __init__ before its modules either way.

One level up, the parts of flywheel/ (a subpackage or a top-level module) stand in the layers of LAYERS, and a
part imports only from layers below its own: importing any module of a package runs its __init__, so a cycle
between two packages knots them even where no two modules import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("flywheel", "tasks", "flows")

# The parts of flywheel/, bottom first; each imports only from the layers below it.
LAYERS = (
    # the base class of the errors a user can fix (the environment contract's errors are such errors)
    ("flywheel.errors",),
    # plain facts that need nothing of the project: the environment contract (Task, Score, Environment, the
    # prompt hash), the stage names and what crosses between stages (the gate report, the retrain summary),
    # metric and tag names, the embedded defaults, device settings, the package's version
    ("flywheel", "flywheel.contract", "flywheel.stages", "flywheel.metrics", "flywheel.tags", "flywheel.settings",
     "flywheel.devices", "flywheel.plots"),
    # pipelines.yaml as checked models; MLflow's runs and registry; student checkpoints on disk
    ("flywheel.config", "flywheel.registry", "flywheel.checkpoints"),
    # the datasets between stages: schemas, sources, the catalog of paths, DVC
    ("flywheel.data",),
    # what writes assistant turns (the oracle, transformers, vLLM, an OpenAI-compatible server)
    ("flywheel.policies",),
    # the environments and their loader (a judge is a policy; replay reads the tasks table)
    ("flywheel.envs",),
    # the one episode loop
    ("flywheel.agent",),
    # its episodes (and served requests) as MLflow traces; replay's check: the recorded conversations said again
    # through the loop, and changed
    ("flywheel.tracing", "flywheel.replaycheck"),
    # what runs the loop: teacher synthesis, SFT and RL, the held-out evaluation and its gate, an environment's
    # dry run (`flywheel check --solve`)
    ("flywheel.synthesis", "flywheel.train", "flywheel.evaluate", "flywheel.dryrun"),
    # what is done with the trained versions: serving, promotion, comparisons, status, reruns; and what a run
    # will take before it starts (the estimate, over the training parts' probe)
    ("flywheel.serving", "flywheel.promotion", "flywheel.comparison", "flywheel.status", "flywheel.reproduce",
     "flywheel.estimate"),
    # the face: the `flywheel` command
    ("flywheel.cli",),
)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path) -> list[tuple[str, int]]:
    """(imported name, line) for every import in the module, at any depth; relative ones made absolute."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from a import b` imports module a.b when there is one, else names from a
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
            found.append((base, node.lineno))
    return found


def _graph() -> dict[str, dict[str, int]]:
    """module -> {project module it imports: line of the first such import}."""
    modules = _modules()
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        for imported, line in _imports(name, path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                edges.setdefault(imported, line)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle per strongly connected component that has one (Tarjan), each as a closed path of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_path_within(graph, sorted(c)) for c in components]


def _path_within(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """A closed path through the component, from its first module back to it (breadth-first, shortest)."""
    start, members = component[0], set(component)
    previous = {start: None}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in graph[node]:
            if nxt == start:
                path = [node]
                while previous[path[-1]] is not None:
                    path.append(previous[path[-1]])
                return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, node, start]
            if nxt in members and nxt not in previous:
                previous[nxt] = node
                queue.append(nxt)
    return component


def _describe(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False)) + \
        f" -> {cycle[-1]}"


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    assert len(graph) > 50 and "flywheel.data.sources" in graph["tasks.collect"], "the graph reads the imports"
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(_describe(graph, c) for c in cycles)


def test_the_arrows_point_one_way():
    forbidden = {"flywheel": ("prefect", "tasks", "flows"), "tasks": ("flows",)}
    wrong = set()
    for name, path in _modules().items():
        if _part(name) == "flywheel.cli":  # the face of the project: free to call flows and stages
            continue
        banned = forbidden.get(name.partition(".")[0], ())
        for imported, line in _imports(name, path):
            top = imported.partition(".")[0]
            if top in banned:
                wrong.add(f"{path.relative_to(REPO)}:{line} imports from {top}/" if top != "prefect" else
                             f"{path.relative_to(REPO)}:{line} imports Prefect")
    assert not wrong, "layering (cli -> flows -> tasks -> flywheel):\n" + "\n".join(sorted(wrong))


def test_a_cycle_through_a_function_level_import_is_found():
    graph = {"a": {"b": 3}, "b": {"c": 10}, "c": {"a": 7}, "d": {"a": 1}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _describe(graph, ["a", "b", "c", "a"]) == "a (line 3) -> b (line 10) -> c (line 7) -> a"
    assert _cycles({"a": {"b": 1}, "b": {}}) == []


def _part(module: str) -> str:
    """The part of flywheel/ a module belongs to: `flywheel.data.sources` -> `flywheel.data`."""
    return ".".join(module.split(".")[:2])


def _part_edges(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, str]]:
    """part -> {part it imports: the first module-level edge that shows it, "module (line) -> module"}."""
    edges: dict[str, dict[str, str]] = {}
    for module, imported in graph.items():
        if module.partition(".")[0] != "flywheel":
            continue
        edges.setdefault(_part(module), {})
        for target, line in imported.items():
            if target.partition(".")[0] == "flywheel" and _part(target) != _part(module):
                edges[_part(module)].setdefault(_part(target), f"{module} (line {line}) -> {target}")
    return edges


def test_the_parts_of_flywheel_import_only_from_layers_below():
    edges = _part_edges(_graph())
    layer = {part: level for level, parts in enumerate(LAYERS) for part in parts}
    unplaced = sorted(set(edges) - set(layer))
    assert not unplaced, f"parts of flywheel/ in no layer: {unplaced}; add each to LAYERS where it belongs"
    upward = [f"{a} (layer {layer[a]}) imports {b} (layer {layer[b]}): {why}"
              for a, targets in sorted(edges.items()) for b, why in sorted(targets.items()) if layer[b] >= layer[a]]
    assert not upward, "imports that do not point down the layers:\n" + "\n".join(upward)


def test_the_parts_of_flywheel_form_no_cycle():
    edges = _part_edges(_graph())
    assert {"flywheel.data", "flywheel.envs", "flywheel.train"} <= set(edges), "the graph reads the parts"
    cycles = _cycles({part: dict.fromkeys(targets, 0) for part, targets in edges.items()})
    assert not cycles, "package-level import cycles:\n" + "\n".join(
        " -> ".join(f"{a} ({edges[a][b]})" for a, b in zip(c, c[1:], strict=False)) for c in cycles)
