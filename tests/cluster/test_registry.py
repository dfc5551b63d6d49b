"""The loopback registry that kubelet nodes pull the project's image from (devcluster.registry), over real HTTP:
what a containerd pull asks (`/v2/`, a manifest by tag then by digest, blobs; HEAD and GET), and what it must
refuse (names and digests that are not, paths out of the layout). The pull itself, by the nodes' containerd,
is tests/cluster/test_kubelet_*.py's (every image change goes through it)."""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from devcluster.registry import REF_NAME, REPOSITORY, Layout, layout_tag, serving

MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def put_blob(root: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / "sha256" / digest).write_bytes(data)
    return f"sha256:{digest}"


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Layout, str, str, bytes]:
    """A layout as `buildah push oci:` writes it: one image, its layer, config and manifest, named by a tag."""
    root = tmp_path / "oci-layout"
    layer = b"layer bytes"
    layer_digest = put_blob(root, layer)
    config_digest = put_blob(root, b"{}")
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config_digest,
                "size": 2,
            },
            "layers": [
                {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": 11}
            ],
        }
    ).encode()
    manifest_digest = put_blob(root, manifest)
    tag = layout_tag("ghcr.io/kvpilot/kvpilot:0.1.0-abc")
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": MANIFEST,
                "digest": manifest_digest,
                "size": len(manifest),
                "annotations": {REF_NAME: tag},
            }
        ],
    }
    (root / "index.json").write_text(json.dumps(index))
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return Layout(root), tag, layer_digest, layer


def get(url: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_a_pull_finds_the_manifest_by_tag_and_digest_and_its_blobs(layout) -> None:  # noqa: ANN001
    lay, tag, layer_digest, layer = layout
    with serving(lay) as host:
        base = f"http://{host}/v2/{REPOSITORY}"
        assert get(f"http://{host}/v2/")[0] == 200
        status, headers, body = get(f"{base}/manifests/{tag}")
        assert status == 200 and headers["Content-Type"] == MANIFEST
        digest = headers["Docker-Content-Digest"]
        assert digest == "sha256:" + hashlib.sha256(body).hexdigest()
        assert get(f"{base}/manifests/{digest}")[2] == body
        status, headers, empty = get(f"{base}/blobs/{layer_digest}", "HEAD")
        assert (status, headers["Content-Length"], empty) == (200, str(len(layer)), b"")
        assert get(f"{base}/blobs/{layer_digest}")[2] == layer


@pytest.mark.parametrize(
    "path",
    [
        "/v2/kvpilot-dev/image/manifests/no-such-tag",
        "/v2/kvpilot-dev/image/blobs/sha256:" + "0" * 64,  # well formed, absent
        "/v2/kvpilot-dev/image/blobs/sha256:../../index.json",  # out of the layout
        "/v2/kvpilot-dev/image/blobs/sha512:" + "0" * 128,  # only sha256 is served
        "/v2/../etc/passwd",
        "/v2/kvpilot-dev/image/tags/list",  # no listing
        "/v2/UPPER/manifests/latest",
    ],
)
def test_what_is_not_in_the_layout_is_404(layout, path: str) -> None:  # noqa: ANN001
    with serving(layout[0]) as host:
        status, _, body = get(f"http://{host}{path}")
    assert status == 404 and b"errors" in body


def test_push_keeps_one_build_per_image_and_the_blobs_they_use(layout) -> None:  # noqa: ANN001
    """What `Layout.push` does after buildah's pushes: an earlier build of the same repository, and its blobs
    no kept image shares, go; another repository's image stays."""
    lay, tag, layer_digest, _ = layout
    old_only = put_blob(lay.root, b"an old layer")
    index = json.loads((lay.root / "index.json").read_text())
    old_manifest = json.dumps({"layers": [{"digest": old_only}, {"digest": layer_digest}]}).encode()
    pause_manifest = json.dumps({"layers": []}).encode()
    index["manifests"] += [
        {
            "digest": put_blob(lay.root, old_manifest),
            "annotations": {REF_NAME: layout_tag("ghcr.io/kvpilot/kvpilot:0.1.0-old")},
        },
        {
            "digest": put_blob(lay.root, pause_manifest),
            "annotations": {REF_NAME: layout_tag("localhost/pause:1")},
        },
    ]
    (lay.root / "index.json").write_text(json.dumps(index))
    lay.prune(["ghcr.io/kvpilot/kvpilot:0.1.0-abc"])
    kept = [m["annotations"][REF_NAME] for m in lay.index()]
    assert kept == [tag, layout_tag("localhost/pause:1")]
    assert not lay.blob(old_only).exists() and lay.blob(layer_digest).exists()
