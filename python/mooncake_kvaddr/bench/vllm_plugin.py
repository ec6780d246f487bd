"""vLLM 0.33's own Mooncake store threads, without the plugin, with it, and with the staged transport
(docs/vllm-plugin.md, "Measured").

:class:`VllmStoreRig` runs vLLM's real ``KVCacheStoreSendingThread`` and ``KVCacheStoreRecvingThread`` on CPU
torch KV caches (one MLA-style tensor per layer, registered through vLLM's layout) against a real Mooncake
master; the end-to-end tests use it too. :func:`run` measures, per request: the receive thread's wall time,
the GIL time a busy Python thread loses beside it, split by phase (vLLM's own Python, the layouts'
``prepare_values`` calls, the store call: Mooncake's argument conversion, or our staging wrapper plus
Mooncake's slot call), and the wall time of 1/2/4 receive threads loading 4 requests. Needs vLLM, torch and
Mooncake; imports them only when called.

The rig that drives vLLM's real threads and the measurement around it are one experiment; splitting them
would spread one set of assumptions about vLLM 0.33 over two files.
"""

from __future__ import annotations

import contextlib
import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["HEADLINE", "MODES", "QUICK", "REMOTE", "RigShape", "VllmStoreRig", "plugin_mode", "run"]

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


@dataclass(frozen=True)
class RigShape:
    """One request: ``blocks`` chunks of 128 tokens, ``regions`` layers of ``region_bytes`` per block."""

    blocks: int
    regions: int
    region_bytes: int

    @property
    def tokens(self) -> int:
        """Tokens of the request."""
        return self.blocks * BLOCK

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
#: Mooncake's TCP queue limits raised so that vLLM's one call per request (25,600 regions; four at once on
#: four receive threads) is admitted at all; with the defaults it fails every key (docs/vllm-plugin.md).
REMOTE_TCP_ENV = {
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
    "MC_TCP_ADMISSION_TIMEOUT_MS": "600000",
}


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
    ``native``, ``staged_native``) or with both (``recv*``) for the duration of the block; the previous state
    afterwards."""
    from mooncake_kvaddr.integrations.vllm import plugin

    was = plugin.is_patched()
    had_receive = was and plugin.is_receive_patched()
    had_send = was and plugin.is_send_patched()
    plugin.unpatch()
    if mode != "vllm":
        receive = mode_flags(mode)[0]
        report = plugin.patch(receive=receive, send=receive)
        if not report.active or plugin.is_receive_patched() != receive or plugin.is_send_patched() != receive:
            raise RuntimeError(f"plugin not active as {mode!r}: {report.reason or report.receive_reason}")
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
        head_size = shape.region_bytes // (BLOCK * 2)
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
        self.caches = [
            torch.zeros((self.num_blocks, BLOCK, head_size), dtype=torch.float16) for _ in range(shape.regions)
        ]
        for cache in self.caches:
            storage = cache.untyped_storage()
            code = self.store.register_buffer(storage.data_ptr(), storage.nbytes())
            if code != 0:
                raise RuntimeError(f"register_buffer failed: {code}")
        # ``groups`` > 1: a hybrid-width model, the regions split between full-attention groups of different
        # layer counts (:func:`_group_split`): rows of different widths per group.
        split = _group_split(shape.regions, groups)
        spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=head_size, dtype=torch.float16)
        specs = [KVCacheGroupSpec([f"layer.{i}" for i in range(a, b)], spec) for a, b in split]
        self.coord = coordinator.MooncakeStoreCoordinator(specs, scheduler_block_size=BLOCK, hash_block_size=BLOCK)
        self.dbs = [
            data.ChunkedTokenDatabase(data.KeyMetadata(model, 0, 0, 0, 0, group_id=g), BLOCK, hash_block_size=BLOCK)
            for g in range(groups)
        ]
        for db, (a, b) in zip(self.dbs, split, strict=True):
            db.store_layout.register_kv_caches(self.caches[a:b], self.num_blocks)
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
            req_id=req_id, token_len_chunk=len(hashes) * BLOCK, block_ids=(self.block_ids(),) * len(self.dbs),
            block_hashes=hashes, can_save=True, store_job_id=job,
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
        n = len(hashes) * BLOCK
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


# --- GIL accounting ------------------------------------------------------------------------------------------


class _Spinner:
    """A busy Python thread recording every gap over 0.2 ms as ``(start, end)``: time it could not run."""

    GAP = 0.0002

    def __init__(self) -> None:
        self.gaps: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="plugin-bench-spinner")
        self._thread.start()
        time.sleep(0.01)

    def _run(self) -> None:
        clock = time.perf_counter
        last = clock()
        gaps = self.gaps
        while not self._stop.is_set():
            now = clock()
            if now - last > self.GAP:
                gaps.append((last, now))
            last = now

    def window(self, start: float, end: float) -> list[tuple[float, float]]:
        """Gaps clipped to ``[start, end]``."""
        return [(max(a, start), min(b, end)) for a, b in self.gaps if b > start and a < end]

    def close(self) -> None:
        """Stop the thread."""
        self._stop.set()
        self._thread.join()


class _Phases:
    """Wall intervals each instrumented phase ran in, and the calling thread's CPU time in it.

    The CPU time of the receive thread (``time.thread_time``) is what it spent running: with the GIL held,
    except inside native sections that release it (our gather/scatter copies, timed as their own phase).
    Unlike the busy thread's stalls it is not inflated when other processes take the machine's cores.
    """

    def __init__(self) -> None:
        self.intervals: dict[str, list[tuple[float, float]]] = {}
        self.cpu: dict[str, float] = {}
        self.native_cpu = 0.0  # CPU time of the calling thread inside native-client calls
        self.native_held = 0.0  # the part of those calls' wall time with the GIL held (see _NativeTimer)
        self._lock = threading.Lock()

    def clear(self) -> None:
        """Forget every interval and CPU total."""
        with self._lock:
            self.intervals.clear()
            self.cpu.clear()
            self.native_cpu = self.native_held = 0.0

    def add_native(self, cpu: float, held: float) -> None:
        """Account one native-client call."""
        with self._lock:
            self.native_cpu += cpu
            self.native_held += held

    def timed(self, name: str, func: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            cpu0 = time.thread_time()
            try:
                return func(*args, **kwargs)
            finally:
                cpu = time.thread_time() - cpu0
                end = time.perf_counter()
                with self._lock:
                    self.intervals.setdefault(name, []).append((start, end))
                    self.cpu[name] = self.cpu.get(name, 0.0) + cpu

        return wrapper


class _NativeTimer:
    """A native Mooncake client whose batch calls are accounted in ``phases``: the calling thread's CPU time,
    and the call's wall time minus the interval its C++ ran with the GIL released
    (``mooncake_client_last_release_ns``, which counts the wait to take the GIL back as released): the part
    it held the GIL, i.e. converting the arguments and the results."""

    def __init__(self, client: Any, phases: _Phases) -> None:
        self._client = client
        self._phases = phases

    def __getattr__(self, name: str) -> Any:
        from mooncake_kvaddr import _native

        target = getattr(self._client, name)
        if not name.startswith("batch_"):
            return target

        def call(*args: Any) -> Any:
            cpu0, start = time.thread_time(), time.perf_counter()
            result = target(*args)  # a refused call raises before Mooncake: not accounted
            wall, cpu = time.perf_counter() - start, time.thread_time() - cpu0
            released = _native.mooncake_client_last_release_ns() / 1e9
            self._phases.add_native(cpu, max(0.0, wall - released))
            return result

        return call


def _overlap(gaps: list[tuple[float, float]], intervals: list[tuple[float, float]]) -> float:
    total = 0.0
    for a, b in gaps:
        for c, d in intervals:
            lo, hi = max(a, c), min(b, d)
            if hi > lo:
                total += hi - lo
    return total


class _Proxy:
    """A store proxy: the named methods timed as phases, everything else forwarded."""

    def __init__(self, store: Any, phases: _Phases, timed: dict[str, str]) -> None:
        self._store = store
        for method, phase in timed.items():
            if getattr(store, method, None) is not None:
                setattr(self, method, phases.timed(phase, getattr(store, method)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


class _ArrayProxy(_Proxy):
    """A timed proxy of an array store (registered with the receive handler's ``ArrayStore`` when first used)."""


def _instrument(rig: VllmStoreRig, phases: _Phases, receive_handler: bool) -> Callable[[], None]:
    """Time the layout's ``prepare_values`` (vLLM's handler) or the receive handler's plan (ours), the store
    call, and (staged) Mooncake's slot call under it."""
    from mooncake_kvaddr.integrations.vllm import receive

    receive.ArrayStore.register(_ArrayProxy)
    layout = rig.db.store_layout
    plan_request = receive.plan_request
    if receive_handler:
        # An instance override of prepare_values would send the request to vLLM's handler: time the plan.
        receive.plan_request = phases.timed("prepare_values", plan_request)
    else:
        layout.__dict__["prepare_values"] = phases.timed("prepare_values", layout.prepare_values)
    timed = {"batch_get_into_multi_buffers": "store call", receive.ARRAY_ENTRY: "store call"}
    # The receive handler picks the array entry by the store's type: a timed array store stays one.
    proxy = (_ArrayProxy if isinstance(rig.store, receive.ArrayStore) else _Proxy)(rig.store, phases, timed)
    inner = getattr(rig.store, "_store", None)
    if inner is not None:
        bound = {"batch_get_into": "mooncake slot call", "batch_get_into_multi_buffers": "mooncake bound call"}
        rig.store._store = _Proxy(inner, phases, bound)
    for receiver in rig.receivers:
        receiver.store = proxy
        receiver.__dict__["_handle_request"] = phases.timed("request", receiver._handle_request)
    from mooncake_kvaddr.integrations.vllm import staged_store as staged_module
    from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore

    staged_store: Any = staged_module
    copy = staged_store.scatter
    staged_store.scatter = phases.timed("scatter (GIL released)", copy)
    native_store = next((s for s in (rig.store, inner) if isinstance(s, NativeMooncakeStore)), None)
    native_client = None if native_store is None else native_store.native_client
    if native_store is not None and native_client is not None:
        native_store._client = _NativeTimer(native_client, phases)

    def undo() -> None:
        if native_store is not None and native_client is not None:
            native_store._client = native_client
        layout.__dict__.pop("prepare_values", None)
        receive.plan_request = plan_request
        staged_store.scatter = copy
        for receiver in rig.receivers:
            receiver.store = rig.store
            receiver.__dict__.pop("_handle_request", None)
        if inner is not None:
            rig.store._store = inner

    return undo


# --- the measurement ------------------------------------------------------------------------------------------


def _single_requests(
    rig: VllmStoreRig, hashes: list[Any], expected: list[Any], reps: int, tag: str, receive_handler: bool
) -> dict[str, Any]:
    """One request at a time on one receive thread, beside a busy Python thread.

    Two views of the GIL per request (medians, ms): ``stall_*`` — time the busy thread could not run,
    attributed to the phase it overlapped (on a loaded machine this includes time the OS gave the cores to
    other processes); ``cpu_*`` — the receive thread's own CPU time by phase (GIL held, except the copies
    timed as ``cpu_copy_released``, and the native-client calls' CPU beyond their GIL-held wall time, timed as
    ``cpu_native_released``). ``cpu_gil`` = request CPU - both. ``cpu_bound_call``: the CPU of Mooncake's bound
    ``batch_get_into_multi_buffers`` (argument conversion plus its C++ call on this thread).
    """
    rig.start_receivers(1)
    phases = _Phases()
    undo = _instrument(rig, phases, receive_handler)
    spinner = _Spinner()
    samples: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value * 1e3)

    ok = True
    try:
        for rep in range(reps + 1):
            rig.zero()
            phases.clear()
            start = time.perf_counter()
            failed = rig.load_requests([f"{tag}-single-{rep}"], hashes)
            end = time.perf_counter()
            ok = ok and not failed and rig.verify(expected)
            if rep == 0:
                continue  # warm-up (row caches, first touch of the staging buffer)
            gaps = spinner.window(start, end)
            held = sum(b - a for a, b in gaps)
            pv = _overlap(gaps, phases.intervals.get("prepare_values", []))
            call = _overlap(gaps, phases.intervals.get("store call", []))
            add("wall", end - start)
            add("stall", held)
            add("stall_vllm_python", max(0.0, held - pv - call))
            add("stall_prepare_values", pv)
            add("stall_store_call", call)
            cpu = phases.cpu
            request = cpu.get("request", 0.0)
            copy = cpu.get("scatter (GIL released)", 0.0)
            store_call = cpu.get("store call", 0.0)
            slots = cpu.get("mooncake slot call", 0.0)
            native_released = max(0.0, phases.native_cpu - phases.native_held)
            add("cpu_request", request)
            add("cpu_gil", request - copy - native_released)
            add("cpu_vllm_python", request - cpu.get("prepare_values", 0.0) - store_call)
            add("cpu_prepare_values", cpu.get("prepare_values", 0.0))
            # Mooncake's own part of the store call: the whole call without staging, the slot call with it.
            add("cpu_mooncake_call", slots if "mooncake slot call" in cpu else store_call)
            add("cpu_staging_python", store_call - slots - copy if "mooncake slot call" in cpu else 0.0)
            # Mooncake's bound multi-buffer get: the store call itself on a plain store, else a wrapper's call of it.
            add("cpu_bound_call", store_call if rig.store is rig.raw_store else cpu.get("mooncake bound call", 0.0))
            add("cpu_copy_released", copy)
            add("cpu_native_released", native_released)
    finally:
        spinner.close()
        undo()
    out: dict[str, Any] = {"bytes_ok": ok}
    for name, values in samples.items():
        out[f"{name}_ms"] = statistics.median(values)
    return out


