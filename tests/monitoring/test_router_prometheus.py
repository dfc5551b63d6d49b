"""The router dashboard and alerts against a real router: a real Prometheus scrapes `kvpilot router` in front of
two daemons on loopback (tests/router's fleet) with the labels the chart's router PodMonitor gives (job
kvpilot-router, namespace, deployment; honor_labels, so `pod` is the daemon routed to). After prefix-routed traffic, a request a pod refuses, a refused and a successful fleet
reset, every panel, annotation and variable query of router.json (Grafana's variables substituted) returns
data that is not only NaN, and the router's alert rules evaluate without error and stay silent."""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import partial

import pytest
import yaml
from chart.tools import tool
from router.test_router import SYSTEM, ask, ask_indexed

from monitoring.dashboards import ALERTS, ROUTER_DASHBOARD
from monitoring.prometheus import Prometheus, static_config
from support.procs import wait_for
from support.servers import MODEL, Fleet

pytestmark = pytest.mark.timeout(600)

NAMESPACE, DEPLOYMENT, JOB = "router-ns", "llm", "kvpilot-router"


@pytest.fixture(scope="module")
def prometheus(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """Scrapes the fleet's router every second (a static target with the PodMonitor's target labels) and
    evaluates the router's alert rules."""
    scrape = [
        {
            "job_name": JOB,
            "honor_labels": True,
            "static_configs": [
                {
                    "targets": [f"127.0.0.1:{fleet.router.port}"],
                    "labels": {"namespace": NAMESPACE, "deployment": DEPLOYMENT},
                }
            ],
        }
    ]
    groups = [g for g in yaml.safe_load(ALERTS.read_text())["groups"] if g["name"] == "kvpilot-router"]
    assert groups, "no kvpilot-router rule group"
    workdir = tmp_path_factory.mktemp("prometheus")
    prom = Prometheus(tool("prometheus"), workdir, static_config(workdir, scrape, groups, interval="1s"))
    try:
        wait_for(prom.ready, 60, "prometheus /-/ready")
        yield prom
    finally:
        prom.stop()


def drive(fleet: Fleet) -> None:
    """Traffic that gives every router metric samples: a shared prefix routed by the index, a request the
    pod refuses (400), a reset without the admin token (401) and one through the router (200)."""
    first, _ = ask_indexed(fleet, SYSTEM + " (dashboard)", "When do you open?")
    for user in ("How much is a tyre?", "Do you fix brakes?"):
        pod, c = ask(fleet, SYSTEM + " (dashboard)", user)
        assert pod == first and c.usage.prompt_tokens_details.cached_tokens > 0, (pod, first, c.usage)
    refused = fleet.router.request(
        "POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": -1}
    )
    assert refused.status == 400, refused.body
    wrong = fleet.router.request("POST", "/reset_prefix_cache", headers={"Authorization": "Bearer wrong"})
    assert wrong.status == 401, wrong.body
    fleet.router.reset()


def test_prometheus_answers_every_router_query(fleet: Fleet, prometheus: Prometheus) -> None:
    wait_for(lambda: prometheus.query(f'up{{job="{JOB}"}} == 1'), 30, "prometheus scraping the router")
    # A series born with a new label set starts at its first value, which rate() cannot see: a second round,
    # once Prometheus has the first, gives every series an increase inside the window (as steady traffic does).
    for _ in range(2):
        drive(fleet)
        resets = fleet.router.metrics()['kvpilot_router_fleet_resets_total{result="success"}']
        query = f'kvpilot_router_fleet_resets_total{{result="success"}} >= {resets}'
        wait_for(partial(prometheus.query, query), 30, "the last fleet reset in prometheus")
    time.sleep(3)  # three more scrapes after the last request

    variables = {"namespace": NAMESPACE, "deployment": DEPLOYMENT, "pod": ".*", "datasource": "prometheus"}
    checked, unanswered = prometheus.unanswered(ROUTER_DASHBOARD, variables, "1m", "15m")
    assert not unanswered, "\n".join(unanswered)
    # The pod label is the pod routed to (honor_labels kept it), one value per daemon.
    pods = {
        s["metric"]["pod"] for s in prometheus.query(f'kvpilot_router_pod_ready{{namespace="{NAMESPACE}"}}')
    }
    assert pods == {f"127.0.0.1:{d.port}" for d in fleet.daemons}, pods
    print(f"verified against the live Prometheus: {checked} router dashboard queries")


def test_router_alerts_evaluate_and_stay_silent(fleet: Fleet, prometheus: Prometheus) -> None:
    """Every pod ready and no KV event lost: both rules evaluate cleanly on the real metrics and select nothing."""
    rules = wait_for(prometheus.evaluated_alerts, 30, "every router alert rule evaluated")
    assert {r["name"] for r in rules} == {"KvpilotRouterNoReadyPod", "KvpilotRouterKVEventsMissed"}
    assert all(r["health"] == "ok" and r["state"] == "inactive" for r in rules), rules
    for r in rules:
        assert prometheus.query(r["query"]) == [], r["name"]
    # ... on series that are there: the rules are silent because the values say so, not for want of data.
    assert prometheus.query(f'kvpilot_router_pod_ready{{job="{JOB}"}} == 1')
    assert prometheus.query(f'kvpilot_router_kv_event_batches_total{{job="{JOB}",result="missed"}} == 0')
