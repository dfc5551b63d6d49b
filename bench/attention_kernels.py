"""GPU benchmark of the triton paged attention kernel against torch SDPA on gathered K/V.

Decode: achieved memory bandwidth (bytes of K/V, queries and outputs moved / time) for batch 1-256 and
context 512-32k, next to the GPU's measured copy bandwidth and, where known, its datasheet HBM bandwidth.
Prefill: causal attention throughput (TFLOP/s) for full-prompt chunks. Baseline: torch
`scaled_dot_product_attention` on K/V already gathered into contiguous [B, Hkv, L, D] tensors (the gather
itself is not timed, which flatters the baseline). bf16 by default. Writes JSON under bench/results/.

    python bench/attention_kernels.py [--quick] [--heads 32 --kv-heads 8 --head-dim 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit, devcluster

import benchkit

# Datasheet HBM bandwidth (GB/s), matched by substring of the device name; the measured copy bandwidth
# is reported too, since it is what a kernel can actually reach.
DATASHEET_GBPS = {
    "H200": 4800,
    "H100 SXM": 3350,
    "H100 80GB HBM3": 3350,
    "H100 PCIe": 2000,
    "H100 NVL": 3900,
    "A100-SXM4-80GB": 2039,
    "A100 80GB PCIe": 1935,
    "A100-SXM4-40GB": 1555,
    "A100-PCIE-40GB": 1555,
    "L40S": 864,
    "A10G": 600,
    "L4": 300,
}


def _datasheet(name: str) -> float | None:
    for key, gbps in DATASHEET_GBPS.items():
        if key in name:
            return float(gbps)
    return None


def _bench(fn) -> float:
    """Median milliseconds of fn()."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _bench_or_none(fn) -> float | None:
    """The baseline may not fit (SDPA's math fallback expands grouped K/V); then it is left out."""
    try:
        return _bench(fn)
    except torch.OutOfMemoryError as e:
        print(f"  sdpa baseline skipped: {str(e).splitlines()[0]}")
        torch.cuda.empty_cache()
        return None


def _copy_bandwidth_gbps() -> float:
    n = 1 << 29  # 512 Mi bf16 elements: 1 GiB read and 1 GiB written per copy
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    ms = _bench(lambda: b.copy_(a))
    return 2 * n * 2 / (ms * 1e-3) / 1e9


