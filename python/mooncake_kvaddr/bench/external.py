"""Sections whose producers return plain rows, printed through the one harness.

The vLLM, native-client and multi-host measurements live in modules of their own and return plain row dicts, so
that tests and scripts can call them too; this module only chooses each section's columns and names its baseline
(``docs/benchmarks.md``, "Sections and their baselines", says which module produces which section).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from mooncake_kvaddr.bench.harness import Col, skipped, table


def _installed_vllm() -> str:
    """The installed vLLM's version, as the section titles name it."""
    import vllm

    return str(vllm.__version__)


def _not_ported(name: str, part: str) -> bool:
    """True (after one "skipped" line) when the plugin keeps vLLM's own ``part`` on the installed release: a
    section measuring that part would show no plugin at all (the side-by-side says "not ported")."""
    from mooncake_kvaddr.bench.vllm_releases import plugin_parts

    reason = plugin_parts()[part]
    if reason:
        skipped(name, f"the plugin's {part} part is not active on vLLM {_installed_vllm()}: {reason}")
    return bool(reason)


def _rows_by(rows: Sequence[dict[str, Any]], *keys: str) -> dict[str, dict[str, Any]]:
    return {" / ".join(str(row.get(k)) for k in keys): row for row in rows}


def layouts(quick: bool) -> dict[str, Any] | None:
    """Our layout engine vs the installed vLLM's ``prepare_values`` (or a numpy equivalent without vLLM)."""
    from mooncake_kvaddr.bench import vllm_layouts

    rows = vllm_layouts.run(quick)
    reference = rows[0].get("reference", "vLLM prepare_values") if rows else "vLLM prepare_values"
    release = rows[0].get("release") if rows else None
    cols = (Col("median_ms", "median ms"), Col("min_ms", "min ms"),
            Col("speedup_vs_reference", "speed-up", ".1f", "x"), Col("speedup_of_minima", "x (minima)", ".1f", "x"),
            Col("same_values", "same ints"))
    tp_shared = "head-major, half-block Store chunks" if any("head-major" in r["case"] for r in rows) else "LBNHC"
    return table(f"vLLM {release or '(not installed)'} store layouts: prepare_values per request (rank-local "
                 f"headline, TP-shared {tp_shared})",
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
    """The installed vLLM's own threads: without the plugin, with it, with the staged transport."""
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
    v = _installed_vllm()
    cols = (Col("wall_ms", "wall ms", ".1f"), Col("cpu_gil_ms", "GIL ms", ".1f"), Col("cpu_gil_x", "GIL x", ".1f", "x"),
            Col("stall_ms", "stall ms", ".1f"), Col("stall_x", "stall x", ".1f", "x"),
            Col("cpu_vllm_python_ms", "vLLM py", ".1f"), Col("cpu_prepare_values_ms", "plan", ".1f"),
            Col("cpu_mooncake_call_ms", "mooncake", ".1f"), Col("cpu_staging_python_ms", "staging py", ".1f"),
            Col("wall_4req_4thr_ms", "4 req/4 thr", ".0f"), Col("bytes_ok", "bytes ok"))
    return table(f"vLLM {v}'s own send/receive threads per request (real Mooncake master); GIL ms = receive-thread "
                 "CPU with the GIL (docs/vllm-plugin.md), stall = a busy Python thread's lost time",
                 f"vLLM {v} alone (no plugin); x = its value / the mode's", _rows_by(rows, "mode"), cols, label="mode")


def vllm_lookup(quick: bool) -> dict[str, Any] | None:
    """The installed vLLM's worker lookup (TP 8, every key stored): vLLM alone, the plugin, the plugin without
    the native client."""
    from mooncake_kvaddr.bench import vllm_lookup as producer

    if _not_ported("vllm_lookup", "lookup"):
        return None
    rows = producer.run(quick)
    shape = f"{rows[0]['units']} units x {rows[0]['keys'] // rows[0]['units']} rank namespaces" if rows else ""
    v = _installed_vllm()
    cols = (Col("wall_ms", "wall ms"), Col("cpu_ms", "CPU ms"), Col("cpu_gil_ms", "GIL ms"),
            Col("cpu_gil_x", "GIL x", ".1f", "x"), Col("stall_ms", "stall ms"), Col("stall_x", "stall x", ".1f", "x"),
            Col("hit_ok", "same hit"))
    return table(f"vLLM {v}'s MooncakeStoreWorker.lookup per request ({shape}, real Mooncake master); GIL ms = the "
                 "calling thread's time with the GIL held (the native client's GIL-released part not counted), "
                 "stall = a busy Python thread's lost time",
                 f"vLLM {v} alone; x = its value / the variant's", _rows_by(rows, "variant"), cols,
                 label="variant")


def vllm_send(quick: bool) -> dict[str, Any] | None:
    """The installed vLLM's send thread storing one request: vLLM alone, the plugin, the plugin without the
    native client (wrapper with Mooncake's bound methods; plain store)."""
    from mooncake_kvaddr.bench import vllm_send as producer

    if _not_ported("vllm_send", "send"):
        return None
    rows = producer.run(quick)
    shape = f"{rows[0]['blocks']} chunks x {rows[0]['regions']} regions" if rows else ""
    v = _installed_vllm()
    cols = (Col("wall_ms", "wall ms"), Col("cpu_ms", "CPU ms"), Col("cpu_gil_ms", "GIL ms"),
            Col("cpu_gil_x", "GIL x", ".1f", "x"), Col("stall_ms", "stall ms"), Col("stall_x", "stall x", ".1f", "x"),
            Col("fast_path", "ours", ".0f"), Col("stored_ok", "stored"))
    return table(f"vLLM {v}'s KVCacheStoreSendingThread per store ({shape}, real Mooncake master); GIL ms = the send "
                 "thread's time with the GIL held (the native client's GIL-released part not counted), stall = a busy "
                 "Python thread's lost time, ours = stores our handler planned",
                 f"vLLM {v} alone; x = its value / the variant's", _rows_by(rows, "variant"), cols,
                 label="variant")


def vllm_receive_cases(quick: bool) -> dict[str, Any] | None:
    """The installed vLLM's receive thread on a disk-offload load and a hybrid-width load: vLLM alone vs the plugin."""
    from mooncake_kvaddr.bench import vllm_receive_cases as producer

    if _not_ported("vllm_receive_cases", "receive"):
        return None
    rows = producer.run(quick)
    v = _installed_vllm()
    cols = (Col("wall_ms", "wall ms"), Col("cpu_gil_ms", "GIL ms"), Col("cpu_gil_floor_ms", "floor ms"),
            Col("cpu_gil_x", "GIL x", ".1f", "x"), Col("floor_x", "floor x", ".1f", "x"), Col("stall_ms", "stall ms"),
            Col("stall_x", "stall x", ".1f", "x"), Col("recv_fallbacks", "to vLLM", ".0f"), Col("bytes_ok", "bytes ok"))
    return table(f"vLLM {v}'s KVCacheStoreRecvingThread on a disk-offload load (budget 0.3 x the request) and a "
                 "hybrid load (two groups, rows of 67 and 33 regions), real Mooncake master; GIL ms = receive-thread "
                 "CPU with the GIL held; floor = vLLM's with its bound call counted only for converting the rows",
                 f"vLLM {v} alone; x = its value / the plugin's", _rows_by(rows, "case", "mode"), cols,
                 label="case / mode")


def vllm_releases(sections: dict[str, Any], quick: bool, reps: int | None, mooncake: bool) -> dict[str, Any] | None:
    """vLLM 0.33 and 0.34 side by side: the installed release's rows from the sections this run measured
    (``sections``), vLLM 0.34's from a child process in its own environment."""
    from mooncake_kvaddr.bench import vllm_releases as producer

    try:
        import vllm
    except Exception as exc:  # vLLM absent or broken here: nothing to put beside 0.34
        skipped("vllm_releases", f"vLLM not importable: {exc}")
        return None
    release = str(vllm.__version__)
    parts = producer.plugin_parts()

    def rows_of(name: str) -> list[dict[str, Any]] | None:
        section = sections.get(name)
        return None if section is None else list(section["rows"].values())

    rows = producer.layout_rows(release, rows_of("layouts") or [])
    if mooncake:
        rows += producer.receive_rows(release, rows_of("vllm_threads") or [], parts)
        rows += producer.send_rows(release, None if parts["send"] else rows_of("vllm_send"),
                                   parts["send"] or "no rows")
        rows += producer.lookup_rows(release, None if parts["lookup"] else rows_of("vllm_lookup"),
                                     parts["lookup"] or "no rows")
        if producer.release_series(release) in producer.HETERO_SERIES:
            rows += producer.hetero_rows(release, quick, reps, parts)
    installed = {"vllm": release, "parts": parts, "rows": rows}
    return producer.side_by_side(quick, reps, mooncake=mooncake, installed=installed)


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
