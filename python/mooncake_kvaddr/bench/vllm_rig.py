"""The installed vLLM's real Mooncake store threads on CPU torch caches (:class:`VllmStoreRig`), and the transfer
modes and request shapes it runs under. Split out of :mod:`~mooncake_kvaddr.bench.vllm_plugin` (which re-exports
its public names): the plugin, send and receive-case benchmarks and the end-to-end tests all drive this one rig.
vLLM 0.33's and 0.34's threads take the same constructor arguments and request records. The rig wraps the store
itself (as the plugin's worker hook would): it builds the threads, never vLLM's worker. Needs vLLM, torch and
Mooncake; imports them only when a rig is built.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BLOCK",
    "HEADLINE",
    "HEAD_MAJOR",
    "HETERO",
    "HETERO_QUICK",
    "MODES",
    "QUICK",
    "REMOTE",
    "RigShape",
    "VllmStoreRig",
    "mode_flags",
    "native_off",
    "plugin_mode",
]

#: Transfer modes: vLLM alone; the plugin's patched layouts only (vLLM's own handlers): alone, + staged
#: transport, + native-client transport, + staged transport whose slot calls go through the native client; the
#: plugin with its receive and send handlers too (``recv*``): alone (plain Mooncake store, list rows: what
#: ``MOONCAKE_KVADDR_VLLM_NATIVE_CLIENT=0`` installs), + staged, + native (int64 matrices to the store wrapper),
#: + both (staged slot calls through the native client), and ``recv_native_off``: the plugin's default store
#: wrapper where no native client can be built (an unverified wheel, ``MOONCAKE_KVADDR_NATIVE_CLIENT=0``; set
#: for the mode's duration), so every call goes to Mooncake's bound methods behind the registered-range guard.
MODES = (
    "vllm", "plugin", "recv", "recv_staged", "recv_native", "recv_staged_native", "recv_native_off", "staged",
    "native", "staged_native",
)  # fmt: skip
#: The modes whose native client is switched off (``MOONCAKE_KVADDR_NATIVE_CLIENT=0`` while they run).
NATIVE_OFF_SUFFIX = "_native_off"
BLOCK = 128


#: The heterogeneous-TP layout (vLLM 0.34): head-major caches of this rank of local TP 2 (4 KV heads) stored
#: as Store TP 4 shards (2 heads each, both owned here) in Store chunks of half a block.
HEAD_MAJOR = "head_major"
HEAD_MAJOR_HEADS = 4
HEAD_MAJOR_LOCAL_TP = 2
HEAD_MAJOR_STORE_TP = 4


@dataclass(frozen=True)
class RigShape:
    """One request: ``blocks`` blocks of 128 tokens, ``regions`` regions of ``region_bytes`` per block.

    ``layout`` "mla": one MLA-style cache per region, a Store chunk a block. :data:`HEAD_MAJOR`: one head-major
    cache per two regions (layer), each key a half-block Store chunk of one shard: ``regions`` segments of
    ``region_bytes / 4`` (the same bytes as "mla", twice the keys per shard)."""

    blocks: int
    regions: int
    region_bytes: int
    layout: str = "mla"

    @property
    def tokens(self) -> int:
        """Tokens of the request."""
        return self.blocks * BLOCK

    @property
    def hash_block(self) -> int:
        """Tokens per block hash (and per Store chunk)."""
        return BLOCK // 2 if self.layout == HEAD_MAJOR else BLOCK

    @property
    def units(self) -> int:
        """Block hashes of the request."""
        return self.tokens // self.hash_block

    @property
    def request_bytes(self) -> int:
        """Bytes one request moves."""
        return self.blocks * self.regions * self.region_bytes


#: The headline request: 289,024 tokens, 100 regions x 2 KiB per block, 441 MiB.
HEADLINE = RigShape(blocks=2258, regions=100, region_bytes=2048)
QUICK = RigShape(blocks=128, regions=32, region_bytes=2048)
#: Over TCP between processes (``remote``): 32,768 tokens, 100 regions x 2 KiB per block, 50 MiB (vLLM's
#: multi-buffer call moves ~25-80 MiB/s at 2 KiB regions over TCP here, so the headline would take minutes).
REMOTE = RigShape(blocks=256, regions=100, region_bytes=2048)
#: The headline's bytes and tokens in the heterogeneous-TP layout (vLLM 0.34 only), and a quick one.
HETERO = RigShape(blocks=2258, regions=100, region_bytes=2048, layout=HEAD_MAJOR)
HETERO_QUICK = RigShape(blocks=128, regions=32, region_bytes=2048, layout=HEAD_MAJOR)


def mode_flags(mode: str) -> tuple[bool, bool, bool]:
    """``(receive handler replaced, staged transport, native-client store wrapper)`` of a mode of :data:`MODES`
    (the wrapper of a ``*_native_off`` mode has no native client: see :func:`native_off`)."""
    return mode.startswith("recv"), "staged" in mode, "native" in mode


def native_off(mode: str) -> bool:
    """True for the modes whose store wrapper runs without a native client (Mooncake's bound methods)."""
    return mode.endswith(NATIVE_OFF_SUFFIX)


@contextlib.contextmanager
def plugin_mode(mode: str) -> Iterator[None]:
    """vLLM untouched (``vllm``), patched without the receive and send handlers (``plugin``, ``staged``,
    ``native``, ``staged_native``) or with both (``recv*``; the send handler only where the installed release
    has it ported) for the duration of the block; the previous state afterwards."""
    from mooncake_kvaddr.integrations.vllm import plugin
    from mooncake_kvaddr.integrations.vllm.releases import NOT_PORTED

    was = plugin.is_patched()
    had_receive = was and plugin.is_receive_patched()
    had_send = was and plugin.is_send_patched()
    plugin.unpatch()
    if mode != "vllm":
        receive = mode_flags(mode)[0]
        report = plugin.patch(receive=receive, send=receive)
        # A send handler the installed release's module has not ported stays vLLM's (the PatchReport says so).
        send_expected = receive and not report.send_reason.startswith(NOT_PORTED)
        if not report.active or plugin.is_receive_patched() != receive or plugin.is_send_patched() != send_expected:
            raise RuntimeError(
                f"plugin not active as {mode!r}: {report.reason or report.receive_reason or report.send_reason}"
            )
    try:
        yield
    finally:
        plugin.unpatch()
        if was:
            plugin.patch(receive=had_receive, send=had_send)


class VllmStoreRig:
    """vLLM's own send/receive threads on CPU caches, one Mooncake client, one master (``master_address``).

    ``staged`` wraps the client in :class:`StagedMooncakeStore` and ``native`` in :class:`NativeMooncakeStore`
    (inside the staged wrapper when both) before the caches are registered (as the plugin's worker hook
    does). Receive threads share one queue, as in vLLM's worker; :meth:`start_receivers` replaces them with
    a fresh set on a fresh queue (vLLM's threads never exit; old ones stay blocked on their old, empty queue).
    """

    def __init__(
        self,
        master_address: str,
        shape: RigShape,
        *,
        staged: bool = False,
        native: bool = False,
        recv_threads: int = 1,
        staging_bytes: int = 256 << 20,
        model: str = "rig/model",
        segment: bool = True,
        groups: int = 1,
        offload_budget: int | None = None,
    ) -> None:
        import importlib

        import torch
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import coordinator, data, worker
        from vllm.distributed.mooncake_store import MooncakeStoreConfig, setup_mooncake_store
        from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MLAAttentionSpec

        from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore
        from mooncake_kvaddr.integrations.vllm.staged_store import StagedMooncakeStore

        mooncake_store = importlib.import_module("mooncake.store")
        self._torch = torch
        self._data = data
        self._worker = worker
        self.shape = shape
        self.num_blocks = shape.blocks + 1  # block 0 is vLLM's null block
        store = mooncake_store.MooncakeDistributedStore()
        config = MooncakeStoreConfig(
            metadata_server="P2PHANDSHAKE",
            master_server_address=master_address,
            protocol="tcp",
            device_name="",
            mode="embedded" if segment else "standalone-store",
            global_segment_size=max(2 * shape.request_bytes + (64 << 20), 256 << 20) if segment else 0,
            local_buffer_size=16 << 20,
        )
        setup_mooncake_store(store, config, "127.0.0.1")
        self.raw_store = store
        self.store: Any = NativeMooncakeStore(store) if native else store
        if staged:
            self.store = StagedMooncakeStore(self.store, staging_bytes=staging_bytes)
        hbs = shape.hash_block
        if shape.layout == HEAD_MAJOR:
            if groups != 1:
                raise ValueError("the head-major rig has one KV-cache group")
            self.caches, specs, self.dbs = self._head_major(shape, model)
        else:
            head_size = shape.region_bytes // (BLOCK * 2)
            self.caches = [
                torch.zeros((self.num_blocks, BLOCK, head_size), dtype=torch.float16) for _ in range(shape.regions)
            ]
            # ``groups`` > 1: a hybrid-width model, the regions split between full-attention groups of different
            # layer counts (:func:`_group_split`): rows of different widths per group.
            split = _group_split(shape.regions, groups)
            spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=head_size, dtype=torch.float16)
            specs = [KVCacheGroupSpec([f"layer.{i}" for i in range(a, b)], spec) for a, b in split]
            self.dbs = [
                data.ChunkedTokenDatabase(data.KeyMetadata(model, 0, 0, 0, 0, group_id=g), BLOCK,
                                          hash_block_size=BLOCK)
                for g in range(groups)
            ]  # fmt: skip
            for db, (a, b) in zip(self.dbs, split, strict=True):
                db.store_layout.register_kv_caches(self.caches[a:b], self.num_blocks)
        for cache in self.caches:
            storage = cache.untyped_storage()
            code = self.store.register_buffer(storage.data_ptr(), storage.nbytes())
            if code != 0:
                raise RuntimeError(f"register_buffer failed: {code}")
        self.coord = coordinator.MooncakeStoreCoordinator(specs, scheduler_block_size=BLOCK, hash_block_size=hbs)
        self.db = self.dbs[0]
        self.offload_budget = offload_budget
        ready = threading.Event()
        self.sender = worker.KVCacheStoreSendingThread(
            self.store, self.coord, self.dbs, BLOCK, 0, (1,) * groups, "kv_both", ready,
            enable_kv_event=False, replicate_config=mooncake_store.ReplicateConfig(), enable_group_semantics=False,
            supports_group_ids=False, record_operation=None, group_participates=[True] * groups,
        )  # fmt: skip
        self.sender.start()
        ready.wait(10)
        self.load_queue: queue.Queue[Any] = queue.Queue()
        self.receivers: list[Any] = []
        self.start_receivers(recv_threads)
        self._job = 0

    def _head_major(self, shape: RigShape, model: str) -> tuple[list[Any], list[Any], list[Any]]:
        """vLLM 0.34's head-major layout over one cache per layer (blocks x heads x tokens x K/V content, as
        vLLM's own layout tests build them): caches, the group specs, the one token database."""
        import importlib

        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

        layout = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.layout")

        torch = self._torch
        layers = shape.regions // 2
        # A layer's block holds 2 regions: heads x BLOCK tokens x (K, V) x head_size fp16 elements.
        head_size = shape.region_bytes // (2 * HEAD_MAJOR_HEADS * BLOCK)
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEAD_MAJOR_HEADS, head_size=head_size,
                                 dtype=torch.float16)  # fmt: skip
        content = spec.state_content_size_bytes // 2  # fp16 elements per (head, token)
        caches = [torch.zeros((self.num_blocks, HEAD_MAJOR_HEADS, BLOCK, content), dtype=torch.float16)
                  for _ in range(layers)]  # fmt: skip
        metadata = self._data.KeyMetadata(model, 0, 0, 0, 0, group_id=0)
        chunk = shape.hash_block
        store_layout = layout.HeadMajorStoreLayout(
            metadata, BLOCK, chunk, local_tp_size=HEAD_MAJOR_LOCAL_TP, store_tp_size=HEAD_MAJOR_STORE_TP,
            tp_rank=0, layer_specs=[spec] * layers, store_chunk_size=chunk,
        )  # fmt: skip
        store_layout.register_kv_caches(caches, self.num_blocks)
        db = self._data.ChunkedTokenDatabase(metadata, chunk, hash_block_size=chunk, store_layout=store_layout)
        return caches, [KVCacheGroupSpec([f"layer.{i}" for i in range(layers)], spec)], [db]

    def keys(self, hashes: list[Any]) -> list[str]:
        """The keys a store of ``hashes`` writes (every owned shard of each Store chunk)."""
        store_layout = self.db.store_layout
        shards = store_layout.local_shard_ids if self.shape.layout == HEAD_MAJOR else (0,)
        return [store_layout.key_for(shard, h) for h in hashes for shard in shards]

    def start_receivers(self, count: int) -> None:
        """``count`` new vLLM receive threads on a new shared queue."""
        self.load_queue = queue.Queue()
        self.receivers = []
        for i in range(count):
            ready = threading.Event()
            receiver = self._worker.KVCacheStoreRecvingThread(
                self.store, self.coord, self.dbs, BLOCK, 0, ready,
                disk_offload_buffer_budget_bytes=self.offload_budget, record_operation=None,
                request_queue=self.load_queue, group_participates=[True] * len(self.dbs), is_hma_required=False,
            )  # fmt: skip
            receiver.name = f"rig-recv-{i}"
            receiver.start()
            ready.wait(10)
            self.receivers.append(receiver)

    # --- requests ---------------------------------------------------------------------------------------------

    def block_ids(self) -> list[int]:
        """Block ids 1..blocks (0 is the null block vLLM skips)."""
        return list(range(1, self.shape.blocks + 1))

    def fill(self, seed: int) -> None:
        """Random bytes in every block of every cache."""
        gen = self._torch.Generator().manual_seed(seed)
        for cache in self.caches:
            noise = self._torch.randint(-(1 << 15), 1 << 15, cache.shape, generator=gen, dtype=self._torch.int16)
            cache.view(self._torch.int16).copy_(noise)

    def snapshot(self) -> list[Any]:
        """Copies of the caches (to verify a load against)."""
        return [cache.clone() for cache in self.caches]

    def zero(self) -> None:
        """Zero every cache (so a load that writes nothing is caught by :meth:`verify`)."""
        for cache in self.caches:
            cache.zero_()

    def verify(self, expected: list[Any]) -> bool:
        """True when every cache's blocks 1.. equal ``expected`` byte for byte."""
        int16 = self._torch.int16
        return all(
            bool(self._torch.equal(cache[1:].view(int16), want[1:].view(int16)))
            for cache, want in zip(self.caches, expected)
        )

    @staticmethod
    def hashes(seed: int, blocks: int) -> list[bytes]:
        """``blocks`` distinct 32-byte block hashes."""
        return [seed.to_bytes(8, "little") + i.to_bytes(24, "little") for i in range(blocks)]

    def store_request(self, req_id: str, hashes: list[Any], timeout: float = 120.0) -> None:
        """Store blocks 1.. under ``hashes`` with vLLM's send thread; wait for its completion."""
        self._job += 1
        job = self._job
        meta = self._data.ReqMeta(
            req_id=req_id, token_len_chunk=len(hashes) * self.shape.hash_block,
            block_ids=(self.block_ids(),) * len(self.dbs), block_hashes=hashes, can_save=True, store_job_id=job,
        )  # fmt: skip
        self.sender.add_request(meta)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if job in self.sender.take_completed_saves():
                return
            time.sleep(0.002)
        raise TimeoutError(f"store of {req_id} did not complete in {timeout} s")

    def load_requests(self, req_ids: list[str], hashes: list[Any], timeout: float = 300.0) -> set[int]:
        """Load ``req_ids`` (each: ``hashes`` into blocks 1..) with vLLM's receive threads; wait until every
        one finished; return the block ids vLLM reported as failed."""
        n = len(hashes) * self.shape.hash_block
        for req_id in req_ids:
            spec = self._data.LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=n, can_load=True, token_len=n)
            meta = self._data.ReqMeta(
                req_id=req_id, token_len_chunk=n, block_ids=(self.block_ids(),) * len(self.dbs), block_hashes=hashes,
                load_spec=spec,
            )  # fmt: skip
            self.load_queue.put(meta)
        pending = set(req_ids)
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            for receiver in self.receivers:
                pending -= receiver.get_and_clear_finished_requests()
            if pending:
                time.sleep(0.0005)
        failed: set[int] = set()
        for receiver in self.receivers:
            failed |= receiver.get_and_clear_block_ids_with_load_errors()
        if pending:
            raise TimeoutError(f"loads {sorted(pending)} did not finish in {timeout} s")
        return failed

    def close(self) -> None:
        """Unregister the caches and close the Mooncake client (vLLM's threads are daemons and stay idle)."""
        for cache in self.caches:
            with contextlib.suppress(Exception):
                self.store.unregister_buffer(cache.untyped_storage().data_ptr())
        with contextlib.suppress(Exception):
            self.store.close()


def _group_split(regions: int, groups: int) -> list[tuple[int, int]]:
    """Region ranges of ``groups`` groups: the first takes two thirds, the next two thirds of the rest, ...,
    the last what is left (so 2 groups of 100 regions are 67 and 33 wide); one group takes them all."""
    if groups < 1 or groups > regions:
        raise ValueError(f"groups must be in 1..{regions}, got {groups}")
    bounds, start = [], 0
    for g in range(groups):
        left = regions - start - (groups - 1 - g)  # leave one region for each later group
        end = regions if g == groups - 1 else start + max(1, min(left, -(-2 * (regions - start) // 3)))
        bounds.append((start, end))
        start = end
    return bounds
