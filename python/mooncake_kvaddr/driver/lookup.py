"""Store lookup: how many leading prompt tokens every KV-cache group can load (SPEC.md §1.4, §3.5).

Lookup runs on one rank for the whole deployment, so a chunk counts as stored only when every rank
namespace that will load it holds it. Per group, the namespaces come from the parallel layout and the
group's replication factor (:func:`~mooncake_kvaddr.core.keys.lookup_namespaces`); their key prefixes are
built once, at construction. A lookup then

1. floors the prompt to the lookup alignment (the scheduler block size, or ``hash_block_size`` when
   partial-hash hits are on),
2. builds every candidate key - groups in order, probed units ascending, all namespaces of a unit
   next to each other - and asks the store about all of them in one ``batch_is_exist``,
3. reduces the answers to per-unit presence (present only if every namespace answered exactly 1), and
4. walks the groups the way vLLM's hybrid KV-cache coordinator does, group type by group type, to the
   longest prefix that every group can serve. A hit covering the whole prompt is re-derived one token
   shorter (the last token must be recomputed) from the same answers, without a second RPC.

Two probing modes, fixed by the group layout:

* coarse (the usual one): group ``g`` probes its chunks of ``block_size`` tokens, named by the compact
  chunk hash (SPEC.md §1.2), only where its lookup mask allows it (the mask is read before the hash);
* fine-grained: when an align-mode Mamba group has ``block_size > hash_block_size`` (or ``>=`` with DCP),
  every group probes every ``hash_block_size`` unit under its raw hash, and hits land on those units.

Supported group types: full attention (MHA/GQA/MLA and uniform mixes of them), sliding-window attention
and Mamba. Not supported: EAGLE's dropped last block and chunked-local attention.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

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
from mooncake_kvaddr.driver.store import BatchResult

__all__ = ["ExistenceStore", "GroupSpec", "GroupSpecLike", "LookupPlan", "ParallelLayout", "StoreLookup"]

logger = logging.getLogger(__name__)

#: Mamba state caching modes (vLLM's ``mamba_cache_mode``); only "align" can enable partial-hash hits.
MAMBA_CACHE_MODES = ("align", "all", "none")


@dataclass(frozen=True)
class ParallelLayout:
    """The deployment's parallel sizes, as far as key namespaces go (SPEC.md §1.4).

    ``num_kv_heads`` is the model's total number of KV heads: with ``tp_size`` above it, TP ranks hold
    identical attention bytes and share one namespace (the replication factor).
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


KindLike = SpecKind | str | Sequence[SpecKind | str]


