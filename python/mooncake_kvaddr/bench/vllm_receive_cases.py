"""vLLM 0.33's own receive thread on the two loads that used to leave the plugin's fast path: a disk-offload
staging budget that splits the headline request into batches, and a hybrid model whose two KV-cache groups have
rows of different widths (67 + 33 regions). vLLM alone against the plugin's default (its receive handler and the
native client), one real Mooncake master; per load (medians, ms, beside a busy Python thread): wall, the receive
thread's GIL-held CPU (and vLLM's conservative floor: its bound call counted only for converting the rows), the
busy thread's stall, whether the bytes match. docs/benchmarks.md quotes it.
"""

from __future__ import annotations

import contextlib
from typing import Any

from mooncake_kvaddr.bench.vllm_plugin import _conversion_ms, _single_requests
from mooncake_kvaddr.bench.vllm_rig import HEADLINE, QUICK, RigShape, VllmStoreRig, mode_flags, plugin_mode

__all__ = ["CASES", "MODES", "run"]

#: Case -> (KV-cache groups, disk-offload staging budget as a fraction of the request's bytes).
CASES: dict[str, tuple[int, float | None]] = {"disk_offload": (1, 0.3), "hybrid_widths": (2, None)}
MODES = ("vllm", "recv_native")


def _measure(master: str, shape: RigShape, case: str, mode: str, reps: int) -> dict[str, Any]:
    groups, fraction = CASES[case]
    budget = None if fraction is None else int(shape.request_bytes * fraction)
    receive_handler, staged, native = mode_flags(mode)
    row: dict[str, Any] = {"case": case, "mode": mode, "groups": groups, "budget": budget}
    with contextlib.ExitStack() as stack:
        stack.enter_context(plugin_mode(mode))
        rig = VllmStoreRig(master, shape, staged=staged, native=native, model=f"cases/{case}/{mode}",
                           groups=groups, offload_budget=budget)  # fmt: skip
        stack.callback(rig.close)
        hashes = rig.hashes(40 + MODES.index(mode) + 2 * list(CASES).index(case), shape.blocks)
        rig.fill(9)
        expected = rig.snapshot()
        rig.store_request(f"store-{case}-{mode}", hashes)
        handler = rig._worker.KVCacheStoreRecvingThread._handle_request
        fallbacks = handler.stats.fallback_requests if receive_handler else 0
        row.update(_single_requests(rig, hashes, expected, reps, f"{case}-{mode}", receive_handler))
        if mode == "vllm":
            conversion = _conversion_ms(rig, reps)
            if conversion is not None:
                row["cpu_gil_floor_ms"] = row["cpu_gil_ms"] - max(0.0, row["cpu_bound_call_ms"] - conversion)
        if receive_handler:
            row["recv_fallbacks"] = handler.stats.fallback_requests - fallbacks
    return row


def run(quick: bool = True, *, reps: int | None = None, master_address: str | None = None) -> list[dict[str, Any]]:
    """One row per (case, mode); ``cpu_gil_x`` = vLLM alone's GIL ms / the plugin's, ``floor_x`` = vLLM alone's
    floor / the plugin's GIL ms."""
    from mooncake_kvaddr.driver.master import EmbeddedMaster

    shape = QUICK if quick else HEADLINE
    reps = reps if reps is not None else (3 if quick else 5)
    rows = []

    def measure(case: str, mode: str) -> dict[str, Any]:
        if master_address is not None:
            return _measure(master_address, shape, case, mode, reps)
        # A master of its own per rig: a closed rig's segment can linger in a master for a while, and a put the
        # master places there fails (TRANSFER_FAIL).
        with EmbeddedMaster() as master:
            return _measure(master.rpc_address, shape, case, mode, reps)

    for case in CASES:
        base = measure(case, "vllm")
        ours = measure(case, "recv_native")
        if ours["cpu_gil_ms"] > 0:
            ours["cpu_gil_x"] = base["cpu_gil_ms"] / ours["cpu_gil_ms"]
            if "cpu_gil_floor_ms" in base:
                ours["floor_x"] = base["cpu_gil_floor_ms"] / ours["cpu_gil_ms"]
        if ours["stall_ms"] > 0:
            ours["stall_x"] = base["stall_ms"] / ours["stall_ms"]
        rows += [base, ours]
    return rows


def main(argv: list[str] | None = None) -> None:  # pragma: no cover - manual runs
    """``python -m mooncake_kvaddr.bench.vllm_receive_cases [--full] [--reps N]``: the rows as JSON."""
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
