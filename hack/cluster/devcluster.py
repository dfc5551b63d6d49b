#!/usr/bin/env python3
"""Launcher for the dev cluster (`devcluster`, in hack/lib): `make cluster-up`, `make cluster-down`, the demo
and the tests run it as `python hack/cluster/devcluster.py up|down|run|agent` with the venv's python.

The dev cluster is dev tooling, not part of the kvpilot package, so it is found by appending hack/lib to
sys.path: appended, not prepended, and never the checkout itself, whose `operator/` folder (installed as
`kvpilot.operator`) would shadow the standard library's `operator` module.
"""

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "lib"))

from devcluster.cli import main  # noqa: E402

raise SystemExit(main())
