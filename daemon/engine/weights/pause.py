"""The engine's pause state (`LLMEngine.pause` / `resume`): the mode, whether the batch has drained, and the
requests held meanwhile; and the last output of a request that a pause or a weight swap stops."""

from __future__ import annotations

from collections.abc import Callable

from kvpilot.daemon.engine.outputs import RequestOutput
from kvpilot.daemon.engine.request import Request
from kvpilot.daemon.engine.weights.ops import PauseMode


class PauseState:
    def __init__(self) -> None:
        self.mode: PauseMode | None = None  # None while serving
        self.drained = False  # paused, and nothing is left to step
        self.held: list[str] = []  # requests added while paused, scheduled on resume
        self._on_drained: Callable[[], None] | None = None  # a WAIT pause's answer, once drained

    def start(self, mode: PauseMode, busy: bool, on_drained: Callable[[], None]) -> bool:
        """Pause in `mode` with `busy` requests scheduled; True when drained already (then `on_drained`
        is never called), else it is called after the step that drains the batch."""
        self.mode = mode
        self.drained = mode is not PauseMode.WAIT or not busy
        self._on_drained = None if self.drained else on_drained
        return self.drained

    def hold(self, request_id: str) -> bool:
        """A request arrives: True when it is held (paused) rather than scheduled."""
        if self.mode is not None:
            self.held.append(request_id)
        return self.mode is not None

    def end(self) -> list[str]:
        """Serve again; returns the requests held meanwhile."""
        self.mode, self.drained, self._on_drained = None, False, None
        held, self.held = self.held, []
        return held

    def may_step(self) -> bool:
        return self.mode is None or (self.mode is PauseMode.WAIT and not self.drained)

    def after_step(self, busy: bool) -> None:
        if self.mode is PauseMode.WAIT and not self.drained and not busy:
            self.drained = True
            if self._on_drained is not None:
                done, self._on_drained = self._on_drained, None
                done()

    def release(self, request_id: str) -> None:
        """The request left the engine: it is no longer held."""
        if request_id in self.held:
            self.held.remove(request_id)


def stopped_output(seq: Request, weight_version: str, restart: bool = False) -> RequestOutput:
    """A sequence ended (finish_reason "abort"), or `restart`ed: what it sent so far is to be discarded,
    it runs again from its prompt."""
    return RequestOutput(
        request_id=seq.group_id,
        index=seq.index,
        new_token_ids=[],
        finished=not restart,
        finish_reason=None if restart else "abort",
        num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_tokens=max(seq.num_cached_tokens, 0),
        num_output_tokens=0 if restart else len(seq.output_token_ids),
        weight_version=weight_version,
        restart=restart,
    )
