"""Benchmark: the layout engine's ``prepare_values`` beside vLLM 0.33's own (docs/vllm.md, "Performance").

``run(quick)`` measures, in one process with the variants' order shuffled every round and every input built
outside the timed region, the rank-local headline shape (2,258 chunks × 100 regions, block 128) with
never-seen block ids (cold) and with repeated ones (warm), and a TP-shared LBNHC shape (61 layers × 2
caches, block 128, 2 shards per rank: 15,616 segments per key). The reference is vLLM 0.33's own layout when
vLLM is importable, otherwise a numpy broadcast equivalent of it (named in the rows). Returns one dict per
(case, variant) with the median in milliseconds and the speed-up over the reference.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from mooncake_kvaddr.integrations.vllm import data as ours

HEADLINE_CHUNKS = 2258
HEADLINE_REGIONS = 100
BLOCK_SIZE = 128
REGION_BLOCK_LEN = 2048
LBNHC_LAYERS = 61
LBNHC_HEADS = 8  # model KV heads; local TP 2, store TP 4 → 2 shards per rank, 2 heads per shard
LBNHC_HEAD_DIM = 64


def _reference() -> tuple[Any, str]:
    """vLLM's data module, or the numpy stand-in when vLLM is not installed."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import data as vllm_data
    except Exception:  # vLLM absent or not importable here
        return None, "numpy reference"
    import vllm

    return vllm_data, f"vLLM {vllm.__version__}"


