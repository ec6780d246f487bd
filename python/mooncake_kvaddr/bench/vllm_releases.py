"""vLLM releases side by side: the release-aware vLLM measurements under the installed vLLM and, when vLLM
0.34's environment exists, under its Python as a child process, in one table (docs/benchmarks.md, "vLLM 0.34").

One vLLM per interpreter, so the second release runs in a child that writes its rows to a file. A part the
installed plugin does not patch on a release (its ``PatchReport``) gets a "not ported" row, never a figure.
``python -m mooncake_kvaddr.bench.vllm_releases [--quick] [--reps N] [--json PATH]`` runs only this.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mooncake_kvaddr.bench.harness import Col, table

__all__ = ["DEFAULT_VENV", "ENV_VENV", "HETERO_SERIES", "hetero_rows", "measure", "other_python", "release_series",
           "side_by_side", "summarise"]

#: vLLM 0.34's environment: the one CI's setup builds (``.ci/setup``), or where this variable points.
ENV_VENV = "MOONCAKE_KVADDR_VLLM034_VENV"
DEFAULT_VENV = "/opt/mooncake_kvaddr/vllm-0.34"
OTHER_SERIES = "0.34"
ALONE = "vLLM alone"
PLUGIN = "with the plugin"
NATIVE_OFF = "plugin, native client off"
#: The rig's modes the receive rows compare: vLLM untouched; the plugin's default (receive handler, layouts,
#: the store wrapped with the native client); the same with the native client switched off.
RECEIVE_MODES = ("vllm", "recv_native", "recv_native_off")
SEND_VARIANTS = ("vllm", "plugin", "plugin_native_off")
#: The producers' variant names -> the table's.
_VARIANTS = {"vllm": ALONE, "plugin": PLUGIN, "plugin_native_off": NATIVE_OFF, "recv_native": PLUGIN,
             "recv_native_off": NATIVE_OFF}  # fmt: skip
#: Layout cases whose rows the side-by-side carries (the section prints every variant).
_LAYOUT_METRIC = "prepare_values ms/request"
#: Releases whose threads also run the heterogeneous-TP request (``vllm_rig.HETERO``: head-major layout, local TP
#: 2 over Store TP 4, half-block Store chunks; vLLM 0.33 has no such layout).
HETERO_SERIES = ("0.34",)
_HETERO_CASE = "head-major TP 2 over 4, half-block Store chunks"


def release_series(version: str) -> str:
    """``"0.34"`` of ``"0.34.0"``."""
    return ".".join(version.split(".")[:2])


def plugin_parts() -> dict[str, str]:
    """Per part of the plugin (layouts, worker, receive, lookup, send): "" when it patches the installed vLLM,
    else the ``PatchReport``'s reason. The plugin's state is left as it was."""
    from mooncake_kvaddr.integrations.vllm import plugin

    was = plugin.is_patched()
    had = (was and plugin.is_receive_patched(), was and plugin.is_send_patched())
    plugin.unpatch()
    try:
        report = plugin.patch(receive=True, lookup=True, send=True)
        return {
            "layouts": "" if report.active else report.reason or "not patched",
            "worker": report.hook_reason if report.active else report.reason,
            "receive": report.receive_reason if report.active else report.reason,
            "lookup": report.lookup_reason if report.active else report.reason,
            "send": report.send_reason if report.active else report.reason,
        }
    finally:
        plugin.unpatch()
        if was:
            plugin.patch(receive=had[0], send=had[1])


def _row(release: str, section: str, case: str, metric: str, variant: str, median: float | None,
         note: str = "") -> dict[str, Any]:
    return {"release": release, "section": section, "case": case, "metric": metric, "variant": variant,
            "median": median, "note": note}


def layout_rows(release: str, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The layouts section's rows as side-by-side rows: per case, vLLM's own and the plugin's drop-in."""
    from mooncake_kvaddr.bench.vllm_layouts import DROP_IN

    out: list[dict[str, Any]] = []
    for row in rows:
        if row["variant"] == row.get("reference"):
            variant = ALONE
            note = f"{row['chunks']} chunks, {row.get('keys', row['chunks'])} keys x {row['segments']} segments"
        elif row["variant"] == DROP_IN:
            variant = PLUGIN
            note = f"drop-in on vLLM's class; same values, Python ints: {row.get('same_values')}"
        else:
            continue
        out.append(_row(release, "layouts", row["case"], _LAYOUT_METRIC, variant, row["median_ms"], note))
        if variant == ALONE and row.get("drop_in"):
            out.append(_row(release, "layouts", row["case"], _LAYOUT_METRIC, PLUGIN, None, row["drop_in"]))
    return out


