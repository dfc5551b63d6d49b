"""`helm test`: the installed operator answers a PrefixCacheReset on this cluster.

Creates a PrefixCacheReset whose selector matches no pod in the release namespace, waits until the operator
ends it Succeeded with condition Complete (reason NoTargets), and deletes it. That proves the CRDs are served,
the operator runs, watches, and may patch status. Only the Python standard library and the pod's
ServiceAccount token are used, so any image with python3 runs it.
"""

import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request

SA = "/var/run/secrets/kubernetes.io/serviceaccount"
API = f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}"
NS = os.environ["NAMESPACE"]
TIMEOUT_S = float(os.environ.get("TIMEOUT_SECONDS", "60"))
PATH = f"/apis/kvpilot.io/v1alpha1/namespaces/{NS}/prefixcacheresets"


def call(method: str, path: str, body: dict | None = None) -> dict:
    with open(f"{SA}/token") as f:
        token = f.read().strip()
    req = urllib.request.Request(API + path, method=method, data=json.dumps(body).encode() if body else None)
    req.add_header("Authorization", f"Bearer {token}")
    req.add_header("Content-Type", "application/json")
    ctx = ssl.create_default_context(cafile=f"{SA}/ca.crt")
    with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
        return json.loads(r.read() or b"{}")


def main() -> int:
    reset = {
        "apiVersion": "kvpilot.io/v1alpha1",
        "kind": "PrefixCacheReset",
        "metadata": {"generateName": "helm-test-"},
        "spec": {
            "selector": {"matchLabels": {"kvpilot.io/helm-test": "matches-no-pod"}},
            "allowNoTargets": True,  # no pod is the point: Succeeded, not Failed with reason NoTargets
            "timeoutSeconds": 30,
        },
    }
    name = call("POST", PATH, reset)["metadata"]["name"]
    print(f"created PrefixCacheReset {NS}/{name}", flush=True)
    deadline = time.monotonic() + TIMEOUT_S
    status: dict = {}
    try:
        while time.monotonic() < deadline:
            status = call("GET", f"{PATH}/{name}").get("status") or {}
            if status.get("phase") in ("Succeeded", "Failed"):
                break
            time.sleep(1)
    finally:
        try:
            call("DELETE", f"{PATH}/{name}")
        except urllib.error.URLError as e:
            print(f"could not delete {name}: {e}", file=sys.stderr)
    complete = [c for c in status.get("conditions") or [] if c.get("type") == "Complete"]
    if status.get("phase") == "Succeeded" and complete and complete[0].get("status") == "True":
        print(f"operator answered: phase Succeeded, Complete ({complete[0].get('reason')})")
        return 0
    print(
        f"the operator did not finish {name} within {TIMEOUT_S:.0f}s: status {json.dumps(status)}",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
