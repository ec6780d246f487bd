"""Parsing and checking of configuration values: sizes with units, addresses, ports, typed scalars.

Used by :mod:`mooncake_kvaddr.driver.config`; every error names the field it is about and shows the
offending value through a bounded ``repr`` (a huge or deeply nested value can neither flood the message nor
overflow the stack). The rules are described in ``docs/configuration.md``.
"""

from __future__ import annotations

import contextlib
import math
import operator
import re
import reprlib
from typing import Final

__all__ = [
    "check_bool",
    "check_int",
    "check_str",
    "check_timeout",
    "parse_address",
    "parse_host_port",
    "parse_size",
    "show",
]

# Mooncake takes sizes as C++ size_t.
_SIZE_LIMIT: Final = 1 << 64

# Each binary unit as "k", "kb" or "kib" (parse_size lower-cases the unit).
_UNITS: Final = {"": 1, "b": 1} | {
    prefix + suffix: 1 << (10 * power) for power, prefix in enumerate("kmgt", 1) for suffix in ("", "b", "ib")
}
# re.ASCII: "\d" is [0-9] only, so full-width or Arabic-Indic digits are rejected, not read as numbers.
_SIZE_RE: Final = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", re.ASCII)
_PORT_RE: Final = re.compile(r"[0-9]{1,5}", re.ASCII)
# A DNS name or an IPv4 address: letters, digits, '-', '.', '_' (no spaces, no scheme, no path).
_HOST_RE: Final = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?", re.ASCII)
_IPV6_RE: Final = re.compile(r"\[[0-9A-Fa-f:.]+(?:%[A-Za-z0-9_.-]+)?\]", re.ASCII)

# Error messages show values through this: bounded length and depth, so a huge or deeply nested value can
# neither flood the message nor overflow the stack while it is formatted.
_REPR: Final = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxstring = 80
_REPR.maxother = 80


def show(value: object) -> str:
    try:
        return _REPR.repr(value)
    except Exception:  # a broken __repr__ must not hide the real error
        return f"<{type(value).__name__}>"


def parse_size(value: object, field: str = "size") -> int:
    """Return ``value`` as a number of bytes.

    Accepts a non-negative ``int``, an integral ``float`` (JSON numbers), or a string made of an ASCII
    number and an optional binary unit (``B``, ``K``/``KB``/``KiB``, ``M``…, ``G``…, ``T``…;
    case-insensitive, spaces allowed). A fractional byte count from a decimal string is truncated
    (``"1.5 GB"`` is exact anyway), as vLLM's parser does. Sizes must be below 2**64 (Mooncake's ``size_t``).

    Raises:
        TypeError: ``value`` is neither an int, a float nor a string (``bool`` is rejected too).
        ValueError: the string cannot be parsed, the unit is unknown, or the size is negative or >= 2**64.
    """
    if isinstance(value, bool):
        raise TypeError(f"{field}: expected a size (int or string like '4GB'), got bool {value!r}")
    if isinstance(value, int):
        size = int(value)
    elif isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ValueError(f"{field}: a float size must be a whole number of bytes, got {value!r}")
        size = int(value)
    elif isinstance(value, str):
        match = _SIZE_RE.fullmatch(value)
        if match is None:
            raise ValueError(
                f"{field}: cannot parse size {show(value)}; use an int or a number with a unit, "
                "e.g. '4GB', '512MiB'"
            )
        number, unit = match.groups()
        multiplier = _UNITS.get(unit.lower())
        if multiplier is None:
            raise ValueError(
                f"{field}: unknown size unit {unit!r} in {show(value)}; use B, KB, MB, GB, TB (or KiB, MiB, ...)"
            )
        if number.isdigit():
            size = int(number) * multiplier  # exact: no float rounding for "4398046511104"
        else:
            scaled = float(number) * multiplier
            if not math.isfinite(scaled):
                raise ValueError(f"{field}: size {show(value)} is too large")
            size = int(scaled)
    else:
        raise TypeError(f"{field}: expected a size (int or string like '4GB'), got {type(value).__name__}")
    if size < 0:
        raise ValueError(f"{field}: size must be >= 0, got {show(value)}")
    if size >= _SIZE_LIMIT:
        raise ValueError(f"{field}: size must be below 2**64 bytes (Mooncake's size_t), got {show(value)}")
    return size