def _restore_env(saved: dict[str, str | None]) -> None:
    import os

    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _wait_for_segment(rig: VllmStoreRig, timeout: float = 30.0) -> None:
    """Until a small put finds space: the remote segment holder has mounted its segment."""
    deadline = time.monotonic() + timeout
    while rig.raw_store.put("plugin-bench-ready", b"x") != 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no segment to store into after {timeout} s (the segment holder did not come up)")
        time.sleep(0.2)


def _conversion_ms(rig: VllmStoreRig, reps: int) -> float | None:
    """Median thread CPU (ms) Mooncake's bound ``batch_get_into_multi_buffers`` spends converting one request's
    rows as lists of Python ints (what vLLM hands it), with the GIL held and nothing transferred: called with no
    key, the binding converts every argument, then answers ``[]`` (``MooncakeStore.time_argument_conversion``).
    Part of vLLM alone's GIL time that its ``cpu_*`` split counts in the store call; None when the binding
    answered anything else."""
    regions = [cache.untyped_storage().data_ptr() for cache in rig.caches]
    stride = rig.shape.region_bytes
    addrs = [[base + block * stride for base in regions] for block in rig.block_ids()]
    sizes = [[stride] * len(regions) for _ in addrs]
    samples = []
    for _ in range(max(reps, 1)):
        cpu0 = time.thread_time()
        out = rig.raw_store.batch_get_into_multi_buffers([], addrs, sizes)
        samples.append((time.thread_time() - cpu0) * 1e3)
        if list(out):
            return None
    return statistics.median(samples)