@dataclass(frozen=True, init=False)
class GroupSpec:
    """What one KV-cache group caches, as far as lookup goes.

    Args:
        kind: ``"attention"`` (MHA/GQA), ``"mla"`` or ``"mamba"``; a sequence of kinds for a uniform-type
            group (e.g. MLA and GQA layers sharing one group).
        sliding_window: tokens of a sliding-window attention group (``None``: full attention). A hit needs
            only the blocks inside the window before its end.
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
            if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
                raise ValueError(f"GroupSpec: sliding_window must be an int >= 1, got {sliding_window!r}")
        if mamba_cache_mode not in MAMBA_CACHE_MODES:
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


@dataclass
class LookupPlan:
    """One lookup's candidate keys and how their answers fold back into per-group units.

    ``units[g]`` lists the probed unit ids of group ``g`` (ascending); ``unit_counts[g]`` is how many units
    the group could have probed (masked units count, and read as absent). Group ``g`` owns
    ``len(units[g]) * widths[g]`` consecutive keys, group-major.
    """

    keys: list[str] = field(default_factory=list)
    units: list[list[int]] = field(default_factory=list)
    unit_counts: list[int] = field(default_factory=list)
    widths: list[int] = field(default_factory=list)

    def presence(self, results: Sequence[int]) -> list[list[bool]]:
        """Per group, per unit: stored under every namespace (each result exactly 1)."""
        if len(results) != len(self.keys):
            raise ValueError(f"{len(results)} exist results for {len(self.keys)} keys")
        present: list[list[bool]] = []
        pos = 0
        for units, count, width in zip(self.units, self.unit_counts, self.widths, strict=True):
            end = pos + len(units) * width
            flags = reduce_exists(results[pos:end], width) if units else []
            row = [False] * count
            for unit, flag in zip(units, flags, strict=True):
                row[unit] = flag
            present.append(row)
            pos = end
        return present


@dataclass(frozen=True)
class _SpecGroup:
    """Groups with equal specs: a unit is present only if every member group has it (like vLLM's SpecGroup)."""

    spec: GroupSpec
    block_size: int
    members: tuple[int, ...]


class StoreLookup:
    """Lookup over one worker's KV-cache groups (SPEC.md §3.5), probing every rank namespace (§1.4).

    Args:
        databases: one database per KV-cache group, in group order (their metadata names the keys).
        specs: per group, a :class:`GroupSpec` or a kind (``"attention"``, ``"mla"``, ``"mamba"``, or a
            sequence of them for a uniform group); default: full attention everywhere.
        layout: the parallel layout whose rank namespaces must all hold a chunk. ``None``: this worker's
            own namespace only (each database's own key prefix), the single-rank behaviour.
    """

    def __init__(
        self,
        databases: Sequence[ChunkedTokenDatabase],
        specs: Sequence[GroupSpecLike] | None = None,
        layout: ParallelLayout | None = None,
    ) -> None:
        if not databases:
            raise ValueError("databases: need one ChunkedTokenDatabase per KV-cache group (at least one)")
        if specs is not None and len(specs) != len(databases):
            raise ValueError(f"specs: {len(specs)} specs for {len(databases)} KV-cache groups")
        self.databases = list(databases)
        self.specs = [GroupSpec.of(s) for s in specs] if specs is not None else [GroupSpec()] * len(databases)
        self.layout = layout
        self.block_sizes = [db.block_size for db in self.databases]
        self.scheduler_block_size = math.lcm(*self.block_sizes)
        if layout is None:
            self.factors: list[int] | None = None
            self.prefixes: list[tuple[str, ...]] = [(db.key_prefix,) for db in self.databases]
        else:
            self.factors = [
                replication_factor(spec.kinds, layout.tp_size, layout.dcp_size, layout.num_kv_heads)
                for spec in self.specs
            ]
            self.prefixes = [
                tuple(lookup_prefixes(db.metadata, lookup_namespaces(
                    layout.tp_size, layout.pcp_size, layout.dcp_size, layout.pp_size, factor)))
                for db, factor in zip(self.databases, self.factors, strict=True)
            ]
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

    # ------------------------------------------------------------------ public API

    def align_lookup_length(self, length: int) -> int:
        """``length`` floored to the lookup alignment (hash unit with partial-hash hits, else scheduler block)."""
        return length // self.alignment * self.alignment

    def lookup_masks(self, token_len: int) -> list[list[bool] | None]:
        """Per group, which chunks can decide a hit at an aligned boundary ``<= token_len`` (None: all).

        Full attention needs every chunk. A sliding-window group needs only the blocks inside the window
        before an aligned boundary, a Mamba group only the block that ends on one. Coarse mode only.
        """
        masks: list[list[bool] | None] = []
        for spec, bs in zip(self.specs, self.block_sizes, strict=True):
            per_boundary = self.alignment // bs  # chunks between two aligned boundaries
            if spec.is_full_attention or per_boundary <= 1:
                masks.append(None)
                continue
            needed = 1 if spec.is_mamba else _window_blocks(spec, bs)
            if needed >= per_boundary:
                masks.append(None)
                continue
            chunks = -(-token_len // bs)
            masks.append([i % per_boundary >= per_boundary - needed for i in range(chunks)])
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
        read.
        """
        hbs = self._require_hash_block_size()
        plan = LookupPlan()
        if self.partial_hash_hits:
            count = min(len(block_hashes), token_len // hbs)
            for g in range(len(self.databases)):
                self._probe(plan, g, block_hashes, range(count), count)
            return plan
        if lookup_masks is None:
            masks: Sequence[Sequence[bool] | None] = self.lookup_masks(token_len)
        elif len(lookup_masks) != len(self.databases):
            raise ValueError(f"lookup_masks: {len(lookup_masks)} masks for {len(self.databases)} KV-cache groups")
        else:
            masks = lookup_masks
        for g, bs in enumerate(self.block_sizes):
            group_hashes = chunk_hashes_for_block_size(block_hashes, hbs, bs)
            count = min(len(group_hashes), -(-token_len // bs))
            mask = masks[g]
            if mask is None:
                units: Sequence[int] = range(count)
            else:
                units = [i for i in range(min(count, len(mask))) if mask[i]]
            self._probe(plan, g, group_hashes, units, count)
        return plan

    def hit_length(self, present: Sequence[Sequence[bool]], max_length: int) -> int:
        """Longest prefix of at most ``max_length`` tokens every group can load, given per-unit presence.

        Mirrors vLLM's hybrid coordinator: full-attention groups first, then the others, repeated until the
        length settles; with partial-hash hits, a length that ends inside a full-attention block must also
        have that block's partial key, else the next lower aligned length is tried.
        """
        candidate = max_length
        while True:
            hit = self._converge(present, candidate)
            if hit == 0 or self._partial_boundary_present(present, hit):
                return hit
            candidate = max(0, hit - self.alignment)

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
        token_len = self.align_lookup_length(num_tokens)
        if not block_hashes or token_len <= 0:
            return 0
        plan = self.plan(token_len, block_hashes, lookup_masks)
        if not plan.keys:
            return 0
        try:
            answer = store.batch_is_exist(plan.keys)
            results = answer.codes if isinstance(answer, BatchResult) else answer
            present = plan.presence(results)
        except Exception as exc:  # a lookup never fails the scheduler: whatever went wrong is a miss
            logger.warning("lookup: batch_is_exist over %d keys failed: %s", len(plan.keys), exc)
            return 0
        hit = self.hit_length(present, token_len)
        if hit >= num_tokens:
            usable = self.align_lookup_length(num_tokens - 1)
            if usable <= 0:
                return 0
            hit = self.hit_length(present, usable)
        return hit

    # ------------------------------------------------------------------ internals

    def _require_hash_block_size(self) -> int:
        if self.hash_block_size is None:
            sizes = sorted({db.hash_block_size for db in self.databases})
            raise ValueError(f"lookup: the KV-cache groups disagree on hash_block_size {sizes}; one hash chain "
                             "feeds every group, so they must share it")
        return self.hash_block_size

    def _probe(
        self, plan: LookupPlan, g: int, hashes: Sequence[BlockHash], units: Sequence[int], count: int
    ) -> None:
        prefixes = self.prefixes[g]
        if isinstance(units, range) and isinstance(hashes, BlobBlockHashes) and hashes.hash_len:
            # A leading run of a wire blob: hand the bytes over as they are, no object per hash.
            view = memoryview(hashes.blob)[: len(units) * hashes.hash_len]
            plan.keys.extend(build_lookup_keys(prefixes, BlobBlockHashes(view, hashes.hash_len)))
        else:
            plan.keys.extend(build_lookup_keys(prefixes, [hashes[i] for i in units]))
        plan.units.append(list(units))
        plan.unit_counts.append(count)
        plan.widths.append(len(prefixes))

    def _merge_spec_groups(self) -> list[_SpecGroup]:
        merged: dict[tuple[GroupSpec, int], list[int]] = {}
        for g, (spec, bs) in enumerate(zip(self.specs, self.block_sizes, strict=True)):
            merged.setdefault((spec, bs), []).append(g)
        groups = [_SpecGroup(spec, bs, tuple(members)) for (spec, bs), members in merged.items()]
        groups.sort(key=lambda group: not group.spec.is_full_attention)  # stable: full attention first
        return groups

    def _units(self, present: Sequence[Sequence[bool]], group: _SpecGroup) -> list[bool]:
        rows = [present[g] for g in group.members]
        if len(rows) == 1:
            return list(rows[0])
        return [all(flags) for flags in zip(*rows)]

    def _find(self, present: Sequence[Sequence[bool]], group: _SpecGroup, max_length: int) -> int:
        units = self._units(present, group)
        bs, align = group.block_size, self.alignment
        hbs = self._require_hash_block_size()
        if self.partial_hash_hits:
            # Units are hash-sized; a block's own key is the unit that ends it.
            raw: list[bool] | None = units
            chunks = units[bs // hbs - 1 :: bs // hbs]
        else:
            raw, chunks = None, units
        if group.spec.is_mamba:
            return _mamba_hit(chunks, raw, bs, hbs, max_length, align)
        if group.spec.sliding_window is not None:
            return _sliding_window_hit(chunks, bs, _window_blocks(group.spec, bs), max_length, align)
        return _full_attention_hit(chunks, raw, bs, hbs, max_length, align)

    def _converge(self, present: Sequence[Sequence[bool]], max_length: int) -> int:
        groups = self._spec_groups
        if len(groups) == 1:
            return self._find(present, groups[0], max_length)
        simple_hybrid = len(groups) == 2 and groups[0].spec.is_full_attention
        full_hits: dict[int, int] = {}  # a full-attention hit only shrinks by trimming: compute it once
        hit = max_length
        while True:
            current = hit
            for index, group in enumerate(groups):
                if index in full_hits:
                    current = min(current, full_hits[index])
                    continue
                current = self._find(present, group, current)
                if group.spec.is_full_attention:
                    full_hits[index] = current
            if current >= hit:
                return hit
            hit = current
            if simple_hybrid:
                return hit

    def _partial_boundary_present(self, present: Sequence[Sequence[bool]], hit: int) -> bool:
        first = self._spec_groups[0]
        if not self.partial_hash_hits or not first.spec.is_full_attention:
            return True
        unit = hit // self._require_hash_block_size() - 1
        units = self._units(present, first)
        return unit < len(units) and units[unit]


def _window_blocks(spec: GroupSpec, block_size: int) -> int:
    """Blocks a sliding-window hit needs before its end: ``ceil((window - 1) / block_size)``."""
    assert spec.sliding_window is not None
    return -(-(spec.sliding_window - 1) // block_size)


def _full_attention_hit(
    chunks: Sequence[bool], raw: Sequence[bool] | None, bs: int, hbs: int, max_length: int, alignment: int
) -> int:
    """The leading run of present blocks; with hash-sized units, extended into the first missing block by its
    highest present interior boundary (a stored partial tail)."""
    limit = min(max_length // bs, len(chunks))
    full = 0
    while full < limit and chunks[full]:
        full += 1
    hit = full * bs
    if raw is not None and bs > hbs:
        scale = bs // hbs
        first = full * scale
        top = min(first + scale - 1, max_length // hbs, len(raw))
        for unit in range(top - 1, first - 1, -1):
            if raw[unit]:
                hit = (unit + 1) * hbs
                break
    return hit - hit % alignment


def _mamba_hit(
    chunks: Sequence[bool], raw: Sequence[bool] | None, bs: int, hbs: int, max_length: int, alignment: int
) -> int:
    """The last stored state at or below ``max_length``: only the state at the hit's end is needed."""
    if raw is not None and bs > hbs:
        for unit in range(min(max_length // hbs, len(raw)) - 1, -1, -1):
            if raw[unit]:
                return (unit + 1) * hbs
        return 0
    for chunk in range(min(max_length // bs, len(chunks)) - 1, -1, -1):
        if chunks[chunk] and (chunk + 1) * bs % alignment == 0:
            return (chunk + 1) * bs
    return 0


def _sliding_window_hit(chunks: Sequence[bool], bs: int, needed: int, max_length: int, alignment: int) -> int:
    """The highest aligned end preceded by ``needed`` present blocks (or by present blocks back to the start)."""
    run = 0
    for chunk in range(min(max_length // bs, len(chunks)) - 1, -1, -1):
        if not chunks[chunk]:
            run = 0
            continue
        if run == 0 and (chunk + 1) * bs % alignment:
            continue  # a hit must end on an aligned boundary
        run += 1
        if run >= needed:
            return (chunk + run) * bs
    return run * bs

