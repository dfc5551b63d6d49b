"""What the attention op needs to know about a packed batch, built once per engine step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvpilot.kernels.reference_plan import AttentionPlan


@dataclass(slots=True)
class AttentionMetadata:
    """Layout of a packed batch of S sequences and T query tokens.

    query_start_loc: [S+1] int32, sequence i's query rows are [query_start_loc[i], query_start_loc[i+1]).
    seq_lens: [S] int32, context length of each sequence including its new tokens.
    block_tables: [S, max_blocks] int32, the KV blocks of each sequence in order (padded with 0).
    The *_list fields are host copies, so CPU code never syncs on a device tensor.
    reference_plan: the torch reference attention's per-step plan (`kernels/reference_plan.py`), built by
    the first layer that runs and reused by the others.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc_list: list[int]
    seq_lens_list: list[int]
    block_tables_list: list[list[int]]
    max_query_len: int
    max_seq_len: int
    # ((block_size, device), the plan) once built
    reference_plan: tuple[tuple[int, torch.device], AttentionPlan] | None = field(default=None, repr=False)

    @classmethod
    def build(
        cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], device: torch.device
    ) -> AttentionMetadata:
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        width = max((len(t) for t in block_tables), default=1) or 1
        table = torch.zeros((len(block_tables), width), dtype=torch.int32)
        for i, t in enumerate(block_tables):
            if t:
                table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        return cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=table.to(device),
            query_start_loc_list=starts,
            seq_lens_list=list(seq_lens),
            block_tables_list=[list(t) for t in block_tables],
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
        )
