"""Every integer form of every address/size argument, at every entry point that hands addresses to Mooncake.

A value that is negative read as signed, or >= 2**63 read as unsigned (the same bits), or a null address, must
be refused - ``ValueError``/``OverflowError``/``TypeError``, or ``-600`` for that key where the API reports per
key - before Mooncake sees it: never a signal, never a wild pointer in a copy, never process memory in the
store. Good values in every accepted form (unsigned arrays included) still move their bytes. SECURITY.md,
"Input forms", lists what each entry point accepts.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake_kvaddr.driver.config import StoreConfig
from mooncake_kvaddr.driver.master import EmbeddedMaster
from mooncake_kvaddr.driver.native_client import NativeClient
from mooncake_kvaddr.driver.store import MooncakeStore

pytestmark = pytest.mark.mooncake

REFUSED = -600
REGIONS = 2
REGION_BYTES = 256

#: Values no address or size may have, with the integer forms that can hold each.
BAD_VALUES = (-1, -4096, -(2**63), 2**63, 2**63 + 4096, 2**64 - 4096, 2**64 - 1)
SIGNED = (np.int8, np.int16, np.int32, np.int64)
UNSIGNED = (np.uint8, np.uint16, np.uint32, np.uint64)


def _holds(dtype: Any, value: int) -> bool:
    info = np.iinfo(dtype)
    return int(info.min) <= value <= int(info.max)


def _raw_store(master: EmbeddedMaster) -> Any:
    import mooncake.store as ms

    store = ms.MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 0, "tcp", "", master.rpc_address) == 0
    return store


@pytest.fixture(scope="module")
def raw(master: EmbeddedMaster) -> Iterator[Any]:
    store = _raw_store(master)
    yield store
    store.close()


@pytest.fixture(scope="module")
def native(raw: Any) -> NativeClient:
    client, reason = NativeClient.probe(raw)
    assert client is not None, reason
    return client


@pytest.fixture(scope="module", params=[True, False], ids=["native", "bound"])
def driver(request: pytest.FixtureRequest, master: EmbeddedMaster) -> Iterator[MooncakeStore]:
    config = StoreConfig(
        master_server_address=master.rpc_address, global_segment_size="32MiB", local_buffer_size=0,
        native_client=request.param,
    )
    with MooncakeStore(config) as store:
        assert store.native_client_active is request.param
        yield store


class Memory:
    """Two keys' worth of registered source memory and a destination; rows of key 1 carry the bad value."""

    def __init__(self) -> None:
        self.src = np.random.default_rng(1).integers(0, 256, 2 * REGIONS * REGION_BYTES, dtype=np.uint8)
        self.dst = np.zeros_like(self.src)
        step = np.arange(REGIONS, dtype=np.int64) * REGION_BYTES
        self.src_rows = np.stack([self.src.ctypes.data + step, self.src.ctypes.data + REGIONS * REGION_BYTES + step])
        self.dst_rows = np.stack([self.dst.ctypes.data + step, self.dst.ctypes.data + REGIONS * REGION_BYTES + step])
        self.sizes = np.full((2, REGIONS), REGION_BYTES, dtype=np.int64)

    def assert_key1_untouched(self) -> None:
        """Key 1 (the one with the bad value) wrote nothing; key 0 is either untouched or Mooncake's bytes."""
        half = REGIONS * REGION_BYTES
        assert not self.dst[half:].any()
        key0, src0 = self.dst[:half], self.src[:half]
        assert bool(np.all((key0 == 0) | (key0 == src0)))

    def ranges(self) -> np.ndarray[Any, Any]:
        return np.array(
            [[self.src.ctypes.data, self.src.ctypes.data + self.src.nbytes],
             [self.dst.ctypes.data, self.dst.ctypes.data + self.dst.nbytes]], dtype=np.int64
        )


