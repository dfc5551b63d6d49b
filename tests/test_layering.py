"""The parts import each other only downwards: the router and the operator never import each other, the
router imports nothing of the daemon (what they share, the OpenAI protocol, the KV-event format, block keys
and the admin token, are neutral modules under kvpilot/), the reset fan-out both use imports neither of them
(nor Kubernetes or kopf), and no shared module under kvpilot/ imports a part. Read from the source with `ast`,
nothing imported, so an import inside a function counts as much as one at the top."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PARTS = ("kvpilot.daemon", "kvpilot.router", "kvpilot.operator", "kvpilot.kernels")

# folder -> (its import name, the packages none of its modules may import)
RULES = {
    "daemon": ("kvpilot.daemon", ("kvpilot.router", "kvpilot.operator")),
    # the engine speaks no HTTP: the server maps its errors to statuses
    "daemon/engine": ("kvpilot.daemon.engine", ("kvpilot.daemon.server", "aiohttp")),
    # the engine imports the KV connector's holds and landings: they, too, speak no HTTP
    "daemon/kv_transfer": ("kvpilot.daemon.kv_transfer", ("kvpilot.daemon.server", "aiohttp")),
    "kernels": ("kvpilot.kernels", ("kvpilot.daemon", "kvpilot.router", "kvpilot.operator")),
    "router": ("kvpilot.router", ("kvpilot.operator", "kvpilot.daemon")),
    "operator": ("kvpilot.operator", ("kvpilot.router",)),
    "kvpilot/fanout": ("kvpilot.fanout", ("kvpilot.operator", "kvpilot.router", "kubernetes", "kopf")),
}

# The modules of kvpilot/ that may import the parts: the CLI dispatcher, which hands each subcommand to its
# part's own cli.py. Every other module there is shared (fan-out aside: it has its own rule above).
CLI_DISPATCHER = {"kvpilot/cli/main.py", "kvpilot/__main__.py"}


def shared_modules() -> list[Path]:
    """The modules of kvpilot/ that the parts share: all but the CLI dispatcher and the fan-out."""
    return [
        path
        for path in sorted((ROOT / "kvpilot").rglob("*.py"))
        if path.relative_to(ROOT).as_posix() not in CLI_DISPATCHER
        and not path.is_relative_to(ROOT / "kvpilot" / "fanout")
    ]


def imports(source: str, package: str) -> list[tuple[int, str]]:
    """(line, absolute name) of everything a module of `package` imports, sorted by line. `from A import B`
    counts as A.B, so `from kvpilot import operator` is seen; relative imports are resolved."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[: len(parts) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            out += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return sorted(out)


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize("folder", sorted(RULES))
def test_no_forbidden_import(folder: str) -> None:
    import_name, forbidden = RULES[folder]
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, f"no Python files under {folder}/"
    bad = []
    for path in files:
        package = ".".join([import_name, *path.relative_to(ROOT / folder).parent.parts])
        for line, name in imports(path.read_text(), package):
            if any(within(name, f) for f in forbidden):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not bad, "layering broken:\n" + "\n".join(bad)


def test_shared_modules_import_no_part() -> None:
    files = shared_modules()
    assert (
        ROOT / "kvpilot" / "kv" / "events.py" in files and ROOT / "kvpilot" / "cli" / "main.py" not in files
    )
    assert all((ROOT / name).is_file() for name in CLI_DISPATCHER), "a listed dispatcher module is gone"
    bad = []
    for path in files:
        package = ".".join(["kvpilot", *path.relative_to(ROOT / "kvpilot").parent.parts])
        for line, name in imports(path.read_text(), package):
            if any(within(name, part) for part in PARTS):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not bad, "a shared module imports a part:\n" + "\n".join(bad)


def test_the_check_sees_every_form_of_import() -> None:
    source = (
        "import kopf\n"
        "from kvpilot import operator\n"
        "from ..operator.metrics import POD_REQUESTS\n"
        "from . import pods\n"
        "def f():\n"
        "    import kubernetes.client\n"
    )
    assert imports(source, "kvpilot.router") == [
        (1, "kopf"),
        (2, "kvpilot.operator"),
        (3, "kvpilot.operator.metrics.POD_REQUESTS"),
        (4, "kvpilot.router.pods"),
        (6, "kubernetes.client"),
    ]
    # and both callers' use of the fan-out is found in the real files
    for folder, package, module in (
        ("operator", "kvpilot.operator", "resets/drive.py"),
        ("router", "kvpilot.router", "fleet/reset.py"),
    ):
        found = imports((ROOT / folder / module).read_text(), package)
        assert any(within(name, "kvpilot.fanout") for _, name in found), module
    # the neutral contracts are what the router and the daemon really import: the rules above see them
    for folder, package, module, contract in (
        ("router", "kvpilot.router", "kv/stream.py", "kvpilot.kv.events"),
        ("daemon/engine", "kvpilot.daemon.engine", "kv/publisher.py", "kvpilot.kv.events"),
        ("router", "kvpilot.router", "routing/prompts.py", "kvpilot.protocol"),
        ("daemon/server", "kvpilot.daemon.server", "prepare.py", "kvpilot.protocol"),
    ):
        found = imports((ROOT / folder / module).read_text(), package)
        assert any(within(name, contract) for _, name in found), module
    # and the shared-module rule sees a part imported by a real dispatcher module
    found = imports((ROOT / "kvpilot" / "cli" / "main.py").read_text(), "kvpilot.cli")
    assert any(within(name, "kvpilot.daemon") for _, name in found)
