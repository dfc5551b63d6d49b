"""LoRA adapters made by peft for the tests, and peft's own greedy answers with them: the reference the
engine must match."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.cluster import readable_by_pods

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base_dir: Path, out: Path, seed: int, r: int = 8, targets: list[str] | None = None, scale: float = 0.05
) -> Path:
    """A peft LoRA directory for the model at `base_dir` whose B matrices are random (peft starts them
    at zero, which would change nothing): each seed gives an adapter that answers differently."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets or ALL_TARGETS, lora_dropout=0.0)
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def lora_adapters(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> dict[str, Path]:
    """Two adapters of the default model: one on every projection (r=8), one on q and v only (r=4)."""
    root = tmp_path_factory.mktemp("loras")
    adapters = {
        "every-layer": make_adapter(default_model_dir, root / "every-layer", seed=1),
        "attention-only": make_adapter(
            default_model_dir, root / "attention-only", seed=2, r=4, targets=["q_proj", "v_proj"]
        ),
    }
    readable_by_pods(root)  # the dev cluster's pods mount them (support.cluster.host_folders)
    return adapters


def peft_greedy(
    base_dir: Path, adapter: Path | None, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """peft's greedy continuation of each prompt, in fp32, one prompt at a time."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
            outs.append(ids[0, len(prompt) :].tolist())
    return outs
