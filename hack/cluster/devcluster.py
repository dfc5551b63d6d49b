#!/usr/bin/env python3
"""Launcher for the dev cluster (`devcluster`, in hack/lib): `make cluster-up`, `make cluster-down`, the demo
and the tests run it as `python hack/cluster/devcluster.py up|down|run` with the venv's python.

The dev cluster is dev tooling, not part of the kvpilot package, so it is found by appending hack/lib to
sys.path: appended, not prepended, and never the checkout itself, whose `operator/` folder (installed as
`kvpilot.operator`) would shadow the standard library's `operator` module.
"""

import sys
from pathlib import Path

here = Path(__file__).resolve().parent
# Run as a script without PYTHONSAFEPATH, Python puts this folder first on sys.path, where this very file
# would be found as `devcluster` instead of the package it launches.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
sys.path.append(str(here.parent / "lib"))

from devcluster.cli import main  # noqa: E402

raise SystemExit(main())
