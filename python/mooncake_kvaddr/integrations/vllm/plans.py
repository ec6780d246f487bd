"""What both of the plugin's vLLM handlers plan with (docs/vllm-plugin.md, "The receive handler", "The send
handler"): the array-store contract our store wrappers offer, and which
token databases, layouts and hash forms are ours to plan.
"""

from __future__ import annotations

import abc
import inspect
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, cast

import numpy as np

from mooncake_kvaddr.core.plan import KeyPlan
from mooncake_kvaddr.driver import per_key
from mooncake_kvaddr.driver.rules import rotate

__all__ = [
    "ARRAY_ENTRY",
    "ArrayStore",
    "HandlerStats",
    "Kinds",
    "concat_rows",
    "finish_handler",
    "hash_source",
    "join_groups",
    "multi_buffers_call",
    "ragged_calls",
    "record_batch",
]

#: The array entry point our store wrappers offer (keys, (n, w) int64 addrs, (n, w) int64 sizes).
ARRAY_ENTRY = "batch_get_into_multi_buffers_arrays"


class ArrayStore(abc.ABC):
    """The store types whose :data:`ARRAY_ENTRY` the receive handler calls: our own wrappers (subclasses, through
    ``native_store.StoreWrapper``) and whatever a caller registers explicitly (``ArrayStore.register(cls)``: a
    test's recording store, a benchmark's timing proxy). The choice is by type, never by probing the store for
    the attribute (a mock store "has" every attribute); any other store gets vLLM's list rows
    (docs/vllm-plugin.md)."""

    @abc.abstractmethod
    def batch_get_into_multi_buffers_arrays(self, keys: list[str], addrs: Any, sizes: Any) -> Any:
        """``batch_get_into_multi_buffers`` with (keys x regions) int64 matrices; Mooncake's per-key codes."""

    def batch_get_into_multi_buffers_ragged(self, keys: list[str], addrs: Any, sizes: Any, widths: Any) -> Any:
        """The array entry for rows of different widths: (keys x max width) matrices, row ``i`` holding
        ``widths[i]`` regions; this default makes one array call per width and merges the answers."""
        return ragged_calls(self.batch_get_into_multi_buffers_arrays, keys, addrs, sizes, widths)

    def batch_put_from_multi_buffers_arrays(self, keys: list[str], addrs: Any, sizes: Any, config: Any) -> Any:
        """``batch_put_from_multi_buffers(keys, addrs, sizes, config)`` with int64 matrices (the send handler's
        entry); this default hands the rows on as lists to the subclass's ``batch_put_from_multi_buffers``."""
        rows = np.asarray(addrs).tolist(), np.asarray(sizes).tolist()
        return self.batch_put_from_multi_buffers(keys, *rows, config)  # type: ignore[attr-defined]

    def batch_put_from_multi_buffers_ragged(
        self, keys: list[str], addrs: Any, sizes: Any, widths: Any, config: Any
    ) -> Any:
        """The array put for rows of different widths (as :meth:`batch_get_into_multi_buffers_ragged`; each put
        gets ``config`` cut to its keys)."""
        return ragged_calls(self.batch_put_from_multi_buffers_arrays, keys, addrs, sizes, widths, config)


def multi_buffers_call(store: Any, rows: KeyPlan, verb: str, *config: Any) -> Any:
    """``store.batch_<verb>_multi_buffers`` (``verb``: ``get_into``, or ``put_from`` with its one ``config``) on a
    plan's rows: an :class:`ArrayStore` gets them as matrices (one width: its array entry; else its ragged entry),
    any other store as vLLM's lists."""
    name = f"batch_{verb}_multi_buffers"
    if rows.arrays and isinstance(store, ArrayStore):
        widths = rows.widths
        if widths is None:
            return getattr(store, f"{name}_arrays")(rows.keys, rows.addrs, rows.sizes, *config)
        if widths.size and bool((widths == widths[0]).all()):  # rows of one width: one matrix
            width = int(widths[0])
            return getattr(store, f"{name}_arrays")(rows.keys, rows.addrs[:, :width], rows.sizes[:, :width], *config)
        return getattr(store, f"{name}_ragged")(rows.keys, rows.addrs, rows.sizes, widths, *config)
    if rows.arrays:
        return getattr(store, name)(rows.keys, *rows.row_lists(), *config)
    return getattr(store, name)(rows.keys, rows.addrs, rows.sizes, *config)


