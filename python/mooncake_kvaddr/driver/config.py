"""Configuration of the Mooncake store client (:class:`StoreConfig`).

The field names follow vLLM's ``MooncakeStoreConfig`` so that an existing ``mooncake.json`` (the file named
by ``MOONCAKE_CONFIG_PATH``) loads unchanged; the extra fields are the knobs this package needs to drive the
store safely (batch splitting, bounded waits, the embedded master).

Sizes accept ints or strings such as ``"4GB"``, ``"512MiB"``, ``"1.5 GB"``. Like Mooncake's and vLLM's own
parsers, ``KB/MB/GB/TB`` are binary units (``"1GB" == 2**30``), identical to ``KiB/MiB/GiB/TiB``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

__all__ = ["DEFAULT_CONFIG_ENV", "MIN_GLOBAL_SEGMENT_SIZE", "TRANSFER_MODES", "StoreConfig", "parse_size"]

#: Environment variable naming the JSON config file (the one vLLM's connector reads).
DEFAULT_CONFIG_ENV: Final = "MOONCAKE_CONFIG_PATH"

_PROTOCOLS: Final = ("tcp", "rdma")

# Over TCP a single batch of more than ~1-2 k regions fails with -800 (per-peer queue of 1024 transfers,
# MOONCAKE.md section 2); RDMA has no such queue, so its budget only bounds one call's argument lists.
_DEFAULT_REGION_BUDGET: Final = {"tcp": 1000, "rdma": 1 << 20}

#: How KVTransfer moves a key with several regions: ``"multi_buffer"`` hands Mooncake every region (its
#: ``batch_*_multi_buffers`` calls), ``"staged"`` copies the regions natively through one contiguous staging
#: slot per key, ``"auto"`` stages host-memory layouts with more than one region per key.
TRANSFER_MODES: Final = ("auto", "staged", "multi_buffer")

# Mooncake refuses a smaller non-zero segment at setup ("Total size must be at least 16777216" -> -600).
MIN_GLOBAL_SEGMENT_SIZE: Final = 16 << 20

_UNITS: Final = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
    "tib": 1 << 40,
}
_SIZE_RE: Final = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_size(value: object, field: str = "size") -> int:
    """Return ``value`` as a number of bytes.

    Accepts a non-negative ``int``, an integral ``float`` (JSON numbers), or a string made of a number and
    an optional binary unit (``B``, ``K``/``KB``/``KiB``, ``M``…, ``G``…, ``T``…; case-insensitive, spaces
    allowed). A fractional byte count from a decimal string is truncated (``"1.5 GB"`` is exact anyway).

    Raises:
        TypeError: ``value`` is neither an int, a float nor a string (``bool`` is rejected too).
        ValueError: the string cannot be parsed, the unit is unknown, or the size is negative.
    """
    if isinstance(value, bool):
        raise TypeError(f"{field}: expected a size (int or string like '4GB'), got bool {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ValueError(f"{field}: a float size must be a whole number of bytes, got {value!r}")
        size = int(value)
    elif isinstance(value, str):
        match = _SIZE_RE.fullmatch(value)
        if match is None:
            raise ValueError(
                f"{field}: cannot parse size {value!r}; use an int or a number with a unit, e.g. '4GB', '512MiB'"
            )
        number, unit = match.groups()
        multiplier = _UNITS.get(unit.lower())
        if multiplier is None:
            raise ValueError(
                f"{field}: unknown size unit {unit!r} in {value!r}; use B, KB, MB, GB, TB (or KiB, MiB, ...)"
            )
        # Integers stay exact (no float rounding for "4398046511104"); decimals are truncated to bytes.
        size = int(number) * multiplier if number.isdigit() else int(float(number) * multiplier)
    else:
        raise TypeError(f"{field}: expected a size (int or string like '4GB'), got {type(value).__name__}")
    if size < 0:
        raise ValueError(f"{field}: size must be >= 0, got {value!r}")
    return size


def _check_str(field: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{field}: expected str, got {type(value).__name__} {value!r}")
    return value


def _check_positive_int(field: str, value: object, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field}: expected int, got {type(value).__name__} {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else ">= 1"
        raise ValueError(f"{field}: must be {bound}, got {value}")
    return value


def _check_timeout(field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{field}: expected a number of seconds, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{field}: must be a positive number of seconds, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class StoreConfig:
    """Everything needed to set up a Mooncake store client, validated at construction.

    The first eight fields are vLLM's ``MooncakeStoreConfig`` (a JSON file written for vLLM loads as is);
    the others tune this package. ``master_server_address=None`` means "start an embedded master on
    127.0.0.1" (see :class:`mooncake_kvaddr.driver.master.EmbeddedMaster`).
    """

    local_hostname: str = "127.0.0.1"
    """Address this client advertises to peers (``"host"`` or ``"host:port"`` to pin the port)."""
    metadata_server: str = "P2PHANDSHAKE"
    """Transfer-engine metadata: ``"P2PHANDSHAKE"`` (no server), ``"http://…/metadata"`` or etcd."""
    master_server_address: str | None = None
    """``"host:port"`` of a running master; ``None`` starts an embedded one on loopback."""
    protocol: str = "tcp"
    """``"tcp"`` or ``"rdma"``."""
    device_name: str = ""
    """RDMA device list (``""`` = auto-discover / TCP)."""
    global_segment_size: int = 512 << 20
    """Bytes this client contributes to the pool: 0 (pure client) or >= 16 MiB; allocated at setup."""
    local_buffer_size: int = 16 << 20
    """Staging buffer of Mooncake's copying API; the zero-copy batch calls work with 0."""
    tenant: str = "default"
    """Mooncake tenant namespace (``tenant_id``)."""

    max_regions_per_batch: int | None = None
    """Region budget per Mooncake call; larger batches are split (``None``: 1000 on tcp, 2**20 on rdma)."""
    setup_retries: int | None = None
    """``MC_STORE_CLIENT_SETUP_RETRIES`` for setup (~4.4 s each without a master; ``None``: 3 with the
    embedded master, else the environment's value or Mooncake's default of 20)."""
    close_timeout_s: float = 120.0
    """How long ``close()`` waits for calls in flight (a TCP transfer may take 60 s to time out)."""
    master_start_timeout_s: float = 15.0
    """How long to wait for the embedded master's ``/health`` to answer 200."""
    master_args: tuple[str, ...] = ()
    """Extra command-line flags for the embedded master, e.g. ``("-default_kv_lease_ttl=2000",)``."""
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

        for name in ("local_hostname", "metadata_server", "device_name", "tenant"):
            _check_str(name, getattr(self, name))
        if not self.local_hostname:
            raise ValueError("local_hostname: must not be empty (use '127.0.0.1' for loopback)")
        if not self.metadata_server:
            raise ValueError("metadata_server: must not be empty (use 'P2PHANDSHAKE')")
        if self.master_server_address is not None:
            address = _check_str("master_server_address", self.master_server_address).strip()
            if not address:
                raise ValueError("master_server_address: must be 'host:port', or None to start an embedded master")
            put("master_server_address", address)
        protocol = _check_str("protocol", self.protocol).strip().lower()
        if protocol not in _PROTOCOLS:
            raise ValueError(f"protocol: must be one of {_PROTOCOLS}, got {self.protocol!r}")
        put("protocol", protocol)
        segment = parse_size(self.global_segment_size, "global_segment_size")
        if 0 < segment < MIN_GLOBAL_SEGMENT_SIZE:
            raise ValueError(
                f"global_segment_size: Mooncake needs 0 (pure client) or at least 16 MiB, got {segment} bytes"
            )
        put("global_segment_size", segment)
        put("local_buffer_size", parse_size(self.local_buffer_size, "local_buffer_size"))
        mode = _check_str("transfer_mode", self.transfer_mode).strip().lower().replace("-", "_")
        if mode not in TRANSFER_MODES:
            raise ValueError(f"transfer_mode: must be one of {TRANSFER_MODES}, got {self.transfer_mode!r}")
        put("transfer_mode", mode)
        staging = parse_size(self.staging_buffer_size, "staging_buffer_size")
        if staging == 0:
            raise ValueError("staging_buffer_size: must be > 0 (use transfer_mode='multi_buffer' to stage nothing)")
        put("staging_buffer_size", staging)
        if self.max_regions_per_batch is not None:
            _check_positive_int("max_regions_per_batch", self.max_regions_per_batch)
        if self.setup_retries is not None:
            _check_positive_int("setup_retries", self.setup_retries)
        put("close_timeout_s", _check_timeout("close_timeout_s", self.close_timeout_s))
        put("master_start_timeout_s", _check_timeout("master_start_timeout_s", self.master_start_timeout_s))
        args = self.master_args
        if isinstance(args, str) or not isinstance(args, (list, tuple)):
            raise TypeError(f"master_args: expected a list of strings, got {type(args).__name__}")
        put("master_args", tuple(_check_str("master_args[]", a) for a in args))

    # ------------------------------------------------------------------ derived values

    @property
    def embedded_master(self) -> bool:
        """True when setup starts its own master (``master_server_address is None``)."""
        return self.master_server_address is None

    @property
    def region_budget(self) -> int:
        """Regions per Mooncake call after defaulting ``max_regions_per_batch`` by protocol."""
        if self.max_regions_per_batch is not None:
            return self.max_regions_per_batch
        return _DEFAULT_REGION_BUDGET[self.protocol]

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], **overrides: Any) -> StoreConfig:
        """Build from a mapping (a parsed JSON object); ``overrides`` win. Unknown keys are rejected."""
        if not isinstance(data, Mapping):
            raise TypeError(f"config: expected a JSON object / mapping, got {type(data).__name__}")
        merged = {**data, **overrides}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in merged if k not in known)
        if unknown:
            raise ValueError(f"config: unknown key(s) {unknown}; known keys are {sorted(known)}")
        return cls(**merged)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str], **overrides: Any) -> StoreConfig:
        """Load a JSON file (vLLM's ``mooncake.json`` format plus this class's extra fields)."""
        file = Path(path)
        try:
            text = file.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"config: cannot read {file}: {exc}") from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"config: {file} is not valid JSON: {exc}") from exc
        try:
            return cls.from_dict(data, **overrides)
        except (TypeError, ValueError) as exc:
            # Keep the exception type (callers may tell them apart) but say which file was wrong.
            raise type(exc)(f"{file}: {exc}") from exc

    @classmethod
    def from_env(cls, var: str = DEFAULT_CONFIG_ENV, **overrides: Any) -> StoreConfig:
        """Load the JSON file named by environment variable ``var``; raise ``ValueError`` if it is unset."""
        path = os.environ.get(var)
        if not path:
            raise ValueError(f"config: environment variable {var} is not set (it should name a JSON file)")
        return cls.from_json(path, **overrides)

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
