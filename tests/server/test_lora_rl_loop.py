"""An RL-style loop on a real daemon: each step trains the LoRA adapter with peft on the CPU, commits it with
vLLM's `/v1/load_lora_adapter` (`load_inplace`), then samples. Every sample after a commit must come from
the new adapter (stale samples: 0), and the base model's cache must stay warm throughout."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from support.lora import make_adapter, peft_greedy
from support.servers import ADMIN_TOKEN, Server, start_server, stop_server

STEPS = 3
SAMPLES = 4  # per step, sent together
MAX_TOKENS = 8
BASE_SYSTEM = (
    "You are the assistant of a platform team. Every replica keeps a prefix cache of attention keys and "
    "values, and the team flushes it before benchmarks so that each run starts cold."
)


@pytest.fixture(scope="module")
def policy_server(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> Iterator[tuple[Server, Path]]:
    root = tmp_path_factory.mktemp("rl")
    first = make_adapter(default_model_dir, root / "step-0", seed=7)
    srv = start_server(root, "--enable-lora", "--lora-modules", f"policy={first}", token=ADMIN_TOKEN)
    yield srv, root
    stop_server(srv)
    assert "Traceback" not in srv.log(), srv.log()[-4000:]


def train_step(base_dir: Path, adapter: Path, out: Path, seed: int) -> Path:
    """One optimizer step of the adapter with peft (a language-model loss on one text), saved to `out`."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(base_dir)
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), adapter, is_trainable=True
    )
    batch = tok([f"Step {seed}: the cache is cold and the answer is {seed * 7}."], return_tensors="pt")
    loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5).step()
    model.save_pretrained(out)
    return out


def test_every_sample_after_a_commit_comes_from_the_new_adapter(policy_server, default_model_dir) -> None:  # noqa: ANN001
    import openai
    from transformers import AutoTokenizer

    server, root = policy_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    prompt = list(tok("Reinforcement learning on a warm cache is", add_special_tokens=True)["input_ids"])
    base = client.models.list().data[0].id

    def base_cached() -> int:
        out = client.chat.completions.create(
            model=base,
            messages=[{"role": "system", "content": BASE_SYSTEM}, {"role": "user", "content": "Hi"}],
            max_tokens=1,
        )
        return out.usage.prompt_tokens_details.cached_tokens or 0

    def sample(_: int) -> str:
        out = client.completions.create(model="policy", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        return out.choices[0].text

    base_cached()
    adapter = root / "step-0"
    answers: list[str] = []
    stale = 0
    for step in range(1, STEPS + 1):
        adapter = train_step(default_model_dir, adapter, root / f"step-{step}", seed=step)
        expected = tok.decode(
            peft_greedy(default_model_dir, adapter, [prompt], MAX_TOKENS)[0], skip_special_tokens=True
        )
        committed = server.request(
            "POST",
            "/v1/load_lora_adapter",
            {"lora_name": "policy", "lora_path": str(adapter), "load_inplace": True},
            headers=server.admin(),
        )
        assert committed.status == 200, committed.body
        with ThreadPoolExecutor(SAMPLES) as pool:
            got = list(pool.map(sample, range(SAMPLES)))
        stale += sum(g != expected for g in got)
        answers.append(expected)
        assert base_cached() >= 32, step  # the base model's cache survives every commit
    assert stale == 0
    assert len(set(answers)) == STEPS  # each step's adapter answers otherwise: the loop can tell them apart
