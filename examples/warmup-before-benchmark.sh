#!/usr/bin/env bash
# Before a benchmark run against the InferenceDeployment `llm`: its caches emptied (a PrefixCacheReset,
# verified cold), then filled with the prompts the run shares (a PrefixCacheWarmup, verified warm), so every
# run starts from the same, known cache. Each step waits for its resource's end and stops the script unless
# it succeeded. Run from the checkout; put the prefixes your benchmark shares in examples/warmup-prompts.yaml.
# Arguments go to `kvpilot bench` (e.g. --concurrency 1 4 16 --max-tokens 64).
set -euo pipefail
cd "$(dirname "$0")/.."

finish() {  # KIND NAME: wait for either end; succeed only on Succeeded
    kubectl wait --for=jsonpath='{.status.completionTime}' "$1/$2" --timeout=10m
    kubectl get "$1" "$2"
    [ "$(kubectl get "$1" "$2" -o jsonpath='{.status.phase}')" = Succeeded ]
}

finish pcr "$(kubectl create -f examples/prefixcachereset.yaml -o jsonpath='{.metadata.name}')"
kubectl apply -f examples/warmup-prompts.yaml
finish pcw "$(kubectl create -f examples/prefixcachewarmup.yaml -o jsonpath='{.metadata.name}')"
# --no-reset: the bench would otherwise reset the cache before each run, undoing the warm-up
.venv/bin/kvpilot bench --no-reset --url "$(.venv/bin/kvpilot endpoint llm)" "$@"
