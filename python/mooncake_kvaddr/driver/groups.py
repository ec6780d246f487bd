"""vLLM 0.33-style layout databases as :class:`~mooncake_kvaddr.driver.transfer.KVTransfer` drives them
(docs/vllm.md, "Driver"): the transfer wraps each ``integrations.vllm.data.ChunkedTokenDatabase`` it is given in a
:class:`LayoutGroup`, which plans through the group's layout (one entry per chunk and local shard id) and keeps
its rows inside the caches the transfer registered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import numpy as np

from mooncake_kvaddr.core.database import LoadWalk, StorePlan
from mooncake_kvaddr.core.hashes import BlockHash
from mooncake_kvaddr.core.layouts import (
    LayoutTokenDatabase,
    LBHNCStoreLayout,
    LBNHCStoreLayout,
    RankLocalStoreLayout,
    TPShardedStoreLayout,
)
from mooncake_kvaddr.core.metadata import KeyMetadata, PoolKey
from mooncake_kvaddr.core.plan import KeyPlan
from mooncake_kvaddr.driver.bounds import RegisteredCaches
from mooncake_kvaddr.driver.path_base import _no_instance_overrides, register_bounded_rows
from mooncake_kvaddr.driver.staging import Int64Array

__all__ = ["LayoutGroup", "group_databases", "host_regions", "install_segments"]

_Rows = TypeVar("_Rows", bound=tuple[Any, ...])


class LayoutGroup:
    """One KV-cache group's layout database, seen through the interface the transfer paths speak.

    Args:
        database: a vLLM 0.33-style ``ChunkedTokenDatabase`` (``integrations.vllm.data``); its
            ``store_layout`` (rank-local or TP-shared) decides the keys and the rows.

    Rank-local layouts take their regions from :meth:`KVTransfer.register_kv_caches` (forwarded to the layout);
    TP-shared layouts derive segment templates from the same tensors (``register_kv_caches`` hands them over)
    and only remember the transfer's regions for its consistency check.
    """

    def __init__(self, database: LayoutTokenDatabase) -> None:
        if not isinstance(database, LayoutTokenDatabase):
            raise TypeError(
                "database: expected a layout ChunkedTokenDatabase (integrations.vllm.data), "
                f"got {type(database).__name__}"
            )
        layout = database.store_layout
        if not isinstance(layout, (RankLocalStoreLayout, TPShardedStoreLayout)):
            raise TypeError(
                "database: expected a layout ChunkedTokenDatabase (integrations.vllm.data) whose store_layout is "
                f"a RankLocalStoreLayout or TPShardedStoreLayout, got {type(layout).__name__}"
            )
        self.database = database
        self.layout: RankLocalStoreLayout | TPShardedStoreLayout = layout
        self.metadata: KeyMetadata = database.metadata
        self.block_size: int = database.block_size
        self.hash_block_size: int = database.hash_block_size
        self.shard_ids: tuple[int, ...] = tuple(layout.local_shard_ids)
        if not self.shard_ids:
            raise ValueError("database: its store layout owns no shard (store_tp_size < local tp size?)")
        self.rank_local = isinstance(layout, RankLocalStoreLayout)
        first = None if self.rank_local else self.shard_ids[0]
        self.key_prefix = PoolKey.build_prefix(self.metadata, tp_rank=first)
        self._bases: list[int] = []
        self._lens: list[int] = []
        # TP-shared: the caches the transfer registered, and the template version last proven inside them.
        self._caches: RegisteredCaches | None = None
        self._checked_version: int | None = None
        self._pins = 0  # rank-local: pins this group holds on its layout's regions

    # ------------------------------------------------------------------ TP-shared segments vs the registration

    def bind_registered_caches(self, caches: RegisteredCaches) -> None:
        """Called by :meth:`KVTransfer.register_kv_caches`: the buffers every slice must stay inside."""
        self._caches = caches
        self._checked_version = None

    # ------------------------------------------------------------------ regions

    @property
    def kv_caches_base_addr(self) -> list[int]:
        """The region bases the transfer registered (the layout's own for a rank-local layout)."""
        return self.layout.kv_caches_base_addr if isinstance(self.layout, RankLocalStoreLayout) else self._bases

    @property
    def block_len(self) -> list[int]:
        """The block lengths the transfer registered (the layout's own for a rank-local layout)."""
        return self.layout.block_len if isinstance(self.layout, RankLocalStoreLayout) else self._lens

    def set_kv_caches_base_addr(self, base_addrs: list[int]) -> None:
        """Rank-local: the layout's regions; TP-shared: remembered only (the layout's templates hold the rows)."""
        if isinstance(self.layout, RankLocalStoreLayout):
            self.layout.set_kv_caches_base_addr(base_addrs)
        else:
            self._bases = base_addrs

    def _pin_regions(self, kv_caches_base_addr: list[int], block_len: list[int]) -> None:
        """Rank-local: pin the layout's regions (its native engine then refuses other values inside each call);
        TP-shared: nothing to pin (its rows come from installed templates, checked by
        :meth:`bind_registered_caches`)."""
        if isinstance(self.layout, RankLocalStoreLayout):
            self.layout._pin_regions(kv_caches_base_addr, block_len)
            self._pins += 1

    def _unpin_regions(self) -> None:
        """Drop one pin of :meth:`_pin_regions`."""
        if self._pins and isinstance(self.layout, RankLocalStoreLayout):
            self._pins -= 1
            self.layout._unpin_regions()

    def set_block_len(self, block_lens: list[int]) -> None:
        """See :meth:`set_kv_caches_base_addr`."""
        if isinstance(self.layout, RankLocalStoreLayout):
            self.layout.set_block_len(block_lens)
        else:
            self._lens = block_lens

    # ------------------------------------------------------------------ tail-key boundary

    def tail_tokens(self, num_tokens: int) -> int:
        """``num_tokens`` checked as a tail-key boundary of this group: a load given it keys the chunk ending at
        ``token_len`` by ``block_hashes[num_tokens // hash_block_size - 1]``."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)):
            raise TypeError(f"tail boundary: num_tokens must be an int, got {type(num_tokens).__name__}")
        if num_tokens < self.hash_block_size:
            raise ValueError(f"tail boundary: num_tokens {num_tokens} is below one hash block "
                             f"({self.hash_block_size} tokens)")
        return int(num_tokens)

    # ------------------------------------------------------------------ walks and plans

    def plan_store(
        self, token_len: int, block_hashes: Sequence[BlockHash], block_ids: Sequence[int], mask_num: int = 0
    ) -> StorePlan:
        """A send thread's candidates (the layout's native plan_store): the walk (vLLM 0.33's start rule),
        without chunks on the NULL block 0 or past ``block_ids``, each expanded to one ``(start, end,
        shard_id)`` entry per local shard id."""
        keys, chunks, ids = self.layout.plan_store(token_len, block_hashes, block_ids, mask_num)
        # The paths accept any (start, end, ...) chunk; StorePlan's annotation names the seed's pairs.
        return StorePlan(keys, cast(list[tuple[int, int]], chunks), ids)

    def walk_load(
        self, token_len: int, block_hashes: Sequence[BlockHash], mask_num: int = 0, tail: int | None = None
    ) -> LoadWalk:
        """A load's keys and ``(n, 3)`` ``(start, end, shard_id)`` entries, in :meth:`plan_load`'s order; ``tail``:
        a tail-key boundary (:meth:`tail_tokens`)."""
        tail = None if tail is None else self.tail_tokens(tail)
        keys, chunks = self.layout.walk_load(token_len, block_hashes, mask_num, None, tail)
        return LoadWalk(keys, chunks)

    def plan_load(
        self,
        token_len: int,
        block_hashes: Sequence[BlockHash],
        block_ids: Sequence[int],
        mask_num: int = 0,
        tail: int | None = None,
    ) -> KeyPlan:
        """The layout's fused load plan (keys, rows, block ids); ``tail``: a tail-key boundary."""
        tail = None if tail is None else self.tail_tokens(tail)
        keys, addrs, sizes, ids = self._bounded_rows(2, lambda: self.layout.plan_load(
            token_len, block_hashes, mask_num, None, list(block_ids), tail
        ))
        return KeyPlan(keys, addrs, sizes, ids)

    def _bounded_rows(self, sizes_at: int, compute: Callable[[], _Rows]) -> _Rows:
        """``compute()``'s rows (the sizes at index ``sizes_at``), computed between two reads of the TP-shared
        segment templates' version (refused unless the templates are still those of that version: an install
        ran meanwhile), and refused without a segment: a TP-shared layout whose caches were never registered
        would put empty objects (or read nothing) under real keys.

        TP-shared, before computing: the layout's installed segment templates are proven to keep every slice of
        every registered block (ids ``[0, num_blocks)``, which the transfer's screen enforces) inside one
        registered buffer. A layout re-registered after the transfer registered its caches (other tensors,
        other memory) is refused: its rows would move process memory the transfer never registered. Rank-local
        (its regions are checked against the registration by the transfer itself), and before a transfer
        registered caches (a group used on its own computes rows but moves nothing): no version.
        """
        version: int | None = None
        caches = self._caches
        if caches is not None and isinstance(self.layout, TPShardedStoreLayout):
            version, templates = self.layout.segment_templates
            if version != self._checked_version:
                if version % 2:
                    raise RuntimeError("the store layout is being re-registered: retry")
                caches.check_templates(templates, self.shard_ids)
                self._checked_version = version
        rows = compute()
        if version is not None and self.layout.segment_templates[0] != version:  # type: ignore[union-attr]
            raise RuntimeError("the store layout was re-registered during the call: nothing moved")
        sizes = rows[sizes_at]
        empty = sizes.shape[1] == 0 if isinstance(sizes, np.ndarray) else any(len(row) == 0 for row in sizes)
        if len(sizes) and empty:
            raise RuntimeError(
                "the store layout has no segments: register its KV caches first (KVTransfer.register_kv_caches)"
            )
        return rows

    @staticmethod
    def _split(chunks: Any) -> tuple[list[tuple[int, int]], list[int]]:
        rows = chunks.tolist() if isinstance(chunks, np.ndarray) else list(chunks)
        pairs: list[tuple[int, int]] = []
        shards: list[int] = []
        for row in rows:
            if len(row) != 3:
                raise ValueError(f"chunk {row!r}: a layout database expects (start, end, shard_id) entries")
            pairs.append((int(row[0]), int(row[1])))
            shards.append(int(row[2]))
        return pairs, shards

    def prepare_values(
        self, chunks: Sequence[Sequence[int]], block_ids: Sequence[int]
    ) -> tuple[list[list[int]], list[list[int]], list[int]]:
        """The layout's rows of ``(start, end, shard_id)`` entries (lists)."""
        pairs, shards = self._split(chunks)
        return self._bounded_rows(1, lambda: self.layout.prepare_values(pairs, list(block_ids), shards))

    def prepare_values_array(
        self, chunks: Any, block_ids: Sequence[int] | Int64Array
    ) -> tuple[Int64Array, Int64Array, Int64Array]:
        """The layout's rows of ``(start, end, shard_id)`` entries (int64 arrays)."""
        pairs, shards = self._split(chunks)
        return self._bounded_rows(1, lambda: self.layout.prepare_values_array(pairs, block_ids, shards))


#: The layouts whose rows come from the native engine over the registered regions (rank-local) or over
#: segment templates proven inside the registered buffers (TP-shared).
_ENGINE_LAYOUTS: frozenset[type] = frozenset(
    {RankLocalStoreLayout, TPShardedStoreLayout, LBHNCStoreLayout, LBNHCStoreLayout}
)


def _layout_rows_bounded(group: LayoutGroup) -> bool:
    """A group's rows are bounded by construction when its layout is one of ours, used as is (no row method
    replaced on the layout or on the group)."""
    layout = group.layout
    return type(layout) in _ENGINE_LAYOUTS and _no_instance_overrides(layout) and _no_instance_overrides(group)


register_bounded_rows(LayoutGroup, _layout_rows_bounded)


def group_databases(databases: Sequence[Any], transfer_mode: str | None) -> tuple[list[Any], str | None]:
    """The transfer's per-group databases (each layout database wrapped in a :class:`LayoutGroup`) and its
    transfer mode: a TP-shared layout's key is many segments that are not the registered regions, so it
    moves with the multi-buffer calls only (the default then, and the only mode allowed)."""
    groups = [LayoutGroup(db) if isinstance(db, LayoutTokenDatabase) else db for db in databases]
    layouts = [g for g in groups if isinstance(g, LayoutGroup)]
    if layouts and len(layouts) != len(groups):
        raise TypeError("databases: layout databases (integrations.vllm.data) and others cannot share a transfer")
    if any(not g.rank_local for g in layouts):
        if transfer_mode not in (None, "multi_buffer"):
            raise ValueError(f"transfer_mode: a TP-shared store layout needs 'multi_buffer', got {transfer_mode!r}")
        transfer_mode = "multi_buffer"
    return groups, transfer_mode


def host_regions(groups: Sequence[Any], kv_caches: list[Any]) -> list[Any]:
    """The host regions to register for ``kv_caches``: as given for seed-era databases; over layout groups,
    each cache's host memory as a numpy array (CPU tensors; numpy arrays too unless a layout is TP-shared)."""
    layouts = [g for g in groups if isinstance(g, LayoutGroup)]
    if not layouts:
        return kv_caches
    if any(not g.rank_local for g in layouts) and any(isinstance(cache, np.ndarray) for cache in kv_caches):
        raise TypeError("kv_caches: a TP-shared store layout needs CPU tensors (its segments follow their shape "
                        "and strides), got a numpy array")
    return [_host_array(cache) for cache in kv_caches]


def install_segments(groups: Sequence[Any], kv_caches: list[Any], num_blocks: int) -> None:
    """Every TP-shared layout derives its segment templates from the tensors (its packed-shape checks apply)."""
    for group in groups:
        if isinstance(group, LayoutGroup) and not group.rank_local:
            group.layout.register_kv_caches(kv_caches, num_blocks)


def _host_array(cache: Any) -> np.ndarray[Any, Any]:
    if isinstance(cache, np.ndarray):
        return cache
    numpy = getattr(cache, "numpy", None)
    if numpy is None:
        raise TypeError(f"kv_caches: expected numpy arrays or CPU tensors, got {type(cache).__name__}")
    array: np.ndarray[Any, Any] = numpy()
    if not array.flags.c_contiguous:
        # A dense view in another dimension order (e.g. a token-major cache seen head-major): register the
        # memory in its physical order, which is one C-contiguous range.
        array = array.transpose(np.argsort(array.strides, kind="stable")[::-1])
        if not array.flags.c_contiguous:
            raise ValueError("kv_caches: every cache must be one dense range of memory")
    return array