def _form(matrix: list[list[int]], form: str, dtype: Any) -> Any:
    """The same rows in one of the accepted containers."""
    if form == "matrix":
        return np.array(matrix, dtype=dtype)
    if form == "fortran":
        return np.asfortranarray(np.array(matrix, dtype=dtype))
    if form == "byteswapped":
        return np.array(matrix, dtype=np.dtype(dtype).newbyteorder(">"))
    if form == "lists":
        return [list(row) for row in matrix]
    if form == "tuples":
        return tuple(tuple(row) for row in matrix)
    if form == "row_arrays":
        return [np.array(row, dtype=dtype) for row in matrix]
    if form == "scalars":
        return [[np.dtype(dtype).type(v) for v in row] for row in matrix]
    raise AssertionError(form)


def _flat(values: list[int], form: str, dtype: Any) -> Any:
    if form in ("matrix", "fortran", "row_arrays"):
        return np.array(values, dtype=dtype)
    if form == "byteswapped":
        return np.array(values, dtype=np.dtype(dtype).newbyteorder(">"))
    if form in ("lists", "tuples"):
        return list(values) if form == "lists" else tuple(values)
    if form == "scalars":
        return [np.dtype(dtype).type(v) for v in values]
    raise AssertionError(form)


def _flat_fitting(values: list[int], form: str, dtype: Any) -> Any:
    """:func:`_flat` in ``dtype`` when every value fits it, else in the one of int64/uint64 that holds them."""
    if not all(_holds(dtype, v) for v in values):
        dtype = np.int64 if all(_holds(np.int64, v) for v in values) else np.uint64
    return _flat(values, form, dtype)


FORMS = ("matrix", "fortran", "byteswapped", "lists", "tuples", "row_arrays", "scalars")


@st.composite
def bad_inputs(draw: st.DrawFn) -> tuple[str, Any, int, str, int]:
    """(form, dtype, bad value, which argument holds it, its column)."""
    value = draw(st.sampled_from(BAD_VALUES))
    form = draw(st.sampled_from(FORMS))
    # Python-int containers ignore the dtype; every bad value fits int64 or uint64, so one dtype always holds it.
    dtype = draw(st.sampled_from([d for d in SIGNED + UNSIGNED if _holds(d, value)]))
    where = draw(st.sampled_from(("addrs", "sizes")))
    column = draw(st.integers(0, REGIONS - 1))
    return form, dtype, value, where, column


def _rows_with(mem: Memory, rows: np.ndarray[Any, Any], where: str, column: int, value: int) -> tuple[Any, Any]:
    addrs = rows.tolist()
    sizes = mem.sizes.tolist()
    (addrs if where == "addrs" else sizes)[1][column] = value
    return addrs, sizes


def _forms_fit(values: list[list[int]], dtype: Any) -> bool:
    return all(_holds(dtype, v) for row in values for v in row)


def _refused_or_raised(call: Callable[[], Any]) -> list[int] | None:
    """The per-key codes, or None when the call raised a clear Python exception."""
    try:
        result = call()
    except (ValueError, OverflowError, TypeError):
        return None
    return [int(c) for c in (result.codes if hasattr(result, "codes") else result)]


def _exists(driver: MooncakeStore, keys: list[str]) -> list[int]:
    return [int(c) for c in driver.batch_is_exist(keys).codes]


def _check_put(codes: list[int] | None, exists: Callable[[list[str]], list[int]], keys: list[str]) -> None:
    if codes is not None:
        assert codes[1] == REFUSED, codes
    # The key with the bad value is never stored: nothing of this process's memory reached the pool.
    assert exists([keys[1]]) == [0]


