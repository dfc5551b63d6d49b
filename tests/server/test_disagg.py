"""Prefill/decode disaggregation through two real daemons on loopback (docs/disaggregation.md): a prefill pod
holds a prompt's KV, a decode pod pulls it over the transfer port and answers token-identical to one pod doing
both; resets on either side, a dead prefill pod, hostile transfer clients and bad params, and a soak of resets
at random moments of a P/D load. (The engine's side alone: tests/engine/test_disagg.py.)"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import struct
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator

import pytest

from kvpilot.daemon.server.disagg import SIGNATURE, signature, transfer_key
from kvpilot.protocol.kv_transfer import PREFILL_ASK
from support.procs import free_port, wait_for
from support.servers import ADMIN_TOKEN, Server, start_pd_pair, stop_server, transfer_config

BS = 16
TOPICS = ["tides", "volcanoes", "glaciers", "comets", "coral reefs", "deserts", "auroras", "monsoons"]


def chat_body(topic: str, **extra: object) -> dict:
    text = (
        f"Write a short, factual paragraph about {topic} for a science newsletter aimed at curious "
        "teenagers. Mention how scientists measure it, one surprising fact, and why it matters for people "
        f"living today. Keep it under eighty words and do not use lists. Topic: {topic}."
    )
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 12, "temperature": 0, **extra}


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    prefill, decode = start_pd_pair(tmp_path_factory.mktemp("pd"))
    yield prefill, decode
    for s in (prefill, decode):
        stop_server(s)


def post(server: Server, body: dict, path: str = "/v1/chat/completions") -> dict:
    r = server.request("POST", path, body)
    assert r.status == 200, r.body
    return r.json()


def prefill_then_decode(
    prefill: Server, decode: Server, body: dict, path: str = "/v1/chat/completions"
) -> tuple[dict, dict]:
    """What vllm-router's P/D mode does: the prefill with max_tokens 1, then the body and its params."""
    pre = post(prefill, {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_ASK}, path)
    dec = post(decode, {**body, "kv_transfer_params": pre["kv_transfer_params"]}, path)
    return pre, dec