def record_batch(thread: Any, operation: str, start: float, num_keys: int, num_bytes: int, failed: int | None) -> None:
    """vLLM's record of one batch get or put of ``num_keys`` keys: ``failed`` of them failed (a partial failure
    unless none), or the call raised (None: every key failed, status ``error``)."""
    thread._record_operation(
        operation,
        start,
        num_keys,
        num_bytes=num_bytes,
        status="error" if failed is None else "partial_failure" if failed else "ok",
        num_failed_keys=num_keys if failed is None else failed,
    )


def ragged_calls(
    call: Callable[..., Any], keys: list[str], addrs: Any, sizes: Any, widths: Any, *config: Any
) -> list[Any]:
    """One ``call(keys, addrs, sizes[, config])`` per row width, for (keys x max width) matrices whose row ``i``
    holds ``widths[i]`` regions (the rest padding): each call gets the keys of one width, in their order,
    matrices trimmed to that width and a put's ``config`` with its per-key fields cut to those keys
    (:func:`~mooncake_kvaddr.driver.per_key.config_for`); the per-key answers come back in the keys' order
    (docs/vllm-plugin.md, "The receive handler": hybrid models whose groups have different row widths)."""
    widths = np.asarray(widths)
    results: list[Any] = [None] * len(keys)
    for width in dict.fromkeys(widths.tolist()):
        picks = np.flatnonzero(widths == width)
        part = per_key.configs_for(config, picks.tolist(), len(keys))
        answers = call([keys[i] for i in picks], addrs[picks, :width], sizes[picks, :width], *part)
        per_key.put_back(results, picks.tolist(), answers, "the store")
    return results


class Kinds:
    """Which token databases and layouts are ours to plan, cached per type (vLLM's classes rarely change)."""

    def __init__(
        self,
        data: ModuleType,
        ours: Mapping[str, Any],
        *,
        layouts: ModuleType | None = None,
        db_chunk: str = "block_size",
        sharded_chunk: str = "block_size",
    ) -> None:
        """``data``: vLLM's module with ``ChunkedTokenDatabase``; ``layouts``: the one with the layout classes
        (``data`` on 0.32/0.33). A database's chunk size is its ``db_chunk`` attribute; it must equal a
        rank-local layout's ``block_size`` and a TP-shared layout's ``sharded_chunk`` (the release's names)."""
        self._data = data
        self._layouts = layouts if layouts is not None else data
        self._ours = ours
        self._db_chunk = db_chunk
        self._sharded_chunk = sharded_chunk
        self._db_types: dict[type, bool] = {}
        self._layout_types: dict[type, str] = {}
        self._lock = threading.Lock()

    def _cached(self, table: dict[type, Any], cls: type, compute: Callable[[type], Any]) -> Any:
        """``table``'s answer for ``cls``, computed by ``compute(cls)`` on the first ask."""
        known = table.get(cls)
        if known is None:
            known = compute(cls)
            with self._lock:
                table[cls] = known
        return known

    def db_ok(self, db: Any) -> bool:
        def ours(cls: type) -> bool:
            base = self._data.ChunkedTokenDatabase
            static = inspect.getattr_static
            return isinstance(db, base) and static(cls, "process_tokens") is static(base, "process_tokens")

        return cast(bool, self._cached(self._db_types, type(db), ours))

    def engine_of(
        self, db: Any, engines: Mapping[str, Callable[[Any], tuple[Any, list[str]]]]
    ) -> tuple[Any, list[str]] | str:
        """The engine and key prefixes that plan ``db``'s group, or why vLLM's handler must run it: a database or
        layout not backed by our engine, or a database whose block sizes are not its layout's (vLLM walks with
        the database's, our engine with the layout's)."""
        if not self.db_ok(db):
            return "a token database that is not vLLM's"
        layout = db.store_layout
        kind = self.layout_kind(layout)
        if not kind:
            return "a layout not backed by our engine"
        sizes = (getattr(db, self._db_chunk), db.hash_block_size)
        chunk = layout.block_size if kind == "rank_local" else getattr(layout, self._sharded_chunk)
        if sizes != (chunk, layout.hash_block_size) or type(sizes[0]) is not int:
            return "a token database whose block sizes are not its layout's"
        return engines[kind](layout)

    def layout_kind(self, layout: Any) -> str:
        """``"rank_local"``, ``"sharded"`` or ``""`` (not ours: vLLM's handler)."""
        kind: str = self._cached(self._layout_types, type(layout), self._classify)
        if kind and ("prepare_values" in layout.__dict__ or "key_for" in layout.__dict__):
            return ""  # an instance override: vLLM would call it
        return kind

    def _classify(self, cls: type) -> str:
        data = self._layouts
        static = inspect.getattr_static
        for kind, base, prepare, key_for in (
            ("rank_local", data.RankLocalStoreLayout, "rank_local_prepare_values", "rank_local_key_for"),
            ("sharded", data.TPShardedStoreLayout, "sharded_prepare_values", "sharded_key_for"),
        ):
            if (
                issubclass(cls, base)
                and static(cls, "prepare_values") is self._ours[prepare]
                and static(cls, "key_for") is self._ours[key_for]
                and static(cls, "local_shard_ids") is static(base, "local_shard_ids")
            ):
                return kind
        return ""


