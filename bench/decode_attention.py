"""The attention of a decode step, alone, on the CPU: the torch reference (kernels/reference.py) against the
project's C kernel (kernels/cpu_attention.py), at the batch sizes a step gives them.

The shapes are the embedded model's (9 query heads, 3 KV heads of 64, blocks of 16 tokens), `--layers`
layers of paged caches (30 by default), random; each of a batch's sequences has `--context` tokens, the
first `--shared` of them the same blocks for all (a system prompt the batch shares, as in
bench/vs_vllm.py's chat load). One pass attends one query row a sequence in every layer, as a decode step
does, over one step's metadata (the reference's plan built once a pass, by the first layer, as in the
engine). Each way's time is its best of `--repeats` passes, taking turns; the figures are ms a pass and
the kernel's speed-up. Both outputs are checked against each other first (the run stops if one is off).

    .venv/bin/python bench/decode_attention.py                                  # batches 1, 8, 32
    .venv/bin/python bench/decode_attention.py --batches 8 --layers 2 --repeats 2   # a quick look

JSON to bench/results/decode-attention-<UTC time>.json (--out to choose); 1 torch thread unless --threads.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit

import benchkit
from kvpilot.kernels import cpu_attention, reference
from kvpilot.kernels.metadata import AttentionMetadata

RESULTS = Path(__file__).parent / "results"
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M's attention; the engine's block size


def _step(batch: int, context: int, shared: int, gen: torch.Generator) -> tuple[AttentionMetadata, int]:
    """One decode step's metadata (blocks numbered from 0: a shared prefix's, then each sequence's own)
    and how many blocks the pool needs."""
    shared_blocks = shared // BLOCK
    own = (context + BLOCK - 1) // BLOCK - shared_blocks
    tables, next_block = [], shared_blocks
    for _ in range(batch):
        tables.append(list(range(shared_blocks)) + list(range(next_block, next_block + own)))
        next_block += own
    order = torch.randperm(next_block, generator=gen).tolist()  # blocks scattered over the pool
    tables = [[order[b] for b in t] for t in tables]
    return AttentionMetadata.build([1] * batch, [context] * batch, tables, torch.device("cpu")), next_block


def _pass(
    op: Callable[..., torch.Tensor],
    queries: list[torch.Tensor],
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    meta: AttentionMetadata,
) -> Callable[[], list[torch.Tensor]]:
    """One decode step's attention in every layer through `op`."""

    def run() -> list[torch.Tensor]:
        meta.reference_plan = None  # built once a pass, by the first layer, as in a step
        return [op(q, k, v, meta, HEAD_DIM**-0.5) for q, (k, v) in zip(queries, caches)]

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=345, help="tokens of each sequence (the query's included)")
    ap.add_argument("--shared", type=int, default=320, help="of them, a prefix all sequences share")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not cpu_attention.available():
        sys.exit("the C attention kernel does not run here (no x86-64 with AVX2 and FMA, or no C compiler)")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    gen = torch.Generator().manual_seed(0)
    batches: dict[str, dict] = {}
    for batch in args.batches:
        meta, blocks = _step(batch, args.context, min(args.shared, args.context - 1), gen)
        caches = [
            (
                torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen),
                torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen),
            )
            for _ in range(args.layers)
        ]
        queries = [torch.randn(batch, HEADS, HEAD_DIM, generator=gen) for _ in range(args.layers)]

        passes = {
            name: _pass(op, queries, caches, meta)
            for name, op in (
                ("reference", reference.paged_attention),
                ("kernel", cpu_attention.paged_attention),
            )
        }
        for got, want in zip(passes["kernel"](), passes["reference"]()):
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                sys.exit(f"the kernel's attention at batch {batch} is not the reference's")
        best = benchkit.best_times(passes, args.repeats)
        row: dict = {name: {"ms": t * 1e3} for name, t in best.items()}
        row["speedup"] = best["reference"] / best["kernel"]
        batches[str(batch)] = row
        print(
            f"batch {batch:3d}: reference {best['reference'] * 1e3:6.2f} ms, kernel {best['kernel'] * 1e3:6.2f} ms"
            f" a step of {args.layers} layers ({row['speedup']:.2f}x)",
            flush=True,
        )
    doc = {
        **benchkit.header("decode-attention", load_before),
        "threads": args.threads,
        "layers": args.layers,
        "context": args.context,
        "shared": args.shared,
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block": BLOCK},
        "batches": batches,
        "commit": benchkit.git_head(),
    }
    benchkit.write(args.out or benchkit.default_path(RESULTS, "decode-attention"), doc)


if __name__ == "__main__":
    main()