def _case(batch: int, q_len: int, ctx: int, heads: int, kv_heads: int, head_dim: int, block: int, dtype):
    from kvpilot.kernels import AttentionMetadata

    blocks_per_seq = (ctx + block - 1) // block
    num_blocks = batch * blocks_per_seq
    perm = torch.randperm(num_blocks).tolist()  # scattered blocks, as in a long-running server
    tables = [perm[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(batch)]
    k_cache = torch.randn(num_blocks, block, kv_heads, head_dim, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    query = torch.randn(batch * q_len, heads, head_dim, device="cuda", dtype=dtype)
    meta = AttentionMetadata.build([q_len] * batch, [ctx] * batch, tables, torch.device("cuda"))
    return query, k_cache, v_cache, meta, tables


def _gathered(cache: torch.Tensor, tables: list[list[int]], ctx: int) -> torch.Tensor:
    idx = torch.tensor(tables, device="cuda")
    g = cache[idx]  # [B, nb, block, Hkv, D]
    b = g.shape[0]
    # [B, Hkv, L, D] as a view (last dim contiguous, which SDPA's fused kernels accept): no second copy.
    return g.reshape(b, -1, *cache.shape[2:])[:, :ctx].transpose(1, 2)


def bench_decode(args, batch: int, ctx: int) -> dict:
    from kvpilot.kernels import triton_attention as ta

    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    q, kc, vc, meta, tables = _case(batch, 1, ctx, h, hkv, d, args.block_size, torch.bfloat16)
    scale = d**-0.5
    splits = ta.choose_num_splits(batch, hkv, 1, ctx, ta._num_sms(q.device))
    t_ms = _bench(lambda: ta.paged_attention(q, kc, vc, meta, scale))
    kv_bytes = 2 * batch * ctx * hkv * d * 2
    io_bytes = kv_bytes + 2 * q.numel() * 2
    row = {
        "kind": "decode",
        "batch": batch,
        "context": ctx,
        "num_splits": splits,
        "triton_ms": t_ms,
        "triton_gbps": io_bytes / (t_ms * 1e-3) / 1e9,
    }
    kg, vg = _gathered(kc, tables, ctx), _gathered(vc, tables, ctx)
    qs = q.view(batch, h, 1, d)
    s_ms = _bench_or_none(
        lambda: F.scaled_dot_product_attention(qs, kg, vg, scale=scale, enable_gqa=h != hkv)
    )
    if s_ms is not None:
        row.update(sdpa_ms=s_ms, sdpa_gbps=io_bytes / (s_ms * 1e-3) / 1e9, speedup_vs_sdpa=s_ms / t_ms)
    return row


def bench_prefill(args, batch: int, ctx: int) -> dict:
    from kvpilot.kernels import triton_attention as ta

    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    q, kc, vc, meta, tables = _case(batch, ctx, ctx, h, hkv, d, args.block_size, torch.bfloat16)
    scale = d**-0.5
    flops = 4 * batch * h * d * ctx * ctx / 2  # causal: half of QK^T and PV
    t_ms = _bench(lambda: ta.paged_attention(q, kc, vc, meta, scale))
    row = dict(
        kind="prefill", batch=batch, context=ctx, triton_ms=t_ms, triton_tflops=flops / (t_ms * 1e-3) / 1e12
    )
    kg, vg = _gathered(kc, tables, ctx), _gathered(vc, tables, ctx)
    qs = q.view(batch, ctx, h, d).transpose(1, 2)
    s_ms = _bench_or_none(
        lambda: F.scaled_dot_product_attention(qs, kg, vg, is_causal=True, scale=scale, enable_gqa=h != hkv)
    )
    if s_ms is not None:
        row.update(sdpa_ms=s_ms, sdpa_tflops=flops / (s_ms * 1e-3) / 1e12, speedup_vs_sdpa=s_ms / t_ms)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="a few points only")
    p.add_argument(
        "--max-kv-gib", type=float, default=None, help="skip points whose K/V (paged + gathered) exceed this"
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    if not torch.cuda.is_available():
        print(
            "bench/attention_kernels.py needs a CUDA GPU (the triton kernels run natively only there); none found."
        )
        return 2
    torch.manual_seed(0)
    name = torch.cuda.get_device_name()
    copy_gbps = _copy_bandwidth_gbps()
    torch.cuda.empty_cache()
    datasheet = _datasheet(name)
    if args.max_kv_gib is None:
        args.max_kv_gib = 0.6 * torch.cuda.mem_get_info()[0] / 2**30
    print(f"{name}: measured copy bandwidth {copy_gbps:.0f} GB/s, datasheet {datasheet or 'unknown'} GB/s")

    batches = [1, 16, 256] if args.quick else [1, 4, 16, 64, 256]
    contexts = [512, 8192, 32768] if args.quick else [512, 2048, 8192, 32768]
    kv_per_token = 2 * args.kv_heads * args.head_dim * 2
    rows = []
    for ctx in contexts:
        for batch in batches:
            gib = 2 * batch * ctx * kv_per_token / 2**30  # paged cache + the gathered copy
            if gib > args.max_kv_gib:
                print(f"decode  B={batch:4d} ctx={ctx:6d}: skipped ({gib:.0f} GiB > --max-kv-gib)")
                continue
            r = bench_decode(args, batch, ctx)
            torch.cuda.empty_cache()
            r["pct_of_copy_bw"] = 100 * r["triton_gbps"] / copy_gbps
            if datasheet:
                r["pct_of_datasheet_bw"] = 100 * r["triton_gbps"] / datasheet
            rows.append(r)
            print(
                f"decode  B={batch:4d} ctx={ctx:6d} splits={r['num_splits']:2d}: triton {r['triton_ms']:.3f} ms "
                f"{r['triton_gbps']:.0f} GB/s ({r['pct_of_copy_bw']:.0f}% of copy) | sdpa {r.get('sdpa_ms', 0):.3f} ms "
                f"{r.get('sdpa_gbps', 0):.0f} GB/s | x{r.get('speedup_vs_sdpa', 0):.2f}"
            )
    prefill_tokens = 32768 if args.quick else 65536
    for ctx in contexts:
        for batch in batches:
            if batch * ctx > prefill_tokens:
                continue
            r = bench_prefill(args, batch, ctx)
            torch.cuda.empty_cache()
            rows.append(r)
            print(
                f"prefill B={batch:4d} ctx={ctx:6d}: triton {r['triton_ms']:.3f} ms {r['triton_tflops']:.1f} TFLOP/s"
                f" | sdpa {r.get('sdpa_ms', 0):.3f} ms {r.get('sdpa_tflops', 0):.1f} TFLOP/s"
                f" | x{r.get('speedup_vs_sdpa', 0):.2f}"
            )

    import triton

    result = dict(
        benchmark="kernels",
        time=datetime.now(UTC).isoformat(timespec="seconds"),
        device=name,
        torch=torch.__version__,
        triton=triton.__version__,
        dtype="bfloat16",
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        block_size=args.block_size,
        copy_bandwidth_gbps=copy_gbps,
        datasheet_bandwidth_gbps=datasheet,
        baseline="torch scaled_dot_product_attention on pre-gathered contiguous K/V (gather not timed)",
        rows=rows,
    )
    benchkit.write(args.out or benchkit.default_path(Path(__file__).parent / "results", "kernels"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
