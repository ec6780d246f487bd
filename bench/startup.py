"""The plugin's start-up cost per vLLM release (docs/vllm-plugin.md, "Start-up").

    python3 bench/startup.py [--runs 7] [--python PATH ...]

For each interpreter (default: this one and vLLM 0.34's environment, ``$MOONCAKE_KVADDR_VLLM034_VENV``), fresh
processes import vllm (not counted), then time importing the entry point's module and calling ``register()``:
as installed, and with ``vllm.__version__`` set to a release no module knows. Prints medians and extremes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = """
import importlib.util, json, sys, time
import vllm
# vLLM imports tabulate right after its own import whether or not a plugin is there (-X importtime shows it with
# no importer): done here first, so that it does not land in the plugin's window.
if importlib.util.find_spec("tabulate") is not None:
    import tabulate
if sys.argv[1] != "installed":
    vllm.__version__ = sys.argv[1]
version = vllm.__version__
start = time.perf_counter()
from mooncake_kvaddr.integrations.vllm import plugin
imported = time.perf_counter()
plugin.register()
done = time.perf_counter()
store_modules = sorted(m for m in sys.modules if ".mooncake.store" in m)
print(json.dumps({"version": version, "import_ms": (imported - start) * 1e3, "register_ms": (done - imported) * 1e3,
                  "store_modules": store_modules}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--python", nargs="*", default=None)
    args = parser.parse_args()
    venv = os.environ.get("MOONCAKE_KVADDR_VLLM034_VENV", "/opt/mooncake_kvaddr/vllm-0.34")
    pythons = args.python or [sys.executable, str(Path(venv) / "bin" / "python")]
    root = Path(__file__).resolve().parents[1] / "python"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    print(f"load average at start {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"{'vLLM':<22} {'import ms':>22} {'register() ms':>22} {'both ms':>22}  store modules imported")
    for python in pythons:
        if not Path(python).exists():
            print(f"{python}: missing")
            continue
        for version in ("installed", "0.99.0"):
            rows = []
            for _ in range(args.runs):
                done = subprocess.run([python, "-c", CHILD, version], capture_output=True, text=True, env=env,
                                      timeout=600, check=True)  # fmt: skip
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))

            def cell(values: list[float]) -> str:
                return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"

            both = [r["import_ms"] + r["register_ms"] for r in rows]
            label = rows[0]["version"] + (" (unknown)" if version != "installed" else "")
            imports, registers = cell([r["import_ms"] for r in rows]), cell([r["register_ms"] for r in rows])
            print(f"{label:<22} {imports:>22} {registers:>22} {cell(both):>22}  {len(rows[0]['store_modules'])}")
    print(f"load average at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
