"""Child processes that never outlive us.

Every server we start gets its own process group, so stopping it also stops
anything it forked. Live groups are remembered and killed at interpreter exit,
so a crashed test run leaves no apiserver or pod process behind. The dev
cluster, the tests (tests/support) and bench/ start their servers with these.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

_live: dict[int, subprocess.Popen] = {}
_lock = threading.Lock()


# Where free_port draws from: below Kubernetes' NodePort range (30000-32767) and the kernel's ephemeral
# ports (32768-60999). A port the kernel hands out for port 0 lies in the ephemeral range, where any
# outgoing connection's own port may take it between the check and the server's bind (a daemon once failed
# to bind its KV events endpoint so); nothing takes a port here unasked.
PORT_RANGE = range(20000, 30000)
_ports = random.SystemRandom()  # the OS's randomness: processes (xdist workers, forks) never draw alike
_handed: set[int] = set()
# A port handed out is leased to its process for LEASE_S in a folder every process of this user shares: a
# bind check alone let two processes (xdist workers, a bench a test runs) take one port that neither had bound
# yet, and the slower server failed "Address already in use". A fixed path, not the temp folder: a test may
# run a bench with TMPDIR set to a folder of its own.
LEASES = Path("/tmp") / f"kvpilot-port-leases-{os.getuid()}"
LEASE_S = 600.0


def free_port() -> int:
    """A loopback port, free now, from PORT_RANGE, never handed out before by this process and not by another
    one in the last LEASE_S (a server given one may not have bound it yet)."""
    for _ in range(1000):
        port = _ports.choice(PORT_RANGE)
        with _lock:
            if port in _handed:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:  # in use, or lingering (TIME_WAIT): another one
                    continue
            if not _lease(port):
                continue
            _handed.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {PORT_RANGE.start}-{PORT_RANGE.stop - 1}")


def _lease(port: int) -> bool:
    """Lease `port` to this process unless another one holds it; one process at a time decides. Where the
    folder cannot be used (another user's, a full or read-only /tmp) the bind check alone decides, as it did
    before leases: a server start never fails on it."""
    try:
        LEASES.mkdir(mode=0o700, exist_ok=True)
        if LEASES.lstat().st_uid != os.getuid():  # nobody else may plant a lease, or a link, in it
            return True
        fd = os.open(LEASES / "lock", os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        lease = LEASES / str(port)
        with contextlib.suppress(FileNotFoundError):
            if time.time() - lease.lstat().st_mtime < LEASE_S:
                return False
        held = os.open(lease, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(held, str(os.getpid()).encode())
            os.utime(held)  # the lease starts now, whatever the file held
        finally:
            os.close(held)
        return True
    except OSError:
        return True
    finally:
        # Unlocked before closed: a child forked meanwhile shares the descriptor, and with it the lock.
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin")


def sbin_path() -> dict[str, str]:
    """This environment with the system folders on PATH: a user's shell may lack /usr/sbin, where Debian puts
    runc and iptables (containerd, the kubelet and kube-proxy look them up on PATH too)."""
    path = os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep)
    return {**os.environ, "PATH": os.pathsep.join(path + [d for d in SBIN if d not in path])}


def run_tool(*argv: str | Path, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    """A system tool run to its end (buildah, ctr, ip, iptables: found on sbin_path()), its output captured."""
    return subprocess.run(
        [str(a) for a in argv], check=check, capture_output=True, text=True, timeout=timeout, env=sbin_path()
    )


def spawn(
    argv: Sequence[str],
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
) -> subprocess.Popen:
    """Start `argv` in a new session (its own process group), output to `log_path`."""
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    finally:
        if log_path:
            out.close()  # the child holds its own copy of the descriptor
    with _lock:
        _live[proc.pid] = proc
    return proc


# Looked up once here: the child after fork must not load libraries.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG (1): if we are SIGKILLed (no atexit runs), the kernel
    # kills the child too. It survives exec. Caveat: it fires when the *thread*
    # that forked exits, so spawn from threads that live as long as the child.
    _prctl(1, signal.SIGKILL)


def wait_ready(
    proc: subprocess.Popen,
    ready: Callable[[], object],
    timeout: float,
    what: str,
    log_path: Path | None = None,
    interval: float = 0.5,
) -> None:
    """Poll `ready()` until it returns something truthy while `proc` runs. A probe that raises OSError
    or ValueError (not listening yet, a half-written reply) counts as not ready. If `proc` exits or
    `timeout` passes, its group is stopped and RuntimeError carries the tail of its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{_tail(log_path)}")
        try:
            if ready():
                return
        except (OSError, ValueError):
            pass
        time.sleep(interval)
    stop(proc)
    raise RuntimeError(f"{what} was not ready after {timeout:.0f} s:\n{_tail(log_path)}")


def _tail(log_path: Path | None, chars: int = 10000) -> str:
    return log_path.read_text(errors="replace")[-chars:] if log_path and log_path.exists() else ""


def group_alive(pgid: int) -> bool:
    """True while any process of the group exists (zombies of ours are reaped first)."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop(proc: subprocess.Popen, grace: float = 5.0, leader_only: bool = False) -> int | None:
    """SIGTERM the process group, SIGKILL it after `grace` seconds; returns the exit code.

    `leader_only`: SIGTERM only the leader, as Kubernetes signals a container's main process, so that a
    server shuts its own children down in order; what is left of the group after `grace` is SIGKILLed."""
    pgid = proc.pid  # start_new_session makes the leader's pid the group id
    if leader_only:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    else:
        _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if proc.poll() is not None and not group_alive(pgid):
            break
        time.sleep(0.05)
    else:
        _signal_group(pgid, signal.SIGKILL)
    try:
        code = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        code = None
    # Children the leader left behind may linger briefly after SIGKILL.
    end = time.monotonic() + 2
    while group_alive(pgid) and time.monotonic() < end:
        _signal_group(pgid, signal.SIGKILL)
        time.sleep(0.02)
    with _lock:
        _live.pop(proc.pid, None)
    return code


def stop_all(grace: float = 5.0) -> None:
    """Stop every process group spawned here that is still tracked (a test session's last teardown)."""
    with _lock:
        procs = list(_live.values())
    for proc in procs:
        stop(proc, grace)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@atexit.register
def _kill_all() -> None:
    with _lock:
        procs = list(_live.values())
    for proc in procs:
        _signal_group(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
