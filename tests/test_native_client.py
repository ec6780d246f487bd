"""The native Mooncake client (driver/native_client.py) against the real wheel, compared with the bound methods.

Every call must return exactly what ``MooncakeDistributedStore``'s bound method returns on the same inputs
(success, missing keys, -600 / -800 failures, empty batches), move the same bytes, refuse bad input before
Mooncake sees it, and - when any check fails - stay off without calling Mooncake at all.
"""

from __future__ import annotations

import threading
import time
import types
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake_kvaddr import _native
from mooncake_kvaddr.driver import native_client as nc_module
from mooncake_kvaddr.driver.master import EmbeddedMaster
from mooncake_kvaddr.driver.native_client import ENV_VAR, KeyBlob, NativeClient

pytestmark = pytest.mark.mooncake

CODE_INVALID_PARAMS = -600
CODE_NOT_FOUND = -704
CODE_TRANSFER_FAILED = -800


def _raw_store(master: EmbeddedMaster, segment: int = 128 << 20) -> Any:
    import mooncake.store as ms

    store = ms.MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", segment, 0, "tcp", "", master.rpc_address)
    assert rc == 0, f"setup failed: {rc}"
    return store


@pytest.fixture(scope="module")
def raw_store(master: EmbeddedMaster) -> Iterator[Any]:
    """A bare ``MooncakeDistributedStore`` on the module's master."""
    store = _raw_store(master)
    yield store
    store.close()


@pytest.fixture(scope="module")
def client(raw_store: Any) -> NativeClient:
    native, reason = NativeClient.probe(raw_store)
    assert native is not None, reason
    return native


def _unique(prefix: str, n: int) -> list[str]:
    tag = uuid.uuid4().hex[:10]
    return [f"{prefix}-{tag}-{i}" for i in range(n)]


class Layout:
    """``n`` keys of ``regions`` regions each, sizes per region, in one source and one destination buffer."""

    def __init__(self, sizes: np.ndarray[Any, Any], seed: int = 0) -> None:
        self.sizes = np.ascontiguousarray(sizes, dtype=np.int64)
        total = int(self.sizes.sum())
        rng = np.random.default_rng(seed)
        self.src = rng.integers(0, 256, max(total, 1), dtype=np.uint8)
        self.dst = np.zeros(max(total, 1), dtype=np.uint8)
        offsets = np.concatenate([[0], np.cumsum(self.sizes.ravel())[:-1]]).astype(np.int64).reshape(self.sizes.shape)
        self.offsets = offsets
        self.src_addrs = self.src.ctypes.data + offsets
        self.dst_addrs = self.dst.ctypes.data + offsets

    def src_bytes(self, i: int) -> bytes:
        start = int(self.offsets[i, 0]) if self.sizes.shape[1] else 0
        return self.src[start : start + int(self.sizes[i].sum())].tobytes()

    def dst_bytes(self, i: int) -> bytes:
        start = int(self.offsets[i, 0]) if self.sizes.shape[1] else 0
        return self.dst[start : start + int(self.sizes[i].sum())].tobytes()


def _lists(a: np.ndarray[Any, Any]) -> list[list[int]]:
    return [[int(v) for v in row] for row in a]


# ---------------------------------------------------------------------------------------------- set-up checks


def test_probe_resolves_every_method_in_the_loaded_store_so(client: NativeClient) -> None:
    import os

    library = nc_module.store_library()  # store.so, or _store*.so behind the mooncake.store package (0.3.14)
    assert library is not None
    assert os.path.realpath(client.library) == os.path.realpath(library)
    assert set(client.slots) == {
        "batch_get_into_multi_buffers",
        "batch_put_from_multi_buffers",
        "batch_get_into",
        "batch_put_from",
        "batchIsExist",
    }
    assert len(set(client.slots.values())) == 5
    assert client.distribution in nc_module.VERIFIED_VERSIONS


@pytest.mark.parametrize(
    "override",
    [
        {"batch_get_into_multi_buffers": "_ZN8mooncake10RealClient28batch_get_into_multi_buffersEv"},
        {"batch_put_from_multi_buffers": "_ZN8mooncake10RealClient9no_such_fnEv"},
        {"batch_get_into": "_ZN8mooncake10RealClient9no_such_fnEv"},
        {"batch_put_from": "_ZN8mooncake10RealClient9no_such_fnEv"},
        {"batch_is_exist": "_ZN8mooncake10RealClient9no_such_fnEv"},
        {"vtable": "_ZTVN8mooncake10NoSuchTypeE"},
        {"typeinfo": "_ZTIN8mooncake10NoSuchTypeE"},
    ],
)
def test_missing_symbol_refuses_without_calling(raw_store: Any, override: dict[str, str]) -> None:
    before = _native.mooncake_client_call_count()
    native, reason = NativeClient.probe(raw_store, symbol_overrides=override)
    assert native is None
    assert next(iter(override.values())) in reason
    assert _native.mooncake_client_call_count() == before


