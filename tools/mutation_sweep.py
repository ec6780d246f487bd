"""Automated mutation sweep (docs/development.md, "Mutation runs"): a search for gaps in the tests, not a
measurement of a fresh set. Token mutants (comparisons flipped, ``and``/``or``, ``any``/``all``, ``min``/``max``,
``is``/``is not``, ``+``/``-``, ``True``/``False``, small integers off by one) on the lines the tests run, one
per line, each run against only the tests that run that line.

    python3 tools/mutation_sweep.py map --work /tmp/sweep [PYTEST ARGS ...]
    python3 tools/mutation_sweep.py run --work /tmp/sweep MODULE [MODULE ...] [--budget S] [--max-per-module N]
    python3 tools/mutation_sweep.py run --work /tmp/sweep2 MODULE ... --budget 1e9 --survivors-of RESULTS.jsonl

``map`` runs pytest under coverage.py with one context per test (its node id) against the installed package and
writes ``map.json`` (module -> line -> node ids) and each test's duration. ``run`` copies the installed package
into a scratch venv (``--system-site-packages``; the installed package and this checkout are never modified),
patches one mutant at a time into that copy and runs the selected tests there. MODULE is a path inside the
package, e.g. ``core/database.py``. Results go to ``results.jsonl``; survivors are places to read, not verdicts.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import time
import tokenize
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "mooncake_kvaddr"

_FLIPS = {"<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "!=", "!=": "=="}
_NAMES = {"and": "or", "or": "and", "any": "all", "all": "any", "min": "max", "max": "min",
          "True": "False", "False": "True"}
_SKIP_STARTS = ("raise ", "logger.", "log.", "warnings.warn", "import ", "from ", "@", "def ", "class ", "assert ")


def _installed() -> Path:
    import importlib.util

    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise SystemExit(f"{PACKAGE} is not installed")
    return Path(spec.origin).parent


def cmd_map(work: Path, pytest_args: list[str]) -> int:
    import coverage
    import pytest

    work.mkdir(parents=True, exist_ok=True)
    pkg = _installed()
    cov = coverage.Coverage(data_file=str(work / ".coverage"), source=[str(pkg)], omit=["*/bench/*"])
    durations: dict[str, float] = {}

    class Contexts:
        def pytest_runtest_setup(self, item: Any) -> None:
            cov.switch_context(item.nodeid)

        def pytest_runtest_logreport(self, report: Any) -> None:
            durations[report.nodeid] = durations.get(report.nodeid, 0.0) + report.duration

    cov.start()
    try:
        rc = pytest.main(["-p", "no:cacheprovider", "-q", *pytest_args], plugins=[Contexts()])
    finally:
        cov.stop()
        cov.save()
    data = cov.get_data()
    mapping: dict[str, dict[str, list[str]]] = {}
    for measured in data.measured_files():
        rel = Path(measured).resolve().relative_to(pkg.resolve()).as_posix()
        lines = data.contexts_by_lineno(measured)
        mapping[rel] = {str(n): sorted(c for c in ctx if c) for n, ctx in lines.items() if any(ctx)}
    (work / "map.json").write_text(json.dumps(mapping))
    (work / "durations.json").write_text(json.dumps(durations))
    print(f"pytest exit {rc}; {len(mapping)} modules mapped -> {work / 'map.json'}")
    return 0


def mutants_of(source: str, lines: set[int]) -> list[tuple[int, int, int, str, str]]:
    """One mutant per covered line: (line, start col, end col, old token, new token)."""
    by_line: dict[int, list[tokenize.TokenInfo]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        by_line.setdefault(tok.start[0], []).append(tok)
    text = source.splitlines()
    out = []
    for n in sorted(lines):
        if n > len(text) or text[n - 1].strip().startswith(_SKIP_STARTS):
            continue
        toks = [t for t in by_line.get(n, []) if t.start[0] == t.end[0]]
        choice = None
        for rank in range(5):
            for i, t in enumerate(toks):
                prev = toks[i - 1] if i else None
                new = None
                if rank == 0 and t.type == tokenize.OP and t.string in _FLIPS:
                    new = _FLIPS[t.string]
                elif rank == 1 and t.type == tokenize.NAME and t.string in ("and", "or", "any", "all", "min", "max"):
                    new = _NAMES[t.string]
                elif rank == 2 and t.type == tokenize.NAME and t.string == "is":
                    nxt = toks[i + 1] if i + 1 < len(toks) else None
                    new = "is" if nxt is not None and nxt.string == "not" else "is not"
                    if new == "is":
                        t = tokenize.TokenInfo(t.type, "is not", t.start, nxt.end, t.line)  # type: ignore[union-attr]
                elif rank == 3 and t.type == tokenize.OP and t.string in ("+", "-") and prev is not None and (
                        prev.type in (tokenize.NAME, tokenize.NUMBER) or prev.string in (")", "]")):
                    new = "-" if t.string == "+" else "+"
                elif rank == 4 and t.type == tokenize.NAME and t.string in ("True", "False"):
                    new = _NAMES[t.string]
                elif rank == 4 and t.type == tokenize.NUMBER and t.string.isdigit() and int(t.string) < 64:
                    new = str(int(t.string) + 1) if t.string != "1" else "0"
                if new is not None:
                    choice = (n, t.start[1], t.end[1], t.string, new)
                    break
            if choice:
                break
        if choice:
            out.append(choice)
    return out


def _venv(work: Path) -> Path:
    venv = work / "venv"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    pkg = _installed()
    target = site / PACKAGE
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(pkg, target, ignore=shutil.ignore_patterns("__pycache__"))
    for info in pkg.parent.glob(f"{PACKAGE}-*.dist-info"):
        dest = site / info.name
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(info, dest)
    return target


def cmd_run(work: Path, modules: list[str], budget: float, most: int, only: set[str] | None = None) -> int:
    mapping = json.loads((work / "map.json").read_text())
    durations = json.loads((work / "durations.json").read_text())
    target = _venv(work)
    python = str(work / "venv" / "bin" / "python")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    results = work / "results.jsonl"
    for module in modules:
        path = target / module
        original = path.read_text()
        lines = {int(n) for n in mapping.get(module, {})}
        mutants = mutants_of(original, lines)[:most]
        print(f"{module}: {len(lines)} covered lines, {len(mutants)} mutants", flush=True)
        for line, c0, c1, old, new in mutants:
            if only is not None and f"{module}:{line}" not in only:
                continue
            rows = original.splitlines(keepends=True)
            rows[line - 1] = rows[line - 1][:c0] + new + rows[line - 1][c1:]
            mutated = "".join(rows)
            try:
                compile(mutated, str(path), "exec")
            except SyntaxError:
                continue
            tests = sorted(mapping[module][str(line)], key=lambda t: durations.get(t, 1.0))
            chosen, spent = [], 0.0
            for t in tests:
                if chosen and spent + durations.get(t, 1.0) > budget:
                    break
                chosen.append(t)
                spent += durations.get(t, 1.0)
            start = time.monotonic()
            try:
                path.write_text(mutated)
                for cached in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
                    cached.unlink()
                try:
                    done = subprocess.run([python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *chosen],
                                          cwd=ROOT, env=env, capture_output=True, text=True,
                                          timeout=max(120.0, 4 * spent + 60))
                    rc = done.returncode
                    verdict = {0: "survived", 5: "no tests"}.get(rc, "killed" if rc > 0 else "crashed")
                except subprocess.TimeoutExpired:
                    verdict = "timeout"
            finally:
                path.write_text(original)
            record = {"module": module, "line": line, "old": old, "new": new, "verdict": verdict,
                      "text": original.splitlines()[line - 1].strip(), "tests": len(chosen), "of": len(tests),
                      "seconds": round(time.monotonic() - start, 1)}
            with results.open("a") as fh:
                fh.write(json.dumps(record) + "\n")
            print(f"{verdict:9} {module}:{line} {old}->{new}  {record['text'][:90]}", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("map")
    m.add_argument("--work", type=Path, required=True)
    r = sub.add_parser("run")
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("modules", nargs="+")
    r.add_argument("--budget", type=float, default=30.0, help="seconds of selected tests per mutant (at least one)")
    r.add_argument("--max-per-module", type=int, default=10_000)
    r.add_argument("--survivors-of", type=Path, help="only the survivors in this results.jsonl (run again)")
    args, rest = parser.parse_known_args()
    if args.cmd == "map":
        return cmd_map(args.work, rest)
    if rest:
        parser.error(f"unknown arguments: {rest}")
    only = None
    if args.survivors_of:
        rows = [json.loads(line) for line in args.survivors_of.read_text().splitlines()]
        only = {f"{r['module']}:{r['line']}" for r in rows if r["verdict"] == "survived"}
    return cmd_run(args.work, args.modules, args.budget, args.max_per_module, only)


if __name__ == "__main__":
    sys.exit(main())
