"""Sections whose producers return plain rows, printed through the one harness.

- ``layouts``: vLLM 0.33 store layouts — our layout engine beside vLLM's own ``prepare_values``
  (:mod:`mooncake_kvaddr.bench.vllm_layouts`; docs/vllm.md).
- ``native_client``: Mooncake's bound multi-buffer methods beside our native client calls
  (:mod:`mooncake_kvaddr.bench.native_client`; docs/native-client.md).
- ``vllm_threads``: vLLM 0.33's own send/receive threads without the plugin, with it, and with the staged
  transport (:mod:`mooncake_kvaddr.bench.vllm_plugin`; docs/vllm-plugin.md).
- ``vllm_lookup``: vLLM 0.33's ``MooncakeStoreWorker.lookup`` at TP 8 without the plugin, with it, and with it
  but without the native client (:mod:`mooncake_kvaddr.bench.vllm_lookup`; docs/vllm-plugin.md).
- ``multihost``: cross-namespace TCP (:mod:`mooncake_kvaddr.bench.netns_tcp`; docs/multihost.md).

Each producer returns plain row dicts; this module only chooses the columns and names the baseline.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from mooncake_kvaddr.bench.harness import Col, skipped, table


def _rows_by(rows: Sequence[dict[str, Any]], *keys: str) -> dict[str, dict[str, Any]]:
    return {" / ".join(str(row.get(k)) for k in keys): row for row in rows}


def layouts(quick: bool) -> dict[str, Any] | None:
    """Our layout engine vs vLLM 0.33's ``prepare_values`` (or its numpy equivalent without vLLM)."""
    from mooncake_kvaddr.bench import vllm_layouts

    rows = vllm_layouts.run(quick)
    reference = rows[0].get("reference", "vLLM 0.33 prepare_values") if rows else "vLLM 0.33 prepare_values"
    cols = (Col("median_ms", "median ms"), Col("min_ms", "min ms"),
            Col("speedup_vs_reference", "speed-up", ".1f", "x"), Col("speedup_of_minima", "x (minima)", ".1f", "x"))
    return table("vLLM 0.33 store layouts: prepare_values per request (rank-local headline, TP-shared LBNHC)",
                 f"{reference} (speed-up = its median / the variant's median)", _rows_by(rows, "case", "variant"),
                 cols, label="case / variant")


def native_client(quick: bool) -> dict[str, Any] | None:
    """Mooncake's bound methods vs our native client, per load and store."""
    from mooncake_kvaddr.bench import native_client as producer

    rows = producer.run(quick=quick)
    if rows and "skipped" in rows[0]:
        skipped("native_client", str(rows[0]["skipped"]))
        return None
    shape = f"{rows[0]['keys']} keys, {rows[0]['mib']} MiB" if rows else ""
    cols = (Col("total_ms_median", "total ms", ".1f"), Col("vs_bound_median", "x bound time", ".2f"),
            Col("gil_held_ms_median", "GIL held ms"), Col("gil_held_ms_min", "GIL min ms"),
            Col("correct", "bytes ok"))
    return table(f"Native Mooncake client vs the bound methods: {shape}, in-process store",
                 "Mooncake's bound method with the same inputs (x bound time = this path's median / bound's)",
                 _rows_by(rows, "op", "path"), cols, label="op / path")


def vllm_threads(quick: bool) -> dict[str, Any] | None:
    """vLLM 0.33's own threads: without the plugin, with it, with the staged transport."""
    try:
        vllm_plugin = importlib.import_module("mooncake_kvaddr.bench.vllm_plugin")
    except ImportError as exc:
        skipped("vllm_threads", f"plugin bench unavailable: {exc}")
        return None
    rows: list[dict[str, Any]] = vllm_plugin.run(quick)
    if not rows:
        return None
    base = next((row for row in rows if row.get("mode") == "vllm"), rows[0])
    for row in rows:
        for key in ("cpu_gil_ms", "stall_ms"):
            if row.get(key) and base.get(key):
                row[key.replace("_ms", "_x")] = base[key] / row[key]
    cols = (Col("wall_ms", "wall ms", ".1f"), Col("cpu_gil_ms", "GIL ms", ".1f"), Col("cpu_gil_x", "GIL x", ".1f", "x"),
            Col("stall_ms", "stall ms", ".1f"), Col("stall_x", "stall x", ".1f", "x"),
            Col("cpu_vllm_python_ms", "vLLM py", ".1f"), Col("cpu_prepare_values_ms", "plan", ".1f"),
            Col("cpu_mooncake_call_ms", "mooncake", ".1f"), Col("cpu_staging_python_ms", "staging py", ".1f"),
            Col("wall_4req_4thr_ms", "4 req/4 thr", ".0f"), Col("bytes_ok", "bytes ok"))
    return table("vLLM 0.33's own send/receive threads per request (real Mooncake master); GIL ms = receive-thread "
                 "CPU with the GIL (docs/vllm-plugin.md), stall = a busy Python thread's lost time",
                 "vLLM 0.33 alone (no plugin); x = its value / the mode's", _rows_by(rows, "mode"), cols, label="mode")


