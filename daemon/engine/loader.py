"""Everything the engine needs from a checkpoint directory: config, tokenizer, weights, EOS ids."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from kvpilot.daemon.engine.models import load_model
from kvpilot.daemon.engine.models.llama import LlamaForCausalLM
from kvpilot.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from kvpilot.kernels import Ops

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    name: str
    model_dir: Path
    model: LlamaForCausalLM
    tokenizer: Any
    eos_token_ids: frozenset[int]


def resolve_model_dir(model: str | None) -> Path:
    if model is None or model == DEFAULT_MODEL_NAME:
        return ensure_default_model()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"--model {model!r}: not a checkpoint directory (no config.json); models cannot be downloaded "
            f"here, pass a local Hugging Face checkpoint directory or omit --model for {DEFAULT_MODEL_NAME}"
        )
    return path


def load(model: str | None, ops: Ops, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    model_dir = resolve_model_dir(model)
    hf_config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    weights = load_model(model_dir, hf_config, ops, dtype, device)
    return LoadedModel(
        model or DEFAULT_MODEL_NAME,
        model_dir,
        weights,
        tokenizer,
        eos_token_ids(model_dir, hf_config, tokenizer),
    )


def eos_token_ids(model_dir: Path, hf_config: Any, tokenizer: Any) -> frozenset[int]:
    """EOS of the config, the tokenizer and generation_config.json (chat models often list their
    end-of-turn token only there)."""
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id]
    if (model_dir / "generation_config.json").is_file():
        try:
            sources.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
        except (OSError, ValueError) as exc:
            log.warning("ignoring %s/generation_config.json: %s", model_dir, exc)
    for eos in sources:
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return frozenset(ids)