def test_wrong_vtable_refuses_without_calling(raw_store: Any) -> None:
    before = _native.mooncake_client_call_count()
    # Another class's vtable from the same library: the object is not one of those.
    native, reason = NativeClient.probe(raw_store, symbol_overrides={"vtable": "_ZTVN8mooncake11DummyClientE"})
    assert native is None
    assert "not a mooncake::RealClient" in reason
    assert _native.mooncake_client_call_count() == before


@pytest.mark.parametrize("typeinfo", ["_ZTISt9exception", "_ZTIN8mooncake11DummyClientE"])
def test_a_real_typeinfo_of_another_class_refuses_without_calling(
    raw_store: Any, client: NativeClient, typeinfo: str
) -> None:
    """The RTTI comparison itself: the override resolves (std::exception's typeinfo through the library's
    libstdc++; DummyClient's in the library), so only comparing the vtable's RTTI word with it refuses."""
    import ctypes

    assert ctypes.c_void_p.in_dll(ctypes.CDLL(client.library), typeinfo) is not None  # it resolves
    before = _native.mooncake_client_call_count()
    native, reason = NativeClient.probe(raw_store, symbol_overrides={"typeinfo": typeinfo})
    assert native is None
    assert "does not point at the exported typeinfo " + typeinfo in reason
    assert _native.mooncake_client_call_count() == before


def test_method_not_in_vtable_refuses(raw_store: Any) -> None:
    # A real exported RealClient method with the right library, but not virtual: not what the binding calls.
    internal = (
        "_ZN8mooncake10RealClient37batch_get_into_multi_buffers_internalERKSt6vectorINSt7__cxx1112basic_stringIcSt11"
        "char_traitsIcESaIcEEESaIS7_EERKS1_IS1_IPvSaISC_EESaISE_EERKS1_IS1_ImSaImEESaISK_EEb"
    )
    before = _native.mooncake_client_call_count()
    native, reason = NativeClient.probe(raw_store, symbol_overrides={"batch_get_into_multi_buffers": internal})
    assert native is None
    assert "not a virtual method" in reason
    assert _native.mooncake_client_call_count() == before


def test_a_method_symbol_from_another_library_refuses(raw_store: Any, client: NativeClient) -> None:
    """A name that resolves through the store library's dependencies (libstdc++'s std::exception typeinfo) is
    refused because it lives in another library, before the vtable is searched for it."""
    import ctypes

    other = "_ZTISt9exception"
    assert ctypes.c_void_p.in_dll(ctypes.CDLL(client.library), other) is not None  # it resolves
    before = _native.mooncake_client_call_count()
    native, reason = NativeClient.probe(raw_store, symbol_overrides={"batch_is_exist": other})
    assert native is None
    assert f"symbol {other} resolves outside" in reason
    assert _native.mooncake_client_call_count() == before


def test_turned_off_by_env(raw_store: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(ENV_VAR, "0")
    native, reason = NativeClient.probe(raw_store)
    assert native is None and ENV_VAR in reason
    monkeypatch.setattr(nc_module, "_logged", set())
    with caplog.at_level("INFO", logger=nc_module.__name__):
        assert NativeClient.from_store(raw_store) is None
        assert NativeClient.from_store(raw_store) is None
    assert [r.getMessage() for r in caplog.records] == [f"native Mooncake client off: {reason}"]


def test_a_switch_that_is_neither_on_nor_off_turns_it_off_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 39 item 4: ``disabled`` read as the default, on. Now off (the bound methods always work), with a
    warning naming the variable; ``unverified`` stays a value of its own."""
    monkeypatch.setenv(ENV_VAR, "disabled")
    with caplog.at_level("WARNING", logger=nc_module.__name__):
        native, reason = NativeClient.probe(object())
    assert native is None and reason.startswith(f"{ENV_VAR}='disabled' is neither on nor off"), reason
    assert [r.getMessage() for r in caplog.records] == [f"native Mooncake client off: {reason} (or unverified)"]
    monkeypatch.setenv(ENV_VAR, " Unverified ")
    assert "MooncakeDistributedStore" in NativeClient.probe(object())[1]  # past the switch


def test_unverified_version_stays_off_unless_asked(raw_store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)  # the wheel matrix may run with it set to "unverified"
    monkeypatch.setattr(nc_module, "mooncake_distribution", lambda: ("mooncake-transfer-engine", "9.9.9"))
    native, reason = NativeClient.probe(raw_store)
    assert native is None and "9.9.9" in reason
    monkeypatch.setenv(ENV_VAR, "unverified")
    native, reason = NativeClient.probe(raw_store)
    assert native is not None, reason


def test_refuses_other_objects() -> None:
    native, reason = NativeClient.probe(object())
    assert native is None and "MooncakeDistributedStore" in reason


def test_refuses_a_store_that_is_not_set_up() -> None:
    import mooncake.store as ms

    native, reason = NativeClient.probe(ms.MooncakeDistributedStore())
    assert native is None and "not set up" in reason


def test_closed_store_is_refused_not_called(master: EmbeddedMaster) -> None:
    store = _raw_store(master, segment=16 << 20)
    native = NativeClient.from_store(store)
    assert native is not None
    keys = _unique("closed", 2)
    assert native.batch_is_exist(keys) == [0, 0]
    store.close()
    before = _native.mooncake_client_call_count()
    with pytest.raises(RuntimeError, match="stale"):
        native.batch_is_exist(keys)
    assert native.closed
    with pytest.raises(RuntimeError):
        native.batch_is_exist(keys)
    assert _native.mooncake_client_call_count() == before
    assert NativeClient.probe(store)[0] is None


def test_a_store_set_up_again_makes_the_native_client_stale(master: EmbeddedMaster) -> None:
    """Closed and set up again, the store holds a new Mooncake client: the old native client must see that its
    client is not the store's (not merely that the store holds some client) and refuse, calling nothing."""
    store = _raw_store(master, segment=16 << 20)
    try:
        native = NativeClient.from_store(store)
        assert native is not None
        keys = _unique("again", 2)
        assert native.batch_is_exist(keys) == [0, 0]
        store.close()
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 0, "tcp", "", master.rpc_address) == 0
        before = _native.mooncake_client_call_count()
        with pytest.raises(RuntimeError, match="stale"):
            native.batch_is_exist(keys)
        assert native.closed
        assert _native.mooncake_client_call_count() == before
        fresh = NativeClient.from_store(store)
        assert fresh is not None
        assert fresh.batch_is_exist(keys) == [0, 0]
    finally:
        store.close()