def _check_get(codes: list[int] | None) -> None:
    if codes is not None:
        assert codes[1] == REFUSED, codes  # a key that reached Mooncake would answer -704 (never stored)


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(case=bad_inputs(), guarded=st.booleans())
def test_native_client_multi_buffer_refuses_every_bad_form(native: NativeClient, case: Any, guarded: bool) -> None:
    form, dtype, value, where, column = case
    mem = Memory()
    keys = [f"forms-{uuid.uuid4().hex}-{i}" for i in range(2)]
    ranges = mem.ranges() if guarded else None
    for op, rows in (("put", mem.src_rows), ("get", mem.dst_rows)):
        addrs, sizes = _rows_with(mem, rows, where, column, value)
        a = _form(addrs, form, dtype if _forms_fit(addrs, dtype) else np.int64)
        s = _form(sizes, form, dtype if _forms_fit(sizes, dtype) else np.int64)
        if op == "put":
            codes = _refused_or_raised(partial(native.batch_put_from_multi_buffers, keys, a, s, ranges=ranges))
            _check_put(codes, native.batch_is_exist, keys)
        else:
            codes = _refused_or_raised(partial(native.batch_get_into_multi_buffers, keys, a, s, ranges=ranges))
            _check_get(codes)
    mem.assert_key1_untouched()


@SETTINGS
@given(case=bad_inputs(), guarded=st.booleans())
def test_native_client_contiguous_refuses_every_bad_form(native: NativeClient, case: Any, guarded: bool) -> None:
    form, dtype, value, where, _ = case
    mem = Memory()
    keys = [f"forms-{uuid.uuid4().hex}-{i}" for i in range(2)]
    ranges = mem.ranges() if guarded else None
    for op, base in (("put", mem.src_rows), ("get", mem.dst_rows)):
        ptrs = base[:, 0].tolist()
        sizes = [REGION_BYTES, REGION_BYTES]
        (ptrs if where == "addrs" else sizes)[1] = value
        p, s = _flat_fitting(ptrs, form, dtype), _flat_fitting(sizes, form, dtype)
        if op == "put":
            codes = _refused_or_raised(partial(native.batch_put_from, keys, p, s, ranges=ranges))
            _check_put(codes, native.batch_is_exist, keys)
        else:
            codes = _refused_or_raised(partial(native.batch_get_into, keys, p, s, ranges=ranges))
            _check_get(codes)
    mem.assert_key1_untouched()


@SETTINGS
@given(case=bad_inputs())
def test_driver_store_refuses_every_bad_form(driver: MooncakeStore, case: Any) -> None:
    form, dtype, value, where, column = case
    mem = Memory()
    keys = [f"forms-{uuid.uuid4().hex}-{i}" for i in range(2)]
    for op, rows in (("put", mem.src_rows), ("get", mem.dst_rows)):
        addrs, sizes = _rows_with(mem, rows, where, column, value)
        a = _form(addrs, form, dtype if _forms_fit(addrs, dtype) else np.int64)
        s = _form(sizes, form, dtype if _forms_fit(sizes, dtype) else np.int64)
        ptrs, lens = rows[:, 0].tolist(), [REGION_BYTES, REGION_BYTES]
        (ptrs if where == "addrs" else lens)[1] = value
        flat_a, flat_s = _flat_fitting(ptrs, form, dtype), _flat_fitting(lens, form, dtype)
        if op == "put":
            for call in (
                partial(driver.batch_put_from_multi_buffers, keys, a, s),
                partial(driver.batch_put_from, keys, flat_a, flat_s),
            ):
                codes = _refused_or_raised(call)
                _check_put(codes, partial(_exists, driver), keys)
        else:
            for call in (
                partial(driver.batch_get_into_multi_buffers, keys, a, s),
                partial(driver.batch_get_into, keys, flat_a, flat_s),
            ):
                _check_get(_refused_or_raised(call))
    mem.assert_key1_untouched()


