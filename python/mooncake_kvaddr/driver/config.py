"""Configuration of the Mooncake store client (:class:`StoreConfig`; docs/configuration.md).

A vLLM Mooncake config file (``MOONCAKE_CONFIG_PATH``) loads unchanged; the other fields are the knobs this
package needs to drive the store safely (batch splitting, bounded waits, the embedded master). Every value is
checked when the object is built, with an error that names the field.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from mooncake_kvaddr.driver.master import check_master_args
from mooncake_kvaddr.driver.values import (
    check_bool,
    check_int,
    check_str,
    check_timeout,
    parse_address,
    parse_host_port,
    parse_size,
    show,
)

__all__ = [
    "DEFAULT_CONFIG_ENV",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "MIN_GLOBAL_SEGMENT_SIZE",
    "MODES",
    "TRANSFER_MODES",
    "VLLM_CONNECTOR_KEYS",
    "StoreConfig",
    "parse_address",
    "parse_size",
]

logger = logging.getLogger(__name__)

#: Environment variable naming the JSON config file (the one vLLM's connector reads).
DEFAULT_CONFIG_ENV: Final = "MOONCAKE_CONFIG_PATH"

_PROTOCOLS: Final = ("tcp", "rdma")

#: vLLM's Mooncake topologies: ``"embedded"`` (this client contributes ``global_segment_size`` > 0 bytes
#: to the pool) and ``"standalone-store"`` (it contributes 0; a separate ``mooncake_client`` owns the pool).
MODES: Final = ("embedded", "standalone-store")

#: Keys vLLM 0.33's Mooncake store connector reads from ``kv_connector_extra_config``. They configure vLLM's
#: connector, not the store client: accepted by :meth:`StoreConfig.from_dict` and ignored (logged at debug).
VLLM_CONNECTOR_KEYS: Final = frozenset(
    {
        "cache_prefix",
        "custom_mem_pool",
        "enable_cross_layers_blocks",
        "enable_group_semantics",
        "enable_lookup",
        "enable_store_tp_lcm",
        "load_async",
        "lookup_async",
        "lookup_rpc_port",
        "preferred_segment",
        "prefill_tp_sizes",
        "save_decode_cache",
        "store_tp_size",
    }
)

# Over TCP a single batch of more than ~1-2 k regions fails with -800 (per-peer queue of 1024 transfers,
# docs/configuration.md); RDMA has no such queue, so its budget only bounds one call's argument lists.
_DEFAULT_REGION_BUDGET: Final = {"tcp": 1000, "rdma": 1 << 20}

#: How KVTransfer moves a key with several regions: ``"multi_buffer"`` hands Mooncake every region (its
#: ``batch_*_multi_buffers`` calls), ``"staged"`` copies the regions natively through one contiguous staging
#: slot per key, ``"auto"`` picks one of them per direction by region size and transport (``rules.choose_auto_mode``).
TRANSFER_MODES: Final = ("auto", "staged", "multi_buffer")

#: Default of :attr:`StoreConfig.request_timeout_s`. Generous: the longest healthy request over TCP (the
#: headline load in multi-buffer mode across namespaces, docs/multihost.md, "Benchmark") fits ten times over,
#: so a loaded host does not hit it; a hung peer is cut short by the transfer-timeout rule first
#: (docs/transfer-modes.md, "Deadlines").
DEFAULT_REQUEST_TIMEOUT_S: Final = 120.0

#: Default of :attr:`StoreConfig.connect_timeout_s`: a master on another host has time to start; one that
#: cannot be reached is reported well before Mooncake's own retries would give up (~90 s, docs/configuration.md).
DEFAULT_CONNECT_TIMEOUT_S: Final = 20.0

#: Default of :attr:`StoreConfig.max_abandoned_calls`: a few hung staged calls, each holding one thread and
#: its staging slots, before staged requests fail fast instead of piling up more.
DEFAULT_MAX_ABANDONED_CALLS: Final = 4
_MAX_ABANDONED_CALLS_LIMIT: Final = 1024

# Mooncake refuses a smaller non-zero segment at setup ("Total size must be at least 16777216" -> -600).
MIN_GLOBAL_SEGMENT_SIZE: Final = 16 << 20
_MAX_SETUP_RETRIES: Final = 1000
_DEFAULT_TENANT: Final = "default"


@dataclass(frozen=True)
class StoreConfig:
    """Everything needed to set up a Mooncake store client, validated at construction.

    The fields shared with vLLM's ``MooncakeStoreConfig`` have vLLM's names and meanings, so a JSON file
    written for vLLM loads as is; the others tune this package. Where the master is:
    ``master_server_address="host:port"`` for a running master, or ``embedded_master=True`` to have
    :meth:`MooncakeStore.setup <mooncake_kvaddr.driver.store.MooncakeStore.setup>` start a private one on
    127.0.0.1 (tests, demos, benchmarks). A config with neither is valid (it may be used only for its
    transfer settings) but cannot set up a store. See ``docs/configuration.md``.
    """

    local_hostname: str = "127.0.0.1"
    """Address this client advertises to peers (``"host"``, or ``"host:port"`` to pin the port)."""
    metadata_server: str = "P2PHANDSHAKE"
    """Transfer-engine metadata: ``"P2PHANDSHAKE"`` (no server), ``"http://…/metadata"`` or etcd."""
    master_server_address: str | None = None
    """``"host:port"`` (or ``"etcd://host:port;…"``) of a running master; ``None`` with ``embedded_master``."""
    protocol: str = "tcp"
    """``"tcp"`` or ``"rdma"``."""
    device_name: str = ""
    """RDMA device list (``""`` = auto-discover / TCP)."""
    global_segment_size: int = 512 << 20
    """Bytes this client contributes to the pool: 0 (pure client) or >= 16 MiB; allocated at setup."""
    local_buffer_size: int = 16 << 20
    """Staging buffer of Mooncake's copying API; the zero-copy batch calls work with 0."""
    tenant_id: str = _DEFAULT_TENANT
    """Mooncake tenant namespace (vLLM's ``tenant_id``; ``None``/blank mean ``"default"``). Alias: ``tenant``."""
    mode: str | None = None
    """vLLM's topology, ``"embedded"`` or ``"standalone-store"`` (see :data:`MODES`); ``None`` derives it
    from ``global_segment_size``. When given it must agree: embedded needs a segment, standalone none."""
    enable_offload: bool = False
    """vLLM's flag for a pool with an SSD tier. Recorded (see ``docs/configuration.md``); not passed to
    Mooncake's setup, as vLLM does not pass it either."""
    embedded_master: bool = False
    """Start a private ``mooncake_master`` on 127.0.0.1 at setup (and stop it at close). Only when asked:
    a deployment names its master in ``master_server_address``."""

    max_regions_per_batch: int | None = None
    """Region budget per Mooncake call; larger batches are split (``None``: 1000 on tcp, 2**20 on rdma)."""
    setup_retries: int | None = None
    """How many client setup attempts, each on a newly picked local port, this package makes itself (no
    environment variable is touched). ``None``: 3 with the embedded master, else one Mooncake setup call
    with Mooncake's own retry policy. How long a failed attempt takes: ``docs/configuration.md``, "Setup
    attempts, and how long a failure takes"."""
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    """How long setup waits for a master named by ``master_server_address`` to accept a TCP connection and
    answer a request before it raises ``StoreSetupError`` naming the address: a master that is not up yet gets
    this long, one where nothing listens or that never answers is reported after it. Mooncake's own setup call
    runs only once the master answered. See ``docs/configuration.md``, "Setup attempts, and how long a failure
    takes"."""
    close_timeout_s: float = 120.0
    """How long ``close()`` waits for calls in flight (a TCP transfer may take 60 s to time out)."""
    request_timeout_s: float | None = DEFAULT_REQUEST_TIMEOUT_S
    """Deadline of one request: a store batch call, or one ``KVTransfer`` load or store. Checked before every
    Mooncake call the request makes (each sub-batch, each staged batch); once it has passed, the remaining
    keys fail ``TRANSFER_FAILED`` without another call. A multi-buffer or direct call already in flight is not
    interrupted, so such a request ends within this plus one call; a staged request stops waiting for its call
    here (the call is abandoned, see :attr:`max_abandoned_calls`). ``None``: no deadline. See
    ``docs/transfer-modes.md``, "Deadlines"."""
    max_abandoned_calls: int = DEFAULT_MAX_ABANDONED_CALLS
    """Staged Mooncake calls a KVTransfer may have abandoned at their request's deadline and still in flight
    (each keeps one thread and the staging slots it reads or writes until Mooncake returns). Once that many
    are in flight, new staged requests fail at once (``stopped`` says why) until one returns. ``0``: never
    abandon a call; a staged request then waits for its call like the other modes. See
    ``docs/transfer-modes.md``, "Deadlines"."""
    master_start_timeout_s: float = 15.0
    """How long to wait for the embedded master to be ready."""
    native_client: bool = True
    """Call Mooncake's C++ client directly for batch transfers, with the GIL released, when this Mooncake
    build is verified for it; otherwise (or ``False``, or ``MOONCAKE_KVADDR_NATIVE_CLIENT=0``) the bound
    Python methods. Results are the same either way (``docs/native-client.md``, "In the driver")."""
    master_args: tuple[str, ...] = ()
    """Extra command-line flags for the embedded master, e.g. ``("-default_kv_lease_ttl=2000",)``: each one
    ``-name=value``, none that sets where the master listens (refused with ``ValueError``, see
    :func:`~mooncake_kvaddr.driver.master.check_master_args`); the loopback flags come after them."""
    transfer_mode: str = "auto"
    """How KVTransfer moves keys with several regions: ``"auto"``, ``"staged"`` or ``"multi_buffer"``
    (see :data:`TRANSFER_MODES`). One-region layouts always use the contiguous calls unless
    ``"multi_buffer"`` is asked for."""
    staging_buffer_size: int = 512 << 20
    """Bytes of the staging pool of a staged KVTransfer (registered with Mooncake once, pre-faulted at
    start-up, never larger than the KV cache needs). A request larger than the pool moves in batches."""

    def __post_init__(self) -> None:
        # A frozen dataclass cannot assign normally; normalise in place so that every instance that exists
        # is valid and uses canonical types (int sizes, lower-case protocol, tuple master_args).
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        for name in ("local_hostname", "metadata_server", "device_name"):
            check_str(name, getattr(self, name))
        hostname = self.local_hostname.strip()
        if not hostname:
            raise ValueError("local_hostname: must not be empty (use '127.0.0.1' for loopback)")
        parse_host_port(hostname, "local_hostname", port_required=False)
        put("local_hostname", hostname)
        if not self.metadata_server.strip():
            raise ValueError("metadata_server: must not be empty (use 'P2PHANDSHAKE')")
        put("metadata_server", self.metadata_server.strip())
        put("embedded_master", check_bool("embedded_master", self.embedded_master))
        if self.master_server_address is not None:
            address = check_str("master_server_address", self.master_server_address).strip()
            parse_address(address)  # a malformed address fails here, not after minutes of setup retries
            if self.embedded_master:
                raise ValueError(
                    f"master_server_address={address!r} and embedded_master=True: choose one "
                    "(an address names a running master; embedded_master starts a private one)"
                )
            put("master_server_address", address)
        put("protocol", _choice("protocol", self.protocol, _PROTOCOLS))
        segment = parse_size(self.global_segment_size, "global_segment_size")
        if 0 < segment < MIN_GLOBAL_SEGMENT_SIZE:
            raise ValueError(
                f"global_segment_size: Mooncake needs 0 (pure client) or at least 16 MiB, got {segment} bytes"
            )
        put("global_segment_size", segment)
        put("local_buffer_size", parse_size(self.local_buffer_size, "local_buffer_size"))
        put("tenant_id", _normalize_tenant(self.tenant_id))
        if self.mode is not None:
            mode = _choice("mode", self.mode, MODES)
            if mode == "embedded" and segment == 0:
                raise ValueError("mode 'embedded' needs global_segment_size > 0 (use 'standalone-store' for 0)")
            if mode == "standalone-store" and segment != 0:
                raise ValueError(f"mode 'standalone-store' needs global_segment_size 0, got {segment}")
            put("mode", mode)
        put("enable_offload", check_bool("enable_offload", self.enable_offload))
        put("native_client", check_bool("native_client", self.native_client))
        put("transfer_mode", _choice("transfer_mode", self.transfer_mode, TRANSFER_MODES, dashes=True))
        staging = parse_size(self.staging_buffer_size, "staging_buffer_size")
        if staging == 0:
            raise ValueError("staging_buffer_size: must be > 0 (use transfer_mode='multi_buffer' to stage nothing)")
        put("staging_buffer_size", staging)
        if self.max_regions_per_batch is not None:
            check_int("max_regions_per_batch", self.max_regions_per_batch, low=1)
        if self.setup_retries is not None:
            check_int("setup_retries", self.setup_retries, low=1, high=_MAX_SETUP_RETRIES)
        put("connect_timeout_s", check_timeout("connect_timeout_s", self.connect_timeout_s))
        put("close_timeout_s", check_timeout("close_timeout_s", self.close_timeout_s))
        if self.request_timeout_s is not None:
            put("request_timeout_s", check_timeout("request_timeout_s", self.request_timeout_s))
        check_int("max_abandoned_calls", self.max_abandoned_calls, low=0, high=_MAX_ABANDONED_CALLS_LIMIT)
        put("master_start_timeout_s", check_timeout("master_start_timeout_s", self.master_start_timeout_s))
        args = self.master_args
        if isinstance(args, str) or not isinstance(args, (list, tuple)):
            raise TypeError(f"master_args: expected a list of strings, got {type(args).__name__}")
        put("master_args", check_master_args("master_args", tuple(check_str("master_args[]", a) for a in args)))

    # ------------------------------------------------------------------ derived values

    @property
    def tenant(self) -> str:
        """Alias of :attr:`tenant_id` (the name this package used before it followed vLLM's)."""
        return self.tenant_id

    @property
    def topology(self) -> str:
        """:attr:`mode` if given, else ``"embedded"`` with a segment and ``"standalone-store"`` without."""
        if self.mode is not None:
            return self.mode
        return "embedded" if self.global_segment_size > 0 else "standalone-store"

    @property
    def has_master(self) -> bool:
        """True when setup knows where the master is (an address, or ``embedded_master``)."""
        return self.embedded_master or self.master_server_address is not None

    @property
    def region_budget(self) -> int:
        """Regions per Mooncake call after defaulting ``max_regions_per_batch`` by protocol."""
        if self.max_regions_per_batch is not None:
            return self.max_regions_per_batch
        return _DEFAULT_REGION_BUDGET[self.protocol]

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, strict: bool = True, **overrides: Any) -> StoreConfig:
        """Build from a mapping: a parsed vLLM ``mooncake.json``, or a dict in vLLM's
        ``kv_connector_extra_config`` style (store keys mixed with vLLM connector keys); ``overrides`` win.

        ``tenant`` is accepted as an alias of ``tenant_id``. Keys of vLLM's connector
        (:data:`VLLM_CONNECTOR_KEYS`) are ignored and logged at debug level. Any other unknown key is a
        ``ValueError`` (a typo must not silently fall back to a default); with ``strict=False`` it is
        logged as a warning and ignored instead (for files written for a newer vLLM).
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"config: expected a JSON object / mapping, got {type(data).__name__}")
        merged: dict[str, Any] = {}
        for key, value in (*data.items(), *overrides.items()):
            if not isinstance(key, str):
                raise TypeError(f"config: keys must be strings, got {type(key).__name__} {show(key)}")
            merged[key] = value
        if "tenant" in merged:
            alias = merged.pop("tenant")
            if "tenant_id" in merged and _normalize_tenant(merged["tenant_id"]) != _normalize_tenant(alias):
                raise ValueError(
                    f"config: 'tenant' ({show(alias)}) and 'tenant_id' ({show(merged['tenant_id'])}) disagree; "
                    "they are one setting (tenant is an alias), give one"
                )
            merged.setdefault("tenant_id", alias)
        known = {f.name for f in dataclasses.fields(cls)}
        vllm_only = sorted(k for k in merged if k not in known and k in VLLM_CONNECTOR_KEYS)
        if vllm_only:
            logger.debug("config: ignoring vLLM connector key(s) %s", vllm_only)
        unknown = sorted(k for k in merged if k not in known and k not in VLLM_CONNECTOR_KEYS)
        if unknown:
            if strict:
                raise ValueError(
                    f"config: unknown key(s) {unknown}; known keys are {sorted(known)} (plus 'tenant', and "
                    "vLLM's connector keys, which are ignored); pass strict=False to ignore unknown keys"
                )
            logger.warning("config: ignoring unknown key(s) %s", unknown)
        return cls(**{k: v for k, v in merged.items() if k in known})

    @classmethod
    def from_json(cls, path: str | os.PathLike[str], *, strict: bool = True, **overrides: Any) -> StoreConfig:
        """Load a JSON file: vLLM's Mooncake config file as is, plus this class's extra fields."""
        file = Path(path)
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"config: cannot read {file}: {exc}") from exc
        try:
            data = json.loads(text)
        except RecursionError:
            raise ValueError(f"config: {file} nests JSON arrays/objects too deeply to be a config file") from None
        except ValueError as exc:  # JSONDecodeError, or an integer literal beyond Python's digit limit
            raise ValueError(f"config: {file} is not valid JSON: {exc}") from exc
        try:
            return cls.from_dict(data, strict=strict, **overrides)
        except (TypeError, ValueError) as exc:
            # Keep the exception type (callers may tell them apart) but say which file was wrong.
            raise type(exc)(f"{file}: {exc}") from exc

    @classmethod
    def from_env(cls, var: str = DEFAULT_CONFIG_ENV, *, strict: bool = True, **overrides: Any) -> StoreConfig:
        """Load the JSON file named by environment variable ``var``; raise ``ValueError`` if it is unset."""
        path = os.environ.get(var)
        if not path:
            raise ValueError(f"config: environment variable {var} is not set (it should name a JSON file)")
        return cls.from_json(path, strict=strict, **overrides)

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, **overrides: Any) -> StoreConfig:
        """The usual entry point: ``path`` if given, else ``$MOONCAKE_CONFIG_PATH`` if set, else defaults.

        ``overrides`` are applied on top of whichever source was used.
        """
        if path is not None:
            return cls.from_json(path, **overrides)
        if os.environ.get(DEFAULT_CONFIG_ENV):
            return cls.from_env(DEFAULT_CONFIG_ENV, **overrides)
        return cls.from_dict({}, **overrides)

    def replace(self, **changes: Any) -> StoreConfig:
        """A copy with ``changes`` applied (same names and aliases as :meth:`from_dict`), validated again."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if "tenant" in changes and "tenant_id" not in changes:
            fields.pop("tenant_id")
        return StoreConfig.from_dict(fields, **changes)


def _choice(field: str, value: object, choices: tuple[str, ...], *, dashes: bool = False) -> str:
    """``value`` stripped and lower-cased (``dashes``: with ``-`` read as ``_``) if it is one of ``choices``."""
    text = check_str(field, value).strip().lower()
    text = text.replace("-", "_") if dashes else text
    if text not in choices:
        raise ValueError(f"{field}: must be one of {choices}, got {show(value)}")
    return text


def _normalize_tenant(value: object) -> str:
    # vLLM's rule: null or blank means "default"; surrounding spaces are dropped.
    if value is None:
        return _DEFAULT_TENANT
    text = check_str("tenant_id", value).strip()
    return text or _DEFAULT_TENANT