def vllm_lookup(quick: bool) -> dict[str, Any] | None:
    """vLLM 0.33's worker lookup (TP 8, every key stored): vLLM alone, the plugin, the plugin without the native
    client."""
    from mooncake_kvaddr.bench import vllm_lookup as producer

    rows = producer.run(quick)
    shape = f"{rows[0]['units']} units x {rows[0]['keys'] // rows[0]['units']} rank namespaces" if rows else ""
    cols = (Col("wall_ms", "wall ms"), Col("cpu_ms", "CPU ms"), Col("cpu_gil_ms", "GIL ms"),
            Col("cpu_gil_x", "GIL x", ".1f", "x"), Col("stall_ms", "stall ms"), Col("stall_x", "stall x", ".1f", "x"),
            Col("hit_ok", "same hit"))
    return table(f"vLLM 0.33's MooncakeStoreWorker.lookup per request ({shape}, real Mooncake master); GIL ms = the "
                 "calling thread's time with the GIL held (the native client's GIL-released part not counted), "
                 "stall = a busy Python thread's lost time",
                 "vLLM 0.33 alone; x = its value / the variant's", _rows_by(rows, "variant"), cols, label="variant")


def vllm_send(quick: bool) -> dict[str, Any] | None:
    """vLLM 0.33's send thread storing one request: vLLM alone, the plugin, the plugin without the native client
    (wrapper with Mooncake's bound methods; plain store)."""
    from mooncake_kvaddr.bench import vllm_send as producer

    rows = producer.run(quick)
    shape = f"{rows[0]['blocks']} chunks x {rows[0]['regions']} regions" if rows else ""
    cols = (Col("wall_ms", "wall ms"), Col("cpu_ms", "CPU ms"), Col("cpu_gil_ms", "GIL ms"),
            Col("cpu_gil_x", "GIL x", ".1f", "x"), Col("stall_ms", "stall ms"), Col("stall_x", "stall x", ".1f", "x"),
            Col("fast_path", "ours", ".0f"), Col("stored_ok", "stored"))
    return table(f"vLLM 0.33's KVCacheStoreSendingThread per store ({shape}, real Mooncake master); GIL ms = the send "
                 "thread's time with the GIL held (the native client's GIL-released part not counted), stall = a busy "
                 "Python thread's lost time, ours = stores our handler planned",
                 "vLLM 0.33 alone; x = its value / the variant's", _rows_by(rows, "variant"), cols, label="variant")


def vllm_receive_cases(quick: bool) -> dict[str, Any] | None:
    """vLLM 0.33's receive thread on a disk-offload load and a hybrid-width load: vLLM alone vs the plugin."""
    from mooncake_kvaddr.bench import vllm_receive_cases as producer

    rows = producer.run(quick)
    cols = (Col("wall_ms", "wall ms"), Col("cpu_gil_ms", "GIL ms"), Col("cpu_gil_floor_ms", "floor ms"),
            Col("cpu_gil_x", "GIL x", ".1f", "x"), Col("floor_x", "floor x", ".1f", "x"), Col("stall_ms", "stall ms"),
            Col("stall_x", "stall x", ".1f", "x"), Col("recv_fallbacks", "to vLLM", ".0f"), Col("bytes_ok", "bytes ok"))
    return table("vLLM 0.33's KVCacheStoreRecvingThread on a disk-offload load (budget 0.3 x the request) and a "
                 "hybrid load (two groups, rows of 67 and 33 regions), real Mooncake master; GIL ms = receive-thread "
                 "CPU with the GIL held; floor = vLLM's with its bound call counted only for converting the rows",
                 "vLLM 0.33 alone; x = its value / the plugin's", _rows_by(rows, "case", "mode"), cols,
                 label="case / mode")


def multihost(quick: bool) -> dict[str, Any] | None:
    """Cross-namespace TCP: staged vs multi-buffer (split) vs vLLM's single call."""
    from mooncake_kvaddr.bench import netns, netns_tcp

    reason = netns.unavailable_reason()
    if reason:
        skipped("multihost", reason)
        return None
    rows = netns_tcp.run(quick)
    cols = (Col("median_ms", "median ms", ".1f"), Col("mib_per_s", "MiB/s", ".0f"),
            Col("speedup_vs_multi_buffer_split", "x split", ".1f", "x"), Col("verified", "verified"),
            Col("status", "status"))
    return table("Cross-namespace TCP (master, writer, reader in three network namespaces)",
                 "multi-buffer split to the region budget (x split = its median / the path's median)",
                 _rows_by(rows, "shape", "path", "op"), cols, label="shape / path / op")
