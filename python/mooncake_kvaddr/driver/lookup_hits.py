"""The hit arithmetic of :class:`~mooncake_kvaddr.driver.lookup.StoreLookup` on per-unit presence tables, as
pure functions of one group's spec and sizes, so that the lookup module keeps only probing and the walk over
groups. Notation as there: hits count alignment steps ``j``; ``k = alignment // unit`` units make one step and
``s = block_size // unit`` units one block.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from mooncake_kvaddr.driver.lookup_types import BoolArray, GroupSpec, IntArray

__all__ = ["last_true_at_or_before", "leading_run", "loadable_steps", "step_finder", "window_blocks"]


def loadable_steps(
    spec: GroupSpec, block_size: int, unit: int, alignment: int, present: BoolArray, top: int
) -> BoolArray:
    """``ok[j - 1]``: a group of ``spec`` and ``block_size``, probed in ``unit``-token units, can load ``j``
    steps with the keys a loader derives from that length (``top`` steps at most, all within the probed
    units)."""
    k, s = alignment // unit, block_size // unit
    at_end: BoolArray = present[k - 1 : top * k : k]  # the key at each candidate end: unit j * k - 1
    if spec.is_mamba:
        return at_end  # the state stored at the end
    blocks = present[s - 1 :: s]  # a block's own key is the unit that ends it
    if spec.sliding_window is None:
        # The key at the end (a partial tail when the end cuts a block) and every whole block before it:
        # (j * k) // s <= run, i.e. j <= ((run + 1) * s - 1) // k.
        ok: BoolArray = at_end.copy()
        ok[((leading_run(blocks) + 1) * s - 1) // k :] = False
        return ok
    # The window's blocks before an end on a block boundary (or every block back to the start). The end
    # j * k is a whole number of blocks when j is a multiple of q.
    q = s // math.gcd(s, k)
    steps = np.arange(q, top + 1, q, dtype=np.int64)
    last = steps * k // s  # blocks before the end
    first = np.maximum(last - window_blocks(spec, block_size), 0)
    absent = np.concatenate(([0], np.cumsum(~blocks, dtype=np.int64)))
    ok = np.zeros(top, dtype=np.bool_)
    ok[steps - 1] = absent[last] == absent[first]
    return ok


def step_finder(
    spec: GroupSpec, block_size: int, unit: int, alignment: int, present: BoolArray, top: int
) -> Callable[[int], int]:
    """vLLM 0.33's finder of one spec group whose members' presence, ANDed, is ``present``: the group's
    longest hit, in steps, at most a given step (``top`` at most). O(units) to build, O(1) a call."""
    k, s = alignment // unit, block_size // unit
    n = present.size
    if spec.is_full_attention:
        run = leading_run(present[s - 1 :: s])
        last_present = last_true_at_or_before(present)

        def full_attention(step: int) -> int:
            units = step * k
            whole = min(run, units // s)  # leading whole blocks inside the bound
            hit = whole * s
            stop = min(whole * s + s - 1, units, n)  # interior units of the next block, <= the bound
            if stop > whole * s and (p := int(last_present[stop - 1])) >= whole * s:
                hit = p + 1
            return hit // k

        return full_attention
    if spec.is_mamba:
        on_step = present & ((np.arange(n, dtype=np.int64) + 1) % k == 0)
        last_state = last_true_at_or_before(on_step)

        def mamba(step: int) -> int:
            units = min(step * k, n)
            return 0 if units <= 0 else (int(last_state[units - 1]) + 1) // k

        return mamba
    steps = min(top, n // k)
    ok = np.concatenate(([True], loadable_steps(spec, block_size, unit, alignment, present, steps)))
    last_ok = last_true_at_or_before(ok)

    def sliding_window(step: int) -> int:
        return int(last_ok[min(step, steps)])

    return sliding_window


def window_blocks(spec: GroupSpec, block_size: int) -> int:
    """Blocks a sliding-window hit needs before its end: ``ceil((window - 1) / block_size)``."""
    assert spec.sliding_window is not None
    return -(-(spec.sliding_window - 1) // block_size)


def leading_run(flags: BoolArray) -> int:
    """How many leading entries are True."""
    misses = np.flatnonzero(~flags)
    return int(misses[0]) if misses.size else int(flags.size)


def last_true_at_or_before(flags: BoolArray) -> IntArray:
    """``out[i]``: the highest index ``<= i`` whose flag is True, or -1."""
    marks = np.where(flags, np.arange(flags.size, dtype=np.int64), -1)
    return np.maximum.accumulate(marks) if marks.size else marks
