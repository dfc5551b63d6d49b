"""The model's forward under torch.compile, and on CUDA replayed as CUDA graphs (vLLM's piecewise shape).

The attention and its KV write are one custom op, `kvpilot::attention`, opaque to the compiler: its
metadata (block tables, the reference attention's plan) is the step's, not a tensor the graph could
take, so the op reads it from the step being run (`_STEP`, set around each call on the calling thread).
Everything between two attention ops, the projections, norms, rotary and MLP, is what inductor fuses;
the compiled graph takes the torch reference ops for them (inductor writes the fused kernels itself).

One graph serves every token count (dynamic shapes), and one more the one-token steps. With CUDA graphs, a step of up to the largest
capture size is padded to the next size and replayed from the graph recorded for that size (the attention
op, tagged cudagraph-unsafe, runs between the graph's pieces on the real rows only); a bigger step runs
the compiled graph as it is. Padding rows only pass through row-wise ops and are dropped.

Steps with LoRA rows run eager (the adapters' per-row kernels are not in the graph). A weight update
copies into the parameters' own storage (weights/stage.py), which the graphs read: no graph is left
holding old weights.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpilot.daemon.engine.compile.config import CompilationConfig
from kvpilot.daemon.engine.models import ForwardBatch
from kvpilot.daemon.engine.models.llama import LlamaForCausalLM
from kvpilot.kernels import Ops
from kvpilot.kernels.ops import TORCH_OPS

log = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class _Step:
    batch: ForwardBatch
    ops: Ops  # the device's attention and KV write
    tokens: int  # real rows; the rest of the rows are padding


class _Current(threading.local):
    step: _Step | None = None


_STEP = _Current()


@torch.library.custom_op(
    "kvpilot::attention", mutates_args=("k_cache", "v_cache"), tags=(torch.Tag.cudagraph_unsafe,)
)
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The running step's KV write and paged attention over its real rows; padding rows get zeros."""
    step = _STEP.step
    if step is None:
        raise RuntimeError("kvpilot::attention runs only inside a compiled step")
    n = step.tokens
    step.ops.write_kv(k[:n], v[:n], k_cache, v_cache, step.batch.slot_mapping)
    out = step.ops.paged_attention(q[:n], k_cache, v_cache, step.batch.attn, scale)
    if n == q.shape[0]:
        return out
    return torch.cat([out, out.new_zeros((q.shape[0] - n, *out.shape[1:]))])


@attention.register_fake
def _attention_shape(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return torch.empty_like(q)


class CompiledForward:
    """Runs a step the way `config` says: `__call__(batch, kv_caches)` is the model's forward's contract."""

    def __init__(self, model: LlamaForCausalLM, config: CompilationConfig, kv_caches: KVCaches) -> None:
        self.model, self.config = model, config
        if config.cache_dir:  # read by inductor at each lookup; the flag wins over the environment
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = config.cache_dir
        self._sizes = list(config.cudagraph_capture_sizes)
        self._compiled: Callable[..., torch.Tensor] | None = None
        self._graphed: Callable[..., torch.Tensor] | None = None
        if config.compiled:
            self._compiled = torch.compile(self._compute, dynamic=True)
            if self._sizes:
                import torch._inductor.config as inductor

                inductor.triton.cudagraph_dynamic_shape_warn_limit = None  # one graph per size is the plan
                self._graphed = torch.compile(self._compute, dynamic=True, mode="reduce-overhead")
                for k, v in kv_caches:  # the graphs read the pool where it is: never copied in per replay
                    torch._dynamo.mark_static_address(k)
                    torch._dynamo.mark_static_address(v)
        self._seen: set[int] = (
            set()
        )  # the padded sizes run so far (0: the compiled graph without CUDA graphs)

    @property
    def graphs_run(self) -> frozenset[int]:
        """The graphs run so far: 0 the compiled one (without CUDA graphs), n the CUDA graph of n-token
        steps; empty while every step ran eager."""
        return frozenset(self._seen)

    def _compute(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        kv_caches: KVCaches,
    ) -> torch.Tensor:
        return self.model.compute(input_ids, positions, logits_indices, kv_caches, TORCH_OPS, attention)

    def __call__(self, batch: ForwardBatch, kv_caches: KVCaches) -> torch.Tensor:
        if self._compiled is None or batch.lora is not None:
            logits: torch.Tensor = self.model(batch, kv_caches)  # nn.Module's __call__ is Any
            return logits
        tokens, rows = batch.input_ids.shape[0], batch.logits_indices.shape[0]
        # A one-token step gets a graph of its own (torch.compile specializes size 1): padded to two rows
        # it ran the generic graph at 0.65x the eager step's speed, unpadded at 1.0x (bench/compile.py).
        size, sampled, fn, graph = tokens, rows, self._compiled, 0
        if self._graphed is not None and tokens <= self._sizes[-1]:
            # the sampled rows padded too: a graph is recorded per shape of all its inputs
            size = sampled = graph = self._sizes[bisect.bisect_left(self._sizes, tokens)]
            fn = self._graphed
        _STEP.step = _Step(batch, self.model.ops, tokens)
        started = time.monotonic()
        try:
            with torch.inference_mode():
                logits = fn(
                    _pad(batch.input_ids, size),
                    _pad(batch.positions, size),
                    _pad(batch.logits_indices, sampled),
                    kv_caches,
                )
        finally:
            _STEP.step = None
        if graph not in self._seen:
            self._seen.add(graph)
            took = time.monotonic() - started
            if graph:
                log.info("CUDA graph of %d-token steps recorded in %.1f s", graph, took)
            else:
                log.info("the step compiled in %.1f s (torch.compile, dynamic shapes)", took)
        # a graph's output is overwritten by its next replay: the sampler gets its own copy
        return logits[:rows].clone() if graph else logits


def _pad(t: torch.Tensor, size: int) -> torch.Tensor:
    """`t` [n] grown to [size] with copies of its first element (a real token, position or row)."""
    if t.shape[0] >= size:
        return t
    return torch.cat([t, t[:1].expand(size - t.shape[0])])
