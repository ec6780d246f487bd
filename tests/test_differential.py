"""Native vs oracle on generated inputs (hypothesis): block sizes, hash block sizes, R up to 160, cycling
block_len, multi-block spans, partial tails, negative block indices, and addresses up to and past 2**63."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvaddr_testing import assert_native_ints, paired

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


@st.composite
def layouts(draw: Any, huge: bool = False) -> dict[str, Any]:
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 256]))
    hbs = draw(st.sampled_from([d for d in (1, 2, 4, 8, 16, 32, 64, 128, 256) if block_size % d == 0]))
    n_regions = draw(st.integers(0, 160))
    n_lens = draw(st.integers(1, max(1, n_regions))) if n_regions else draw(st.integers(0, 3))
    top = INT64_MAX if huge else 1 << 57
    bases = draw(st.lists(st.integers(0, top), min_size=n_regions, max_size=n_regions))
    lens = draw(st.lists(st.integers(1, 1 << 22), min_size=n_lens, max_size=n_lens))
    n_blocks = draw(st.integers(1, 64))
    block_ids = draw(st.lists(st.integers(-(1 << 20), 1 << (44 if huge else 30)), min_size=n_blocks,
                              max_size=n_blocks))
    chunk = st.tuples(
        st.integers(-n_blocks - 2, n_blocks + 1),  # first block index (out-of-range ones included)
        st.integers(-2, 3 * block_size // hbs),  # span in hash blocks (0, negative, multi-block, partial)
        st.integers(0, 3),  # misalignment in tokens (mostly 0)
    )
    raw = draw(st.lists(chunk, min_size=0, max_size=40))
    misalign = draw(st.booleans())
    chunks = []
    for block_index, span_hashes, extra in raw:
        start = block_index * block_size + draw(st.integers(0, block_size // hbs - 1)) * hbs
        chunks.append((start, start + span_hashes * hbs + (extra if misalign else 0)))
    return dict(block_size=block_size, hbs=hbs, bases=bases, lens=lens, block_ids=block_ids, chunks=chunks)


def outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except (AssertionError, IndexError, ZeroDivisionError, OverflowError, TypeError) as exc:
        return "error", exc


def fits_int64(result: tuple[list[list[int]], list[list[int]], list[int]]) -> bool:
    return all(INT64_MIN <= v <= INT64_MAX for rows in result[:2] for row in rows for v in row)


def check(layout: dict[str, Any], cache_bytes: int) -> None:
    native, oracle = paired(layout["bases"], layout["lens"], layout["block_size"], layout["hbs"],
                            address_cache_bytes=cache_bytes)
    chunks, block_ids = layout["chunks"], layout["block_ids"]
    want_kind, want = outcome(oracle.prepare_values, chunks, block_ids)
    for _ in range(2):  # second round runs on warm address rows
        got_kind, got = outcome(native.prepare_values, chunks, block_ids)
        if want_kind == "ok" and fits_int64(want):
            assert got_kind == "ok", got
            assert got == want
            assert_native_ints(got)
            arrays = native.prepare_values_array(chunks, block_ids)
            assert [a.tolist() for a in arrays] == list(want)
        elif want_kind == "ok":
            assert got_kind == "error" and isinstance(got, OverflowError)
        else:
            assert got_kind == "error", got
            assert isinstance(got, type(want)), (got, want)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_prepare_values_matches_oracle(layout: dict[str, Any]) -> None:
    check(layout, cache_bytes=64 << 20)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_prepare_values_matches_oracle_without_cache(layout: dict[str, Any]) -> None:
    check(layout, cache_bytes=0)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(huge=True))
def test_huge_addresses_match_or_overflow(layout: dict[str, Any]) -> None:
    check(layout, cache_bytes=1 << 16)


@settings(max_examples=300, deadline=None)
@given(layouts(), st.integers(-(1 << 40), 1 << 40))
def test_prepare_value_for_block_matches_oracle(layout: dict[str, Any], block_id: int) -> None:
    native, oracle = paired(layout["bases"], layout["lens"], layout["block_size"], layout["hbs"])
    want_kind, want = outcome(oracle.prepare_value_for_block, block_id)
    got_kind, got = outcome(native.prepare_value_for_block, block_id)
    if want_kind == "ok" and all(INT64_MIN <= v <= INT64_MAX for v in want[0]):
        assert got == want
    else:
        assert got_kind == "error"


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_numpy_anchor_agrees_where_it_does_not_wrap(layout: dict[str, Any]) -> None:
    from mooncake_kvaddr.core.oracle import numpy_prepare_values

    _, oracle = paired(layout["bases"], layout["lens"], layout["block_size"], layout["hbs"])
    want_kind, want = outcome(oracle.prepare_values, layout["chunks"], layout["block_ids"])
    if want_kind != "ok" or not fits_int64(want) or not layout["bases"]:
        return
    with np.errstate(over="ignore"):
        got = numpy_prepare_values(layout["chunks"], layout["block_ids"], layout["bases"], layout["lens"],
                                   layout["block_size"], layout["hbs"])
    assert got == want
