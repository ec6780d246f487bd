"""The plugin without a native client against vLLM alone, before and after the row fix (docs/benchmarks.md,
"The plugin without a native client").

vLLM 0.33.0's real receive thread on the headline request (bench.vllm_plugin's rig), in one process, in rounds
(each round a fresh embedded master; the variants in a rotating order): vLLM alone (``vllm``); the plugin's
default wrapper with no native client (``recv_native_off``) handing Mooncake's bound method the rows as
``numpy.tolist`` of both matrices (``off_tolist``: what the wrapper did before) and as
:func:`~mooncake_kvaddr.driver.store_calls.bound_rows` builds them (``off_rows``: now); the plugin
with ``MOONCAKE_KVADDR_VLLM_NATIVE_CLIENT=0`` (``recv``: no wrapper, the engine's list rows); the plugin's
default with the native client (``recv_native``). Per variant: the medians over rounds of each round's median
receive-thread GIL CPU (``cpu_gil``, an upper bound: it counts Mooncake's bound call whole), of its floor
(``cpu_gil_floor``: less that call's CPU beyond converting the rows, what surely held the GIL) and of the
busy-thread stall, and their ratio to vLLM alone.

    python3 bench/native_off_ab.py --rounds 3 --reps 5 --json bench/results/native_off_ab.json   # package installed
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

VARIANTS = {  # variant -> (bench.vllm_plugin mode, rows for Mooncake's bound method: "tolist" | "rows" | None)
    "vllm": ("vllm", None),
    "off_tolist": ("recv_native_off", "tolist"),
    "off_rows": ("recv_native_off", "rows"),
    "recv": ("recv", None),
    "recv_native": ("recv_native", None),
}


def _tolist_rows(addrs: Any, sizes: Any) -> tuple[list[Any], list[Any]]:
    return np.asarray(addrs).tolist(), np.asarray(sizes).tolist()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--quick", action="store_true", help="the small request (a smoke run)")
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    from mooncake_kvaddr.bench import vllm_plugin
    from mooncake_kvaddr.driver import store_calls
    from mooncake_kvaddr.driver.master import EmbeddedMaster

    rows_fn = store_calls.bound_rows
    variants = [v for v in args.variants.split(",") if v]
    shape = vllm_plugin.QUICK if args.quick else vllm_plugin.HEADLINE
    samples: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    load = [os.getloadavg()[0]]
    started = time.time()
    for r in range(args.rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        with EmbeddedMaster() as master:
            for variant in order:
                mode, form = VARIANTS[variant]
                store_calls.bound_rows = _tolist_rows if form == "tolist" else rows_fn
                try:
                    row = vllm_plugin._measure_mode(master.rpc_address, shape, mode, args.reps, ())
                finally:
                    store_calls.bound_rows = rows_fn
                if not row.get("bytes_ok"):
                    raise SystemExit(f"{variant}: bytes differ")
                samples[variant].append(row)
                load.append(os.getloadavg()[0])
                print(f"round {r} {variant}: cpu_gil {row['cpu_gil_ms']:.1f} ms (floor {row['cpu_gil_floor_ms']:.1f}), "
                      f"stall {row['stall_ms']:.1f} ms", flush=True)  # fmt: skip
    base_gil = statistics.median(s["cpu_gil_ms"] for s in samples["vllm"]) if "vllm" in samples else None
    base_stall = statistics.median(s["stall_ms"] for s in samples["vllm"]) if "vllm" in samples else None
    summary = {}
    base_floor = statistics.median(s["cpu_gil_floor_ms"] for s in samples["vllm"]) if "vllm" in samples else None
    head = f"{'cpu_gil ms':>10} {'x vLLM':>7} {'floor ms':>9} {'x vLLM':>7} {'stall ms':>9} {'x vLLM':>7}"
    print(f"\n{'variant':<12} {head}")
    for variant, rows in samples.items():
        gil = statistics.median(s["cpu_gil_ms"] for s in rows)
        floor = statistics.median(s["cpu_gil_floor_ms"] for s in rows)
        stall = statistics.median(s["stall_ms"] for s in rows)
        summary[variant] = {
            "mode": VARIANTS[variant][0],
            "cpu_gil_ms": gil,
            "cpu_gil_floor_ms": floor,
            "stall_ms": stall,
            "cpu_gil_x_vllm": base_gil / gil if base_gil else None,
            "cpu_gil_floor_x_vllm": base_floor / floor if base_floor else None,
            "stall_x_vllm": base_stall / stall if base_stall else None,
            "per_round": rows,
        }
        gx = f"{base_gil / gil:.2f}" if base_gil else "-"
        fx = f"{base_floor / floor:.2f}" if base_floor else "-"
        sx = f"{base_stall / stall:.2f}" if base_stall else "-"
        print(f"{variant:<12} {gil:>10.1f} {gx:>7} {floor:>9.1f} {fx:>7} {stall:>9.1f} {sx:>7}")
    print(f"load average during the run: {min(load):.1f}-{max(load):.1f}; {time.time() - started:.0f} s")
    if args.json:
        from mooncake_kvaddr.bench.harness import machine

        with open(args.json, "w") as out:
            doc = {"machine": machine(), "rounds": args.rounds, "reps": args.reps, "load_average": load,
                   "command": " ".join(["bench/native_off_ab.py", *sys.argv[1:]]), "variants": summary}  # fmt: skip
            json.dump(doc, out, indent=1)
    sys.stdout.flush()
    os._exit(0)  # vLLM's receive threads block forever on their queues


if __name__ == "__main__":
    sys.exit(main())
