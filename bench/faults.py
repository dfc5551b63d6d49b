"""The fault tests (tests/faults/) run once, their measured figures collected into one JSON file.

    .venv/bin/python bench/faults.py [-k router]

Each fault test records what it measured (recovery times, how many pods were flushed how many times, requests
served and lost) through tests/faults/fault_figures.py into the file named by $KVPILOT_FAULT_FIGURES; this
script sets it, runs pytest on tests/faults/ and writes bench/results/faults-YYYYmmdd-HHMMSS.json with the
figures, the tests' outcome and the machine's load. docs/reliability.md quotes a run. Not a test itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit, devcluster

import benchkit

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-k", default=None, help="pytest -k expression: run only the matching fault tests")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        figures = Path(tmp) / "figures.json"
        env = {**os.environ, "KVPILOT_FAULT_FIGURES": str(figures), "PYTHONSAFEPATH": "1"}
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/faults", "-rA"]
        argv += ["-k", a.k] if a.k else []
        rc = subprocess.run(argv, cwd=ROOT, env=env).returncode
        found = json.loads(figures.read_text()) if figures.exists() else {}
    doc = {**benchkit.header("faults", load), "pytest_exit_code": rc, "figures": found}
    benchkit.write(a.out or benchkit.default_path(ROOT / "bench" / "results", "faults"), doc)
    sys.exit(rc)


if __name__ == "__main__":
    main()
