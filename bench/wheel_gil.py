"""The receive thread's GIL per headline request on every Mooncake wheel of the wheel matrix (docs/benchmarks.md,
"Receive-thread GIL per wheel"; docs/native-client.md, "Wheel matrix").

Two commands:

- ``measure``: run in one wheel-matrix venv (``.ci/wheels --gil`` calls it with the leg's interpreter and
  ``LD_LIBRARY_PATH``). Runs the ``vllm_threads`` section's single-request part
  (:func:`mooncake_kvaddr.bench.vllm_plugin.run`: vLLM 0.33.0's real ``KVCacheStoreRecvingThread`` on the
  headline request, 289,024 tokens = 2,258 chunks x 100 regions x 2 KiB) for vLLM alone and the plugin's modes,
  one after the other in one process, and writes one JSON file: the rows, which Mooncake the process loaded (the
  native client's own probe of the distribution), whether the default mode's wrapper used the native client,
  the machine and its load average before and after.
- ``report``: reads every leg's JSON and writes the table (text) and one JSON document with the per-leg
  medians and the ratios vLLM alone / mode, taken within each leg's process.

    .ci/wheels --gil non-cuda cuda12 cuda13 cuda13-0.3.14      # measure, then report
    python3 bench/wheel_gil.py report --dir /tmp/mooncake_kvaddr_wheels/results
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from typing import Any

#: vLLM alone, the plugin's default (receive handler + native-client wrapper), the default wrapper without a
#: native client (an unverified wheel), and the plugin with ``MOONCAKE_KVADDR_VLLM_NATIVE_CLIENT=0`` (no wrapper).
DEFAULT_MODES = ("vllm", "recv_native", "recv_native_off", "recv")
LABELS = {
    "vllm": "vLLM alone",
    "recv_native": "plugin default",
    "recv_native_off": "plugin, no native client",
    "recv": "plugin, VLLM_NATIVE_CLIENT=0",
}


def measure(args: argparse.Namespace) -> int:
    from mooncake_kvaddr import __version__
    from mooncake_kvaddr.bench import vllm_plugin
    from mooncake_kvaddr.bench.harness import machine
    from mooncake_kvaddr.driver import native_client

    modes = tuple(m for m in args.modes.split(",") if m)
    load_before = os.getloadavg()
    started = time.time()
    rows = vllm_plugin.run(quick=args.quick, reps=args.reps, modes=modes, thread_counts=())
    doc = {
        "leg": args.leg,
        "wheel": args.wheel,
        "mooncake_distribution": list(native_client.mooncake_distribution() or ()),
        "store_library": native_client.store_library(),
        "mooncake_kvaddr": __version__,
        "machine": machine(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "seconds": round(time.time() - started, 1),
        "reps": args.reps,
        "quick": args.quick,
        "rows": rows,
    }
    with open(args.json, "w") as out:
        json.dump(doc, out, indent=1)
    print(json.dumps({row["mode"]: round(row.get("cpu_gil_ms", 0.0), 2) for row in rows}))
    sys.stdout.flush()
    os._exit(0)  # vLLM's receive threads block forever on their queues


def _fmt(value: Any, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def report(args: argparse.Namespace) -> int:
    docs = []
    for path in sorted(glob.glob(os.path.join(args.dir, "*.gil.json"))):
        with open(path) as f:
            docs.append(json.load(f))
    if args.legs:
        order = [leg for leg in args.legs.split(",") if leg]
        docs = sorted((d for d in docs if d["leg"] in order), key=lambda d: order.index(d["leg"]))
    if not docs:
        print(f"no *.gil.json in {args.dir}", file=sys.stderr)
        return 1
    legs = []
    lines = [
        "Receive-thread GIL per headline request (289,024 tokens = 2,258 chunks x 100 regions x 2 KiB),",
        "vLLM 0.33.0's own KVCacheStoreRecvingThread, per Mooncake wheel; medians of each leg's requests;",
        "ratios = vLLM alone / mode, within one process. cpu_gil: receive-thread CPU with the GIL held (ms);",
        "stall: a busy Python thread's lost time beside it (ms; also counts CPU starvation on a loaded machine).",
        "",
    ]
    header = (
        f"{'leg':<14} {'mode':<30} {'cpu_gil':>8} {'x vLLM':>7} {'floor':>7} {'stall':>7} {'x vLLM':>7} {'wall':>7} "
        f"{'native':>6} {'bytes':>5}"
    )
    for doc in docs:
        rows = {row["mode"]: row for row in doc["rows"]}
        base = rows.get("vllm", {})
        dist = doc.get("mooncake_distribution") or ["?", "?"]
        lines.append(
            f"[{doc['leg']}] {dist[0]} {dist[1]}; {doc['machine']['cpu']}, {doc['machine']['cores']} cores; "
            f"load average {doc['loadavg_before'][0]:.1f} -> {doc['loadavg_after'][0]:.1f}; {doc['started_utc']}"
        )
        lines.append(header)
        leg: dict[str, Any] = {
            "leg": doc["leg"],
            "wheel": doc["wheel"],
            "mooncake_distribution": dist,
            "started_utc": doc["started_utc"],
            "loadavg_before": doc["loadavg_before"],
            "loadavg_after": doc["loadavg_after"],
            "machine": doc["machine"],
            "reps": doc["reps"],
            "modes": {},
        }
        for mode, row in rows.items():
            gil, stall = row.get("cpu_gil_ms"), row.get("stall_ms")
            gil_x = base["cpu_gil_ms"] / gil if gil and base.get("cpu_gil_ms") else None
            stall_x = base["stall_ms"] / stall if stall and base.get("stall_ms") else None
            native = row.get("native_client")
            leg["modes"][mode] = {
                "label": LABELS.get(mode, mode),
                "cpu_gil_ms": gil,
                "cpu_gil_x_vllm": gil_x,
                "stall_ms": stall,
                "stall_x_vllm": stall_x,
                "wall_ms": row.get("wall_ms"),
                "conversion_ms": row.get("mooncake_conversion_ms"),
                "cpu_gil_floor_ms": row.get("cpu_gil_floor_ms"),
                "native_client": native,
                "native_calls": row.get("native_calls"),
                "fallback_calls": row.get("fallback_calls"),
                "recv_fallbacks": row.get("recv_fallbacks"),
                "bytes_ok": row.get("bytes_ok"),
                "phases_ms": {k: v for k, v in row.items() if k.startswith(("cpu_", "stall_")) and k.endswith("_ms")},
            }
            lines.append(
                f"{'':<14} {LABELS.get(mode, mode):<30} {_fmt(gil, '.2f'):>8} {_fmt(gil_x):>7} "
                f"{_fmt(row.get('cpu_gil_floor_ms')):>7} {_fmt(stall):>7} "
                f"{_fmt(stall_x):>7} {_fmt(row.get('wall_ms')):>7} {'-' if native is None else str(native):>6} "
                f"{row.get('bytes_ok')!s:>5}"
            )
        lines.append("")
        legs.append(leg)
    lines.append("cpu_gil counts Mooncake's bound call whole (an upper bound); floor = cpu_gil less that call's CPU")
    lines.append("beyond converting its rows (timed alone): what surely held the GIL. The default's cpu_gil is exact.")
    lines.append(
        f"{'leg':<14} {'vLLM alone cpu_gil':>19} {'floor':>7} {'plugin default':>15} {'ratio':>7} {'of floor':>9}"
        f" {'no native client floor':>23}"
    )
    for leg in legs:
        v, p = leg["modes"].get("vllm", {}), leg["modes"].get("recv_native", {})
        off = leg["modes"].get("recv_native_off", {})
        floor, exact = v.get("cpu_gil_floor_ms"), p.get("cpu_gil_ms")
        floor_x = floor / exact if floor is not None and exact else None
        v["gil_floor_x_default"] = floor_x
        lines.append(
            f"{leg['leg']:<14} {_fmt(v.get('cpu_gil_ms'), '.2f'):>19} {_fmt(floor, '.2f'):>7} {_fmt(exact, '.2f'):>15} "
            f"{_fmt(p.get('cpu_gil_x_vllm')):>6}x {_fmt(floor_x):>8}x {_fmt(off.get('cpu_gil_floor_ms'), '.2f'):>23}"
        )
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.txt:
        with open(args.txt, "w") as out:
            out.write(text)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"command": args.command_line, "legs": legs}, out, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    m = sub.add_parser("measure", help="run in one leg's venv")
    m.add_argument("--leg", required=True)
    m.add_argument("--wheel", required=True, help="NAME==VERSION of the leg's Mooncake wheel")
    m.add_argument("--json", required=True)
    m.add_argument("--reps", type=int, default=5)
    m.add_argument("--modes", default=",".join(DEFAULT_MODES))
    m.add_argument("--quick", action="store_true", help="the small request (a smoke run)")
    r = sub.add_parser("report", help="the table of every leg's JSON")
    wheels_dir = os.environ.get("WHEELS_DIR", "/tmp/mooncake_kvaddr_wheels")
    r.add_argument("--dir", default=os.path.join(wheels_dir, "results"))
    r.add_argument("--legs", default="", help="comma-separated legs, in table order (default: every file)")
    r.add_argument("--json", default="")
    r.add_argument("--txt", default="")
    r.add_argument("--command-line", default="", help="recorded in the JSON: how the legs were measured")
    args = parser.parse_args(argv)
    return measure(args) if args.what == "measure" else report(args)


if __name__ == "__main__":
    sys.exit(main())
