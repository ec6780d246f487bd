"""Network namespaces through ``setns(2)`` and ``ip(8)``: entering one, creating, listing and deleting them.

Split out of :mod:`~mooncake_kvaddr.bench.netns` (which re-exports the public names) so that the cluster module
holds only the three-host topology and its processes; the stale-namespace sweep and the availability probe
live here, beside the ``ip`` calls they are made of.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, TypeVar

from mooncake_kvaddr.driver.master import MasterError, find_master_binary, process_is_running

__all__ = ["NAME_PREFIX", "NetnsError", "list_namespaces", "run_in_netns", "sweep_stale", "unavailable_reason"]

_T = TypeVar("_T")

#: Every namespace the harness creates is named ``mkvmh-<creator pid>-<token>-<role>``.
NAME_PREFIX: Final = "mkvmh"
_NAME_RE: Final = re.compile(rf"^{NAME_PREFIX}-(\d+)-([0-9a-f]+)-([a-z]+)$")

_CLONE_NEWNET: Final = 0x40000000
_PR_SET_PDEATHSIG: Final = 1
_NETNS_DIR: Final = Path("/run/netns")
_IP_TIMEOUT_S: Final = 15.0
_KILL_WAIT_S: Final = 5.0


class NetnsError(RuntimeError):
    """Creating, using or removing the namespaces failed (the message carries ``ip``'s stderr)."""


# ------------------------------------------------------------------------------------------- system calls


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.setns.restype = ctypes.c_int
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    libc.prctl.restype = ctypes.c_int
    return libc


def _setns(fd: int) -> None:
    if _libc().setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET): {os.strerror(err)}")


def _open_netns(name: str) -> int:
    try:
        return os.open(_NETNS_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise NetnsError(f"network namespace {name!r} cannot be opened: {exc}") from exc


def run_in_netns(netns: str, fn: Callable[[], _T], timeout: float = 30.0) -> _T:
    """Call ``fn()`` in a fresh thread that has joined network namespace ``netns``; return its result.

    Only that thread changes namespace (``setns`` with ``CLONE_NEWNET`` is per thread), so sockets ``fn``
    creates live in ``netns`` while the rest of the process stays where it was. Raises what ``fn`` raised,
    or :class:`TimeoutError` if it did not finish within ``timeout`` seconds.
    """
    fd = _open_netns(netns)
    box: list[Any] = []

    def target() -> None:
        try:
            _setns(fd)
            box.append((True, fn()))
        except BaseException as exc:  # handed back to the caller, which re-raises it
            box.append((False, exc))

    try:
        thread = threading.Thread(target=target, name=f"netns-{netns}", daemon=True)
        thread.start()
        thread.join(timeout)
    finally:
        os.close(fd)
    if not box:
        raise TimeoutError(f"run_in_netns({netns!r}): no result within {timeout} s")
    ok, value = box[0]
    if not ok:
        raise value
    result: _T = value
    return result


def _netns_preexec(fd: int) -> Callable[[], None]:
    """A ``preexec_fn`` that moves the child into the namespace behind ``fd`` and ties it to its parent."""
    libc = _libc()
    setns = libc.setns
    prctl = libc.prctl
    parent = os.getpid()

    def preexec() -> None:
        if setns(fd, _CLONE_NEWNET) != 0:
            os._exit(126)
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl: the signal will never come
            os._exit(1)

    return preexec


# ------------------------------------------------------------------------------------------- ip(8)


@functools.cache
def _ip_binary() -> str | None:
    found = shutil.which("ip")
    if found:
        return found
    for candidate in ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    binary = _ip_binary()
    if binary is None:
        raise NetnsError("the `ip` command (iproute2) is not installed")
    try:
        done = subprocess.run(
            [binary, *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(f"`ip {' '.join(args)}` did not finish within {_IP_TIMEOUT_S} s") from exc
    if check and done.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def list_namespaces(prefix: str = NAME_PREFIX) -> list[str]:
    """Names of the existing network namespaces that start with ``prefix + "-"``."""
    done = _ip("netns", "list", check=False)
    if done.returncode != 0:
        return []
    names = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
    return [name for name in names if name.startswith(prefix + "-")]


def _netns_pids(name: str) -> list[int]:
    done = _ip("netns", "pids", name, check=False)
    return [int(tok) for tok in done.stdout.split() if tok.isdigit()] if done.returncode == 0 else []


def _kill_netns_processes(name: str) -> None:
    """SIGKILL every process inside namespace ``name`` (continued first, so a stopped one dies too)."""
    for _ in range(3):
        pids = _netns_pids(name)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + _KILL_WAIT_S
        while time.monotonic() < deadline and any(process_is_running(p) for p in pids):
            time.sleep(0.02)


def _delete_netns(name: str) -> None:
    _kill_netns_processes(name)
    done = _ip("netns", "delete", name, check=False)
    if done.returncode != 0 and (_NETNS_DIR / name).exists():
        raise NetnsError(f"cannot delete network namespace {name!r}: {done.stderr.strip()}")


def sweep_stale(prefix: str = NAME_PREFIX) -> list[str]:
    """Delete namespaces named ``<prefix>-<pid>-…`` whose creating process is gone; returns their names.

    Only names with this module's pattern are considered, and a namespace whose creator still runs is left
    alone (another cluster in use). Processes still inside a stale namespace are killed first.
    """
    removed: list[str] = []
    for name in list_namespaces(prefix):
        match = _NAME_RE.match(name)
        if match is None or not name.startswith(prefix + "-"):
            continue
        if process_is_running(int(match.group(1))):
            continue
        with contextlib.suppress(NetnsError):
            _delete_netns(name)
            removed.append(name)
    return removed


@functools.cache
def unavailable_reason() -> str | None:
    """Why a :class:`NetnsCluster` cannot run here (``None`` if it can); checked once per process.

    Checks: Linux, effective root, ``ip`` installed, the Mooncake wheel's master binary, and a trial
    namespace with a bridge and a veth pair (created and deleted again).
    """
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "not root: creating network namespaces needs CAP_SYS_ADMIN and CAP_NET_ADMIN"
    if _ip_binary() is None:
        return "the `ip` command (iproute2) is not installed"
    try:
        find_master_binary()
    except MasterError as exc:
        return str(exc)
    token = secrets.token_hex(3)
    a, b = f"{NAME_PREFIX}-{os.getpid()}-{token}-probea", f"{NAME_PREFIX}-{os.getpid()}-{token}-probeb"
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("-n", a, "link", "add", "br0", "type", "bridge")
        _ip("link", "add", "eth0", "netns", a, "type", "veth", "peer", "name", "eth0", "netns", b)
        _ip("-n", b, "link", "set", "lo", "up")
    except NetnsError as exc:
        return f"cannot build network namespaces here: {exc}"
    finally:
        for name in (a, b):
            with contextlib.suppress(NetnsError):
                _delete_netns(name)
    return None
