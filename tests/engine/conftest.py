"""Engine fixtures: chat prompts on the real default model and transformers' answers for them."""

from __future__ import annotations

from pathlib import Path

import pytest

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
    "Who wrote Romeo and Juliet?",
    "Give me a tip for learning to cook.",
    "What does a compiler do?",
    "Describe the colour blue to someone who cannot see.",
]

SYSTEM_PROMPT = (
    "You are a careful assistant for an inference platform team. Answer briefly and precisely. "
    "The team runs many language model replicas on Kubernetes, and each replica keeps a prefix cache "
    "of attention keys and values so that prompts which share a beginning are not computed twice. "
    "Benchmarks flush these caches between runs so that every run starts cold, and training pipelines "
    "flush them after every weight update so that no stale values are reused. Keep answers short."
)


def chat_ids(tokenizer, user: str, system: str | None = None) -> list[int]:  # noqa: ANN001
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}
    ]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path):  # noqa: ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def chat_prompts(tokenizer) -> list[list[int]]:  # noqa: ANN001
    return [chat_ids(tokenizer, q) for q in QUESTIONS]


@pytest.fixture(scope="session")
def shared_prefix_prompts(tokenizer) -> list[list[int]]:  # noqa: ANN001
    return [chat_ids(tokenizer, q, SYSTEM_PROMPT) for q in QUESTIONS[:6]]


@pytest.fixture(scope="session")
def hf_model(default_model_dir: Path):  # noqa: ANN201
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def make_engine(default_model_dir: Path):  # noqa: ANN201
    """Build an engine on the default model with overrides of the test's choosing."""
    from kvpilot.daemon.engine.config import EngineConfig
    from kvpilot.daemon.engine.engine import LLMEngine

    def make(**overrides):  # noqa: ANN003, ANN202
        cfg = EngineConfig(model=str(default_model_dir), num_kv_blocks=overrides.pop("num_kv_blocks", 256))
        for k, v in overrides.items():
            setattr(cfg, k, v)
        return LLMEngine(cfg)

    return make


@pytest.fixture(scope="module")
def engine(make_engine):  # noqa: ANN001, ANN201
    """The default-model engine of one test module; modules that want other settings define their own."""
    return make_engine()