def test_closed_native_client_refuses(raw_store: Any) -> None:
    native = NativeClient.from_store(raw_store)
    assert native is not None
    native.close()
    with pytest.raises(RuntimeError, match="closed"):
        native.batch_is_exist(["a"])


# ---------------------------------------------------------------------------------------------- differential


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.integers(1, 5).flatmap(
        lambda regions: st.lists(
            st.lists(st.integers(1, 700), min_size=regions, max_size=regions), min_size=1, max_size=6
        )
    ),
    missing=st.lists(st.booleans(), min_size=6, max_size=6),
    seed=st.integers(0, 2**32 - 1),
)
def test_multi_buffer_round_trip_equals_bound(
    raw_store: Any, client: NativeClient, sizes: list[list[int]], missing: list[bool], seed: int
) -> None:
    layout = Layout(np.array(sizes, dtype=np.int64), seed)
    n = len(sizes)
    native_keys = _unique("nat", n)
    bound_keys = _unique("bnd", n)
    put_native = client.batch_put_from_multi_buffers(native_keys, layout.src_addrs, layout.sizes)
    put_bound = raw_store.batch_put_from_multi_buffers(bound_keys, _lists(layout.src_addrs), _lists(layout.sizes))
    assert put_native == put_bound == [0] * n
    # A duplicate put: first write wins, 0 either way.
    assert client.batch_put_from_multi_buffers(native_keys, layout.src_addrs, layout.sizes) == list(
        raw_store.batch_put_from_multi_buffers(bound_keys, _lists(layout.src_addrs), _lists(layout.sizes))
    )

    # Some keys of the get are missing: per-key -704.
    get_native_keys = [("absent-" + k) if missing[i] else k for i, k in enumerate(native_keys)]
    get_bound_keys = [("absent-" + k) if missing[i] else k for i, k in enumerate(bound_keys)]
    assert client.batch_is_exist(get_native_keys) == list(raw_store.batch_is_exist(get_bound_keys))
    got_native = client.batch_get_into_multi_buffers(get_native_keys, layout.dst_addrs, layout.sizes)
    native_bytes = [layout.dst_bytes(i) for i in range(n)]
    layout.dst[:] = 0
    got_bound = raw_store.batch_get_into_multi_buffers(get_bound_keys, _lists(layout.dst_addrs), _lists(layout.sizes))
    assert got_native == list(got_bound)
    for i in range(n):
        expected = CODE_NOT_FOUND if missing[i] else int(layout.sizes[i].sum())
        assert got_native[i] == expected
        if not missing[i]:
            assert native_bytes[i] == layout.src_bytes(i) == layout.dst_bytes(i)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=8), seed=st.integers(0, 2**32 - 1))
def test_contiguous_round_trip_equals_bound(raw_store: Any, client: NativeClient, sizes: list[int], seed: int) -> None:
    layout = Layout(np.array(sizes, dtype=np.int64).reshape(-1, 1), seed)
    n = len(sizes)
    native_keys = _unique("cnat", n)
    bound_keys = _unique("cbnd", n)
    ptrs = layout.src_addrs[:, 0]
    lens = layout.sizes[:, 0]
    assert client.batch_put_from(native_keys, ptrs, lens) == list(
        raw_store.batch_put_from(bound_keys, ptrs.tolist(), lens.tolist())
    )
    dst = layout.dst_addrs[:, 0]
    got_native = client.batch_get_into([*native_keys, "absent"], np.append(dst, dst[0]), np.append(lens, lens[0]))
    native_bytes = [layout.dst_bytes(i) for i in range(n)]
    layout.dst[:] = 0
    got_bound = raw_store.batch_get_into(
        [*bound_keys, "absent"], [*dst.tolist(), int(dst[0])], [*lens.tolist(), int(lens[0])]
    )
    assert got_native == list(got_bound)
    assert got_native[:n] == sizes and got_native[n] < 0
    assert native_bytes == [layout.src_bytes(i) for i in range(n)]


