"""docs/router.md's first block, run as written in bash from the checkout: two daemons that publish KV events,
the router in front of them, a chat request, a fleet reset and /health through the router. Only the ports
change (free ones instead of 8001, 8002, 8080, 5557, ...), so that nothing else on this machine is in the way."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from support import ROOT
from support.procs import free_port

pytestmark = pytest.mark.timeout(600)

SEP = "----- 8< -----"


def quickstart() -> list[str]:
    text = (ROOT / "docs" / "router.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "docs/router.md has no bash block"
    lines = block.group(1).replace("\\\n", " ").splitlines()
    return [
        re.sub(r"\s+#.*$", "", ln).strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")
    ]


def test_the_router_quickstart_as_written(tmp_path: Path) -> None:
    cmds = quickstart()
    serve = [c for c in cmds if c.startswith(".venv/bin/kvpilot serve ")]
    (router,) = [c for c in cmds if c.startswith(".venv/bin/kvpilot router ")]
    curls = [c for c in cmds if c.startswith("curl ")]
    assert len(serve) == 2 and all(c.endswith("&") for c in serve) and len(curls) == 3, cmds
    port = re.compile(r"((?:127\.0\.0\.1|localhost):|--port )(\d+)")
    ports = sorted({int(m[2]) for c in cmds for m in port.finditer(c)})
    assert 8080 in ports, ports  # the router's default port, which the curls use
    remap = {p: free_port() for p in ports}

    def moved(cmd: str) -> str:
        return port.sub(lambda m: f"{m[1]}{remap[int(m[2])]}", cmd)

    router_port = remap[8080]
    script = "\n".join(
        [
            *(moved(c) for c in serve),
            # the docs run the router in the foreground (the daemons load meanwhile); here it goes to the background
            f"{moved(router)} --port {router_port} &",
            # until the router has seen both daemons ready (its /health is 200 once one is; it probes every few s)
            f'for i in $(seq 300); do [ "$(curl -sf localhost:{router_port}/health | grep -o \'"ready": true\' '
            '| wc -l)" = 2 ] && break; sleep 1; done',
            *(f"{moved(c)}; echo; echo '{SEP}'" for c in curls),
        ]
    )
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "KVPILOT_ADMIN_TOKEN")}
    # Output to files, not pipes: the processes started with `&` keep them open after the script ends.
    with open(tmp_path / "stdout.log", "wb") as stdout, open(tmp_path / "stderr.log", "wb") as stderr:
        proc = subprocess.Popen(
            ["bash", "-c", script], cwd=ROOT, env=env, stdout=stdout, stderr=stderr, start_new_session=True
        )
    try:
        proc.wait(timeout=400)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # the daemons and the router, started with `&`
        except ProcessLookupError:
            pass
    out, log = (tmp_path / "stdout.log").read_text(), (tmp_path / "stderr.log").read_text()[-4000:]
    parts = out.split(SEP)
    assert len(parts) == 4, (out, log)
    chat, reset, health = (json.loads(part) for part in parts[:3])
    assert chat["choices"][0]["message"]["content"], (chat, log)
    assert reset["success"] is True and len(reset["pods"]) == 2, reset
    assert all(p["success"] and p["epoch"] >= 1 and p["verified"] == "cold" for p in reset["pods"]), reset
    assert len(health["pods"]) == 2 and all(p["ready"] and p["kv_events"] == "on" for p in health["pods"]), (
        health
    )
