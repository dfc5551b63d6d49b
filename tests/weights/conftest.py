"""Weight update tests: a second checkpoint made from the embedded model with changed weights (same
shapes, different greedy outputs), one made incompatible, transformers' greedy outputs as the reference,
and a daemon serving the embedded model as version v1 that the tests update through its routes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from benchkit import changed_checkpoint as changed_checkpoint_of
from support.procs import free_port
from support.servers import ADMIN_TOKEN, Server, start_server, stop_server, wait_idle


@pytest.fixture(scope="session")
def original_checkpoint() -> Path:
    from kvpilot.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def changed_checkpoint(tmp_path_factory: pytest.TempPathFactory, original_checkpoint: Path) -> Path:
    """The embedded model with every MLP down projection perturbed (seeded): same names and shapes."""
    return changed_checkpoint_of(original_checkpoint, tmp_path_factory.mktemp("changed-ckpt"))


@pytest.fixture(scope="session")
def incompatible_checkpoint(tmp_path_factory: pytest.TempPathFactory, original_checkpoint: Path) -> Path:
    """The embedded model's tensors with one of them cut to another shape."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("incompatible-ckpt")
    tensors = load_file(str(original_checkpoint / "model.safetensors"))
    name = "model.layers.3.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :100].contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def events_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, events_port: int) -> Iterator[Server]:
    srv = start_server(
        tmp_path_factory.mktemp("weights"),
        "--weight-version",
        "v1",
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{events_port}",
        token=ADMIN_TOKEN,
    )
    yield srv
    stop_server(srv)
    assert "Traceback" not in srv.log(), srv.log()[-4000:]


@pytest.fixture
def quiet(daemon: Server) -> Server:
    wait_idle(daemon)
    return daemon