def receive_rows(release: str, rows: Sequence[dict[str, Any]], parts: dict[str, str]) -> list[dict[str, Any]]:
    """The receive-thread rows (the rig's ``vllm`` and ``recv_native`` modes): GIL and wall per request."""
    out: list[dict[str, Any]] = []
    by_mode = {row["mode"]: row for row in rows}
    for mode in RECEIVE_MODES:
        row = by_mode.get(mode)
        if row is None:
            continue
        case = f"receive, {_shape(row['tokens'] // 128, row['regions'], row.get('layout', 'mla'))}"
        variant = _VARIANTS[mode]
        note = f"bytes ok: {row.get('bytes_ok')}"
        if mode != "vllm":
            hook = "installed by the plugin" if not parts.get("worker") else f"not installed ({parts['worker']})"
            note += (f"; to vLLM's handler: {row.get('recv_fallbacks')}; store wrapped by the bench rig as the"
                     f" worker hook would (native client: {row.get('native_client')}); worker hook {hook}")
        out.append(_row(release, "receive thread", case, "GIL ms/request (thread CPU)", variant, row["cpu_gil_ms"],
                        note))
        out.append(_row(release, "receive thread", case, "wall ms/request", variant, row["wall_ms"]))
    return out


def _part_rows(release: str, section: str, metric: str, rows: Sequence[dict[str, Any]] | None,
               reason: str, describe: Callable[[dict[str, Any]], str]) -> list[dict[str, Any]]:
    """Send or lookup rows (``vllm``, ``plugin`` and ``plugin_native_off`` variants), or one "not ported" row
    with the reason."""
    if rows is None:
        return [_row(release, section, section, metric, PLUGIN, None, f"no figure: {reason}")]
    out = []
    for row in rows:
        variant = _VARIANTS.get(row["variant"])
        if variant is None:
            continue
        out.append(_row(release, section, describe(row), metric, variant, row["cpu_gil_ms"]))
    return out


def _shape(blocks: int, regions: int, layout: str) -> str:
    if layout == "mla":
        return f"{blocks} chunks x {regions} regions"
    return f"{_HETERO_CASE}, {2 * blocks} chunks x 2 shards x {regions} segments"


def send_rows(release: str, rows: Sequence[dict[str, Any]] | None, reason: str) -> list[dict[str, Any]]:
    return _part_rows(release, "send thread", "GIL ms/store (thread CPU)", rows, reason,
                      lambda r: f"store, {_shape(r['blocks'], r['regions'], r.get('layout', 'mla'))}")


def lookup_rows(release: str, rows: Sequence[dict[str, Any]] | None, reason: str) -> list[dict[str, Any]]:
    return _part_rows(release, "lookup", "GIL ms/lookup (thread CPU)", rows, reason,
                      lambda r: f"lookup, {r['units']} units x {r['keys'] // r['units']} ranks")


def measure(quick: bool, reps: int | None, *, mooncake: bool = True, tiny: bool = False) -> dict[str, Any]:
    """Every side-by-side row for the installed vLLM, measured here: layouts, and with ``mooncake`` the receive
    thread, and send and lookup where the plugin patches them (else "not ported" rows). ``tiny``: the tests'
    smallest layouts (:data:`vllm_layouts.TINY`) and the quick thread requests."""
    import vllm

    from mooncake_kvaddr.bench import vllm_layouts

    release = str(vllm.__version__)
    parts = plugin_parts()
    rows = layout_rows(release, vllm_layouts.run(quick, rounds=reps, sizes=vllm_layouts.TINY if tiny else None))
    quick = quick or tiny
    if mooncake:
        from mooncake_kvaddr.bench import vllm_lookup, vllm_plugin, vllm_send

        rows += receive_rows(release, vllm_plugin.run(quick, reps=reps, modes=RECEIVE_MODES, thread_counts=()),
                             parts)
        rows += send_rows(release, *_if_ported(parts["send"], lambda: vllm_send.run(
            quick, reps=reps, variants=SEND_VARIANTS)))  # fmt: skip
        rows += lookup_rows(release, *_if_ported(parts["lookup"], lambda: vllm_lookup.run(quick, reps=reps)))
        if release_series(release) in HETERO_SERIES:
            rows += hetero_rows(release, quick, reps, parts)
    return {"vllm": release, "parts": parts, "rows": rows}


