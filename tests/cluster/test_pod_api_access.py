"""The pieces that give pods their way to the API server, without a cluster.

The same pieces run end to end in test_incluster.py; these pin down the
kubelet rules they follow and the forwarder's byte-for-byte copying.
"""

from __future__ import annotations

import socket
import threading

from devcluster import apiproxy, mountns
from devcluster.podspec import refresh_time
from support.procs import free_port


def test_token_renewed_at_80_percent_of_the_requested_lifetime() -> None:
    assert refresh_time(1000.0, 600, 1600.0) == 1000.0 + 480
    # The apiserver extends a 3607 s token to a year; the kubelet still renews it within the hour.
    assert refresh_time(0.0, 3607, 365 * 86400.0) == 0.8 * 3607
    # A token that expires sooner than asked is renewed by its real lifetime.
    assert refresh_time(0.0, 3607, 1000.0) == 800.0
    # Never later than a day, whatever was asked.
    assert refresh_time(0.0, 10 * 86400, 10 * 86400.0) == 86400.0


def test_service_env_is_what_a_kubelet_sets() -> None:
    env = apiproxy.service_env("10.244.0.1", 443)
    assert env["KUBERNETES_SERVICE_HOST"] == "10.244.0.1"
    assert env["KUBERNETES_SERVICE_PORT"] == env["KUBERNETES_SERVICE_PORT_HTTPS"] == "443"
    assert env["KUBERNETES_PORT"] == env["KUBERNETES_PORT_443_TCP"] == "tcp://10.244.0.1:443"
    assert env["KUBERNETES_PORT_443_TCP_ADDR"] == "10.244.0.1"
    assert apiproxy.endpoint("https://127.0.0.1:6443") == ("127.0.0.1", 6443)


def test_sa_source_finds_the_mount_at_the_standard_path(tmp_path) -> None:
    dirs = {"kube-api-access-x": tmp_path / "a", "data": tmp_path / "b"}
    container = {
        "volumeMounts": [
            {"name": "data", "mountPath": "/data"},
            {"name": "kube-api-access-x", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount/"},
        ]
    }
    assert mountns.sa_source(container, dirs) == tmp_path / "a"
    assert mountns.sa_source({"volumeMounts": [{"name": "data", "mountPath": "/data"}]}, dirs) is None


def test_hosts_file_is_the_kubelets_plus_the_api_names() -> None:
    pod = {
        "metadata": {"name": "x" * 70},
        "spec": {"hostAliases": [{"ip": "10.1.2.3", "hostnames": ["db", "db.local"]}]},
    }
    assert mountns.pod_hostname(pod) == "x" * 63  # the kernel's limit, as the kubelet cuts it
    hosts = mountns.hosts_file(pod, "10.244.1.2", "10.244.0.1").splitlines()
    assert "127.0.0.1\tlocalhost" in hosts
    assert f"10.244.1.2\t{'x' * 63}" in hosts
    assert (
        "10.244.0.1\tkubernetes kubernetes.default kubernetes.default.svc kubernetes.default.svc.cluster.local"
        in hosts
    )
    assert hosts[-1] == "10.1.2.3\tdb db.local"


def test_proxy_copies_both_ways_and_half_closes() -> None:
    upstream = socket.create_server(("127.0.0.1", 0))
    received = []

    def serve() -> None:
        conn, _ = upstream.accept()
        with conn:
            data = b""
            while chunk := conn.recv(65536):  # until the client's half-close arrives
                data += chunk
            received.append(data)
            conn.sendall(data[::-1])

    threading.Thread(target=serve, daemon=True).start()
    listen = ("127.0.0.1", free_port())
    proxy = apiproxy.ApiProxy(listen, upstream.getsockname())
    proxy.start()
    try:
        payload = bytes(range(256)) * 1000
        with socket.create_connection(listen, timeout=10) as c:
            c.sendall(payload)
            c.shutdown(socket.SHUT_WR)
            reply = b""
            while chunk := c.recv(65536):
                reply += chunk
        assert received == [payload]
        assert reply == payload[::-1]
    finally:
        proxy.stop()
        upstream.close()
