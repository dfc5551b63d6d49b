"""vLLM's own KV event structs at work: run as a script by a python whose path holds vLLM's package (the
vllm-client folder, vLLM 0.33.0: `make vllm-client`), it decodes kvpilot's payloads with
`msgspec.msgpack.Decoder(type=KVEventBatch)` from vllm/distributed/kv_events.py, as vLLM's consumers do,
and encodes what it decoded again with vLLM's encoder. Reads `{"payloads": [hex, ...]}` on stdin and
writes, for each payload, `{"batch": <the decoded batch as plain values, bytes as hex, each event with
its struct's name>, "reencoded": hex}` on stdout, as one JSON list.

vllm/distributed/kv_events.py imports one name from vllm/v1/core/kv_cache_utils.py, the hash type
`ExternalBlockHash`; that module imports vLLM's multimodal stack, whose dependencies the --no-deps folder
lacks. So that one module is stood in, holding the type as vLLM defines it (`KV_CACHE_UTILS_LINE`, which
the test finds in vLLM's source); every struct that decodes is vLLM's own."""

from __future__ import annotations

import json
import sys
import types
from typing import Any

KV_CACHE_UTILS_LINE = "ExternalBlockHash: TypeAlias = bytes | int"


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def main() -> None:
    import msgspec

    utils = types.ModuleType("vllm.v1.core.kv_cache_utils")
    utils.ExternalBlockHash = bytes | int
    sys.modules[utils.__name__] = utils
    from vllm.distributed import kv_events

    decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    encoder = msgspec.msgpack.Encoder()
    out = []
    for payload in json.load(sys.stdin)["payloads"]:
        batch = decoder.decode(bytes.fromhex(payload))
        events = [
            {"struct": type(e).__name__} | {k: _plain(v) for k, v in msgspec.structs.asdict(e).items()}
            for e in batch.events
        ]
        plain = {"ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank, "events": events}
        out.append({"batch": plain, "reencoded": encoder.encode(batch).hex()})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
