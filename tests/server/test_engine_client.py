"""The server's one contract with the engine: both clients implement every member of `EngineClient` with
its parameters, and no server module reaches past the contract into an implementation."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import kvpilot.daemon.server as server_package
from kvpilot.daemon.engine.client import EngineClient, WeightOperations
from kvpilot.daemon.engine.engine_loop import EngineLoop
from kvpilot.daemon.engine.parallel.dp_engine import DataParallelLoop

IMPLEMENTATIONS = ("engine_loop", "dp_engine", "dp_rank", "dp_policy", "tp")


def _members() -> dict[str, object]:
    """Every public member of the contract, the ones it inherits (the named weight operations) included."""
    members: dict[str, object] = {}
    for cls in reversed(EngineClient.__mro__):
        if cls.__module__ == EngineClient.__module__:
            members.update((name, value) for name, value in vars(cls).items() if not name.startswith("_"))
    return members


def test_the_contract_includes_the_weight_operations() -> None:
    assert {"run_weight_op", "pause_generation", "finish_weight_update", "add", "reset_ranks"} <= set(
        _members()
    )


@pytest.mark.parametrize("client", [EngineLoop, DataParallelLoop])
def test_each_client_carries_weight_operations_itself(client: type) -> None:
    # the contract's run_weight_op only raises: a client that inherits it would fail every weight route
    assert client.run_weight_op is not WeightOperations.run_weight_op


@pytest.mark.parametrize("client", [EngineLoop, DataParallelLoop])
def test_each_client_implements_the_whole_contract(client: type) -> None:
    init = inspect.getsource(client.__init__)
    for name, member in _members().items():
        if isinstance(member, property):
            assert isinstance(getattr(client, name, None), property) or f"self.{name} =" in init, name
            continue
        impl = getattr(client, name)
        assert inspect.iscoroutinefunction(impl) == inspect.iscoroutinefunction(member), name
        wanted = list(inspect.signature(member).parameters)
        given = inspect.signature(impl).parameters
        assert list(given)[: len(wanted)] == wanted, name
        assert all(p.default is not p.empty for p in list(given.values())[len(wanted) :]), name


def test_the_server_imports_no_engine_implementation() -> None:
    for path in Path(server_package.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            for module in modules:
                assert module.rsplit(".", 1)[-1] not in IMPLEMENTATIONS, f"{path.name} imports {module}"
