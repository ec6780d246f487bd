"""The value types of store lookup (docs/lookup.md): the parallel layout, the group specs, the store and prefix
protocols, and one lookup's plan and answer. They stand apart from
:class:`~mooncake_kvaddr.driver.lookup.StoreLookup` so that the lookup reads as one module;
:mod:`mooncake_kvaddr.driver.lookup` re-exports every name here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from mooncake_kvaddr.core.keys import SpecKind, reduce_exists
from mooncake_kvaddr.core.metadata import TailKeyBoundary
from mooncake_kvaddr.driver.store import BatchResult

__all__ = [
    "MAMBA_CACHE_MODES",
    "MAX_NAMESPACES",
    "BoolArray",
    "ExistenceStore",
    "GroupSpec",
    "GroupSpecLike",
    "IntArray",
    "KindLike",
    "LookupPlan",
    "LookupPrefixSource",
    "LookupResult",
    "ParallelLayout",
    "Presence",
]

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
