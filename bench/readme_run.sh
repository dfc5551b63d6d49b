#!/usr/bin/env bash
# README's benchmark table in one run: every bench it quotes, one after the other, on one machine state.
#
#     bash bench/readme_run.sh            # ~12 minutes on 2 cores; run it on a quiet machine
#
# Each bench writes its JSON under bench/results/readme-<UTC date>/ and run.log there gets the load average
# before and after each one: a figure from a loaded machine is noise, and the log says which were.
# The table quotes these files by name (README.md, "Benchmarks").
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONSAFEPATH=1 # the checkout must never be on sys.path (its operator/ shadows the stdlib)
PY=${PY:-.venv/bin/python}
out=bench/results/readme-$(date -u +%Y%m%d)
mkdir -p "$out"
log=$out/run.log
echo "# $(date -u +%FT%TZ) git $(git rev-parse --short HEAD) cpus $(nproc)" >>"$log"

run() { # run NAME ARGS...: one bench, its load before and after in run.log
	local name=$1
	shift
	echo "$(date -u +%T) $name start load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$log"
	"$PY" "$@" >"$out/$name.out" 2>&1 || echo "$(date -u +%T) $name FAILED (see $name.out)" | tee -a "$log"
	echo "$(date -u +%T) $name end load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$log"
}

run engine bench/engine.py --output "$out/engine.json"
run serve-vs-generate-batch bench/serve.py --vs-generate-batch --output "$out/serve-vs-generate-batch.json"
run serve-vs-bound bench/serve.py --vs-bound --output "$out/serve-vs-bound.json"
run serve bench/serve.py --output "$out/serve.json"
run warm-cache bench/warm_cache.py --output "$out/warm-cache.json"
run dp bench/dp.py --output "$out/dp.json"
run tp bench/tp.py --output "$out/tp.json"
run fanout-5000 bench/fanout.py --pods 5000 --out "$out/fanout-5000.json"
run fanout-10000 bench/fanout.py --pods 10000 --sequential-max-delay-ms 0 --out "$out/fanout-10000.json"
run router-cost bench/router_cost.py --out "$out/router-cost.json"
run index-memory bench/index_memory.py --output "$out/index-memory.json"
echo "# $(date -u +%FT%TZ) done" >>"$log"
