"""The linear layers of a decode step, alone, through each CPU kernel: `F.linear` (MKL's sgemm) against the
packed kernels of kernels/packed_linear.py (the project's panels, kernels/panel_gemm.py, and oneDNN's
reordered weight), at the row counts a step gives them.

The weights are the embedded model's shapes (q/k/v, o, gate/up, down; hidden 576, MLP 1536), `--layers`
layers of them (30 by default, ~425 MB in float32: more than the caches, so every pass streams them from
memory as a real step does), random; one pass multiplies `rows` random rows by every weight once. Each
kernel's time is its best of `--repeats` passes, the kernels taking turns; the figures are ms a pass, the
weights' bytes over it (GB/s), and each packed kernel's speed-up over `F.linear`. Every kernel's product is
checked against `F.linear`'s first (the run stops if one is off).

    .venv/bin/python bench/decode_matmul.py                                   # 1, 2, 4, 8, 16, 32, 64 rows
    .venv/bin/python bench/decode_matmul.py --rows 1 8 --layers 4 --repeats 2   # a quick look

JSON to bench/results/decode-matmul-<UTC time>.json (--out to choose); 1 torch thread unless --threads.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit

import benchkit
from kvpilot.kernels import onednn_linear, panel_gemm
from kvpilot.kernels.packed_linear import ONEDNN, PANELS, Kernel

RESULTS = Path(__file__).parent / "results"
HIDDEN, MLP, HEADS_OUT = 576, 1536, 960  # SmolLM2-135M: q 576 + k 192 + v 192 out of the hidden size
SHAPES = ((HEADS_OUT, HIDDEN), (HIDDEN, HIDDEN), (2 * MLP, HIDDEN), (HIDDEN, MLP))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    has = ((PANELS, panel_gemm.available()), (ONEDNN, onednn_linear.packable(torch.zeros(8, 8))))
    kernels: list[Kernel] = [k for k, here in has if here]
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=gen) * 0.02 for _ in range(args.layers) for shape in SHAPES]
    packed = {k.name: [k.pack(w) for w in weights] for k in kernels}
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    rows_out: dict[str, dict] = {}
    for n in args.rows:
        inputs = [torch.randn(n, w.shape[1], generator=gen) for w in weights]

        def dense(inputs: list[torch.Tensor] = inputs) -> list[torch.Tensor]:
            return [F.linear(x, w) for x, w in zip(inputs, weights)]

        passes: dict[str, Callable[[], list[torch.Tensor]]] = {"F.linear": dense}
        for k in kernels:

            def run(k: Kernel = k, inputs: list[torch.Tensor] = inputs) -> list[torch.Tensor]:
                return [
                    k.multiply(x, p, w.shape[0], None) for x, p, w in zip(inputs, packed[k.name], weights)
                ]

            passes[k.name] = run
        want = dense()
        for name, run in passes.items():
            for got, ref in zip(run(), want):
                if not torch.allclose(got, ref, rtol=1e-4, atol=1e-4):
                    sys.exit(f"{name} at {n} rows is not F.linear's product")
        best = benchkit.best_times(passes, args.repeats)
        row: dict = {name: {"ms": t * 1e3, "gb_per_s": nbytes / t / 1e9} for name, t in best.items()}
        for k in kernels:
            row[f"{k.name}_speedup"] = best["F.linear"] / best[k.name]
        rows_out[str(n)] = row
        print(
            f"{n:4d} rows: "
            + "  ".join(
                f"{name} {t * 1e3:7.1f} ms ({nbytes / t / 1e9:4.1f} GB/s)" for name, t in best.items()
            )
            + "".join(f"  {k.name} {row[f'{k.name}_speedup']:.2f}x" for k in kernels),
            flush=True,
        )
    doc = {
        **benchkit.header("decode-matmul", load_before),
        "threads": args.threads,
        "layers": args.layers,
        "weight_bytes": nbytes,
        "kernels": [k.name for k in kernels],
        "rows": rows_out,
        "commit": benchkit.git_head(),
    }
    benchkit.write(args.out or benchkit.default_path(RESULTS, "decode-matmul"), doc)


if __name__ == "__main__":
    main()
