"""The plugin's transport with KV caches in GPU memory, on a real Mooncake store (docs/native-client.md, "On a GPU").

The tests run on CPU-only machines; this script is the check for a machine with a GPU and a CUDA Mooncake wheel.
It registers torch KV caches (CUDA, or host with ``--device cpu``) through :class:`NativeMooncakeStore`, computes
every chunk's segments with our rank-local and TP-shared (LBNHC) layouts, stores them, zeroes the caches, loads them
back through the native client and through Mooncake's bound methods, and compares the bytes; it also checks that the
registered-range guard refuses a slice one byte outside a registered cache. Prints one JSON record.

    python3 bench/gpu_plugin_check.py [--device cuda] [--out result.json]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
import time
from typing import Any

BLOCK = 16
HEADS = 8
HEAD_DIM = 128


def _mooncake_dist() -> str:
    for name in ("mooncake-transfer-engine-cuda13", "mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"):
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "?"


def _raw_store(address: str, segment: int) -> Any:
    import mooncake.store as ms

    store = ms.MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", segment, 64 << 20, "tcp", "", address)
    if rc != 0:
        raise RuntimeError(f"Mooncake setup answered {rc}")
    return store


def _sync(torch: Any, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Case:
    """One layout over its own caches: the rows of every chunk, the keys, a fill and a byte comparison."""

    def __init__(self, torch: Any, device: str, name: str, layers: int, blocks: int) -> None:
        from mooncake_kvaddr.core.layouts import RankLocalStoreLayout
        from mooncake_kvaddr.core.layouts_tp import LBNHCStoreLayout
        from mooncake_kvaddr.core.metadata import KeyMetadata

        self.torch, self.device, self.name, self.blocks = torch, device, name, blocks
        nb = blocks + 1  # block 0 stays out of every request (vLLM's null block), so it must stay zero
        if name == "rank_local":
            # One region per layer and K/V: (num_blocks, block_size, heads * head_dim), bf16.
            self.caches = [torch.zeros((nb, BLOCK, HEADS * HEAD_DIM), dtype=torch.bfloat16, device=device)
                           for _ in range(2 * layers)]  # fmt: skip
            layout: Any = RankLocalStoreLayout(KeyMetadata(f"gpu/{name}", 0, 0, 0, 0), BLOCK, BLOCK)
            shards = [0]
        else:
            # Token-major packed caches seen as (num_blocks, heads, block_size, head_dim): one segment per token
            # of a block per cache, two store shards (store TP 2 over local TP 1).
            self.caches = [torch.zeros((nb, BLOCK, HEADS, HEAD_DIM), dtype=torch.bfloat16, device=device)
                           for _ in range(2 * layers)]  # fmt: skip
            namespace = LBNHCStoreLayout.shared_namespace(2, 1)
            meta = KeyMetadata(f"gpu/{name}", 0, 0, 0, 0, store_namespace=namespace)
            layout = LBNHCStoreLayout(meta, BLOCK, BLOCK, 1, 2, 0, HEADS)
            shards = list(layout.local_shard_ids)
        views = self.caches if name == "rank_local" else [c.permute(0, 2, 1, 3) for c in self.caches]
        layout.register_kv_caches(views, nb)
        self.layout = layout
        # One row per (chunk, shard), chunk-major; chunk i is block i + 1.
        chunks = [(i * BLOCK, (i + 1) * BLOCK) for i in range(blocks) for _ in shards]
        row_shards = [s for _ in range(blocks) for s in shards]
        block_ids = list(range(1, blocks + 1))
        self.addrs, self.sizes, _ = layout.prepare_values_array(chunks, block_ids, row_shards)
        run = os.getpid()
        self.keys = [layout.key_for(s, f"{run}-{i}".encode()) for i in range(blocks) for s in shards]
        if len(self.keys) != self.addrs.shape[0]:
            raise AssertionError(f"{len(self.keys)} keys for {self.addrs.shape[0]} rows")

    def fill(self, seed: int) -> None:
        gen = self.torch.Generator(device=self.device).manual_seed(seed)
        for cache in self.caches:
            flat = cache[1:].view(self.torch.int16)
            flat.copy_(self.torch.randint(-(1 << 15), 1 << 15, flat.shape, generator=gen, dtype=self.torch.int16,
                                          device=self.device))  # fmt: skip
        _sync(self.torch, self.device)

    def snapshot(self) -> list[Any]:
        return [cache.clone() for cache in self.caches]

    def zero(self) -> None:
        for cache in self.caches:
            cache.zero_()
        _sync(self.torch, self.device)

    def same(self, expected: list[Any]) -> bool:
        _sync(self.torch, self.device)
        i16 = self.torch.int16
        return all(bool(self.torch.equal(c.view(i16), e.view(i16))) for c, e in zip(self.caches, expected))

    def register(self, wrapper: Any) -> None:
        for cache in self.caches:
            storage = cache.untyped_storage()
            code = wrapper.register_buffer(storage.data_ptr(), storage.nbytes())
            if code != 0:
                raise RuntimeError(f"register_buffer({storage.data_ptr():#x}, {storage.nbytes()}) answered {code}")

    @property
    def key_bytes(self) -> int:
        return int(self.sizes[0].sum())


def _round(case: Case, wrapper: Any, how: str, seed: int, rep: int) -> dict[str, Any]:
    """Store every chunk, zero, load, compare; ``how``: ``lists`` (vLLM's call), ``arrays`` (the plugin's
    handlers) or ``bound`` (Mooncake's own method, the wrapped store)."""
    import mooncake.store as ms

    keys = [f"{k}/{how}/{rep}" for k in case.keys]
    addrs, sizes = case.addrs, case.sizes
    config = ms.ReplicateConfig()
    case.zero()
    case.fill(seed)
    want = case.snapshot()
    t0 = time.perf_counter()
    if how == "arrays":
        put = wrapper.batch_put_from_multi_buffers_arrays(keys, addrs, sizes, config)
    elif how == "lists":
        put = wrapper.batch_put_from_multi_buffers(keys, addrs.tolist(), sizes.tolist(), config)
    else:
        put = wrapper.wrapped.batch_put_from_multi_buffers(keys, addrs.tolist(), sizes.tolist(), config)
    t1 = time.perf_counter()
    case.zero()
    t2 = time.perf_counter()
    if how == "arrays":
        got = wrapper.batch_get_into_multi_buffers_arrays(keys, addrs, sizes)
    elif how == "lists":
        got = wrapper.batch_get_into_multi_buffers(keys, addrs.tolist(), sizes.tolist())
    else:
        got = wrapper.wrapped.batch_get_into_multi_buffers(keys, addrs.tolist(), sizes.tolist())
    t3 = time.perf_counter()
    nbytes = case.key_bytes * len(keys)
    return {
        "how": how,
        "keys": len(keys),
        "segments_per_key": int(addrs.shape[1]),
        "bytes": nbytes,
        "put_ok": list(put) == [0] * len(keys),
        "get_ok": list(got) == [case.key_bytes] * len(keys),
        "bytes_equal": case.same(want),
        "put_ms": (t1 - t0) * 1e3,
        "get_ms": (t3 - t2) * 1e3,
        "put_codes": sorted(set(map(int, put))),
        "get_codes": sorted(set(map(int, got))),
    }


def _guard(case: Case, wrapper: Any) -> dict[str, Any]:
    """Two keys stored for this check; a load whose first row starts one byte before its cache: -600 for that
    key (its blocks untouched), the other key loads."""
    import mooncake.store as ms

    keys = [f"{k}/guard" for k in case.keys[:2]]
    addrs, sizes = case.addrs[:2].copy(), case.sizes[:2].copy()
    put = wrapper.batch_put_from_multi_buffers_arrays(keys, addrs, sizes, ms.ReplicateConfig())
    addrs[0, 0] = case.caches[0].untyped_storage().data_ptr() - 1
    case.zero()
    got = wrapper.batch_get_into_multi_buffers_arrays(keys, addrs, sizes)
    _sync(case.torch, case.device)
    untouched = all(int(c[1].count_nonzero().item()) == 0 for c in case.caches)  # key 0 is block 1's
    return {"put_codes": [int(c) for c in put], "codes": [int(c) for c in got],
            "refused_only_bad_key": list(put) == [0, 0] and int(got[0]) == -600 and int(got[1]) == case.key_bytes,
            "refused_blocks_untouched": untouched}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="rounds per layout and call form (medians reported)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    import torch

    from mooncake_kvaddr.driver.master import EmbeddedMaster
    from mooncake_kvaddr.driver.native_client import NativeClient
    from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore
    from mooncake_kvaddr.integrations.vllm.transports import maybe_stage_store

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    record: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "mooncake": _mooncake_dist(),
        "MC_STORE_MEMCPY": os.environ.get("MC_STORE_MEMCPY", "(unset)"),
    }
    ok = True
    with EmbeddedMaster() as master:
        cases = [Case(torch, args.device, name, args.layers, args.blocks) for name in ("rank_local", "lbnhc")]
        need = sum(3 * args.repeat * c.key_bytes * len(c.keys) for c in cases)
        raw = _raw_store(master.rpc_address, max(2 * need, 512 << 20))  # no eviction during the check
        record["native_client"] = NativeClient.from_store(raw) is not None
        wrapper = NativeMooncakeStore(raw, armed=True)
        staged = maybe_stage_store(wrapper, [c.caches for c in cases], {"mooncake_kvaddr_staged": True})
        record["staged_off_for_device_caches"] = staged is wrapper if args.device == "cuda" else None
        try:
            for case in cases:
                case.register(wrapper)
            rounds = []
            for i, case in enumerate(cases):
                for j, how in enumerate(("arrays", "lists", "bound")):
                    runs = [_round(case, wrapper, how, seed=100 * i + 10 * j + r, rep=r) for r in range(args.repeat)]
                    result = {"layout": case.name, **runs[0]}
                    for field in ("put_ok", "get_ok", "bytes_equal"):
                        result[field] = all(run[field] for run in runs)
                    for field in ("put_ms", "get_ms"):
                        result[field] = round(statistics.median(run[field] for run in runs), 2)
                    ok &= result["put_ok"] and result["get_ok"] and result["bytes_equal"]
                    rounds.append(result)
            record["rounds"] = rounds
            record["guard"] = _guard(cases[0], wrapper)
            ok &= record["guard"]["refused_only_bad_key"] and record["guard"]["refused_blocks_untouched"]
            record["native_calls"] = wrapper.stats.native_calls
            record["fallback_calls"] = wrapper.stats.fallback_calls
            ok &= record["native_client"] and wrapper.stats.native_calls > 0
        finally:
            wrapper.close()
    record["ok"] = bool(ok)
    text = json.dumps(record, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
