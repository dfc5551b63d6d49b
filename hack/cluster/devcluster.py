#!/usr/bin/env python3
"""Launcher for `kvpilot.devcluster` that works from a checkout, installed or not.

It appends the repo root to sys.path rather than prepending it (as `python -m`
from the root would), so the root's `operator/` folder, which the installed
package maps to `kvpilot.operator`, can never shadow the standard library's
`operator` module.
"""

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))

from kvpilot.devcluster.cli import main  # noqa: E402

raise SystemExit(main())
