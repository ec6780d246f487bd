"""Benchmark: the layout engine's ``prepare_values`` beside the installed vLLM's own (docs/vllm.md, "Performance").

One section per release the plugin knows: vLLM's method called as its original (``registry.original_of``), the
drop-in as the plugin installs it on vLLM's class, on the same layout objects, interleaved, inputs built untimed.
Cases: the rank-local headline request (on 0.34 with a block stride apart from the stored length) and the release's
TP-shared layout (0.33: LBNHC; 0.34: head-major over CPU tensors, heterogeneous TP, Store chunks half a block).
"""

from __future__ import annotations

import contextlib
import gc
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
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


#: Head-major (vLLM 0.34) heterogeneous-TP case: local TP 2 over Store TP 4 (2 shards per rank), 50 layers x 2
#: heads per shard = 100 segments per key, Store chunks half a block; head size 8 keeps the tensors' (untouched,
#: ``torch.empty``) memory small: the descriptor count, not the segment size, is what prepare_values pays for.
HEAD_MAJOR_LAYERS = 50
HEAD_MAJOR_LOCAL_HEADS = 4
HEAD_MAJOR_HEAD_SIZE = 8
HEAD_MAJOR_LOCAL_TP = 2
HEAD_MAJOR_STORE_TP = 4


@dataclass(frozen=True)
class Sizes:
    """The requests and default timed rounds of one run: :data:`FULL`, :data:`QUICK` or :data:`TINY` (tests)."""

    chunks: int = HEADLINE_CHUNKS  # rank-local
    regions: int = HEADLINE_REGIONS
    lbnhc_layers: int = LBNHC_LAYERS
    lbnhc_chunks: int = 32
    head_major_layers: int = HEAD_MAJOR_LAYERS
    head_major_blocks: int = HEADLINE_CHUNKS
    rank_local_rounds: int = 15
    tp_shared_rounds: int = 9


FULL = Sizes()
QUICK = Sizes(lbnhc_chunks=16, head_major_blocks=256, rank_local_rounds=5, tp_shared_rounds=3)
TINY = Sizes(chunks=40, regions=6, lbnhc_layers=2, lbnhc_chunks=17, head_major_layers=3, head_major_blocks=12,
             rank_local_rounds=1, tp_shared_rounds=1)

#: The drop-in's variant name in every case (the plugin's replacement, on vLLM's own class and objects).
DROP_IN = "mooncake_kvaddr drop-in (plugin on vLLM's class)"


@dataclass(frozen=True)
class _Vllm:
    """The installed vLLM as this section sees it: its version and the module holding its store layouts."""

    version: str
    layouts: Any

    @property
    def reference(self) -> str:
        return f"vLLM {self.version} prepare_values"

    @property
    def series(self) -> str:
        return ".".join(self.version.split(".")[:2])


def _reference() -> _Vllm | None:
    """The installed vLLM's layout module (per the plugin's release record), or None without vLLM."""
    try:
        import vllm
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import data as vllm_data
    except Exception:  # vLLM absent or not importable here
        return None
    import importlib

    from mooncake_kvaddr.integrations.vllm.registry import DATA_MODULE
    from mooncake_kvaddr.integrations.vllm.releases import for_version

    version = str(vllm.__version__)
    release = for_version(version)
    if release is None or release.layout_module == DATA_MODULE:
        return _Vllm(version, vllm_data)
    return _Vllm(version, importlib.import_module(release.layout_module))


def _own(layout: Any) -> Callable[..., Any]:
    """vLLM's own ``prepare_values`` of ``layout``'s class, bound to it (the original while the plugin is on)."""
    from mooncake_kvaddr.integrations.vllm.registry import original_of

    own = original_of(type(layout), "prepare_values")
    return lambda chunks, ids, shard_ids: own(layout, chunks, ids, shard_ids)


def _same_ints(ours_out: Any, theirs: Any) -> bool:
    """True when two ``prepare_values`` results hold the same values and ours holds Python ints (no numpy
    scalars); rows compare as lists (the tuple form's rows are tuples)."""
    addrs, sizes, ids = ours_out
    typed = all(type(v) is int for v in (addrs[0][0], sizes[0][0], ids[0])) if ids else True
    want_addrs, want_sizes, want_ids = theirs
    return (typed and list(ids) == list(want_ids) and [list(r) for r in addrs] == [list(r) for r in want_addrs]
            and [list(r) for r in sizes] == [list(r) for r in want_sizes])


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
          extra: dict[str, Any], same: dict[str, bool] | None = None) -> list[dict[str, Any]]:
    base, base_min = medians[reference]
    return [
        {"section": "vllm-layouts", "case": case, "variant": name, "median_ms": round(ms, 4),
         "min_ms": round(low, 4), "speedup_vs_reference": round(base / ms, 2) if ms > 0 else float("inf"),
         "speedup_of_minima": round(base_min / low, 2) if low > 0 else float("inf"),
         **({"same_values": same[name]} if same and name in same else {}), **extra}
        for name, (ms, low) in medians.items()
    ]