def _measure_mode(
    master: str, shape: RigShape, mode: str, reps: int, thread_counts: tuple[int, ...], *, remote: bool = False
) -> dict[str, Any]:
    import os

    row: dict[str, Any] = {"mode": mode, "tokens": shape.tokens, "regions": shape.regions, "remote": remote}
    receive_handler, staged, native = mode_flags(mode)
    with contextlib.ExitStack() as stack:
        if native_off(mode):  # read when the wrapper first probes for its native client (its first batch call)
            from mooncake_kvaddr.driver.native_client import ENV_VAR

            stack.callback(_restore_env, {ENV_VAR: os.environ.get(ENV_VAR)})
            os.environ[ENV_VAR] = "0"
        stack.enter_context(plugin_mode(mode))
        staging = max(shape.request_bytes // 2, 64 << 20)
        rig = VllmStoreRig(master, shape, staged=staged, native=native, staging_bytes=staging,
                           model=f"bench/{mode}", segment=not remote)  # fmt: skip
        stack.callback(rig.close)
        if remote:
            _wait_for_segment(rig)
        hashes = rig.hashes(MODES.index(mode) + 1, shape.blocks)
        rig.fill(7)
        expected = rig.snapshot()
        rig.store_request(f"store-{mode}", hashes)
        handler = rig._worker.KVCacheStoreRecvingThread._handle_request
        fallbacks = handler.stats.fallback_requests if receive_handler else 0
        row.update(_single_requests(rig, hashes, expected, reps, mode, receive_handler))
        conversion = row["mooncake_conversion_ms"] = _conversion_ms(rig, reps)
        if conversion is not None:
            # What surely held the GIL: cpu_gil less the part of Mooncake's bound call beyond converting its rows
            # (its C++ call on this thread, GIL released or not: cpu_gil counts it whole).
            row["cpu_gil_floor_ms"] = row["cpu_gil_ms"] - max(0.0, row["cpu_bound_call_ms"] - conversion)
        ok = bool(row["bytes_ok"])
        for count in thread_counts:
            rig.start_receivers(count)
            samples = []
            for rep in range(reps + 1):
                rig.zero()
                start = time.perf_counter()
                failed = rig.load_requests([f"{mode}-{count}thr-{rep}-{i}" for i in range(4)], hashes)
                samples.append(time.perf_counter() - start)
                ok = ok and not failed and rig.verify(expected)
            row[f"wall_4req_{count}thr_ms"] = statistics.median(samples[1:]) * 1e3
        row["bytes_ok"] = ok
        if receive_handler:  # requests our handler handed to vLLM's (0: every one took the fast path)
            row["recv_fallbacks"] = handler.stats.fallback_requests - fallbacks
        if native:  # which client the wrapper's calls went to (a *_native_off mode: the bound methods only)
            from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore

            wrapper = rig.store.wrapped if staged else rig.store
            assert isinstance(wrapper, NativeMooncakeStore)
            row["native_client"] = wrapper.native_client is not None
            row["native_calls"] = wrapper.stats.native_calls
            row["fallback_calls"] = wrapper.stats.fallback_calls
    return row


def run(
    quick: bool = True,
    *,
    reps: int | None = None,
    master_address: str | None = None,
    modes: tuple[str, ...] = MODES,
    remote: bool = False,
    thread_counts: tuple[int, ...] = (1, 2, 4),
) -> list[dict[str, Any]]:
    """Measure ``modes`` (default all of :data:`MODES`); one dict per mode, times in ms, ``bytes_ok`` per mode.

    Starts an embedded master unless ``master_address`` is given. ``quick`` uses a small request
    (:data:`QUICK`); otherwise the headline one (:data:`HEADLINE`). The 4-request rows load the same stored
    request 4 times into the same blocks (identical bytes). ``remote``: vLLM's worker holds no segment; a
    separate ``mooncake_client`` process does, so every byte crosses Mooncake's TCP transport between
    processes (request :data:`REMOTE`, or :data:`QUICK` with ``quick``; Mooncake's TCP queue limits raised as
    in :data:`REMOTE_TCP_ENV`, set in this process's environment for the run and restored after).
    ``thread_counts``: the receive-thread counts of the 4-request rows (empty: single requests only).
    """
    import os

    from mooncake_kvaddr.driver.master import EmbeddedMaster

    shape = QUICK if quick else (REMOTE if remote else HEADLINE)
    reps = reps if reps is not None else (3 if quick else 5)
    with contextlib.ExitStack() as stack:
        if remote:
            saved = {name: os.environ.get(name) for name in REMOTE_TCP_ENV}
            stack.callback(_restore_env, saved)
            os.environ.update(REMOTE_TCP_ENV)  # before any Mooncake client (and the holder) starts
        if master_address is None:
            master = stack.enter_context(EmbeddedMaster())
            master_address = master.rpc_address
        if remote:
            from mooncake_kvaddr.bench.tcp import segment_holder

            stack.enter_context(segment_holder(master_address, 2 * len(modes) * shape.request_bytes + (256 << 20)))
        return [_measure_mode(master_address, shape, mode, reps, thread_counts, remote=remote) for mode in modes]


def main(argv: list[str] | None = None) -> None:  # pragma: no cover - manual runs
    """``python -m mooncake_kvaddr.bench.vllm_plugin [--full] [--reps N] [--modes M,...] [--threads N,...]
    [--json PATH]``: print (and write) JSON rows."""
    import argparse
    import json
    import os
    import sys

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--full", action="store_true", help="the headline request instead of the quick one")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    parser.add_argument("--remote", action="store_true", help="the segment in another process: TCP between processes")
    parser.add_argument(
        "--threads", default="1,2,4", help="receive-thread counts of the 4-request rows, comma-separated ('' for none)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the rows to PATH")
    args = parser.parse_args(argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}")
    threads = tuple(int(t) for t in args.threads.split(",") if t)
    rows = run(quick=not args.full, reps=args.reps, modes=modes, remote=args.remote, thread_counts=threads)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    json.dump(rows, sys.stdout, indent=1)
    print(flush=True)
    os._exit(0)  # vLLM's receive threads block forever on their queues


if __name__ == "__main__":  # pragma: no cover
    main()
