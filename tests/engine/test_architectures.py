"""Every supported architecture loads from a Hugging Face checkpoint directory and decodes like
transformers: tiny random-weight Llama (untied head), Qwen2 (q/k/v bias) and Mistral, plus bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.engine import LLMEngine
from kvpilot.daemon.engine.models import UnsupportedModelError
from kvpilot.daemon.engine.request import SamplingParams

PROMPTS = [list(range(100, 137)), list(range(900, 905)), [7] * 20 + list(range(40, 60))]


def make_checkpoint(root: Path, tokenizer_dir: Path, arch: str, shape: dict) -> Path:
    import transformers
    from transformers import AutoTokenizer

    config_cls, model_cls, extra = {
        "llama-untied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": False}),
        "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    }[arch]
    config = getattr(transformers, config_cls)(**shape, max_position_embeddings=256, **extra)
    torch.manual_seed(7)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():  # larger weights than the init: clear argmax margins, no near-ties
        for name, p in model.named_parameters():
            if p.dim() > 1 or name.endswith(".bias"):
                p.normal_(0, 0.2)
    out = root / arch
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


@pytest.mark.parametrize("arch", ["llama-untied", "qwen2", "mistral"])
def test_architecture_matches_transformers(
    arch: str, tmp_path: Path, default_model_dir: Path, tiny_model_shape: dict
) -> None:
    from transformers import AutoModelForCausalLM

    ckpt = make_checkpoint(tmp_path, default_model_dir, arch, tiny_model_shape)
    engine = LLMEngine(EngineConfig(model=str(ckpt), num_kv_blocks=64))
    ours = engine.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    for prompt, got in zip(PROMPTS, ours):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert got == ref[0, len(prompt) :].tolist()


def test_qwen2_biases_are_loaded(tmp_path: Path, default_model_dir: Path, tiny_model_shape: dict) -> None:
    ckpt = make_checkpoint(tmp_path, default_model_dir, "qwen2", tiny_model_shape)
    engine = LLMEngine(EngineConfig(model=str(ckpt), num_kv_blocks=16))
    bias = engine.runner.model.layers[0].self_attn.qkv_proj.bias
    assert bias is not None and bias.abs().sum() > 0


def test_bf16_runs_and_is_consistent_with_itself(
    tmp_path: Path, default_model_dir: Path, tiny_model_shape: dict
) -> None:
    ckpt = make_checkpoint(
        tmp_path, default_model_dir, "llama-untied", tiny_model_shape
    )  # sharp weights: tokens vary
    outs = []
    for caching in (False, True):
        engine = LLMEngine(
            EngineConfig(model=str(ckpt), dtype="bfloat16", num_kv_blocks=64, enable_prefix_caching=caching)
        )
        assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16
        outs.append(engine.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True)))
        outs.append(engine.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True)))  # warm cache
    assert all(len(o) == 6 for o in outs[0])
    assert any(len(set(o)) > 1 for o in outs[0])  # a model that repeats one token would prove nothing
    assert outs[0] == outs[1] == outs[2] == outs[3]


def test_unsupported_architecture_is_a_clear_error(tmp_path: Path, default_model_dir: Path) -> None:
    from transformers import BertConfig, BertModel

    out = tmp_path / "bert"
    BertModel(
        BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    ).save_pretrained(out)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(out)
    with pytest.raises(UnsupportedModelError, match="not supported"):
        LLMEngine(EngineConfig(model=str(out), num_kv_blocks=8))


def test_missing_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a checkpoint directory"):
        LLMEngine(EngineConfig(model=str(tmp_path / "nope")))
