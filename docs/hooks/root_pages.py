"""mkdocs hook: README.md, ARCHITECTURE.md and infra/README.md are pages of the site too, and a link written for
the repository (README.md -> docs/rl.md, docs/rl.md -> ../README.md) goes to the same page in the site."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

# the site's page -> the repository file it is made from (the pages under docs/ are their own files)
ROOT_PAGES = {"index.md": "README.md", "architecture.md": "ARCHITECTURE.md", "infra.md": "infra/README.md"}
LINK = re.compile(r"\]\(([^)\s#]+\.md)(#[^)\s]*)?\)")


def on_files(files, config):
    """Add the repository's root pages to the site's files."""
    root = Path(config.config_file_path).parent
    for uri, source in ROOT_PAGES.items():
        files.append(File.generated(config, uri, content=(root / source).read_text()))
    return files


def on_page_markdown(markdown, page, config, files):
    """A link to a repository Markdown file that is a page of the site points to that page."""
    source = ROOT_PAGES.get(page.file.src_uri, f"docs/{page.file.src_uri}")
    pages = {repo: uri for uri, repo in ROOT_PAGES.items()}

    def to_site(match: re.Match) -> str:
        target = posixpath.normpath(posixpath.join(posixpath.dirname(source), match.group(1)))
        uri = pages.get(target) or (target.removeprefix("docs/") if target.startswith("docs/") else None)
        return match.group(0) if uri is None else f"]({uri}{match.group(2) or ''})"

    return LINK.sub(to_site, markdown)
