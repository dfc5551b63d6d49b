"""Reading a peer's HTTP reply with a byte cap (aiohttp's client): what the router reads from pods, the
fan-out's weight-update phases and `kvpilot bench` read from servers. A peer may answer an endless or a huge
body; past the cap the rest is not read and the reply counts as broken."""

from __future__ import annotations

import aiohttp


async def read_capped(response: aiohttp.ClientResponse, max_bytes: int) -> bytes | None:
    """The reply body (decompressed, if it is compressed), or None once it passes `max_bytes`. The whole
    body: `response.content.read(n)` would stop at whatever the first network read brought."""
    length = response.content_length
    if length is not None and length > max_bytes:
        return None
    if length is not None and "Content-Encoding" not in response.headers:
        return await response.read()  # exactly `length` bytes, joined once
    body = bytearray()  # chunked, or compressed: what it inflates to is counted as it comes
    async for chunk in response.content.iter_any():
        body += chunk
        if len(body) > max_bytes:
            return None
    return bytes(body)
