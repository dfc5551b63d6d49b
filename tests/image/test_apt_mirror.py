"""hack/lib/aptmirror.sh: the image's Debian mirrors come from the building machine's own apt sources (deb822 and
one-line formats), so no archive host is written into the project."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from support import ROOT

SCRIPT = ROOT / "hack" / "lib" / "aptmirror.sh"


def mirror(apt: Path, suite: str) -> str:
    r = subprocess.run(
        ["bash", "-c", f'source "{SCRIPT}"; apt_mirror "$1"', "_", suite],
        env={"APT_SOURCES_DIR": str(apt), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


DEB822 = (
    "Types: deb\nURIs: http://mirror.test/debian/\nSuites: bookworm bookworm-updates\nComponents: main\n\n"
    "Types: deb\nURIs: http://off.test/debian\nSuites: bookworm-security\nEnabled: no\n\n"
    "Types: deb\nURIs: http://security.test/debian-security http://second.test/x\n"
    "Suites: bookworm-security\nComponents: main\n"
)
ONE_LINE = (
    "# deb http://commented.test/debian bookworm main\n"
    "deb-src http://src.test/debian bookworm main\n"
    "deb [arch=amd64 signed-by=/k.gpg] http://mirror.test/debian bookworm main\n"
    "deb http://security.test/debian-security bookworm-security main\n"
)
EXPECTED = {
    "bookworm": "http://mirror.test/debian",
    "bookworm-security": "http://security.test/debian-security",
    "trixie": "",
}


@pytest.mark.parametrize(
    ("file", "text"), [("sources.list.d/debian.sources", DEB822), ("sources.list", ONE_LINE)]
)
def test_the_mirror_of_each_suite(tmp_path: Path, file: str, text: str) -> None:
    """deb822 (a disabled entry and a second URI skipped) and one-line sources (comments, deb-src and
    options skipped) name the same mirrors."""
    (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / file).write_text(text)
    assert {suite: mirror(tmp_path, suite) for suite in EXPECTED} == EXPECTED


def test_no_sources_no_mirror(tmp_path: Path) -> None:
    assert mirror(tmp_path, "bookworm") == ""
