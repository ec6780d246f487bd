"""A replacement for vLLM's ``MooncakeStoreWorker.lookup`` (docs/vllm-plugin.md, "The lookup").

The candidate keys are built natively per KV-cache group (one UTF-8 blob for the native client, else the list of
str vLLM builds) instead of one Python str per key. The tail boundaries stay vLLM's code, and so does the hit,
except where the release reads it off the answers (:class:`DirectHit`). Which units are asked for and how answers
count differ per release: a :class:`LookupRules` from the release module.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import random
import threading
import time
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from mooncake_kvaddr import _native
from mooncake_kvaddr.core.flags import flag
from mooncake_kvaddr.driver.native_client import KeyBlob
from mooncake_kvaddr.driver.rules import floor_to
from mooncake_kvaddr.integrations.vllm.plans import finish_handler
from mooncake_kvaddr.integrations.vllm.receive_check import quiet_thread
from mooncake_kvaddr.integrations.vllm.registry import signature_problem
from mooncake_kvaddr.integrations.vllm.transports import TRANSPORT_ATTR

__all__ = [
    "ENV_LOOKUP",
    "POOL_FUNCTIONS",
    "RULES_033",
    "DirectHit",
    "LookupRules",
    "LookupStats",
    "LookupUnits",
    "check_shape",
    "lookup_enabled",
    "make_lookup",
    "plan_lookup",
    "self_check",
]

#: Set to ``0``/``false``/``off``/``no`` to keep vLLM's own ``MooncakeStoreWorker.lookup``.
ENV_LOOKUP = "MOONCAKE_KVADDR_VLLM_LOOKUP"

_EXPECTED_PARAMS = ("num_tokens", "block_hashes")
#: Names ``MooncakeStoreWorker.lookup`` resolves in its module; ours takes the same objects from there.
_MODULE_NAMES = ("MooncakeLookupResult", "ExternalCachedBlockPool", "cdiv", "logger")
#: The functions of vLLM's block pool that our faster pool (:func:`fast_pool_class`) stands in for, alike in
#: every release (in a release's ``FINGERPRINTED["lookup"]``).
POOL_FUNCTIONS = tuple(f"ExternalCachedBlockPool.{name}" for name in ("__init__", "get_cached_block", "contains"))


def lookup_enabled(environ: Mapping[str, str]) -> bool:
    """False when :data:`ENV_LOOKUP` turns the replacement off (on by default with the plugin), or spells
    neither on nor off (one warning naming it)."""
    return flag(environ.get(ENV_LOOKUP), True, ENV_LOOKUP, or_off="vllm.mooncake_kvaddr")


def check_shape(worker: ModuleType, rules: LookupRules | None = None) -> str:
    """Empty string when vLLM's worker module has the lookup this module replaces, with the helpers the release's
    lookup calls (``rules``, 0.32/0.33's by default); else the first mismatch."""
    rules = rules or RULES_033
    cls = worker.__dict__.get("MooncakeStoreWorker")
    if not isinstance(cls, type):
        return "MooncakeStoreWorker is missing"
    problem = signature_problem(cls, "lookup", _EXPECTED_PARAMS)
    if problem:
        return problem
    for helper in rules.helpers:
        if not callable(inspect.getattr_static(cls, helper, None)):
            return f"MooncakeStoreWorker.{helper} is missing"
    for name in _MODULE_NAMES:
        if worker.__dict__.get(name) is None:
            return f"{worker.__name__}.{name} is missing"
    return ""


@dataclass
class LookupStats:
    """Counters of the replacement lookup: by our plan, by vLLM's method, hits read off the flags
    (:class:`DirectHit`), and store calls with a key blob."""

    fast: int = 0
    fallback: int = 0
    direct: int = 0
    blob_calls: int = 0
    reasons: dict[str, int] = field(default_factory=dict)


@dataclass
class LookupUnits:
    """What one vLLM lookup asks the store (the driver's lookup has its own ``lookup_types.LookupPlan``): per
    prefix-cacheable group, its unit hashes and key prefixes; with ``pages`` (vLLM 0.34), per group each unit's
    physical block and whether it ends a Store chunk, for the page-prefix rule (a unit counts only when every
    chunk before it in its block was present; None where a unit is a whole block: every flag kept)."""

    groups: list[tuple[int, list[Any], tuple[str, ...]]]
    pages: list[tuple[Any, Any] | None] | None = None
    #: Per group, after :meth:`present`: each unit's flag (page-prefix rule applied), in lookup order.
    kept: dict[int, list[bool]] = field(default_factory=dict)

    @property
    def key_count(self) -> int:
        return sum(len(hashes) * len(prefixes) for _, hashes, prefixes in self.groups)

    def key_list(self) -> list[str]:
        """The keys in vLLM's order (per group, per unit, per prefix), as str."""
        keys: list[str] = []
        for _, hashes, prefixes in self.groups:
            keys.extend(_native.build_lookup_keys(prefixes, hashes))
        return keys

    def key_blob(self) -> KeyBlob:
        """The same keys as one UTF-8 blob cut at int64 offsets (the native client's form)."""
        parts = [_native.lookup_key_blob(prefixes, hashes) for _, hashes, prefixes in self.groups]
        if len(parts) == 1:
            return KeyBlob(*parts[0])
        shift = 0
        cuts = [np.zeros(1, np.int64)]
        for blob, offsets in parts:
            cuts.append(offsets[1:] + shift)
            shift += len(blob)
        return KeyBlob(b"".join(blob for blob, _ in parts), np.concatenate(cuts))

    def present(self, results: Any) -> dict[int, set[bytes]]:
        """Per group, the hash bytes of the units whose every prefix answered exactly 1 (vLLM's rule), and with
        ``pages`` only those whose block's earlier chunks were present too."""
        widths: list[int] = []
        for _, hashes, prefixes in self.groups:
            widths += [len(prefixes)] * len(hashes)
        try:
            flags: Any = _native.reduce_exists(results, widths)
        except (TypeError, ValueError, OverflowError):
            flags = self._flags_by_items(results)  # not a list of ints of the right length: vLLM's loop
        found: dict[int, set[bytes]] = {}
        start = 0
        for i, (g, hashes, _) in enumerate(self.groups):
            units = found.setdefault(g, set())
            kept = flags[start : start + len(hashes)]
            page = self.pages[i] if self.pages is not None else None
            if page is not None and kept:
                kept = page_prefix(np.asarray(kept, dtype=bool), *page).tolist()
            self.kept[g] = kept
            units.update(map(bytes, itertools.compress(hashes, kept)))
            start += len(hashes)
        return found

    def leading_run(self, group_ids: Sequence[int], units: int, found: Mapping[int, set[bytes]]) -> int | None:
        """After :meth:`present`: how many units from the start every group of ``group_ids`` has (the hit
        vLLM's coordinator finds when a unit is a block), or None where these flags cannot tell: a group not
        planned unit by unit, or a unit absent here whose hash is present elsewhere in the group (a repeated
        hash: vLLM's set of hashes counts it present)."""
        run = units
        hashes_of = {g: hashes for g, hashes, _ in self.groups}
        for g in group_ids:
            kept = self.kept.get(g)
            if kept is None or len(kept) != units:
                return None
            try:
                first = kept.index(False)
            except ValueError:
                first = units
            if first < units and bytes(hashes_of[g][first]) in found.get(g, ()):
                return None
            run = min(run, first)
        return run

    def _flags_by_items(self, results: Any) -> list[bool]:
        # Item by item, as vLLM reads them: the same answers and the same exceptions for any result object.
        flags: list[bool] = []
        pos = 0
        for _, hashes, prefixes in self.groups:
            count = len(prefixes)
            for _h in hashes:
                flags.append(all(results[pos + j] == 1 for j in range(count)))
                pos += count
        return flags


def page_prefix(present: Any, pages: Any, closes: Any) -> Any:
    """vLLM 0.34's page-prefix rule over one group's units in lookup order: a unit counts when it is present and
    no unit before it in the same run of its physical block (``pages``) that ends a Store chunk (``closes``)
    was absent. Boolean arrays in, one out."""
    pages = np.asarray(pages, dtype=np.int64)
    closes = np.asarray(closes, dtype=bool)
    count = len(present)
    failed = (closes & ~present).astype(np.int64)
    before = np.cumsum(failed) - failed  # absent chunk ends strictly before each unit
    starts = np.ones(count, dtype=bool)
    starts[1:] = pages[1:] != pages[:-1]
    run_start = np.maximum.accumulate(np.where(starts, np.arange(count), 0))
    result: Any = present & (before == before[run_start])
    return result


@dataclass(frozen=True)
class LookupRules:
    """What one release's ``MooncakeStoreWorker.lookup`` does its own way (the release module's record).

    ``plan(worker, token_len, block_hashes, cdiv)``: the units vLLM's lookup asks for. ``helpers``: the
    worker's methods it calls (vLLM's own, checked present). ``longest_hit``: the hit is vLLM 0.34's
    ``_longest_hit`` (tail boundaries given the load masks; the worker's ``_selective_lease``, when set,
    probes and leases as vLLM does)."""

    plan: Callable[[Any, int, Sequence[Any], Callable[[int, int], int]], LookupUnits]
    helpers: tuple[str, ...] = ("_tail_key_boundaries",)
    longest_hit: bool = False
    #: ``direct_hit(worker_module)(worker)``: the worker's :class:`DirectHit` when its coordinator's hit is the
    #: leading run of present units (one unit per block), else None (vLLM's coordinator computes it).
    direct_hit: Callable[[ModuleType], Callable[[Any], DirectHit | None]] | None = None


@dataclass(frozen=True)
class DirectHit:
    """A coordinator whose hit is the leading run of units every group of ``group_ids`` has, ``block`` tokens
    a unit, rounded down to ``align`` tokens; its masks list ``groups`` groups (present blocks True)."""

    group_ids: tuple[int, ...]
    block: int
    align: int
    groups: int

    def hit(self, run: int, max_length: int) -> tuple[tuple[list[bool], ...], int]:
        """``(masks, hit_length)`` as the coordinator returns them for ``max_length`` tokens."""
        tokens = floor_to(min(run, max_length // self.block) * self.block, self.align)
        blocks = -(-tokens // self.block)
        return tuple([True] * blocks if g in self.group_ids else [] for g in range(self.groups)), tokens


def plan_lookup(
    worker: Any, token_len: int, block_hashes: Sequence[Any], cdiv: Callable[[int, int], int]
) -> LookupUnits:
    """The units vLLM's lookup would ask for, read from the worker exactly as vLLM reads them."""
    coord = worker.coord
    fine_grained = coord.enable_partial_hash_hits
    masks = None if fine_grained else coord.lookup_mask(token_len)
    groups: list[tuple[int, list[Any], tuple[str, ...]]] = []
    for g, db in enumerate(worker.token_dbs):
        spec = worker._kv_cache_groups[g].kv_cache_spec
        if not spec.prefix_cacheable:
            continue
        prefixes = tuple(worker._lookup_key_prefixes[g])
        if fine_grained:
            limit = min(len(block_hashes), token_len // worker.hash_block_size)
            hashes = _first(block_hashes, limit)
        else:
            mask = masks[g]  # type: ignore[index]
            group_hashes = coord.block_hashes_for_spec(block_hashes, spec)
            limit = min(len(group_hashes), cdiv(token_len, db.block_size))
            if mask is None:
                hashes = _first(group_hashes, limit)
            else:
                hashes = [group_hashes[i] for i in range(min(limit, len(mask))) if mask[i]]
        groups.append((g, hashes, prefixes))
    return LookupUnits(groups)


def _first(hashes: Sequence[Any], limit: int) -> list[Any]:
    """``hashes[0:limit]`` read as vLLM reads it, item by item, except from a plain list (one slice)."""
    return hashes[:limit] if type(hashes) is list else [hashes[i] for i in range(limit)]


#: vLLM 0.32/0.33's lookup: units per group from ``block_hashes_for_spec``, masks per unit, no page rule.
RULES_033 = LookupRules(plan=plan_lookup)


def _native_transport(worker: Any) -> Any:
    """The worker's native-client wrapper when its native client is live, else None (vLLM's store is used).
    Chosen by our own types: the pair our worker hook stored, around the very store the worker holds."""
    from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore
    from mooncake_kvaddr.integrations.vllm.staged_store import StagedMooncakeStore

    pair = getattr(worker, "__dict__", {}).get(TRANSPORT_ATTR)
    if not isinstance(pair, tuple) or len(pair) != 2 or pair[0] is not worker.store:
        return None
    transport = pair[1]
    if isinstance(transport, StagedMooncakeStore):
        transport = transport.wrapped
    if isinstance(transport, NativeMooncakeStore) and transport.native_client is not None:
        return transport
    return None


def fast_pool_class(pool_cls: type) -> type:
    """vLLM's ``ExternalCachedBlockPool`` over per-group sets of hash bytes instead of one set of
    ``(group, hash)`` tuples, answering ``get_cached_block`` and ``contains`` as vLLM's do: vLLM's coordinator
    asks it once per block, twice per lookup on a full hit. The fingerprints of vLLM's ``__init__``,
    ``get_cached_block`` and ``contains`` (what this class stands in for) are checked before it is used."""

    class FastPool(pool_cls):  # type: ignore[misc]
        def __init__(self, hash_block_size: int, units: dict[int, set[bytes]]) -> None:
            super().__init__(hash_block_size, set())  # vLLM's own set stays empty: nothing of vLLM reads it here
            self._units = units

        def get_cached_block(self, block_hash: Any, group_ids: list[int]) -> Any:
            key = block_hash if type(block_hash) is bytes else bytes(block_hash)
            if len(group_ids) == 1:  # the common case, without the loop
                found = self._units.get(group_ids[0])
                return [self._present_block] if found is not None and key in found else None
            for g in group_ids:
                found = self._units.get(g)
                if found is None or key not in found:
                    return None
            return [self._present_block] * len(group_ids)

        def contains(self, group_id: int, block_hash: Any) -> bool:
            found = self._units.get(group_id)
            return found is not None and bytes(block_hash) in found

    FastPool.__qualname__ = FastPool.__name__ = f"Fast{pool_cls.__name__}"
    return FastPool


def make_lookup(
    original: Callable[..., Any], worker_module: ModuleType, rules: LookupRules | None = None
) -> Callable[..., Any]:
    """The replacement ``MooncakeStoreWorker.lookup`` under the release's ``rules`` (0.32/0.33's by default);
    ``original`` is vLLM's (run for anything unusual)."""
    rules = rules or RULES_033
    plan_units = rules.plan
    with_masks = rules.longest_hit
    result_cls = worker_module.MooncakeLookupResult
    pool_cls = fast_pool_class(worker_module.ExternalCachedBlockPool)
    cdiv = worker_module.cdiv
    log = worker_module.logger
    direct_of = rules.direct_hit(worker_module) if rules.direct_hit is not None else None
    stats = LookupStats()
    lock = threading.Lock()

    def fallback(self: Any, num_tokens: int, block_hashes: Any, why: str) -> Any:
        with lock:
            stats.fallback += 1
            stats.reasons[why] = stats.reasons.get(why, 0) + 1
        return original(self, num_tokens, block_hashes)

    def lookup(self: Any, num_tokens: int, block_hashes: Any) -> Any:
        """mooncake_kvaddr's lookup (docs/vllm-plugin.md, "The lookup")."""
        if self._capacity_only:
            return fallback(self, num_tokens, block_hashes, "capacity-only worker")
        token_len = self.coord.align_lookup_length(num_tokens)
        if not block_hashes or token_len <= 0:
            return result_cls(0)
        lease = getattr(self, "_selective_lease", None) if with_masks else None
        try:
            plan = plan_units(self, token_len, block_hashes, cdiv)
            n_keys = plan.key_count
            transport = _native_transport(self) if n_keys and lease is None else None
            keys: Any = plan.key_blob() if transport is not None else plan.key_list()
            direct = direct_of(self) if direct_of is not None and lease is None else None
        except Exception as exc:  # vLLM's method raises its own error, or accepts what we refuse
            return fallback(self, num_tokens, block_hashes, f"planning raised {type(exc).__name__}")
        with lock:
            stats.fast += 1
            stats.blob_calls += transport is not None
        if not n_keys:
            return result_cls(0)
        # vLLM 0.34's selective lease probes lease-free through its own object (Mooncake's batch_probe_key).
        exists = lease.probe if lease is not None else (transport or self.store).batch_is_exist
        started = time.perf_counter()
        try:
            results = exists(keys)
            self._record_kv_connector_operation("lookup_exists", time.perf_counter() - started, n_keys)
        except Exception as e:
            self._record_kv_connector_operation(
                "lookup_exists", time.perf_counter() - started, n_keys, status="error", num_failed_keys=n_keys
            )
            log.error("Remote connection failed in lookup: %s", e)
            return result_cls(0)
        found = plan.present(results)
        if lease is not None:
            # vLLM's own hit and lease rounds, over the (group, hash) pairs its lookup would have found.
            pairs = {(g, h) for g, units in found.items() for h in units}
            hit, masks = self._longest_hit(num_tokens, token_len, block_hashes, pairs)
            longest = functools.partial(self._longest_hit, num_tokens, token_len, block_hashes)
            return lease.lease_hit(block_hashes, hit, masks, pairs, longest)
        pool = pool_cls(self.hash_block_size, found)
        run = None
        if direct is not None:
            run = plan.leading_run(direct.group_ids, min(token_len // direct.block, len(block_hashes)), found)
        if run is not None:
            assert direct is not None
            find: Callable[[int], Any] = functools.partial(direct.hit, run)
            with lock:
                stats.direct += 1
        else:

            def find(length: int) -> Any:
                return self.coord.find_longest_cache_hit(block_hashes, length, pool)

        masks, hit = find(token_len)
        if hit >= num_tokens:
            # A full hit is cut below the request's end: its last token is computed again for sampling.
            usable = self.coord.align_lookup_length(num_tokens - 1)
            if usable <= 0:
                return result_cls(0)
            masks, hit = find(usable)
        given = (masks,) if with_masks else ()  # vLLM 0.34's _longest_hit passes the load masks
        return result_cls(hit, self._tail_key_boundaries(block_hashes, hit, pool, *given))

    return finish_handler(lookup, original, "MooncakeStoreWorker.lookup", stats)


# --- the self-check ------------------------------------------------------------------------------------------


class _Recorder:
    """A store answering ``batch_is_exist`` from a set of keys, recording what it was asked."""

    def __init__(self, present: set[str], fail: bool) -> None:
        self.present = present
        self.fail = fail
        self.asked: list[list[str]] = []

    def batch_is_exist(self, keys: Any) -> list[int]:
        self.asked.append(list(keys))
        if self.fail:
            raise RuntimeError("self-check: store down")
        return [1 if k in self.present else 0 for k in self.asked[-1]]


def _stand_in(worker_module: ModuleType, coord: Any, groups: list[Any], dbs: list[Any], prefixes: Any, hbs: int,
              store: Any, records: list[Any], helpers: tuple[str, ...] = ("_tail_key_boundaries",)) -> Any:  # fmt: skip
    stub = types.SimpleNamespace(
        _capacity_only=False,
        _selective_lease=None,
        coord=coord,
        token_dbs=dbs,
        _kv_cache_groups=groups,
        _lookup_key_prefixes=prefixes,
        hash_block_size=hbs,
        store=store,
        _record_kv_connector_operation=lambda op, _s, n, **kw: records.append((op, n, sorted(kw.items()))),
    )
    for helper in helpers:
        setattr(stub, helper, types.MethodType(getattr(worker_module.MooncakeStoreWorker, helper), stub))
    return stub


def self_check(worker_module: ModuleType, lookup: Callable[..., Any], *, seed: int = 0, cases: int = 8,
               rules: LookupRules | None = None) -> None:  # fmt: skip
    """vLLM's own lookup and ``lookup`` on small generated requests (one or two full-attention groups, coarse and
    fine-grained, partial stores, a failing store; Store chunks of half a block where the release's ``rules``
    have them): equal results, store calls and records, else ``AssertionError``."""
    rules = rules or RULES_033
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import MooncakeStoreCoordinator
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    original = getattr(lookup, "__wrapped__", None) or worker_module.MooncakeStoreWorker.lookup
    rng = random.Random(seed)
    with quiet_thread(worker_module.logger):  # the failing-store case logs vLLM's error line: not at start-up
        for case in range(cases):
            hbs = 16
            sizes = [hbs * rng.choice((1, 2))] + ([hbs * 2] if case % 2 else [])
            groups = [
                KVCacheGroupSpec([f"layer.{g}"], FullAttentionSpec(block_size=b, num_kv_heads=1, head_size=8,
                                                                   dtype=torch.float16))
                for g, b in enumerate(sizes)
            ]  # fmt: skip
            fine = case % 4 == 3
            prefixes = tuple(
                tuple(f"self-check/g{g}/r{r}" for r in range(rng.randint(1, 3))) for g in range(len(sizes))
            )
            hashes = [rng.randbytes(8) for _ in range(rng.randint(1, 12))]
            every = [f"{p}@{h.hex()}" for ps in prefixes for p in ps for h in hashes]
            present = {k for k in every if rng.random() < 0.85}
            num_tokens = rng.randint(1, len(hashes) * hbs + 8)
            # Store chunks (0.34): half a block where that is whole hash blocks, so the page-prefix rule applies.
            chunks = [b // 2 if rules.longest_hit and b > hbs and case % 3 else b for b in sizes]
            outcomes = []
            for func in (original, lookup):
                coord = MooncakeStoreCoordinator(groups, max(sizes), hbs, enable_partial_hash_hits=fine)
                store = _Recorder(present, fail=case == cases - 1)
                records: list[Any] = []
                dbs = [types.SimpleNamespace(block_size=b, chunk_size=c) for b, c in zip(sizes, chunks)]
                stub = _stand_in(worker_module, coord, groups, dbs, prefixes, hbs, store, records, rules.helpers)
                try:
                    got: Any = func(stub, num_tokens, hashes)
                except Exception as exc:
                    got = type(exc)
                outcomes.append((got, store.asked, records))
            if outcomes[0] != outcomes[1]:
                raise AssertionError(f"lookup self-check case {case}: vLLM {outcomes[0]!r}, ours {outcomes[1]!r}")