@pytest.fixture(scope="module", params=["native", "staged"])
def wrapper(request: pytest.FixtureRequest, master: EmbeddedMaster) -> Iterator[Any]:
    """The plugin's store wrappers, each over a Mooncake client of its own (closing a wrapper closes it)."""
    from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore
    from mooncake_kvaddr.integrations.vllm.staged_store import StagedMooncakeStore

    raw = _raw_store(master)
    store: Any = (
        NativeMooncakeStore(raw, armed=True) if request.param == "native"
        else StagedMooncakeStore(raw, staging_bytes=1 << 16, armed=True)
    )
    yield store
    store.close()


@SETTINGS
@given(case=bad_inputs())
def test_plugin_wrappers_refuse_every_bad_form(wrapper: Any, case: Any) -> None:
    form, dtype, value, where, column = case
    mem = Memory()
    for buf in (mem.src, mem.dst):
        assert wrapper.register_buffer(int(buf.ctypes.data), buf.nbytes) == 0
    try:
        keys = [f"forms-{uuid.uuid4().hex}-{i}" for i in range(2)]
        addrs, sizes = _rows_with(mem, mem.src_rows, where, column, value)
        a = _form(addrs, form, dtype if _forms_fit(addrs, dtype) else np.int64)
        s = _form(sizes, form, dtype if _forms_fit(sizes, dtype) else np.int64)
        codes = _refused_or_raised(partial(wrapper.batch_put_from_multi_buffers, keys, a, s))
        _check_put(codes, wrapper.wrapped.batch_is_exist, keys)
        addrs, sizes = _rows_with(mem, mem.dst_rows, where, column, value)
        a = _form(addrs, form, dtype if _forms_fit(addrs, dtype) else np.int64)
        s = _form(sizes, form, dtype if _forms_fit(sizes, dtype) else np.int64)
        _check_get(_refused_or_raised(partial(wrapper.batch_get_into_multi_buffers, keys, a, s)))
        mem.assert_key1_untouched()
    finally:
        for buf in (mem.src, mem.dst):
            wrapper.unregister_buffer(int(buf.ctypes.data))


# --------------------------------------------------------------------------- good values in every form move bytes


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
def test_good_rows_move_their_bytes_in_every_form(native: NativeClient, form: str, dtype: Any) -> None:
    mem = Memory()
    keys = [f"forms-{uuid.uuid4().hex}-{i}" for i in range(2)]
    sizes = _form(mem.sizes.tolist(), form, dtype)
    codes = native.batch_put_from_multi_buffers(keys, _form(mem.src_rows.tolist(), form, dtype), sizes)
    assert codes == [0, 0]
    got = native.batch_get_into_multi_buffers(keys, _form(mem.dst_rows.tolist(), form, dtype), sizes,
                                              ranges=mem.ranges())
    assert got == [REGIONS * REGION_BYTES] * 2
    assert mem.dst.tobytes() == mem.src.tobytes()


def test_the_issue_case_uint64_matrix_above_2_63(native: NativeClient, driver: MooncakeStore) -> None:
    """The reported crash: a uint64 address matrix holding 2**63 + 4096 (SIGSEGV before the fix)."""
    addrs = np.array([[2**63 + 4096]], np.uint64)
    sizes = np.array([[4096]], np.uint64)
    key = [f"forms-{uuid.uuid4().hex}"]
    with pytest.raises(ValueError, match=r"address >= 2\*\*63"):
        native.batch_get_into_multi_buffers(key, addrs, sizes)
    with pytest.raises(ValueError, match=r"address >= 2\*\*63"):
        native.batch_put_from_multi_buffers(key, addrs, sizes)
    assert native.batch_put_from_multi_buffers(key, addrs, sizes, ranges=np.array([[4096, 8192]])) == [REFUSED]
    with pytest.raises(ValueError, match="2\\*\\*63"):
        driver.batch_get_into_multi_buffers(key, addrs, sizes)
    with pytest.raises(ValueError, match="2\\*\\*63"):
        driver.batch_put_from_multi_buffers(key, addrs, sizes)
    assert native.batch_is_exist(key) == [0]
