"""The installed vLLM's own send thread (0.33; a release whose send handler the plugin ports) storing the
headline request through a real Mooncake master: vLLM alone; the plugin's default (its send handler, int64
matrices to the native client); the plugin without a native client (Mooncake's bound method gets lists); the
plugin with ``MOONCAKE_KVADDR_VLLM_NATIVE_CLIENT=0`` (list rows). Per store (medians, ms, beside a busy Python
thread): wall time, the send thread's CPU and GIL-held time, the busy thread's stall; every key checked present
afterwards. docs/benchmarks.md quotes it.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from typing import Any

from mooncake_kvaddr.bench.vllm_instrument import _NativeTimer, _Phases, _Spinner
from mooncake_kvaddr.bench.vllm_plugin import _restore_env
from mooncake_kvaddr.bench.vllm_rig import HEADLINE, QUICK, RigShape, VllmStoreRig, mode_flags, native_off, plugin_mode

__all__ = ["VARIANTS", "run"]

#: Variant -> the bench rig's mode (docs/benchmarks.md names them).
VARIANTS = {
    "vllm": "vllm",
    "plugin": "recv_native",
    "plugin_native_off": "recv_native_off",
    "plugin_plain_store": "recv",
}


def _store_once(
    rig: VllmStoreRig, phases: _Phases, spinner: _Spinner, tag: str, seed: int, last: bool
) -> dict[str, float]:
    hashes = rig.hashes(seed, rig.shape.units)
    phases.clear()
    start = time.perf_counter()
    rig.store_request(tag, hashes)
    end = time.perf_counter()
    if last:  # an existence check leases the keys (no removal after it)
        keys = rig.keys(hashes)
        present = list(rig.raw_store.batch_is_exist(keys))
        if present != [1] * len(keys):
            raise RuntimeError(f"{tag}: {present.count(1)} of {len(keys)} keys stored")
    else:
        rig.raw_store.remove_all()  # room for the next store's new keys
    cpu = phases.cpu.get("request", 0.0)
    released = max(0.0, phases.native_cpu - phases.native_held)
    return {
        "wall_ms": (end - start) * 1e3,
        "cpu_ms": cpu * 1e3,
        "cpu_gil_ms": (cpu - released) * 1e3,
        "stall_ms": spinner_lost(spinner, start, end) * 1e3,
    }


def spinner_lost(spinner: _Spinner, start: float, end: float) -> float:
    """Seconds the busy thread could not run in ``[start, end]``."""
    return sum(b - a for a, b in spinner.window(start, end))


def _measure(master: str, shape: RigShape, variant: str, reps: int) -> dict[str, Any]:
    mode = VARIANTS[variant]
    _, staged, native = mode_flags(mode)
    row: dict[str, Any] = {"variant": variant, "blocks": shape.blocks, "regions": shape.regions,
                           "layout": shape.layout}
    with contextlib.ExitStack() as stack:
        if native_off(mode):
            from mooncake_kvaddr.driver.native_client import ENV_VAR

            stack.callback(_restore_env, {ENV_VAR: os.environ.get(ENV_VAR)})
            os.environ[ENV_VAR] = "0"
        stack.enter_context(plugin_mode(mode))
        rig = VllmStoreRig(master, shape, staged=staged, native=native, model=f"send/{variant}")
        stack.callback(rig.close)
        rig.fill(3)
        phases = _Phases()
        sender = rig.sender
        sender.__dict__["_handle_request"] = phases.timed("request", sender._handle_request)
        stack.callback(sender.__dict__.pop, "_handle_request", None)
        client = rig.store.native_client if native else None
        if client is not None:
            rig.store._client = _NativeTimer(client, phases)
        spinner = _Spinner()
        stack.callback(spinner.close)
        handler = type(sender).__dict__["_handle_request"]
        fast0 = handler.stats.fast_requests if hasattr(handler, "stats") else 0
        samples: dict[str, list[float]] = {}
        for rep in range(reps + 1):
            got = _store_once(rig, phases, spinner, f"send-{variant}-{rep}", 500 + rep, rep == reps)
            if rep:  # rep 0 warms the row caches and the segment
                for name, value in got.items():
                    samples.setdefault(name, []).append(value)
        row.update({name: statistics.median(values) for name, values in samples.items()})
        row["native_client"] = client is not None
        row["fast_path"] = handler.stats.fast_requests - fast0 if hasattr(handler, "stats") else 0
        row["stored_ok"] = True
    return row


def run(
    quick: bool = True, *, reps: int | None = None, master_address: str | None = None,
    variants: tuple[str, ...] = tuple(VARIANTS), shape: RigShape | None = None,
) -> list[dict[str, Any]]:
    """One row per variant of ``variants`` ("vllm" first; times in ms; ``cpu_gil_x``/``stall_x``: vLLM alone's
    value / the variant's). ``shape``: the request (default :data:`QUICK` or :data:`HEADLINE`)."""
    if not variants or variants[0] != "vllm" or any(v not in VARIANTS for v in variants):
        raise ValueError(f"variants must start with 'vllm' and be among {list(VARIANTS)}, got {variants}")
    from mooncake_kvaddr.driver.master import EmbeddedMaster

    shape = shape or (QUICK if quick else HEADLINE)
    reps = reps if reps is not None else (3 if quick else 5)
    with contextlib.ExitStack() as stack:
        if master_address is None:
            master_address = stack.enter_context(EmbeddedMaster()).rpc_address
        rows = [_measure(master_address, shape, variant, reps) for variant in variants]
    base = rows[0]
    for row in rows:
        for key in ("cpu_gil_ms", "stall_ms"):
            if row[key] > 0:
                row[key.replace("_ms", "_x")] = base[key] / row[key]
    return rows


def main(argv: list[str] | None = None) -> None:  # pragma: no cover - manual runs
    """``python -m mooncake_kvaddr.bench.vllm_send [--full] [--reps N]``: print the rows as JSON."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--full", action="store_true", help="the headline request instead of the quick one")
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args(argv)
    for row in run(not args.full, reps=args.reps):
        print(json.dumps(row))


if __name__ == "__main__":  # pragma: no cover
    main()
