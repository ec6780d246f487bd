"""The measurement scripts the docs quote (bench/, tools/) still run: a tiny shape each, as a subprocess.

They are not part of the installed package, so a checkout is needed (the wheel leg runs the tests from a copy
without them: skipped there).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
