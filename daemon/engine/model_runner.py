"""Turns a scheduled step into one packed forward pass and the logits the step needs.

It owns the KV cache tensors (one K and one V tensor of [num_blocks, block_size, Hkv, D] per layer);
the block ids in each chunk say where a request's tokens live in them.
"""

from __future__ import annotations

import torch

from kvpilot.daemon.engine.models import ForwardBatch
from kvpilot.daemon.engine.models.llama import LlamaForCausalLM
from kvpilot.daemon.engine.scheduler import SchedulerOutput
from kvpilot.kernels import AttentionMetadata


def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    a = model.args
    return 2 * a.num_layers * block_size * a.num_kv_heads * a.head_dim * torch.finfo(dtype).bits // 8


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        a = model.args
        shape = (num_blocks, block_size, a.num_kv_heads, a.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(a.num_layers)
        ]

    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run the step; returns the logits of positions `chunk.logits_from` to the chunk's end of
        every chunk, in chunk order."""
        if out.block_copies:
            self._copy_blocks(out.block_copies)
        return self.model(self._prepare(out), self.kv_caches)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k, v in self.kv_caches:
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    def _prepare(self, out: SchedulerOutput) -> ForwardBatch:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        for c in out.chunks:
            end = c.start + c.num_tokens
            input_ids.extend(c.request.all_token_ids[c.start : end])
            pos = range(c.start, end)
            positions.extend(pos)
            slots.extend(c.block_ids[p // bs] * bs + p % bs for p in pos)
            logits_rows.extend(range(len(input_ids) - (end - c.logits_from), len(input_ids)))
        attn = AttentionMetadata.build(
            query_lens=[c.num_tokens for c in out.chunks],
            seq_lens=[c.start + c.num_tokens for c in out.chunks],
            block_tables=[c.block_ids for c in out.chunks],
            device=self.device,
        )

        def as_tensor(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int64, device=self.device)

        return ForwardBatch(
            input_ids=as_tensor(input_ids),
            positions=as_tensor(positions),
            slot_mapping=as_tensor(slots),
            attn=attn,
            logits_indices=as_tensor(logits_rows),
        )
