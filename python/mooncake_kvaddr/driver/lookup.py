"""Store lookup: how many leading prompt tokens every KV-cache group can load (docs/lookup.md).

Lookup runs on one rank for the whole deployment, so a chunk counts as stored only when every rank
namespace that will load it holds it. Per group, the namespaces come from the parallel layout and the
group's replication factor (:func:`~mooncake_kvaddr.core.keys.lookup_namespaces`); their key prefixes are
built once, at construction. A lookup then

1. floors the prompt to the lookup alignment (the scheduler block size, or ``hash_block_size`` when
   partial-hash hits are on),
2. builds every candidate key - groups in order, probed units ascending, all namespaces of a unit
   next to each other - and asks the store about all of them in one ``batch_is_exist``,
3. reduces the answers to per-unit presence (present only if every namespace answered exactly 1; the
   answers are consumed exactly: a count mismatch is a miss, never a shifted read), and
4. returns the longest aligned length ``H`` below the prompt's last token that **every** group can load
   with the keys a loader derives from ``H`` (docs/lookup.md, "What a group needs to load H").

Two probing modes, fixed by the group layout:

* coarse (the usual one): group ``g`` probes its chunks of ``block_size`` tokens, named by the compact
  chunk hash, only where its lookup mask allows it (the mask is read before the hash);
* fine-grained: when an align-mode Mamba group has ``block_size > hash_block_size`` (or ``>=`` with DCP),
  every group probes every ``hash_block_size`` unit under its raw hash, and hits land on those units.

Cost: O(hashes x namespaces) keys and O(hashes x groups) arithmetic, independent of ``num_tokens``
(docs/lookup.md, "Cost").

:meth:`StoreLookup.lookup_with_boundaries` is the vLLM 0.33 shape of the answer: the hit length as vLLM
0.33's hybrid coordinator derives it, plus per group the token boundary whose key stores the tail block
(a loader that honours these boundaries may load a partial tail from a longer stored key).

Supported group types: full attention (MHA/GQA/MLA and uniform mixes of them), sliding-window attention
and Mamba. Not supported: EAGLE's dropped last block and chunked-local attention.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from mooncake_kvaddr.core.database import ChunkedTokenDatabase
from mooncake_kvaddr.core.hashes import BlobBlockHashes, BlockHash, chunk_hashes_for_block_size
from mooncake_kvaddr.core.keys import (
    SpecKind,
    build_lookup_keys,
    lookup_namespaces,
    lookup_prefixes,
    reduce_exists,
    replication_factor,
)
from mooncake_kvaddr.core.metadata import TailKeyBoundary
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

#: Mamba state caching modes (vLLM's ``mamba_cache_mode``); only "align" can enable partial-hash hits.
MAMBA_CACHE_MODES = ("align", "all", "none")

#: Most rank namespaces one group may expand to (pcp x tp x pp): every lookup probes each of them per unit.
MAX_NAMESPACES = 1 << 16

BoolArray = npt.NDArray[np.bool_]
#: Per group, per unit presence: any sequence of bools (lists, numpy arrays).
Presence = Sequence[Sequence[bool] | BoolArray]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class ParallelLayout:
    """The deployment's parallel sizes, as far as key namespaces go (docs/lookup.md, "Rank namespaces").

    ``num_kv_heads`` is the model's total number of KV heads: with ``tp_size`` above it, TP ranks hold
    identical attention bytes and share one namespace (the replication factor). Checked at construction:
    every size is an int >= 1; ``tp_size`` and ``num_kv_heads`` divide one another (KV heads are split
    evenly over TP ranks, or each head is replicated on the same number of ranks); ``dcp_size`` divides
    ``tp_size`` (DCP subdivides the TP group); at most :data:`MAX_NAMESPACES` namespaces per group.
    """

    tp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    pp_size: int = 1
    num_kv_heads: int = 1

    def __post_init__(self) -> None:
        for name in ("tp_size", "pcp_size", "dcp_size", "pp_size", "num_kv_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelLayout.{name}: must be an int >= 1, got {value!r}")
        tp, heads = self.tp_size, self.num_kv_heads
        if max(tp, heads) % min(tp, heads):
            raise ValueError(
                f"ParallelLayout: tp_size {tp} and num_kv_heads {heads} must divide one another (KV heads are "
                "split evenly over TP ranks, or replicated on an equal number of ranks each)"
            )
        if tp % self.dcp_size:
            raise ValueError(
                f"ParallelLayout: dcp_size {self.dcp_size} must divide tp_size {tp} (decode context parallelism "
                "subdivides the tensor-parallel group)"
            )
        namespaces = self.pcp_size * tp * self.pp_size
        if namespaces > MAX_NAMESPACES:
            raise ValueError(
                f"ParallelLayout: pcp_size x tp_size x pp_size = {namespaces} rank namespaces exceeds "
                f"{MAX_NAMESPACES}; every lookup would probe each of them"
            )


KindLike = SpecKind | str | Sequence[SpecKind | str]


@dataclass(frozen=True, init=False)
class GroupSpec:
    """What one KV-cache group caches, as far as lookup goes.

    Args:
        kind: ``"attention"`` (MHA/GQA), ``"mla"`` or ``"mamba"``; a sequence of kinds for a uniform-type
            group (e.g. MLA and GQA layers sharing one group).
        sliding_window: tokens of a sliding-window attention group (``None``: full attention), at least 2.
            A hit needs only the blocks inside the window before its end. (A 1-token window attends to
            nothing cached: no stored block could ever decide a hit, so it is refused.)
        mamba_cache_mode: for Mamba groups, vLLM's ``mamba_cache_mode``; ``"align"`` with
            ``block_size > hash_block_size`` switches the whole lookup to fine-grained units.
    """

    kinds: tuple[SpecKind, ...]
    sliding_window: int | None
    mamba_cache_mode: str

    def __init__(
        self, kind: KindLike = SpecKind.ATTENTION, *, sliding_window: int | None = None, mamba_cache_mode: str = "align"
    ) -> None:
        raw = [kind] if isinstance(kind, (str, SpecKind)) else list(kind)
        if not raw:
            raise ValueError("GroupSpec: a KV-cache group needs at least one spec kind")
        try:
            kinds = tuple(SpecKind(k) for k in raw)
        except ValueError:
            known = ", ".join(k.value for k in SpecKind)
            raise ValueError(f"GroupSpec: unknown spec kind in {kind!r} (known: {known})") from None
        mamba = SpecKind.MAMBA in kinds
        if mamba and len(set(kinds)) > 1:
            raise ValueError(f"GroupSpec: a group is either Mamba or attention, got {kind!r}")
        if sliding_window is not None:
            if mamba:
                raise ValueError("GroupSpec: sliding_window applies to attention groups, not Mamba")
            if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 2:
                raise ValueError(
                    f"GroupSpec: sliding_window must be an int >= 2, got {sliding_window!r} (a 1-token window "
                    "needs no cached block, so no stored chunk could ever decide a hit)"
                )
        if not isinstance(mamba_cache_mode, str) or mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(
                f"GroupSpec: mamba_cache_mode must be one of {MAMBA_CACHE_MODES}, got {mamba_cache_mode!r}"
            )
        object.__setattr__(self, "kinds", kinds)
        object.__setattr__(self, "sliding_window", sliding_window)
        object.__setattr__(self, "mamba_cache_mode", mamba_cache_mode)

    @classmethod
    def of(cls, spec: GroupSpecLike) -> GroupSpec:
        """``spec`` itself, or a default spec of the given kind(s)."""
        return spec if isinstance(spec, GroupSpec) else cls(spec)

    @property
    def is_mamba(self) -> bool:
        """A Mamba (recurrent state) group: a hit needs only the state at its end."""
        return self.kinds[0] is SpecKind.MAMBA

    @property
    def is_full_attention(self) -> bool:
        """A full-attention group: a hit needs every block before its end."""
        return not self.is_mamba and self.sliding_window is None


GroupSpecLike = GroupSpec | KindLike


class ExistenceStore(Protocol):
    """The one store call a lookup makes: :meth:`MooncakeStore.batch_is_exist`, or Mooncake's raw binding."""

    def batch_is_exist(self, keys: list[str]) -> BatchResult | Sequence[int]: ...


