"""The C paged attention (kernels/cpu_attention.py) against the torch reference it stands in for: decode
rows and several rows a sequence, shared prefixes, block sizes, grouped heads and head sizes, strided
queries; the steps it leaves to the reference; metadata that would read outside the pool refused. The
engine's greedy tokens through it are tested in tests/engine/test_cpu_ops.py."""

from __future__ import annotations

import random

import pytest
import torch

from kvpilot.kernels import cpu_attention, reference
from kvpilot.kernels.metadata import AttentionMetadata
from kvpilot.kernels.ops import select_ops

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no AVX2/FMA or no C compiler here")

CPU = torch.device("cpu")


def _step(
    rows: list[int],
    lens: list[int],
    block: int = 16,
    heads: int = 9,
    kv_heads: int = 3,
    dim: int = 64,
    shared_blocks: int = 0,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A query (a strided view of a fused projection, as the model passes it), caches of random values and
    the step's metadata: each sequence's blocks drawn at random from the pool, its first `shared_blocks`
    the same for all."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = sum((n + block - 1) // block for n in lens) + shared_blocks
    pool = list(range(need + 5))
    rng.shuffle(pool)
    shared = [pool.pop() for _ in range(shared_blocks)]
    tables = []
    for n in lens:
        count = (n + block - 1) // block
        own = shared[:count]
        tables.append(own + [pool.pop() for _ in range(count - len(own))])
    k_cache = torch.randn(need + 5, block, kv_heads, dim, generator=gen)
    v_cache = torch.randn(need + 5, block, kv_heads, dim, generator=gen)
    tokens = sum(rows)
    fused = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    query = fused[:, : heads * dim].view(tokens, heads, dim)
    return query, k_cache, v_cache, AttentionMetadata.build(rows, lens, tables, CPU)


CASES = {
    "decode, 8 sequences sharing a prefix": dict(
        rows=[1] * 8, lens=[345, 344, 345, 400, 337, 336, 350, 345], shared_blocks=21
    ),
    "one token of context": dict(rows=[1], lens=[1]),
    "contexts at and around block edges": dict(rows=[1] * 5, lens=[15, 16, 17, 63, 64]),
    "longer than one tile": dict(rows=[1, 1], lens=[1000, 129]),
    "block size 7": dict(rows=[1] * 3, lens=[50, 7, 8], block=7),
    "no grouped heads": dict(rows=[1] * 2, lens=[40, 90], heads=4, kv_heads=4),
    "4 heads a group, head size 128": dict(rows=[1] * 2, lens=[70, 33], heads=8, kv_heads=2, dim=128),
    "head size 72 (not a multiple of 64)": dict(rows=[1] * 3, lens=[30, 65, 9], heads=2, kv_heads=1, dim=72),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_it_attends_as_the_reference_does(case: dict) -> None:
    query, k_cache, v_cache, meta = _step(**case)
    got = cpu_attention.paged_attention(query, k_cache, v_cache, meta, 0.125)
    meta.reference_plan = None
    want = reference.paged_attention(query, k_cache, v_cache, meta, 0.125)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


def test_several_rows_of_a_sequence_each_see_their_own_causal_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The C code serves any row count (the engine sends it decode steps only): row r of a chunk of q rows
    sees the sequence's first len - q + r + 1 keys."""
    monkeypatch.setattr(cpu_attention, "MAX_QUERY_ROWS", 64)
    query, k_cache, v_cache, meta = _step(rows=[3, 1, 20], lens=[40, 17, 20], shared_blocks=1)
    got = cpu_attention.paged_attention(query, k_cache, v_cache, meta, 0.3)
    want = reference.paged_attention(query, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


def test_what_it_does_not_fit_goes_to_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill chunk, and a cache in bfloat16: the reference's own result, not the kernel's."""
    calls = []
    attend = reference.paged_attention

    def counted(*args: object) -> torch.Tensor:
        calls.append(args)
        return attend(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(reference, "paged_attention", counted)
    query, k_cache, v_cache, meta = _step(rows=[5, 1], lens=[5, 30])
    cpu_attention.paged_attention(query, k_cache, v_cache, meta, 0.125)
    query, k_cache, v_cache, meta = _step(rows=[1, 1], lens=[9, 30])
    cpu_attention.paged_attention(query.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), meta, 0.125)
    assert len(calls) == 2
    cpu_attention.paged_attention(query, k_cache, v_cache, meta, 0.125)
    assert len(calls) == 2  # a float32 decode step: the kernel's


def test_metadata_that_would_read_outside_the_pool_is_refused() -> None:
    query, k_cache, v_cache, meta = _step(rows=[1, 1], lens=[20, 30])
    meta.block_tables[1, 1] = k_cache.shape[0]  # one past the pool
    with pytest.raises(ValueError, match="block id outside the pool"):
        cpu_attention.paged_attention(query, k_cache, v_cache, meta, 0.125)
    meta.block_tables[1, 1] = -1
    with pytest.raises(ValueError, match="block id outside the pool"):
        cpu_attention.paged_attention(query, k_cache, v_cache, meta, 0.125)
    query, k_cache, v_cache, meta = _step(rows=[1, 1], lens=[20, 30])
    meta.seq_lens[0] = 16 * meta.block_tables.shape[1] + 1  # past its table
    with pytest.raises(ValueError, match="sequence bounds"):
        cpu_attention.paged_attention(query, k_cache, v_cache, meta, 0.125)
    query, k_cache, v_cache, meta = _step(rows=[1, 1], lens=[20, 30])
    meta.query_start_loc[2] = 3  # more rows than the query has
    with pytest.raises(ValueError, match="sequence bounds"):
        cpu_attention.paged_attention(query, k_cache, v_cache, meta, 0.125)
    query, k_cache, v_cache, meta = _step(rows=[1, 1], lens=[20, 30])
    meta.seq_lens = meta.seq_lens.long()  # not the int32 the C code reads
    with pytest.raises(ValueError, match="does not fit"):
        cpu_attention.paged_attention(query, k_cache, v_cache, meta, 0.125)


def test_the_cpu_op_set_is_chosen_where_torch_runs_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPILOT_KERNELS", raising=False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert select_ops("cpu").name == "cpu"
        assert select_ops("cpu").paged_attention is cpu_attention.paged_attention
        assert select_ops("cpu", "torch").name == "torch"
        torch.set_num_threads(2)
        # the kernel is single-threaded; the reference's matmuls are not
        assert select_ops("cpu").name == "torch"
        assert select_ops("cpu", "cpu").name == "cpu"
    finally:
        torch.set_num_threads(threads)


def test_slots_outside_every_context_are_never_read_and_a_nan_inside_one_reaches_its_row() -> None:
    lens = [20, 30]
    query, k_cache, v_cache, meta = _step(rows=[1, 1], lens=lens)
    inside = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for table, n in zip(meta.block_tables_list, lens):
        for pos in range(n):
            inside[table[pos // 16], pos % 16] = True
    k_cache[~inside], v_cache[~inside] = float("nan"), float("nan")
    got = cpu_attention.paged_attention(query, k_cache, v_cache, meta, 0.125)
    assert got.isfinite().all()
    torch.testing.assert_close(got, reference.paged_attention(query, k_cache, v_cache, meta, 0.125))
    # a key of the second sequence's own made NaN: its row is NaN, as the reference's; the first's is not
    last = meta.block_tables_list[1][29 // 16]
    k_cache[last, 29 % 16] = float("nan")
    meta.reference_plan = None
    got = cpu_attention.paged_attention(query, k_cache, v_cache, meta, 0.125)
    assert got[1].isnan().all() and got[0].isfinite().all()
    torch.testing.assert_close(
        got, reference.paged_attention(query, k_cache, v_cache, meta, 0.125), equal_nan=True
    )