def test_failure_codes_equal_bound(raw_store: Any, client: NativeClient) -> None:
    layout = Layout(np.full((2, 2), 1024, dtype=np.int64))
    keys = _unique("fail", 2)
    assert client.batch_put_from_multi_buffers(keys, layout.src_addrs, layout.sizes) == [0, 0]
    # Destination smaller than the object: -600; larger: -800 (MOONCAKE's own rules, reproduced code for code).
    small = layout.sizes.copy()
    small[:, 1] = 512
    big = layout.sizes.copy()
    big[:, 1] = 2048
    dst = Layout(np.full((2, 2), 2048, dtype=np.int64))
    for rows, expected in ((small, CODE_INVALID_PARAMS), (big, CODE_TRANSFER_FAILED)):
        native = client.batch_get_into_multi_buffers(keys, dst.dst_addrs, rows)
        bound = raw_store.batch_get_into_multi_buffers(keys, _lists(dst.dst_addrs), _lists(rows))
        assert native == list(bound) == [expected, expected]
    # Contiguous get into a too-small buffer.
    native = client.batch_get_into(keys, dst.dst_addrs[:, 0], np.array([100, 100]))
    bound = raw_store.batch_get_into(keys, dst.dst_addrs[:, 0].tolist(), [100, 100])
    assert native == list(bound) and all(c < 0 for c in native)
    # A zero-byte object and an empty key are refused by Mooncake (both paths alike).
    zero = np.zeros((1, 1), dtype=np.int64)
    zkeys = _unique("zero", 2)
    assert client.batch_put_from_multi_buffers(zkeys[:1], layout.src_addrs[:1, :1], zero) == list(
        raw_store.batch_put_from_multi_buffers(zkeys[1:], _lists(layout.src_addrs[:1, :1]), [[0]])
    )
    assert client.batch_put_from_multi_buffers([""], layout.src_addrs[:1], layout.sizes[:1]) == list(
        raw_store.batch_put_from_multi_buffers([""], _lists(layout.src_addrs[:1]), _lists(layout.sizes[:1]))
    )
    assert client.batch_is_exist([""]) == list(raw_store.batch_is_exist([""]))


def test_empty_batches_equal_bound(raw_store: Any, client: NativeClient) -> None:
    before = _native.mooncake_client_call_count()
    empty = np.zeros((0, 3), dtype=np.int64)
    assert client.batch_is_exist([]) == list(raw_store.batch_is_exist([])) == []
    assert client.batch_get_into_multi_buffers([], empty, empty) == list(
        raw_store.batch_get_into_multi_buffers([], [], [])
    )
    assert client.batch_put_from_multi_buffers([], empty, empty) == list(
        raw_store.batch_put_from_multi_buffers([], [], [])
    )
    assert client.batch_get_into([], [], []) == list(raw_store.batch_get_into([], [], []))
    assert client.batch_put_from([], [], []) == list(raw_store.batch_put_from([], [], []))
    assert _native.mooncake_client_call_count() == before  # nothing to do: Mooncake is not called


def test_replicate_config_is_passed(raw_store: Any, client: NativeClient) -> None:
    import mooncake.store as ms

    layout = Layout(np.full((1, 2), 256, dtype=np.int64))
    config = ms.ReplicateConfig()
    config.replica_num = 2
    config.with_hard_pin = True
    keys = _unique("cfg", 2)
    assert client.batch_put_from_multi_buffers(keys[:1], layout.src_addrs, layout.sizes, config) == list(
        raw_store.batch_put_from_multi_buffers(keys[1:], _lists(layout.src_addrs), _lists(layout.sizes), config)
    )
    assert client.batch_put_from(_unique("cfg1", 1), layout.src_addrs[:, 0], np.array([256]), config) == [0]
    # The config really reaches Mooncake: replica_num=0 is refused (-600) by both paths, the default is not.
    refused = ms.ReplicateConfig()
    refused.replica_num = 0
    zkeys = _unique("cfg0", 4)
    assert client.batch_put_from_multi_buffers(zkeys[:1], layout.src_addrs, layout.sizes, refused) == list(
        raw_store.batch_put_from_multi_buffers(zkeys[1:2], _lists(layout.src_addrs), _lists(layout.sizes), refused)
    )
    assert client.batch_put_from_multi_buffers(zkeys[:1], layout.src_addrs, layout.sizes, refused) == [
        CODE_INVALID_PARAMS
    ]
    assert client.batch_put_from(zkeys[2:3], layout.src_addrs[:, 0], np.array([512]), refused) == list(
        raw_store.batch_put_from(zkeys[3:], [int(layout.src_addrs[0, 0])], [512], refused)
    )
    assert client.batch_put_from(zkeys[2:3], layout.src_addrs[:, 0], np.array([512]), refused) == [CODE_INVALID_PARAMS]
    assert client.batch_put_from_multi_buffers(zkeys[:1], layout.src_addrs, layout.sizes) == [0]
    # Anything but a ReplicateConfig is refused before the call (a look-alike object included).

    class Fake:
        def _pybind11_conduit_v1_(self, *args: Any) -> Any:
            raise AssertionError("must not be asked")

    before = _native.mooncake_client_call_count()
    for bad in (Fake(), {"replica_num": 1}, 1):
        with pytest.raises(TypeError, match="ReplicateConfig"):
            client.batch_put_from_multi_buffers(keys[:1], layout.src_addrs, layout.sizes, bad)
        with pytest.raises(TypeError, match="ReplicateConfig"):
            client.batch_put_from(keys[:1], layout.src_addrs[:, 0], np.array([256]), bad)
    assert _native.mooncake_client_call_count() == before


