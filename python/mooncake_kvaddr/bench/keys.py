"""Sections "keys" and "lookup_keys": key strings for one request's sha256 chunk hashes.

Baselines: Python's ``key_for`` per chunk (the oracle, written as vLLM writes keys) for keys; Python f-strings
over every rank namespace for lookup keys.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from mooncake_kvaddr.bench.harness import run_interleaved, timing_table
from mooncake_kvaddr.bench.workload import Shape, make_databases
from mooncake_kvaddr.core.keys import build_lookup_keys

KEYS_BASELINE = "keys: Python key_for per chunk"
LOOKUP_BASELINE = "lookup keys: Python f-strings"


def run(shape: Shape, reps: int, namespaces: int = 8) -> tuple[dict[str, Any], dict[str, Any]]:
    """Print and return the two sections (keys, lookup keys); both run interleaved in one round."""
    native, oracle = make_databases(shape)
    rng = random.Random(1)
    hashes = [rng.randbytes(32) for _ in range(shape.chunks)]
    blob = b"".join(hashes)
    prefix = native.key_prefix
    prefixes = [prefix.replace("tp_rank:0", f"tp_rank:{i}") for i in range(namespaces)]

    def python_lookup_keys() -> list[str]:
        keys: list[str] = []
        for h in hashes:
            hex_ = h.hex()
            keys.extend(f"{p}@{hex_}" for p in prefixes)
        return keys

    if build_lookup_keys(prefixes, blob, 32) != python_lookup_keys():
        raise AssertionError("native lookup keys differ from f-strings")
    if native.keys_for(hashes) != [oracle.key_for(h) for h in hashes]:
        raise AssertionError("native keys differ from the oracle")
    variants: dict[str, Callable[[int], object]] = {
        KEYS_BASELINE: lambda rep: [oracle.key_for(h) for h in hashes],
        "keys: Python f-string list": lambda rep: [f"{prefix}@{h.hex()}" for h in hashes],
        "keys: native build_keys (list)": lambda rep: native.keys_for(hashes),
        "keys: native build_keys (blob)": lambda rep: native.keys_for(blob, 32),
        LOOKUP_BASELINE: lambda rep: python_lookup_keys(),
        "lookup keys: native (blob)": lambda rep: build_lookup_keys(prefixes, blob, 32),
    }
    results = run_interleaved(variants, reps)
    keys = [r for r in results if not r.name.startswith("lookup")]
    lookup = [r for r in results if r.name.startswith("lookup")]
    return (
        timing_table(f"Key strings for {shape.chunks} sha256 hashes", keys, KEYS_BASELINE, shape=shape.describe()),
        timing_table(f"Lookup keys: {shape.chunks} sha256 hashes x {namespaces} namespaces", lookup,
                     LOOKUP_BASELINE, shape=shape.describe()),
    )
