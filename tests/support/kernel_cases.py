"""Shared by tests/kernels (CPU interpreter) and tests/gpu (native CUDA): tolerances and inputs.

Tolerances per dtype (|actual - expected| <= atol + rtol * |expected|, torch.testing semantics):

| op                         | float32         | float16         | bfloat16          |
|----------------------------|-----------------|-----------------|-------------------|
| write_kv                   | exact           | exact           | exact             |
| rms_norm, rotary, silu_mul | 1e-5 / 1e-5     | 1e-3 / 1e-3     | 1.6e-2 / 1.6e-2   |
| paged_attention            | 2e-5 / 2e-5     | 4e-3 / 4e-3     | 3e-2 / 3e-2       |

Elementwise ops may differ from the reference by one rounding of the output dtype (fp16 ulp ~1e-3, bf16
ulp ~8e-3 relative; the interpreter's bf16 rounding is not always round-to-nearest-even); attention
accumulates in fp32 in a different order from the reference (online softmax, probabilities rounded to the
input dtype before P @ V, as in flash attention), about 2 ulps of the output dtype.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from kvpilot.kernels import AttentionMetadata

ELEMENTWISE_TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
ATTENTION_TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class AttentionCase:
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float
    slot_mapping: torch.Tensor  # slots of each query token (where its own K/V were written)


def build_attention_case(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
) -> AttentionCase:
    """A packed batch: sequence i has seq_lens[i] tokens of context, the last q_lens[i] of them queries.

    Every sequence gets its blocks from a shuffled pool (non-contiguous, out of order), the pool has spare
    blocks nobody owns (filled with garbage that must never be read), and table rows are padded with 0.
    """
    assert all(1 <= q <= s for q, s in zip(q_lens, seq_lens))
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(need) + spare_blocks
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, i = [], 0
    for n in need:
        tables.append(ids[i : i + n])
        i += n
    heads = num_kv_heads * group
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn((sum(q_lens), heads, head_dim), generator=gen).to(dtype)
    slots = []
    for q, s, t in zip(q_lens, seq_lens, tables):
        slots.extend(t[p // block_size] * block_size + p % block_size for p in range(s - q, s))
    device = torch.device(device)
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, device)
    return AttentionCase(
        query=query.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        meta=meta,
        scale=head_dim**-0.5,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
    )


# The edges every attention test batch covers, as (q_len, seq_len) with block size 16:
#  (1, 1)   one token, nothing cached            (1, 37)  decode, length not a multiple of the block
#  (1, 32)  decode right at a block boundary     (5, 21)  prefill chunk whose prefix ends on a boundary
#  (19, 19) fresh prefill, not a block multiple  (7, 40)  chunk starting mid-block over cached blocks
MIXED_BATCH = ([1, 1, 1, 5, 19, 7], [1, 37, 32, 21, 19, 40])


def random_batch(rng: random.Random, max_seqs: int, max_len: int) -> tuple[list[int], list[int]]:
    n = rng.randint(1, max_seqs)
    seq_lens = [rng.randint(1, max_len) for _ in range(n)]
    q_lens = [rng.choice([1, 1, rng.randint(1, s)]) if s > 1 else 1 for s in seq_lens]
    return q_lens, seq_lens


def random_attention_case(
    seed: int,
    *,
    heads: list[tuple[int, int]],
    max_seqs: int,
    max_len: int,
    block_sizes: list[int],
    device: str | torch.device = "cpu",
) -> tuple[AttentionCase, torch.dtype]:
    """A random_batch of up to `max_seqs` sequences of up to `max_len` tokens, in DTYPES[seed % 3], with
    (num_kv_heads, group) drawn from `heads`, head_dim 64 or 128 and a block size from `block_sizes`."""
    rng = random.Random(seed)
    q_lens, seq_lens = random_batch(rng, max_seqs=max_seqs, max_len=max_len)
    num_kv_heads, group = rng.choice(heads)
    dtype = DTYPES[seed % 3]
    case = build_attention_case(
        q_lens,
        seq_lens,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=rng.choice([64, 128]),
        block_size=rng.choice(block_sizes),
        dtype=dtype,
        device=device,
        seed=seed,
    )
    return case, dtype


def sharpen_checkpoint(src, dst, qk: float = 6.0, vo: float = 12.0, mlp: float = 8.0):
    """Copy a random-weight Llama checkpoint with its layers' weights scaled up.

    At the default init (std 0.02) a tiny Llama with tied embeddings is dominated by its embeddings and
    greedily repeats its last input token whatever attention computes, so an end-to-end comparison would
    not notice a broken kernel. Scaled like this, attention is peaked and the layers decide the tokens:
    scaling the attention scores by 1.05 changes the greedy tokens, by 1.0001 it does not.
    """
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn
            for w, f in ((a.q_proj, qk), (a.k_proj, qk), (a.v_proj, vo), (a.o_proj, vo)):
                w.weight.mul_(f)
            for w in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                w.weight.mul_(mlp)
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


LORA_TOL = {  # two matmuls, each rounded to the dtype as the torch reference rounds them
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


def lora_case(
    tokens: int, k: int, n: int, rank: int, rows: str, dtype: torch.dtype, device: str = "cpu", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(y, x, a, b, rows) of one adapter's product over a step of `tokens` rows: `rows` "all" (None), "some"
    (every third row, in order), "shuffled" (the same, out of order) or "none" (no row)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(tokens, n, generator=g)
    x = torch.randn(tokens, k, generator=g)
    a = torch.randn(rank, k, generator=g) / k**0.5
    b = torch.randn(n, rank, generator=g) / rank**0.5
    picked = {
        "all": None,
        "some": torch.arange(0, tokens, 3),
        "shuffled": torch.arange(0, tokens, 3)[torch.randperm(len(range(0, tokens, 3)), generator=g)],
        "none": torch.empty(0, dtype=torch.int64),
    }[rows]
    out = [t.to(device=device, dtype=dtype) for t in (y, x, a, b)]
    return (*out, None if picked is None else picked.to(device))