# ---------------------------------------------------------------------------------------------- input forms


def test_every_input_form_gives_the_same_result(raw_store: Any, client: NativeClient) -> None:
    layout = Layout(np.array([[100, 200, 300], [50, 60, 70]], dtype=np.int64))
    keys = _unique("form", 2)
    assert client.batch_put_from_multi_buffers(keys, layout.src_addrs, layout.sizes) == [0, 0]
    blob = "".join(keys).encode()
    offsets = np.cumsum([0] + [len(k) for k in keys]).astype(np.int64)
    forms = [
        (keys, layout.dst_addrs, layout.sizes),
        ([k.encode() for k in keys], layout.dst_addrs.astype(np.uint64), layout.sizes.astype(np.uint64)),
        (tuple(keys), _lists(layout.dst_addrs), _lists(layout.sizes)),
        (np.array(keys), list(layout.dst_addrs), list(layout.sizes)),
        (KeyBlob(blob, offsets), layout.dst_addrs, layout.sizes),
        (KeyBlob(bytearray(blob), offsets), layout.dst_addrs, _lists(layout.sizes)),
        (keys, np.asfortranarray(layout.dst_addrs), layout.sizes),  # not C-contiguous: row path
    ]
    for form_keys, addrs, sizes in forms:
        layout.dst[:] = 0
        assert client.batch_get_into_multi_buffers(form_keys, addrs, sizes) == [600, 180]
        assert layout.dst_bytes(0) == layout.src_bytes(0) and layout.dst_bytes(1) == layout.src_bytes(1)
        assert client.batch_is_exist(form_keys) == [1, 1]


class _ClearsTheLists:
    """An address whose ``__index__`` empties the caller's row lists while the call converts them."""

    def __init__(self, value: int, victims: list[list[Any]]) -> None:
        self.value, self.victims = value, victims

    def __index__(self) -> int:
        for victim in self.victims:
            victim.clear()
        return self.value


