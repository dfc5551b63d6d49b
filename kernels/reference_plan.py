"""The torch reference attention's per-step plan: every index and mask of a packed batch, computed once
per step by the first layer and reused by all the others (they differ only in their cache).

Sequences whose block tables start with the same blocks (a shared system prompt served from the prefix
cache) form a group: their queries attend to those blocks together, so each layer reads the shared keys
once for the whole group instead of copying them out once per sequence. After its group's prefix, each
sequence attends to its own tail: the decode rows of a group (one query each) together, with tails
padded to the longest; each longer chunk on its own, with a causal mask. Padding repeats a sequence's
own first tail slot, so no read ever leaves that sequence's context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpilot.kernels.metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """Leading blocks shared by a group of sequences; all of the group's queries see all of them."""

    slots: torch.Tensor | None  # [P] cache slots, or None when `span` covers them
    span: tuple[int, int] | None  # the slot range when the blocks are consecutive in the pool (a view)
    length: int


@dataclass(frozen=True, slots=True)
class Unit:
    """Query rows attending to [their group's prefix] + their tails, in one softmax.

    Decode rows (one query each) have a tail per row: `tail_slots` is [n * L], row-major. A chunk (one
    sequence, several queries) has one tail its rows share: `tail_slots` is [L]."""

    rows: slice | torch.Tensor
    prefix: int | None  # index into AttentionPlan.prefixes
    tail_slots: torch.Tensor
    tail_len: int  # L
    per_row_tail: bool
    bias: torch.Tensor  # [n, P + L] float32: 0 where a key is visible, -inf where not


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
    prefix_len = [0 if g is None else prefixes[g].length for g in group_of]
    units = []
    decode_by_group: dict[int | None, list[int]] = {}
    for i in range(len(seq_lens)):
        q_len = starts[i + 1] - starts[i]
        if q_len == 1:
            decode_by_group.setdefault(group_of[i], []).append(i)
            continue
        pos = torch.arange(prefix_len[i], seq_lens[i])
        qpos = torch.arange(seq_lens[i] - q_len, seq_lens[i])
        units.append(
            Unit(
                rows=slice(starts[i], starts[i + 1]),
                prefix=group_of[i],
                tail_slots=(table[i, pos // block_size] * block_size + pos % block_size).to(device),
                tail_len=len(pos),
                per_row_tail=False,
                bias=_bias(pos[None, :] <= qpos[:, None], prefix_len[i]).to(device),
            )
        )
    for g, ids in decode_by_group.items():
        first = torch.tensor([prefix_len[i] for i in ids])
        lens = torch.tensor([seq_lens[i] for i in ids]) - first
        width = int(lens.max())
        offsets = torch.arange(width)
        valid = offsets[None, :] < lens[:, None]
        pos = torch.where(valid, first[:, None] + offsets, first[:, None])
        slots = table[ids].gather(1, pos // block_size) * block_size + pos % block_size
        rows = [starts[i] for i in ids]
        units.append(
            Unit(
                rows=_rows(rows, device),
                prefix=g,
                tail_slots=slots.flatten().to(device),
                tail_len=width,
                per_row_tail=True,
                bias=_bias(valid, 0 if g is None else prefixes[g].length).to(device),
            )
        )
    whole = slice(0, starts[-1])
    covers_all = len(units) == 1 and isinstance(units[0].rows, slice) and units[0].rows == whole
    return AttentionPlan(prefixes, units, covers_all)


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
    prefixes = []
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
            span, slots = (blocks[0] * block_size, (blocks[0] + n) * block_size), None
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
