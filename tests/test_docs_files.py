"""Every source file is named on the docs page of its part, so a newcomer finds what each file is for.

A page names a file in its file table (or its text) by its name in backticks; a file moved, added or removed
without its page following fails here. README.md's benchmark table names the bench scripts.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# folder -> the page that describes its files (a file belongs to the deepest folder listed)
PAGES = {
    "daemon/engine": "docs/engine.md",
    "daemon/server": "docs/server.md",
    "daemon/kv_transfer": "docs/disaggregation.md",
    "kernels": "docs/kernels.md",
    "router": "docs/router.md",
    "operator": "docs/operator.md",
    "kvpilot": "docs/architecture.md",
    "kvpilot/fanout": "docs/fanout.md",
    "hack/lib/devcluster": "docs/cluster.md",
    "hack": "docs/tools.md",
    "bench": "README.md",
    "tests/support": "docs/architecture.md",
}
SKIP = {"__init__.py", "go.sum"}


def _tracked(folder: str) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", folder],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [f for f in out if (ROOT / f).is_file()]


def _owner(path: str) -> str | None:
    folders = [f for f in PAGES if path.startswith(f + "/")]
    return max(folders, key=len) if folders else None


def _named(page: str, folder: str, path: str) -> bool:
    """A file counts as named by its own name, its path in the repo or its path under the part's folder; a Go
    module's files (go.mod, tools.go, ...) by their module's folder."""
    p = Path(path)
    if p.suffix in (".go", ".mod", ".sum"):
        return f"{p.parent}" in page or f"{p.parent.relative_to(folder)}/" in page
    unique = sum(1 for f in _tracked(folder) if Path(f).name == p.name) == 1
    return (unique and f"`{p.name}`" in page) or path in page or f"{p.relative_to(folder)}`" in page


@pytest.mark.parametrize("folder", sorted(PAGES))
def test_every_file_is_named_on_its_page(folder: str) -> None:
    page = (ROOT / PAGES[folder]).read_text()
    files = [
        f
        for f in _tracked(folder)
        if _owner(f) == folder
        and Path(f).name not in SKIP
        and "/results/" not in f
        and Path(f).suffix in (".py", ".sh", ".go", ".mod")
    ]
    assert files, f"no files under {folder}/: is the table above out of date?"
    missing = [f for f in files if not _named(page, folder, f)]
    assert not missing, f"{PAGES[folder]} does not name {missing} (add them to its file table)"