def test_rows_are_read_as_they_were_when_the_call_began(client: NativeClient) -> None:
    """Every row is fixed before any item is converted (int_rows.hpp, as in multi_buffer_arrays): an
    ``__index__`` that empties the caller's lists changes nothing the call reads."""
    layout = Layout(np.array([[100, 200], [50, 60]], dtype=np.int64), seed=8)
    keys = _unique("snapshot", 2)
    assert client.batch_put_from_multi_buffers(keys, layout.src_addrs, layout.sizes) == [0, 0]
    addrs, sizes = _lists(layout.dst_addrs), _lists(layout.sizes)
    addrs[0][0] = _ClearsTheLists(int(layout.dst_addrs[0, 0]), [addrs, sizes, addrs[1], sizes[1]])
    assert client.batch_get_into_multi_buffers(keys, addrs, sizes) == [300, 110]
    assert layout.dst.tobytes() == layout.src.tobytes()


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((["a", "b"], np.ones((1, 2), np.int64), np.ones((1, 2), np.int64)), ValueError, "rows for 2 keys"),
        ((["a"], np.ones((1, 2), np.int64), np.ones((1, 3), np.int64)), ValueError, "same shape"),
        ((["a"], [[1, 2]], [[1]]), ValueError, "2 addresses but 1 sizes"),
        ((["a"], [[1]], [[1], [2]]), ValueError, "one row per key"),
        ((["a"], [[0]], [[1]]), ValueError, "address 0"),
        ((["a"], [[-5]], [[1]]), ValueError, "negative address"),
        ((["a"], [[4096]], [[-1]]), ValueError, "negative size"),
        ((["a"], np.array([[4096]]), np.array([[-1]])), ValueError, "negative size"),
        ((["a"], np.array([[2**64 - 8]], np.uint64), np.array([[16]], np.uint64)), ValueError, "address >= 2\\*\\*63"),
        ((["a"], np.array([[2**63 - 8]]), np.array([[16]])), ValueError, "overflows"),
        ((["a"], np.array([[4096]], np.uint64), np.array([[2**63]], np.uint64)), ValueError, "size >= 2\\*\\*63"),
        ((["a"], [[4096, 8192]], [[2**62, 2**62]]), ValueError, "2\\*\\*63"),
        ((["a"], [[1.5]], [[1]]), TypeError, "int"),
        ((["a"], [[2**64]], [[1]]), OverflowError, "64-bit"),
        (([1], [[4096]], [[1]]), TypeError, "str or bytes"),
        (("ab", [[4096]], [[1]]), TypeError, "sequence of str"),
        ((None, [[4096]], [[1]]), TypeError, "sequence"),
        ((["a"], "xy", [[1]]), TypeError, "addrs must be"),
        ((["a"], [[4096]], b"x"), TypeError, "sizes must be"),
        ((["a"], [["x"]], [[1]]), TypeError, "int"),
        ((["a"], ["x"], [[1]]), TypeError, "sequence of ints"),
        # int_rows.hpp's rule, shared with multi_buffer_arrays: a set or dict iterates unordered or as keys.
        ((["a"], [{4096}], [[1]]), TypeError, "addrs row 0 must be a sequence of ints"),
        ((["a"], [[4096]], [{1: 2}]), TypeError, "sizes row 0 must be a sequence of ints"),
        ((["a"], {4096: 1}, [[1]]), TypeError, "addrs rows must be a sequence of ints"),
        ((KeyBlob(b"ab", np.array([0, 3])), [[4096]], [[1]]), ValueError, "within the blob"),
        ((KeyBlob(b"ab", np.array([1, 2])), [[4096]], [[1]]), ValueError, "must be 0"),
        ((KeyBlob(b"ab", np.array([0, 1])), [[4096]], [[1]]), ValueError, "blob's length"),
        ((KeyBlob(b"ab", np.array([0, 2], np.int32)), [[4096]], [[1]]), TypeError, "int64"),
        # A decreasing cut would give the second key a negative length (a huge size_t without the check).
        ((KeyBlob(b"abc", np.array([0, 2, 1, 3])), [[4096], [4096]], [[1], [1]]), ValueError, "non-decreasing"),
        ((KeyBlob("ab", np.array([0, 2])), [[4096]], [[1]]), TypeError, "bytes-like"),
        ((KeyBlob(b"ab", None), [[4096]], [[1]]), TypeError, "sequence of str or bytes"),
        ((KeyBlob(b"ab", [0, 2]), [[4096]], [[1]]), TypeError, "int64"),
    ],
)
def test_bad_input_raises_before_calling(client: NativeClient, args: tuple[Any, ...], error: type, match: str) -> None:
    before = _native.mooncake_client_call_count()
    with pytest.raises(error, match=match):
        client.batch_get_into_multi_buffers(*args)
    with pytest.raises(error, match=match):
        client.batch_put_from_multi_buffers(*args)
    assert _native.mooncake_client_call_count() == before


class _RaisingBlob(KeyBlob):
    """A key blob whose bytes cannot be read: the handle reads them with the GIL held and must raise."""

    __slots__ = ()

    def __getattribute__(self, name: str) -> Any:
        if name == "data":
            raise RuntimeError("no bytes here")
        return super().__getattribute__(name)


def test_the_handle_takes_a_key_blob_by_type_and_raises_what_reading_it_raises(client: NativeClient) -> None:
    """The handle recognises our KeyBlob (and its subclasses) by type, not by attributes: an object with
    ``data`` and ``offsets`` that is not one is a sequence of keys; a blob whose bytes raise passes the error on."""
    before = _native.mooncake_client_call_count()
    with pytest.raises(RuntimeError, match="no bytes here"):
        client.batch_is_exist(_RaisingBlob(b"ab", np.array([0, 2])))
    lookalike = types.SimpleNamespace(data=b"ab", offsets=np.array([0, 2]))
    with pytest.raises(TypeError, match="sequence"):
        client.batch_is_exist(lookalike)  # type: ignore[arg-type]
    assert _native.mooncake_client_call_count() == before


@pytest.mark.parametrize("cuts", [[0, 2, 1, 3], [0, 3, 0, 3], [0, 4, 3]])
def test_an_existence_check_refuses_a_key_blob_cut_out_of_order(client: NativeClient, cuts: list[int]) -> None:
    before = _native.mooncake_client_call_count()
    with pytest.raises(ValueError, match="non-decreasing and within the blob"):
        client.batch_is_exist(KeyBlob(b"abc", np.array(cuts, np.int64)))
    assert _native.mooncake_client_call_count() == before


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((["a", "b"], [4096], [1, 1]), ValueError, "1 entries for 2 keys"),
        ((["a"], [4096], [1, 1]), ValueError, "2 entries for 1 keys"),
        ((["a"], [0], [1]), ValueError, "address 0"),
        ((["a"], np.array([4096]), np.array([-1])), ValueError, "negative size"),
        ((["a"], np.array([2**63], np.uint64), np.array([1], np.uint64)), OverflowError, "int64"),
        ((["a"], [4096], [None]), TypeError, "int"),
    ],
)
def test_bad_contiguous_input_raises_before_calling(
    client: NativeClient, args: tuple[Any, ...], error: type, match: str
) -> None:
    before = _native.mooncake_client_call_count()
    with pytest.raises(error, match=match):
        client.batch_get_into(*args)
    with pytest.raises(error, match=match):
        client.batch_put_from(*args)
    assert _native.mooncake_client_call_count() == before


