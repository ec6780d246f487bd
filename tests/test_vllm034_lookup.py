"""The plugin's ``MooncakeStoreWorker.lookup`` on vLLM 0.34 against vLLM 0.34's own (imported, never copied).

Twin stand-in workers (what the lookup reads: vLLM's coordinator, token databases with Store chunks, lookup
prefixes per group and rank namespace, the store, the record callback, vLLM's ``_longest_hit`` and
``_tail_key_boundaries``, a selective lease or none) over generated group mixes (full attention, sliding window,
Mamba), block-granular and partial-hash lookups, stores missing keys inside a block (the page-prefix rule),
stores that answer oddly or raise, and selective-lease rounds with keys evicted between probe and lease: every
result, every store call, every record and every exception must be equal.
"""

from __future__ import annotations

import logging
import math
import random
import types
from typing import Any
from unittest import mock

import numpy as np
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_release("0.34")]

torch = pytest.importorskip("torch")
worker_module: Any = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker")

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import (  # noqa: E402
    coordinator as coordinator_module,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import data as data_module  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import layout as layout_module  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import (  # noqa: E402
    selective_lease as lease_module,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from mooncake_kvaddr.integrations.vllm import lookup as lookup_module  # noqa: E402
from mooncake_kvaddr.integrations.vllm import plugin  # noqa: E402
from mooncake_kvaddr.integrations.vllm.registry import original_of  # noqa: E402
from mooncake_kvaddr.integrations.vllm.releases import v0_34  # noqa: E402

WORKER = worker_module.MooncakeStoreWorker
ORIGINAL = original_of(WORKER, "lookup")
LOOKUPS = 10_000

#: How a store answers an existence call: vLLM's list, or forms vLLM reads item by item, or raising.
#: ``once``: a key repeated in one call is present only the first time (a repeated hash then differs by position).
FORMS = ("list",) * 10 + ("raise", "mock", "short", "long", "numpy", "tuple", "floats", "bools", "negative", "once",
                          "once")  # fmt: skip


class Store:
    """Keys present in a set; records every call; evicts keys after a call from its own seeded generator (so
    twins asked the same calls evict the same keys); answers in ``form``."""

    def __init__(self, present: set[str], form: str, evict_seed: int, evict: float) -> None:
        self.present = set(present)
        self.form = form
        self.rng = random.Random(evict_seed)
        self.evict = evict
        self.calls: list[tuple[str, list[str]]] = []

    def _answer(self, name: str, keys: Any) -> Any:
        keys = list(keys)
        self.calls.append((name, keys))
        codes = [1 if k in self.present else 0 for k in keys]
        if self.evict:
            self.present = {k for k in sorted(self.present) if self.rng.random() >= self.evict}
        form = self.form
        if form == "raise":
            raise RuntimeError("store down")
        if form == "mock":
            return mock.MagicMock()
        if form == "short":
            return codes[:-1]
        if form == "long":
            return [*codes, 1, 1]
        if form == "numpy":
            return np.asarray(codes, dtype=np.int32)
        if form == "tuple":
            return tuple(codes)
        if form == "floats":
            return [float(c) for c in codes]
        if form == "bools":
            return [c == 1 for c in codes]
        if form == "negative":
            return [c if c else -704 for c in codes]
        if form == "once":
            return [c if k not in keys[:i] else 0 for i, (k, c) in enumerate(zip(keys, codes))]
        return codes

    def batch_is_exist(self, keys: Any) -> Any:
        return self._answer("batch_is_exist", keys)

    def batch_probe_key(self, keys: Any) -> Any:
        return self._answer("batch_probe_key", keys)


def _spec(rng: random.Random, kind: str, block: int) -> Any:
    if kind == "mamba":
        return MambaSpec(block_size=block, shapes=((1,),), dtypes=(torch.float16,), mamba_cache_mode="align")
    if kind == "window":
        return SlidingWindowSpec(block_size=block, num_kv_heads=1, head_size=8, dtype=torch.float16,
                                 sliding_window=block * rng.randint(1, 3))  # fmt: skip
    return FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=8, dtype=torch.float16)


class TailDroppingCoordinator(coordinator_module.MooncakeStoreCoordinator):  # type: ignore[misc]
    """vLLM's coordinator whose load masks leave one group's last block unloaded (as it may for a sliding-window
    or Mamba tail): the tail boundaries must be computed with the masks of the very hit they describe."""

    def find_longest_cache_hit(self, *args: Any, **kwargs: Any) -> Any:
        masks, hit = super().find_longest_cache_hit(*args, **kwargs)
        dropped = hit % len(masks) if masks else 0
        if masks and masks[dropped]:
            masks = tuple([*m[:-1], False] if g == dropped else m for g, m in enumerate(masks))
        return masks, hit


class Case:
    """One generated worker configuration, its hashes and a store's contents."""

    def __init__(self, rng: random.Random) -> None:
        while True:
            self.hbs = rng.choice([4, 8, 16])
            self.drop_tail = rng.random() < 0.2
            self.fine = rng.random() < 0.35
            self.eagle = rng.random() < 0.15  # Eagle's last-block drop
            count = rng.choice([1, 1, 2, 2, 3])
            kinds = ["full"] + [rng.choice(["full", "window", "mamba"]) for _ in range(count - 1)]
            rng.shuffle(kinds)
            blocks = [self.hbs * rng.choice([1, 2, 4]) for _ in kinds]
            if rng.random() < 0.3:  # the headline's shape: full attention only, a block a hash block (at most)
                kinds = ["full"] * min(count, 2)
                blocks = [self.hbs] * len(kinds)
            self.groups = [KVCacheGroupSpec([f"layer.{g}"], _spec(rng, k, b)) for g, (k, b) in enumerate(zip(kinds,
                                                                                                           blocks))]
            # Store chunks: whole hash blocks dividing the group's block.
            self.chunks = [rng.choice([c for c in (b, b // 2, b // 4) if c >= self.hbs and c % self.hbs == 0])
                           for b in blocks]  # fmt: skip
            self.blocks = blocks
            try:
                # The scheduler block: the blocks' least common multiple, or twice it (hits round down to it).
                self.coord_args = (self.groups, math.lcm(*blocks) * rng.choice([1, 1, 2]), self.hbs)
                self.coordinator()
            except (AssertionError, ValueError, NotImplementedError):
                continue
            break
        # Rank namespaces: one to four lookup prefixes per group.
        self.prefixes = tuple(
            tuple(f"m@{g}@tp{r}@pcp0@dcp0@pp0@c{self.chunks[g]}" for r in range(rng.randint(1, 4)))
            for g in range(len(self.groups))
        )
        self.n_hashes = rng.randint(0, 24)
        self.hashes = [rng.randbytes(rng.choice([8, 32])) for _ in range(self.n_hashes)]
        if self.hashes and rng.random() < 0.1:
            self.hashes[rng.randrange(self.n_hashes)] = self.hashes[0]  # a repeated hash
        every = [f"{p}@{h.hex()}" for ps in self.prefixes for p in ps for h in self.hashes]
        style = rng.random()
        if style < 0.4:  # a stored prefix, then a few holes (holes inside a block: the page-prefix rule)
            cut = rng.randint(0, len(self.hashes))
            keep = {h.hex() for h in self.hashes[:cut]}
            self.present = {k for k in every if k.rsplit("@", 1)[1] in keep and rng.random() > 0.04}
        else:
            density = rng.choice([0.5, 0.85, 0.97, 1.0])
            self.present = {k for k in every if rng.random() < density}

    def coordinator(self) -> Any:
        cls = TailDroppingCoordinator if self.drop_tail else coordinator_module.MooncakeStoreCoordinator
        return cls(*self.coord_args, enable_partial_hash_hits=self.fine, use_eagle=self.eagle)

    def worker(self, store: Store, lease: bool) -> tuple[Any, list[Any]]:
        """A stand-in with what vLLM 0.34's lookup reads, and the list its records go to."""
        records: list[Any] = []
        metadata = layout_module.KeyMetadata("m", 0, 0, 0, 0)
        dbs = [
            data_module.ChunkedTokenDatabase(
                metadata, chunk_size=c, hash_block_size=self.hbs,
                store_layout=layout_module.RankLocalStoreLayout(metadata, b, self.hbs),
            )
            for b, c in zip(self.blocks, self.chunks)
        ]  # fmt: skip
        stub = types.SimpleNamespace(
            _capacity_only=False,
            coord=self.coordinator(),
            token_dbs=dbs,
            _kv_cache_groups=self.groups,
            _lookup_key_prefixes=self.prefixes,
            hash_block_size=self.hbs,
            store=store,
            _selective_lease=None,
            _record_kv_connector_operation=lambda op, _s, n, **kw: records.append((op, n, sorted(kw.items()))),
        )
        for helper in ("_longest_hit", "_tail_key_boundaries"):
            setattr(stub, helper, types.MethodType(getattr(WORKER, helper), stub))
        if lease:
            stub._selective_lease = lease_module.SelectiveLookupLease(
                store, dbs, self.groups, self.prefixes, stub._record_kv_connector_operation
            )
        return stub, records


def _run(func: Any, stub: Any, num_tokens: int, hashes: Any) -> Any:
    try:
        return ("ok", func(stub, num_tokens, hashes))
    except Exception as exc:
        return ("raised", type(exc).__name__)


@pytest.fixture(scope="module")
def ours() -> Any:
    return lookup_module.make_lookup(ORIGINAL, worker_module, v0_34.LOOKUP_RULES)


def test_lookup_matches_vllm_034(ours: Any) -> None:
    rng = random.Random(2034)
    compared = 0
    seen = {"forms": set(), "fine": set(), "lease": set(), "hit": 0, "page_rule": 0, "evicted": 0, "groups": set()}
    quiet = [worker_module.logger, lease_module.logger]
    for log in quiet:
        log.disabled = True
    try:
        while compared < LOOKUPS:
            case = Case(rng)
            form = rng.choice(FORMS)
            lease = rng.random() < 0.3
            evict = rng.choice([0.0, 0.0, 0.05, 0.3]) if lease else 0.0
            seed = rng.randrange(1 << 30)
            seen["forms"].add(form)
            seen["fine"].add(case.fine)
            seen["lease"].add(lease)
            seen["groups"].add(len(case.groups))
            top = case.n_hashes * case.hbs + case.hbs
            for num_tokens in sorted(rng.sample(range(top), k=min(6, top))):
                twins = []
                for _ in range(2):
                    store = Store(case.present, form, seed, evict)
                    twins.append((*case.worker(store, lease), store))
                (theirs, their_records, their_store), (mine, my_records, my_store) = twins
                expected = _run(ORIGINAL, theirs, num_tokens, case.hashes)
                got = _run(ours, mine, num_tokens, case.hashes)
                where = (case.__dict__, form, lease, evict, num_tokens)
                assert got == expected, where
                assert my_store.calls == their_store.calls, where
                assert my_records == their_records, where
                compared += 1
                if expected[0] == "ok" and expected[1].hit_length > 0:
                    seen["hit"] += 1
                if lease and len(their_store.calls) > 1 and their_store.present != case.present:
                    seen["evicted"] += 1
                if _page_rule_matters(case, mine, num_tokens):
                    seen["page_rule"] += 1
    finally:
        for log in quiet:
            log.disabled = False
    assert seen["forms"] == set(FORMS) and seen["fine"] == {True, False} and seen["lease"] == {True, False}
    assert seen["groups"] == {1, 2, 3}
    assert seen["hit"] > LOOKUPS // 5 and seen["page_rule"] > 100 and seen["evicted"] > 100, seen
    assert ours.stats.fast > ours.stats.fallback
    # The hit read off the flags (one full-attention spec, a unit a block) ran often, and so did vLLM's.
    assert LOOKUPS // 20 < ours.stats.direct < ours.stats.fast // 2, ours.stats


def test_a_repeated_hash_counts_as_in_vllms_set(ours: Any) -> None:
    """One full-attention group, a unit a block (the hit read off the flags): a store that answers a key repeated
    in the call only the first time leaves the later unit absent by position, yet vLLM's set of present hashes
    counts it. The hit must still be vLLM's."""
    rng = random.Random(11)
    beyond = 0
    for _ in range(300):
        case = Case.__new__(Case)
        case.hbs, case.drop_tail, case.fine, case.eagle = 8, False, False, False
        case.blocks, case.chunks = [8], [8]
        case.groups = [KVCacheGroupSpec(["layer.0"], _spec(rng, "full", 8))]
        case.coord_args = (case.groups, 8, 8)
        case.prefixes = (tuple(f"m@0@tp{r}" for r in range(rng.randint(1, 3))),)
        n = rng.randint(2, 12)
        case.hashes = [rng.randbytes(8) for _ in range(n)]
        later = rng.randrange(1, n)
        case.hashes[later] = case.hashes[rng.randrange(later)]
        case.present = {f"{p}@{h.hex()}" for p in case.prefixes[0] for h in case.hashes}
        stores = [Store(case.present, "once", 0, 0.0) for _ in range(2)]
        expected = _run(ORIGINAL, case.worker(stores[0], False)[0], n * 8 + 1, case.hashes)
        assert _run(ours, case.worker(stores[1], False)[0], n * 8 + 1, case.hashes) == expected, case.__dict__
        beyond += expected[1].hit_length > later * 8
    assert beyond > 100, beyond


def _page_rule_matters(case: Case, stub: Any, num_tokens: int) -> bool:
    """True when the page-prefix rule dropped a unit whose own keys were all present."""
    token_len = stub.coord.align_lookup_length(num_tokens)
    if not case.hashes or token_len <= 0:
        return False
    plan = v0_34.plan_lookup(stub, token_len, case.hashes, worker_module.cdiv)
    answers = [1 if k in case.present else 0 for k in plan.key_list()]
    with_rule = plan.present(answers)
    plan.pages = None
    return plan.present(answers) != with_rule


def test_plan_lists_exactly_vllms_candidate_keys() -> None:
    rng = random.Random(5)
    for _ in range(300):
        case = Case(rng)
        store = Store(case.present, "list", 0, 0.0)
        stub, _ = case.worker(store, False)
        num_tokens = rng.randint(1, case.n_hashes * case.hbs + case.hbs)
        _run(ORIGINAL, stub, num_tokens, case.hashes)
        token_len = stub.coord.align_lookup_length(num_tokens)
        if not case.hashes or token_len <= 0:
            assert store.calls == []
            continue
        keys = v0_34.plan_lookup(stub, token_len, case.hashes, worker_module.cdiv).key_list()
        assert [("batch_is_exist", keys)] == store.calls or (not keys and not store.calls)


def test_page_prefix_rule_against_a_loop() -> None:
    """The vectorised rule against the rule written as a loop: a unit counts when present and every chunk end
    before it in its block's run was present."""
    rng = random.Random(9)
    for _ in range(2000):
        n = rng.randint(1, 30)
        pages = sorted(rng.randrange(0, 8) for _ in range(n))
        closes = [rng.random() < 0.6 for _ in range(n)]
        present = [rng.random() < 0.7 for _ in range(n)]
        expected = []
        ok, last = True, None
        for page, close, here in zip(pages, closes, present):
            if page != last:
                ok, last = True, page
            expected.append(ok and here)
            if close:
                ok = ok and here
        got = lookup_module.page_prefix(np.array(present), np.array(pages), np.array(closes)).tolist()
        assert got == expected, (pages, closes, present)


def test_patch_on_034_replaces_the_lookup() -> None:
    plugin.unpatch()
    try:
        report = plugin.patch(receive=False, send=False)
        assert "MooncakeStoreWorker.lookup" in report.patched and report.lookup_reason == "", report
        assert WORKER.__dict__["lookup"].__wrapped__ is ORIGINAL
    finally:
        plugin.unpatch()
    assert WORKER.__dict__["lookup"] is ORIGINAL


def test_a_hit_rule_vllm_changed_goes_to_vllms_coordinator(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The hit read off the flags reproduces ``FullAttentionManager.find_longest_cache_hit`` (the coordinator's
    one spec group): where that function is not the one checked against (here: a release that no longer rounds
    a hit down to the scheduler block), the lookup must leave the hit to vLLM's coordinator, not answer with
    the rule it copied. Since the plugin's own install (fingerprints and self-check pass: the self-check's
    scheduler block is the block) left it in place, the answer must still be vLLM's."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    own = FullAttentionManager.__dict__["find_longest_cache_hit"].__func__

    def find_longest_cache_hit(cls: Any, block_hashes: Any, max_length: int, kv_cache_group_ids: Any,
                               block_pool: Any, kv_cache_spec: Any, drop_eagle_block: bool, alignment_tokens: int,
                               dcp_world_size: int = 1, pcp_world_size: int = 1) -> Any:  # fmt: skip
        return own(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec, drop_eagle_block,
                   kv_cache_spec.block_size, dcp_world_size, pcp_world_size)  # fmt: skip

    monkeypatch.setattr(FullAttentionManager, "find_longest_cache_hit", classmethod(find_longest_cache_hit))
    with caplog.at_level(logging.WARNING, "vllm.mooncake_kvaddr"):
        changed = lookup_module.make_lookup(ORIGINAL, worker_module, v0_34.LOOKUP_RULES)
    assert "FullAttentionManager.find_longest_cache_hit is not the function" in caplog.text
    rng = random.Random(3)
    case = Case.__new__(Case)
    case.hbs, case.drop_tail, case.fine, case.eagle = 16, False, False, False
    case.blocks, case.chunks = [16], [16]
    case.groups = [KVCacheGroupSpec(["layer.0"], _spec(rng, "full", 16))]
    case.coord_args = (case.groups, 32, 16)  # a scheduler block of two blocks: hits round down to it
    case.prefixes = (("m@0@tp0",),)
    case.hashes = [rng.randbytes(32) for _ in range(6)]
    case.present = {f"m@0@tp0@{h.hex()}" for h in case.hashes[:3]}  # three blocks present: 48 tokens
    expected = _run(ORIGINAL, case.worker(Store(case.present, "list", 0, 0.0), False)[0], 97, case.hashes)
    assert expected[0] == "ok" and expected[1].hit_length == 48  # vLLM's changed rule: not rounded to 32
    got = _run(changed, case.worker(Store(case.present, "list", 0, 0.0), False)[0], 97, case.hashes)
    assert got == expected
    assert changed.stats.direct == 0
