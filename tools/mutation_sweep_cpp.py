"""The C++ half of the mutation sweep (docs/development.md, "Mutation runs"): token mutants in csrc/, one per line
the tests run, each built into a scratch copy of the extension and run against the test files that run that line.

    python3 tools/mutation_sweep_cpp.py map --work /tmp/csweep [TEST FILE ...]
    python3 tools/mutation_sweep_cpp.py run --work /tmp/csweep [CSRC FILE ...] [--max-per-file N] [--budget S]

``map`` exports HEAD to WORK/tree, builds the extension there with gcov counters (``-O0 --coverage``), and runs
each test file once against a scratch venv (the installed package with that extension); the counters after each
file give csrc line -> test files (``map.json``) and each file's duration. ``run`` builds the export once more
without counters (``-O0``, WORK/build) and then, per mutant, patches the line, rebuilds incrementally, copies the
extension into the venv and runs the test files that ran the line (fastest first, ``-x``, up to ``--budget``
seconds of them). Results go to ``results.jsonl``; a mutant that does not compile is skipped, not counted. A
second ``run`` in the same work folder leaves out the lines an earlier one mutated.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mutation_sweep import ROOT, _venv

# Comparisons are only taken with a space either side, which keeps template brackets out.
_RANKED = [
    [(" <= ", " < "), (" >= ", " > "), (" < ", " <= "), (" > ", " >= "), (" == ", " != "), (" != ", " == ")],
    [(" && ", " || "), (" || ", " && ")],
    [(" + ", " - "), (" - ", " + ")],
    [("true", "false"), ("false", "true")],
]
_SMALL_INT = re.compile(r"(?<![\w.])([0-9])(?![\w.])")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _export(work: Path) -> Path:
    tree = work / "tree"
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def _configure(tree: Path, build: Path, flags: str) -> None:
    import pybind11

    subprocess.run(["cmake", "-S", str(tree), "-B", str(build), "-DCMAKE_BUILD_TYPE=None",
                    f"-DCMAKE_CXX_FLAGS={flags}", f"-DCMAKE_SHARED_LINKER_FLAGS={flags}",
                    f"-Dpybind11_DIR={pybind11.get_cmake_dir()}", f"-DPython_EXECUTABLE={sys.executable}"],
                   check=True, capture_output=True)


def _build(build: Path) -> bool:
    done = subprocess.run(["cmake", "--build", str(build), "-j2"], capture_output=True, text=True)
    return done.returncode == 0


def _install_so(build: Path, target: Path) -> None:
    (built,) = build.glob("_native*.so")
    for old in target.glob("_native*.so"):
        old.unlink()
    shutil.copy2(built, target / built.name)


def _pytest(work: Path, files: list[str], timeout: float, stop_first: bool) -> tuple[str, float]:
    python = str(work / "venv" / "bin" / "python")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not multihost", *files]
    if stop_first:
        cmd.insert(3, "-x")
    start = time.monotonic()
    try:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start
    verdict = {0: "survived", 5: "no tests"}.get(rc, "killed" if rc > 0 else "crashed")
    return verdict, time.monotonic() - start


def _covered_lines(build: Path, tree: Path) -> dict[str, set[int]]:
    """csrc-relative file -> lines with a nonzero count, from every .gcda under ``build``."""
    out: dict[str, set[int]] = {}
    csrc = str(tree / "csrc") + "/"
    with tempfile.TemporaryDirectory() as scratch:
        for gcda in build.rglob("*.gcda"):
            done = subprocess.run(["gcov", "--json-format", "--stdout", str(gcda)], cwd=scratch,
                                  capture_output=True, text=True)
            for chunk in done.stdout.splitlines():
                if not chunk.startswith("{"):
                    continue
                for entry in json.loads(chunk).get("files", []):
                    name = os.path.normpath(entry["file"] if os.path.isabs(entry["file"])
                                            else os.path.join(str(build), entry["file"]))
                    if not name.startswith(csrc):
                        continue
                    lines = out.setdefault(name[len(csrc):], set())
                    lines.update(ln["line_number"] for ln in entry["lines"] if ln["count"] > 0)
    return out


def _prepare(work: Path, folder: str, flags: str) -> tuple[Path, Path, Path]:
    """HEAD exported to WORK/tree and built with ``flags`` into WORK/``folder``; the scratch venv's package."""
    tree = _export(work)
    build = work / folder
    _configure(tree, build, flags)
    if not _build(build):
        raise SystemExit(f"the build in {build} failed")
    return tree, build, _venv(work)


