"""Two builds of the package side by side: ``python -m mooncake_kvaddr.bench --quick`` run by two interpreters
in turn (A B B A ...), then each row compared over the rounds (docs/benchmarks.md, "Old and new build").

    python3 bench/quick_ab.py --old /tmp/oldv/bin/python --new python3 [--rounds 3] [--stat min] [--json OUT]

Each interpreter must import its own build of ``mooncake_kvaddr`` (a venv per build). A row is "slower" when
the new build's figure exceeds the old one's by more than ``--tolerance`` (default 10 %); rows only one build
has are listed. ``--stat``: the figure of a row over the rounds, ``min`` (default: a row's time moves in steps
from one process to the next, so the median of a few processes lands on either step; the best process does
not) or ``median``. Runs alternate, so the machine's noise hits both alike; quote the ratios, not the times.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def run_once(python: str, extra: list[str]) -> dict[str, float]:
    """``section / row`` -> median ms of one quick bench run by ``python``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        subprocess.run([python, "-m", "mooncake_kvaddr.bench", "--quick", "--json", str(out), *extra],
                       check=True, capture_output=True, text=True)
        data: dict[str, Any] = json.loads(out.read_text())
    rows: dict[str, float] = {}

    def walk(node: Any, path: str) -> None:
        # Every timing the sections report: numeric leaves named *_ms (the spread columns p10/p90 aside).
        if isinstance(node, dict):
            for key, value in node.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    if str(key).endswith("_ms") and key not in ("p10_ms", "p90_ms"):
                        rows[f"{path} / {key}"] = float(value)
                elif key not in ("machine", "notes"):
                    walk(value, f"{path} / {key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")

    walk(data["sections"], "")
    return {row.lstrip(" /"): ms for row, ms in rows.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="interpreter that imports the old build")
    parser.add_argument("--new", required=True, help="interpreter that imports the new build")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("--stat", choices=("min", "median"), default="min")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("bench_args", nargs="*", help="extra arguments for the bench (e.g. --no-mooncake)")
    args = parser.parse_args()
    samples: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    for r in range(args.rounds):
        for label, python in (("old", args.old), ("new", args.new)) if r % 2 == 0 else (("new", args.new),
                                                                                        ("old", args.old)):
            for row, ms in run_once(python, args.bench_args).items():
                samples[label].setdefault(row, []).append(ms)
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    report = []
    for row in sorted(set(samples["old"]) | set(samples["new"])):
        old, new = samples["old"].get(row), samples["new"].get(row)
        if not old or not new:
            report.append({"row": row, "only": "old" if old else "new"})
            continue
        o, n = (min(old), min(new)) if args.stat == "min" else (statistics.median(old), statistics.median(new))
        report.append({"row": row, "old_ms": o, "new_ms": n, "new_over_old": n / o if o else None,
                       "old_median_ms": statistics.median(old), "new_median_ms": statistics.median(new),
                       "slower": bool(o and n > o * (1 + args.tolerance))})
    width = max(len(r["row"]) for r in report) if report else 10
    print(f"{'row':{width}}  {'old ms':>10}  {'new ms':>10}  new/old   ({args.stat} over {args.rounds} rounds)")
    for r in report:
        if "only" in r:
            print(f"{r['row']:{width}}  only in the {r['only']} build")
        else:
            flag = "  SLOWER" if r["slower"] else ""
            ratio = "n/a" if r["new_over_old"] is None else f"{r['new_over_old']:.2f}"  # a 0 ms old figure
            print(f"{r['row']:{width}}  {r['old_ms']:10.3f}  {r['new_ms']:10.3f}  {ratio}{flag}")
    slower = [r["row"] for r in report if r.get("slower")]
    print(f"{len(slower)} of {sum('only' not in r for r in report)} rows more than {args.tolerance:.0%} slower")
    for stat, old_key, new_key in (("min", "old_ms", "new_ms"), ("median", "old_median_ms", "new_median_ms")):
        if args.stat == "median" and stat == "min":
            continue  # old_ms/new_ms are medians then
        ratios = [r[new_key] / r[old_key] for r in report if "only" not in r and r[old_key] > 0 and r[new_key] > 0]
        if ratios:
            print(f"geometric mean of new/old by {stat}: {math.exp(statistics.fmean(map(math.log, ratios))):.3f} "
                  f"over {len(ratios)} rows")
    if args.json is not None:
        args.json.write_text(json.dumps({"rounds": args.rounds, "tolerance": args.tolerance, "stat": args.stat,
                                         "rows": report},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
