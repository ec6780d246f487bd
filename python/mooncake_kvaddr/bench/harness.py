"""The one harness every bench section uses: timing, GIL-stall counting, printing tables, the JSON report.

It exists so that every section measures by the same rules (``docs/benchmarks.md``, "How it measures"): variants
interleaved in one process after a warm-up, medians and ratios rather than lone absolute times, a named baseline
on every table and in the JSON, and GIL-held time seen by a busy Python thread (:class:`StallCounter`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mooncake_kvaddr._version import __version__

# Variant names shared by several sections (and by the plot).
NUMPY_BASELINE = "numpy + tolist (vLLM 0.33 prepare_values)"
ORACLE = "oracle (pure Python loop)"


# ----------------------------------------------------------------------------------------------- timing


@dataclass
class Result:
    """Timings of one variant, in milliseconds."""

    name: str
    samples: list[float] = field(default_factory=list)

    def quantile(self, q: float) -> float:
        """The ``q`` quantile (nearest rank) of the samples."""
        ordered = sorted(self.samples)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    @property
    def median(self) -> float:
        """Median of the samples (ms)."""
        return statistics.median(self.samples)

    def summary(self, baseline_ms: float | None) -> dict[str, Any]:
        """Median, p10, p90, sample count and the speed-up over ``baseline_ms`` (None without one)."""
        return {
            "median_ms": self.median,
            "p10_ms": self.quantile(0.1),
            "p90_ms": self.quantile(0.9),
            "samples": len(self.samples),
            "speedup_vs_baseline": (baseline_ms / self.median) if baseline_ms else None,
        }


def run_interleaved(variants: Mapping[str, Callable[[int], object]], reps: int, warmup: int = 2) -> list[Result]:
    """Time each variant ``reps`` times, round-robin with a rotating start.

    ``fn(rep)`` is called with the repetition number (negative during warm-up) and its result is freed inside
    the timed region: freeing Python objects is GIL time too.
    """
    names = list(variants)
    results = {name: Result(name) for name in names}
    for rep in range(-warmup, reps):
        offset = rep % len(names)
        for name in names[offset:] + names[:offset]:
            fn = variants[name]
            t0 = time.perf_counter()
            out = fn(rep)
            del out
            elapsed = (time.perf_counter() - t0) * 1e3
            if rep >= 0:
                results[name].samples.append(elapsed)
    return list(results.values())


def median_ms(samples: Iterable[float]) -> float:
    """Median of samples already in milliseconds."""
    return statistics.median(list(samples))


# ------------------------------------------------------------------------------------------ GIL stalls


class StallCounter:
    """A busy pure-Python thread that timestamps every iteration.

    While another thread holds the GIL it cannot run, so its gaps measure GIL-held time. :meth:`reset` opens
    a window; afterwards read ``longest`` (s), ``stalled`` (s, the sum of gaps over :attr:`STALL`) and
    ``iterations``. Use as a context manager so the thread always stops.
    """

    STALL = 0.0005

    def __init__(self) -> None:
        self._stop = threading.Event()
        self.reset()
        self._thread = threading.Thread(target=self._run, name="bench-stall-counter", daemon=True)
        self._thread.start()

    def reset(self) -> None:
        """Start a new measuring window."""
        self.longest = 0.0
        self.stalled = 0.0
        self.iterations = 0

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            now = time.perf_counter()
            gap = now - last
            if gap > self.longest:
                self.longest = gap
            if gap > self.STALL:
                self.stalled += gap
            self.iterations += 1
            last = now

    def close(self) -> None:
        """Stop the thread and wait for it."""
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> StallCounter:
        time.sleep(0.01)  # let the thread reach its loop before the first window
        self.reset()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def beside_spinner(fn: Callable[[], object], seconds: float) -> dict[str, float]:
    """Call ``fn`` repeatedly for ``seconds`` beside a :class:`StallCounter`.

    Returns the median ms per call, the busy thread's longest stall (ms) and its iterations per second (M).
    """
    samples = []
    with StallCounter() as counter:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            c0 = time.perf_counter()
            out = fn()
            del out
            samples.append((time.perf_counter() - c0) * 1e3)
        elapsed = time.perf_counter() - t0
        longest, iterations = counter.longest, counter.iterations
    return {
        "ms_per_call": statistics.median(samples),
        "thread_longest_stall_ms": longest * 1e3,
        "thread_mits": iterations / elapsed / 1e6,
    }


# ------------------------------------------------------------------------------------------- reporting


@dataclass(frozen=True)
class Col:
    """One printed column: ``key`` of the row dicts, its title, and a format spec for numbers."""

    key: str
    title: str
    fmt: str = ".3f"
    suffix: str = ""

    def cell(self, row: Mapping[str, Any]) -> str:
        value = row.get(self.key)
        if value is None:
            return "-"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return str(value)
        return f"{value:{self.fmt}}{self.suffix}"


def table(
    title: str,
    baseline: str | None,
    rows: Mapping[str, Mapping[str, Any]],
    cols: Sequence[Col],
    *,
    label: str = "variant",
    notes: Sequence[str] = (),
    **extra: Any,
) -> dict[str, Any]:
    """Print one table and return its JSON form: ``{"title", "baseline", "rows", **extra}``.

    ``baseline`` says what every ratio in the table is measured against (None: the table has no ratios).
    """
    print(f"\n{title}")
    print(f"  baseline: {baseline}" if baseline else "  baseline: none (absolute figures, no ratios)")
    for note in notes:
        print(f"  {note}")
    width = max([len(label), *(len(name) for name in rows)]) + 1
    widths = [max(len(c.title), 9) for c in cols]
    print(f"  {label:<{width}}" + "".join(f" {c.title:>{w}}" for c, w in zip(cols, widths)))
    for name, row in rows.items():
        print(f"  {name:<{width}}" + "".join(f" {c.cell(row):>{w}}" for c, w in zip(cols, widths)))
    return {"title": title, "baseline": baseline, "notes": list(notes), "rows": dict(rows), **extra}


TIMING_COLS = (
    Col("median_ms", "median ms"),
    Col("p10_ms", "p10"),
    Col("p90_ms", "p90"),
    Col("speedup_vs_baseline", "speed-up", ".1f", "x"),
)


def timing_table(title: str, results: Sequence[Result], baseline: str, **extra: Any) -> dict[str, Any]:
    """Print interleaved timings with each variant's speed-up over the ``baseline`` variant (one of them)."""
    by_name = {r.name: r for r in results}
    if baseline not in by_name:
        raise ValueError(f"baseline {baseline!r} is not one of the variants {list(by_name)}")
    base = by_name[baseline].median
    rows = {r.name: r.summary(base) for r in results}
    return table(title, f"{baseline} (speed-up = its median / the variant's median)", rows, TIMING_COLS, **extra)


