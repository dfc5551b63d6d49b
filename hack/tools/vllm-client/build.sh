#!/usr/bin/env bash
# Installs vLLM's package, for its trainer-side client only, into one folder of the tools cache:
#   ${KVPILOT_CACHE:-$HOME/.cache/kvpilot}/tools/vllm-client/   (put it on PYTHONPATH)
# `pip install --no-deps --target` from the pins in hack/tools/vllm-client/requirements.txt, for the
# project's python (VLLM_CLIENT_PYTHON, default the checkout's .venv/bin/python): vLLM's own pins (an exact
# torch, CUDA libraries, GPU kernels: 9.4 GB) would not fit beside the project's venv, and the client needs
# none of them; its import runs on the project's torch and requests. The folder is made anew each time and
# counts only once the import of `HTTPVLLMWeightSyncClient` worked and vLLM says the pinned version.
# A stamp (the hash of this script, the requirements, the python's and its torch's versions) makes a
# second run instant. Kept out of hack/tools/build.sh (`make tools`): every stamp there hashes that
# script, so an entry there would rebuild every tool once. tests/weights/test_weight_client.py runs it.
#
# Usage: hack/tools/vllm-client/build.sh [--force] [--print-dir]
# Env:   KVPILOT_CACHE, VLLM_CLIENT_PYTHON, PIP_INDEX_URL (honoured as usual), BUILD_NICE (default 10)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../../lib/buildflags.sh
source "$here/../../lib/buildflags.sh"
parse_build_flags vllm-client --print-dir "$@"
LOG_TAG=vllm-client
# shellcheck source=../../lib/gobuild.sh
source "$here/../../lib/gobuild.sh"  # step, die

tools_dir="${KVPILOT_CACHE:-$HOME/.cache/kvpilot}/tools"
dest="$tools_dir/vllm-client"
if [[ $print_only == 1 ]]; then
    echo "$dest"
    exit 0
fi
python="${VLLM_CLIENT_PYTHON:-$here/../../../.venv/bin/python}"
[[ -x "$python" ]] || die "no python at $python (run make setup, or set VLLM_CLIENT_PYTHON)"
version="$(awk -F'==' '$1=="vllm" {print $2}' "$here/requirements.txt")"
stamp="$tools_dir/.vllm-client.inputs.sha256"
# cbor2 is a compiled wheel: the folder belongs to one python version; vLLM's import runs on that
# python's torch, so another torch checks the import again.
versions='import sys, importlib.metadata as m; print(sys.version, m.version("torch"))'
hash="$({ cat "$0" "$here/requirements.txt"; "$python" -c "$versions"; } | sha256sum | cut -d' ' -f1)"

mkdir -p "$tools_dir"
exec 9>"$tools_dir/.vllm-client.lock"  # one install at a time; the next finds it done
flock 9
if [[ $force == 0 && -f "$stamp" && "$(cat "$stamp")" == "$hash" && -d "$dest/vllm" ]]; then
    step "up to date: $dest (vllm $version)"
    exit 0
fi
rm -f "$stamp"
t0=$SECONDS
tmp="$dest.tmp"
rm -rf "$tmp"
trap 'rm -rf "$tmp" "$tmp.err"' EXIT
export PYTHONSAFEPATH=1  # `python -m` must not import the checkout's operator/ as the stdlib's
step "pip install --no-deps --target: vllm==$version and the two modules its client's import needs"
nice -n "${BUILD_NICE:-10}" "$python" -m pip install -q --disable-pip-version-check --no-deps \
    --target "$tmp" -r "$here/requirements.txt" || die "pip install -r $here/requirements.txt failed"
check='import vllm
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
print(vllm.__version__)'
if ! reported="$(cd / && PYTHONPATH="$tmp" "$python" -c "$check" 2>"$tmp.err")"; then
    tail -n 20 "$tmp.err" >&2
    die "importing HTTPVLLMWeightSyncClient from $tmp failed (above)"
fi
[[ "$reported" == "$version" ]] || die "vllm says version '$reported', expected $version"
rm -rf "$dest"
mv "$tmp" "$dest"
echo "$hash" > "$stamp"
step "done in $((SECONDS - t0))s: $dest (vllm $version, $(du -sh "$dest" | cut -f1))"
