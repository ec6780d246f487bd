"""The measurement scripts the docs quote (bench/, tools/) still run: a tiny shape each, as a subprocess.

They are not part of the installed package, so a checkout is needed (the wheel leg runs the tests from a copy
without them: skipped there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.mooncake


def _run(script: str, *args: str) -> str:
    path = ROOT / script
    if not path.exists():
        pytest.skip(f"{script} is not in this tree (tests copied without the checkout)")
    pytest.importorskip("mooncake.store")
    import mooncake_kvaddr

    # The package this test process imports (the source tree's or the installed one), and tests/ for helpers.
    package_root = Path(mooncake_kvaddr.__file__).resolve().parent.parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(package_root), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def test_transfer_crossover_script_runs() -> None:
    out = _run("bench/transfer_crossover.py", "--reps", "1", "--shape", "8:4:2", "--shape", "4:16:2")
    assert "BYTES DIFFER" not in out
    rows = [line for line in out.splitlines() if line.strip().startswith(("8 ", "4 "))]
    assert len(rows) == 2, out
    assert "st / mb" in rows[0]  # in memory, 4 small regions: loads staged, stores multi-buffer


def test_native_driver_bench_script_runs() -> None:
    out = _run("tools/bench_native_driver.py", "--keys", "16", "--repeats", "1")
    assert out.strip(), "the script printed nothing"


def test_mooncake_copy_threads_script_runs() -> None:
    out = _run("bench/mooncake_copy_threads.py", "--keys", "16", "--regions", "4", "--reps", "1", "--threads", "1,2")
    assert "bytes verified" in out, out
    assert sum(line.strip().startswith(("batch_get_into", "numpy")) for line in out.splitlines()) == 3, out


def test_object_floor_script_runs(tmp_path: Path) -> None:
    out = _run("bench/object_floor.py", "--reps", "1", "--json", str(tmp_path / "floor.json"))
    assert "target 3x" in out and "floor, cold" in out, out
    import json

    report = json.loads((tmp_path / "floor.json").read_text())
    assert all(ms > 0 for ms in report["median_ms"].values()), report


def test_gpu_plugin_check_script_runs_on_host_memory(tmp_path: Path) -> None:
    """bench/gpu_plugin_check.py (docs/native-client.md, "On a GPU") on host caches: every form stores and
    loads byte for byte, the guard refuses the bad row, and the record says so."""
    pytest.importorskip("torch", reason="torch is not installed (comes with vLLM)")
    out = tmp_path / "check.json"
    _run("bench/gpu_plugin_check.py", "--device", "cpu", "--layers", "2", "--blocks", "4", "--repeat", "1",
         "--out", str(out))  # fmt: skip
    import json

    record = json.loads(out.read_text())
    assert record["ok"] and record["native_client"] and record["native_calls"] > 0, record
    assert [(r["layout"], r["how"]) for r in record["rounds"]] == [
        (layout, how) for layout in ("rank_local", "lbnhc") for how in ("arrays", "lists", "bound")
    ]
    assert all(r["bytes_equal"] and r["put_codes"] == [0] for r in record["rounds"]), record
    assert record["guard"]["codes"][0] == -600 and record["guard"]["refused_blocks_untouched"], record


def test_every_listed_mutant_still_applies() -> None:
    """tools/mutants.json (docs/development.md, "Mutation runs") names code that exists: a mutant whose text
    changed must be updated with the code it mutates."""
    out = _run("tools/mutation_run.py", "tools/mutants.json", "--check")
    assert "0 no longer apply" in out, out


# --- python -m mooncake_kvaddr.bench.vllm_releases (docs/benchmarks.md, "vLLM 0.34") ----------------------------


def _side_by_side(tmp_path: Path, env_update: dict[str, str], *args: str) -> tuple[str, dict[str, Any]]:
    """Run the releases' side-by-side on the tiny shapes; its stdout and its JSON document."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vLLM is not installed")
    pytest.importorskip("torch", reason="torch is not installed (comes with vLLM)")
    import mooncake_kvaddr

    package_root = Path(mooncake_kvaddr.__file__).resolve().parent.parent
    env = {**os.environ, **env_update}
    env["PYTHONPATH"] = os.pathsep.join([str(package_root), env.get("PYTHONPATH", "")])
    out = tmp_path / "side.json"
    done = subprocess.run(
        [sys.executable, "-m", "mooncake_kvaddr.bench.vllm_releases", "--tiny", "--reps", "1", "--json", str(out),
         *args],
        capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout, json.loads(out.read_text())


def _rows(result: dict[str, Any], release: str) -> list[dict[str, Any]]:
    return [row for row in result["side_by_side"]["rows"].values() if row["release"] == release]


def _check_release(result: dict[str, Any], release: str) -> None:
    """A measured release's rows: each layout case and the receive thread alone and with the plugin (figures,
    same values), and send and lookup either measured or "not ported" with the PatchReport's reason."""
    rows = _rows(result, release)
    parts = result["side_by_side"]["parts"][release]
    layouts = [r for r in rows if r["section"] == "layouts"]
    cases = {r["case"] for r in layouts}
    assert len(cases) == 4, cases  # rank-local and the TP-shared layout, cold and warm
    for case in cases:
        pair = {r["variant"]: r for r in layouts if r["case"] == case}
        assert set(pair) == {"vLLM alone", "with the plugin"}, pair
        assert all(r["median"] > 0 and r["ratio"] > 0 for r in pair.values()), pair
        assert "same values, Python ints: True" in pair["with the plugin"]["note"], pair
    variants = {"vLLM alone", "with the plugin", "plugin, native client off"}
    # vLLM 0.34's threads also run the heterogeneous-TP request (head-major, half-block Store chunks).
    hetero = release.startswith("0.34.")
    receive = [r for r in rows if r["section"] == "receive thread"]
    assert len({r["case"] for r in receive}) == 1 + hetero, receive
    assert hetero == any("head-major TP 2 over 4" in r["case"] for r in receive), receive
    for case in {r["case"] for r in receive}:
        assert {(r["metric"], r["variant"]) for r in receive if r["case"] == case} == {
            (m, v) for m in ("GIL ms/request (thread CPU)", "wall ms/request") for v in variants
        }, receive
    assert all(r["median"] > 0 for r in receive), receive
    assert all("bytes ok: True" in r["note"] for r in receive if r["metric"].startswith("GIL")), receive
    assert all("to vLLM's handler: 0" in r["note"] for r in receive
               if r["metric"].startswith("GIL") and r["variant"] != "vLLM alone"), receive  # fmt: skip
    for section, part in (("send thread", "send"), ("lookup", "lookup")):
        got = [r for r in rows if r["section"] == section]
        if parts[part]:  # not patched on this release: one row, no figure, the report's reason
            assert [(r["variant"], r["median"]) for r in got] == [("with the plugin", None)], got
            assert parts[part] in got[0]["note"], got
        else:
            assert {r["variant"] for r in got} == variants, got
            assert len({r["case"] for r in got}) == 1 + (hetero and section == "send thread"), got
            assert all(r["median"] > 0 for r in got), got


@pytest.mark.vllm
def test_vllm_releases_side_by_side_runs_vllm_034_in_its_environment(tmp_path: Path) -> None:
    """With vLLM 0.34's environment present, one run measures the installed vLLM here and 0.34 in a child, and
    prints one table naming its baseline."""
    import importlib.metadata

    from mooncake_kvaddr.bench.vllm_releases import other_python

    pytest.importorskip("mooncake.store")
    python, reason = other_python()
    if python is None:
        pytest.skip(reason)
    stdout, result = _side_by_side(tmp_path, {})
    installed = importlib.metadata.version("vllm")
    assert "baseline: the same release's vLLM alone on the same case and metric" in stdout
    assert "load average at start" in stdout and "load average at the end" in stdout
    _check_release(result, installed)
    if installed.startswith("0.34."):
        assert result["side_by_side"]["releases"] == [installed], result["side_by_side"]
    else:
        assert result["side_by_side"]["releases"] == [installed, "0.34.0"], result["side_by_side"]
        _check_release(result, "0.34.0")
        # On 0.34 the receive rows say how the store was wrapped (the worker hook is the plugin's only where ported).
        plugin_note = next(r["note"] for r in _rows(result, "0.34.0")
                           if r["section"] == "receive thread" and r["variant"] == "with the plugin")
        assert "store wrapped by the bench rig" in plugin_note, plugin_note


@pytest.mark.vllm
def test_vllm_releases_side_by_side_says_why_034_was_not_measured(tmp_path: Path) -> None:
    """Without vLLM 0.34's environment the table has the installed release only, and one line says why."""
    import importlib.metadata

    try:
        installed = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vLLM is not installed")
    if installed.startswith("0.34."):
        pytest.skip("the installed vLLM is 0.34 itself")
    missing = tmp_path / "no-venv"
    stdout, result = _side_by_side(tmp_path, {"MOONCAKE_KVADDR_VLLM034_VENV": str(missing)}, "--no-mooncake")
    line = f"vLLM 0.34 not measured: no vLLM 0.34 environment at {missing}"
    assert line in stdout, stdout
    assert result["side_by_side"]["releases"] == [importlib.metadata.version("vllm")]
    assert any(note.startswith(line) for note in result["side_by_side"]["notes"]), result["side_by_side"]
    assert {r["section"] for r in result["side_by_side"]["rows"].values()} == {"layouts"}