def _enter_drop_in(stack: contextlib.ExitStack) -> str:
    """The plugin's layouts on vLLM's classes until ``stack`` closes (its handlers off); "" or why not."""
    from mooncake_kvaddr.bench.vllm_rig import plugin_mode

    try:
        stack.enter_context(plugin_mode("plugin"))
    except RuntimeError as exc:  # the plugin refused this vLLM: the rows say so, with no drop-in figure
        return str(exc)
    return ""


def _rank_local(sizes: Sizes, ref: _Vllm | None, rounds: int | None) -> list[dict[str, Any]]:
    """The headline request on vLLM's rank-local layout (0.34: block stride 2,304 B, 2,048 B stored per block),
    plus, where its regions' stride is their length (0.33, or no vLLM), our own layout classes' forms."""
    rng = random.Random(0)
    bases = [0x7F00_0000_0000 + r * (1 << 32) for r in range(sizes.regions)]
    lens = [REGION_BLOCK_LEN] * sizes.regions
    n = sizes.chunks
    chunks = [(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE) for i in range(n)]
    shard_ids = [0] * n
    rounds = rounds or sizes.rank_local_rounds
    ref_name = ref.reference if ref is not None else "numpy reference"
    extra: dict[str, Any] = {"chunks": n, "segments": sizes.regions, "reference": ref_name,
                             "release": ref.version if ref is not None else None}
    variants: dict[str, Callable[[Any], object]] = {}
    warm_layouts: list[Any] = []
    with contextlib.ExitStack() as stack:
        if ref is None:
            reference: Any = _NumpyRankLocal(bases, lens)
            variants[ref_name] = lambda ids: reference.prepare_values(chunks, ids, shard_ids)
            strided = False
        else:
            vllm_layout = ref.layouts.RankLocalStoreLayout(ref.layouts.KeyMetadata("bench", 0, 0, 0, 0), BLOCK_SIZE,
                                                           BLOCK_SIZE)
            vllm_layout.set_kv_caches_base_addr(list(bases))
            strided = hasattr(vllm_layout, "block_stride")  # 0.34: the stride is set, the stored length apart
            vllm_layout.set_block_len([REGION_BLOCK_LEN + 256] * sizes.regions if strided else list(lens))
            if strided:
                vllm_layout.block_len = list(lens)
                extra["block_stride"] = REGION_BLOCK_LEN + 256
            own = _own(vllm_layout)
            variants[ref_name] = lambda ids: own(chunks, ids, shard_ids)
            reason = _enter_drop_in(stack)
            if reason:
                extra["drop_in"] = f"not measured: {reason}"
            else:
                variants[DROP_IN] = lambda ids: vllm_layout.prepare_values(chunks, ids, shard_ids)
                warm_layouts.append(vllm_layout)
        if not strided:  # our own (0.33-shaped) layout classes: lists, tuples, arrays
            md = ours.KeyMetadata("bench", 0, 0, 0, 0)
            layout = ours.RankLocalStoreLayout(md, BLOCK_SIZE, BLOCK_SIZE)
            layout.set_kv_caches_base_addr(list(bases))
            layout.set_block_len(list(lens))
            tuple_layout = ours.RankLocalStoreLayout(md, BLOCK_SIZE, BLOCK_SIZE)
            tuple_layout.set_kv_caches_base_addr(list(bases))
            tuple_layout.set_block_len(list(lens))
            tuple_layout.immutable_rows = True
            variants["mooncake_kvaddr lists"] = lambda ids: layout.prepare_values(chunks, ids, shard_ids)
            variants["mooncake_kvaddr tuples"] = lambda ids: tuple_layout.prepare_values(chunks, ids, shard_ids)
            variants["mooncake_kvaddr arrays"] = lambda ids: layout.prepare_values_array(chunks, ids, shard_ids)
            warm_layouts += [layout, tuple_layout]

        def fresh_ids() -> list[int]:
            return [rng.randrange(1, 1 << 40) for _ in range(n)]

        same = _check(variants, ref_name, fresh_ids())
        rows = _rows("rank-local cold (never-seen block ids)", _median_ms(variants, fresh_ids, rounds), ref_name,
                     extra, same)
        warm_ids = fresh_ids()
        for _ in range(3):  # the second sighting caches a block id's rows; the third builds the cached tuples
            for warm_layout in warm_layouts:
                warm_layout.prepare_values(chunks, warm_ids, shard_ids)
        rows += _rows("rank-local warm (repeated block ids)", _median_ms(variants, lambda: warm_ids, rounds),
                      ref_name, extra, same)
    return rows


