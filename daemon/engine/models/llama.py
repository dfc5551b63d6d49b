"""The Llama family (Llama, Mistral, Qwen2 with its q/k/v bias, SmolLM) on the engine's paged attention.

Input is a packed batch: all scheduled tokens of all requests in one [T] row, prefill chunks and
decode tokens mixed, no padding. Logits are computed only for the rows that are sampled (the LM head
is a large share of a small model's decode step on the CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.kernels import AttentionMetadata, Ops, packed_linear
from kvpilot.kernels.packed_linear import PackedWeight

if TYPE_CHECKING:
    from kvpilot.daemon.engine.parallel.tp import RowParallelLinear
    from kvpilot.daemon.engine.weights.lora import LoRABatch


@dataclass(frozen=True, slots=True)
class Weight:
    """One of the model's weights as weight updates, adapters and the digest see it, wherever its values are
    kept: a parameter, or the panels that replaced a linear weight (`LlamaForCausalLM.pack_linears`)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]  # its values: the parameter itself, or a new dense tensor
    write: Callable[[torch.Tensor], None]  # new values (its shape and dtype), copied in place

    @classmethod
    def of_parameter(cls, p: torch.Tensor) -> Weight:
        def write(values: torch.Tensor) -> None:
            p.data.copy_(values)

        return cls(tuple(p.shape), p.dtype, p.detach, write)

    @classmethod
    def of_packed(cls, packed: PackedWeight, width: int) -> Weight:
        return cls((packed.out_features, width), packed.packed.dtype, packed.dense, packed.write)


@dataclass(frozen=True, slots=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool

    @classmethod
    def from_hf(cls, cfg: Any) -> LlamaArgs:
        # cfg: a transformers PretrainedConfig, Any: the fields read here are the model's own, not the base class's
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise NotImplementedError(f"rope scaling {rope_type!r} is not supported yet")
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        heads = cfg.num_attention_heads
        max_position = cfg.max_position_embeddings
        # Sliding-window attention is not implemented: serve only the context where it equals full
        # attention rather than silently diverging from the model beyond the window.
        window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        if window:
            max_position = min(max_position, int(window))
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(theta),
            max_position=max_position,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            # Qwen2 has biases on q/k/v and says so only through its model type.
            qkv_bias=cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
        )


# attend(q, k, v, k_cache, v_cache, scale) -> [T, H, D]: writes the step's K/V into the paged cache and
# attends over it; q [T, H, D], k and v [T, Hkv, D] (strided views of the fused projection).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def rope_cache(head_dim: int, max_position: int, theta: float) -> torch.Tensor:
    """[max_position, head_dim] float32: cat(cos, sin) of each position's head_dim/2 angles."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


@dataclass(slots=True)
class ForwardBatch:
    """One step's packed input (built by the model runner)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [S'] rows whose next token is sampled
    lora: LoRABatch | None = None  # the adapters of the step's rows (lora.py); None: all rows are base


class PackedLinear(nn.Linear):
    """nn.Linear that, once its weight is laid out for a faster kernel (`LlamaForCausalLM.pack_linears`),
    multiplies through that layout: every row count where the layout replaced the weight (`own`), the row
    counts a copy was timed faster at otherwise."""

    packed: PackedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.packed
        if p is not None and p.takes(x):
            return p(x, self.bias)
        return F.linear(x, self.weight, self.bias)

    def own(self) -> None:
        """The weight laid out in panels in its place: the parameter is dropped, so no second copy stays."""
        self.packed = PackedWeight.owning(self.weight)
        del self.weight


class LlamaAttention(nn.Module):
    def __init__(self, a: LlamaArgs, prefix: str) -> None:
        super().__init__()
        # Each projection's name as LoRA adapters address it (lora.py)
        self.qkv_name, self.o_name = f"{prefix}.qkv_proj", f"{prefix}.o_proj"
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_size, self.kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        # tensor parallelism replaces it with a column-sharded nn.Linear (parallel/tp.py)
        self.qkv_proj: nn.Linear = PackedLinear(
            a.hidden_size, self.q_size + 2 * self.kv_size, bias=a.qkv_bias
        )
        # tensor parallelism replaces it with its row-parallel one (parallel/tp.py)
        self.o_proj: nn.Linear | RowParallelLinear = PackedLinear(self.q_size, a.hidden_size, bias=False)
        self.scale = a.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        rope: torch.Tensor,
        ops: Ops,
        attend: Attend,
        lora: LoRABatch | None,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if lora is not None:
            lora.add(self.qkv_name, x, qkv)
        # Strided views of the fused projection: every op takes them (unit stride along the head size).
        q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        ops.rotary(q, k, positions, rope)
        o = attend(q, k, v, kv[0], kv[1], self.scale).reshape(t, self.q_size)
        out: torch.Tensor = self.o_proj(o)  # nn.Module's __call__ is typed Any: forward's tensor
        if lora is not None:
            lora.add(self.o_name, o, out)
        return out


