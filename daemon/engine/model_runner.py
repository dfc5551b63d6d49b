"""Turns a scheduled step into one packed forward pass and the logits the step needs.

It owns the KV cache tensors (one K and one V tensor of [num_blocks, block_size, Hkv, D] per layer);
the block ids in each chunk say where a request's tokens live in them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvpilot.daemon.engine.compile.config import EAGER, CompilationConfig
from kvpilot.daemon.engine.compile.forward import CompiledForward
from kvpilot.daemon.engine.kv.host_tier import HostBlock
from kvpilot.daemon.engine.models import ForwardBatch
from kvpilot.daemon.engine.models.llama import LlamaForCausalLM
from kvpilot.daemon.engine.scheduler import SchedulerOutput
from kvpilot.daemon.engine.weights.lora import LoRAAdapter, lora_batch
from kvpilot.kernels import AttentionMetadata


def kv_block_shape(model: LlamaForCausalLM, block_size: int) -> tuple[int, ...]:
    """One block of every layer as the offload tiers hold it: [layers, K/V, block_size, kv_heads, head_dim]."""
    a = model.args
    return (a.num_layers, 2, block_size, a.num_kv_heads, a.head_dim)


def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    return torch.Size(kv_block_shape(model, block_size)).numel() * torch.finfo(dtype).bits // 8


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        compilation: CompilationConfig | None = None,
    ) -> None:
        """`compilation`: how the forward runs (compile/config.py); None: eager."""
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
        self.block_shape = kv_block_shape(model, block_size)
        self.forward = CompiledForward(model, compilation or EAGER, self.kv_caches)
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    # ---- offload tiers (kv/offload.py) ---------------------------------------------------------
    def read_blocks(self, block_ids: list[int]) -> list[HostBlock]:
        """Copy these pool blocks to host memory, one tensor each. Call before anything writes to them;
        on a GPU the copy to (pinned) host memory runs on a side stream and each block's `ready` event
        says when it has landed, so the step goes on without it."""
        staged = self._stage(block_ids)
        if self._copy_stream is None:
            return [HostBlock(b.clone()) for b in staged.unbind(0)]  # each its own memory, freed on its own
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            host = [torch.empty(self.block_shape, dtype=staged.dtype, pin_memory=True) for _ in block_ids]
            for h, b in zip(host, staged.unbind(0)):
                h.copy_(b, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._copy_stream)
        staged.record_stream(self._copy_stream)  # not reused before the side stream is done with it
        return [HostBlock(h, ready) for h in host]

    def gather_blocks(self, block_ids: list[int]) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """These pool blocks as one host tensor, [blocks, *block_shape] (a prefill held for a remote decode:
        kv_transfer/held.py), and on a GPU the event that says it has landed: the copy to pinned memory runs
        on the side stream, as `read_blocks`' does. Call before anything writes to them."""
        staged = self._stage(block_ids)
        if self._copy_stream is None:
            return staged, None  # on the CPU the gather is the copy
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            host = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
            host.copy_(staged, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._copy_stream)
        staged.record_stream(self._copy_stream)
        return host, ready

    def _stage(self, block_ids: list[int]) -> torch.Tensor:
        """These pool blocks gathered into one tensor on the pool's device, every layer's K and V."""
        idx = torch.tensor(block_ids, device=self.device)
        staged = torch.empty(
            (len(block_ids), *self.block_shape), dtype=self.kv_caches[0][0].dtype, device=self.device
        )
        for layer, (k, v) in enumerate(self.kv_caches):
            staged[:, layer, 0] = k.index_select(0, idx)
            staged[:, layer, 1] = v.index_select(0, idx)
        return staged

    def write_blocks(self, block_ids: list[int], blocks: list[HostBlock]) -> None:
        """Copy blocks from the offload tiers into these pool blocks, before the step's forward pass. On a
        GPU the copies queue on the step's stream behind each block's own copy off the GPU, if that is
        still on its way; the host never waits."""
        current = torch.cuda.current_stream(self.device) if self._copy_stream is not None else None
        batch = torch.empty(
            (len(blocks), *self.block_shape), dtype=self.kv_caches[0][0].dtype, device=self.device
        )
        for row, b in zip(batch.unbind(0), blocks):
            if current is not None and b.ready is not None:
                current.wait_event(b.ready)
            row.copy_(b.data, non_blocking=True)
        idx = torch.tensor(block_ids, device=self.device)
        for layer, (k, v) in enumerate(self.kv_caches):
            k.index_copy_(0, idx, batch[:, layer, 0])
            v.index_copy_(0, idx, batch[:, layer, 1])

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
        return self.forward(self._batch(plan), self.kv_caches)

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
            if c.request.lora is not None:
                p.lora_spans.append((c.request.lora, len(p.input_ids) - c.num_tokens, c.num_tokens))
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
            lora=lora_batch(p.lora_spans, len(p.input_ids), self.device, self.model.ops.lora_add)
            if p.lora_spans
            else None,
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
    # (adapter, first row, rows) of each chunk run under an adapter (empty: all base). Never set with
    # tensor parallelism, whose shards take this plan as plain lists (config.py refuses the two together).
    lora_spans: list[tuple[LoRAAdapter, int, int]] = field(default_factory=list)
