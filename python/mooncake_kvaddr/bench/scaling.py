"""Section "scaling": every address variant over request lengths and region counts, and its plot.

Baseline: numpy + ``.tolist()`` (vLLM 0.33's ``prepare_values``) at the same length and region count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mooncake_kvaddr.bench import addresses
from mooncake_kvaddr.bench.harness import NUMPY_BASELINE, ORACLE, Col, table
from mooncake_kvaddr.bench.workload import HEADLINE, Shape

TOKENS = (1_024, 4_096, 16_384, 65_536, 262_144, 1_048_576)
REGIONS = (1, 61, 96, 160)
QUICK_TOKENS = (1_024, 16_384, 262_144)
QUICK_REGIONS = (1, 96)

SHORT = {
    NUMPY_BASELINE: "numpy",
    addresses.LISTS_COLD: "lists cold",
    addresses.LISTS_WARM: "lists warm",
    addresses.TUPLES_COLD: "tuples cold",
    addresses.TUPLES_WARM: "tuples warm",
    addresses.ARRAYS: "arrays",
    ORACLE: "oracle",
}


def run(tokens: Sequence[int], regions: Sequence[int], reps: int) -> dict[str, Any]:
    """Print and return the section: median ms and speed-up over numpy per (length, region count)."""
    points: dict[str, Any] = {}
    shown: dict[str, dict[str, str]] = {}
    names: list[str] = []
    for n_regions in regions:
        for n_tokens in tokens:
            shape = Shape(tokens=n_tokens, regions=n_regions)
            # The oracle is minutes per point at the largest shapes and adds nothing new there.
            results = addresses.measure(shape, reps, include_oracle=n_tokens * n_regions <= 65_536 * 160)
            base = next(r.median for r in results if r.name == NUMPY_BASELINE)
            names = names or [r.name for r in results if r.name != ORACLE]
            by_name = {r.name: r for r in results}
            points[f"{n_tokens}x{n_regions}"] = {
                "tokens": n_tokens,
                "regions": n_regions,
                "chunks": shape.chunks,
                "variants": {r.name: r.summary(base) for r in results},
            }
            shown[f"{n_tokens:>9} tokens, R {n_regions:>3}"] = {
                SHORT.get(n, n): f"{by_name[n].median:.3f} ({base / by_name[n].median:5.1f}x)" for n in names
            }
    cols = [Col(SHORT.get(n, n), SHORT.get(n, n)) for n in names]
    out = table(f"Scaling: median ms per request (speed-up), block_size {HEADLINE.block_size}",
                f"{NUMPY_BASELINE} at the same length and region count", shown, cols, label="request")
    out["rows"] = points  # the JSON keeps the numbers, not the printed cells
    return out


def plot(report: dict[str, Any], path: str) -> bool:
    """Speed-up over numpy vs request length, one line per variant, one panel per region count."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed (pip install 'mooncake_kvaddr[bench]'); no plot written")
        return False
    section = report["sections"].get("scaling") or {}
    rows = section.get("rows", {})
    if not rows:
        print("--plot: no scaling section in this run; no plot written")
        return False
    regions = sorted({r["regions"] for r in rows.values()})
    fig, axes = plt.subplots(1, len(regions), figsize=(4.2 * len(regions), 3.8), squeeze=False, sharey=True)
    for ax, n_regions in zip(axes[0], regions):
        points = sorted((r for r in rows.values() if r["regions"] == n_regions), key=lambda r: r["tokens"])
        for name in points[0]["variants"]:
            xs = [r["tokens"] for r in points if name in r["variants"]]
            ys = [r["variants"][name]["speedup_vs_baseline"] for r in points if name in r["variants"]]
            ax.plot(xs, ys, marker="o", label=SHORT.get(name, name))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"R = {n_regions} regions")
        ax.set_xlabel("request length (tokens)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("speed-up vs numpy + tolist (vLLM 0.33)")
    axes[0][-1].legend(fontsize=8)
    machine = report["machine"]
    fig.suptitle(f"mooncake_kvaddr {machine['mooncake_kvaddr']} prepare_values, {machine['cpu']} "
                 f"({machine['cores']} cores); baseline: numpy + tolist", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
    return True
