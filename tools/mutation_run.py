"""Hand-made mutation runs (docs/development.md, "Mutation runs"): apply one small bug at a time to a scratch
checkout, rebuild it into its own venv, run the tests that sit beside the mutated file, and record whether they
failed (killed) or passed (survived). The tree you run it from is never modified.

    python3 tools/mutation_run.py tools/mutants.json --work /tmp/mutation [--only ID ...]

Each entry of the JSON list: ``id``, ``file`` (repository path), ``old`` (text that occurs exactly once),
``new`` (its replacement), ``tests`` (pytest arguments), optionally ``why``, ``equivalent`` (why the mutant
cannot change behaviour: reported, not counted) and ``retired`` (why its code is gone, with the commit: skipped).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def sh(cmd: list[str], cwd: Path, timeout: float) -> tuple[int, str]:
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, "timed out"
    return done.returncode, (done.stdout + done.stderr)[-2000:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mutants", type=Path)
    parser.add_argument("--work", type=Path, default=Path("/tmp/mooncake_kvaddr_mutation"))
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per mutant's tests")
    parser.add_argument("--check", action="store_true", help="only check that every mutant applies to this tree")
    args = parser.parse_args()
    mutants = json.loads(args.mutants.read_text())
    mutants = [m for m in mutants if not m.get("retired")]  # nothing left to mutate (see the docstring)
    if args.only:
        mutants = [m for m in mutants if m["id"] in args.only]
    if args.check:
        stale = [m["id"] for m in mutants
                 if not (ROOT / m["file"]).exists() or (ROOT / m["file"]).read_text().count(m["old"]) != 1]
        seen: set[str] = set()
        twice = sorted({m["id"] for m in mutants if m["id"] in seen or seen.add(m["id"])})
        print(f"{len(mutants)} mutants, {len(stale)} no longer apply" + (f": {stale}" if stale else "")
              + (f"; ids given twice: {twice}" if twice else ""))
        return 1 if stale or twice else 0
    tree, venv = args.work / "tree", args.work / "venv"
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    # The committed tree (HEAD), exported: uncommitted edits of the checkout are not part of the run.
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    if not venv.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    install = [python, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-Cbuild-dir=build/mut", "."]
    results = []
    for m in mutants:
        path = tree / m["file"]
        source = path.read_text()
        if source.count(m["old"]) != 1:
            results.append({"id": m["id"], "verdict": "malformed (old text not found exactly once)"})
            continue
        path.write_text(source.replace(m["old"], m["new"]))
        start = time.monotonic()
        try:
            rc, out = sh(install, tree, 1800)
            tail: list[str] = []
            if rc != 0:
                verdict = "build failed"
            else:
                rc, out = sh([python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m["tests"].split()],
                             tree, args.timeout)
                tail = out.strip().splitlines()[-1:]
                verdict = {0: "survived", 5: "no tests"}.get(rc, "killed")
        finally:
            path.write_text(source)
        if m.get("equivalent") and verdict == "survived":
            verdict = "equivalent"
        results.append({"id": m["id"], "verdict": verdict, "seconds": round(time.monotonic() - start), "tail": tail})
        print(f"{m['id']:6} {verdict:10} {m.get('why', '')}", flush=True)
    sh(install, tree, 1800)  # leave the venv with the unmutated build
    counted = [r for r in results if r["verdict"] in ("killed", "survived")]
    killed = sum(r["verdict"] == "killed" for r in counted)
    print(f"{killed} of {len(counted)} killed" + (f" ({100 * killed / len(counted):.0f} %)" if counted else ""))
    (args.work / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
