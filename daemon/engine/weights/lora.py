"""LoRA adapters: peft adapter directories loaded onto the engine's fused projections, and the low-rank
products a step adds for the rows of each adapter in its batch.

An adapter is a peft directory (`adapter_config.json`, `adapter_model.safetensors`) made for the served
base model. Its per-module pairs (A [r, in], B [out, r]) are fused as the base weights are: q/k/v into
`qkv_proj`, gate/up into `gate_up_proj` (`LlamaForCausalLM.checkpoint_slot` says where each goes). A
fused module's pairs become one pair: the A's stacked along the rank, the B's (scaled by alpha/r) placed
block-diagonally at their output rows, so one product per module serves all of its targets.

A batch mixes base rows and rows of several adapters: each step adds, for every adapter present, the
product of that adapter's rows alone (a gather, two small matmuls, a scatter-add). Base rows pay nothing.

An adapter's identity is its name and the digest of its files: it enters its blocks' keys (`block_keys`),
so KV computed under one adapter, or under another version of it, is never served to another.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError

from kvpilot.daemon.engine.models.llama import LlamaForCausalLM
from kvpilot.kv.block_keys import LoRAKey
from kvpilot.kv.events import MAX_LORA_NAME_CHARS

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json is a few hundred bytes
# Rank 64 on every projection of a 70B model is about 1.6 GiB; the file is read whole into host memory.
MAX_WEIGHTS_BYTES = 4 << 30
LORA_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._:/@+=-]{{0,{MAX_LORA_NAME_CHARS - 1}}}")
PEFT_DEFAULT_ALPHA = 8  # LoraConfig's lora_alpha when a config leaves it out
# The projections a LoRA pair may target: every linear layer of a decoder layer (not the embeddings or
# the LM head, which the engine shares between all rows of a batch).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAError(ValueError):
    """An adapter cannot be served (a bad directory, another base model, a feature not supported): the
    message names why."""


@dataclass(slots=True, weakref_slot=True)
class LoRAAdapter:
    identity: LoRAKey
    path: Path
    rank: int
    # Fused module name (e.g. "layers.0.self_attn.qkv_proj") -> (A [R, in], scaled B [out, R]).
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def name(self) -> str:
        return self.identity.name


def parse_lora_modules(specs: list[str]) -> dict[str, str]:
    """`--lora-modules` as vLLM takes it: `name=path` items, or JSON objects with `name` and `path`."""
    out: dict[str, str] = {}
    for spec in specs:
        if spec.lstrip().startswith("{"):
            try:
                obj = json.loads(spec)
                name, path = obj["name"], obj["path"]
            except (ValueError, KeyError, TypeError):
                raise LoRAError(f"--lora-modules {spec!r}: a JSON item needs 'name' and 'path'") from None
        else:
            name, sep, path = spec.partition("=")
            if not sep:
                raise LoRAError(f"--lora-modules {spec!r}: expected name=path")
        check_name(name)
        if not isinstance(path, str) or not path:
            raise LoRAError(f"--lora-modules {spec!r}: the path is empty")
        if name in out:
            raise LoRAError(f"--lora-modules: adapter {name!r} is named twice")
        out[name] = path
    return out


def check_name(name: object) -> str:
    # A name goes into logs, metrics labels and other tenants' /v1/models: no space, newline or control
    # character (a forged log line), only what model and Hugging Face repository names are made of.
    if not isinstance(name, str) or not LORA_NAME.fullmatch(name):
        raise LoRAError(
            f"an adapter name must be a non-empty string of at most {MAX_LORA_NAME_CHARS} letters, digits "
            "and '._:/@+=-', starting with a letter or digit"
        )
    return name


def load_adapter(
    name: str,
    path: str | Path,
    model: LlamaForCausalLM,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> LoRAAdapter:
    """Read and check a peft LoRA directory for `model`; raises LoRAError naming what is wrong (an adapter
    comes from a caller at run time: nothing in it may raise anything else)."""
    try:
        return _load(name, Path(path).expanduser(), model, max_rank, dtype, device)
    except LoRAError:
        raise
    except (OSError, RecursionError, RuntimeError, ValueError, SafetensorError, MemoryError) as exc:
        raise LoRAError(f"adapter {name!r} cannot be loaded: {exc}") from None


def _load(
    name: str, root: Path, model: LlamaForCausalLM, max_rank: int, dtype: torch.dtype, device: torch.device
) -> LoRAAdapter:
    raw, weights_path = _read_config(name, root)
    weights = _read_weights(name, weights_path)  # read once: the tensors and the digest are of one content
    try:
        cfg = json.loads(raw)
    except ValueError as exc:
        raise LoRAError(f"adapter {name!r}: {CONFIG_FILE} is not JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    rank, scaling = _check_config(name, cfg, max_rank)
    per_module: dict[str, dict[str, torch.Tensor]] = {}  # peft module path -> {"A": .., "B": ..}
    try:
        for key, tensor in safetensors.torch.load(weights).items():
            module, part = _split_key(name, key)
            pair = per_module.setdefault(module, {})
            if part in pair:
                raise LoRAError(f"adapter {name!r}: {module} has two lora_{part} tensors")
            if not tensor.is_floating_point():  # checked before anything is converted (uint8: 4x as float32)
                raise LoRAError(f"adapter {name!r}: {key} is {tensor.dtype}, not a floating-point tensor")
            pair[part] = tensor  # converted once its shape is known to fit
    except LoRAError:
        raise
    except (OSError, RuntimeError, ValueError, SafetensorError) as exc:
        raise LoRAError(f"adapter {name!r}: {WEIGHTS_FILE} cannot be read: {exc}") from None
    if not per_module:
        raise LoRAError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")

    params = model.weights()
    fused: dict[str, list[tuple[torch.Tensor, torch.Tensor, int, int]]] = {}
    for module, ab in sorted(per_module.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"adapter {name!r}: {module} has {sorted(ab)} of its lora_A/lora_B pair")
        try:
            slot = model.checkpoint_slot(module + ".weight")
        except KeyError:
            slot = None
        if slot is None or slot[0] not in params:
            raise LoRAError(f"adapter {name!r}: module {module!r} is not a layer of this base model")
        pname, offset, size = slot
        out_rows, in_cols = params[pname].shape[0], params[pname].shape[1]
        rows = out_rows if size is None else size
        a, b = ab["A"], ab["B"]
        if (
            a.dim() != 2
            or b.dim() != 2
            or a.shape[1] != in_cols
            or b.shape[0] != rows
            or a.shape[0] != b.shape[1]
        ):
            raise LoRAError(
                f"adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                f"but this base model's layer maps {in_cols} to {rows}: an adapter of another model?"
            )
        if a.shape[0] != rank:
            raise LoRAError(f"adapter {name!r}: {module} has rank {a.shape[0]}, its config says r={rank}")
        fused.setdefault(pname.removesuffix(".weight"), []).append(
            (a.to(torch.float32), b.to(torch.float32) * scaling, offset, out_rows)
        )

    pairs = {}
    for target, parts in fused.items():
        total = sum(a.shape[0] for a, _, _, _ in parts)
        out_rows = parts[0][3]
        big_a = torch.cat([a for a, _, _, _ in parts]).to(device=device, dtype=dtype)
        big_b = torch.zeros(out_rows, total, dtype=dtype, device=device)
        col = 0
        for a, b, offset, _ in parts:
            big_b[offset : offset + b.shape[0], col : col + a.shape[0]] = b.to(device=device, dtype=dtype)
            col += a.shape[0]
        pairs[target] = (big_a.contiguous(), big_b)
    identity = LoRAKey(name, _digest(raw, weights))
    log.info(
        "LoRA adapter %s: %s, rank %d, %d modules, digest %s",
        name,
        root,
        rank,
        len(per_module),
        identity.digest[:12],
    )
    return LoRAAdapter(identity, root, rank, pairs)


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    """An adapter as the server lists it (/v1/models) and names it to routers (/health)."""

    path: str
    digest: str


def served_adapter(name: str, path: str) -> ServedAdapter:
    """The adapter at `path` as its ranks will key it, without loading it (a data-parallel server's front
    process, which loads no weights)."""
    raw, weights_path = _read_config(name, Path(path).expanduser())
    return ServedAdapter(path, _digest(raw, _read_weights(name, weights_path)))


def _read_config(name: str, root: Path) -> tuple[bytes, Path]:
    """The adapter's config bytes (bounded) and where its weights are."""
    cfg_path, weights_path = root / CONFIG_FILE, root / WEIGHTS_FILE
    if not cfg_path.is_file() or not weights_path.is_file():
        raise LoRAError(
            f"adapter {name!r}: {root} is not a peft LoRA directory ({CONFIG_FILE} and {WEIGHTS_FILE})"
        )
    with cfg_path.open("rb") as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise LoRAError(f"adapter {name!r}: {CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    return raw, weights_path


def _read_weights(name: str, weights_path: Path) -> bytes:
    try:
        with weights_path.open("rb") as f:
            weights = f.read(MAX_WEIGHTS_BYTES + 1)
    except OSError as exc:
        raise LoRAError(f"adapter {name!r}: {WEIGHTS_FILE} cannot be read: {exc.strerror}") from None
    if len(weights) > MAX_WEIGHTS_BYTES:
        raise LoRAError(f"adapter {name!r}: {WEIGHTS_FILE} is larger than {MAX_WEIGHTS_BYTES} bytes")
    return weights


def _digest(raw_config: bytes, weights: bytes) -> str:
    """The adapter's identity beside its name: sha256 over its config and its weights file's sha256."""
    digest = hashlib.sha256(raw_config)
    digest.update(hashlib.sha256(weights).digest())
    return digest.hexdigest()


def _check_config(name: str, cfg: dict[str, Any], max_rank: int) -> tuple[int, float]:
    """The adapter's rank and scaling, or LoRAError for what the engine does not implement."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"adapter {name!r}: peft_type {cfg.get('peft_type')!r}, only LORA is served")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAError(f"adapter {name!r}: r must be a positive integer")
    if rank > max_rank:
        raise LoRAError(f"adapter {name!r}: rank {rank} is above --max-lora-rank {max_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise LoRAError(f"adapter {name!r}: lora_alpha must be a number")
    unsupported = {
        "use_dora": bool(cfg.get("use_dora")),
        "bias": cfg.get("bias", "none") not in (None, "none"),
        "modules_to_save": bool(cfg.get("modules_to_save")),
        "rank_pattern": bool(cfg.get("rank_pattern")),
        "alpha_pattern": bool(cfg.get("alpha_pattern")),
        "fan_in_fan_out": bool(cfg.get("fan_in_fan_out")),
    }
    if any(unsupported.values()):
        found = ", ".join(k for k, v in unsupported.items() if v)
        raise LoRAError(
            f"adapter {name!r}: {found} not supported (plain LoRA on the decoder's linear layers)"
        )
    scaling = alpha / rank**0.5 if cfg.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _split_key(name: str, key: str) -> tuple[str, str]:
    """peft's `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` -> (the base model's
    module path, "A")."""
    stem, _, tail = key.rpartition(".lora_")
    part = tail.removesuffix(".weight").split(".")[0]
    if not stem or part not in ("A", "B") or not tail.endswith("weight"):
        raise LoRAError(f"adapter {name!r}: tensor {key!r} is not a LoRA weight (lora_A / lora_B)")
    # `model.` too: with and without it, two keys would name one layer (checkpoint_slot drops it)
    module = stem.removeprefix("base_model.model.").removeprefix("model.")
    if module.rsplit(".", 1)[-1] not in TARGETS:
        raise LoRAError(
            f"adapter {name!r}: {module!r} is not a projection the engine adapts ({', '.join(TARGETS)})"
        )
    return module, part


# y, x, a, b, rows: one adapter's product added to y at rows (kvpilot.kernels.reference.lora_add)
LoRAAdd = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], None]


class LoRABatch:
    """One step's adapters and their rows; the model calls `add` after each projection."""

    __slots__ = ("_groups", "_lora_add")

    def __init__(self, groups: list[tuple[LoRAAdapter, torch.Tensor | None]], lora_add: LoRAAdd) -> None:
        self._groups = groups  # (adapter, its rows; None: every row of the batch)
        self._lora_add = lora_add  # the kernel: Ops.lora_add (triton on CUDA, torch elsewhere)

    def add(self, module: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += the low-rank product of each adapter's rows of x, for the fused module `module`."""
        for adapter, rows in self._groups:
            pair = adapter.pairs.get(module)
            if pair is not None:
                self._lora_add(y, x, *pair, rows)


def lora_batch(
    spans: list[tuple[LoRAAdapter, int, int]], num_rows: int, device: torch.device, lora_add: LoRAAdd
) -> LoRABatch | None:
    """The LoRABatch for a step of `num_rows` rows whose `spans` (adapter, first row, rows) run under an
    adapter; the other rows are the base model's. One span per chunk, not a Python item per token."""
    # By identity, not name: after an in-place reload one step may run both versions of an adapter.
    by_adapter: dict[LoRAKey, tuple[LoRAAdapter, list[tuple[int, int]]]] = {}
    for adapter, start, count in spans:
        by_adapter.setdefault(adapter.identity, (adapter, []))[1].append((start, count))
    if not by_adapter:
        return None
    groups: list[tuple[LoRAAdapter, torch.Tensor | None]] = []
    for adapter, ranges in by_adapter.values():
        if sum(n for _, n in ranges) == num_rows:
            groups.append((adapter, None))  # every row: no gather
            continue
        rows = torch.cat([torch.arange(s, s + n, dtype=torch.int64) for s, n in ranges]).to(device)
        groups.append((adapter, rows))
    return LoRABatch(groups, lora_add)


class LoRARegistry:
    """The adapters an engine serves, by name, and those of them whose weights it holds (`--max-cpu-loras`,
    least recently used first out). An adapter whose weights were let go is taken back from a request that
    still runs it, else read again from its directory when a request names it, and must come back with the
    identity it was served under: files changed on disk meanwhile are refused, never served under the old
    identity's cached blocks. Requests hold the adapter they run under, so letting one go never takes
    weights from a running request, and no adapter is in memory twice. Locked: run-time loads come from
    beside the steps while the engine's thread looks adapters up."""

    def __init__(self, read: Callable[[str, str | Path], LoRAAdapter], capacity: int | None = None) -> None:
        self.read = read  # an adapter's directory -> the adapter, checked against the base model
        self.served: dict[str, tuple[Path, LoRAKey]] = {}  # every adapter served: its directory, identity
        self._held: OrderedDict[str, LoRAAdapter] = OrderedDict()
        # Every adapter still in memory (held, or run by a request), by identity: taken back, not read again.
        self._alive: weakref.WeakValueDictionary[LoRAKey, LoRAAdapter] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self.capacity = capacity  # adapters whose weights are held at most (None: every one)
        self.reloads = 0
        # name -> the number (`ops.LoadLoRA.order`) of the latest load or unload of it seen: one the server
        # made earlier (a load it gave up on and undid, whether its read was running or still queued) is
        # dropped, not served behind the server's back.
        self._last_op: dict[str, int] = {}

    def add(self, adapter: LoRAAdapter) -> None:
        with self._lock:
            self.served[adapter.name] = (adapter.path, adapter.identity)
            self._hold(adapter)

    def load(self, name: str, path: str, inplace: bool, order: int) -> LoRAAdapter:
        """Read and serve an adapter (LoRAError if it cannot be), as operation number `order`. May run
        beside the steps: it is taken in one assignment, and requests already running keep the adapter
        they started with, whose identity keys their blocks, so nothing the old weights computed is served
        after a reload."""
        check_name(name)
        with self._lock:
            self._overtaken(name, order)
            if name in self.served and not inplace:
                raise LoRAError(f"adapter {name!r} is already loaded (load_inplace replaces it)")
            self._last_op[name] = order
        adapter = self.read(name, path)
        with self._lock:
            self._overtaken(name, order)
            self.served[name] = (adapter.path, adapter.identity)
            self._hold(adapter)
        return adapter

    def get(self, name: str) -> LoRAAdapter | None:
        """The adapter `name` with its weights (read again if they were let go); None: not served.
        LoRAError when its files no longer hold the weights it was served with."""
        with self._lock:
            if name not in self.served:
                return None
            adapter = self._held.get(name)
            if adapter is not None:
                self._held.move_to_end(name)
                return adapter
            path, identity = self.served[name]
            adapter = self._alive.get(identity)
            if adapter is not None:
                self._hold(adapter)
                return adapter
        # Read outside the lock: an unload (on the engine's thread) or another adapter's read never waits
        # on this one.
        adapter = self.read(name, path)
        if adapter.identity != identity:
            raise LoRAError(
                f"adapter {name!r}: the files in {path} changed since it was loaded (digest "
                f"{identity.digest[:12]}, now {adapter.identity.digest[:12]}): load it again with "
                "load_inplace"
            )
        with self._lock:
            self.reloads += 1
            served = self.served.get(name)
            if served is None or served[1] != identity:  # unloaded, or loaded again in place, meanwhile
                return self._held.get(name)
            adapter = self._alive.get(identity) or adapter  # another request's read meanwhile: one in memory
            self._hold(adapter)
            return adapter

    def remove(self, name: str, order: int) -> bool:
        """Stop serving `name`, as operation number `order`; False: none of that name is served, or a later
        load of it came first (that load stays)."""
        with self._lock:
            if order < self._last_op.get(name, 0):
                return False
            self._last_op[name] = order
            self._held.pop(name, None)
            return self.served.pop(name, None) is not None

    @property
    def held(self) -> list[str]:
        with self._lock:
            return list(self._held)

    def _overtaken(self, name: str, order: int) -> None:
        if self._last_op.get(name, 0) > order:
            raise LoRAError(
                f"adapter {name!r}: a later load or unload of it came first; this load is dropped"
            )

    def _hold(self, adapter: LoRAAdapter) -> None:
        self._alive[adapter.identity] = adapter
        self._held[adapter.name] = adapter
        self._held.move_to_end(adapter.name)
        while self.capacity is not None and len(self._held) > self.capacity:
            self._held.popitem(last=False)
