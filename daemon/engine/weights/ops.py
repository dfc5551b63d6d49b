"""Weight operations as values: what the server asks every rank's `WeightControl` (`control.py`) to do, and
what each rank answers. A value, not a name, crosses the pipe to a data-parallel rank, and the rank
dispatches on its type (`WeightControl.run`), so every operation has one caller and one handler to grep.

Errors are the engine's own kinds (`WeightErrorKind`); which HTTP status each answers with is the server's
business (`daemon/server/weights/routes.py`).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

INITIAL_VERSION = "initial"  # the version of weights loaded without --weight-version
MIXED_VERSION = "mixed"  # what /weight_info says when the ranks serve different versions
RESERVED_VERSIONS = frozenset({INITIAL_VERSION, MIXED_VERSION})  # no caller may name weights so


class PauseMode(enum.Enum):
    ABORT = "abort"  # end every request (finish_reason "abort")
    WAIT = "wait"  # let the running batch finish, then stop
    KEEP = "keep"  # freeze the requests where they are; a swap restarts them


class WeightErrorKind(enum.Enum):
    INCOMPATIBLE = "incompatible"  # the update does not fit this model or engine (a named tensor, a bad info)
    NOT_FOUND = "not_found"  # no checkpoint where the update points
    OUT_OF_ORDER = "out_of_order"  # not in start -> update -> finish order
    NO_MEMORY = "no_memory"  # the staging copy would not fit in host memory or its cap
    TRANSFER_FAILED = "transfer_failed"  # the trainer's group could not be joined or broke off
    RANK_FAILED = "rank_failed"  # the rank is dead or the operation raised there
    TIMEOUT = "timeout"  # the rank did not answer in time


class WeightError(Exception):
    """A weight operation refused or failed on one rank: its kind, and the tensor it names, if any."""

    def __init__(self, kind: WeightErrorKind, message: str, tensor: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.tensor = tensor

    # it crosses the pipe from a rank process
    def __reduce__(self) -> tuple[type[WeightError], tuple[WeightErrorKind, str, str | None]]:
        return type(self), (self.kind, str(self), self.tensor)


# ---- the operations: those without arguments as members of `Command`, the others as one class each ----
class Command(enum.Enum):
    RESUME = "resume"
    IS_PAUSED = "is_paused"
    SHUTDOWN_TRANSFER = "shutdown_transfer"
    START_UPDATE = "start_update"
    ABORT_UPDATE = "abort_update"
    GET_INFO = "get_info"


@dataclass(frozen=True, slots=True)
class Pause:
    mode: PauseMode


@dataclass(frozen=True, slots=True)
class AbortRequests:
    request_ids: tuple[str, ...]  # empty: every request


@dataclass(frozen=True, slots=True)
class InitTransfer:
    init_info: dict[str, Any]


@dataclass(frozen=True, slots=True)
class UpdateWeights:
    update_info: dict[str, Any]


@dataclass(frozen=True, slots=True)
class FinishUpdate:
    version: str | None  # None: the daemon names it (initial+N)


@dataclass(frozen=True, slots=True)
class SetVersion:
    version: str


# Every run-time load and unload is numbered where it is made (the server, under its LoRA lock), so a
# rank can tell an operation the server has already moved past: a load still queued when the server gave
# up on it and undid it starts after the undo on the rank, and must not land.
_lora_orders = itertools.count(1)


def next_lora_order() -> int:
    return next(_lora_orders)


@dataclass(frozen=True, slots=True)
class LoadLoRA:
    name: str
    path: str
    inplace: bool  # replace an adapter of that name (its new identity keys new blocks)
    order: int = field(default_factory=next_lora_order)


@dataclass(frozen=True, slots=True)
class UnloadLoRA:
    name: str
    order: int = field(default_factory=next_lora_order)


WeightOp = (
    Command
    | Pause
    | AbortRequests
    | InitTransfer
    | UpdateWeights
    | FinishUpdate
    | SetVersion
    | LoadLoRA
    | UnloadLoRA
)


def beside_steps(op: WeightOp) -> bool:
    """Reading a checkpoint or an adapter, joining a trainer's group and hashing the weights take up to
    seconds: these run on a thread beside the engine's steps, the others between two steps."""
    return isinstance(op, UpdateWeights | InitTransfer | LoadLoRA) or op is Command.GET_INFO


@dataclass(frozen=True, slots=True)
class RankReply:
    """One rank's answer to an operation: its `value` (the fields the routes report per rank), or `error`."""

    rank: int
    value: dict[str, Any] | None = None
    error: WeightError | None = None

    @classmethod
    def of(cls, rank: int, reply: dict[str, Any] | BaseException, timeout: float) -> RankReply:
        """The rank's answer, or what its client makes of none: TIMEOUT when the answer did not come
        within `timeout` seconds (a `TimeoutError`), RANK_FAILED when the rank is dead or raised."""
        if isinstance(reply, dict):
            return cls(rank, value=reply)
        if isinstance(reply, WeightError):
            return cls(rank, error=reply)
        if isinstance(reply, TimeoutError):
            return cls(rank, error=WeightError(WeightErrorKind.TIMEOUT, f"no answer within {timeout:g} s"))
        return cls(rank, error=WeightError(WeightErrorKind.RANK_FAILED, str(reply)))
