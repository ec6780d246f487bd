"""The checks of vLLM 0.33's own store-layout test module, rewritten here and run against both modules.

vLLM's wheel ships no tests; these are the same checks (scalar reference on the (R, L) grids it uses, empty and
misaligned chunks, shared namespaces, the rank-local-only database surface, and a byte round trip of TP-shared
objects written at TP 4 and read at TP 2), parametrised over our ``integrations.vllm.data`` and — when installed
— vLLM's ``data.py``, so a divergence shows as one side failing.
"""

from __future__ import annotations

import ctypes
import random
from typing import Any

import pytest

from mooncake_kvaddr.integrations.vllm import data as ours

BS = 128


def _vllm_data() -> Any:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import data
    except Exception as exc:
        pytest.skip(f"vLLM 0.33 not importable: {exc!r}")
    return data


@pytest.fixture(params=["mooncake_kvaddr", pytest.param("vllm", marks=pytest.mark.vllm)])
def D(request: pytest.FixtureRequest) -> Any:
    return ours if request.param == "mooncake_kvaddr" else _vllm_data()


def make_layout(D: Any, regions: int, lens: int) -> Any:
    layout = D.RankLocalStoreLayout(D.KeyMetadata("test-model", 1, 0, 0, 0), BS, BS)
    layout.set_kv_caches_base_addr([0x7F00_0000_0000 + r * (1 << 30) for r in range(regions)])
    layout.set_block_len([30_208 + 512 * i for i in range(lens)])
    return layout


@pytest.mark.parametrize(("regions", "lens"), [(96, 96), (96, 2), (1, 1)])
def test_rank_local_matches_the_scalar_rule(D: Any, regions: int, lens: int) -> None:
    layout = make_layout(D, regions, lens)
    rng = random.Random(0)
    block_ids = [rng.randrange(1 << 20) for _ in range(300)]
    chunks = []
    block = 0
    while block < len(block_ids) - 4:
        span = rng.choice([1, 1, 1, 2, 4])
        chunks.append((block * BS, (block + span) * BS))
        block += span + rng.choice([0, 1])
    addrs, sizes, ids = layout.prepare_values(chunks, block_ids, [0] * len(chunks))
    assert len(addrs) == len(sizes) == len(ids) == len(chunks)
    blen = layout.block_len
    for (start, end), row, size_row, bid in zip(chunks, addrs, sizes, ids):
        expected_id = block_ids[start // BS]
        assert bid == expected_id and type(bid) is int
        assert row == [b + expected_id * blen[r % len(blen)] for r, b in enumerate(layout.kv_caches_base_addr)]
        assert size_row == [blen[r % len(blen)] * -(-(end - start) // BS) for r in range(regions)]
        assert all(type(a) is int for a in row)


def test_rank_local_empty_and_misaligned(D: Any) -> None:
    layout = make_layout(D, 4, 4)
    assert layout.prepare_values([], [1, 2, 3], []) == ([], [], [])
    with pytest.raises(AssertionError):
        layout.prepare_values([(0, BS + 1)], [0, 1], [0])


@pytest.mark.parametrize(("name", "fmt"), [("LBHNCStoreLayout", "tp_shared_lbhnc"),
                                           ("LBNHCStoreLayout", "tp_shared_lbnhc")])
def test_shared_namespace(D: Any, name: str, fmt: str) -> None:
    assert getattr(D, name).shared_namespace(4, 2) == f"@store_tp:4@store_pp:2@store_format:{fmt}"


def test_database_rank_local_surface_rejects_tp_shared(D: Any) -> None:
    md = D.KeyMetadata("test-model", 0, 0, 0, 0)
    layout = D.LBHNCStoreLayout(md, block_size=16, hash_block_size=16, local_tp_size=2, store_tp_size=4, tp_rank=0,
                                num_kv_heads=8)
    with pytest.raises(RuntimeError, match="rank-local"):
        D.ChunkedTokenDatabase(md, 16, store_layout=layout).prepare_value_for_block(0)


@pytest.mark.parametrize(("name", "writer_strides", "reader_strides"), [
    ("LBHNCStoreLayout", (128, 64, 4, 1), (256, 64, 4, 1)),
    ("LBNHCStoreLayout", (128, 4, 8, 1), (256, 4, 16, 1)),
])
def test_tp_shared_objects_round_trip_from_tp4_to_tp2(D: Any, name: str, writer_strides: tuple[int, ...],
                                                      reader_strides: tuple[int, ...]) -> None:
    torch = pytest.importorskip("torch")
    cls = getattr(D, name)
    block = 16
    objects: dict[int, bytes] = {}
    written = []
    for rank in range(4):  # writers: TP 4, 2 heads each, one store shard each
        tensor = torch.empty_strided((1, 2, block, 4), writer_strides, dtype=torch.float16)
        tensor.copy_(torch.arange(128, dtype=torch.float16).view(1, 2, block, 4) + rank * 1000)
        written.append(tensor)
        layout = cls(D.KeyMetadata("test-model", rank, 0, 0, 0), block, block, local_tp_size=4, store_tp_size=4,
                     tp_rank=rank, num_kv_heads=8)
        layout.register_kv_caches([tensor], 1)
        addrs, sizes, _ = layout.prepare_values([(0, block)], [0], [rank])
        objects[rank] = b"".join(ctypes.string_at(a, s) for a, s in zip(addrs[0], sizes[0]))
    for rank in range(2):  # readers: TP 2, 4 heads each, two store shards each
        tensor = torch.zeros(1, 4, block, 4, dtype=torch.float16).as_strided((1, 4, block, 4), reader_strides)
        tensor.zero_()
        layout = cls(D.KeyMetadata("test-model", rank, 0, 0, 0), block, block, local_tp_size=2, store_tp_size=4,
                     tp_rank=rank, num_kv_heads=8)
        layout.register_kv_caches([tensor], 1)
        shards = layout.local_shard_ids
        addrs, sizes, _ = layout.prepare_values([(0, block)] * len(shards), [0], shards)
        for shard, row, size_row in zip(shards, addrs, sizes):
            offset = 0
            for a, s in zip(row, size_row):
                ctypes.memmove(a, objects[shard][offset : offset + s], s)
                offset += s
        torch.testing.assert_close(tensor, torch.cat(written[2 * rank : 2 * rank + 2], dim=1))
