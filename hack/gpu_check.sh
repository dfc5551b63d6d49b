#!/usr/bin/env bash
# `make gpu-check`: every GPU figure of the project in one command on a CUDA machine, within 8 minutes.
# Each step has its own time limit and runs even when an earlier one failed (one run of a rented GPU should
# give every figure it can); the script fails at the end if any step did. The benches go first, each with
# a fixed limit; the tests get what is left of the 8 minutes (their triton compiles are the least
# predictable part). What it writes, all under bench/results/gpu-check-<UTC time>/: each bench's JSON,
# each step's log, the tests' JUnit XML, nvidia-smi's view of the GPU and summary.json (each step's exit
# status and seconds; 124 or 137: it ran past its limit).
#
#   kernels      bench/attention_kernels.py --quick: paged attention decode GB/s against copy and datasheet bandwidth
#   decode       bench/decode_bandwidth.py: decode tokens/s of the default model in bf16 and the share of
#                HBM bandwidth a step reaches
#   kv-tiers     bench/kv_tiers.py --device cuda: TTFT from the offload tiers; read_blocks/write_blocks GB/s
#                against a pinned copy (the PCIe bound as this machine reaches it)
#   compile      bench/compile.py: decode tokens/s at batch 1, 16, 64, -O2 (torch.compile and CUDA graphs)
#                against eager, and the first step's compile time with an empty and a warm cache
#   tests-gpu    pytest tests/gpu (what `make test-gpu` runs): native triton kernels, the engine on CUDA,
#                the nccl weight transport (that one needs 2 GPUs and says so when it skips)
set -uo pipefail

cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PYTHONSAFEPATH=1

if ! command -v nvidia-smi >/dev/null || ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
	echo "make gpu-check needs a CUDA device (nvidia-smi and torch.cuda.is_available()); none here." >&2
	echo "On a machine without one: make test (the CPU suite) and the CPU benches in bench/." >&2
	exit 2
fi

out=bench/results/gpu-check-$(date -u +%Y%m%d-%H%M%S)
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv >"$out/nvidia-smi.csv"
steps=()

# step NAME SECONDS COMMAND...: run it under its limit (SIGTERM, SIGKILL 5 s later), output to NAME.log.
step() {
	local name=$1 limit=$2
	shift 2
	echo "== $name (at most ${limit} s): $*"
	local start=$SECONDS rc=0
	timeout --kill-after=5 "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
	tail -n 15 "$out/$name.log"
	if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
		echo "== $name: over its ${limit} s limit"
	fi
	echo "== $name: exit $rc after $((SECONDS - start)) s"
	steps+=("{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - start)), \"log\": \"$name.log\"}")
}

TOTAL=470 # seconds, all steps; under make's 8 minutes with the checks above
step kernels 90 "$PY" bench/attention_kernels.py --quick --out "$out/kernels.json"
step decode 80 "$PY" bench/decode_bandwidth.py --output "$out/decode-bandwidth.json"
step kv-tiers 110 "$PY" bench/kv_tiers.py --device cuda --output "$out/kv-tiers.json"
step compile 90 "$PY" bench/compile.py --device cuda --tokens 16 --repeats 1 --out "$out/compile.json"
step tests-gpu $((TOTAL - SECONDS)) "$PY" -m pytest -q tests/gpu --junitxml="$out/tests-gpu.xml"

(
	IFS=,
	echo "{\"gpu\": \"$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1)\", \"steps\": [${steps[*]}]}"
) >"$out/summary.json"
echo "wrote $out/"
failed=$(grep -o '"rc": [1-9][0-9]*' "$out/summary.json" | wc -l)
if [ "$failed" != 0 ]; then
	echo "gpu-check: $failed step(s) failed; see $out/*.log" >&2
	exit 1
fi
