"""hack/lib/aptmirror.sh: the image's Debian mirrors come from the building machine's own apt sources (deb822 and
one-line formats), so no archive host is written into the project."""

from __future__ import annotations

import subprocess
from pathlib import Path

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


def test_deb822_sources_name_the_mirror_per_suite(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.test/debian/\nSuites: bookworm bookworm-updates\nComponents: main\n\n"
        "Types: deb\nURIs: http://off.test/debian\nSuites: bookworm-security\nEnabled: no\n\n"
        "Types: deb\nURIs: http://security.test/debian-security http://second.test/x\n"
        "Suites: bookworm-security\nComponents: main\n"
    )
    assert mirror(tmp_path, "bookworm") == "http://mirror.test/debian"
    assert mirror(tmp_path, "bookworm-updates") == "http://mirror.test/debian"
    assert mirror(tmp_path, "bookworm-security") == "http://security.test/debian-security"
    assert mirror(tmp_path, "trixie") == ""


def test_one_line_sources_with_options(tmp_path: Path) -> None:
    (tmp_path / "sources.list").write_text(
        "# deb http://commented.test/debian bookworm main\n"
        "deb-src http://src.test/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://mirror.test/debian bookworm main\n"
        "deb http://security.test/debian-security bookworm-security main\n"
    )
    assert mirror(tmp_path, "bookworm") == "http://mirror.test/debian"
    assert mirror(tmp_path, "bookworm-security") == "http://security.test/debian-security"


def test_no_sources_no_mirror(tmp_path: Path) -> None:
    assert mirror(tmp_path, "bookworm") == ""