def _check(variants: dict[str, Callable[[Any], object]], ref_name: str, ids: Any) -> dict[str, bool]:
    """Whether each list-returning variant gives the reference's values, as Python ints (once, untimed)."""
    want = variants[ref_name](ids)
    return {name: _same_ints(fn(ids), want) for name, fn in variants.items()
            if name != ref_name and "arrays" not in name}


def _lbnhc(sizes: Sizes, ref: _Vllm | None, rounds: int | None) -> list[dict[str, Any]]:
    """vLLM 0.32/0.33's TP-shared LBNHC layout (or its numpy stand-in without vLLM)."""
    rng = random.Random(1)
    local_tp, store_tp, tp_rank = 2, 4, 0
    local_heads = LBNHC_HEADS // local_tp
    per_shard = LBNHC_HEADS // store_tp
    content = LBNHC_HEAD_DIM * 2  # fp16 bytes
    token_stride = local_heads * content
    block_stride = BLOCK_SIZE * token_stride
    # Templates as register_kv_caches builds them for 2 x 61 token-major caches (no tensors needed).
    cache_bases = [0x7E00_0000_0000 + c * (1 << 34) for c in range(2 * sizes.lbnhc_layers)]
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
    ref_name = ref.reference if ref is not None else "numpy reference"
    reference: Any = None
    if ref is not None:
        reference = ref.layouts.LBNHCStoreLayout(ref.layouts.KeyMetadata("bench", 0, 0, 0, 0, store_namespace=ns),
                                                 BLOCK_SIZE, BLOCK_SIZE, local_tp, store_tp, tp_rank, LBNHC_HEADS)
        reference._set_segment_templates(templates)
        own = _own(reference)
    else:
        own = _NumpyTemplates(templates, layout.local_shard_ids[0]).prepare_values
    n_chunks = sizes.lbnhc_chunks
    chunks = [(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE) for i in range(n_chunks) for _ in layout.local_shard_ids]
    shard_ids = [shard for _ in range(n_chunks) for shard in layout.local_shard_ids]
    rounds = rounds or sizes.tp_shared_rounds
    extra: dict[str, Any] = {"chunks": n_chunks, "keys": len(chunks), "segments": len(templates[0][0]),
                             "reference": ref_name, "release": ref.version if ref is not None else None}

    def fresh_ids() -> list[int]:
        return [rng.randrange(1, 1 << 20) for _ in range(n_chunks)]

    variants: dict[str, Callable[[Any], object]] = {
        ref_name: lambda ids: own(chunks, ids, shard_ids),
        "mooncake_kvaddr lists": lambda ids: layout.prepare_values(chunks, ids, shard_ids),
        "mooncake_kvaddr tuples": lambda ids: tuple_layout.prepare_values(chunks, ids, shard_ids),
        "mooncake_kvaddr arrays": lambda ids: layout.prepare_values_array(chunks, ids, shard_ids),
    }
    warm_layouts = [layout, tuple_layout]
    with contextlib.ExitStack() as stack:
        if reference is not None:
            reason = _enter_drop_in(stack)
            if reason:
                extra["drop_in"] = f"not measured: {reason}"
            else:
                variants[DROP_IN] = lambda ids: reference.prepare_values(chunks, ids, shard_ids)
                warm_layouts.append(reference)
        same = _check(variants, ref_name, fresh_ids())
        rows = _rows("LBNHC cold (never-seen block ids)", _median_ms(variants, fresh_ids, rounds), ref_name, extra,
                     same)
        warm_ids = fresh_ids()
        for _ in range(3):
            for warm_layout in warm_layouts:
                warm_layout.prepare_values(chunks, warm_ids, shard_ids)
        rows += _rows("LBNHC warm (repeated block ids)", _median_ms(variants, lambda: warm_ids, rounds), ref_name,
                      extra, same)
    return rows