def cmd_map(work: Path, files: list[str]) -> int:
    tree, cov, target = _prepare(work, "cov", "-O0 --coverage")
    _install_so(cov, target)
    if not files:
        files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py"))
    mapping: dict[str, dict[str, list[str]]] = {}
    durations: dict[str, float] = {}
    for test_file in files:
        for gcda in cov.rglob("*.gcda"):
            gcda.unlink()
        verdict, seconds = _pytest(work, [test_file], 1800.0, stop_first=False)
        durations[test_file] = round(seconds, 1)
        covered = _covered_lines(cov, tree)
        for name, lines in covered.items():
            per = mapping.setdefault(name, {})
            for line in lines:
                per.setdefault(str(line), []).append(test_file)
        print(f"{verdict:9} {test_file} {seconds:.0f}s, {sum(len(v) for v in covered.values())} csrc lines",
              flush=True)
    (work / "map.json").write_text(json.dumps(mapping))
    (work / "durations.json").write_text(json.dumps(durations))
    return 0


def mutants_of(text: str, lines: set[int]) -> list[tuple[int, str, str, str]]:
    """One mutant per covered line: (line, old line, new line, what changed)."""
    rows = text.splitlines()
    out = []
    for n in sorted(lines):
        if n > len(rows):
            continue
        row = rows[n - 1]
        stripped = row.strip()
        if not stripped or stripped.startswith(("//", "#", "*", "/*", "throw ", "static_assert")):
            continue
        code = row.split("//", 1)[0]
        masked = _STRING.sub(lambda m: "\0" * len(m.group(0)), code)
        choice = None
        for rank in _RANKED:
            for old, new in rank:
                at = masked.find(old)
                if old.strip() in ("+", "-") and "\0" in masked:
                    continue  # most likely a message built from strings: a - there does not compile
                if at >= 0 and not (old.strip() in ("<", ">") and masked[at - 1: at] in "<>-"):
                    choice = (n, row, row[:at] + new + row[at + len(old):], f"{old.strip()}->{new.strip()}")
                    break
            if choice:
                break
        if choice is None:
            found = _SMALL_INT.search(masked)
            if found:
                digit = found.group(1)
                new = "0" if digit == "1" else str(int(digit) + 1)
                choice = (n, row, row[:found.start()] + new + row[found.end():], f"{digit}->{new}")
        if choice:
            out.append(choice)
    return out


def cmd_run(work: Path, files: list[str], budget: float, most: int) -> int:
    mapping = json.loads((work / "map.json").read_text())
    durations = json.loads((work / "durations.json").read_text())
    tree, build, target = _prepare(work, "build", "-O0")
    results = work / "results.jsonl"
    # Lines an earlier run of this work folder already mutated are left out: a second run samples new ones.
    done: set[tuple[str, int]] = set()
    if results.exists():
        done = {(r["file"], r["line"]) for r in map(json.loads, results.read_text().splitlines())}
    for name in files or sorted(mapping):
        path = tree / "csrc" / name
        original = path.read_text()
        lines = {int(n) for n in mapping.get(name, {})} - {line for f, line in done if f == name}
        mutants = mutants_of(original, lines)
        if len(mutants) > most:  # spread the sample over the whole file
            step = len(mutants) / most
            mutants = [mutants[int(i * step)] for i in range(most)]
        print(f"{name}: {len(lines)} covered lines, {len(mutants)} mutants", flush=True)
        for line, old_row, new_row, what in mutants:
            rows = original.splitlines(keepends=True)
            rows[line - 1] = new_row + ("\n" if rows[line - 1].endswith("\n") else "")
            start = time.monotonic()
            try:
                path.write_text("".join(rows))
                if not _build(build):
                    verdict, tests = "no build", []
                else:
                    _install_so(build, target)
                    tests = sorted(mapping[name][str(line)], key=lambda t: durations.get(t, 1.0))
                    chosen, spent = [], 0.0
                    for t in tests:
                        if chosen and spent + durations.get(t, 1.0) > budget:
                            break
                        chosen.append(t)
                        spent += durations.get(t, 1.0)
                    verdict, _ = _pytest(work, chosen, max(180.0, 3 * spent + 60), stop_first=True)
                    tests = chosen
            finally:
                path.write_text(original)
            record = {"file": name, "line": line, "change": what, "verdict": verdict, "text": old_row.strip(),
                      "tests": tests, "seconds": round(time.monotonic() - start, 1)}
            with results.open("a") as fh:
                fh.write(json.dumps(record) + "\n")
            print(f"{verdict:9} {name}:{line} {what}  {old_row.strip()[:90]}", flush=True)
    _build(build)
    _install_so(build, target)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("map")
    m.add_argument("--work", type=Path, required=True)
    m.add_argument("files", nargs="*", help="test files (default: every tests/test_*.py)")
    r = sub.add_parser("run")
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("files", nargs="*", help="csrc-relative files, e.g. kvaddr/ranges.hpp (default: every mapped)")
    r.add_argument("--budget", type=float, default=60.0, help="seconds of selected test files per mutant")
    r.add_argument("--max-per-file", type=int, default=10_000)
    args = parser.parse_args()
    if args.cmd == "map":
        return cmd_map(args.work, args.files)
    return cmd_run(args.work, args.files, args.budget, args.max_per_file)


if __name__ == "__main__":
    sys.exit(main())
