"""`--compilation-config` / `-O` and `--enforce-eager`, read as vLLM reads them, into what the step runs.

Levels (vLLM's `-O` names; 3 is 2 today, as in vLLM):
- 0: eager, every op dispatched from Python (the reference for every other level);
- 1: the forward compiled by torch.compile (inductor), one graph for every token count (dynamic shapes),
  the attention and its KV write kept out of it as one opaque op (their metadata changes every step);
- 2, 3: 1, and on CUDA the steps of up to `max_cudagraph_capture_size` tokens, padded to the next capture
  size, replayed as CUDA graphs between the attention ops (on the CPU, 1).

The default: 2 on CUDA, where a small model's step is bound by kernel launches; 0 on the CPU, where the
step is bound by reading the weights and compiling costs more than it pays back (docs/performance.md has
the figures); 0 with tensor parallelism, whose all-reduce is not in the graph yet (a level above 0 is
refused there). `--enforce-eager` is level 0 whatever the rest says, as vLLM's flag is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

LEVELS = (0, 1, 2, 3)
_KEYS = ("level", "cudagraph_capture_sizes", "max_cudagraph_capture_size", "cache_dir")
_MAX_CAPTURE = 512  # tokens: vLLM's ceiling too; a bigger step is compute-bound, launches are noise


@dataclass(frozen=True, slots=True)
class CompilationConfig:
    level: int
    cudagraph_capture_sizes: tuple[int, ...]  # ascending; empty: no CUDA graphs
    cache_dir: str | None  # torch.compile's cache (inductor's FX graph cache); None: torch's default

    @property
    def compiled(self) -> bool:
        return self.level > 0

    def describe(self) -> str:
        """One line for the startup log."""
        if not self.compiled:
            return "eager (-O0)"
        graphs = (
            f", CUDA graphs of steps up to {self.cudagraph_capture_sizes[-1]} tokens"
            if self.cudagraph_capture_sizes
            else ""
        )
        return f"torch.compile (-O{self.level}){graphs}"


EAGER = CompilationConfig(0, (), None)


def parse_compilation_config(
    text: str | None, enforce_eager: bool, device_type: str, max_num_seqs: int, tensor_parallel_size: int = 1
) -> CompilationConfig:
    """The flags' values as one config; ValueError names what is wrong. `text` is a level ("3") or a JSON
    object with the keys in _KEYS; None: the device's default."""
    doc: dict[str, object] = {}
    if text is not None and text.strip():
        doc = _read(text.strip())
    level = doc.get("level", 2 if device_type == "cuda" and tensor_parallel_size == 1 else 0)
    if isinstance(level, bool) or level not in LEVELS:
        raise ValueError(f"compilation level must be one of {', '.join(map(str, LEVELS))}, not {level!r}")
    assert isinstance(level, int)
    if level and tensor_parallel_size > 1 and not enforce_eager:
        raise ValueError("a compiled step and tensor_parallel_size > 1 cannot be combined yet: use -O0")
    if enforce_eager:
        level = 0
    cache_dir = doc.get("cache_dir")
    if cache_dir is not None and not (isinstance(cache_dir, str) and cache_dir):
        raise ValueError("compilation cache_dir must be a directory path")
    sizes: tuple[int, ...] = ()
    if level >= 2 and device_type == "cuda":
        sizes = _capture_sizes(doc, max_num_seqs)
    return CompilationConfig(level, sizes, cache_dir)


def _read(text: str) -> dict[str, object]:
    if text.isdigit():
        return {"level": int(text)}
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--compilation-config is a level (0-3) or a JSON object: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError("--compilation-config is a level (0-3) or a JSON object")
    unknown = sorted(set(doc) - set(_KEYS))
    if unknown:
        raise ValueError(f"--compilation-config: unknown keys {unknown}; known: {', '.join(_KEYS)}")
    return doc


def _capture_sizes(doc: dict[str, object], max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's default sizes (1, 2, 4, then every 8) up to the batch a decode step can have (or
    max_cudagraph_capture_size), or the config's own list."""
    ceiling = doc.get("max_cudagraph_capture_size", min(max_num_seqs, _MAX_CAPTURE))
    if isinstance(ceiling, bool) or not isinstance(ceiling, int) or not 0 <= ceiling <= _MAX_CAPTURE:
        raise ValueError(f"max_cudagraph_capture_size must be an integer in [0, {_MAX_CAPTURE}]")
    given = doc.get("cudagraph_capture_sizes")
    if given is None:
        sizes = [s for s in (1, 2, 4, *range(8, _MAX_CAPTURE + 1, 8)) if s <= ceiling]
        return tuple(sizes)
    if not isinstance(given, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and 0 < s <= _MAX_CAPTURE for s in given
    ):
        raise ValueError(f"cudagraph_capture_sizes must be a list of integers in [1, {_MAX_CAPTURE}]")
    return tuple(sorted(set(given)))
