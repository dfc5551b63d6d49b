"""`make setup` through the real Makefile, offline: serving installs no test tools and says little; an existing venv is only refreshed (pip install), never made
again with whichever `python3` is first on PATH; a missing one is made, and one whose interpreter is gone is
removed and made anew, saying so.

The Makefile runs in a temporary folder with its own pyproject.toml. pip in these venvs is a stand-in that
records its calls: the installs themselves are pip's business, not the Makefile's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support import ROOT

# Run by a venv's python: installs the recording pip into that venv (made --without-pip).
PLANT_PIP = """\
import pathlib, sysconfig
pip = pathlib.Path(sysconfig.get_path("purelib")) / "pip"
pip.mkdir(parents=True, exist_ok=True)
(pip / "__init__.py").write_text("")
(pip / "__main__.py").write_text(
    "import os, sys\\n"
    "with open(os.environ['PIP_CALLS'], 'a') as f:\\n"
    "    f.write(sys.prefix + ' ' + ' '.join(sys.argv[1:]) + '\\\\n')\\n"
)
"""


def make_venv(venv: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run([venv / "bin" / "python", "-c", PLANT_PIP], check=True)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A checkout with the real Makefile, a pyproject.toml and a `python3` first on PATH that records its calls
    and makes a venv with the recording pip (it stands for another interpreter than the venv's)."""
    work = tmp_path / "checkout"
    work.mkdir()
    shutil.copy(ROOT / "Makefile", work / "Makefile")
    (work / "pyproject.toml").write_text('[project]\nname = "demo"\nversion = "0"\n')
    bin_dir = tmp_path / "other-python"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"
    python3.write_text(
        textwrap.dedent(f"""\
        #!{sys.executable}
        import subprocess, sys
        with open({str(tmp_path / "python3-calls")!r}, "a") as f:
            f.write(" ".join(sys.argv[1:]) + "\\n")
        assert sys.argv[1:3] == ["-m", "venv"], sys.argv
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", sys.argv[3]], check=True)
        subprocess.run([sys.argv[3] + "/bin/python", "-c", {PLANT_PIP!r}], check=True)
        """)
    )
    python3.chmod(0o755)
    return work


def make_setup(project: Path, target: str = "setup") -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PATH": f"{project.parent / 'other-python'}{os.pathsep}{os.environ['PATH']}",
        "PIP_CALLS": str(project.parent / "pip-calls"),
    }
    env.pop("VIRTUAL_ENV", None)
    return subprocess.run(["make", target], cwd=project, env=env, capture_output=True, text=True, timeout=120)


def calls(project: Path, name: str) -> list[str]:
    path = project.parent / name
    return path.read_text().splitlines() if path.exists() else []


def assert_refreshed(project: Path, r: subprocess.CompletedProcess) -> None:
    """pip ran three installs with the venv's own python, and setup is marked done."""
    assert r.returncode == 0, r.stdout + r.stderr
    pip = calls(project, "pip-calls")
    assert len(pip) == 3 and all(c.startswith(f"{project / '.venv'} install ") for c in pip), pip
    assert "-e .[operator]" in pip[1], pip
    installed = project / ".venv" / ".installed"
    assert installed.stat().st_mtime >= (project / "pyproject.toml").stat().st_mtime


def test_an_existing_venv_is_refreshed_not_made_again(project: Path) -> None:
    """pyproject.toml newer than the last setup, another python3 first on PATH: the venv keeps its interpreter."""
    venv = project / ".venv"
    make_venv(venv)
    (venv / ".installed").touch()
    os.utime(venv / ".installed", (1, 1))  # older than pyproject.toml: setup must run again
    cfg = (venv / "pyvenv.cfg").read_bytes()

    r = make_setup(project)
    assert_refreshed(project, r)
    assert calls(project, "python3-calls") == [], "an existing venv must not be made again"
    assert (venv / "pyvenv.cfg").read_bytes() == cfg

    r = make_setup(project)  # done: nothing to do
    assert r.returncode == 0 and len(calls(project, "pip-calls")) == 3, r.stdout + r.stderr


def test_a_missing_venv_is_made_with_python3(project: Path) -> None:
    r = make_setup(project)
    assert_refreshed(project, r)
    assert calls(project, "python3-calls") == ["-m venv .venv"]
    assert "broken" not in r.stdout


def test_a_venv_whose_python_is_gone_is_made_anew(project: Path) -> None:
    venv = project / ".venv"
    make_venv(venv)
    (venv / "stale").write_text("from the old venv")
    for name in ("python", "python3"):  # its interpreter was uninstalled
        (venv / "bin" / name).unlink()
        (venv / "bin" / name).symlink_to(project.parent / "gone" / "python3")

    r = make_setup(project)
    assert_refreshed(project, r)
    assert (
        ".venv is broken (its python is gone or cannot find its packages): removing it and making it anew"
        in (r.stdout)
    ), r.stdout
    assert calls(project, "python3-calls") == ["-m venv .venv"]
    assert not (venv / "stale").exists(), "the broken venv must be removed, not made over"


def test_serving_installs_no_test_tools_and_says_little(project: Path) -> None:
    """`make serve` on a fresh checkout: the runtime extras only, pip's chatter kept back, a few lines before the
    server's own; `make setup-test` then adds the test extras to the same venv."""
    r = make_setup(project)
    assert_refreshed(project, r)
    assert not any("test]" in c for c in calls(project, "pip-calls")), calls(project, "pip-calls")
    before_server = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert len(before_server) < 20, before_server
    assert not any("pip install" in line for line in before_server), before_server  # no command lines echoed

    r = make_setup(project, "setup-test")
    assert r.returncode == 0, r.stdout + r.stderr
    pip = calls(project, "pip-calls")
    assert len(pip) == 4 and "-e .[test]" in pip[3], pip


def test_a_failing_pip_shows_its_output(project: Path) -> None:
    """Quiet is only for success: when pip fails, its own words reach the user."""
    make_venv(project / ".venv")
    failing = "import sys; print('ERROR: no matching distribution for torch>=2.5'); sys.exit(1)"
    pip_main = next((project / ".venv").glob("lib/python*/site-packages/pip/__main__.py"))
    pip_main.write_text(failing)
    r = make_setup(project)
    assert r.returncode != 0
    assert "no matching distribution for torch" in r.stdout + r.stderr, r.stdout + r.stderr
