#!/usr/bin/env python3
"""Launcher for `kvpilot.devcluster` that works from a source checkout.

Running `python -m kvpilot.devcluster` from the repo root would put the root
first on sys.path, where the `operator/` folder shadows the standard library's
`operator` module. This script instead appends the root at the end.
"""

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))

from kvpilot.devcluster.cli import main  # noqa: E402

raise SystemExit(main())
