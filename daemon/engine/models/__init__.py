"""Model architectures the engine runs, by the `architectures` name of a Hugging Face config."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvpilot.daemon.engine.models.llama import ForwardBatch, LlamaArgs, LlamaForCausalLM, rope_cache
from kvpilot.kernels import Ops

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}

__all__ = ["ARCHITECTURES", "ForwardBatch", "UnsupportedModelError", "load_model"]


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one the engine implements (e.g. encoder-only)."""


def load_model(
    model_dir: Path,
    hf_config: Any,  # a transformers PretrainedConfig: its fields are the model's own
    ops: Ops,
    dtype: torch.dtype,
    device: torch.device,
) -> LlamaForCausalLM:
    archs = getattr(hf_config, "architectures", None) or []
    cls = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if cls is None:
        raise UnsupportedModelError(
            f"{model_dir}: architecture {archs or hf_config.model_type!r} is not supported; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    with torch.device("meta"):
        model = cls(LlamaArgs.from_hf(hf_config), ops)
    model = model.to_empty(device=device).to(dtype)
    # to_empty left the rope table uninitialised; it stays float32 whatever the model dtype.
    a = model.args
    model.rope = rope_cache(a.head_dim, a.max_position, a.rope_theta).to(device)
    model.load_weights(_iter_safetensors(files, dtype))
    return model.requires_grad_(False).eval()


def _iter_safetensors(files: list[Path], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, st.get_tensor(name).to(dtype)
