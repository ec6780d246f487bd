"""Benchmark: staged vs multi-buffer transfers over Mooncake's TCP transport between network namespaces.

Usage: ``python -m mooncake_kvaddr.bench.netns_tcp [--quick] [--json PATH]``. Between hosts every region crosses
TCP, where vLLM 0.33's one call per request fails beyond ~1-2 k regions; this measures our staged and split
multi-buffer paths beside it on a :class:`~mooncake_kvaddr.bench.netns.NetnsCluster`, every load verified byte
for byte, a failure reported as a failure (``docs/multihost.md``, "Benchmark").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mooncake_kvaddr.bench.netns import NetnsCluster, Worker, unavailable_reason

__all__ = ["PATHS", "Shape", "main", "run", "shapes"]

#: path name -> (store name in the client worker, KVTransfer mode)
PATHS: dict[str, tuple[str, str]] = {
    "staged": ("main", "staged"),
    "multi_buffer_split": ("main", "multi_buffer"),
    "multi_buffer_single_call": ("single", "multi_buffer"),
}
_BASELINE = "multi_buffer_split"
# Generous: a single-call failure can take Mooncake's 60 s transfer timeout, and the machine may be shared.
_CALL_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Shape:
    """One request: ``chunks`` keys of ``regions`` regions of ``block_bytes`` bytes."""

    name: str
    chunks: int
    regions: int
    block_bytes: int

    @property
    def nbytes(self) -> int:
        """Bytes moved per operation."""
        return self.chunks * self.regions * self.block_bytes


def shapes(quick: bool) -> list[Shape]:
    """The headline shape (2,258 keys x 100 regions x 2 KiB) and a 1,000-key shape; a tenth each if quick."""
    if quick:
        return [Shape("headline/10", 226, 100, 2048), Shape("1000-key/10", 100, 100, 2048)]
    return [Shape("headline", 2258, 100, 2048), Shape("1000-key", 1000, 100, 2048)]


def _status(outcomes: dict[str, int], error: str | None = None) -> str:
    failed = {k: n for k, n in outcomes.items() if k != "ok" and n}
    if not failed and not error:
        return "ok"
    parts = [f"{k} x {n}" for k, n in sorted(failed.items())]
    if error:
        parts.append(f"error: {error[:80]}")
    return "FAILED: " + ", ".join(parts)


def _measure(
    client: Worker, shape: Shape, path: str, reps: int
) -> tuple[list[float], list[float], str, str, bool, bool]:
    store_s: list[float] = []
    load_s: list[float] = []
    store_status = load_status = "ok"
    verified = True
    refilled = False
    for rep in range(reps):
        seed = 100 + rep
        client.call("remove_all", _CALL_TIMEOUT_S)
        client.call("fill", _CALL_TIMEOUT_S, cache=path, seed=seed)
        stored = client.call("store", _CALL_TIMEOUT_S, cache=path, tag="bench", chunks=shape.chunks)
        store_s.append(stored["seconds"])
        if not stored["stored_ok"] or stored["stored"] != shape.chunks:
            store_status = _status(stored["outcomes"]) if not stored["stored_ok"] else "FAILED: partial"
            # Put the data back through the staged path (it stores only the missing keys), so the load is timed.
            refilled = True
            client.call("fill", _CALL_TIMEOUT_S, cache="staged", seed=seed)
            again = client.call("store", _CALL_TIMEOUT_S, cache="staged", tag="bench", chunks=shape.chunks)
            if not again["stored_ok"]:
                raise RuntimeError(f"the staged refill failed: {again['outcomes']}")
        loaded = client.call("load", _CALL_TIMEOUT_S, cache=path, tag="bench", chunks=shape.chunks, seed=seed)
        load_s.append(loaded["seconds"])
        if loaded["reported_failed"] or loaded["error"]:
            load_status = _status(loaded["outcomes"], loaded["error"])
        verified &= loaded["verified"] == shape.chunks and loaded["wrong"] == 0 and loaded["stale"] == 0
        if store_status != "ok" and load_status != "ok":
            break  # fails both ways: not timed again (each failure may take a minute)
    return store_s, load_s, store_status, load_status, verified, refilled


def run(quick: bool = False, reps: int | None = None, only: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Measure every path on every shape of :func:`shapes` (those named in ``only``, if given); one row per
    (shape, path, operation).

    Row fields: ``shape``, ``chunks``, ``regions``, ``block_bytes``, ``bytes``, ``path``, ``op``
    (``"store"``/``"load"``), ``median_ms``, ``samples_ms``, ``mib_per_s`` (``None`` when failed), ``status``
    (``"ok"`` or ``"FAILED: <outcome> x <count>, ..."``), ``verified`` (every load's bytes checked; loads
    only), ``load_after_refill``, ``speedup_vs_multi_buffer_split`` (baseline median / this median; ``None``
    unless both succeeded). Raises ``RuntimeError`` with the reason when the harness cannot run here.
    """
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"multi-host bench unavailable: {reason}")
    reps = reps if reps is not None else (1 if quick else 3)
    selected = [s for s in shapes(quick) if not only or s.name in only]
    if not selected:
        raise ValueError(f"no shape named {list(only)}; shapes: {[s.name for s in shapes(quick)]}")
    rows: list[dict[str, Any]] = []
    largest = max(s.nbytes for s in selected)
    with NetnsCluster() as cluster:
        holder = cluster.spawn_worker("writer")
        # The holder's segment: one request's objects plus headroom; it only serves TCP.
        holder.call("setup", 60, master=cluster.master_address, hostname=cluster.nodes["writer"].address,
                    segment=largest + (largest >> 2) + (64 << 20))
        client = cluster.spawn_worker("reader")
        hostname = cluster.nodes["reader"].address
        client.call("setup", 60, master=cluster.master_address, hostname=hostname, segment=0)
        client.call("setup", 60, master=cluster.master_address, hostname=hostname, segment=0,
                    store="single", region_budget=1 << 30)
        for shape in selected:
            geometry = {"regions": shape.regions, "blocks": shape.chunks + 1, "block_bytes": shape.block_bytes,
                        "block_size": 16}
            for path, (store, mode) in PATHS.items():
                # The single-call path stands for vLLM, which probes no peer before its gets.
                client.call("cache", _CALL_TIMEOUT_S, cache=path, store=store, mode=mode,
                            probe_peers=False if path == "multi_buffer_single_call" else None, **geometry)
            measured: dict[str, dict[str, Any]] = {}
            for path in PATHS:
                store_s, load_s, store_status, load_status, verified, refilled = _measure(client, shape, path, reps)
                for op, samples, status in (("store", store_s, store_status), ("load", load_s, load_status)):
                    median = statistics.median(samples)
                    measured[f"{path}/{op}"] = row = {
                        "shape": shape.name, "chunks": shape.chunks, "regions": shape.regions,
                        "block_bytes": shape.block_bytes, "bytes": shape.nbytes, "path": path, "op": op,
                        "median_ms": median * 1e3, "samples_ms": [s * 1e3 for s in samples],
                        "mib_per_s": shape.nbytes / (1 << 20) / median if status == "ok" and median > 0 else None,
                        "status": status, "verified": verified if op == "load" else None,
                        "load_after_refill": refilled if op == "load" else None,
                    }  # fmt: skip
                    rows.append(row)
            for row in rows[-2 * len(PATHS) :]:
                base = measured[f"{_BASELINE}/{row['op']}"]
                ok = row["status"] == "ok" and base["status"] == "ok"
                row["speedup_vs_multi_buffer_split"] = base["median_ms"] / row["median_ms"] if ok else None
            client.call("remove_all", _CALL_TIMEOUT_S)
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a fixed-width text table."""
    lines = [
        f"{'shape':<12} {'path':<26} {'op':<6} {'median ms':>10} {'MiB/s':>8} {'vs split':>9}  status",
    ]
    for r in rows:
        mib = f"{r['mib_per_s']:.0f}" if r["mib_per_s"] else "-"
        speed = f"{r['speedup_vs_multi_buffer_split']:.1f}x" if r.get("speedup_vs_multi_buffer_split") else "-"
        status = r["status"]
        if r["op"] == "load":
            status += "" if r["verified"] else " (bytes NOT verified)"
            status += " (after staged refill)" if r["load_after_refill"] else ""
        lines.append(
            f"{r['shape']:<12} {r['path']:<26} {r['op']:<6} {r['median_ms']:>10.1f} {mib:>8} {speed:>9}  {status}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mooncake_kvaddr.bench.netns_tcp [--quick] [--reps N] [--json PATH]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a tenth of each shape, one repetition")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per path (default 3, quick 1)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--shape", action="append", default=[], help="only this shape (repeatable)")
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        print(f"multi-host bench skipped: {reason}")
        return 0
    t0 = time.perf_counter()
    rows = run(args.quick, args.reps, args.shape)
    print("Cross-namespace TCP (master, segment holder and client in three network namespaces); medians")
    print(format_table(rows))
    print(f"({time.perf_counter() - t0:.0f} s; shared machine, numbers are noisy)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(rows, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
