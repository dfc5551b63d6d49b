"""The pod network's way to the API server: a TCP forwarder on a node's bridge.

The apiserver listens on loopback only, which a pod in its own network namespace cannot reach. The forwarder
listens on node-1's bridge address, the endpoint kube-proxy gives the `kubernetes` Service (serviceproxy.py),
and copies bytes both ways to the apiserver. TLS passes through untouched: pods verify the apiserver's own
certificate, which names the Service's ClusterIP (controlplane.py).
"""

from __future__ import annotations

import logging
import socket
import threading
from urllib.parse import urlsplit

log = logging.getLogger("devcluster.apiproxy")


def endpoint(url: str) -> tuple[str, int]:
    """(host, port) of an https URL such as a kubeconfig's server."""
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 443


class ApiProxy:
    """Forwards every connection to `listen` on to `target`, two threads per connection."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.listen, self.target = listen, target
        self._server: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    def start(self) -> None:
        self._server = socket.create_server(self.listen)
        self._server.settimeout(0.5)  # lets the accept loop notice stop()
        threading.Thread(target=self._accept_loop, name="apiproxy", daemon=True).start()
        log.info("forwarding %s:%s to the apiserver at %s:%s", *self.listen, *self.target)

    def stop(self) -> None:
        self._stopped.set()
        if self._server is not None:
            self._server.close()
        with self._lock:
            for s in self._open:
                _shutdown(s)  # wakes both pumps; the last one closes the pair

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed by stop()
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError as e:
                log.warning("apiserver unreachable at %s:%s: %s", *self.target, e)
                _close(client)
                continue
            client.settimeout(None)
            upstream.settimeout(None)
            with self._lock:
                self._open.update((client, upstream))
            pair = threading.Barrier(2, action=lambda c=client, u=upstream: self._forget(c, u))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst, pair), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, pair: threading.Barrier) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)  # pass the half-close on; the other direction may go on
        except OSError:  # reset or stopped: end both directions (wakes the other pump's recv)
            _shutdown(src)
            _shutdown(dst)
        try:
            pair.wait()  # the last of the two directions closes both sockets
        except threading.BrokenBarrierError:
            pass

    def _forget(self, *socks: socket.socket) -> None:
        with self._lock:
            for s in socks:
                self._open.discard(s)
                _close(s)


def _close(s: socket.socket) -> None:
    try:
        s.close()
    except OSError:
        pass


def _shutdown(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
