"""Weight updates through the real daemon (embedded model, version v1 at start): vLLM's RL routes and
SGLang's one-call route, the output afterwards equal to transformers on the new checkpoint, the version
everywhere, the cache fenced by version, and refusals (order, incompatible tensors, missing checkpoints,
the admin token, a pinned version)."""

from __future__ import annotations

from pathlib import Path

import msgpack
import zmq

from support.servers import Server
from support.weights import admin, complete, greedy, prompt_ids, refused_at_start, stage_incompatible, update

TOKENS = 6


def _same_text(server: Server, ids: list[int], checkpoint, reply: dict) -> None:  # noqa: ANN001
    from support.weights import tokenizer

    want = tokenizer(checkpoint).decode(list(greedy(checkpoint, tuple(ids), TOKENS)))
    assert reply["choices"][0]["text"] == want, (reply, want)


def test_update_serves_the_new_weights_everywhere(
    quiet: Server, original_checkpoint, changed_checkpoint, events_port
) -> None:  # noqa: ANN001
    srv = quiet
    ids = prompt_ids(original_checkpoint)
    assert greedy(original_checkpoint, tuple(ids), TOKENS) != greedy(changed_checkpoint, tuple(ids), TOKENS)
    before = complete(srv, ids, TOKENS)
    _same_text(srv, ids, original_checkpoint, before)
    assert before["system_fingerprint"] == "v1"
    again = complete(srv, ids, TOKENS)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # cached under v1

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{events_port}")
    try:
        import time

        time.sleep(0.5)  # the subscription reaches the publisher
        done = update(srv, changed_checkpoint, "v2")
        assert done["weight_version"] == "v2" and done["digest"].startswith("sha256:")

        after = complete(srv, ids, TOKENS)
        _same_text(srv, ids, changed_checkpoint, after)
        assert after["system_fingerprint"] == "v2"
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # v1's KV never matches

        events = _events(sub, until=lambda evs: any(e["type"] == "BlockStored" for e in evs))
        cleared = [e for e in events if e["type"] == "AllBlocksCleared"]
        assert cleared and cleared[-1] == {"type": "AllBlocksCleared", "weight_version": "v2"}, events
        from kvpilot.kv.block_keys import key_scheme

        stored = [h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]]
        assert stored[0] == key_scheme().prompt_hashes(ids, 16, None, "v2")[0]  # the version is in the key
        assert stored[0] != key_scheme().prompt_hashes(ids, 16, None, "v1")[0]
    finally:
        sub.close(0)

    assert srv.request("GET", "/health").json()["weight_version"] == "v2"
    assert srv.cache()["weight_version"] == "v2"
    assert srv.request("GET", "/v1/models").json()["data"][0]["weight_version"] == "v2"
    info = admin(srv, "GET", "/weight_info")
    assert info["weight_version"] == "v2" and info["digest"] == done["digest"]
    assert admin(srv, "GET", "/get_world_size") == {"world_size": 1}
    m = srv.metrics()
    assert m[f'kvpilot_weight_version_info{{digest="{done["digest"]}",version="v2"}}'] == 1
    assert m['kvpilot_weight_updates_total{result="success"}'] >= 1
    assert m['kvpilot_weight_update_duration_seconds_count{phase="update"}'] >= 1
    assert m["kvpilot_generation_paused"] == 0

    # SGLang's one call takes it back to the embedded weights, named v3.
    r = admin(
        srv,
        "POST",
        "/update_weights_from_disk",
        {"model_path": str(original_checkpoint), "weight_version": "v3"},
    )
    assert r["success"] is True and r["weight_version"] == "v3"
    back = complete(srv, ids, TOKENS)
    _same_text(srv, ids, original_checkpoint, back)
    assert back["system_fingerprint"] == "v3"


def _events(sub: zmq.Socket, until) -> list:  # noqa: ANN001
    events: list = []
    while sub.poll(20_000):
        _topic, _seq, payload = sub.recv_multipart()
        events += msgpack.unpackb(payload, raw=False)[1]
        if until(events):
            return events
    raise AssertionError(f"no matching KV events within 20 s: {events}")


def test_out_of_order_calls_get_409(quiet: Server, changed_checkpoint) -> None:  # noqa: ANN001
    srv = quiet
    body = {"update_info": {"model_path": str(changed_checkpoint)}}
    assert admin(srv, "POST", "/update_weights", body, expect=409)["error"]["code"] == "out_of_order"
    admin(srv, "POST", "/finish_weight_update", {"weight_version": "x"}, expect=409)
    admin(srv, "POST", "/start_weight_update")
    admin(srv, "POST", "/start_weight_update", expect=409)
    assert admin(srv, "POST", "/abort_weight_update")["dropped"] is True
    admin(srv, "POST", "/finish_weight_update", {}, expect=409)
    sglang = srv.request(
        "POST", "/update_weights_from_disk", {"model_path": "/nonexistent/ckpt"}, headers=srv.admin()
    )
    assert sglang.status == 404 and sglang.json()["success"] is False


