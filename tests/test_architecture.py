"""ARCHITECTURE.md against the code: every path it names exists, every name it places is defined where it says,
and its table of layers is tests/test_layering.py's LAYERS."""

from __future__ import annotations

import re
from pathlib import Path

from test_layering import LAYERS

REPO = Path(__file__).resolve().parent.parent
PAGE = (REPO / "ARCHITECTURE.md").read_text()
PATH = re.compile(r"^(?:flywheel|tasks|flows|tests)/[\w/]*(?:\.py|/)$")
NAME = re.compile(r"^[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)?$")


def _quoted(line: str) -> list[str]:
    return re.findall(r"`([^`]+)`", line)


def _defines(path: Path, name: str) -> bool:
    """Whether the module (or any module of the package) defines `name` (Class.method: the method in the class)."""
    owner, _, member = name.rpartition(".")
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
    for text in (f.read_text() for f in files):
        if member and not owner:
            owner, member = member, ""
        found = re.search(rf"^(?:class|def) {owner}\b|^{owner}\b\s*[:=]", text, re.M)
        if found and (not member or re.search(rf"^    def {member}\b", text[found.start():], re.M)):
            return True
    return False


def test_every_path_it_names_exists():
    paths = [q for line in PAGE.splitlines() for q in _quoted(line) if PATH.match(q)]
    assert len(paths) > 30, "the page names the modules"
    missing = [p for p in paths if not (REPO / p).exists()]
    assert not missing, f"ARCHITECTURE.md names what is not there: {missing}"


def test_every_name_it_places_is_defined_in_the_module_beside_it():
    wrong = []
    for line in PAGE.splitlines():
        quoted = _quoted(line)
        paths = [REPO / q for q in quoted if PATH.match(q)]
        names = [q for q in quoted if not PATH.match(q) and NAME.match(q) and (q[0].isupper() or "." in q)]
        for name in names if paths else []:
            if not any(_defines(p, name) for p in paths):
                wrong.append(f"{name} (beside {', '.join(str(p.relative_to(REPO)) for p in paths)})")
    assert not wrong, f"ARCHITECTURE.md places names where they are not defined: {wrong}"


def test_its_layers_are_the_layering_tests():
    rows = [line for line in PAGE.splitlines() if re.match(r"^\| \d+ \|", line)]
    shown = [tuple(q.removesuffix(".py").removesuffix("/").replace("/", ".") for q in _quoted(row.split("|")[2]))
             for row in rows]
    expected = [tuple(part for part in layer if part != "flywheel") for layer in LAYERS]
    assert shown == expected, "ARCHITECTURE.md's table of layers differs from tests/test_layering.py's LAYERS"
