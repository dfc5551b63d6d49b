"""The staging copy of a weight update: new tensors are received here while the engine keeps serving
with the live ones, then copied into the live parameters in one go (`apply`, between two steps).

Everything received is checked against the live model before it is kept: its name must have a place in
the model (`checkpoint_slot`), its shape must equal that place's, and its dtype must be a floating one
(converted to the model's dtype, as at load). The stage holds host copies of only the parameters an
update touches, so a partial update costs what it changes. Its `digest` names the weights the model
will have after the swap (staged tensors over live ones), equal on every rank and pod that staged the
same checkpoint, so a fleet can check before it commits.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvpilot.daemon.engine.memory_budget import host_memory_available
from kvpilot.daemon.engine.weights.ops import WeightError, WeightErrorKind

if TYPE_CHECKING:
    from kvpilot.daemon.engine.models.llama import LlamaForCausalLM, Weight

# Host memory left free beyond what the stage takes, for the rest of the process.
HEADROOM_BYTES = 256 << 20


def weights_digest(weights: Mapping[str, Callable[[], torch.Tensor]]) -> str:
    """sha256 over each tensor's name, dtype, shape and bytes, in name order; each tensor read when its turn
    comes (a weight kept in panels is made dense for it, one at a time)."""
    h = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name]().detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "sha256:" + h.hexdigest()


def checkpoint_tensors(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a Hugging Face checkpoint directory (its *.safetensors files). Raises WeightError
    NOT_FOUND when there is none there, or none this process may read (a path of another user's, a folder
    not mounted into the pod), INCOMPATIBLE when a file is not safetensors."""
    from safetensors import SafetensorError, safe_open

    path = Path(model_path)
    try:
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    except OSError as exc:
        raise WeightError(
            WeightErrorKind.NOT_FOUND, f"cannot read the checkpoint at {model_path!r}: {exc}"
        ) from exc
    if not files:
        raise WeightError(
            WeightErrorKind.NOT_FOUND, f"no checkpoint at {model_path!r} (a directory of *.safetensors files)"
        )
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                    yield name, st.get_tensor(name)
        except OSError as exc:
            raise WeightError(WeightErrorKind.NOT_FOUND, f"cannot read {str(f)!r}: {exc}") from exc
        except SafetensorError as exc:
            raise WeightError(
                WeightErrorKind.INCOMPATIBLE, f"{str(f)!r} is not a safetensors file: {exc}"
            ) from exc


class WeightStage:
    """Received tensors for one update, not yet live. Filled off the engine thread: it only reads the
    live parameters' names, shapes and dtypes (fixed) and copies their values once, when an update first
    touches a fused parameter."""

    def __init__(self, model: LlamaForCausalLM, max_bytes: int | None = None) -> None:
        self.model = model
        self.live = model.weights()
        self.staged: dict[str, torch.Tensor] = {}
        self.received = 0
        self.max_bytes = max_bytes  # --weight-staging-memory-bytes: the operator's cap on the host copy
        self.bytes = 0  # host memory the staged copies take

    def put(self, name: str, tensor: torch.Tensor) -> None:
        slot = self._slot(name)
        if slot is None:
            return
        pname, offset, size = slot
        live = self.live[pname]
        want = tuple(live.shape) if size is None else (size, *live.shape[1:])
        if tuple(tensor.shape) != want:
            raise WeightError(
                WeightErrorKind.INCOMPATIBLE,
                f"tensor {name!r} has shape {list(tensor.shape)}, the model's is {list(want)}",
                name,
            )
        if not tensor.is_floating_point():
            raise WeightError(
                WeightErrorKind.INCOMPATIBLE,
                f"tensor {name!r} has dtype {tensor.dtype}, not a floating one",
                name,
            )
        staged = self.staged.get(pname)
        if staged is None:
            staged = self.staged[pname] = self._host_copy(pname, whole=size is None)
        target = staged if size is None else staged[offset : offset + size]
        target.copy_(tensor.to(live.dtype))
        self.received += 1

    def put_all(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        before = self.received
        for name, tensor in tensors:
            self.put(name, tensor)
        return self.received - before

    def digest(self) -> str:
        return weights_digest({n: self._staged_or(n, w) for n, w in self.live.items()})

    def _staged_or(self, name: str, live: Weight) -> Callable[[], torch.Tensor]:
        staged = self.staged.get(name)
        return live.read if staged is None else lambda: staged

    @torch.no_grad()
    def apply(self) -> int:
        """Copy the staged tensors into the live parameters (their storage: nothing new is allocated on
        the device beyond the copy's transfer). Call between two engine steps."""
        for pname, t in self.staged.items():
            self.live[pname].write(t)
        return len(self.staged)

    def _slot(self, name: str) -> tuple[str, int, int | None] | None:
        try:
            return self.model.checkpoint_slot(name)
        except KeyError:
            raise WeightError(
                WeightErrorKind.INCOMPATIBLE, f"tensor {name!r} has no place in the model", name
            ) from None

    def _host_copy(self, pname: str, whole: bool) -> torch.Tensor:
        live = self.live[pname]
        need = math.prod(live.shape) * live.dtype.itemsize
        if self.max_bytes is not None and self.bytes + need > self.max_bytes:
            raise WeightError(
                WeightErrorKind.NO_MEMORY,
                f"staging {pname!r} ({need} bytes) would take the staging copy to {self.bytes + need} bytes, "
                f"above --weight-staging-memory-bytes {self.max_bytes}",
                pname,
            )
        if need + HEADROOM_BYTES > host_memory_available():
            raise WeightError(
                WeightErrorKind.NO_MEMORY, f"not enough host memory to stage {pname!r} ({need} bytes)", pname
            )
        self.bytes += need
        if whole:
            return torch.empty(live.shape, dtype=live.dtype)
        return live.read().to("cpu", copy=True)  # a fused parameter: the slices not sent stay


TRANSFER_BACKENDS = ("checkpoint", "gloo", "nccl")


def transfer_backend(config_json: str | None, device: str | None = None) -> str:
    """The backend `--weight-transfer-config` names (vLLM's JSON form); ValueError when it is not one
    this daemon has, or (given the engine's `device`) it cannot run there: nccl moves CUDA tensors."""
    import json

    if not config_json:
        return "checkpoint"
    try:
        cfg = json.loads(config_json)
    except ValueError:
        raise ValueError(f"--weight-transfer-config is not JSON: {config_json!r}") from None
    backend = cfg.get("backend", "checkpoint") if isinstance(cfg, dict) else None
    if not isinstance(backend, str) or backend not in TRANSFER_BACKENDS:
        raise ValueError(
            f"--weight-transfer-config backend {backend!r} is not available; this daemon has "
            + ", ".join(TRANSFER_BACKENDS)
        )
    if backend == "nccl" and device is not None:
        import torch.distributed as dist

        if device != "cuda" and not device.startswith("cuda:"):
            raise ValueError(
                f'--weight-transfer-config backend "nccl" needs a CUDA device; this engine runs on {device} '
                '(on the CPU use {"backend": "gloo"}, its CPU twin)'
            )
        if not dist.is_nccl_available():
            raise ValueError('--weight-transfer-config backend "nccl": this torch has no NCCL')
    return backend
