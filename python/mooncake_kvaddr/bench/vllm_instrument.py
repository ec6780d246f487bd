"""GIL accounting around vLLM's store threads: a busy spinner thread, per-phase wall and CPU timers, and the store
proxies that time the store calls. Split out of :mod:`~mooncake_kvaddr.bench.vllm_plugin` so that the receive
(``vllm_plugin``, ``vllm_receive_cases``) and send (``vllm_send``) measurements share one set of instruments.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from mooncake_kvaddr.bench.vllm_rig import VllmStoreRig

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
