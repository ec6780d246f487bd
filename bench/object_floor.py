"""What the list form of ``prepare_values`` can reach at best: the cost of the result's Python objects alone.

Run from the repository root (after an in-place build)::

    PYTHONPATH=python python3 bench/object_floor.py [--reps 30] [--json bench/results/object_floor.json]

The drop-in ``prepare_values`` (seed-era ``ChunkedTokenDatabase`` and the vLLM 0.33 mirror's
``RankLocalStoreLayout``) returns lists of Python ints, type for type with vLLM. On the headline request
(2,258 chunks x 100 regions) that is 225,800 address ints and 4,516 fresh row lists per call, whatever
computes them. This script times, interleaved in one process with the result freed inside the timed region
(``bench/harness.run_interleaved``), the two baselines, our list paths, and two **floors** that compute
nothing and only build the objects the result is made of:

- *cold floor*: the address ints alone, from an int64 matrix already holding the answer (numpy's ``tolist``:
  one new int per cell, one list per row; the size rows are not even included);
- *warm reference*: CPython's own fresh copies, by list slicing with the cyclic GC paused, of address and
  size rows that are already built: what any output returning new lists of existing ints does at least (a
  new list per row and a reference count taken, and later dropped, per item). Our warm path does exactly
  that in C with lists the GC does not track, so it runs below this reference; it is printed to show that
  no Python-level shortcut is left.

``baseline / cold floor`` is the largest cold speed-up any list output can show against that baseline on
this machine. The issues' list-form targets (cold >= 3x, warm >= 20x) are printed beside it.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

from mooncake_kvaddr.bench.harness import NUMPY_BASELINE, machine, run_interleaved
from mooncake_kvaddr.bench.workload import HEADLINE, cold_block_ids, make_databases, request_chunks
from mooncake_kvaddr.core.oracle import numpy_prepare_values
from mooncake_kvaddr.integrations.vllm import data as mirror

COLD_FLOOR = "floor, cold: address ints alone (int64 matrix .tolist())"
WARM_FLOOR = "reference, warm: CPython's copies of built rows (slicing, GC paused)"


def _vllm_reference() -> tuple[Any, str] | None:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import data as vllm_data
    except Exception:  # vLLM absent or not importable here: the mirror rows are compared to the numpy anchor
        return None
    import vllm

    return vllm_data, f"vLLM {vllm.__version__} RankLocalStoreLayout"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    shape = HEADLINE
    native, _ = make_databases(shape)
    chunks = request_chunks(shape)
    warm_ids = random.Random(0).sample(range(1 << 20), shape.chunks)
    bases, lens = native.kv_caches_base_addr, native.block_len
    for _ in range(2):  # a block id's rows are cached on its second sighting
        native.prepare_values(chunks, warm_ids)

    # The mirror over the same regions; every chunk is one whole block (vLLM 0.33 keys whole blocks).
    md = mirror.KeyMetadata("bench", 0, 0, 0, 0)
    whole = [(c * shape.block_size, (c + 1) * shape.block_size) for c in range(shape.chunks)]
    shard_ids = [0] * shape.chunks
    layout = mirror.RankLocalStoreLayout(md, shape.block_size, shape.block_size)
    layout.set_kv_caches_base_addr(list(bases))
    layout.set_block_len(list(lens))
    for _ in range(2):
        layout.prepare_values(whole, warm_ids, shard_ids)

    addr_matrix, size_matrix, _ids = native.prepare_values_array(chunks, warm_ids)
    addr_matrix = np.array(addr_matrix)  # its own memory, not a pooled buffer
    built_addrs: list[list[int]] = addr_matrix.tolist()
    built_sizes: list[list[int]] = np.array(size_matrix).tolist()
    expected = numpy_prepare_values(chunks, warm_ids, bases, lens, shape.block_size, shape.hash_block_size)
    if native.prepare_values(chunks, warm_ids) != expected or [built_addrs, built_sizes] != list(expected[:2]):
        raise AssertionError("the measured paths disagree with the numpy anchor")

    def warm_floor() -> object:
        gc.disable()
        try:
            return [row[:] for row in built_addrs], [row[:] for row in built_sizes]
        finally:
            gc.enable()

    variants: dict[str, Callable[[int], object]] = {
        NUMPY_BASELINE: lambda rep: numpy_prepare_values(
            chunks, warm_ids, bases, lens, shape.block_size, shape.hash_block_size
        ),
        "drop-in lists, cold block ids": lambda rep: native.prepare_values(chunks, cold_block_ids(shape, rep, 1 << 21)),
        "drop-in lists, warm block ids": lambda rep: native.prepare_values(chunks, warm_ids),
        "mirror lists, cold block ids": lambda rep: layout.prepare_values(
            whole, cold_block_ids(shape, rep, 1 << 23), shard_ids
        ),
        "mirror lists, warm block ids": lambda rep: layout.prepare_values(whole, warm_ids, shard_ids),
        COLD_FLOOR: lambda rep: addr_matrix.tolist(),
        WARM_FLOOR: lambda rep: warm_floor(),
    }
    reference = _vllm_reference()
    vllm_name = None
    if reference is not None:
        module, vllm_name = reference
        ref = module.RankLocalStoreLayout(module.KeyMetadata("bench", 0, 0, 0, 0), shape.block_size, shape.block_size)
        ref.set_kv_caches_base_addr(list(bases))
        ref.set_block_len(list(lens))
        if ref.prepare_values(whole, warm_ids, shard_ids) != layout.prepare_values(whole, warm_ids, shard_ids):
            raise AssertionError("the mirror disagrees with vLLM on the benchmark shape")
        variants[vllm_name] = lambda rep: ref.prepare_values(whole, warm_ids, shard_ids)

    results = {r.name: r for r in run_interleaved(variants, args.reps)}
    med = {name: statistics.median(r.samples) for name, r in results.items()}
    low = {name: min(r.samples) for name, r in results.items()}
    print(
        f"prepare_values, list form: {shape.describe()}; result freed inside the timed region; "
        f"{args.reps} interleaved reps"
    )
    print(f"  {'variant':<68} {'median ms':>10} {'min ms':>8}")
    for name in variants:
        print(f"  {name:<68} {med[name]:>10.3f} {low[name]:>8.3f}")
    ceilings: dict[str, dict[str, float]] = {}
    baselines = [NUMPY_BASELINE] + ([vllm_name] if vllm_name else [])
    for base in baselines:
        ours = "drop-in" if base == NUMPY_BASELINE else "mirror"
        ceilings[base] = {
            "cold_ceiling": med[base] / med[COLD_FLOOR],
            "cold_ceiling_minima": low[base] / low[COLD_FLOOR],
            "cold": med[base] / med[f"{ours} lists, cold block ids"],
            "warm": med[base] / med[f"{ours} lists, warm block ids"],
            "warm_cpython_copies": med[base] / med[WARM_FLOOR],
        }
        c = ceilings[base]
        print(
            f"  vs {base}: {ours} lists cold {c['cold']:.1f}x (target 3x; the address ints alone allow at most "
            f"{c['cold_ceiling']:.1f}x, {c['cold_ceiling_minima']:.1f}x of the minima), warm {c['warm']:.1f}x "
            f"(target 20x; CPython's own row copies {c['warm_cpython_copies']:.1f}x)"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(
                {
                    "machine": machine(),
                    "shape": shape.describe(),
                    "reps": args.reps,
                    "median_ms": med,
                    "min_ms": low,
                    "ceilings": ceilings,
                },
                out,
                indent=2,
            )
            out.write("\n")


if __name__ == "__main__":
    main()
