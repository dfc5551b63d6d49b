"""The fault tests' measured figures (recovery times, flush counts): each test records its own, merged into the
JSON file named by KVPILOT_FAULT_FIGURES when it is set (bench/faults.py sets it; docs/reliability.md quotes
it), and printed either way so a plain pytest run shows them with -s."""

from __future__ import annotations

import json
import os
from pathlib import Path


def record(test: str, **figures: object) -> None:
    print(f"fault figures {test}: {json.dumps(figures, sort_keys=True)}")
    path = os.environ.get("KVPILOT_FAULT_FIGURES")
    if not path:
        return
    p = Path(path)
    data = json.loads(p.read_text()) if p.exists() else {}
    data[test] = figures
    p.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