def text(reply: dict) -> str:
    choice = reply["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def held_blocks(reply: dict) -> int:
    return len(reply["kv_transfer_params"]["remote_block_keys"])


def failures(server: Server, reason: str) -> float:
    return server.metrics()[f'kvpilot_kv_transfer_failures_total{{reason="{reason}"}}']


def test_a_chat_prefilled_on_one_pod_is_decoded_on_the_other_token_identical(pd) -> None:  # noqa: ANN001
    prefill, decode = pd
    body = chat_body("tides")
    alone = post(prefill, body)  # one pod doing both
    prefill.reset()
    sent, received = (s.metrics() for s in pd)
    pre, dec = prefill_then_decode(prefill, decode, body)
    params = pre["kv_transfer_params"]
    assert (
        params["do_remote_prefill"] is True and params["remote_port"] and params["remote_host"] == "127.0.0.1"
    )
    n = held_blocks(pre)
    assert n == (pre["usage"]["prompt_tokens"] - 1) // BS > 2
    assert text(dec) == text(alone)
    assert cached(dec) == n * BS  # every full block came from the prefill pod, none computed here
    after_sent, after_received = (s.metrics() for s in pd)
    key = 'kvpilot_kv_transfer_blocks_total{direction="%s"}'
    assert after_sent[key % "sent"] - sent[key % "sent"] == n
    assert after_received[key % "received"] - received[key % "received"] == n
    producer_side, consumer_side = prefill.cache()["kv_transfer"], decode.cache()["kv_transfer"]
    assert producer_side["role"] == "kv_producer" and consumer_side["role"] == "kv_consumer"
    assert (
        producer_side["held"]["transfers"] == 0 and producer_side["sending"] == 0
    )  # the pull spent the hold
    assert consumer_side["landed_blocks"] >= n and consumer_side["pulls_in_flight"] == 0


def test_a_streamed_completion_decodes_from_the_pulled_blocks(pd) -> None:  # noqa: ANN001
    prefill, decode = pd
    body = {
        "prompt": chat_body("volcanoes")["messages"][0]["content"] * 2,
        "max_tokens": 10,
        "temperature": 0,
    }
    alone = post(prefill, body, "/v1/completions")
    pre = post(prefill, {**body, "max_tokens": 1, "kv_transfer_params": PREFILL_ASK}, "/v1/completions")
    r = decode.request(
        "POST",
        "/v1/completions",
        {
            **body,
            "stream": True,
            "stream_options": {"include_usage": True},
            "kv_transfer_params": pre["kv_transfer_params"],
        },
    )
    assert r.status == 200, r.body
    chunks = [json.loads(line[6:]) for line in r.body.decode().splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text(alone)
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == held_blocks(pre) * BS


def test_a_decode_pod_pulls_only_the_blocks_it_lacks(pd) -> None:  # noqa: ANN001
    """The decode pod holds the first prompt's blocks: a second prompt that shares them pulls its own tail."""
    prefill, decode = pd
    first = chat_body("glaciers")
    prefill_then_decode(prefill, decode, first)
    second = chat_body(
        "glaciers",
        messages=[
            *first["messages"],
            {"role": "assistant", "content": "Glaciers are rivers of ice."},
            {
                "role": "user",
                "content": "Now say why they retreat, with two causes and one consequence for rivers downstream.",
            },
        ],
    )
    before = decode.metrics()['kvpilot_kv_transfer_blocks_total{direction="received"}']
    pre, dec = prefill_then_decode(prefill, decode, second)
    pulled = decode.metrics()['kvpilot_kv_transfer_blocks_total{direction="received"}'] - before
    assert 0 < pulled < held_blocks(pre)
    assert cached(dec) == held_blocks(pre) * BS


def test_a_prefill_pod_reset_drops_held_kv_and_the_decode_pod_computes(pd) -> None:  # noqa: ANN001
    prefill, decode = pd
    body = chat_body("comets")
    alone = post(decode, body)
    decode.reset()
    gone = failures(decode, "gone")
    pre = post(prefill, {**body, "max_tokens": 1, "kv_transfer_params": PREFILL_ASK})
    assert prefill.cache()["kv_transfer"]["held"]["transfers"] == 1
    reset = prefill.reset()  # never waits for the pull
    assert reset["success"] and reset["dropped_holds"] == 1
    dec = post(decode, {**body, "kv_transfer_params": pre["kv_transfer_params"]})
    assert text(dec) == text(alone)
    assert cached(dec) == 0
    assert failures(decode, "gone") == gone + 1


def test_an_unreachable_prefill_pod_costs_a_recompute_not_an_error(pd) -> None:  # noqa: ANN001
    prefill, decode = pd
    body = chat_body("deserts")
    pre = post(prefill, {**body, "max_tokens": 1, "kv_transfer_params": PREFILL_ASK})
    params = {**pre["kv_transfer_params"], "remote_port": free_port()}  # nothing listens there
    params[SIGNATURE] = signature(transfer_key(ADMIN_TOKEN), params)  # as the fleet would sign it
    before = failures(decode, "unreachable")
    dec = post(decode, {**body, "kv_transfer_params": params})
    assert dec["choices"][0]["finish_reason"] and cached(dec) < held_blocks(pre) * BS  # its own hits only
    assert failures(decode, "unreachable") == before + 1
    assert prefill.reset()["dropped_holds"] == 1  # the hold nobody could pull


def test_params_the_fleet_did_not_sign_make_no_connection(pd) -> None:  # noqa: ANN001
    """A client that writes its own params (where to connect, what to land under which keys) gets its answer
    computed on the decode pod: no connection is made, nothing is landed, the refusal is counted."""
    prefill, decode = pd
    body = chat_body("the tides of Fundy")
    pre = post(prefill, {**body, "max_tokens": 1, "kv_transfer_params": PREFILL_ASK})
    trap = socket.create_server(("127.0.0.1", 0))
    trap.settimeout(0.5)
    forged = {**pre["kv_transfer_params"], "remote_port": trap.getsockname()[1]}  # signature now wrong
    before = failures(decode, "untrusted")
    try:
        dec = post(decode, {**body, "kv_transfer_params": forged})
        with pytest.raises(TimeoutError):
            trap.accept()
    finally:
        trap.close()
    assert failures(decode, "untrusted") == before + 1
    assert cached(dec) < held_blocks(pre) * BS
    unsigned = {k: v for k, v in pre["kv_transfer_params"].items() if k != SIGNATURE}
    post(decode, {**body, "kv_transfer_params": unsigned})
    assert failures(decode, "untrusted") == before + 2
    assert prefill.reset()["dropped_holds"] == 1  # never pulled


def test_kv_of_another_salt_is_never_landed_and_its_hold_is_released(pd) -> None:  # noqa: ANN001
    """The decode request's salt differs from the prefill's: no held key is its own, so nothing is pulled
    (counted incompatible), and the hold is let go at once rather than kept until its timeout."""
    prefill, decode = pd
    body = chat_body("coral reefs")
    pre = post(
        prefill, {**body, "cache_salt": "tenant-a", "max_tokens": 1, "kv_transfer_params": PREFILL_ASK}
    )
    assert prefill.cache()["kv_transfer"]["held"]["transfers"] == 1
    before = failures(decode, "incompatible")
    dec = post(decode, {**body, "cache_salt": "tenant-b", "kv_transfer_params": pre["kv_transfer_params"]})
    assert cached(dec) == 0
    assert failures(decode, "incompatible") == before + 1
    wait_for(lambda: prefill.cache()["kv_transfer"]["held"]["transfers"] == 0, 10, "the release")


def keys(n: int = 2) -> list[str]:
    return ["ab" * 32] * n


DECODE_PARAMS = {
    "do_remote_prefill": True,
    "remote_host": "127.0.0.1",
    "remote_port": 1,
    "remote_request_id": "x",
    "remote_block_keys": keys(),
    "remote_epoch": 0,
    "block_size": BS,
}
BAD = [
    ("decode", {**DECODE_PARAMS, "remote_port": "8000"}, "kv_transfer_params.remote_port"),
    ("decode", {**DECODE_PARAMS, "remote_port": 70000}, "kv_transfer_params.remote_port"),
    (
        "decode",
        {k: v for k, v in DECODE_PARAMS.items() if k != "remote_block_keys"},
        "kv_transfer_params.remote_block_keys",
    ),
    ("decode", {**DECODE_PARAMS, "remote_block_keys": ["not hex"]}, "kv_transfer_params.remote_block_keys"),
    # more blocks than the context (512 tokens) holds
    ("decode", {**DECODE_PARAMS, "remote_block_keys": keys(40)}, "kv_transfer_params.remote_block_keys"),
    ("decode", {**DECODE_PARAMS, "remote_host": "h" * 300}, "kv_transfer_params.remote_host"),
    (
        "decode",
        {**DECODE_PARAMS, "remote_host": "x..y"},
        "kv_transfer_params.remote_host",
    ),  # no resolver takes it
    ("decode", {**DECODE_PARAMS, "remote_host": "a" * 64 + ".svc"}, "kv_transfer_params.remote_host"),
    ("decode", {**DECODE_PARAMS, "remote_epoch": True}, "kv_transfer_params.remote_epoch"),
    ("decode", PREFILL_ASK, "kv_transfer_params"),  # a consumer does not prefill for others
    ("prefill", DECODE_PARAMS, "kv_transfer_params"),  # a producer does not decode remote prefills
]


@pytest.mark.parametrize(("pod", "params", "param"), BAD, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(BAD)])
def test_bad_kv_transfer_params_are_a_400_naming_the_field(pd, pod: str, params: dict, param: str) -> None:  # noqa: ANN001
    server = pd[0] if pod == "prefill" else pd[1]
    r = server.request("POST", "/v1/chat/completions", chat_body("auroras", kv_transfer_params=params))
    assert r.status == 400, r.body
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("extra", [{"stream": True}, {"n": 2}], ids=["stream", "n"])
def test_a_prefill_for_a_remote_decode_is_one_whole_reply(pd, extra: dict) -> None:  # noqa: ANN001
    r = pd[0].request(
        "POST", "/v1/chat/completions", chat_body("auroras", kv_transfer_params=PREFILL_ASK, **extra)
    )
    assert r.status == 400, r.body
    assert r.json()["error"]["param"] == "kv_transfer_params"


def test_a_taken_transfer_port_is_a_startup_error_naming_it(pd, tmp_path) -> None:  # noqa: ANN001
    """The producer's transfer port is taken (here by the fixture's producer): the daemon says which port
    and exits 1, rather than blame its HTTP port or serve prefills nobody can pull."""
    taken = transfer_port(pd[0])
    argv = [
        sys.executable,
        "-m",
        "kvpilot",
        "serve",
        "--port",
        str(free_port()),
        "--num-gpu-blocks-override",
        "64",
    ]
    argv += ["--kv-transfer-config", transfer_config("kv_producer", taken)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 1
    assert f"cannot listen on the KV transfer port 0.0.0.0:{taken}" in done.stderr


def transfer_port(prefill: Server) -> int:
    return prefill.cache()["kv_transfer"]["port"]


def raw_exchange(port: int, payload: bytes) -> bytes:
    """Send `payload` to the transfer port; what comes back before the server closes (bounded)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while len(out) < 1 << 16 and (chunk := s.recv(4096)):
            out += chunk
        return out


def frame(obj: dict) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body


def test_hostile_clients_of_the_transfer_port_get_nothing_and_it_serves_on(pd) -> None:  # noqa: ANN001
    prefill, decode = pd
    port = transfer_port(prefill)
    body = chat_body("monsoons")
    pre = post(prefill, {**body, "max_tokens": 1, "kv_transfer_params": PREFILL_ASK})
    hold = pre["kv_transfer_params"]["remote_request_id"]
    assert raw_exchange(port, b"GET / HTTP/1.1\r\n\r\n") == b""  # not the protocol: closed
    assert raw_exchange(port, b"KVP1" + struct.pack(">I", 1 << 31)) == b""  # a 2 GiB frame is never read
    assert raw_exchange(port, b"KVP1" + b"\x00\x00\x00\x05notjs") == b""
    gone = raw_exchange(port, b"KVP1" + frame({"hold": uuid.uuid4().hex, "first": 0, "count": 1}))
    assert json.loads(gone[4:]) == {"ok": False, "reason": "gone"}  # a guessed id pulls nothing
    bad = raw_exchange(port, b"KVP1" + frame({"hold": hold, "first": True, "count": 1}))
    assert json.loads(bad[4:]) == {"ok": False, "reason": "bad_request"}
    # many idle connections at once do not stop the real pull
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
    try:
        dec = post(decode, {**body, "kv_transfer_params": pre["kv_transfer_params"]})
    finally:
        for s in idle:
            s.close()
    assert cached(dec) == held_blocks(pre) * BS


def test_a_pull_whose_send_crosses_a_prefill_reset_is_refused() -> None:
    """The sender's closing epoch is read after the last byte: a reset during the send shows there, and
    the decode side refuses the blocks (remote_reset). In process: the real server and client, the reset
    timed between the header and the last byte."""
    import torch

    from kvpilot.daemon.engine.kv.cache_scope import CacheScope
    from kvpilot.daemon.kv_transfer.held import HeldKV
    from kvpilot.daemon.kv_transfer.pull import PullFailed, PullRequest, pull
    from kvpilot.daemon.kv_transfer.server import TransferServer
    from kvpilot.daemon.kv_transfer.wire import MAGIC, read_frame
    from kvpilot.daemon.kv_transfer.wire import frame as wire_frame

    shape = (2, 2, 16, 3, 64)
    data = torch.randn(96, *shape)  # 14 MiB: the send outlasts the socket buffers

    async def run() -> tuple[int, int, str]:
        held = HeldKV(60, 1 << 30)
        server = TransferServer(held, "127.0.0.1", 0, 30, lambda blocks, nbytes: None)
        port = await server.start()
        try:
            keys = tuple(bytes([i]) * 32 for i in range(96))
            held.hold("a", keys, data, None, CacheScope(None, None, None))
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(MAGIC + wire_frame({"hold": "a", "first": 0, "count": 96}))
            head = await read_frame(reader)
            held.drop()  # the reset lands while the blocks are on their way
            await reader.readexactly(data.numel() * 4)
            tail = await read_frame(reader)
            writer.close()
            # and the real client: the reset right after the server took the hold, before it sent a byte
            take = held.take

            def take_then_reset(hold_id: str):  # noqa: ANN202
                taken = take(hold_id)
                held.drop()
                return taken

            held.take = take_then_reset  # type: ignore[method-assign]
            held.hold("b", keys, data, None, CacheScope(None, None, None))
            try:
                await pull(PullRequest("127.0.0.1", port, "b", 0, 96, held.epoch), shape, torch.float32, 30)
                outcome = "landed"
            except PullFailed as exc:
                outcome = exc.reason
            return head["epoch"], tail["epoch"], outcome
        finally:
            await server.stop()

    head, tail, outcome = asyncio.run(run())
    assert tail == head + 1
    assert outcome == "remote_reset"


def test_a_scoped_reset_drops_and_refuses_only_its_own_scope() -> None:
    """A reset of one salt drops that salt's hold and refuses a send of it under way, while another salt's
    hold, waiting or being sent, is pulled whole (in process: the real server and client)."""
    import torch

    from kvpilot.daemon.engine.kv.cache_scope import CacheScope
    from kvpilot.daemon.kv_transfer.held import HeldKV
    from kvpilot.daemon.kv_transfer.pull import PullFailed, PullRequest, pull
    from kvpilot.daemon.kv_transfer.server import TransferServer

    shape = (2, 2, 16, 3, 64)
    alice, bob = CacheScope(None, None, "alice"), CacheScope(None, None, "bob")
    keys = tuple(bytes([i]) * 32 for i in range(4))

    async def run() -> list[str]:
        held = HeldKV(60, 1 << 30)
        server = TransferServer(held, "127.0.0.1", 0, 30, lambda blocks, nbytes: None)
        port = await server.start()
        take = held.take

        def take_then_reset_alice(hold_id: str):  # noqa: ANN202
            taken = take(hold_id)
            held.drop(lambda scope: scope == alice)  # lands while the taken hold is being sent
            return taken

        held.take = take_then_reset_alice  # type: ignore[method-assign]
        outcomes = []
        try:
            for name, scope in (("a", alice), ("b", bob)):
                made = held.hold(name, keys, torch.randn(4, *shape), None, scope)
                try:
                    await pull(
                        PullRequest("127.0.0.1", port, name, 0, 4, made.epoch), shape, torch.float32, 30
                    )
                    outcomes.append("landed")
                except PullFailed as exc:
                    outcomes.append(exc.reason)
            left = held.hold("b2", keys, torch.randn(4, *shape), None, bob)
            held.take = take  # type: ignore[method-assign]
            held.drop(lambda scope: scope == alice)
            await pull(PullRequest("127.0.0.1", port, "b2", 0, 4, left.epoch), shape, torch.float32, 30)
            outcomes.append("landed")
        finally:
            await server.stop()
        return outcomes

    assert asyncio.run(run()) == ["remote_reset", "landed", "landed"]


def test_resets_at_random_moments_of_a_pd_load_change_no_output_and_leave_nothing(pd) -> None:  # noqa: ANN001
    """Prefills held, pulls in flight, decodes running, and resets of either pod at random moments between:
    every answer is the one pod's answer, and afterwards no hold is left and neither pod serves a stale hit."""
    prefill, decode = pd
    rng = random.Random(44)
    bodies = [chat_body(t) for t in TOPICS]
    expected = {}
    for b in bodies:
        expected[b["messages"][0]["content"]] = text(post(prefill, b))
    stop = threading.Event()
    resets: list[str] = []

    def reset_at_random() -> None:
        while not stop.is_set():
            stop.wait(rng.uniform(0.05, 0.6))
            pod = rng.choice(["prefill", "decode"])
            (prefill if pod == "prefill" else decode).reset()
            resets.append(pod)

    results: list[tuple[str, str]] = []

    def worker(items: list[dict]) -> None:
        for b in items:
            _, dec = prefill_then_decode(prefill, decode, b)
            results.append((b["messages"][0]["content"], text(dec)))

    resetter = threading.Thread(target=reset_at_random)
    workers = [threading.Thread(target=worker, args=(bodies[i::2] * 2,)) for i in range(2)]
    resetter.start()
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=600)
    stop.set()
    resetter.join()
    assert len(results) == 2 * len(bodies) and len(resets) >= 3
    assert all(got == expected[prompt] for prompt, got in results)
    assert prefill.cache()["kv_transfer"]["held"]["transfers"] == 0  # each hold pulled, released or dropped
    prefill.reset()
    decode.reset()
    for server in pd:
        reply = post(server, bodies[0])
        assert cached(reply) == 0  # cold means cold on both sides
        assert server.cache()["blocks_used"] == 0
