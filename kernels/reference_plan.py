"""The torch reference attention's per-step plan: every index and mask of a packed batch, computed once
per step by the first layer and reused by all the others (they differ only in their cache).

Sequences whose block tables start with the same blocks (a shared system prompt served from the prefix
cache) form a group: their queries attend to those blocks together, so each layer reads the shared keys
once for the whole group instead of copying them out once per sequence. After its group's prefix, each
sequence attends to its own tail: the decode rows of a group (one query each) as one batch, with tails
padded to the longest; the group's short chunks as another batch, queries padded too; a long chunk on
its own. Masks are additive biases (causal, padding). Padding repeats a sequence's own first tail slot,
so no read ever leaves that sequence's context. A chunk in no group attends to its own context only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpilot.kernels.metadata import AttentionMetadata

# Chunks of a group up to this many queries run as one batch (a prefix hit leaves each request a short
# suffix to prefill; a burst of them would otherwise be one small attention call each).
_BATCHED_CHUNK = 64


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """Leading blocks shared by a group of sequences; all of the group's queries see all of them."""

    slots: torch.Tensor | None  # [P] cache slots, or None when `span` covers them
    span: tuple[int, int] | None  # the slot range when the blocks are consecutive in the pool (a view)
    length: int


@dataclass(frozen=True, slots=True)
class Unit:
    """Query rows attending to [their group's prefix] + their tails, in one softmax.

    A batch (`num_seqs` > 0) holds several sequences, each with its own tail: the decode rows of a
    group, or its short chunks with their queries padded to the longest (padding repeats a sequence's
    last query; `real_rows` picks the real ones). `tail_slots` is then [num_seqs * L], row-major.
    Otherwise the unit is one chunk whose queries share one tail, `tail_slots` [L]."""

    rows: slice | torch.Tensor  # the unit's query rows, sequence by sequence
    real_rows: tuple[torch.Tensor, torch.Tensor] | None  # (rows in the batch, their places in the unit)
    prefix: int | None  # index into AttentionPlan.prefixes
    tail_slots: torch.Tensor
    tail_len: int  # L
    num_seqs: int
    bias: torch.Tensor  # [rows, P + L] float32: 0 where a key is visible, -inf where not


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    prefixes: list[SharedPrefix]
    units: list[Unit]
    covers_all_rows: bool  # a single unit whose rows are the whole batch in order


def plan_attention(meta: AttentionMetadata, block_size: int, device: torch.device) -> AttentionPlan:
    """The plan for this step's batch, built on the first call and kept on `meta` for the next layers."""
    key = (block_size, device)
    if meta.reference_plan is not None and meta.reference_plan[0] == key:
        return meta.reference_plan[1]
    plan = _build(meta, block_size, device)
    meta.reference_plan = (key, plan)
    return plan


