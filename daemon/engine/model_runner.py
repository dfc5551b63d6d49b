"""Turns a scheduled step into one packed forward pass and the logits the step needs.

It owns the KV cache tensors (one K and one V tensor of [num_blocks, block_size, Hkv, D] per layer);
the block ids in each chunk say where a request's tokens live in them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

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
        # Called with each step's plan before it runs: tensor parallelism sends it to the other shards.
        self.on_step: Callable[[StepPlan], None] | None = None
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
        plan = self.plan(out)
        if self.on_step is not None:
            self.on_step(plan)
        return self.run(plan)

    def run(self, plan: StepPlan) -> torch.Tensor:
        if plan.block_copies:
            self._copy_blocks(plan.block_copies)
        return self.model(self._batch(plan), self.kv_caches)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k, v in self.kv_caches:
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    def plan(self, out: SchedulerOutput) -> StepPlan:
        bs = self.block_size
        p = StepPlan(block_copies=list(out.block_copies))
        for c in out.chunks:
            end = c.start + c.num_tokens
            p.input_ids.extend(c.request.all_token_ids[c.start : end])
            pos = range(c.start, end)
            p.positions.extend(pos)
            p.slots.extend(c.block_ids[q // bs] * bs + q % bs for q in pos)
            p.logits_rows.extend(range(len(p.input_ids) - (end - c.logits_from), len(p.input_ids)))
            p.query_lens.append(c.num_tokens)
            p.seq_lens.append(end)
            p.block_tables.append(list(c.block_ids))
        return p

    def _batch(self, p: StepPlan) -> ForwardBatch:
        attn = AttentionMetadata.build(
            query_lens=p.query_lens, seq_lens=p.seq_lens, block_tables=p.block_tables, device=self.device
        )

        def as_tensor(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int64, device=self.device)

        return ForwardBatch(
            input_ids=as_tensor(p.input_ids),
            positions=as_tensor(p.positions),
            slot_mapping=as_tensor(p.slots),
            attn=attn,
            logits_indices=as_tensor(p.logits_rows),
        )


@dataclass(slots=True)
class StepPlan:
    """One step's input as plain lists: what a tensor-parallel shard needs to run the same step."""

    block_copies: list[tuple[int, int]] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
