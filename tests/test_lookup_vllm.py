"""Lookup against vLLM 0.33's own worker lookup (imported, never copied), on generated group mixes and stores.

vLLM's ``MooncakeStoreWorker.lookup`` runs unchanged on a stand-in worker that carries only what the method
reads (its coordinator, block sizes, lookup prefixes and the fake store). Checked:

* :meth:`StoreLookup.lookup_with_boundaries` equals vLLM's ``MooncakeLookupResult`` (hit and tail
  boundaries) exactly;
* :meth:`StoreLookup.lookup` (a loader that keys the cut block at the hit) never exceeds vLLM's hit, and
  equals it in coarse mode, where every key is a whole block's.
"""

from __future__ import annotations

import math
import random
import types
from typing import Any

import pytest

from test_lookup_model import DictStore, Scenario, build, fill_store, hashes_for, random_scenario

pytest.importorskip("torch")
pytest.importorskip("vllm")

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
    MooncakeStoreCoordinator,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import MooncakeStoreWorker
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from mooncake_kvaddr.driver.lookup import StoreLookup


def vllm_worker(sc: Scenario, lookup: StoreLookup, store: DictStore) -> Any:
    """A stand-in carrying exactly what ``MooncakeStoreWorker.lookup`` reads."""
    groups = []
    for g, grp in enumerate(sc.groups):
        spec: Any
        if grp.kind == "mamba":
            spec = MambaSpec(block_size=grp.block_size, shapes=((1,),), dtypes=(torch.float16,),
                             mamba_cache_mode=grp.mamba_mode)
        elif grp.kind == "window":
            spec = SlidingWindowSpec(block_size=grp.block_size, num_kv_heads=1, head_size=8, dtype=torch.float16,
                                     sliding_window=grp.window)
        else:
            spec = FullAttentionSpec(block_size=grp.block_size, num_kv_heads=1, head_size=8, dtype=torch.float16)
        groups.append(KVCacheGroupSpec([f"layer.{g}"], spec))
    coord = MooncakeStoreCoordinator(
        groups, math.lcm(*(grp.block_size for grp in sc.groups)), sc.hbs,
        enable_partial_hash_hits=lookup.partial_hash_hits,
    )
    stub = types.SimpleNamespace(
        _capacity_only=False,
        coord=coord,
        token_dbs=[types.SimpleNamespace(block_size=grp.block_size) for grp in sc.groups],
        _kv_cache_groups=groups,
        _lookup_key_prefixes=tuple(lookup.prefixes),
        hash_block_size=sc.hbs,
        store=store,
        _record_kv_connector_operation=lambda *args, **kwargs: None,
    )
    stub._tail_key_boundaries = types.MethodType(MooncakeStoreWorker._tail_key_boundaries, stub)
    return stub


def check(sc: Scenario, seed: int) -> int:
    rng = random.Random(seed)
    lookup = build(sc)
    hashes = hashes_for(sc.n_hashes, seed)
    compared = 0
    for _ in range(2):
        store, _visible = fill_store(rng, sc, lookup, hashes)
        stub = vllm_worker(sc, lookup, store)
        # vLLM's scheduler hashes every whole hash unit of the prompt (its finders index past the hashes
        # otherwise), so prompts stop below one more unit.
        for num_tokens in range(sc.n_hashes * sc.hbs + sc.hbs):
            theirs = MooncakeStoreWorker.lookup(stub, num_tokens, hashes)
            ours = lookup.lookup_with_boundaries(store, num_tokens, hashes)
            assert ours.hit_length == theirs.hit_length, (sc, seed, num_tokens)
            assert [(b.group_id, b.num_tokens) for b in ours.tail_key_boundaries] == [
                (b.group_id, b.num_tokens) for b in theirs.tail_key_boundaries
            ], (sc, seed, num_tokens)
            exact = lookup.lookup(store, num_tokens, hashes)
            assert exact <= theirs.hit_length
            if not lookup.partial_hash_hits:
                assert exact == theirs.hit_length, (sc, seed, num_tokens)
            compared += 1
    return compared


def test_lookup_matches_vllm_033() -> None:
    rng = random.Random(33)
    compared = 0
    scenarios = 0
    while compared < 20_000:
        sc = random_scenario(rng)
        sc.masks = None  # vLLM derives its own masks
        compared += check(sc, rng.randrange(2**32))
        scenarios += 1
    assert scenarios > 100


@pytest.mark.parametrize("seed", range(30))
def test_fine_grained_mixes_match_vllm_033(seed: int) -> None:
    # Several full-attention groups of different block sizes beside an align-mode Mamba group.
    from test_lookup_model import Group

    rng = random.Random(seed)
    hbs = rng.choice([1, 2])
    groups = [Group("full", hbs * rng.choice([1, 2])), Group("full", hbs * rng.choice([2, 4])),
              Group("mamba", hbs * rng.choice([2, 4]))]
    if rng.random() < 0.5:
        groups.append(Group("window", hbs * 2, rng.randint(2, 9)))
    check(Scenario(hbs, groups, None, rng.randint(1, 16), None), seed)
