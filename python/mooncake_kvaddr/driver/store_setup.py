"""How :meth:`MooncakeStore.setup <mooncake_kvaddr.driver.store.MooncakeStore.setup>` connects its client.

The attempts, their client ports (from Mooncake's own range) and the native client probe, apart from the
store's state machine: ``driver.store`` keeps admission, set-up and close, and calls these.
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
from mooncake_kvaddr.driver.master import EmbeddedMaster
from mooncake_kvaddr.driver.native_client import NativeClient

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


def connect(config: StoreConfig, module: ModuleType, address: str, master: EmbeddedMaster | None) -> Any:
    """A client set up against the master at ``address``; :class:`StoreSetupError` once no attempt is left."""
    retries = config.setup_retries
    if retries is None and master is not None:
        retries = _EMBEDDED_SETUP_RETRIES
    if retries is None:
        # Mooncake's own policy: it picks the client port and retries as its environment says.
        hosts = [config.local_hostname]
    elif _has_port(config.local_hostname):
        hosts = [config.local_hostname]  # a pinned port does not get free by retrying
    else:
        # Our own attempts, each on a port picked here, so the retry count is this call's alone (the
        # process environment, shared by every thread, is never written).
        hosts = [f"{config.local_hostname}:{port}" for port in _client_ports(retries)]
    rc, tried = -1, 0
    for attempt, host in enumerate(hosts):
        tried = attempt + 1
        if attempt:
            time.sleep(_PAUSE_BETWEEN_ATTEMPTS_S)
        client = module.MooncakeDistributedStore()
        rc = _setup_once(config, client, host, address)
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


def _setup_once(config: StoreConfig, client: Any, host: str, address: str) -> int:
    extra: dict[str, str] = {}
    if config.tenant_id != "default":
        extra["tenant_id"] = config.tenant_id  # older wheels lack the keyword; pass it only when needed
    rc: int = client.setup(
        host,
        config.metadata_server,
        config.global_segment_size,
        config.local_buffer_size,
        config.protocol,
        config.device_name,
        address,
        **extra,
    )
    return rc


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
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("0.0.0.0", 0))
            port = sock.getsockname()[1]
        if port not in ports:
            ports.append(port)
    return ports
