"""The `gloo` weight transport: a trainer process broadcasts tensors over torch.distributed (TCP), the CPU
twin of vLLM's NCCL backend, with vLLM's NCCL-style bodies.

`init_info`: `master_address`, `master_port` (the trainer's TCPStore, which it hosts as rank 0),
`rank_offset` (this daemon's first rank in the group) and `world_size`; each data-parallel rank joins as
`rank_offset + its rank`. `update_info`: `names`, `dtype_names`, `shapes`, one broadcast from rank 0 per
tensor, in that order. The group is a standalone `ProcessGroupGloo` on its own store, so it never meets
the process's default group (tensor parallelism's).

Every announced tensor is received before any is checked: a refused update must not leave the trainer
blocked in a broadcast nobody receives.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import torch

from kvpilot.daemon.engine.weight_stage import WeightError

JOIN_TIMEOUT = timedelta(seconds=300)


class GlooReceiver:
    def __init__(self, init_info: dict, rank: int) -> None:
        import torch.distributed as dist

        try:
            address = str(init_info["master_address"])
            port = int(init_info["master_port"])
            world = int(init_info["world_size"])
            me = int(init_info.get("rank_offset", 1)) + rank
        except (KeyError, TypeError, ValueError):
            raise WeightError(
                400, "init_info needs master_address, master_port, world_size (and rank_offset)"
            ) from None
        if not 0 < me < world:
            raise WeightError(400, f"rank {me} is outside the group of {world} (rank 0 is the trainer)")
        store = dist.TCPStore(address, port, world, is_master=False, timeout=JOIN_TIMEOUT)
        self.group = dist.ProcessGroupGloo(
            dist.PrefixStore("kvpilot-weights", store), me, world, JOIN_TIMEOUT
        )
        self.rank = me

    def receive(self, update_info: dict) -> Iterator[tuple[str, torch.Tensor]]:
        names = update_info.get("names")
        dtypes = update_info.get("dtype_names")
        shapes = update_info.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise WeightError(400, "update_info needs names, dtype_names and shapes (lists)")
        if not len(names) == len(dtypes) == len(shapes):
            raise WeightError(400, "names, dtype_names and shapes must have the same length")
        received = []
        for name, dtype_name, shape in zip(names, dtypes, shapes):
            dtype = getattr(torch, str(dtype_name), None)
            if not isinstance(dtype, torch.dtype):
                raise WeightError(400, f"tensor {name!r}: unknown dtype {dtype_name!r}", str(name))
            t = torch.empty([int(s) for s in shape], dtype=dtype)
            try:
                self.group.broadcast(t, 0).wait()
            except RuntimeError as exc:  # the trainer went away or timed out
                raise WeightError(
                    500, f"receiving {name!r} from the trainer failed: {exc}", str(name)
                ) from None
            received.append((str(name), t))
        return iter(received)

    def close(self) -> None:
        self.group = None
