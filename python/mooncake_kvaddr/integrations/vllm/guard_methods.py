"""The Mooncake methods that take raw pointers (Mooncake 0.3.13's ``MooncakeDistributedStore``, and 0.3.14's
snapshot read), as the registered-range guard of :mod:`mooncake_kvaddr.integrations.vllm.guard` checks them:
their parameter names and the value a refused key gets. Apart from the guard's policy so that the table of
Mooncake's API reads on its own; ``guard`` re-exports every name.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from mooncake_kvaddr.driver.outcomes import CODE_INVALID_PARAMS

__all__ = [
    "CONFIG",
    "FLAT_METHODS",
    "INVALID_PARAMS",
    "MULTI_METHODS",
    "RANGES_METHOD",
    "RANGES_METHODS",
    "REGISTRATION_METHODS",
    "SINGLE_METHODS",
    "guarded_names",
    "takes_pointers",
]

#: Mooncake's INVALID_PARAMS result code (docs/configuration.md): the code a refused key gets.
INVALID_PARAMS = CODE_INVALID_PARAMS


# --- the methods that take raw pointers (Mooncake 0.3.13's MooncakeDistributedStore) -------------------------
# name -> (parameter names of keys, pointers, sizes; per-key extra parameters (sub-set with the keys); the value
# a refused key gets).

#: ``(keys, rows of addresses, rows of sizes, ...)``.
MULTI_METHODS: dict[str, tuple[tuple[str, str, str], tuple[str, ...], Any]] = {
    "batch_get_into_multi_buffers": (("keys", "all_buffer_ptrs", "all_sizes"), (), INVALID_PARAMS),
    "batch_put_from_multi_buffers": (("keys", "all_buffer_ptrs", "all_sizes"), (), INVALID_PARAMS),
    "batch_get_into_multi_buffer_ranges": (
        ("keys", "all_buffer_ptrs", "all_sizes"), ("all_src_offsets",), INVALID_PARAMS,
    ),
    "batch_put_from_multi_buffer_ranges": (
        ("keys", "all_buffer_ptrs", "all_sizes"), ("all_dst_offsets",), INVALID_PARAMS,
    ),
}  # fmt: skip

_FLAT = ("keys", "buffer_ptrs", "sizes")
_FLAT_TP = ("base_keys", "buffer_ptrs", "sizes")
_PARALLEL_PUT = ("parallelisms", "writer_partitions")
#: ``(keys, one address per key, one size per key, ...)``.
FLAT_METHODS: dict[str, tuple[tuple[str, str, str], tuple[str, ...], Any]] = {
    "batch_get_into": (_FLAT, (), INVALID_PARAMS),
    "batch_put_from": (_FLAT, (), INVALID_PARAMS),
    "batch_upsert_from": (_FLAT, (), INVALID_PARAMS),
    "batch_get_tensor_into": (_FLAT, (), None),
    "batch_get_tensor_with_parallelism_into": (_FLAT, ("targets",), None),
    "batch_get_tensor_with_tp_into": (_FLAT_TP, (), None),
    "batch_put_tensor_from": (_FLAT, (), INVALID_PARAMS),
    "batch_upsert_tensor_from": (_FLAT, (), INVALID_PARAMS),
    "batch_put_tensor_with_parallelism_from": (_FLAT, _PARALLEL_PUT, INVALID_PARAMS),
    "batch_upsert_tensor_with_parallelism_from": (_FLAT, _PARALLEL_PUT, INVALID_PARAMS),
    "batch_put_tensor_with_tp_from": (_FLAT_TP, (), INVALID_PARAMS),
}

_SINGLE = ("key", "buffer_ptr", "size")
#: ``(key, address, size, ...)``: one slice; ``put_from_with_metadata`` has two (see :meth:`StoreGuard.call`).
SINGLE_METHODS: dict[str, tuple[tuple[str, ...], Any]] = {
    "get_into": (_SINGLE, INVALID_PARAMS),
    "put_from": (_SINGLE, INVALID_PARAMS),
    "upsert_from": (_SINGLE, INVALID_PARAMS),
    "get_tensor_into": (_SINGLE, None),
    "get_tensor_with_parallelism_into": (_SINGLE, None),
    "get_tensor_with_tp_into": (_SINGLE, None),
    "put_tensor_from": (_SINGLE, INVALID_PARAMS),
    "put_tensor_with_parallelism_from": (_SINGLE, INVALID_PARAMS),
    "put_tensor_with_tp_from": (_SINGLE, INVALID_PARAMS),
    "upsert_tensor_from": (_SINGLE, INVALID_PARAMS),
    "upsert_tensor_with_parallelism_from": (_SINGLE, INVALID_PARAMS),
    "put_from_with_metadata": (("key", "buffer_ptr", "metadata_buffer_ptr", "size", "metadata_size"), INVALID_PARAMS),
}
#: Raw-pointer methods with their own shape: ``get_into_ranges(buffer_ptrs, all_keys, all_dst_offsets,
#: all_src_offsets, all_sizes)``, and Mooncake 0.3.14's ``get_into_ranges_from_snapshot(snapshot, ...the
#: same...)``: name -> the parameters before ``buffer_ptrs``.
RANGES_METHODS: dict[str, tuple[str, ...]] = {
    "get_into_ranges": (),
    "get_into_ranges_from_snapshot": ("snapshot",),
}
RANGES_METHOD = "get_into_ranges"
_RANGES_NAMES = ("buffer_ptrs", "all_keys", "all_dst_offsets", "all_src_offsets", "all_sizes")
#: Methods whose pointer arguments are the registration itself (handled by the wrappers).
REGISTRATION_METHODS = frozenset({"register_buffer", "unregister_buffer"})


def guarded_names() -> frozenset[str]:
    """Every method name the guard checks (or handles) itself."""
    return frozenset(MULTI_METHODS) | frozenset(FLAT_METHODS) | frozenset(SINGLE_METHODS) | frozenset(RANGES_METHODS)


_POINTER_PARAM = re.compile(r"\w*(ptr|ptrs|pointer|pointers)\s*:")


def takes_pointers(value: Any) -> bool:
    """True when a method's (pybind11) signature names a pointer parameter (``..._ptr``, ``..._ptrs``)."""
    doc = getattr(value, "__doc__", None) or ""
    first = doc.strip().split("\n", 1)[0].lower()
    return _POINTER_PARAM.search(first) is not None


#: The parameter that holds a put's ``ReplicateConfig`` (its per-key fields are cut with the keys a split keeps).
CONFIG = "config"
#: The batch methods that take a ``config`` right after their rows (Mooncake 0.3.13).
_CONFIG_AFTER_ROWS = frozenset({"batch_put_from_multi_buffers", "batch_put_from", "batch_upsert_from"})


def _positional(name: str, names: Sequence[str], extras: Sequence[str]) -> list[str]:
    """Parameter names in positional order (after self), as far as the per-key extras and the config reach."""
    if name in ("batch_get_into_multi_buffer_ranges", "batch_put_from_multi_buffer_ranges"):
        return [*names, *extras]
    if name == "batch_get_tensor_with_parallelism_into":
        return [*names, "targets"]
    if name in ("batch_put_tensor_with_parallelism_from", "batch_upsert_tensor_with_parallelism_from"):
        return [*names, "parallelisms", CONFIG, "writer_partitions"]
    if name in _CONFIG_AFTER_ROWS:
        return [*names, CONFIG]
    return list(names)