def skipped(title: str, reason: str) -> None:
    """Print that a section did not run, and why (its JSON entry is ``None``)."""
    print(f"\n{title}: skipped ({reason})")


def have_mooncake() -> bool:
    """True if a ``mooncake`` package (any variant) is installed; sections that need it skip otherwise."""
    return importlib.util.find_spec("mooncake") is not None


NO_MOONCAKE = "no Mooncake wheel; pip install 'mooncake_kvaddr[mooncake]' or the extra of your variant"


# --------------------------------------------------------------------------------------- JSON report


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


MOONCAKE_DISTRIBUTIONS = (
    "mooncake-transfer-engine-non-cuda",
    "mooncake-transfer-engine",
    "mooncake-transfer-engine-cuda13",
    "mooncake-transfer-engine-rocm",
    "mooncake-transfer-engine-efa",
    "mooncake-transfer-engine-efa-cuda13",
    "mooncake-transfer-engine-efa-non-cuda",
    "mooncake-transfer-engine-musa",
    "mooncake-transfer-engine-npu",
)


def machine() -> dict[str, Any]:
    """Where the numbers come from: CPU, cores, Python, numpy, the Mooncake variant and ours."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    mooncake = next(
        (f"{d} {v}" for d in MOONCAKE_DISTRIBUTIONS if (v := _dist_version(d)) is not None), None
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "mooncake": mooncake,
        "mooncake_kvaddr": __version__,
        "platform": platform.platform(),
    }


class Report:
    """The run's JSON document: the machine record, the repetitions, one entry per section."""

    def __init__(self, reps: int, quick: bool) -> None:
        self.data: dict[str, Any] = {"machine": machine(), "reps": reps, "quick": quick, "sections": {}}

    @property
    def machine(self) -> dict[str, Any]:
        """The machine record."""
        machine_: dict[str, Any] = self.data["machine"]
        return machine_

    @property
    def sections(self) -> dict[str, Any]:
        """Section name -> its JSON (None for a skipped section)."""
        sections: dict[str, Any] = self.data["sections"]
        return sections

    def add(self, name: str, value: Any) -> None:
        """Record one section's result."""
        self.sections[name] = value

    def write(self, path: str) -> None:
        """Write the report as indented JSON."""
        with open(path, "w") as f:
            json.dump(self.data, f, indent=2)
        print(f"\nwrote {path}")
