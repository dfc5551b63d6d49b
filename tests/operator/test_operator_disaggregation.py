"""A disaggregated InferenceDeployment (spec.disaggregation, docs/disaggregation.md) on the dev cluster: the
API server refuses what cannot run, and real `kvpilot serve` daemons in both roles, as the operator starts
them, hand a prompt's KV from the prefill pod to the decode pod, by hand and through the fleet's router
(`kvpilot router --fleet`, which learns the roles from the fleet); a PrefixCacheReset reports every pod with
its role and proves both cold. The pure parts are in test_operator_disaggregation_parts.py and
tests/router/test_fleet_roles.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest
from monitoring.dashboards import DASHBOARDS, DISAGGREGATION_ROW, METRIC_NAME, load, row_panels
from prometheus_client.parser import text_string_to_metric_families

from support import ROOT
from support.cluster import Cluster
from support.operator import apply_ns, fleet, fleet_pods, http, infd, pcr
from support.procs import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

ROLES = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}
BAD_SPECS = [
    ({"disaggregation": ROLES, "replicas": 3}, "replicas cannot be set with disaggregation"),
    ({"disaggregation": ROLES, "engine": {"dataParallelSize": 2}}, "one engine per pod"),
    ({"disaggregation": ROLES, "engine": {"tensorParallelSize": 2}}, "one engine per pod"),
    ({"disaggregation": ROLES, "placement": "DaemonSet"}, "disaggregation needs placement Deployment"),
    ({"disaggregation": ROLES, "port": 14579}, "port 14579 is the prefill pods' KV-transfer port"),
    (
        {"disaggregation": {"prefill": {"replicas": 0}, "decode": {"replicas": 2}}},
        "both 0 (the fleet stopped) or both at least 1",
    ),
    ({"disaggregation": {"prefill": {"replicas": -1}, "decode": {}}}, "spec.disaggregation.prefill.replicas"),
    ({"disaggregation": {"prefill": {}}}, "spec.disaggregation.decode: Required value"),
    (
        {"disaggregation": ROLES, "router": {"enabled": True, "endpointPicker": {"enabled": True}}},
        "endpointPicker cannot be used with disaggregation",
    ),
]


def test_disaggregation_specs_the_api_server_refuses(
    cluster: Cluster, namespace: str, operator_kubeconfig: Path
) -> None:
    for spec, message in BAD_SPECS:
        doc = json.dumps({**fleet("bad", spec), "metadata": {"name": "bad", "namespace": namespace}})
        r = cluster.kubectl("apply", "-f", "-", input=doc, check=False)
        assert r.returncode != 0 and message in r.stderr, (spec, r.stderr)
    # a stopped fleet (no pod of either role), and each role's replicas defaulted
    stopped = {"prefill": {"replicas": 0}, "decode": {"replicas": 0}}
    apply_ns(cluster, namespace, fleet("stopped", {"disaggregation": stopped}))
    apply_ns(cluster, namespace, fleet("defaulted", {"disaggregation": {"prefill": {}, "decode": {}}}))
    assert infd(cluster, namespace, "defaulted")["spec"]["disaggregation"] == ROLES
    example = str(ROOT / "examples" / "disaggregated-fleet.yaml")
    cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", example)
    assert (
        "prefill/decode disaggregation"
        in cluster.kubectl("explain", "infd.spec.disaggregation").stdout.lower()
    )


def _completion(ip: str, prompt: str, max_tokens: int, params: dict) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "kv_transfer_params": params}
    return http("POST", f"http://{ip}:8000/v1/completions", body)


def _metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _router_url(cluster: Cluster, ns: str, name: str) -> str:
    """The fleet router's URL from this host, as `kvpilot endpoint` prints it (the dev cluster has no DNS)."""
    r = subprocess.run(
        [sys.executable, "-m", "kvpilot", "endpoint", name, "-n", ns],
        env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and "router pod" in r.stderr, r.stderr
    return r.stdout.strip()


def test_real_daemons_in_both_roles_hand_over_kv_and_reset_with_their_roles(
    cluster: Cluster, ns: str
) -> None:
    spec = {
        "disaggregation": ROLES,
        "router": {"enabled": True},
        "engine": {"kvCacheBlocks": 256, "maxNumSeqs": 4, "maxModelLen": 512},
    }
    apply_ns(cluster, ns, fleet("pd", spec))
    cluster.kubectl("wait", "--for=condition=Ready", "infd/pd", "-n", ns, "--timeout=300s")
    st = infd(cluster, ns, "pd")["status"]
    assert st["workload"] == "Deployment/pd-prefill,Deployment/pd-decode"
    assert (st["replicas"], st["readyReplicas"]) == (2, 2)
    for role in ("prefill", "decode"):
        assert st["disaggregation"][role] == {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}
    header, row = cluster.kubectl("get", "infd", "pd", "-n", ns).stdout.splitlines()
    # kubectl's columns by where each header starts (the empty MODEL column leaves no word to split on)
    starts = [header.index(col) for col in header.split()] + [len(row)]
    cols = {col: row[a:b].strip() for col, a, b in zip(header.split(), starts, starts[1:], strict=False)}
    assert (cols["PREFILL"], cols["DECODE"]) == ("1", "1"), (header, row)
    ips = {
        p["metadata"]["labels"]["kvpilot.io/role"]: p["status"]["podIP"]
        for p in fleet_pods(cluster, ns, "pd")
    }
    names = {
        p["metadata"]["name"]: p["metadata"]["labels"]["kvpilot.io/role"]
        for p in fleet_pods(cluster, ns, "pd")
    }
    assert sorted(ips) == ["decode", "prefill"]

    # The prefill pod holds the prompt's KV on the port the operator gave it; the decode pod pulls it there.
    prompt = f"Harbour log {uuid.uuid4().hex}: every ship that passes the cape at night is written down. " * 6
    ask = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}
    held = _completion(ips["prefill"], prompt, 1, ask)["kv_transfer_params"]
    assert held["remote_port"] == 14579 and held["remote_block_keys"], held
    decoded = _completion(ips["decode"], prompt, 4, held)
    assert decoded["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * len(held["remote_block_keys"])
    sent, received = _metrics(f"http://{ips['prefill']}:8000"), _metrics(f"http://{ips['decode']}:8000")
    assert sent[("kvpilot_kv_transfer_blocks_total", (("direction", "sent"),))] > 0
    assert received[("kvpilot_kv_transfer_blocks_total", (("direction", "received"),))] > 0
    # every metric of the fleet dashboard's disaggregation row is served (the chart's Prometheus test has
    # no disaggregated fleet to ask)
    board = load(next(p for p in DASHBOARDS if p.name == "fleet-cache.json"))
    used = {
        m
        for p in row_panels(board, DISAGGREGATION_ROW)
        for t in p["targets"]
        for m in METRIC_NAME.findall(t["expr"])
    }
    assert used and used <= {name for name, _ in received}, used

    # The fleet's router (`kvpilot router --fleet pd`, no flag naming roles) found both pods with their roles
    # and runs each chat as P/D: prefilled on the prefill pod, decoded on the decode pod, which pulled the
    # prompt (its cached tokens, on a prompt neither pod had seen).
    router = _router_url(cluster, ns, "pd")
    assert {p["pod"]: p["role"] for p in http("GET", f"{router}/health")["pods"]} == names
    chat = {
        "messages": [{"role": "user", "content": prompt.replace("Harbour", "Lighthouse")}],
        "max_tokens": 4,
        "temperature": 0,
    }
    req = urllib.request.Request(
        f"{router}/v1/chat/completions", json.dumps(chat).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        assert names[r.headers["X-Kvpilot-Pod"]] == "decode"
        usage = json.loads(r.read())["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0, usage
    transferred = ("kvpilot_router_pd_requests_total", (("outcome", "transferred"),))
    assert _metrics(router)[transferred] == 1

    # A reset reaches both roles, names each pod's role and proves each cold.
    apply_ns(cluster, ns, pcr("flush", {"targetRef": {"name": "pd"}}))
    cluster.kubectl("wait", "--for=condition=Complete", "pcr/flush", "-n", ns, "--timeout=120s")
    rst = cluster.kubectl_json("get", "pcr", "flush", "-n", ns)["status"]
    assert {p["name"]: p["role"] for p in rst["pods"]} == names, rst["pods"]
    assert all(p["result"] == "Succeeded" and p["verified"] == "cold" for p in rst["pods"]), rst["pods"]
    assert (rst["succeeded"], rst["verifiedCold"], rst["verified"]) == (2, 2, "2/2")

    # Colocated again: the role Deployments go, one Deployment of the fleet's name comes.
    cluster.kubectl(
        "patch",
        "infd",
        "pd",
        "-n",
        ns,
        "--type=json",
        "-p",
        '[{"op":"remove","path":"/spec/disaggregation"}]',
    )
    wait_for(
        lambda: (
            infd(cluster, ns, "pd")["status"].get("workload") == "Deployment/pd"
            and "disaggregation" not in infd(cluster, ns, "pd")["status"]
        ),
        60,
        "status of a colocated fleet",
    )
    deployments = {
        d["metadata"]["name"] for d in cluster.kubectl_json("get", "deployments", "-n", ns)["items"]
    }
    assert deployments == {"pd", "pd-router"}, deployments
    # ...and the same router follows: the colocated pod, without a role (whole requests again).
    wait_for(
        lambda: [p["role"] for p in http("GET", f"{router}/health")["pods"] if p["ready"]] == [None],
        240,
        "the router to follow the colocated pod",
        interval=1,
    )
