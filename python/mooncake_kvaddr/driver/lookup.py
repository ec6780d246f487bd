"""Store lookup: how many leading prompt tokens every KV-cache group can load (docs/lookup.md).

Lookup runs on one rank for the whole deployment, so a chunk counts only when every rank namespace that will
load it holds it; all candidate keys go to the store in one ``batch_is_exist``. The value types live in
:mod:`~mooncake_kvaddr.driver.lookup_types`, the hit arithmetic in :mod:`~mooncake_kvaddr.driver.lookup_hits`.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Callable, Sequence, Sized
from dataclasses import dataclass

import numpy as np

from mooncake_kvaddr.core.database import ChunkedTokenDatabase
from mooncake_kvaddr.core.hashes import BlobBlockHashes, BlockHash, chunk_hashes_for_block_size
from mooncake_kvaddr.core.keys import build_lookup_keys, lookup_namespaces, lookup_prefixes, replication_factor
from mooncake_kvaddr.core.metadata import TailKeyBoundary
from mooncake_kvaddr.driver.lookup_hits import loadable_steps, step_finder, window_blocks
from mooncake_kvaddr.driver.lookup_types import MAMBA_CACHE_MODES as MAMBA_CACHE_MODES
from mooncake_kvaddr.driver.lookup_types import MAX_NAMESPACES as MAX_NAMESPACES
from mooncake_kvaddr.driver.lookup_types import BoolArray as BoolArray
from mooncake_kvaddr.driver.lookup_types import (
    ExistenceStore,
    GroupSpec,
    GroupSpecLike,
    LookupPlan,
    LookupPrefixSource,
    LookupResult,
    ParallelLayout,
)
from mooncake_kvaddr.driver.lookup_types import IntArray as IntArray
from mooncake_kvaddr.driver.lookup_types import KindLike as KindLike
from mooncake_kvaddr.driver.lookup_types import Presence as Presence
from mooncake_kvaddr.driver.store import BatchResult

__all__ = [
    "ExistenceStore",
    "GroupSpec",
    "GroupSpecLike",
    "LookupPlan",
    "LookupPrefixSource",
    "LookupResult",
    "ParallelLayout",
    "StoreLookup",
    "TailKeyBoundary",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _SpecGroup:
    """Groups with equal specs and block sizes (vLLM merges them: a unit counts only if all members have it)."""

    spec: GroupSpec
    block_size: int
    members: tuple[int, ...]


class StoreLookup:
    """Lookup over one worker's KV-cache groups, probing every rank namespace (docs/lookup.md).

    Args:
        databases: one database per KV-cache group, in group order (their metadata names the keys).
        specs: per group, a :class:`GroupSpec` or a kind (``"attention"``, ``"mla"``, ``"mamba"``, or a
            sequence of them for a uniform group); default: full attention everywhere.
        layout: the parallel layout whose rank namespaces must all hold a chunk. ``None``: this worker's
            own namespace only (each database's own key prefix), the single-rank behaviour.
        key_prefixes: per group, the lookup key prefixes to probe (in probe order), replacing the ones built
            from ``layout`` (e.g. from a vLLM 0.33 store layout: see :meth:`from_prefix_sources`).
    """

    def __init__(
        self,
        databases: Sequence[ChunkedTokenDatabase],
        specs: Sequence[GroupSpecLike] | None = None,
        layout: ParallelLayout | None = None,
        *,
        key_prefixes: Sequence[Sequence[str]] | None = None,
    ) -> None:
        if not databases:
            raise ValueError("databases: need one ChunkedTokenDatabase per KV-cache group (at least one)")
        _check_groups("specs", specs, "specs", len(databases))
        if layout is not None and not isinstance(layout, ParallelLayout):
            raise TypeError(f"layout: expected a ParallelLayout, got {type(layout).__name__}")
        self.databases = list(databases)
        self.specs = [GroupSpec.of(s) for s in specs] if specs is not None else [GroupSpec()] * len(databases)
        self.layout = layout
        self.block_sizes = [db.block_size for db in self.databases]
        self.scheduler_block_size = math.lcm(*self.block_sizes)
        self.factors: list[int] | None = None
        if layout is None:
            self.prefixes: list[tuple[str, ...]] = [(db.key_prefix,) for db in self.databases]
        else:
            self.factors = [
                replication_factor(spec.kinds, layout.tp_size, layout.dcp_size, layout.num_kv_heads)
                for spec in self.specs
            ]
            self.prefixes = [
                tuple(lookup_prefixes(db.metadata, namespaces))
                for db, namespaces in zip(self.databases, self.rank_namespaces(), strict=True)
            ]
        if key_prefixes is not None:
            _check_groups("key_prefixes", key_prefixes, "prefix lists", len(self.databases))
            self.prefixes = []
            for g, group in enumerate(key_prefixes):
                if isinstance(group, (str, bytes)):
                    raise TypeError(f"key_prefixes[{g}]: expected a sequence of str, "
                                    f"got a single {type(group).__name__}")
                prefixes = tuple(group)
                if not prefixes or len(prefixes) > MAX_NAMESPACES:
                    raise ValueError(f"key_prefixes[{g}]: need 1 to {MAX_NAMESPACES} prefixes, got {len(prefixes)}")
                if not all(isinstance(p, str) for p in prefixes):
                    raise TypeError(f"key_prefixes[{g}]: every prefix must be a str")
                self.prefixes.append(prefixes)
        hash_block_sizes = {db.hash_block_size for db in self.databases}
        # One hash chain feeds every group, so they must agree on its granularity; checked at lookup time so
        # that transfers whose groups disagree still construct (store/load use each group's own size).
        self.hash_block_size: int | None = hash_block_sizes.pop() if len(hash_block_sizes) == 1 else None
        dcp_size = layout.dcp_size if layout is not None else 1
        hbs = self.hash_block_size
        self.partial_hash_hits = hbs is not None and any(
            spec.is_mamba and spec.mamba_cache_mode == "align" and (bs > hbs or (dcp_size > 1 and bs >= hbs))
            for spec, bs in zip(self.specs, self.block_sizes, strict=True)
        )
        self.alignment = hbs if self.partial_hash_hits and hbs is not None else self.scheduler_block_size
        merged: dict[tuple[GroupSpec, int], list[int]] = {}
        for g, (spec, bs) in enumerate(zip(self.specs, self.block_sizes, strict=True)):
            merged.setdefault((spec, bs), []).append(g)
        self._spec_groups = [_SpecGroup(spec, bs, tuple(members)) for (spec, bs), members in merged.items()]
        self._spec_groups.sort(key=lambda group: not group.spec.is_full_attention)  # stable: full attention first

    @classmethod
    def from_prefix_sources(
        cls,
        databases: Sequence[ChunkedTokenDatabase],
        sources: Sequence[LookupPrefixSource],
        specs: Sequence[GroupSpecLike] | None = None,
        layout: ParallelLayout | None = None,
    ) -> StoreLookup:
        """A lookup whose prefixes come from per-group store layouts (vLLM 0.33's
        ``lookup_key_prefixes(rank_namespaces)``), fed this layout's namespaces for each group."""
        _check_groups("sources", sources, "prefix sources", len(databases))
        probe = cls(databases, specs, layout)
        namespaces = probe.rank_namespaces()
        prefixes = [tuple(src.lookup_key_prefixes(ns)) for src, ns in zip(sources, namespaces, strict=True)]
        return cls(databases, specs, layout, key_prefixes=prefixes)

    # ------------------------------------------------------------------ public API

    def rank_namespaces(self) -> list[list[tuple[int, int, int, int]]]:
        """Per group, the ``(tp, pcp, dcp, pp)`` namespaces a lookup probes (docs/lookup.md, "Rank namespaces");
        without a layout, each group's own ranks."""
        if self.layout is None or self.factors is None:
            return [[(db.metadata.tp_rank, db.metadata.pcp_rank, db.metadata.dcp_rank, db.metadata.pp_rank)]
                    for db in self.databases]
        lay = self.layout
        return [lookup_namespaces(lay.tp_size, lay.pcp_size, lay.dcp_size, lay.pp_size, factor)
                for factor in self.factors]

    def align_lookup_length(self, length: int) -> int:
        """``length`` floored to the lookup alignment (hash unit with partial-hash hits, else scheduler block)."""
        return length // self.alignment * self.alignment

    def lookup_masks(self, token_len: int) -> list[list[bool] | None]:
        """Per group, which chunks can decide a hit at an aligned boundary ``<= token_len`` (None: all).

        Full attention needs every chunk. A sliding-window group needs only the blocks inside the window
        before an aligned boundary, a Mamba group only the block that ends on one. Coarse mode only. The lists
        have ``ceil(token_len / block_size)`` entries: :meth:`lookup` itself never builds them.
        """
        return [self._rule_mask(g, -(-token_len // bs)) for g, bs in enumerate(self.block_sizes)]

    def plan(
        self,
        token_len: int,
        block_hashes: Sequence[BlockHash],
        lookup_masks: Sequence[Sequence[bool] | None] | None = None,
    ) -> LookupPlan:
        """Candidate keys for an aligned ``token_len`` (group-major, units ascending, namespaces innermost).

        ``lookup_masks`` (coarse mode only) replaces :meth:`lookup_masks`: per group, a mask over absolute
        chunk ids (``None``: all chunks); chunks past the mask are not probed. A masked chunk's hash is never
        read. Work is bounded by the hashes, not by ``token_len``.
        """
        hbs = self._require_hash_block_size()
        token_len = _as_int("token_len", token_len)
        plan = LookupPlan()
        if self.partial_hash_hits:
            count = max(0, min(len(block_hashes), token_len // hbs))
            for g in range(len(self.databases)):
                self._probe(plan, g, block_hashes, range(count), count)
            return plan
        _check_groups("lookup_masks", lookup_masks, "masks", len(self.databases))
        for g, bs in enumerate(self.block_sizes):
            group_hashes = chunk_hashes_for_block_size(block_hashes, hbs, bs)
            count = max(0, min(len(group_hashes), -(-token_len // bs)))
            mask = self._rule_mask(g, count) if lookup_masks is None else lookup_masks[g]
            units = range(count) if mask is None else [i for i in range(min(count, len(mask))) if mask[i]]
            self._probe(plan, g, group_hashes, units, count)
        return plan

    def hit_length(self, present: Presence, max_length: int) -> int:
        """Longest aligned prefix of at most ``max_length`` tokens that every group can load, given per-unit
        presence (docs/lookup.md, "What a group needs to load H"): the loader keys each group's last chunk
        with the hash at the hit's end, so that exact key must be stored. Linear in the units."""
        tables = self._tables(present)
        # The highest step worth testing: below max_length and within every group's probed units (a group
        # always needs a key at or past the hit's end).
        top = max_length // self.alignment
        for g, table in enumerate(tables):
            top = min(top, table.size // (self.alignment // self._unit(g)))
        if top <= 0:
            return 0
        ok = np.ones(top, dtype=np.bool_)
        for g, table in enumerate(tables):
            ok &= loadable_steps(self.specs[g], self.block_sizes[g], self._unit(g), self.alignment, table, top)
            if not ok.any():
                return 0
        hits = np.flatnonzero(ok)
        return int(hits[-1] + 1) * self.alignment if hits.size else 0

    def lookup(
        self,
        store: ExistenceStore,
        num_tokens: int,
        block_hashes: Sequence[BlockHash],
        *,
        lookup_masks: Sequence[Sequence[bool] | None] | None = None,
    ) -> int:
        """Leading tokens of a ``num_tokens`` prompt that every group can load, with one ``batch_is_exist``.

        A store failure (an exception or a malformed answer) is a miss: 0. A hit covering the whole prompt
        is re-derived below ``num_tokens`` from the same answers, so the last token is recomputed.
        """
        num_tokens = _as_int("num_tokens", num_tokens)
        present = self._present(store, num_tokens, block_hashes, lookup_masks)
        if present is None:
            return 0
        # The longest loadable length strictly below num_tokens (docs/lookup.md, "The last token").
        return self.hit_length(present, self.align_lookup_length(num_tokens - 1))

    def lookup_with_boundaries(
        self,
        store: ExistenceStore,
        num_tokens: int,
        block_hashes: Sequence[BlockHash],
        *,
        lookup_masks: Sequence[Sequence[bool] | None] | None = None,
    ) -> LookupResult:
        """vLLM 0.33's lookup: the hit as its hybrid coordinator converges on it, and per group the boundary
        whose key stores the tail block (docs/lookup.md, "Tail key boundaries"). A loader must honour the
        boundaries: with partial-hash hits a group's tail may be loadable only from a longer stored key."""
        num_tokens = _as_int("num_tokens", num_tokens)
        present = self._present(store, num_tokens, block_hashes, lookup_masks)
        if present is None:
            return LookupResult(0)
        tables = self._tables(present)
        token_len = self.align_lookup_length(num_tokens)
        hit = self._converge(tables, token_len)
        if hit >= num_tokens:
            hit = self._converge(tables, self.align_lookup_length(num_tokens - 1))
        if hit <= 0:
            return LookupResult(0)
        # Per group, the boundary whose key stores the tail block.
        hbs = self._require_hash_block_size()
        boundaries: list[TailKeyBoundary] = []
        for g, table in enumerate(tables):
            unit, bs = self._unit(g), self.block_sizes[g]
            at = hit // unit - 1
            if at < table.size and table[at]:
                boundaries.append(TailKeyBoundary(g, hit))
                continue
            # Fine-grained only: a longer key of the same block (up to its end) holds the tail too.
            stop = min(-(-hit // bs) * bs // unit, table.size)
            later = np.flatnonzero(table[at + 1 : stop]) if self.partial_hash_hits else np.empty(0)
            if not later.size:
                raise RuntimeError(f"lookup: no tail key for group {g} at hit length {hit} (hash unit {hbs})")
            boundaries.append(TailKeyBoundary(g, (at + 2 + int(later[0])) * unit))
        return LookupResult(hit, tuple(boundaries))

    # ------------------------------------------------------------------ internals: probing

    def _require_hash_block_size(self) -> int:
        if self.hash_block_size is None:
            sizes = sorted({db.hash_block_size for db in self.databases})
            raise ValueError(f"lookup: the KV-cache groups disagree on hash_block_size {sizes}; one hash chain "
                             "feeds every group, so they must share it")
        return self.hash_block_size

    def _rule_mask(self, g: int, count: int) -> list[bool] | None:
        """Coarse mode: which of group ``g``'s first ``count`` chunks can decide a hit at an aligned boundary (the
        last ``needed`` chunks before each one), or None (probe all)."""
        spec, bs = self.specs[g], self.block_sizes[g]
        per_boundary = self.alignment // bs
        if self.partial_hash_hits or spec.is_full_attention or per_boundary <= 1:
            return None
        needed = 1 if spec.is_mamba else window_blocks(spec, bs)
        return None if needed >= per_boundary else [i % per_boundary >= per_boundary - needed for i in range(count)]

    def _probe(
        self, plan: LookupPlan, g: int, hashes: Sequence[BlockHash], units: Sequence[int], count: int
    ) -> None:
        prefixes = self.prefixes[g]
        if isinstance(units, range) and isinstance(hashes, BlobBlockHashes) and hashes.hash_len:
            # A leading run of a wire blob: hand the bytes over as they are, no object per hash. Its first
            # len(units) hashes as a flat byte view (whatever the buffer's item format); ValueError when the
            # buffer holds fewer bytes than that.
            view = memoryview(hashes.blob)
            if view.ndim != 1 or view.itemsize != 1 or view.format not in ("B", "b", "c"):
                view = view.cast("B") if view.c_contiguous else memoryview(view.tobytes())
            need = len(units) * hashes.hash_len
            if view.nbytes < need:
                raise ValueError(f"lookup: hash blob holds {view.nbytes} bytes, fewer than {len(units)} hashes of "
                                 f"{hashes.hash_len} bytes")
            keys = build_lookup_keys(prefixes, BlobBlockHashes(view[:need], hashes.hash_len))
        else:
            keys = build_lookup_keys(prefixes, [hashes[i] for i in units])
        if len(keys) != len(units) * len(prefixes):
            raise ValueError(f"lookup: group {g} built {len(keys)} keys for {len(units)} units x "
                             f"{len(prefixes)} namespaces; its hash view does not match its hashes")
        plan.keys.extend(keys)
        plan.units.append(units)
        plan.unit_counts.append(count)
        plan.widths.append(len(prefixes))
        plan.key_counts.append(len(keys))

    def _present(
        self,
        store: ExistenceStore,
        num_tokens: int,
        block_hashes: Sequence[BlockHash],
        lookup_masks: Sequence[Sequence[bool] | None] | None,
    ) -> list[BoolArray] | None:
        """Per-unit presence for a ``num_tokens`` lookup (an int, checked by the caller), or None when nothing can
        hit (or the store failed)."""
        token_len = self.align_lookup_length(num_tokens)
        if not block_hashes or token_len <= 0:
            return None
        plan = self.plan(token_len, block_hashes, lookup_masks)
        if not plan.keys:
            return None
        try:
            answer = store.batch_is_exist(plan.keys)
            results = answer.codes if isinstance(answer, BatchResult) else answer
            return plan.presence(results)
        except Exception as exc:  # a lookup never fails the scheduler: whatever went wrong is a miss
            logger.warning("lookup: batch_is_exist over %d keys failed: %s", len(plan.keys), exc)
            return None

    # ------------------------------------------------------------------ internals: hit arithmetic
    #
    # Hits are counted in alignment steps j (H = j * alignment). A group's probed units are ``unit`` tokens
    # long (hash_block_size with partial-hash hits, else its block size); ``k = alignment // unit`` units
    # make one step and ``s = block_size // unit`` units one block. Everything below is O(units); the per-group
    # arithmetic itself is in driver/lookup_hits.py.

    def _unit(self, g: int) -> int:
        return self._require_hash_block_size() if self.partial_hash_hits else self.block_sizes[g]

    def _tables(self, present: Presence) -> list[BoolArray]:
        _check_groups("present", present, "rows", len(self.databases))
        return [np.asarray(row, dtype=np.bool_).reshape(-1) for row in present]

    # vLLM 0.33's coordinator, for lookup_with_boundaries: each spec group's finder returns its longest
    # hit <= a bound; full-attention finders run once (full attention first), the others until the hit
    # settles. Each finder is O(1) on tables built once, so the whole walk stays linear.

    def _converge(self, tables: Sequence[BoolArray], max_length: int) -> int:
        top = max_length // self.alignment
        if top <= 0:
            return 0
        finders = [self._finder(group, tables, top) for group in self._spec_groups]
        full: dict[int, int] = {}
        hit = top
        while True:
            current = hit
            for index, (group, find) in enumerate(zip(self._spec_groups, finders, strict=True)):
                if index in full:
                    current = min(current, full[index])
                    continue
                current = find(current)
                if group.spec.is_full_attention:
                    full[index] = current
            if current >= hit:
                return hit * self.alignment
            hit = current

    def _finder(self, group: _SpecGroup, tables: Sequence[BoolArray], top: int) -> Callable[[int], int]:
        g = group.members[0]
        present = tables[g].copy()
        for member in group.members[1:]:
            present &= tables[member]
        return step_finder(group.spec, group.block_size, self._unit(g), self.alignment, present, top)


def _check_groups(name: str, values: Sized | None, what: str, groups: int) -> None:
    """``ValueError`` unless ``values`` (``None``: not given) holds one entry per KV-cache group."""
    if values is not None and len(values) != groups:
        raise ValueError(f"{name}: {len(values)} {what} for {groups} KV-cache groups")


def _as_int(name: str, value: int) -> int:
    """``value`` as a Python int (anything with ``__index__`` but bool), else ``TypeError``."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}") from None