class _Resizes:
    """An int whose ``__index__`` grows or empties the list that holds it (a callback run mid-conversion)."""

    def __init__(self, victim: list[Any], grow: bool) -> None:
        self.victim, self.grow = victim, grow

    def __index__(self) -> int:
        if self.grow:
            self.victim.extend([4096] * 100_000)
        else:
            self.victim.clear()
        return 4096


@pytest.mark.parametrize("grow", [True, False])
def test_contiguous_rows_resized_while_converted_raise_before_calling(client: NativeClient, grow: bool) -> None:
    """The pointer list is read at its length when the conversion starts: one that grows under an item's
    ``__index__`` is not followed (the call goes on with the items it had; here the guard refuses both, so
    Mooncake is not called), one that empties raises. Before the fix a growing list was written past its rows."""
    buffer = np.zeros(64, np.uint8)
    ranges = np.array([[buffer.ctypes.data, buffer.ctypes.data + buffer.nbytes]], np.int64)
    before = _native.mooncake_client_call_count()
    for call in (client.batch_get_into, client.batch_put_from):
        ptrs: list[Any] = []
        ptrs.extend([_Resizes(ptrs, grow), 4096])
        if grow:
            assert call(["a", "b"], ptrs, [16, 16], ranges=ranges) == [CODE_INVALID_PARAMS] * 2
            assert client.last_refused() == 2
        else:
            with pytest.raises(RuntimeError, match="changed size"):
                call(["a", "b"], ptrs, [16, 16], ranges=ranges)
    assert _native.mooncake_client_call_count() == before


# ---------------------------------------------------------------------------------------------- threads, GIL


def test_gil_is_released_during_the_call(client: NativeClient) -> None:
    """A busy Python thread keeps running while a large native get is in flight."""
    layout = Layout(np.full((200, 100), 2048, dtype=np.int64))
    keys = _unique("gil", 200)
    assert client.batch_put_from_multi_buffers(keys, layout.src_addrs, layout.sizes) == [0] * 200
    done = threading.Event()
    ticks = [0]
    in_call = [0]
    calling = threading.Event()

    def spin() -> None:
        while not done.is_set():
            ticks[0] += 1
            if calling.is_set():
                in_call[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        time.sleep(0.01)
        for _ in range(3):
            calling.set()
            codes = client.batch_get_into_multi_buffers(keys, layout.dst_addrs, layout.sizes)
            calling.clear()
            assert codes == [204800] * 200
    finally:
        done.set()
        spinner.join()
    assert in_call[0] > 0, "the Python thread never ran while Mooncake was transferring"
    # The C++ records the interval it ran with the GIL released: the copy and the whole transfer.
    assert _native.mooncake_client_last_release_ns() > 0
    assert layout.dst.tobytes() == layout.src.tobytes()


def test_threads_share_one_client(client: NativeClient) -> None:
    layouts = [Layout(np.full((20, 4), 512, dtype=np.int64), seed=s) for s in range(4)]
    errors: list[BaseException] = []

    def work(layout: Layout) -> None:
        try:
            keys = _unique("thr", 20)
            for _ in range(3):
                assert client.batch_put_from_multi_buffers(keys, layout.src_addrs, layout.sizes) == [0] * 20
                assert client.batch_get_into_multi_buffers(keys, layout.dst_addrs, layout.sizes) == [2048] * 20
                assert client.batch_is_exist(keys) == [1] * 20
            assert layout.dst.tobytes() == layout.src.tobytes()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(layout,)) for layout in layouts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_tcp_transport_equals_bound(master: EmbeddedMaster, monkeypatch: pytest.MonkeyPatch) -> None:
    """With MC_STORE_MEMCPY=0 the local segment is reached over Mooncake's TCP transport: same results."""
    monkeypatch.setenv("MC_STORE_MEMCPY", "0")
    store = _raw_store(master, segment=32 << 20)
    monkeypatch.delenv("MC_STORE_MEMCPY")
    try:
        native = NativeClient.from_store(store)
        assert native is not None
        layout = Layout(np.full((6, 10), 2048, dtype=np.int64), seed=7)  # 60 regions: within the TCP queue limits
        keys = _unique("tcp", 6)
        assert native.batch_put_from_multi_buffers(keys[:3], layout.src_addrs[:3], layout.sizes[:3]) == list(
            store.batch_put_from_multi_buffers(keys[3:], _lists(layout.src_addrs[3:]), _lists(layout.sizes[3:]))
        )
        asked = [*keys, "absent"]
        addrs = np.vstack([layout.dst_addrs, layout.dst_addrs[:1]])
        sizes = np.vstack([layout.sizes, layout.sizes[:1]])
        got = native.batch_get_into_multi_buffers(asked, addrs, sizes)
        native_bytes = layout.dst.tobytes()
        layout.dst[:] = 0
        assert got == list(store.batch_get_into_multi_buffers(asked, _lists(addrs), _lists(sizes)))
        assert got == [20480] * 6 + [CODE_NOT_FOUND]
        assert native_bytes == layout.src.tobytes() == layout.dst.tobytes()
    finally:
        store.close()


