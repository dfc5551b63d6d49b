"""The embedded default model converts once, atomically, even when two processes start together."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from kvpilot.default_model import ensure_default_model
print(ensure_default_model())
"""


def test_two_processes_convert_once(tmp_path: Path) -> None:
    env = {**os.environ, "KVPILOT_CACHE": str(tmp_path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in results]
    paths = {out.strip() for out, _ in results}
    assert len(paths) == 1
    model_dir = Path(paths.pop())
    assert (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()
    assert (model_dir / "tokenizer.json").is_file()
    # One process converted, the other waited on the lock and found the finished checkpoint.
    assert sum(err.count("converting the embedded default model") for _, err in results) == 1
    leftovers = [p.name for p in model_dir.parent.iterdir() if p.name.startswith(".convert-")]
    assert leftovers == []


def test_converted_checkpoint_is_a_plain_llama(default_model_dir: Path) -> None:
    import json

    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