def _build(meta: AttentionMetadata, block_size: int, device: torch.device) -> AttentionPlan:
    starts, seq_lens = meta.query_start_loc_list, meta.seq_lens_list
    group_of, prefixes = _shared_prefixes(starts, seq_lens, meta.block_tables_list, block_size, device)
    table = meta.block_tables.to("cpu", torch.int64)
    units = []
    batches: dict[tuple[int | None, bool], list[int]] = {}  # (group, decode) -> sequences
    for i in range(len(seq_lens)):
        q_len = starts[i + 1] - starts[i]
        g = group_of[i]
        if q_len == 1 or (g is not None and q_len <= _BATCHED_CHUNK):
            batches.setdefault((g, q_len == 1), []).append(i)
            continue
        prefix_len = 0 if g is None else prefixes[g].length
        pos = torch.arange(prefix_len, seq_lens[i])
        qpos = torch.arange(seq_lens[i] - q_len, seq_lens[i])
        units.append(
            Unit(
                rows=slice(starts[i], starts[i + 1]),
                real_rows=None,
                prefix=g,
                tail_slots=(table[i, pos // block_size] * block_size + pos % block_size).to(device),
                tail_len=len(pos),
                num_seqs=0,
                bias=_bias(pos[None, :] <= qpos[:, None], prefix_len).to(device),
            )
        )
    for (g, _), ids in batches.items():
        units.append(
            _batch(
                ids, g, 0 if g is None else prefixes[g].length, starts, seq_lens, table, block_size, device
            )
        )
    whole = slice(0, starts[-1])
    covers_all = len(units) == 1 and isinstance(units[0].rows, slice) and units[0].rows == whole
    return AttentionPlan(prefixes, units, covers_all)


def _batch(
    ids: list[int],
    group: int | None,
    prefix_len: int,
    starts: list[int],
    seq_lens: list[int],
    table: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> Unit:
    """Sequences `ids`, each attending to its tail (positions prefix_len.. of its context)."""
    q_lens = torch.tensor([starts[i + 1] - starts[i] for i in ids])
    lens = torch.tensor([seq_lens[i] for i in ids])
    width = int((lens - prefix_len).max())
    offsets = torch.arange(width)
    in_tail = offsets[None, :] < (lens - prefix_len)[:, None]  # [S, L]
    pos = torch.where(in_tail, prefix_len + offsets, prefix_len)  # padding: the tail's first slot
    slots = table[ids].gather(1, pos // block_size) * block_size + pos % block_size
    per_seq = int(q_lens.max())
    j = torch.minimum(torch.arange(per_seq)[None, :], q_lens[:, None] - 1)  # [S, Q]: padding repeats the last
    first_row = torch.tensor([starts[i] for i in ids])
    qpos = (lens - q_lens)[:, None] + j
    visible = in_tail[:, None, :] & (prefix_len + offsets <= qpos[:, :, None])  # [S, Q, L]
    rows = (first_row[:, None] + j).flatten().tolist()
    real_rows = None
    if per_seq > 1:
        real = (torch.arange(per_seq)[None, :] < q_lens[:, None]).flatten()
        real_rows = (torch.tensor(rows)[real].to(device), real.nonzero().flatten().to(device))
    return Unit(
        rows=_rows(rows, device) if real_rows is None else torch.tensor(rows, device=device),
        real_rows=real_rows,
        prefix=group,
        tail_slots=slots.flatten().to(device),
        tail_len=width,
        num_seqs=len(ids),
        bias=_bias(visible.reshape(-1, width), prefix_len).to(device),
    )


def _shared_prefixes(
    starts: list[int], seq_lens: list[int], tables: list[list[int]], block_size: int, device: torch.device
) -> tuple[list[int | None], list[SharedPrefix]]:
    """Groups of sequences by their first block, with the blocks all members share and all their
    queries see (only blocks wholly before a member's first query count). Returns each sequence's
    group (None: on its own) and the groups' prefixes."""
    by_first: dict[int, list[tuple[int, int]]] = {}
    for i, table in enumerate(tables):
        visible = min((seq_lens[i] - (starts[i + 1] - starts[i])) // block_size, len(table))
        if visible > 0:
            by_first.setdefault(table[0], []).append((i, visible))
    group_of: list[int | None] = [None] * len(seq_lens)
    prefixes: list[SharedPrefix] = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        first = tables[members[0][0]]
        n = min(visible for _, visible in members)
        for i, _ in members[1:]:
            k = 1
            while k < n and tables[i][k] == first[k]:
                k += 1
            n = k
        blocks = first[:n]
        for i, _ in members:
            group_of[i] = len(prefixes)
        if blocks == list(range(blocks[0], blocks[0] + n)):
            span: tuple[int, int] | None = (blocks[0] * block_size, (blocks[0] + n) * block_size)
            slots: torch.Tensor | None = None
        else:
            span = None
            slots = (
                (torch.tensor(blocks)[:, None] * block_size + torch.arange(block_size)).flatten().to(device)
            )
        prefixes.append(SharedPrefix(slots, span, n * block_size))
    return group_of, prefixes


def _rows(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, device=device)


def _bias(visible: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """[n, prefix_len + L]: the prefix is visible to every row, the tail as `visible` [n, L] says."""
    bias = torch.zeros((visible.shape[0], prefix_len + visible.shape[1]))
    bias[:, prefix_len:].masked_fill_(~visible, float("-inf"))
    return bias