def hetero_rows(release: str, quick: bool, reps: int | None, parts: dict[str, str]) -> list[dict[str, Any]]:
    """The receive and send threads on the heterogeneous-TP request (``vllm_rig.HETERO``, or its quick form)."""
    from mooncake_kvaddr.bench import vllm_plugin, vllm_send
    from mooncake_kvaddr.bench.vllm_rig import HETERO, HETERO_QUICK

    shape = HETERO_QUICK if quick else HETERO
    rows = receive_rows(release, vllm_plugin.run(quick, reps=reps, modes=RECEIVE_MODES, thread_counts=(),
                                                 shape=shape), parts)  # fmt: skip
    return rows + send_rows(release, *_if_ported(parts["send"], lambda: vllm_send.run(
        quick, reps=reps, variants=SEND_VARIANTS, shape=shape)))  # fmt: skip


def _if_ported(reason: str, run: Callable[[], list[dict[str, Any]]]) -> tuple[list[dict[str, Any]] | None, str]:
    """The section's rows where the part is patched (else none, with the plugin's reason); a section whose rig
    cannot drive this release's vLLM gives no figure and says why, instead of ending the run."""
    if reason:
        return None, reason
    try:
        return run(), ""
    except Exception as exc:  # a rig built for another release's worker: no figure, never a made-up one
        return None, f"the bench's rig could not run this release ({type(exc).__name__}: {exc})"


# --- the second release, in a child process ----------------------------------------------------------------------


def other_python() -> tuple[str | None, str]:
    """vLLM 0.34's interpreter (``$MOONCAKE_KVADDR_VLLM034_VENV/bin/python``), or None and why not."""
    venv = os.environ.get(ENV_VENV) or DEFAULT_VENV
    python = Path(venv) / "bin" / "python"
    if not python.exists():
        return None, f"no vLLM {OTHER_SERIES} environment at {venv} (set {ENV_VENV}; .ci/setup builds it)"
    return str(python), ""


