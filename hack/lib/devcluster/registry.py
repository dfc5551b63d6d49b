"""Images into a node's containerd by their new layers only: buildah pushes into an OCI layout kept on the host
(writing the blobs the layout lacks), and containerd pulls from a read-only registry serving that layout on
loopback (fetching and unpacking the blobs its store lacks). A source change rebuilds the image's last layers
alone, so a node takes it in seconds; an archive (`buildah push` + `ctr import`) is the whole image each time,
7 GB read and written for the project's, minutes.

The registry speaks the part of the OCI distribution API a pull uses (`GET /v2/`, manifests by tag or digest,
blobs by digest; HEAD too), nothing else: no push, no listing. It binds 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.server
import json
import logging
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

from . import procs

log = logging.getLogger("devcluster.kubelet")

# /v2/<name>/(manifests|blobs)/<reference>: a name of path segments, a tag or a sha256 digest.
_ROUTE = re.compile(
    r"^/v2/(?P<name>[a-z0-9]+(?:[._/-][a-z0-9]+)*)/(?P<kind>manifests|blobs)/"
    r"(?P<ref>sha256:[a-f0-9]{64}|[A-Za-z0-9_][A-Za-z0-9._-]{0,127})$"
)
REF_NAME = "org.opencontainers.image.ref.name"
# The repository every image is served under (the node tags the pulled image with its buildah names after).
REPOSITORY = "kvpilot-dev/image"


def layout_tag(ref: str) -> str:
    """An image reference as a tag of the layout and the registry (`ghcr.io/x/y:1.0` -> `ghcr.io_x_y_1.0`)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", ref)[-128:]


class Layout:
    """An OCI image layout on the host that buildah pushes into; one writer at a time (a lock file)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def blob(self, digest: str) -> Path:
        algorithm, hexdigest = digest.split(":", 1)
        return self.root / "blobs" / algorithm / hexdigest

    def index(self) -> list[dict]:
        try:
            return json.loads((self.root / "index.json").read_text()).get("manifests") or []
        except (OSError, ValueError):
            return []

    def manifest_of(self, tag: str) -> dict | None:
        return next((m for m in self.index() if (m.get("annotations") or {}).get(REF_NAME) == tag), None)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root.parent / f"{self.root.name}.lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def push(self, refs: list[str]) -> None:
        """`refs` (buildah's) pushed, uncompressed (gzip costs more time than the bytes it saves on a local disk),
        then the layout pruned to them."""
        for ref in refs:
            oci = f"oci:{self.root}:{layout_tag(ref)}"
            procs.run_tool("buildah", "push", "--quiet", "--disable-compression", ref, oci, timeout=1800)
        self.prune(refs)

    def prune(self, refs: list[str]) -> None:
        """Earlier builds of the repositories of `refs` removed, and the blobs no image left uses: the layout
        holds one build of each image, not one per change."""
        tags = {layout_tag(r) for r in refs}
        repositories = tuple(layout_tag(r.rsplit(":", 1)[0]) + "_" for r in refs)
        index = json.loads((self.root / "index.json").read_text())
        index["manifests"] = [
            m
            for m in index.get("manifests") or []
            if (tag := (m.get("annotations") or {}).get(REF_NAME, "")) in tags
            or not tag.startswith(repositories)
        ]
        (self.root / "index.json").write_text(json.dumps(index))
        used: set[str] = set()
        for m in index["manifests"]:
            used.add(m["digest"])
            manifest = json.loads(self.blob(m["digest"]).read_text())
            used.update(d["digest"] for d in [manifest.get("config") or {}, *manifest.get("layers", [])] if d)
        for path in (self.root / "blobs" / "sha256").iterdir():
            if f"sha256:{path.name}" not in used:
                path.unlink()


class _Handler(http.server.BaseHTTPRequestHandler):
    layout: Layout  # set on the subclass made per server

    def do_HEAD(self) -> None:  # noqa: N802 (http.server's naming)
        self._answer(body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        if self.path == "/v2/":
            return self._send(200, b"{}", "application/json", body)
        m = _ROUTE.match(self.path)
        if m is None:
            return self._send(404, b'{"errors": [{"code": "NAME_UNKNOWN"}]}', "application/json", body)
        ref = m["ref"]
        media = "application/octet-stream"
        if m["kind"] == "manifests" and not ref.startswith("sha256:"):
            desc = self.layout.manifest_of(ref)
            if desc is None:
                return self._send(
                    404, b'{"errors": [{"code": "MANIFEST_UNKNOWN"}]}', "application/json", body
                )
            ref, media = desc["digest"], desc["mediaType"]
        elif m["kind"] == "manifests":
            desc = next((d for d in self.layout.index() if d["digest"] == ref), None)
            media = desc["mediaType"] if desc else "application/vnd.oci.image.manifest.v1+json"
        path = self.layout.blob(ref)
        if not path.is_file():
            return self._send(404, b'{"errors": [{"code": "BLOB_UNKNOWN"}]}', "application/json", body)
        size = path.stat().st_size
        self.send_response(200)
        self.send_header("Content-Type", media)
        self.send_header("Content-Length", str(size))
        self.send_header("Docker-Content-Digest", ref)
        self.end_headers()
        if body:
            with path.open("rb") as f:
                shutil.copyfileobj(f, self.wfile, 1 << 20)

    def _send(self, status: int, data: bytes, media: str, body: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", media)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's signature)
        log.debug("registry: " + format, *args)


@contextlib.contextmanager
def serving(layout: Layout) -> Iterator[str]:
    """The registry on a free loopback port while the block runs; its `host:port`."""
    handler = type("LayoutHandler", (_Handler,), {"layout": layout})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="image-registry", daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
