"""The weight operations' values and errors, without an engine: each error kind answers with one HTTP
status (the server's table), and what crosses the pipe to a data-parallel rank and back keeps its meaning."""

from __future__ import annotations

import pickle

from kvpilot.daemon.engine.weights.ops import (
    Command,
    FinishUpdate,
    Pause,
    PauseMode,
    RankReply,
    WeightError,
    WeightErrorKind,
    beside_steps,
)
from kvpilot.daemon.server.weights.routes import HTTP_STATUS, rank_entry


def test_every_error_kind_has_a_status() -> None:
    assert set(HTTP_STATUS) == set(WeightErrorKind)


def test_operations_and_errors_cross_a_pipe() -> None:
    for op in (Pause(PauseMode.WAIT), FinishUpdate("v2"), Command.GET_INFO):
        assert pickle.loads(pickle.dumps(op)) == op
    err = pickle.loads(pickle.dumps(WeightError(WeightErrorKind.NO_MEMORY, "too big", "w")))
    assert (err.kind, str(err), err.tensor) == (WeightErrorKind.NO_MEMORY, "too big", "w")
    assert beside_steps(Command.GET_INFO) and not beside_steps(Command.START_UPDATE)


def test_a_rank_reply_as_the_routes_report_it() -> None:
    refused = RankReply.of(1, WeightError(WeightErrorKind.INCOMPATIBLE, "no place", "t"), 5.0)
    assert rank_entry(refused) == {"rank": 1, "error": "no place", "status": 400, "tensor": "t"}
    silent = RankReply.of(0, TimeoutError(), 5.0)
    assert rank_entry(silent) == {"rank": 0, "error": "no answer within 5 s", "status": 500}
    assert rank_entry(RankReply.of(2, {"dropped": True}, 5.0)) == {"rank": 2, "dropped": True}