def run_child(python: str, quick: bool, reps: int | None, mooncake: bool, *, tiny: bool = False,
              timeout: float = 3600.0) -> dict[str, Any]:
    """:func:`measure` under ``python`` (this package's tree first on its path); its result, or ``{"error"}``."""
    import site

    import mooncake_kvaddr

    package_root = str(Path(mooncake_kvaddr.__file__).resolve().parent.parent)
    # A source tree goes first on the child's path; an installed package's site-packages must not (it would
    # shadow the child environment's own vLLM): the child's venv sees it after its own packages.
    installed = {str(Path(p).resolve()) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    env = dict(os.environ)
    inherited = env.get("PYTHONPATH", "").split(os.pathsep)
    paths = [p for p in (package_root, *inherited) if p and str(Path(p).resolve()) not in installed]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    with tempfile.TemporaryDirectory(prefix="mooncake-kvaddr-bench-") as tmp:
        out = Path(tmp) / "rows.json"
        command = [python, "-m", "mooncake_kvaddr.bench.vllm_releases", "--child", "--json", str(out)]
        command += ["--quick"] if quick else []
        command += ["--tiny"] if tiny else []
        command += ["--reps", str(reps)] if reps is not None else []
        command += [] if mooncake else ["--no-mooncake"]
        sys.stdout.flush()
        try:
            done = subprocess.run(command, env=env, timeout=timeout, stdout=sys.stderr)
        except subprocess.TimeoutExpired:
            return {"error": f"{python} did not finish in {timeout:.0f} s"}
        if done.returncode != 0 or not out.exists():
            return {"error": f"{python} exited with status {done.returncode} (its output is above)"}
        result: dict[str, Any] = json.loads(out.read_text())
        return result


# --- the one table ------------------------------------------------------------------------------------------------


def summarise(results: Sequence[dict[str, Any]], notes: Sequence[str] = ()) -> dict[str, Any]:
    """Print the side-by-side table of ``results`` (one :func:`measure` result per release); ratio = the
    release's vLLM alone on the same case and metric / the row's."""
    rows: dict[str, dict[str, Any]] = {}
    for result in results:
        base: dict[tuple[str, str], float] = {
            (r["case"], r["metric"]): r["median"] for r in result["rows"] if r["variant"] == ALONE and r["median"]
        }
        for r in result["rows"]:
            ref = base.get((r["case"], r["metric"]))
            ratio = ref / r["median"] if ref and r["median"] else None
            key = f"{r['release']} / {r['case']} / {r['metric']} / {r['variant']}"
            rows[key] = {**r, "baseline": f"vLLM {r['release']} alone", "ratio": ratio}
    cols = (Col("baseline", "baseline"), Col("median", "median", ".2f"), Col("ratio", "ratio", ".1f", "x"),
            Col("note", "note"))
    return table("vLLM releases side by side: each alone and with the plugin (medians; one process per release)",
                 "the same release's vLLM alone on the same case and metric (ratio = its median / the row's)",
                 rows, cols, label="release / case / metric / variant", notes=notes,
                 releases=[r["vllm"] for r in results], parts={r["vllm"]: r["parts"] for r in results})


def side_by_side(quick: bool, reps: int | None, *, mooncake: bool = True, tiny: bool = False,
                 installed: dict[str, Any] | None = None) -> dict[str, Any]:
    """Measure the installed vLLM (unless ``installed`` holds its result already) and vLLM 0.34 in its own
    environment, and print one table; a release that was not measured is one note saying why."""
    results = [installed if installed is not None else measure(quick, reps, mooncake=mooncake, tiny=tiny)]
    notes: list[str] = []
    if release_series(results[0]["vllm"]) == OTHER_SERIES:
        notes.append(f"the installed vLLM is {results[0]['vllm']}: no second release to run")
    else:
        python, reason = other_python()
        if python is None:
            notes.append(f"vLLM {OTHER_SERIES} not measured: {reason}")
        else:
            child = run_child(python, quick, reps, mooncake, tiny=tiny)
            if "error" in child:
                notes.append(f"vLLM {OTHER_SERIES} not measured: {child['error']}")
            elif release_series(child["vllm"]) != OTHER_SERIES:
                notes.append(f"vLLM {OTHER_SERIES} not measured: {python} has vLLM {child['vllm']}")
            else:
                results.append(child)
    for note in notes:
        print(note)
    return summarise(results, notes)


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - manual runs
    import argparse

    from mooncake_kvaddr.bench.harness import have_mooncake, machine

    parser = argparse.ArgumentParser(prog="python -m mooncake_kvaddr.bench.vllm_releases", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small requests")
    parser.add_argument("--tiny", action="store_true", help="the tests' smallest requests (a smoke run)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per variant")
    parser.add_argument("--no-mooncake", action="store_true", help="the layouts only (no Mooncake master)")
    parser.add_argument("--json", metavar="PATH", help="write the result as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # measure this release only
    args = parser.parse_args(argv)
    mooncake = not args.no_mooncake and have_mooncake()
    if args.child:
        result = measure(args.quick, args.reps, mooncake=mooncake, tiny=args.tiny)
    else:
        info = machine()
        print(f"vLLM releases side by side on {info['cpu']} ({info['cores']} cores, {info['platform']}), Python "
              f"{info['python']}; load average at start {_load()} (other processes share the machine)", flush=True)
        result = {"machine": info, "reps": args.reps, "quick": args.quick,
                  "load_average": os.getloadavg(),
                  "side_by_side": side_by_side(args.quick, args.reps, mooncake=mooncake, tiny=args.tiny)}
    if not args.child:
        print(f"\nload average at the end {_load()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    sys.stdout.flush()
    os._exit(0)  # vLLM's receive threads block forever on their queues


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