class _NumpyRankLocal:
    """vLLM 0.33's rank-local ``prepare_values`` arithmetic in numpy (the reference without vLLM)."""

    def __init__(self, bases: list[int], lens: list[int]) -> None:
        self.base = np.asarray(bases, dtype=np.int64)
        self.blen = np.asarray([lens[i % len(lens)] for i in range(len(bases))], dtype=np.int64)

    def prepare_values(
        self, chunks: list[tuple[int, int]], block_ids: list[int], shard_ids: list[int]
    ) -> tuple[Any, Any, Any]:
        n = len(chunks)
        starts = np.fromiter((c[0] for c in chunks), dtype=np.int64, count=n)
        spans = np.fromiter((c[1] for c in chunks), dtype=np.int64, count=n) - starts
        bids = np.fromiter((block_ids[i] for i in (starts // BLOCK_SIZE).tolist()), dtype=np.int64, count=n)
        addrs = self.base[None, :] + bids[:, None] * self.blen[None, :]
        sizes = self.blen[None, :] * ((spans + BLOCK_SIZE - 1) // BLOCK_SIZE)[:, None]
        return addrs.tolist(), sizes.tolist(), bids.tolist()


class _NumpyTemplates:
    """vLLM 0.33's TP-shared ``prepare_values`` arithmetic in numpy (the reference without vLLM)."""

    def __init__(self, templates: list[tuple[list[int], list[int], list[int]]], first_shard: int) -> None:
        self.bases = np.asarray([t[0] for t in templates], dtype=np.uint64)
        self.strides = np.asarray([t[1] for t in templates], dtype=np.uint64)
        self.sizes = np.asarray([t[2] for t in templates], dtype=np.uint64)
        self.first = first_shard

    def prepare_values(
        self, chunks: list[tuple[int, int]], block_ids: list[int], shard_ids: list[int]
    ) -> tuple[Any, Any, Any]:
        n = len(chunks)
        starts = np.fromiter((c[0] for c in chunks), dtype=np.int64, count=n)
        local = np.fromiter((s - self.first for s in shard_ids), dtype=np.int64, count=n)
        bids = np.fromiter((block_ids[i] for i in (starts // BLOCK_SIZE).tolist()), dtype=np.uint64, count=n)
        addrs = self.bases[local] + bids[:, None] * self.strides[local]
        return addrs.tolist(), self.sizes[local].tolist(), bids.tolist()


def _median_ms(
    variants: dict[str, Callable[[Any], object]], make_input: Callable[[], Any], rounds: int
) -> dict[str, tuple[float, float]]:
    """(median, min) ms per variant; each round shuffles the order and builds every call's input untimed."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for _ in range(rounds):
        random.shuffle(order)
        for name in order:
            arg = make_input()
            gc.collect()
            begin = time.perf_counter()
            result = variants[name](arg)
            times[name].append(time.perf_counter() - begin)
            del result
    return {name: (statistics.median(values) * 1e3, min(values) * 1e3) for name, values in times.items()}


def _rows(case: str, medians: dict[str, tuple[float, float]], reference: str,
          extra: dict[str, Any]) -> list[dict[str, Any]]:
    base, base_min = medians[reference]
    return [
        {"section": "vllm-layouts", "case": case, "variant": name, "median_ms": round(ms, 4),
         "min_ms": round(low, 4), "speedup_vs_reference": round(base / ms, 2) if ms > 0 else float("inf"),
         "speedup_of_minima": round(base_min / low, 2) if low > 0 else float("inf"), **extra}
        for name, (ms, low) in medians.items()
    ]


def _rank_local(quick: bool, ref_module: Any, ref_name: str) -> list[dict[str, Any]]:
    rng = random.Random(0)
    bases = [0x7F00_0000_0000 + r * (1 << 32) for r in range(HEADLINE_REGIONS)]
    lens = [REGION_BLOCK_LEN] * HEADLINE_REGIONS
    n = HEADLINE_CHUNKS
    chunks = [(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE) for i in range(n)]
    shard_ids = [0] * n
    md = ours.KeyMetadata("bench", 0, 0, 0, 0)
    layout = ours.RankLocalStoreLayout(md, BLOCK_SIZE, BLOCK_SIZE)
    layout.set_kv_caches_base_addr(list(bases))
    layout.set_block_len(list(lens))
    tuple_layout = ours.RankLocalStoreLayout(md, BLOCK_SIZE, BLOCK_SIZE)
    tuple_layout.set_kv_caches_base_addr(list(bases))
    tuple_layout.set_block_len(list(lens))
    tuple_layout.immutable_rows = True
    reference: Any
    if ref_module is not None:
        reference = ref_module.RankLocalStoreLayout(ref_module.KeyMetadata("bench", 0, 0, 0, 0), BLOCK_SIZE, BLOCK_SIZE)
        reference.set_kv_caches_base_addr(list(bases))
        reference.set_block_len(list(lens))
    else:
        reference = _NumpyRankLocal(bases, lens)
    rounds = 5 if quick else 15
    extra = {"chunks": n, "segments": HEADLINE_REGIONS, "reference": ref_name}

    def fresh_ids() -> list[int]:
        return [rng.randrange(1, 1 << 40) for _ in range(n)]

    variants: dict[str, Callable[[Any], object]] = {
        ref_name: lambda ids: reference.prepare_values(chunks, ids, shard_ids),
        "mooncake_kvaddr lists": lambda ids: layout.prepare_values(chunks, ids, shard_ids),
        "mooncake_kvaddr tuples": lambda ids: tuple_layout.prepare_values(chunks, ids, shard_ids),
        "mooncake_kvaddr arrays": lambda ids: layout.prepare_values_array(chunks, ids, shard_ids),
    }
    rows = _rows("rank-local cold (never-seen block ids)", _median_ms(variants, fresh_ids, rounds), ref_name, extra)
    warm_ids = fresh_ids()
    for warm_layout in (layout, tuple_layout, layout, tuple_layout, tuple_layout):
        # The second sighting caches a block id's rows; the third builds the tuple rows' cached tuples.
        warm_layout.prepare_values(chunks, warm_ids, shard_ids)
    rows += _rows("rank-local warm (repeated block ids)", _median_ms(variants, lambda: warm_ids, rounds), ref_name,
                  extra)
    return rows


def _lbnhc(quick: bool, ref_module: Any, ref_name: str) -> list[dict[str, Any]]:
    rng = random.Random(1)
    local_tp, store_tp, tp_rank = 2, 4, 0
    local_heads = LBNHC_HEADS // local_tp
    per_shard = LBNHC_HEADS // store_tp
    content = LBNHC_HEAD_DIM * 2  # fp16 bytes
    token_stride = local_heads * content
    block_stride = BLOCK_SIZE * token_stride
    # Templates as register_kv_caches builds them for 2 x 61 token-major caches (no tensors needed).
    cache_bases = [0x7E00_0000_0000 + c * (1 << 34) for c in range(2 * LBNHC_LAYERS)]
    templates: list[tuple[list[int], list[int], list[int]]] = []
    for local in range(store_tp // local_tp):
        head_start = local * per_shard
        b: list[int] = []
        s: list[int] = []
        z: list[int] = []
        for base in cache_bases:
            for token in range(BLOCK_SIZE):
                b.append(base + token * token_stride + head_start * content)
                s.append(block_stride)
                z.append(per_shard * content)
        templates.append((b, s, z))
    ns = ours.LBNHCStoreLayout.shared_namespace(store_tp, 1)
    layout = ours.LBNHCStoreLayout(ours.KeyMetadata("bench", 0, 0, 0, 0, store_namespace=ns), BLOCK_SIZE,
                                   BLOCK_SIZE, local_tp, store_tp, tp_rank, LBNHC_HEADS)
    layout._set_segment_templates(templates)
    tuple_layout = ours.LBNHCStoreLayout(layout.metadata, BLOCK_SIZE, BLOCK_SIZE, local_tp, store_tp, tp_rank,
                                         LBNHC_HEADS)
    tuple_layout._set_segment_templates(templates)
    tuple_layout.immutable_rows = True
    reference: Any
    if ref_module is not None:
        reference = ref_module.LBNHCStoreLayout(ref_module.KeyMetadata("bench", 0, 0, 0, 0, store_namespace=ns),
                                                BLOCK_SIZE, BLOCK_SIZE, local_tp, store_tp, tp_rank, LBNHC_HEADS)
        reference._set_segment_templates(templates)
    else:
        reference = _NumpyTemplates(templates, layout.local_shard_ids[0])
    n_chunks = 16 if quick else 32
    chunks = [(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE) for i in range(n_chunks) for _ in layout.local_shard_ids]
    shard_ids = [shard for _ in range(n_chunks) for shard in layout.local_shard_ids]
    rounds = 3 if quick else 9
    extra = {"chunks": n_chunks, "keys": len(chunks), "segments": len(templates[0][0]), "reference": ref_name}

    def fresh_ids() -> list[int]:
        return [rng.randrange(1, 1 << 20) for _ in range(n_chunks)]

    variants: dict[str, Callable[[Any], object]] = {
        ref_name: lambda ids: reference.prepare_values(chunks, ids, shard_ids),
        "mooncake_kvaddr lists": lambda ids: layout.prepare_values(chunks, ids, shard_ids),
        "mooncake_kvaddr tuples": lambda ids: tuple_layout.prepare_values(chunks, ids, shard_ids),
        "mooncake_kvaddr arrays": lambda ids: layout.prepare_values_array(chunks, ids, shard_ids),
    }
    rows = _rows("LBNHC cold (never-seen block ids)", _median_ms(variants, fresh_ids, rounds), ref_name, extra)
    warm_ids = fresh_ids()
    for warm_layout in (layout, tuple_layout, layout, tuple_layout, tuple_layout):
        warm_layout.prepare_values(chunks, warm_ids, shard_ids)
    rows += _rows("LBNHC warm (repeated block ids)", _median_ms(variants, lambda: warm_ids, rounds), ref_name, extra)
    return rows


def run(quick: bool = False) -> list[dict[str, Any]]:
    """All rows of this section (``quick``: fewer rounds and a smaller LBNHC request)."""
    ref_module, ref_name = _reference()
    return _rank_local(quick, ref_module, ref_name) + _lbnhc(quick, ref_module, ref_name)


def main() -> None:
    """Print the rows as a table (``python -m mooncake_kvaddr.bench.vllm_layouts [--quick]``)."""
    import sys

    for row in run(quick="--quick" in sys.argv):
        print(f"{row['case']:<40} {row['variant']:<24} median {row['median_ms']:>9.3f} ms "
              f"{row['speedup_vs_reference']:>7.2f}x   min {row['min_ms']:>9.3f} ms {row['speedup_of_minima']:>7.2f}x")


if __name__ == "__main__":
    main()
