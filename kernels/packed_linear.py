"""Linear layers on the CPU through the weight laid out once for a faster kernel than `F.linear`.

A decode step multiplies a few rows (one per running request) by every weight of the model. `F.linear` on
the CPU is MKL's sgemm, which at 2-16 rows leaves much of the core idle (kernels/panel_gemm.py says why).
Two kernels take a weight laid out once:
- `panels`, kernels/panel_gemm.py: a small AVX2/FMA kernel of the project's, built with the system's C
  compiler at first use, single-threaded; the choice where it runs (x86-64 with AVX2 and FMA, a compiler,
  float32) and torch runs on one thread. It is 1.5-1.95x sgemm at 2-16 rows, even at 1 and from 1,024
  rows up, never far behind, and its layout reads back exactly, so it replaces the weight
  (`PackedWeight.owning`): no second copy, every row count;
- `oneDNN`, kernels/onednn_linear.py: torch's oneDNN ops on a weight reordered into oneDNN's blocked layout
  (vLLM-cpu's `onednn_mm` shape), where the panels do not run and this torch build and CPU take the weight's
  dtype. It is a copy beside the weight (~540 MB again for the embedded model in float32), so only with
  `--packed-linears`, and faster at some row counts only: `fast_rows` times both ways on the model's own
  weights when the engine starts, and only the row counts where the copy won by `MIN_GAIN` use it
  (docs/performance.md has the figures).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpilot.kernels import onednn_linear, panel_gemm

# Row counts timed at start; a step's rows take the decision of the largest one at or below them, and more
# rows than the last one never take the packed copy (a long prefill chunk: untimed, the panels' cost grows
# faster with rows than sgemm's there).
CALIBRATED_ROWS = (1, 2, 4, 8, 16, 32, 64, 256)
# The weights timed at start take at least this much memory (or are all there are): more than a core's
# share of the last-level cache, so that both ways stream them from memory as a step does (timed on one
# layer's 14 MB, which the cache held, the panels looked 10% faster at 1 row than they are). An LM head is
# timed on its first rows of outputs, this many bytes of them: which way is faster hardly changes with them.
CALIBRATION_BYTES = 64 << 20
MIN_GAIN = 1.10  # the packed copy is used where it took at most 1/MIN_GAIN of F.linear's time


@dataclass(frozen=True, slots=True)
class Kernel:
    """A way to multiply by a weight laid out once: `pack(weight)` lays it out, `multiply(x, packed,
    out_features, bias)` is `F.linear(x, weight, bias)` through it. A kernel whose layout can be read back
    exactly (`unpack`, `pack_into`) and that is faster at every row count can replace the weight instead
    of copying it (`PackedWeight.owning`)."""

    name: str
    pack: Callable[[torch.Tensor], torch.Tensor]
    multiply: Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor | None], torch.Tensor]
    unpack: Callable[[torch.Tensor, int], torch.Tensor] | None = None
    pack_into: Callable[[torch.Tensor, torch.Tensor], None] | None = None
    rows: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # an embedding's lookup


PANELS = Kernel(
    "panels", panel_gemm.pack, panel_gemm.multiply, panel_gemm.unpack, panel_gemm.pack_into, panel_gemm.rows
)
ONEDNN = Kernel("oneDNN", onednn_linear.pack, onednn_linear.multiply)


def kernel_for(weight: torch.Tensor) -> Kernel | None:
    """The kernel that packs `weight` here, or None: `F.linear` only. The panels run on one thread, so they
    are the choice where torch runs on one (`--cpu-threads 1`, or a container of 1-2 CPUs); with more,
    oneDNN, which is threaded as sgemm is."""
    if weight.device.type != "cpu":
        return None
    if weight.dtype == torch.float32 and torch.get_num_threads() == 1 and panel_gemm.available():
        return PANELS
    return ONEDNN if onednn_linear.packable(weight) else None


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A weight laid out for a kernel, the kernel that multiplies by it, and the row counts it is used at:
    a copy beside the weight, used where it was timed faster, or (`owns`) the weight itself, used at every
    row count."""

    packed: torch.Tensor
    out_features: int
    kernel: Kernel
    fast_rows: tuple[bool, ...]  # by a step's row count: whether the packed copy takes it
    owns: bool = False  # the layout replaced the weight: every row count goes through it

    @classmethod
    def of(cls, weight: torch.Tensor, kernel: Kernel, fast_rows: tuple[bool, ...] = ()) -> PackedWeight:
        return cls(kernel.pack(weight), weight.shape[0], kernel, fast_rows)

    @classmethod
    def owning(cls, weight: torch.Tensor) -> PackedWeight:
        """The weight laid out in panels, to replace it (the caller drops the original)."""
        return cls(PANELS.pack(weight), weight.shape[0], PANELS, (), owns=True)

    def takes(self, x: torch.Tensor) -> bool:
        if self.owns:
            return True
        n = x.shape[0]
        return n < len(self.fast_rows) and self.fast_rows[n]

    def dense(self) -> torch.Tensor:
        """The weight's values, [out, in] (a new tensor), where it is owned."""
        assert self.owns and self.kernel.unpack is not None
        return self.kernel.unpack(self.packed, self.out_features)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` of the owned weight: the lookup of an embedding table it holds (a tied LM head)."""
        assert self.owns and self.kernel.rows is not None
        return self.kernel.rows(self.packed, index)

    def write(self, values: torch.Tensor) -> None:
        """New values for the owned weight, laid out in place."""
        assert self.owns and self.kernel.pack_into is not None
        if tuple(values.shape) != (self.out_features, self.packed.shape[1]):
            raise ValueError(
                f"a weight of {tuple(values.shape)} written where one of {self.out_features} rows is"
            )
        self.kernel.pack_into(self.packed, values.to(self.packed.dtype))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`F.linear(x, weight, bias)` through the packed copy; x is [rows, in]."""
        return self.kernel.multiply(x, self.packed, self.out_features, bias)

    def repacked(self, weight: torch.Tensor) -> PackedWeight:
        """The same kernel and row counts for `weight`'s new values (a weight update changes them in place)."""
        return PackedWeight.of(weight, self.kernel, self.fast_rows)


def fast_rows(weights: Sequence[torch.Tensor], kernel: Kernel) -> tuple[bool, ...]:
    """By row count up to CALIBRATED_ROWS' last: whether `weights` (a few layers', say), all multiplied
    through `kernel`'s packed copies, took at most 1/MIN_GAIN of `F.linear`'s time at the largest calibrated
    count at or below it; each way timed best of three."""
    packed = [PackedWeight.of(w, kernel) for w in weights]
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