def test_refused_keys_leave_every_other_key_its_own_result(client: NativeClient) -> None:
    """With ``ranges``, refused keys (-600, not sent) are interleaved with sent ones that answer differently
    (bytes read, missing): every slot gets its own key's answer, in order."""
    layout = Layout(np.full((4, 2), 512, np.int64), seed=5)
    keys = _unique("merge", 4)
    ranges = np.array([[layout.src.ctypes.data, layout.src.ctypes.data + layout.src.nbytes],
                       [layout.dst.ctypes.data, layout.dst.ctypes.data + layout.dst.nbytes]], np.int64)
    assert client.batch_put_from_multi_buffers(keys[1:2], layout.src_addrs[1:2], layout.sizes[1:2]) == [0]
    addrs = layout.dst_addrs.copy()
    addrs[0, 1] = 1 << 45  # key 0 and key 2: a slice outside the ranges
    addrs[2, 0] = 8
    got = client.batch_get_into_multi_buffers(keys, addrs, layout.sizes, ranges=ranges)
    assert got == [CODE_INVALID_PARAMS, 1024, CODE_INVALID_PARAMS, CODE_NOT_FOUND]
    assert client.last_refused() == 2
    assert layout.dst_bytes(1) == layout.src_bytes(1)
    flat = client.batch_get_into(keys, [8, int(layout.dst_addrs[1, 0]), 8, int(layout.dst_addrs[3, 0])],
                                 [1024] * 4, ranges=ranges)
    assert flat == [CODE_INVALID_PARAMS, 1024, CODE_INVALID_PARAMS, CODE_NOT_FOUND]


def test_a_call_whose_every_key_is_refused_makes_no_mooncake_call(client: NativeClient) -> None:
    """With ``ranges``, a call whose keys are all refused answers -600 for each and calls Mooncake not at all
    (not even with an empty batch), in every method that takes ``ranges``."""
    layout = Layout(np.full((2, 2), 512, np.int64), seed=6)
    keys = _unique("refused", 2)
    ranges = np.array([[layout.dst.ctypes.data, layout.dst.ctypes.data + layout.dst.nbytes]], np.int64)
    outside = np.full((2, 2), 1 << 45, np.int64)
    before = _native.mooncake_client_call_count()
    for call in (client.batch_get_into_multi_buffers, client.batch_put_from_multi_buffers):
        assert call(keys, outside, layout.sizes, ranges=ranges) == [CODE_INVALID_PARAMS] * 2
        assert client.last_refused() == 2
    for flat_call in (client.batch_get_into, client.batch_put_from):
        assert flat_call(keys, outside[:, 0], [1024, 1024], ranges=ranges) == [CODE_INVALID_PARAMS] * 2
    assert _native.mooncake_client_call_count() == before


def test_the_refused_count_is_the_last_calls_own(client: NativeClient) -> None:
    """``last_refused`` answers for the thread's last call only: after a call that refused keys, a call of any
    method that raises before sending (or refuses none) reports 0, never the earlier call's count."""
    layout = Layout(np.full((2, 1), 512, np.int64), seed=7)
    keys = _unique("count", 2)
    ranges = np.array([[layout.dst.ctypes.data, layout.dst.ctypes.data + layout.dst.nbytes]], np.int64)
    outside = np.full((2, 1), 1 << 45, np.int64)
    failing = (
        lambda: client.batch_get_into_multi_buffers(keys, [[4096]], [[1]], ranges=ranges),
        lambda: client.batch_put_from_multi_buffers(keys, [[4096]], [[1]], ranges=ranges),
        lambda: client.batch_get_into(keys, [4096], [1], ranges=ranges),
        lambda: client.batch_put_from(keys, [4096], [1], ranges=ranges),
    )
    for fail in failing:
        refused = client.batch_get_into_multi_buffers(keys, outside, layout.sizes, ranges=ranges)
        assert refused == [CODE_INVALID_PARAMS] * 2
        assert client.last_refused() == 2
        with pytest.raises(ValueError):
            fail()
        assert client.last_refused() == 0


def test_the_native_client_makes_the_checks_the_python_side_makes_first(client: NativeClient) -> None:
    """Checks the driver (rows per key) and the guard's table (ranges inside [1, 2**63)) make before the
    native client is reached, made by the native client too: an address matrix with more rows than keys, a
    guard range starting at address 0 or empty."""
    with pytest.raises(ValueError, match="2 rows for 1 keys"):
        client.batch_get_into_multi_buffers(["a"], np.full((2, 1), 4096, np.int64), np.ones((2, 1), np.int64))
    for bad in ([[0, 4096]], [[4096, 4096]]):
        with pytest.raises(ValueError, match="0 < start < end"):
            client.batch_get_into_multi_buffers(["a"], [[4096]], [[1]], ranges=np.array(bad, np.int64))
