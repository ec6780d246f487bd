"""How :meth:`MooncakeStore.setup <mooncake_kvaddr.driver.store.MooncakeStore.setup>` connects its client.

The wait for an external master (from Python, bounded and interruptible: Mooncake's setup holds the GIL for each
of its attempts, up to 30 s against a silent listener), the attempts, their client ports (from Mooncake's own
range) and the native client probe; ``driver.store`` keeps admission, set-up and close, and calls these.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import time
from types import ModuleType
from typing import Any, Final

from mooncake_kvaddr.driver.config import StoreConfig
from mooncake_kvaddr.driver.errors import StoreSetupError
from mooncake_kvaddr.driver.master import EmbeddedMaster, free_ports
from mooncake_kvaddr.driver.native_client import NativeClient
from mooncake_kvaddr.driver.outcomes import CODE_MASTER_UNREACHABLE
from mooncake_kvaddr.driver.values import parse_address

# The store's logger: set-up records keep the name they had when this code lived in driver.store.
logger = logging.getLogger("mooncake_kvaddr.driver.store")

# Setup attempts with the embedded master (known to be ready): a failure is a local port clash, and a few
# attempts suffice; Mooncake's default (20 attempts) would hide a dead master for about 90 s
# (docs/configuration.md, section 4).
_EMBEDDED_SETUP_RETRIES: Final = 3
# Where Mooncake picks its client port when it picks one itself (read, never written, by this package).
_CLIENT_PORT_RANGE_ENV: Final = ("MC_STORE_CLIENT_MIN_PORT", "MC_STORE_CLIENT_MAX_PORT")
_CLIENT_PORT_RANGE: Final = (12300, 14300)
_PAUSE_BETWEEN_ATTEMPTS_S: Final = 0.1
#: Attribute set on the log records that say what set-up is waiting for (a command line may show them).
PROGRESS: Final = "mooncake_kvaddr_progress"
# One coro_rpc request (Mooncake's RPC framing: magic 0x15, then a zeroed 19-byte header) for function id 0,
# which no master registers: a master answers at once ("the rpc function not registered"); a listener that is
# not one, or is hung, says nothing.
_PROBE_REQUEST: Final = bytes([0x15]) + bytes(19)
_PAUSE_AFTER_REFUSAL_S: Final = 0.25
_CONNECT_SLICE_S: Final = 2.0


def open_native(config: StoreConfig, client: Any) -> NativeClient | None:
    """The native client for ``client``, or ``None`` (config off, or unavailable: the reason is logged once)."""
    if not config.native_client:
        return None
    try:
        native = NativeClient.from_store(client)
    except Exception as exc:  # never let the fast path break setup: the bound methods always work
        logger.warning("native Mooncake client off: probe failed: %s", exc)
        return None
    if native is not None:
        logger.info("native Mooncake client on (%s)", native.library)
    return native


def wait_for_master(config: StoreConfig, address: str) -> None:
    """Return once the master at ``address`` accepted a TCP connection and answered a request (for
    ``etcd://`` addresses: once one etcd endpoint accepted a connection); :class:`StoreSetupError` naming the
    address, what was tried and ``connect_timeout_s`` after ``config.connect_timeout_s`` seconds.

    Refused connections are retried (a master may be starting). Every wait is a socket call with a timeout, so
    Ctrl-C interrupts it at once.
    """
    timeout = config.connect_timeout_s
    etcd = "://" in address
    endpoints = [(host.strip("[]"), port) for host, port in parse_address(address)]
    what = "one of its etcd endpoints to accept a connection" if etcd else "it to accept a connection and answer"
    logger.info(
        "connecting to the Mooncake master at %s: waiting up to %g s for %s (connect_timeout_s)",
        address, timeout, what, extra={PROGRESS: True},
    )
    started = time.monotonic()
    deadline = started + timeout
    attempts, last_error = 0, "none made"
    while True:
        for host, port in endpoints:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            attempts += 1
            try:
                sock = socket.create_connection((host, port), timeout=min(remaining, _CONNECT_SLICE_S))
            except OSError as exc:
                last_error = f"{host}:{port}: {exc.strerror or exc}"
                continue
            with sock:
                if etcd or _answers(sock, deadline):
                    logger.debug("master %s answered after %.3f s", address, time.monotonic() - started)
                    return
            raise StoreSetupError(
                f"the Mooncake master at {address} accepted a TCP connection but did not answer a request within "
                f"{timeout:g} s: is a mooncake_master (and not something else) listening there, and is it hung? "
                f"To wait longer, raise connect_timeout_s (StoreConfig field and config-file key; "
                f"docs/configuration.md)",
                code=CODE_MASTER_UNREACHABLE,
            )
        if time.monotonic() + _PAUSE_AFTER_REFUSAL_S >= deadline:
            break
        time.sleep(_PAUSE_AFTER_REFUSAL_S)
    raise StoreSetupError(
        f"cannot reach the Mooncake master at {address}: {attempts} TCP connection attempt(s) in {timeout:g} s, "
        f"none accepted (last: {last_error}). Is mooncake_master running there, and is the address right? To "
        f"wait longer, raise connect_timeout_s (StoreConfig field and config-file key; docs/configuration.md)",
        code=CODE_MASTER_UNREACHABLE,
    )


def _answers(sock: socket.socket, deadline: float) -> bool:
    """Whether the peer answers :data:`_PROBE_REQUEST` (any reply, or closing the connection) before ``deadline``."""
    try:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        sock.sendall(_PROBE_REQUEST)
        sock.recv(1)
    except TimeoutError:
        return False
    except OSError:
        pass  # reset by the peer: it reacted, so something alive is there; Mooncake's setup says what
    return True


def connect(config: StoreConfig, module: ModuleType, address: str, master: EmbeddedMaster | None) -> Any:
    """A client set up against the master at ``address``; :class:`StoreSetupError` once no attempt is left.

    An external master (``master`` is ``None``) is first waited for (:func:`wait_for_master`), and no attempt
    of ours starts after ``config.connect_timeout_s``.
    """
    started = time.monotonic()
    if master is None:
        wait_for_master(config, address)
    logger.info("setting up the Mooncake client at %s as %s over %s", address, config.local_hostname,
                config.protocol, extra={PROGRESS: True})
    retries = config.setup_retries
    if retries is None and master is not None:
        retries = _EMBEDDED_SETUP_RETRIES
    if retries is None or _has_port(config.local_hostname):
        # No retries asked: Mooncake's own policy (it picks the client port and retries as its environment
        # says). A pinned port: one attempt, as it does not get free by retrying.
        hosts = [config.local_hostname]
    else:
        # Our own attempts, each on a port picked here, so the retry count is this call's alone (the
        # process environment, shared by every thread, is never written).
        hosts = [f"{config.local_hostname}:{port}" for port in _client_ports(retries)]
    extra: dict[str, str] = {}
    if config.tenant_id != "default":
        extra["tenant_id"] = config.tenant_id  # older wheels lack the keyword; pass it only when needed
    rc, tried = -1, 0
    for attempt, host in enumerate(hosts):
        if attempt:
            if time.monotonic() - started + _PAUSE_BETWEEN_ATTEMPTS_S >= config.connect_timeout_s:
                break
            time.sleep(_PAUSE_BETWEEN_ATTEMPTS_S)
        tried = attempt + 1
        client = module.MooncakeDistributedStore()
        rc = client.setup(
            host,
            config.metadata_server,
            config.global_segment_size,
            config.local_buffer_size,
            config.protocol,
            config.device_name,
            address,
            **extra,
        )
        if rc == 0:
            return client
        # A failed setup may leave a half-built client behind; close() on it is safe and frees it.
        client.close()
        logger.debug("Mooncake setup attempt %d/%d as %s failed with code %s", attempt + 1, len(hosts), host, rc)
        if master is not None and not master.alive:
            break
    detail = ""
    if master is not None:
        detail = f"; embedded master alive={master.alive}, log tail:\n{master.stderr_tail() or '<empty>'}"
    raise StoreSetupError(
        f"Mooncake client setup failed with code {rc} after {tried} attempt(s) (master {address}, "
        f"protocol {config.protocol}, local_hostname {config.local_hostname!r}, metadata "
        f"{config.metadata_server!r}): is the master running and reachable? Mooncake's log has details{detail}",
        code=rc,
    )


def _has_port(hostname: str) -> bool:
    """Whether ``local_hostname`` pins a port (``host:port`` or ``[v6]:port``), as Mooncake reads it."""
    return hostname.rsplit("]", 1)[-1].count(":") == 1


def _client_ports(count: int) -> list[int]:
    """``count`` distinct ports, free a moment ago on every interface, from Mooncake's client port range.

    The range is Mooncake's own (``MC_STORE_CLIENT_MIN_PORT``/``MAX_PORT`` if set, read only), so firewall
    rules written for Mooncake keep working. Falls back to kernel-chosen ports if the range is exhausted.
    """
    low, high = _CLIENT_PORT_RANGE
    with contextlib.suppress(ValueError):
        low = int(os.environ.get(_CLIENT_PORT_RANGE_ENV[0], low))
        high = int(os.environ.get(_CLIENT_PORT_RANGE_ENV[1], high))
    if not 1 <= low <= high <= 65535:
        low, high = _CLIENT_PORT_RANGE
    candidates = random.sample(range(low, high + 1), min(high - low + 1, 8 * count))
    ports: list[int] = []
    for port in candidates:
        if len(ports) == count:
            break
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("0.0.0.0", port))  # the transfer engine listens on every interface
            except OSError:
                continue
        ports.append(port)
    while len(ports) < count:
        ports.extend(port for port in free_ports(count - len(ports), "0.0.0.0") if port not in ports)
    return ports
