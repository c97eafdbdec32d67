"""The documentation site builds with `mkdocs build --strict` (mkdocs.yml): a broken link or anchor, a page left out
of the nav or a link to a file outside docs/ fails here, in `make test` and in CI; the README stays short."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_site_builds_strict_with_every_page(tmp_path):
    site = tmp_path / "site"
    env = os.environ | {"NO_MKDOCS_2_WARNING": "1"}  # Material's notice about its successor, on every build
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stdout[-3000:]}{built.stderr[-5000:]}"
    pages = [p.stem for p in (REPO / "docs").glob("*.md")]
    missing = [p for p in pages if not (site / p / "index.html").is_file()]
    assert pages and not missing, f"docs pages with no page in the site: {missing}"
    # README.md, ARCHITECTURE.md and infra/README.md are pages too (docs/hooks/root_pages.py), their links followed
    home = (site / "index.html").read_text()
    assert "Your own agent" in home and 'href="measured/' in home, "the README is not the site's home page"
    assert (site / "architecture" / "index.html").is_file() and (site / "infra" / "index.html").is_file()


def test_the_readme_is_read_in_five_minutes():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= 400, f"README.md has {lines} lines; move reference text into a page under docs/"
