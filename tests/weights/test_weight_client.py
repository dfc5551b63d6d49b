"""vLLM's own trainer-side client drives the daemon: `HTTPVLLMWeightSyncClient` from vLLM's package
(vllm/distributed/weight_transfer/clients.py, vllm 0.33.0 from PyPI, `make vllm-client`), not requests
written after it. A trainer process, the project's python with that package on its path, hosts the gloo
group as rank 0, calls the client's init / start / update / finish while it broadcasts the changed
weights, and reports what the client raised. Afterwards the daemon answers as transformers does on the
changed checkpoint, under the version the client sent.

The client sends no Authorization header (vLLM leaves its RL routes without one), so the daemon here runs
without an admin token, and a second check shows that a daemon with one refuses it (401).

Run as a script (`python test_weight_client.py trainer|refused ...`), this file is that client process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from support import ROOT, vllm_client
from support.procs import free_port, spawn, stop
from support.servers import Server, start_server, stop_server
from support.weights import admin, complete, greedy, prompt_ids, tokenizer

pytestmark = pytest.mark.timeout(900)

TOKENS = 6
VERSION = "vllm-client-1"


def trainer(base_url: str, checkpoint: str, port: str, version: str, out: str) -> None:
    """vLLM's loop as its rlhf_http example runs it, on gloo: the client's calls that block in the group
    (init, update) run in a thread while this process joins or broadcasts."""
    import requests
    import torch.distributed as dist
    import vllm
    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    client = HTTPVLLMWeightSyncClient(base_url)
    store = dist.TCPStore(
        "127.0.0.1", int(port), 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300)
    )
    init_info = {"master_address": "127.0.0.1", "master_port": int(port), "rank_offset": 1, "world_size": 2}
    joined = _background(client.init_weight_transfer_engine, init_info)
    group = dist.ProcessGroupGloo(dist.PrefixStore("kvpilot-weights", store), 0, 2, timedelta(seconds=300))
    joined()

    tensors = load_file(str(Path(checkpoint) / "model.safetensors"))
    names = sorted(tensors)
    update_info = {
        "names": names,
        "dtype_names": [str(tensors[n].dtype).removeprefix("torch.") for n in names],
        "shapes": [list(tensors[n].shape) for n in names],
    }
    client.start_weight_update()
    sent = _background(client.update_weights, update_info)
    for n in names:
        group.broadcast(tensors[n].contiguous(), 0).wait()
    sent()
    client.finish_weight_update(version)
    # An update with no start open is out of order: the client raises on the daemon's 409.
    try:
        client.update_weights(update_info)
        out_of_order = None
    except requests.HTTPError as exc:
        out_of_order = exc.response.status_code
    client.shutdown_weight_transfer_engine()
    report = {
        "vllm": vllm.__version__,
        "client": f"{HTTPVLLMWeightSyncClient.__module__}.{HTTPVLLMWeightSyncClient.__qualname__}",
        "client_file": sys.modules[HTTPVLLMWeightSyncClient.__module__].__file__,
        "out_of_order": out_of_order,
    }
    Path(out).write_text(json.dumps(report))


def refused(base_url: str, out: str) -> None:
    """The client against a daemon with an admin token: its first call raises on the 401."""
    import requests
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    try:
        HTTPVLLMWeightSyncClient(base_url).start_weight_update()
        status = None
    except requests.HTTPError as exc:
        status = exc.response.status_code
    Path(out).write_text(json.dumps({"status": status}))


def _background(fn: Callable, *args: object) -> Callable[[], None]:
    """Run fn(*args) in a thread; the returned call joins it and re-raises what it raised."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the joining thread
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def join() -> None:
        t.join(600)
        assert not t.is_alive(), f"{fn.__name__} did not return"
        if errors:
            raise errors[0]

    return join


@pytest.fixture(scope="module")
def vllm_client_dir() -> Path:
    return vllm_client.vllm_client_dir()


@pytest.fixture(scope="module")
def open_gloo_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The gloo transport and no admin token: what vLLM's client, which sends none, can drive."""
    srv = start_server(
        tmp_path_factory.mktemp("weights-client"), "--weight-transfer-config", '{"backend": "gloo"}'
    )
    yield srv
    stop_server(srv)
    assert "Traceback" not in srv.log(), srv.log()[-4000:]


def _run_client(client_dir: Path, tmp: Path, *args: str) -> dict:
    """This file as a script in its own process group, vLLM's package first on its path; its report."""
    out = tmp / f"{args[0]}-report.json"
    log = tmp / f"{args[0]}.log"
    path = [str(client_dir), str(ROOT / "tests"), str(ROOT / "hack" / "lib")]  # support.procs: devcluster
    env = os.environ | {"PYTHONPATH": os.pathsep.join(path)}
    proc = spawn([sys.executable, __file__, *args, str(out)], log_path=log, env=env, cwd=tmp)
    try:
        rc = proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        stop(proc)
        pytest.fail(f"the client process did not finish in 600 s: {log.read_text()[-4000:]}")
    assert rc == 0 and out.exists(), log.read_text()[-4000:]
    return json.loads(out.read_text())


def test_vllms_client_updates_the_weights(
    vllm_client_dir: Path,
    open_gloo_daemon: Server,
    original_checkpoint: Path,
    changed_checkpoint: Path,
    tmp_path: Path,
) -> None:
    srv = open_gloo_daemon
    report = _run_client(
        vllm_client_dir, tmp_path, "trainer", srv.url, str(changed_checkpoint), str(free_port()), VERSION
    )
    # vLLM's own class from vLLM's package, the version pinned in hack/tools/vllm-client/requirements.txt.
    assert report["vllm"] == "0.33.0", report
    assert report["client"] == "vllm.distributed.weight_transfer.clients.HTTPVLLMWeightSyncClient", report
    assert Path(report["client_file"]).is_relative_to(vllm_client_dir), report
    assert report["out_of_order"] == 409, report

    info = admin(srv, "GET", "/weight_info")
    assert info["weight_version"] == VERSION and info["digest"].startswith("sha256:"), info
    ids = prompt_ids(original_checkpoint)
    reply = complete(srv, ids, TOKENS)
    want = tokenizer(changed_checkpoint).decode(list(greedy(changed_checkpoint, tuple(ids), TOKENS)))
    assert reply["choices"][0]["text"] == want, (reply, want)
    assert reply["system_fingerprint"] == VERSION, reply


def test_a_daemon_with_a_token_refuses_vllms_client(
    vllm_client_dir: Path, daemon: Server, tmp_path: Path
) -> None:
    """conftest's daemon has an admin token; the client cannot send it, and the daemon stays on v1."""
    report = _run_client(vllm_client_dir, tmp_path, "refused", daemon.url)
    assert report["status"] == 401, report
    info = admin(daemon, "GET", "/weight_info")
    assert info["weight_version"] == "v1" and not any(r["staging"] for r in info["ranks"]), info


if __name__ == "__main__":
    {"trainer": trainer, "refused": refused}[sys.argv[1]](*sys.argv[2:])
