"""Fixtures shared by every test folder: the real default model and a tiny random-weight Llama; and,
registered once here, tests/support's: the process-group cleanup, the daemon/router fleet, the dev cluster,
the operator and the real vLLM server."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = [
    "support.procs",
    "support.servers",
    "support.cluster",
    "support.operator",
    "support.vllm_server",
    "support.lora",
]

# The shape of every tiny random-weight test model: small enough for the triton interpreter and for
# property tests, with the default model's vocabulary so its tokenizer fits.
TINY_MODEL_SHAPE = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    bos_token_id=1,
    eos_token_id=2,
)


# Tests that each run many model processes at once (a dev cluster of their own with a fleet, a router and
# `make serve`; a two-rank daemon swapping its weights), and the tests on nodes of the real kubelet
# (devcluster.kubeletnode): one after the other, in one worker. Two model-heavy ones side by side, beside the
# session's servers, took this 24 GB machine into reclaim (no swap): the API server took over 60 s to answer a
# TLS handshake, and both timed out. And a host runs one cluster of kubelet nodes at a time (one kube-proxy
# owns its Service rules; the CLI test compares the host before and after): README's and the demo's
# `make cluster-up` start one, these files start their own, and the session's `cluster` (support.cluster) is
# one too: its tests run after all of these, in the same worker.
WHOLE_STACK = {
    "tests/test_readme.py",
    "tests/operator/test_demo.py",
    "tests/weights/test_weight_dp.py",
    "tests/cluster/test_kubelet_node.py",
    "tests/cluster/test_kubelet_cli.py",
    "tests/chart/test_chart_cluster.py",  # its own cluster of a kubelet node (its `cluster` fixture)
    "tests/chart/test_chart_rbac.py",  # its own, with an audit log
}


def _on_the_sessions_cluster(item: pytest.Item) -> bool:
    path = item.nodeid.split("::")[0]
    return path not in WHOLE_STACK and "cluster" in getattr(item, "fixturenames", ())


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker reads the groups into the test ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Groups for `make test`'s workers (pytest-xdist, --dist loadgroup): a file's tests stay together in
    one worker, so its module fixtures start once; the tests on the session's cluster of kubelet nodes run in
    WHOLE_STACK's worker, after WHOLE_STACK's own clusters, in collection order, on one cluster (they share
    cluster-wide objects: the CRDs, `kvpilot-system`, the session's operator)."""
    for item in items:
        path = item.nodeid.split("::")[0]
        group = "whole-stack" if path in WHOLE_STACK or _on_the_sessions_cluster(item) else path
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker sends the controller its test ids
def pytest_collection_finish(session: pytest.Session) -> None:
    """The tests on the session's cluster after all others, whatever order `--ff`, `--nf` or `--lf` made
    (they reorder once every pytest_collection_modifyitems has run): a file with a cluster of its own run
    while the session's is up would find the host's nodes taken."""
    session.items.sort(key=_on_the_sessions_cluster)  # stable: each kind keeps its order


@pytest.fixture(scope="session")
def tiny_model_shape() -> dict:
    return dict(TINY_MODEL_SHAPE)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct, converted from its GGUF once per machine."""
    from kvpilot.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A 2-layer random-weight Llama with the default model's tokenizer (so its vocabulary fits):
    fast enough for property tests and the triton interpreter, yet the real loading path."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(**TINY_MODEL_SHAPE, max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(1234)
    LlamaForCausalLM(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def sharp_tiny_model_dir(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory):
    """The tiny Llama, weights scaled so that attention decides its greedy tokens (tests/kernels, gpu)."""
    from support.kernel_cases import sharpen_checkpoint

    return sharpen_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("sharp-tiny-llama"))
