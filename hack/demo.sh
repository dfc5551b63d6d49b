#!/usr/bin/env bash
# The whole story on one machine: a dev cluster, the operator, an InferenceDeployment of two real
# kvpilot daemons and its router, traffic that warms their prefix caches, one fleet-wide reset reported per
# pod, then the same through the router's one URL: a repeated prompt lands where it is cached, and one
# POST /reset_prefix_cache (what AIPerf --reset-kv-cache sends) flushes every pod.
# Run it with `make demo`; everything it starts is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export PATH="$ROOT/.venv/bin:$PATH"   # this script's python and kvpilot (pods run the project's image)
export PYTHONSAFEPATH=1
DIR=$ROOT/.cluster
export KUBECONFIG=$DIR/kubeconfig
NS=default
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

cleanup() {
  say "tearing down"
  [[ -n "${OPERATOR_PID:-}" ]] && kill "$OPERATOR_PID" 2>/dev/null && wait "$OPERATOR_PID" 2>/dev/null || true
  python hack/cluster/devcluster.py down --dir "$DIR" >/dev/null 2>&1 || true
}
trap cleanup EXIT

say "starting the dev cluster (etcd, kube-apiserver, controller-manager, scheduler; a node of the real kubelet and containerd running the project's image)"
python hack/cluster/devcluster.py up --dir "$DIR"
kubectl apply -f crds/ >/dev/null
kubectl wait --for=condition=Established crd --all >/dev/null

say "starting the operator (log: $DIR/operator.log)"
# Free ports, not fixed ones: a busy 8080 or 9090 must not stop the demo.
read -r LIVENESS_PORT METRICS_PORT < <(python -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
kvpilot operator --standalone --bind 127.0.0.1 --liveness-port "$LIVENESS_PORT" --metrics-port "$METRICS_PORT" \
  >"$DIR/operator.log" 2>&1 &
OPERATOR_PID=$!
for _ in $(seq 60); do  # up within seconds; a failed start is shown, not waited on for minutes
  if ! kill -0 "$OPERATOR_PID" 2>/dev/null; then
    echo "the operator exited; the end of its log:" >&2; tail -20 "$DIR/operator.log" >&2; exit 1
  fi
  curl -sf "http://127.0.0.1:$LIVENESS_PORT/healthz" >/dev/null && break
  sleep 1
done

say "deploying an InferenceDeployment of 2 kvpilot daemons with an admin token and a router"
kubectl -n $NS create secret generic kvpilot-admin --from-literal=token="demo-$RANDOM$RANDOM" \
  --dry-run=client -o yaml | kubectl label --local -f - kvpilot.io/admin-token=true -o yaml \
  | kubectl apply -f - >/dev/null  # the label: its owner lets kvpilot mount the token into the fleet's pods
kubectl -n $NS apply -f - <<'EOF'
apiVersion: kvpilot.io/v1alpha1
kind: InferenceDeployment
metadata: {name: llm}
spec:
  replicas: 2
  engine: {maxNumSeqs: 8, kvCacheBlocks: 512}
  adminTokenSecretRef: {name: kvpilot-admin}
  router: {enabled: true}
EOF
echo "waiting for both daemons and the router to load the model and turn Ready (a minute or two on a small CPU)..."
kubectl -n $NS wait --for=condition=Ready infd/llm --timeout=600s
kubectl -n $NS get infd,pods -o wide

IPS=$(kubectl -n $NS get pods -l kvpilot.io/inference-deployment=llm -o jsonpath='{.items[*].status.podIP}')
ask() {  # one chat request to HOST:PORT [QUESTION]; prints the cached prompt tokens it was served with
  curl -s "http://$1/v1/chat/completions" -H 'Content-Type: application/json' -d '{
    "model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0,
    "messages": [{"role": "system", "content": "You are a terse assistant for an inference platform team. Answer in one short sentence."},
                 {"role": "user", "content": "'"${2:-What does a prefix cache do?}"'"}]}' \
  | python -c 'import json, sys; u = json.load(sys.stdin)["usage"]; print("prompt", u["prompt_tokens"], "tokens, cached", u["prompt_tokens_details"]["cached_tokens"])'
}
say "warming each pod's prefix cache: the second identical request is served from cache"
for ip in $IPS; do echo "pod $ip: $(ask "$ip:8000") -> $(ask "$ip:8000")"; done

say "kvpilot reset llm --wait   (creates a PrefixCacheReset and follows it pod by pod)"
kvpilot reset llm -n $NS --wait
kubectl -n $NS get pcr

say "the next request on every pod starts cold again"
for ip in $IPS; do echo "pod $ip: $(ask "$ip:8000")"; done
kubectl -n $NS get infd llm -o jsonpath='{"lastReset: "}{.status.lastReset}{"\n"}'

say "one URL for the fleet: the router (spec.router), which knows what every pod caches from their KV events"
kubectl -n $NS get infd llm -o jsonpath='{"status.endpoint: "}{.status.endpoint}{"\n"}'
# The dev cluster has no kube-proxy or DNS: reach the router's pod, as the Service would.
ROUTER=$(kubectl -n $NS get pods -l kvpilot.io/router=llm -o jsonpath='{.items[0].status.podIP}'):8080
Q="Why would a router send a repeated prompt to the same pod?"   # a prompt no pod has seen yet
echo "router $ROUTER: $(ask "$ROUTER" "$Q") -> $(ask "$ROUTER" "$Q")   (the second lands on the pod that cached the first)"

say "POST /reset_prefix_cache on the router (as AIPerf --reset-kv-cache does): every pod, one answer"
TOKEN=$(kubectl -n $NS get secret kvpilot-admin -o jsonpath='{.data.token}' | base64 -d)
curl -s -X POST "http://$ROUTER/reset_prefix_cache" -H "Authorization: Bearer $TOKEN" | python -c '
import json, sys
r = json.load(sys.stdin)
print("success:", r["success"])
for p in r["pods"]:
    print("  %s: success %s, epoch %s" % (p["pod"], p["success"], p["epoch"]))'
echo "router $ROUTER: $(ask "$ROUTER" "$Q")   (cold again)"
