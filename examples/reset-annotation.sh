#!/usr/bin/env bash
# Trigger a reset from a pipeline without writing a PrefixCacheReset: every new value of the annotation
# makes the operator create one reset (owned by the fleet, deleted a day after it finished).
set -euo pipefail
kubectl annotate --overwrite infd/llm kvpilot.io/reset-prefix-cache="run-$(date +%s)"
kubectl get pcr -l kvpilot.io/inference-deployment=llm
