"""The installed vLLM's own Mooncake store threads (0.33 or 0.34), with and without the plugin and its transports.

Usage: ``python -m mooncake_kvaddr.bench.vllm_plugin [--full] [--modes ...]``. Measures what the plugin exists to
cut, the GIL vLLM's real threads hold (:class:`VllmStoreRig` from :mod:`~mooncake_kvaddr.bench.vllm_rig`, GIL
accounting in :mod:`~mooncake_kvaddr.bench.vllm_instrument`): per request the wall time and GIL time by phase,
and 1/2/4 receive threads. Needs vLLM, torch and Mooncake, imported only when called (docs/vllm-plugin.md).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

from mooncake_kvaddr.bench.vllm_instrument import _instrument, _overlap, _Phases, _Spinner
from mooncake_kvaddr.bench.vllm_rig import (
    HEADLINE,
    MODES,
    QUICK,
    REMOTE,
    RigShape,
    VllmStoreRig,
    mode_flags,
    native_off,
    plugin_mode,
)

__all__ = ["HEADLINE", "MODES", "QUICK", "REMOTE", "RigShape", "VllmStoreRig", "plugin_mode", "run"]


#: Mooncake's TCP queue limits raised so that vLLM's one call per request (25,600 regions; four at once on
#: four receive threads) is admitted at all; with the defaults it fails every key (docs/vllm-plugin.md).
REMOTE_TCP_ENV = {
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
    "MC_TCP_ADMISSION_TIMEOUT_MS": "600000",
}


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
    answered anything else, or for the head-major rig (its rows are not one region per cache)."""
    if rig.shape.layout != "mla":
        return None
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

    row: dict[str, Any] = {"mode": mode, "tokens": shape.tokens, "regions": shape.regions, "remote": remote,
                           "layout": shape.layout}
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
        hashes = rig.hashes(MODES.index(mode) + 1, shape.units)
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
    shape: RigShape | None = None,
) -> list[dict[str, Any]]:
    """Measure ``modes`` (default all of :data:`MODES`); one dict per mode, times in ms, ``bytes_ok`` per mode.

    Starts an embedded master unless ``master_address`` is given. ``quick`` uses a small request
    (:data:`QUICK`); otherwise the headline one (:data:`HEADLINE`). The 4-request rows load the same stored
    request 4 times into the same blocks (identical bytes). ``remote``: vLLM's worker holds no segment; a
    separate ``mooncake_client`` process does, so every byte crosses Mooncake's TCP transport between
    processes (request :data:`REMOTE`, or :data:`QUICK` with ``quick``; Mooncake's TCP queue limits raised as
    in :data:`REMOTE_TCP_ENV`, set in this process's environment for the run and restored after).
    ``thread_counts``: the receive-thread counts of the 4-request rows (empty: single requests only).
    ``shape`` overrides the request.
    """
    import os

    from mooncake_kvaddr.driver.master import EmbeddedMaster

    shape = shape or (QUICK if quick else (REMOTE if remote else HEADLINE))
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