def _head_major(sizes: Sizes, ref: _Vllm, rounds: int | None) -> list[dict[str, Any]]:
    """vLLM 0.34's ``HeadMajorStoreLayout`` registered over real CPU tensors (one per layer, shaped blocks x heads
    x states x content, as vLLM's own layout tests build them): a request of the headline's tokens (2,258
    blocks of 128) in Store chunks of 64 tokens, local TP 2 over Store TP 4, every chunk for both owned shards."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    rng = random.Random(2)
    blocks = sizes.head_major_blocks
    store_chunk = BLOCK_SIZE // 2
    specs = [FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEAD_MAJOR_LOCAL_HEADS,
                               head_size=HEAD_MAJOR_HEAD_SIZE, dtype=torch.float16)
             for _ in range(sizes.head_major_layers)]  # fmt: skip
    content = specs[0].state_content_size_bytes // 2  # fp16 elements per (head, token)
    num_blocks = blocks + 1  # block 0 is vLLM's null block
    # Never written or read: prepare_values computes addresses only (torch.empty touches no page).
    caches = [torch.empty((num_blocks, HEAD_MAJOR_LOCAL_HEADS, BLOCK_SIZE, content), dtype=torch.float16)
              for _ in specs]  # fmt: skip
    layout = ref.layouts.HeadMajorStoreLayout(
        ref.layouts.KeyMetadata("bench", 0, 0, 0, 0), BLOCK_SIZE, store_chunk, local_tp_size=HEAD_MAJOR_LOCAL_TP,
        store_tp_size=HEAD_MAJOR_STORE_TP, tp_rank=0, layer_specs=specs, store_chunk_size=store_chunk,
    )  # fmt: skip
    layout.register_kv_caches(caches, num_blocks)
    shards = list(layout.local_shard_ids)
    chunks = [(s, s + store_chunk) for s in range(0, blocks * BLOCK_SIZE, store_chunk) for _ in shards]
    shard_ids = [shard for _ in range(0, blocks * BLOCK_SIZE, store_chunk) for shard in shards]
    rounds = rounds or sizes.tp_shared_rounds
    ref_name = ref.reference
    own = _own(layout)
    extra: dict[str, Any] = {
        "chunks": blocks * BLOCK_SIZE // store_chunk, "keys": len(chunks), "segments": len(layout._chunk_sizes[0][0]),
        "store_chunk_size": store_chunk, "local_tp": HEAD_MAJOR_LOCAL_TP, "store_tp": HEAD_MAJOR_STORE_TP,
        "reference": ref_name, "release": ref.version,
    }  # fmt: skip

    def fresh_ids() -> list[int]:
        return [rng.randrange(1, 1 << 20) for _ in range(blocks)]  # arithmetic only: past the tensors is fine

    variants: dict[str, Callable[[Any], object]] = {ref_name: lambda ids: own(chunks, ids, shard_ids)}
    with contextlib.ExitStack() as stack:
        reason = _enter_drop_in(stack)
        if reason:
            extra["drop_in"] = f"not measured: {reason}"
        else:
            variants[DROP_IN] = lambda ids: layout.prepare_values(chunks, ids, shard_ids)
        same = _check(variants, ref_name, fresh_ids())
        case = "head-major TP 2 over 4, half-block Store chunks"
        rows = _rows(f"{case} cold", _median_ms(variants, fresh_ids, rounds), ref_name, extra, same)
        warm_ids = fresh_ids()
        for _ in range(3):
            layout.prepare_values(chunks, warm_ids, shard_ids)
        rows += _rows(f"{case} warm", _median_ms(variants, lambda: warm_ids, rounds), ref_name, extra, same)
    return rows




def run(quick: bool = False, *, rounds: int | None = None, sizes: Sizes | None = None) -> list[dict[str, Any]]:
    """All rows of this section for the installed vLLM (``quick``: :data:`QUICK`'s fewer rounds and smaller
    TP-shared requests; ``sizes`` overrides both; ``rounds``: timed rounds per variant instead of the sizes')."""
    sizes = sizes or (QUICK if quick else FULL)
    ref = _reference()
    rows = _rank_local(sizes, ref, rounds)
    if ref is not None and hasattr(ref.layouts, "HeadMajorStoreLayout"):
        rows += _head_major(sizes, ref, rounds)
    elif ref is None or hasattr(ref.layouts, "LBNHCStoreLayout"):
        rows += _lbnhc(sizes, ref, rounds)
    return rows


def main() -> None:
    """Print the rows as a table (``python -m mooncake_kvaddr.bench.vllm_layouts [--quick]``)."""
    import sys

    for row in run(quick="--quick" in sys.argv):
        print(f"{row['case']:<40} {row['variant']:<24} median {row['median_ms']:>9.3f} ms "
              f"{row['speedup_vs_reference']:>7.2f}x   min {row['min_ms']:>9.3f} ms {row['speedup_of_minima']:>7.2f}x")


if __name__ == "__main__":
    main()
