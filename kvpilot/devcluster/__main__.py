"""`python -m kvpilot.devcluster up|down|run|agent` (see cli.py)."""

from .cli import main

raise SystemExit(main())
