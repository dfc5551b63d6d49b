"""bench/prompt_tokens.py, run small and as docs/performance.md writes it (a file, in a shell without
PYTHONSAFEPATH): each family's prompts tokenized alike by the router's SegmentTokenizer and the tokenizer
it wraps (the bench exits non-zero otherwise), both timed, the ratio written to its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


def test_prompt_tokens_quick(tmp_path: Path) -> None:
    out = tmp_path / "prompt-tokens.json"
    # bench/ first on the path, as a file typed in a shell is run (a bench named as a package transformers
    # imports, as bench/kernels.py was, would shadow it)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    argv = [sys.executable, "bench/prompt_tokens.py", "--prompts", "200", "--out", str(out)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    families = json.loads(out.read_text())["families"]
    assert set(families) == {"chat", "completion", "document"}
    for name, row in families.items():
        assert row["prompts"] == 200 and row["tokens_mean"] > 0, (name, row)
        assert row["tokenizer_us"] > 0 and row["segment_tokenizer_us"] > 0, (name, row)
        assert row["tokenizer_over_segment_tokenizer"] > 0, (name, row)
    assert families["document"]["chars_mean"] > 3000  # the document's 40 lines, then a question