class LookupPrefixSource(Protocol):
    """What vLLM 0.33 calls a store layout, as far as lookup goes: the key prefixes of one group under the
    given ``(tp, pcp, dcp, pp)`` rank namespaces (in probe order)."""

    def lookup_key_prefixes(self, rank_namespaces: Sequence[tuple[int, int, int, int]]) -> Sequence[str]: ...


@dataclass(frozen=True)
class LookupResult:
    """vLLM 0.33's lookup answer: the hit length and, for a non-zero hit, one tail boundary per group."""

    hit_length: int
    tail_key_boundaries: tuple[TailKeyBoundary, ...] = ()


@dataclass
class LookupPlan:
    """One lookup's candidate keys and how their answers fold back into per-group units.

    ``units[g]`` lists the probed unit ids of group ``g`` (ascending); ``unit_counts[g]`` is how many units
    the group could have probed (masked units count, and read as absent). Group ``g`` owns
    ``key_counts[g] == len(units[g]) * widths[g]`` consecutive keys, group-major; :meth:`presence` checks
    every count, so an answer is never read for the wrong group.
    """

    keys: list[str] = field(default_factory=list)
    units: list[Sequence[int]] = field(default_factory=list)
    unit_counts: list[int] = field(default_factory=list)
    widths: list[int] = field(default_factory=list)
    key_counts: list[int] = field(default_factory=list)

    def presence(self, results: Sequence[int]) -> list[BoolArray]:
        """Per group, per unit: stored under every namespace (each result exactly 1).

        Raises ``ValueError`` when the answers do not match the keys one for one.
        """
        if len(results) != len(self.keys) or sum(self.key_counts) != len(self.keys):
            raise ValueError(f"{len(results)} exist results for {len(self.keys)} keys")
        present: list[BoolArray] = []
        pos = 0
        for units, count, width, n_keys in zip(
            self.units, self.unit_counts, self.widths, self.key_counts, strict=True
        ):
            if n_keys != len(units) * width:
                raise ValueError(f"{n_keys} keys for {len(units)} units x {width} namespaces")
            row = np.zeros(count, dtype=np.bool_)
            if n_keys:
                flags = reduce_exists(results[pos : pos + n_keys], width)
                if len(flags) != len(units):
                    raise ValueError(f"{len(flags)} unit answers for {len(units)} units")
                if isinstance(units, range):
                    row[units.start : units.stop] = flags
                else:
                    row[np.asarray(units, dtype=np.int64)] = flags
            present.append(row)
            pos += n_keys
        return present


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
        if specs is not None and len(specs) != len(databases):
            raise ValueError(f"specs: {len(specs)} specs for {len(databases)} KV-cache groups")
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
            self.prefixes = self._checked_prefixes(key_prefixes)
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
        self._spec_groups = self._merge_spec_groups()

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
        if len(sources) != len(databases):
            raise ValueError(f"sources: {len(sources)} prefix sources for {len(databases)} KV-cache groups")
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
        masks: list[list[bool] | None] = []
        for g, bs in enumerate(self.block_sizes):
            rule = self._mask_rule(g)
            if rule is None:
                masks.append(None)
                continue
            per, needed = rule
            masks.append([i % per >= per - needed for i in range(-(-token_len // bs))])
        return masks

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
        if lookup_masks is not None and len(lookup_masks) != len(self.databases):
            raise ValueError(f"lookup_masks: {len(lookup_masks)} masks for {len(self.databases)} KV-cache groups")
        for g, bs in enumerate(self.block_sizes):
            group_hashes = chunk_hashes_for_block_size(block_hashes, hbs, bs)
            count = max(0, min(len(group_hashes), -(-token_len // bs)))
            units: Sequence[int]
            if lookup_masks is not None:
                mask = lookup_masks[g]
                units = range(count) if mask is None else [i for i in range(min(count, len(mask))) if mask[i]]
            elif (rule := self._mask_rule(g)) is None:
                units = range(count)
            else:
                per, needed = rule
                units = [i for i in range(count) if i % per >= per - needed]
            self._probe(plan, g, group_hashes, units, count)
        return plan

    def hit_length(self, present: Presence, max_length: int) -> int:
        """Longest aligned prefix of at most ``max_length`` tokens that every group can load, given per-unit
        presence (docs/lookup.md, "What a group needs to load H"): the loader keys each group's last chunk
        with the hash at the hit's end, so that exact key must be stored. Linear in the units."""
        tables = self._tables(present)
        top = self._top(tables, max_length)
        if top <= 0:
            return 0
        ok = np.ones(top, dtype=np.bool_)
        for g, table in enumerate(tables):
            ok &= self._loadable(g, table, top)
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
        present = self._present(store, num_tokens, block_hashes, lookup_masks)
        if present is None:
            return 0
        num_tokens = _as_int("num_tokens", num_tokens)
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
        present = self._present(store, num_tokens, block_hashes, lookup_masks)
        if present is None:
            return LookupResult(0)
        tables = self._tables(present)
        num_tokens = _as_int("num_tokens", num_tokens)
        token_len = self.align_lookup_length(num_tokens)
        hit = self._converge(tables, token_len)
        if hit >= num_tokens:
            hit = self._converge(tables, self.align_lookup_length(num_tokens - 1))
        if hit <= 0:
            return LookupResult(0)
        return LookupResult(hit, self._tail_boundaries(tables, hit))

    # ------------------------------------------------------------------ internals: probing

    def _checked_prefixes(self, key_prefixes: Sequence[Sequence[str]]) -> list[tuple[str, ...]]:
        if len(key_prefixes) != len(self.databases):
            raise ValueError(
                f"key_prefixes: {len(key_prefixes)} prefix lists for {len(self.databases)} KV-cache groups"
            )
        checked: list[tuple[str, ...]] = []
        for g, group in enumerate(key_prefixes):
            if isinstance(group, (str, bytes)):
                raise TypeError(f"key_prefixes[{g}]: expected a sequence of str, got a single {type(group).__name__}")
            prefixes = tuple(group)
            if not prefixes or len(prefixes) > MAX_NAMESPACES:
                raise ValueError(f"key_prefixes[{g}]: need 1 to {MAX_NAMESPACES} prefixes, got {len(prefixes)}")
            if not all(isinstance(p, str) for p in prefixes):
                raise TypeError(f"key_prefixes[{g}]: every prefix must be a str")
            checked.append(prefixes)
        return checked

    def _require_hash_block_size(self) -> int:
        if self.hash_block_size is None:
            sizes = sorted({db.hash_block_size for db in self.databases})
            raise ValueError(f"lookup: the KV-cache groups disagree on hash_block_size {sizes}; one hash chain "
                             "feeds every group, so they must share it")
        return self.hash_block_size

    def _mask_rule(self, g: int) -> tuple[int, int] | None:
        """Coarse mode: ``(chunks per aligned boundary, chunks needed before one)``, or None (probe all)."""
        spec, bs = self.specs[g], self.block_sizes[g]
        per_boundary = self.alignment // bs
        if self.partial_hash_hits or spec.is_full_attention or per_boundary <= 1:
            return None
        needed = 1 if spec.is_mamba else _window_blocks(spec, bs)
        return None if needed >= per_boundary else (per_boundary, needed)

    def _probe(
        self, plan: LookupPlan, g: int, hashes: Sequence[BlockHash], units: Sequence[int], count: int
    ) -> None:
        prefixes = self.prefixes[g]
        if isinstance(units, range) and isinstance(hashes, BlobBlockHashes) and hashes.hash_len:
            # A leading run of a wire blob: hand the bytes over as they are, no object per hash.
            keys = build_lookup_keys(prefixes, BlobBlockHashes(_leading_bytes(hashes, len(units)), hashes.hash_len))
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
        """Per-unit presence for a ``num_tokens`` lookup, or None when nothing can hit (or the store failed)."""
        num_tokens = _as_int("num_tokens", num_tokens)
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

    def _merge_spec_groups(self) -> list[_SpecGroup]:
        merged: dict[tuple[GroupSpec, int], list[int]] = {}
        for g, (spec, bs) in enumerate(zip(self.specs, self.block_sizes, strict=True)):
            merged.setdefault((spec, bs), []).append(g)
        groups = [_SpecGroup(spec, bs, tuple(members)) for (spec, bs), members in merged.items()]
        groups.sort(key=lambda group: not group.spec.is_full_attention)  # stable: full attention first
        return groups

    # ------------------------------------------------------------------ internals: hit arithmetic
    #
    # Hits are counted in alignment steps j (H = j * alignment). A group's probed units are ``unit`` tokens
    # long (hash_block_size with partial-hash hits, else its block size); ``k = alignment // unit`` units
    # make one step and ``s = block_size // unit`` units one block. Everything below is O(units).

    def _unit(self, g: int) -> int:
        return self._require_hash_block_size() if self.partial_hash_hits else self.block_sizes[g]

    def _tables(self, present: Presence) -> list[BoolArray]:
        if len(present) != len(self.databases):
            raise ValueError(f"present: {len(present)} rows for {len(self.databases)} KV-cache groups")
        return [np.asarray(row, dtype=np.bool_).reshape(-1) for row in present]

    def _top(self, tables: Sequence[BoolArray], max_length: int) -> int:
        """Highest step worth testing: below ``max_length`` and within every group's probed units (a group
        always needs a key at or past the hit's end)."""
        top = max_length // self.alignment
        for g, table in enumerate(tables):
            top = min(top, table.size // (self.alignment // self._unit(g)))
        return top

    def _loadable(self, g: int, present: BoolArray, top: int) -> BoolArray:
        """``ok[j - 1]``: group ``g`` can load ``j`` steps with the keys a loader derives from that length
        (``top`` steps at most, all within the probed units)."""
        spec, unit = self.specs[g], self._unit(g)
        k, s = self.alignment // unit, self.block_sizes[g] // unit
        at_end: BoolArray = present[k - 1 : top * k : k]  # the key at each candidate end: unit j * k - 1
        if spec.is_mamba:
            return at_end  # the state stored at the end
        blocks = present[s - 1 :: s]  # a block's own key is the unit that ends it
        if spec.sliding_window is None:
            # The key at the end (a partial tail when the end cuts a block) and every whole block before it:
            # (j * k) // s <= run, i.e. j <= ((run + 1) * s - 1) // k.
            ok: BoolArray = at_end.copy()
            ok[((_leading_run(blocks) + 1) * s - 1) // k :] = False
            return ok
        # The window's blocks before an end on a block boundary (or every block back to the start). The end
        # j * k is a whole number of blocks when j is a multiple of q.
        q = s // math.gcd(s, k)
        steps = np.arange(q, top + 1, q, dtype=np.int64)
        last = steps * k // s  # blocks before the end
        first = np.maximum(last - _window_blocks(spec, self.block_sizes[g]), 0)
        absent = np.concatenate(([0], np.cumsum(~blocks, dtype=np.int64)))
        ok = np.zeros(top, dtype=np.bool_)
        ok[steps - 1] = absent[last] == absent[first]
        return ok

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
        unit = self._unit(g)
        k, s = self.alignment // unit, group.block_size // unit
        present = tables[g].copy()
        for member in group.members[1:]:
            present &= tables[member]
        n = present.size
        if group.spec.is_full_attention:
            run = _leading_run(present[s - 1 :: s])
            last_present = _last_true_at_or_before(present)

            def full_attention(step: int) -> int:
                units = step * k
                whole = min(run, units // s)  # leading whole blocks inside the bound
                hit = whole * s
                stop = min(whole * s + s - 1, units, n)  # interior units of the next block, <= the bound
                if stop > whole * s and (p := int(last_present[stop - 1])) >= whole * s:
                    hit = p + 1
                return hit // k

            return full_attention
        if group.spec.is_mamba:
            on_step = present & ((np.arange(n, dtype=np.int64) + 1) % k == 0)
            last_state = _last_true_at_or_before(on_step)

            def mamba(step: int) -> int:
                units = min(step * k, n)
                return 0 if units <= 0 else (int(last_state[units - 1]) + 1) // k

            return mamba
        steps = min(top, n // k)
        ok = np.concatenate(([True], self._loadable(g, present, steps)))
        last_ok = _last_true_at_or_before(ok)

        def sliding_window(step: int) -> int:
            return int(last_ok[min(step, steps)])

        return sliding_window

    def _tail_boundaries(self, tables: Sequence[BoolArray], hit: int) -> tuple[TailKeyBoundary, ...]:
        hbs = self._require_hash_block_size()
        boundaries: list[TailKeyBoundary] = []
        for g, present in enumerate(tables):
            unit, bs = self._unit(g), self.block_sizes[g]
            at = hit // unit - 1
            if at < present.size and present[at]:
                boundaries.append(TailKeyBoundary(g, hit))
                continue
            # Fine-grained only: a longer key of the same block (up to its end) holds the tail too.
            stop = min(-(-hit // bs) * bs // unit, present.size)
            later = np.flatnonzero(present[at + 1 : stop]) if self.partial_hash_hits else np.empty(0)
            if not later.size:
                raise RuntimeError(f"lookup: no tail key for group {g} at hit length {hit} (hash unit {hbs})")
            boundaries.append(TailKeyBoundary(g, (at + 2 + int(later[0])) * unit))
        return tuple(boundaries)


def _as_int(name: str, value: int) -> int:
    """``value`` as a Python int (anything with ``__index__`` but bool), else ``TypeError``."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}") from None


def _window_blocks(spec: GroupSpec, block_size: int) -> int:
    """Blocks a sliding-window hit needs before its end: ``ceil((window - 1) / block_size)``."""
    assert spec.sliding_window is not None
    return -(-(spec.sliding_window - 1) // block_size)


def _leading_run(flags: BoolArray) -> int:
    """How many leading entries are True."""
    misses = np.flatnonzero(~flags)
    return int(misses[0]) if misses.size else int(flags.size)


def _last_true_at_or_before(flags: BoolArray) -> IntArray:
    """``out[i]``: the highest index ``<= i`` whose flag is True, or -1."""
    marks = np.where(flags, np.arange(flags.size, dtype=np.int64), -1)
    return np.maximum.accumulate(marks) if marks.size else marks


def _leading_bytes(hashes: BlobBlockHashes, count: int) -> memoryview:
    """The first ``count`` hashes of a blob view as a flat byte view (whatever the buffer's item format);
    ``ValueError`` when the buffer holds fewer bytes than that."""
    view = memoryview(hashes.blob)
    if view.ndim != 1 or view.itemsize != 1 or view.format not in ("B", "b", "c"):
        view = view.cast("B") if view.c_contiguous else memoryview(view.tobytes())
    need = count * hashes.hash_len
    if view.nbytes < need:
        raise ValueError(f"lookup: hash blob holds {view.nbytes} bytes, fewer than {count} hashes of "
                         f"{hashes.hash_len} bytes")
    return view[:need]