class LlamaMLP(nn.Module):
    def __init__(self, a: LlamaArgs, prefix: str) -> None:
        super().__init__()
        self.gate_up_name, self.down_name = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
        self.gate_up_proj: nn.Linear = PackedLinear(a.hidden_size, 2 * a.intermediate_size, bias=False)
        self.down_proj: nn.Linear | RowParallelLinear = PackedLinear(
            a.intermediate_size, a.hidden_size, bias=False
        )

    def forward(self, x: torch.Tensor, ops: Ops, lora: LoRABatch | None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is None:
            down: torch.Tensor = self.down_proj(ops.silu_and_mul(gate_up))  # nn.Module's __call__ is Any
            return down
        lora.add(self.gate_up_name, x, gate_up)
        h = ops.silu_and_mul(gate_up)
        out: torch.Tensor = self.down_proj(h)
        lora.add(self.down_name, h, out)
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, a: LlamaArgs, index: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(a, f"layers.{index}.self_attn")
        self.mlp = LlamaMLP(a, f"layers.{index}.mlp")
        self.input_layernorm = nn.Parameter(torch.ones(a.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(a.hidden_size))
        self.eps = a.rms_norm_eps

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        rope: torch.Tensor,
        ops: Ops,
        attend: Attend,
        lora: LoRABatch | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = ops.rms_norm(x, self.input_layernorm, self.eps, residual)
        x = self.self_attn(x, positions, kv, rope, ops, attend, lora)
        x, residual = ops.rms_norm(x, self.post_attention_layernorm, self.eps, residual)
        return self.mlp(x, ops, lora), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, args: LlamaArgs, ops: Ops) -> None:
        super().__init__()
        self.args = args
        self.ops = ops
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = nn.Parameter(torch.ones(args.hidden_size))
        self.lm_head = (
            None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        )
        self.register_buffer(
            "rope", rope_cache(args.head_dim, args.max_position, args.rope_theta), persistent=False
        )
        # the LM head laid out for a faster kernel (`pack_linears`): a copy, or in place of its weight
        self.head_packed: PackedWeight | None = None

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """The eager step: the model's ops, attention through `batch`'s metadata."""
        ops = self.ops

        def attend(
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            k_cache: torch.Tensor,
            v_cache: torch.Tensor,
            scale: float,
        ) -> torch.Tensor:
            ops.write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
            return ops.paged_attention(q, k_cache, v_cache, batch.attn, scale)

        return self.compute(
            batch.input_ids, batch.positions, batch.logits_indices, kv_caches, ops, attend, batch.lora
        )

    def compute(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        ops: Ops,
        attend: Attend,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """The logits of rows `logits_indices`: the layers with `ops`, their attention (the KV write
        included) through `attend`. The eager step and the compiled one (compile/forward.py) both run it."""
        x = self.embed(input_ids)
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, kv, self.rope, ops, attend, lora)
        # Only the sampled rows need the final norm and the LM head.
        x = x.index_select(0, logits_indices)
        assert residual is not None  # set by the first layer
        residual = residual.index_select(0, logits_indices)
        x, _ = ops.rms_norm(x, self.norm, self.args.rms_norm_eps, residual)
        if self.head_packed is not None and self.head_packed.takes(x):
            return self.head_packed(x)
        return F.linear(x, self.head_weight())

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings: from the LM head's panels where they replaced a tied embedding table."""
        head = self.head_packed
        if head is not None and head.owns and self.lm_head is None:
            return head.rows(input_ids)
        out: torch.Tensor = self.embed_tokens(input_ids)
        return out

    def head_weight(self) -> torch.Tensor:
        """The LM head's weight: the embeddings' where the model ties them (gone where panels replaced it:
        `weights()` reads it then)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_linears(self, copies: bool = False) -> str | None:
        """Lay out the linear weights of the layers and the LM head for a faster kernel than `F.linear`
        (kernels/packed_linear.py); returns what was done, or None, changing nothing. The eager CPU step's;
        torch.compile does without.

        - Where the panels run (one torch thread, x86-64 with AVX2 and FMA, float32), they replace the
          weights: every step size goes through them and no second copy is kept (a tied LM head's panels
          serve the embedding's lookups too). `weights()` reads and writes them as dense weights.
        - Otherwise, with `copies` (`--packed-linears`), oneDNN's copies beside the weights, used at the step
          sizes where they were faster, as timed here on the first layers' weights and on the head's (the
          linear weights' memory again)."""
        linears = [m for m in self.modules() if isinstance(m, PackedLinear)]
        if self.head_packed is not None:
            raise RuntimeError("pack_linears: the weights are laid out already")
        kernel = packed_linear.kernel_for(linears[0].weight) if linears else None
        if kernel is packed_linear.PANELS:
            for m in linears:
                m.own()
            self.head_packed = PackedWeight.owning(self.head_weight())
            del (self.embed_tokens if self.lm_head is None else self.lm_head).weight
            return "panels, in place of the weights: every step size"
        if kernel is None or not copies:
            return None
        budget = packed_linear.CALIBRATION_BYTES
        timed: list[torch.Tensor] = []  # the first layers' weights, as many as the budget takes
        for layer in self.layers:
            if sum(w.numel() * w.element_size() for w in timed) >= budget:
                break
            timed += [m.weight for m in layer.modules() if isinstance(m, PackedLinear)]
        rows = packed_linear.fast_rows(timed, kernel)
        head = self.head_weight()
        # timed on a slice of the head's rows (its shape's kind, a fraction of a large vocabulary's time)
        head_rows = packed_linear.fast_rows([head[: budget // (head.shape[1] * head.element_size())]], kernel)
        if any(rows):  # a copy no step size takes is not kept: it would only cost memory
            for m in linears:
                m.packed = PackedWeight.of(m.weight, kernel, rows)
        if any(head_rows):
            self.head_packed = PackedWeight.of(head, kernel, head_rows)
        describe = packed_linear.describe
        return f"{kernel.name} copies: layers at {describe(rows)}, the LM head at {describe(head_rows)}"

    def repack_linears(self) -> None:
        """The packed copies made again from the weights, after a weight update changed them in place (panels
        that replaced the weights were written in place themselves)."""
        for m in self.modules():
            if isinstance(m, PackedLinear) and m.packed is not None and not m.packed.owns:
                m.packed = m.packed.repacked(m.weight)
        if self.head_packed is not None and not self.head_packed.owns:
            self.head_packed = self.head_packed.repacked(self.head_weight())

    def weights(self) -> dict[str, Weight]:
        """Every weight by its parameter's name (the name it had before panels replaced it), read and
        written as a dense tensor whichever way it is kept."""
        out = {name: Weight.of_parameter(p) for name, p in self.named_parameters()}
        for name, m in self.named_modules():
            if isinstance(m, PackedLinear) and m.packed is not None and m.packed.owns:
                out[f"{name}.weight"] = Weight.of_packed(m.packed, m.in_features)
        if self.head_packed is not None and self.head_packed.owns:
            head = "embed_tokens.weight" if self.lm_head is None else "lm_head.weight"
            out[head] = Weight.of_packed(self.head_packed, self.args.hidden_size)
        return out

    def checkpoint_slot(self, name: str) -> tuple[str, int, int | None] | None:
        """Where a Hugging Face tensor goes: (parameter name, first row, rows or None for all of it);
        None for tensors the model does not keep (rotary tables, a tied LM head). Raises KeyError for a
        tensor that has no place here. Loading and weight updates (`weights/stage.py`) share it."""
        a = self.args
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        fused = {
            "q_proj": ("qkv_proj", 0, q),
            "k_proj": ("qkv_proj", q, kv),
            "v_proj": ("qkv_proj", q + kv, kv),
            "gate_proj": ("gate_up_proj", 0, a.intermediate_size),
            "up_proj": ("gate_up_proj", a.intermediate_size, a.intermediate_size),
        }
        name = name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
            return None
        name = name.replace("layernorm.weight", "layernorm").replace("norm.weight", "norm")
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in fused:
            target, offset, size = fused[parts[-2]]
            return ".".join([*parts[:-2], target, parts[-1]]), offset, size
        if name not in self.weights():
            raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
        return name, 0, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a Hugging Face Llama-family state dict, fusing q/k/v and gate/up as they arrive."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            slot = self.checkpoint_slot(name)
            if slot is None:
                continue
            pname, offset, size = slot
            if size is None:
                params[pname].data.copy_(tensor)
                loaded.add(pname)
            else:
                params[pname].data[offset : offset + size].copy_(tensor)
                loaded.add(f"{pname}:{offset}")
        slices = {"qkv_proj": 3, "gate_up_proj": 2}
        expected = sum(slices.get(p.split(".")[-2], 1) if "." in p else 1 for p in params)
        if len(loaded) != expected:
            raise ValueError(f"the checkpoint filled {len(loaded)} of {expected} weight slices")