def hash_source(hashes: Any, blob_type: type) -> tuple[Any, int | None] | None:
    """What the engine reads the hashes from: the list itself, or a ``BlobBlockHashes``'s flat byte blob."""
    if type(hashes) is list or type(hashes) is tuple:
        return hashes, None
    if type(hashes) is blob_type:
        blob = getattr(hashes, "_blob", None)
        hash_len = getattr(hashes, "_hash_len", None)
        if (
            isinstance(blob, memoryview)
            and blob.ndim == 1
            and blob.itemsize == 1
            and type(hash_len) is int
            and hash_len > 0
            and len(blob) % hash_len == 0
        ):
            return blob, hash_len
    return None


def concat_rows(addr_parts: list[Any], size_parts: list[Any]) -> tuple[Any, Any, Any]:
    """Groups' (keys x regions) int64 matrices stacked; when their widths differ, padded with zero cells to the
    widest and returned with each row's width (else widths None)."""
    widest = max(m.shape[1] for m in addr_parts)
    if all(m.shape[1] == widest for m in addr_parts):
        return np.concatenate(addr_parts), np.concatenate(size_parts), None
    rows = sum(m.shape[0] for m in addr_parts)
    addrs = np.zeros((rows, widest), dtype=np.int64)
    sizes = np.zeros((rows, widest), dtype=np.int64)
    widths = np.empty(rows, dtype=np.int64)
    at = 0
    for a, s in zip(addr_parts, size_parts, strict=True):
        n, w = a.shape
        addrs[at : at + n, :w] = a
        sizes[at : at + n, :w] = s
        widths[at : at + n] = w
        at += n
    return addrs, sizes, widths


def join_groups(parts: list[tuple[Any, ...]], arrays: bool, tp_rank: int = 0) -> KeyPlan:
    """The groups' ``plan_load`` results ``(keys, addrs, sizes, ids)`` as one plan in group order (matrices of
    different widths padded: :func:`concat_rows`), every list started at key ``tp_rank % n`` (``rules.rotate``,
    the driver's rotation; 0 keeps the order)."""
    widths = None
    if len(parts) == 1:
        keys, addrs, sizes, ids = parts[0]
    elif arrays:
        kept = [p for p in parts if len(p[0])]
        keys = [key for p in kept for key in p[0]]
        ids = np.concatenate([p[3] for p in kept])
        addrs, sizes, widths = concat_rows([p[1] for p in kept], [p[2] for p in kept])
    else:
        keys, addrs, sizes, ids = ([item for p in parts for item in p[i]] for i in range(4))
    keys, addrs, sizes, ids = (rotate(m, tp_rank) for m in (keys, addrs, sizes, ids))
    return KeyPlan(keys, addrs, sizes, ids, widths=None if widths is None else rotate(widths, tp_rank))


@dataclass
class HandlerStats:
    """Requests a replacement handler planned itself, and those it handed to vLLM's own handler (with the last
    reason). Counters only: exact enough to see which path runs."""

    fast_requests: int = 0
    fallback_requests: int = 0
    last_fallback: str = ""


def finish_handler(
    handler: Callable[..., Any], original: Callable[..., Any], qualname: str, stats: object
) -> Callable[..., Any]:
    """``handler`` dressed as the vLLM method it replaces: ``__wrapped__`` (vLLM's), its qualified name, and
    its counters (:class:`HandlerStats`, the lookup's ``LookupStats``) as ``.stats``."""
    dressed: Any = handler
    dressed.__wrapped__ = original
    dressed.__qualname__ = qualname
    dressed.stats = stats
    return handler