def parse_host_port(text: str, field: str, *, port_required: bool) -> tuple[str, int | None]:
    if _IPV6_RE.match(text) and text.startswith("["):
        close = text.index("]")
        host, rest = text[: close + 1], text[close + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError(f"{field}: expected '[ipv6]:port', got {text!r}")
        port_text = rest[1:] if rest else None
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif ":" in text:
        raise ValueError(f"{field}: an IPv6 address must be written in brackets, '[::1]:50051'; got {text!r}")
    else:
        host, port_text = text, None
    if not (_IPV6_RE.fullmatch(host) or _HOST_RE.fullmatch(host)):
        raise ValueError(f"{field}: {host!r} is not a host name or IP address (in {text!r})")
    if port_text is None:
        if port_required:
            raise ValueError(f"{field}: expected 'host:port', got {text!r} (no port)")
        return host, None
    if not _PORT_RE.fullmatch(port_text):
        raise ValueError(f"{field}: port must be a decimal number 1..65535, got {port_text!r}")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError(f"{field}: port must be 1..65535, got {port}")
    return host, port


def parse_address(value: str, field: str = "master_server_address") -> list[tuple[str, int]]:
    """Parse a master address into its ``(host, port)`` endpoints, without connecting to anything.

    Accepted: ``"host:port"`` (IPv4, DNS name, or ``[ipv6]``), and Mooncake's high-availability form
    ``"etcd://host:port;host:port"`` (the etcd endpoints that elect the master). Ports are 1..65535.

    Raises:
        ValueError: anything else (missing or bad port, a scheme other than ``etcd://``, a path, spaces).
    """
    text = value.strip()
    if not text:
        raise ValueError(f"{field}: must be 'host:port' (or 'etcd://host:port;...'), got an empty string")
    if "://" in text:
        scheme, _, rest = text.partition("://")
        if scheme.lower() != "etcd":
            raise ValueError(f"{field}: unsupported scheme {scheme!r} in {text!r}; use 'host:port' or 'etcd://…'")
        parts = [p.strip() for p in rest.split(";")]
        if not any(parts):
            raise ValueError(f"{field}: no etcd endpoint in {text!r}")
        return [_endpoint(p, field) for p in parts if p]
    return [_endpoint(text, field)]


def _endpoint(text: str, field: str) -> tuple[str, int]:
    host, port = parse_host_port(text, field, port_required=True)
    assert port is not None  # port_required
    return host, port


def check_str(field: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{field}: expected str, got {type(value).__name__} {show(value)}")
    return value


def check_int(field: str, value: object, *, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field}: expected int, got {type(value).__name__} {show(value)}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"{field}: must be {bound}, got {value}")
    return int(value)


def as_index(field: str, value: object) -> int:
    """``value`` as a Python int when it is an int or a numpy integer (anything with ``__index__``) other than a
    bool; else :func:`check_int`'s ``TypeError`` naming ``field``."""
    if not isinstance(value, bool):
        with contextlib.suppress(TypeError):
            return operator.index(value)  # type: ignore[arg-type]
    raise TypeError(f"{field}: expected int, got {type(value).__name__} {show(value)}")


def check_timeout(field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{field}: expected a number of seconds, got {type(value).__name__} {show(value)}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{field}: must be a positive number of seconds, got {value!r}")
    return float(value)


def check_bool(field: str, value: object) -> bool:
    # JSON true/false, or 0/1. A string is refused: vLLM reads "false" as true (any non-empty string), so
    # accepting one would make the same file mean different things to the two readers.
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{field}: expected true or false, got {type(value).__name__} {show(value)}")
