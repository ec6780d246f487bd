"""Batch key building and lookup namespaces (docs/address-rows.md, "Keys"), native where it pays.

``build_keys`` and ``build_lookup_keys`` accept a sequence of bytes-like hashes or one flat blob of
``n * hash_len`` bytes (the zero-copy lookup wire format, no per-hash Python objects). Every key path of the
package, ``ChunkedTokenDatabase.key_for`` included, goes through the same native writer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import Enum

from mooncake_kvaddr import _native
from mooncake_kvaddr.core.hashes import BlobBlockHashes, BlockHash
from mooncake_kvaddr.core.metadata import KeyMetadata, PoolKey

Hashes = Sequence[BlockHash] | bytes | bytearray | memoryview


def _unwrap(hashes: Hashes, hash_len: int | None) -> tuple[Hashes, int | None]:
    # A BlobBlockHashes view is handed over as its blob: one buffer instead of one object per hash.
    if isinstance(hashes, BlobBlockHashes) and hashes.hash_len:
        if hash_len not in (None, hashes.hash_len):
            raise ValueError(f"hash_len {hash_len} differs from the view's {hashes.hash_len}")
        return hashes.blob, hashes.hash_len
    return hashes, hash_len


def build_keys(prefix: str, hashes: Hashes, hash_len: int | None = None) -> list[str]:
    """``[prefix + "@" + h.hex() for h in hashes]``, natively.

    ``hashes`` is a sequence of bytes-like objects or one flat blob of ``n * hash_len`` bytes. Raises
    ``ValueError`` for a blob whose length is not a multiple of ``hash_len`` (or a hash of the wrong length
    when ``hash_len`` is given) and ``TypeError`` for non-bytes hashes.
    """
    data, length = _unwrap(hashes, hash_len)
    return _native.build_keys(prefix, data, length)


def build_lookup_keys(prefixes: Sequence[str], hashes: Hashes, hash_len: int | None = None) -> list[str]:
    """Every hash under every prefix: hash-major, then prefixes in the given order (docs/address-rows.md, "Keys").
    Any bytes-like hash is read, as by :func:`build_keys` (the vLLM plugin's lookup takes only vLLM's hash
    types, docs/keys.md)."""
    data, length = _unwrap(hashes, hash_len)
    return _native.build_lookup_keys(prefixes, data, length, any_buffer=True)


class SpecKind(str, Enum):
    """The KV-cache spec kinds that decide how a group is replicated across TP ranks."""

    ATTENTION = "attention"  # MHA / GQA
    MLA = "mla"  # MLAAttentionSpec / SlidingWindowMLASpec: identical bytes on every TP rank
    MAMBA = "mamba"  # TP-sharded state


def replication_factor(
    kinds: SpecKind | str | Iterable[SpecKind | str], tp_size: int, dcp_size: int, num_kv_heads: int
) -> int:
    """How many TP ranks hold identical bytes for a group (docs/address-rows.md, "Keys").

    ``kinds`` is the group's spec kind, or the inner kinds of a uniform-type group. DCP > 1 → 1; any Mamba →
    1; all MLA → ``tp_size``; otherwise ``max(1, tp_size // num_kv_heads)``.
    """
    if tp_size <= 0 or dcp_size <= 0:
        raise ValueError(f"tp_size and dcp_size must be positive, got {tp_size}, {dcp_size}")
    inner = [SpecKind(kinds)] if isinstance(kinds, (str, SpecKind)) else [SpecKind(k) for k in kinds]
    if not inner:
        raise ValueError("a KV-cache group needs at least one spec kind")
    if dcp_size > 1 or SpecKind.MAMBA in inner:
        return 1
    if all(k is SpecKind.MLA for k in inner):
        return tp_size
    if num_kv_heads <= 0:
        raise ValueError(f"num_kv_heads must be positive, got {num_kv_heads}")
    return max(1, tp_size // num_kv_heads)


def lookup_namespaces(
    tp_size: int, pcp_size: int, dcp_size: int, pp_size: int, factor: int
) -> list[tuple[int, int, int, int]]:
    """The ``(tp, pcp, dcp, pp)`` namespaces a lookup must probe for one group (docs/address-rows.md, "Keys")."""
    for name, value in (("tp_size", tp_size), ("pcp_size", pcp_size), ("dcp_size", dcp_size),
                        ("pp_size", pp_size), ("factor", factor)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if dcp_size > 1:
        return [(tp, pcp, tp % dcp_size, pp) for pcp in range(pcp_size) for tp in range(tp_size)
                for pp in range(pp_size)]
    return [(shard, pcp, 0, pp) for pcp in range(pcp_size) for shard in range(tp_size // factor)
            for pp in range(pp_size)]


def lookup_prefixes(metadata: KeyMetadata, namespaces: Sequence[tuple[int, int, int, int]]) -> list[str]:
    """Key prefixes of ``metadata``'s group under each namespace (built once per group)."""
    return [PoolKey.build_prefix(metadata, tp_rank=tp, pcp_rank=pcp, dcp_rank=dcp, pp_rank=pp)
            for tp, pcp, dcp, pp in namespaces]


def reduce_exists(results: Sequence[int], widths: int | Sequence[int]) -> list[bool]:
    """Which lookup units are present: unit ``u`` covers ``widths[u]`` consecutive ``batch_is_exist``
    results (an int: every unit) and is present only if each of them is exactly 1."""
    return _native.reduce_exists(results, widths)