def test_incompatible_checkpoint_is_refused_naming_the_tensor(
    quiet: Server, original_checkpoint, incompatible_checkpoint, tmp_path: Path
) -> None:  # noqa: ANN001
    srv = quiet
    version = srv.request("GET", "/health").json()["weight_version"]
    ids = prompt_ids(original_checkpoint)
    before = complete(srv, ids, TOKENS)["choices"][0]["text"]
    r = stage_incompatible(srv, incompatible_checkpoint)
    assert r["tensor"] == "model.layers.3.mlp.down_proj.weight", r
    assert "model.layers.3.mlp.down_proj.weight" in r["error"]["message"]
    admin(srv, "POST", "/finish_weight_update", {"weight_version": "bad"}, expect=409)  # nothing staged
    after = complete(srv, ids, TOKENS)
    assert after["choices"][0]["text"] == before and after["system_fingerprint"] == version
    admin(srv, "POST", "/start_weight_update")
    missing = admin(
        srv, "POST", "/update_weights", {"update_info": {"model_path": "/nonexistent"}}, expect=404
    )
    assert missing["error"]["code"] == "no_checkpoint"
    # A file that is not safetensors: refused with its name (it was a 500, the reader's error unhandled).
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "model.safetensors").write_bytes(b"not a safetensors file")
    admin(srv, "POST", "/start_weight_update")
    bad = admin(srv, "POST", "/update_weights", {"update_info": {"model_path": str(garbage)}}, expect=400)
    assert bad["error"]["code"] == "incompatible_weights", bad
    assert "model.safetensors' is not a safetensors file" in bad["error"]["message"], bad
    assert srv.metrics()['kvpilot_weight_updates_total{result="refused"}'] >= 2


def test_every_route_needs_the_admin_token(quiet: Server) -> None:
    for method, path in [
        ("POST", "/pause"),
        ("POST", "/resume"),
        ("GET", "/is_paused"),
        ("POST", "/start_weight_update"),
        ("POST", "/update_weights"),
        ("POST", "/finish_weight_update"),
        ("GET", "/weight_info"),
        ("GET", "/get_world_size"),
        ("POST", "/update_weights_from_disk"),
    ]:
        r = quiet.request(
            method, path, {} if method == "POST" else None, headers={"Authorization": "Bearer wrong"}
        )
        assert r.status == 401, (path, r.status)
    assert admin(quiet, "GET", "/is_paused")["is_paused"] is False


def test_a_pinned_weight_version_must_match(quiet: Server, original_checkpoint) -> None:  # noqa: ANN001
    srv = quiet
    ids = prompt_ids(original_checkpoint)
    version = srv.request("GET", "/health").json()["weight_version"]
    assert complete(srv, ids, 2, weight_version=version)["system_fingerprint"] == version
    r = srv.request("POST", "/v1/completions", {"prompt": ids, "max_tokens": 2, "weight_version": "v-old"})
    assert r.status == 409 and r.json()["error"]["code"] == "weight_version_mismatch", r.body


def test_pause_holds_new_requests_until_resume(quiet: Server, original_checkpoint) -> None:  # noqa: ANN001
    import threading

    srv = quiet
    ids = prompt_ids(original_checkpoint)
    admin(srv, "POST", "/pause?mode=keep")
    assert admin(srv, "GET", "/is_paused")["is_paused"] is True
    assert srv.metrics()["kvpilot_generation_paused"] == 1
    got: list = []
    t = threading.Thread(target=lambda: got.append(complete(srv, ids, 2)))
    t.start()
    t.join(2.0)
    assert not got  # held while paused
    admin(srv, "POST", "/resume")
    t.join(120)
    assert got and got[0]["choices"][0]["finish_reason"] == "length"


def test_the_names_the_daemon_reports_are_reserved(quiet: Server) -> None:
    """`initial` (weights loaded unnamed: /health's weight_version, not in the block keys, where vLLM says
    "default") and `mixed` are what the daemon reports itself, so no caller may name weights so."""
    srv = quiet
    for path, field in [
        ("/finish_weight_update", "weight_version"),
        ("/update_weight_version", "new_version"),
    ]:
        for name in ("initial", "mixed"):
            r = admin(srv, "POST", path, {field: name}, expect=400)
            assert "reserved" in r["error"]["message"] and r["error"]["param"] == field, r
    r = srv.request(
        "POST",
        "/update_weights_from_disk",
        {"model_path": "/x", "weight_version": "initial"},
        headers=srv.admin(),
    )
    assert r.status == 400 and "reserved" in r.json()["error"]["message"], r.body
    assert srv.request("GET", "/health").json()["weight_version"] not in ("initial", "mixed")
    assert "reserved" in refused_at_start("--weight-version", "initial")
