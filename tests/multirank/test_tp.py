"""Tensor parallel on the CPU (gloo): greedy tokens of a sharded model equal the unsharded model's.

The tiny random Llama (4 heads, 2 KV heads) runs TP=2 through the engine; the embedded SmolLM2-135M
(9 heads, 3 KV heads) runs TP=3 through `kvpilot serve` and the official openai client, and refuses TP=2
with a clear message. Each TP engine runs in its own process: a process joins one torch.distributed
group in its life.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.servers import MODEL, start_server, stop_server

pytestmark = pytest.mark.timeout(900)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away"]

GENERATE = """
import json, sys
from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.engine.engine import LLMEngine
from kvpilot.daemon.engine.request import SamplingParams

if __name__ == "__main__":
    model, tp, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    e = LLMEngine(EngineConfig(model=model, num_kv_blocks=64, tensor_parallel_size=tp, cpu_threads=1))
    ids = [e.tokenizer.encode(p) for p in prompts]
    print(json.dumps(e.generate(ids, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))))
"""


def generate(model: Path, tp: int) -> list[list[int]]:
    done = subprocess.run(
        [sys.executable, "-c", GENERATE, str(model), str(tp), json.dumps(PROMPTS)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_tp2_greedy_tokens_equal_tp1_on_a_tiny_llama(tiny_model_dir: Path) -> None:
    one = generate(tiny_model_dir, 1)
    assert all(len(t) == 16 for t in one)
    assert generate(tiny_model_dir, 2) == one


def test_serve_tp3_on_the_embedded_model_matches_tp1(tmp_path: Path, default_model_dir: Path) -> None:
    import openai
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    expected = [tok.decode(t, skip_special_tokens=True) for t in generate(default_model_dir, 1)]
    server = start_server(tmp_path, "--tensor-parallel-size", "3", "--cpu-threads", "1")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        for prompt, text in zip(PROMPTS, expected):
            out = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
            )
            assert out.usage.completion_tokens == 16
            assert out.choices[0].text == text
        reset = server.reset()
        assert [r["rank"] for r in reset["ranks"]] == [0]  # one scheduler for all shards
    finally:
        stop_server(server)
    assert "tensor-parallel shard 2 ready" in server.log()


def test_serve_refuses_a_tp_size_that_does_not_divide_the_heads(tmp_path: Path) -> None:
    with pytest.raises(
        RuntimeError, match=r"--tensor-parallel-size 2 must divide the model's attention heads \(9\)"
    ):
        start_server(tmp_path, "--tensor-parallel-size", "2")
