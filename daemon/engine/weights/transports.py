"""The torch.distributed weight transports, `gloo` (TCP, CPU tensors) and `nccl` (CUDA tensors): a trainer
process broadcasts tensors to the daemon's ranks, with vLLM's NCCL bodies.

`init_info`: `master_address`, `master_port` (the trainer's TCPStore, which it hosts as rank 0),
`rank_offset` (this daemon's first rank in the group) and `world_size`; each data-parallel rank joins as
`rank_offset + its rank`. `update_info`: `names`, `dtype_names`, `shapes`, one broadcast from rank 0 per
tensor, in that order (vLLM's `packed: true` batching is refused). The group is a standalone
`ProcessGroupGloo` / `ProcessGroupNCCL` on its own store (prefix `kvpilot-weights`), so it never meets the
process's default group (tensor parallelism's).

gloo joins when the group is made (the trainer's `ProcessGroupGloo` and ours connect to each other);
NCCL makes its communicator at the first broadcast, on each side, so `/init_weight_transfer_engine`
returns once the store is reached and a trainer that never joins shows at the first update. NCCL
receives into the rank's CUDA device one tensor at a time and each is copied to the host at once: the
update costs one tensor of device memory beyond the model, never a second copy of it.

Every announced tensor is received before any is checked: a refused update must not leave the trainer
blocked in a broadcast nobody receives.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

from kvpilot.daemon.engine.weights.ops import WeightError, WeightErrorKind

log = logging.getLogger(__name__)

JOIN_TIMEOUT = timedelta(seconds=300)
STORE_PREFIX = "kvpilot-weights"


class GroupReceiver:
    def __init__(self, init_info: dict[str, Any], rank: int, backend: str, device: torch.device) -> None:
        import torch.distributed as dist

        try:
            address = str(init_info["master_address"])
            port = int(init_info["master_port"])
            world = int(init_info["world_size"])
            me = int(init_info.get("rank_offset", 1)) + rank
        except (KeyError, TypeError, ValueError):
            raise WeightError(
                WeightErrorKind.INCOMPATIBLE,
                "init_info needs master_address, master_port, world_size (and rank_offset)",
            ) from None
        if not 0 < me < world:
            raise WeightError(
                WeightErrorKind.INCOMPATIBLE,
                f"rank {me} is outside the group of {world} (rank 0 is the trainer)",
            )
        self.device = device if backend == "nccl" else torch.device("cpu")
        # Any: torch's stubs lack the (store, rank, size, timeout) constructor and the broadcast that its C++
        # bindings give both classes.
        group_class: Any = dist.ProcessGroupNCCL if backend == "nccl" else dist.ProcessGroupGloo
        store = dist.TCPStore(address, port, world, is_master=False, timeout=JOIN_TIMEOUT)
        self.group = group_class(dist.PrefixStore(STORE_PREFIX, store), me, world, JOIN_TIMEOUT)
        self.rank = me

    def receive(self, update_info: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        names = update_info.get("names")
        dtypes = update_info.get("dtype_names")
        shapes = update_info.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise WeightError(
                WeightErrorKind.INCOMPATIBLE, "update_info needs names, dtype_names and shapes (lists)"
            )
        if not len(names) == len(dtypes) == len(shapes):
            raise WeightError(
                WeightErrorKind.INCOMPATIBLE, "names, dtype_names and shapes must have the same length"
            )
        if update_info.get("packed"):
            raise WeightError(
                WeightErrorKind.INCOMPATIBLE,
                "packed broadcasts are not supported: send each tensor (packed: false)",
            )
        announced = []
        for name, dtype_name, shape in zip(names, dtypes, shapes):  # all checked before any broadcast
            dtype = getattr(torch, str(dtype_name), None)
            if not isinstance(dtype, torch.dtype):
                raise WeightError(
                    WeightErrorKind.INCOMPATIBLE, f"tensor {name!r}: unknown dtype {dtype_name!r}", str(name)
                )
            try:
                announced.append((str(name), [int(s) for s in shape], dtype))
            except (TypeError, ValueError):
                raise WeightError(
                    WeightErrorKind.INCOMPATIBLE,
                    f"tensor {name!r}: shape {shape!r} is not a list of sizes",
                    str(name),
                ) from None
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):  # this runs on a thread of its own: name the device
                return iter([(n, self._broadcast(n, shape, dtype)) for n, shape, dtype in announced])
        return iter([(n, self._broadcast(n, shape, dtype)) for n, shape, dtype in announced])

    def _broadcast(self, name: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        try:
            self.group.broadcast(t, 0).wait()
        except RuntimeError as exc:  # the trainer went away or timed out
            raise WeightError(
                WeightErrorKind.TRANSFER_FAILED, f"receiving {name!r} from the trainer failed: {exc}", name
            ) from None
        # On CUDA `wait` orders the current stream after the broadcast; the copy to the host runs on it
        # and returns once the tensor has arrived.
        return t.cpu() if t.is_cuda else t

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None and self.device.type == "cuda":
            # NCCL's communicators hold GPU memory and threads until shut down; gloo's go with the object.
            try:
                group.shutdown()
            except RuntimeError as exc:
                log.warning("leaving the trainer's nccl group: %s", exc)
