"""How both ends of a KV event stream set up their ZeroMQ sockets: CURVE keys and message size bounds.

The daemon publishes (PUB) and serves replays (ROUTER); a router subscribes (SUB) and asks for replays
(DEALER). Given a key folder (`--kv-events-curve-dir DIR`, pyzmq's `zmq.auth` key-file format), every
connection is encrypted and authenticated with CURVE:

- the daemon's folder holds its own key pair in `server.key_secret` and the public keys of the clients
  it lets in, each in a `NAME.key` file (any name but `server`); a ZAP handler on the daemon's context
  refuses every other client key, so a plain SUB, or one with a key not listed, gets nothing;
- a router's folder holds its key pair in `client.key_secret` and the daemon's public key in `server.key`.

One folder made with `zmq.auth.create_certificates(DIR, "server")` and `create_certificates(DIR, "client")`
serves both ends; the operator mounts only each end's part (docs/security.md).

Every socket also gets `MAXMSGSIZE`: a peer that sends a bigger frame is disconnected by ZeroMQ before the
frame is buffered (the router then opens a new socket and connects again: router/kv/stream.py). Daemons
never publish a frame above `MAX_BATCH_BYTES` (events.py splits a step's events to fit), so the router's
bound drops only dishonest frames; the daemon receives only subscriptions and 8-byte replay requests, so its bound is small.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)

# Payload bytes of one published batch at most (events.py keeps to it). 1 MiB is ~30 times the largest
# step of the default engine (2048 batched tokens at 16 per block: ~200 stored + ~200 removed blocks, 34 bytes
# a hash, 80 more a block with token ids) and still fits any config once split.
MAX_BATCH_BYTES = 1 << 20
# What a router accepts per frame: a batch plus CURVE's framing (nonce, MAC, command name: under 64 bytes)
# and a generous margin; the handshake's frames are a few hundred bytes.
SUBSCRIBER_MAXMSGSIZE = MAX_BATCH_BYTES + (64 << 10)
# What a daemon accepts per frame: subscriptions (a topic prefix), replay requests (8 bytes), CURVE handshakes.
PUBLISHER_MAXMSGSIZE = 4 << 10

ZAP_DOMAIN = "kvpilot-kv-events"  # libzmq asks the ZAP handler only for sockets with a domain
SERVER = "server"  # the daemon's key pair: server.key (public), server.key_secret (both keys)
CLIENT = "client"  # a router's key pair: client.key, client.key_secret


@dataclass(frozen=True, slots=True)
class ServerKeys:
    public: bytes  # z85
    secret: bytes
    allowed: frozenset[bytes]  # z85 public keys of the clients let in


@dataclass(frozen=True, slots=True)
class ClientKeys:
    public: bytes
    secret: bytes
    server: bytes  # the daemon's public key


def certificate(public: bytes, secret: bytes | None = None) -> str:
    """A key file as `zmq.auth.load_certificate` reads it: the public key, and the secret one when given."""
    kind = "Secret" if secret else "Public"
    lines = [
        f"#   ****  Generated on {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M:%S} by kvpilot  ****",
        f"#   ZeroMQ CURVE {kind} Certificate",
        "",
        "metadata",
        "curve",
        f'    public-key = "{public.decode()}"',
    ]
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def key_files(name: str) -> dict[str, str]:
    """A new key pair as its two files: {NAME.key: public, NAME.key_secret: both keys}."""
    public, secret = zmq.curve_keypair()
    return {f"{name}.key": certificate(public), f"{name}.key_secret": certificate(public, secret)}


def _pair(folder: Path, name: str) -> tuple[bytes, bytes]:
    path = folder / f"{name}.key_secret"
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"KV events CURVE keys: cannot read {path}: {exc}") from None
    if not public or not secret:
        raise ValueError(f"KV events CURVE keys: {path} holds no secret key")
    return public, secret


def _public(path: Path) -> bytes:
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"KV events CURVE keys: cannot read {path}: {exc}") from None
    if not public:
        raise ValueError(f"KV events CURVE keys: {path} holds no public key")
    return public


def load_server_keys(folder: str | Path) -> ServerKeys:
    d = Path(folder)
    public, secret = _pair(d, SERVER)
    allowed = frozenset(_public(p) for p in sorted(d.glob("*.key")) if p.stem != SERVER)
    if not allowed:
        raise ValueError(f"KV events CURVE keys: {d} names no client (a NAME.key public key file)")
    return ServerKeys(public, secret, allowed)


def load_client_keys(folder: str | Path) -> ClientKeys:
    d = Path(folder)
    public, secret = _pair(d, CLIENT)
    return ClientKeys(public, secret, _public(d / f"{SERVER}.key"))


class _AllowedKeys:
    """The ZAP handler's question "may this client key connect?" (pyzmq's credentials provider)."""

    def __init__(self, allowed: frozenset[bytes]) -> None:
        self.allowed = allowed
        self._refused: set[bytes] = set()  # logged once each: a refused peer reconnects every 100 ms

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        if key not in self._refused and len(self._refused) < 100:
            self._refused.add(key)
            log.warning("KV events: refused a client whose CURVE key is not allowed (%s)", key.decode())
        return False


def secure_publisher(
    ctx: zmq.SyncContext, sockets: list[zmq.SyncSocket], curve_dir: str | None
) -> ThreadAuthenticator | None:
    """Bound the daemon's sockets and, with a key folder, make them CURVE servers that let in only the
    listed clients. Call before binding. Returns the ZAP handler to stop before the context ends."""
    keys = load_server_keys(curve_dir) if curve_dir else None
    auth = None
    if keys is not None:
        auth = ThreadAuthenticator(ctx, log=logging.getLogger(__name__ + ".zap"))
        auth.start()
        auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_AllowedKeys(keys.allowed))
    for sock in sockets:
        sock.setsockopt(zmq.MAXMSGSIZE, PUBLISHER_MAXMSGSIZE)
        if keys is not None:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
            # Every handshake goes to the ZAP handler (none goes unchecked: without a domain libzmq skips
            # it, and without a handler it lets the client in unless told to enforce).
            sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    return auth


class SubscriberContext(zmq.asyncio.Context):
    """The router's context: every socket made from it gets the subscriber's options (size bound, IPv6,
    CURVE client keys). Unlike a plain context's defaults, an option that does not apply fails loudly:
    a socket without its keys must not exist."""

    _options: dict[int, Any]

    def socket(self, socket_type: int, *args: Any, **kwargs: Any) -> zmq.asyncio.Socket:
        sock = super().socket(socket_type, *args, **kwargs)
        for opt, value in self._options.items():
            sock.setsockopt(opt, value)
        return sock


def subscriber_context(curve_dir: str | None) -> SubscriberContext:
    """The context a router's KV event sockets come from (`--kv-events-curve-dir` or none)."""
    options: dict[int, Any] = {
        zmq.MAXMSGSIZE: SUBSCRIBER_MAXMSGSIZE,
        zmq.IPV6: 1,  # pods with IPv6 addresses (connecting to IPv4 ones is unchanged)
    }
    if curve_dir:
        keys = load_client_keys(curve_dir)
        options |= {
            zmq.CURVE_SERVERKEY: keys.server,
            zmq.CURVE_PUBLICKEY: keys.public,
            zmq.CURVE_SECRETKEY: keys.secret,
        }
    ctx = SubscriberContext()
    ctx._options = options
    return ctx
