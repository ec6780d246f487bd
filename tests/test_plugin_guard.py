"""The registered-range guard of the vLLM plugin's store wrappers (docs/vllm-plugin.md, "Registered-range guard").

Against a real embedded Mooncake master, in every wrapper combination the plugin installs (native client,
native wrapper falling back to Mooncake's bound methods, staged, staged over native) and for every raw-pointer
data method: a key with a slice outside the buffers registered through the wrapper (outside every buffer,
negative, huge, straddling two registered buffers, inside a buffer unregistered since) gets -600 (or None for
the tensor calls) and is never handed to Mooncake - a put leaves no object behind, a get leaves the destination
untouched - while the other keys of the call still move, with results in order and bytes identical to plain
Mooncake's. Wild addresses that would crash the process run in a subprocess.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mooncake_kvaddr.driver.master import EmbeddedMaster
from mooncake_kvaddr.driver.native_client import NativeClient
from mooncake_kvaddr.driver.staging import StagingBuffer
from mooncake_kvaddr.integrations.vllm import guard as guard_module
from mooncake_kvaddr.integrations.vllm import native_store as native_store_module
from mooncake_kvaddr.integrations.vllm.guard import INVALID_PARAMS, Ranges, RangeTable
from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore, registration_ok
from mooncake_kvaddr.integrations.vllm.staged_store import StagedMooncakeStore

KINDS = ("native", "bound", "staged", "staged_native")
REGION = 256


def _raw_store(master: EmbeddedMaster) -> Any:
    import mooncake.store as ms

    store = ms.MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", master.rpc_address)
    assert rc == 0, f"setup failed: {rc}"
    return store


def _wrap(kind: str, raw: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    if kind == "bound":
        monkeypatch.setattr(NativeClient, "from_store", classmethod(lambda cls, store: None))
    if kind in ("native", "bound"):
        return NativeMooncakeStore(raw, armed=True)
    if kind == "staged":
        return StagedMooncakeStore(raw, staging_bytes=1 << 20, armed=True)
    return StagedMooncakeStore(NativeMooncakeStore(raw, armed=True), staging_bytes=1 << 20, armed=True)


class _Head:
    """The first ``nbytes`` of a :class:`StagingBuffer` (``ptr``, ``nbytes`` and ``array`` as the buffer's)."""

    def __init__(self, room: StagingBuffer, nbytes: int) -> None:
        self.ptr, self.nbytes, self.array = room.ptr, nbytes, room.array[:nbytes]


class Rig:
    """A fresh Mooncake client, one wrapper around it, and host buffers: ``a`` registered, ``halves`` one
    allocation registered as two buffers (a slice across the middle straddles them), ``outside`` never
    registered, ``gone`` registered then unregistered."""

    def __init__(self, kind: str, master: EmbeddedMaster, monkeypatch: pytest.MonkeyPatch) -> None:
        self.kind = kind
        self.raw = _raw_store(master)
        self.store = _wrap(kind, self.raw, monkeypatch)
        # ``a`` is the first 16 regions of a 17-region allocation: the memory right past its end (where the
        # "past_end" slice reaches) is the test's own, so nothing but a wrongly admitted call can change it.
        self._a_room = StagingBuffer(17 * REGION)
        self.a = _Head(self._a_room, 16 * REGION)
        self.halves = StagingBuffer(16 * REGION)
        self.outside = StagingBuffer(16 * REGION)
        self.gone = StagingBuffer(16 * REGION)
        half = self.halves.nbytes // 2
        for ptr, size in ((self.a.ptr, self.a.nbytes), (self.halves.ptr, half), (self.halves.ptr + half, half),
                          (self.gone.ptr, self.gone.nbytes)):  # fmt: skip
            assert self.store.register_buffer(ptr, size) == 0
        assert self.store.unregister_buffer(self.gone.ptr) == 0
        rng = np.random.default_rng(7)
        for buf in (self.a, self.halves, self.outside, self.gone):
            buf.array[:] = rng.integers(0, 255, buf.nbytes, dtype=np.uint8)
        self.tag = uuid.uuid4().hex[:10]

    def key(self, name: str) -> str:
        return f"guard-{self.kind}-{self.tag}-{name}"

    def bad_slices(self) -> dict[str, tuple[int, int]]:
        """Slices in real memory the guard must refuse (a wrongly admitted get would write it: checked)."""
        middle = self.halves.ptr + self.halves.nbytes // 2
        return {
            "outside": (self.outside.ptr, REGION),
            "straddle": (middle - REGION // 2, REGION),
            "unregistered": (self.gone.ptr, REGION),
            "past_end": (self.a.ptr + self.a.nbytes - REGION // 2, REGION),
        }

    def close(self) -> None:
        self.store.close()


@pytest.fixture
def rig_factory(master: EmbeddedMaster, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], Rig]]:
    rigs: list[Rig] = []

    def make(kind: str) -> Rig:
        rig = Rig(kind, master, monkeypatch)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.close()


def _exists(raw: Any, key: str) -> bool:
    return bool(raw.is_exist(key) == 1)


# --- multi-buffer put/get ------------------------------------------------------------------------------------


@pytest.mark.mooncake
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("form", ["lists", "arrays"])
def test_multi_buffer_put_refuses_bad_keys_and_stores_the_good_ones(
    rig_factory: Callable[[str], Rig], kind: str, form: str
) -> None:
    rig = rig_factory(kind)
    bad = rig.bad_slices()
    good_rows = [[rig.a.ptr + (2 * k) * REGION, rig.a.ptr + (2 * k + 1) * REGION] for k in range(3)]
    names = ["g0", *bad, "g1", "g2"]
    rows = [good_rows[0]] + [[rig.a.ptr, ptr] for ptr, _ in bad.values()] + good_rows[1:]
    sizes = [[REGION, REGION] for _ in rows]
    keys = [rig.key(n) for n in names]
    if form == "arrays":
        args: tuple[Any, ...] = (keys, np.array(rows, dtype=np.int64), np.array(sizes, dtype=np.int64))
    else:
        args = (keys, rows, sizes)
    codes = rig.store.batch_put_from_multi_buffers(*args)
    assert codes == [0] + [INVALID_PARAMS] * len(bad) + [0, 0]
    for name in bad:
        assert not _exists(rig.raw, rig.key(name)), f"{name}: the refused key reached the store"
    for name, row in zip(("g0", "g1", "g2"), good_rows, strict=True):
        want = b"".join(ctypes.string_at(p, REGION) for p in row)
        assert rig.raw.get(rig.key(name)) == want  # byte-identical to what Mooncake's own call stores


@pytest.mark.mooncake
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("entry", ["lists", "arrays_entry"])
def test_multi_buffer_get_leaves_refused_destinations_untouched(
    rig_factory: Callable[[str], Rig], kind: str, entry: str
) -> None:
    rig = rig_factory(kind)
    bad = rig.bad_slices()
    source = [[rig.a.ptr + (2 * k) * REGION, rig.a.ptr + (2 * k + 1) * REGION] for k in range(len(bad) + 2)]
    keys = [rig.key(f"obj{k}") for k in range(len(source))]
    assert rig.raw.batch_put_from_multi_buffers(keys, source, [[REGION, REGION]] * len(source)) == [0] * len(source)
    expected = [b"".join(ctypes.string_at(p, REGION) for p in row) for row in source]
    # Destinations: key 0 and the last into the second half of `a` (good), the others into a bad slice each.
    dest_good = [[rig.a.ptr + 8 * REGION, rig.a.ptr + 9 * REGION], [rig.a.ptr + 10 * REGION, rig.a.ptr + 11 * REGION]]
    rows = [dest_good[0]] + [[rig.a.ptr + 12 * REGION, ptr] for ptr, _ in bad.values()] + [dest_good[1]]
    sizes = [[REGION, REGION]] * len(rows)
    snapshots = {name: ctypes.string_at(ptr, REGION) for name, (ptr, _) in bad.items()}
    rig.a.array[8 * REGION : 13 * REGION] = 0
    if entry == "arrays_entry":
        codes = rig.store.batch_get_into_multi_buffers_arrays(
            keys, np.array(rows, dtype=np.int64), np.array(sizes, dtype=np.int64)
        )
    else:
        codes = rig.store.batch_get_into_multi_buffers(keys, rows, sizes)
    assert codes == [2 * REGION] + [INVALID_PARAMS] * len(bad) + [2 * REGION]
    for name, (ptr, _) in bad.items():
        assert ctypes.string_at(ptr, REGION) == snapshots[name], f"{name}: a refused destination was written"
    assert not rig.a.array[12 * REGION : 13 * REGION].any()  # the refused keys' good regions too
    assert rig.a.array[8 * REGION : 10 * REGION].tobytes() == expected[0]
    assert rig.a.array[10 * REGION : 12 * REGION].tobytes() == expected[-1]


# --- contiguous and single-key methods -------------------------------------------------------------------------


@pytest.mark.mooncake
@pytest.mark.parametrize("kind", KINDS)
def test_contiguous_and_single_key_methods_refuse_bad_slices(rig_factory: Callable[[str], Rig], kind: str) -> None:
    rig = rig_factory(kind)
    bad = list(rig.bad_slices().values())
    good = (rig.a.ptr, REGION)
    for method in ("batch_put_from", "batch_upsert_from"):
        keys = [rig.key(f"{method}-{i}") for i in range(len(bad) + 1)]
        slices = [good, *bad]
        codes = getattr(rig.store, method)(keys, [p for p, _ in slices], [n for _, n in slices])
        assert codes == [0] + [INVALID_PARAMS] * len(bad), method
        assert _exists(rig.raw, keys[0]) and not any(_exists(rig.raw, k) for k in keys[1:])
        assert rig.raw.get(keys[0]) == ctypes.string_at(*good)
    for method in ("put_from", "upsert_from"):
        for i, (ptr, size) in enumerate(bad):
            key = rig.key(f"{method}-bad-{i}")
            assert getattr(rig.store, method)(key, ptr, size) == INVALID_PARAMS
            assert not _exists(rig.raw, key)
        key = rig.key(f"{method}-good")
        assert getattr(rig.store, method)(key, *good) == 0 and rig.raw.get(key) == ctypes.string_at(*good)
    # Gets: the object exists; refused destinations stay as they were.
    source = rig.key("batch_put_from-0")
    snapshots = [ctypes.string_at(ptr, REGION) for ptr, _ in bad]
    codes = rig.store.batch_get_into([source] * (len(bad) + 1), [rig.a.ptr + REGION] + [p for p, _ in bad],
                                     [REGION] * (len(bad) + 1))  # fmt: skip
    assert codes == [REGION] + [INVALID_PARAMS] * len(bad)
    for i, (ptr, _) in enumerate(bad):
        assert rig.store.get_into(source, ptr, REGION) == INVALID_PARAMS
        assert ctypes.string_at(ptr, REGION) == snapshots[i]
    assert rig.store.get_into(source, rig.a.ptr + 2 * REGION, REGION) == REGION
    assert ctypes.string_at(rig.a.ptr + 2 * REGION, REGION) == ctypes.string_at(*good)
    # Keyword and extra arguments are checked too.
    key = rig.key("kw")
    ptr, size = bad[0]
    assert rig.store.batch_put_from(keys=[key], buffer_ptrs=[ptr], sizes=[size]) == [INVALID_PARAMS]
    assert rig.store.batch_put_from_multi_buffers([key], all_buffer_ptrs=[[ptr]], all_sizes=[[size]]) == [-600]
    assert rig.store.batch_get_into_multi_buffers([source], [[ptr]], [[size]], True) == [INVALID_PARAMS]
    assert rig.store.put_from(key=key, buffer_ptr=ptr, size=size) == INVALID_PARAMS
    assert not _exists(rig.raw, key)


@pytest.mark.mooncake
@pytest.mark.parametrize("kind", ["native", "staged_native"])
def test_tensor_and_ranged_methods_refuse_bad_slices(rig_factory: Callable[[str], Rig], kind: str) -> None:
    rig = rig_factory(kind)
    ptr, size = rig.bad_slices()["outside"]
    snapshot = ctypes.string_at(ptr, size)
    key = rig.key("t")
    assert rig.store.get_tensor_into(key, ptr, size) is None
    assert rig.store.batch_get_tensor_into([key], [ptr], [size]) == [None]
    assert rig.store.put_tensor_from(key, ptr, size) == INVALID_PARAMS
    assert rig.store.put_from_with_metadata(key, rig.a.ptr, ptr, REGION, size) == INVALID_PARAMS
    assert rig.store.batch_put_from_multi_buffer_ranges([key], [[ptr]], [[size]], [[0]]) == [INVALID_PARAMS]
    assert rig.store.batch_get_into_multi_buffer_ranges([key], [[ptr]], [[size]], [[0]]) == [INVALID_PARAMS]
    assert rig.store.get_into_ranges([ptr], [[key]], [[[0]]], [[[0]]], [[[size]]]) == [[[INVALID_PARAMS]]]
    assert not _exists(rig.raw, key) and ctypes.string_at(ptr, size) == snapshot


# --- wild addresses (would crash the process without the guard) -----------------------------------------------

_WILD = """
import sys
from mooncake_kvaddr.driver.master import EmbeddedMaster
from mooncake_kvaddr.driver.staging import StagingBuffer
from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore
from mooncake_kvaddr.integrations.vllm.staged_store import StagedMooncakeStore
import mooncake.store as ms
import numpy as np

with EmbeddedMaster() as master:
    for kind in ("native", "staged", "staged_native"):
        raw = ms.MooncakeDistributedStore()
        assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 0, "tcp", "", master.rpc_address) == 0
        inner = NativeMooncakeStore(raw, armed=True) if kind != "staged" else raw
        store = inner if kind == "native" else StagedMooncakeStore(inner, staging_bytes=1 << 20, armed=True)
        cache = StagingBuffer(4096)
        assert store.register_buffer(cache.ptr, cache.nbytes) == 0
        assert store.batch_put_from_multi_buffers(["wild-src"], [[cache.ptr]], [[256]]) == [0]
        for name, (ptr, size) in {"negative": (-4096, 256), "huge": (1 << 62, 256), "null": (0, 256),
                                  "wrap": ((1 << 63) - 16, 256), "beyond": (2**64 + 5, 256),
                                  "negative_size": (cache.ptr, -1)}.items():
            got = store.batch_get_into_multi_buffers(["wild-src", "wild-src"], [[cache.ptr], [ptr]], [[256], [size]])
            assert got == [256, -600], (kind, name, got)
            got = store.batch_put_from_multi_buffers([f"wild-{name}"], [[ptr]], [[size]])
            assert got == [-600], (kind, name, got)
            assert raw.is_exist(f"wild-{name}") != 1, (kind, name)
            assert store.batch_get_into(["wild-src"], [ptr], [size]) == [-600], (kind, name)
            assert store.get_into("wild-src", ptr, size) == -600, (kind, name)
            if 0 <= ptr < 2**63:
                a = np.array([[cache.ptr], [ptr]], dtype=np.int64)
                s = np.array([[256], [size]], dtype=np.int64)
                got = store.batch_get_into_multi_buffers_arrays(["wild-src", "wild-src"], a, s)
                assert got == [256, -600], (kind, name, got)
        store.close()
        print("OK", kind, flush=True)
"""


@pytest.mark.mooncake
def test_wild_addresses_never_reach_mooncake_in_a_subprocess(tmp_path: Path) -> None:
    package_root = Path(guard_module.__file__).resolve().parents[3]
    env = dict(os.environ, PYTHONPATH=str(package_root))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_WILD)], env=env, capture_output=True, text=True, timeout=300,
        check=False, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, (done.returncode, done.stdout[-2000:], done.stderr[-3000:])
    assert [line for line in done.stdout.splitlines() if line.startswith("OK")] == [
        "OK native",
        "OK staged",
        "OK staged_native",
    ]


# --- the table, the policy, the warning ------------------------------------------------------------------------


def test_every_raw_pointer_method_of_mooncake_is_guarded(caplog: pytest.LogCaptureFixture) -> None:
    """Every method of the installed ``MooncakeDistributedStore`` whose signature names a pointer is checked by
    the guard (or is the registration itself); a pointer method the guard does not know passes with one
    warning (as without the plugin)."""
    ms = pytest.importorskip("mooncake.store")
    cls = ms.MooncakeDistributedStore
    pointer_methods = {name for name in dir(cls) if not name.startswith("__") and guard_module.takes_pointers(
        getattr(cls, name))}  # fmt: skip
    assert pointer_methods, "no pointer method found: the signature heuristic is broken"
    unguarded = pointer_methods - guard_module.guarded_names() - guard_module.REGISTRATION_METHODS
    assert not unguarded, f"raw-pointer Mooncake methods the guard does not check: {sorted(unguarded)}"

    class Fake:
        def register_buffer(self, ptr: int, size: int) -> int:
            return 0

        def peek(self, key: str, buffer_ptr: int) -> int:
            """peek(self, key: str, buffer_ptr: int) -> int"""
            return 0

    store = NativeMooncakeStore(Fake())
    assert store.peek("k", 1) == 0  # not armed yet: Mooncake's semantics
    store.register_buffer(4096, 4096)
    # Armed: a raw-pointer method the guard does not know passes, as without the plugin, with one warning.
    native_store_module._WARNED_UNKNOWN.discard("peek")
    with caplog.at_level(logging.WARNING, logger="vllm.mooncake_kvaddr"):
        assert store.peek("k", 4096) == 0
        assert store.peek("k", 1 << 40) == 0
    warnings = [r.getMessage() for r in caplog.records if "peek takes raw pointers" in r.getMessage()]
    assert len(warnings) == 1 and "pass unchecked" in warnings[0]


def test_armed_wrappers_refuse_before_any_registration_unarmed_ones_pass() -> None:
    calls: list[str] = []

    class Fake:
        def register_buffer(self, ptr: int, size: int) -> int:
            return 0 if ptr > 0 else -1

        def unregister_buffer(self, ptr: int) -> int:
            return 0

        def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
            calls.append("put")
            return [0] * len(keys)

    for wrapper in (NativeMooncakeStore, lambda s, **k: StagedMooncakeStore(s, staging_bytes=4096, **k)):
        calls.clear()
        armed = wrapper(Fake(), armed=True)
        assert armed.batch_put_from(["k"], [4096], [16]) == [INVALID_PARAMS] and calls == []
        plain = wrapper(Fake())
        assert plain.batch_put_from(["k"], [4096], [16]) == [0] and calls == ["put"]
        assert plain.register_buffer(-5, 10) == -1  # refused by "Mooncake": not recorded, not armed
        assert plain.batch_put_from(["k"], [4096], [16]) == [0]
        assert plain.register_buffer(8192, 100) == 0  # armed from now on
        assert plain.batch_put_from(["k", "j"], [4096, 8192], [16, 100]) == [INVALID_PARAMS, 0]
        plain.unregister_buffer(8192)
        assert plain.batch_put_from(["j"], [8192], [100]) == [INVALID_PARAMS]  # stays armed, range gone
        assert calls == ["put"] * 3


def test_a_positive_register_answer_is_no_registration() -> None:
    """Only 0 is Mooncake's success: a positive answer records no range (its keys are refused like any other)."""
    calls: list[list[str]] = []

    class Fake:
        def register_buffer(self, ptr: int, size: int) -> int:
            return 1 if ptr == 8192 else 0

        def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
            calls.append(keys)
            return [0] * len(keys)

    assert registration_ok(0) and registration_ok(np.int64(0))
    assert not registration_ok(1) and not registration_ok(np.int32(2)) and not registration_ok(False)
    store = NativeMooncakeStore(Fake(), armed=True)
    assert store.register_buffer(8192, 100) == 1
    assert store.register_buffer(4096, 16) == 0
    assert store.ranges.ranges.items == ((4096, 16),)
    assert store.batch_put_from(["j", "k"], [8192, 4096], [100, 16]) == [INVALID_PARAMS, 0] and calls == [["k"]]


def test_plugin_installs_armed_wrappers(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from mooncake_kvaddr.integrations.vllm import plugin

    monkeypatch.delenv(plugin.ENV_NATIVE_CLIENT, raising=False)
    monkeypatch.setenv(plugin.ENV_STAGED, "1")
    tensor = types.SimpleNamespace(device=types.SimpleNamespace(type="cpu"))
    both = plugin.maybe_stage_store(object(), {"a": tensor}, None)
    assert isinstance(both, StagedMooncakeStore) and both.ranges.armed
    assert isinstance(both.wrapped, NativeMooncakeStore) and both.wrapped.ranges.armed


def test_ranges_check_equals_a_slice_by_slice_reference() -> None:
    """The vectorised check (fast path and cell by cell) against a plain Python one, overlapping ranges too."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        buffers = {int(p): int(n) for p, n in zip(rng.integers(1, 1 << 20, 4), rng.integers(1, 1 << 16, 4))}
        ranges = Ranges.of(buffers)
        shape = (int(rng.integers(1, 6)), int(rng.integers(1, 5)))
        pick = rng.choice(list(buffers), size=shape)
        addrs = (pick + rng.integers(-64, 1 << 16, shape)).astype(np.int64)
        sizes = rng.integers(-2, 1 << 12, shape).astype(np.int64)
        if rng.random() < 0.2:
            addrs[0, 0] = (1 << 63) - 5
        want = np.array(
            [[s >= 0 and a > 0 and any(p <= a and a + s <= p + n for p, n in buffers.items())
              for a, s in zip(ra, rs, strict=True)] for ra, rs in zip(addrs.tolist(), sizes.tolist(), strict=True)]
        )  # fmt: skip
        assert (ranges.cells_inside(addrs, sizes) == want).all()
        assert ranges.all_inside(addrs, sizes) == bool(want.all())


def test_table_is_thread_safe_and_snapshots_are_consistent() -> None:
    table = RangeTable()
    stop = threading.Event()
    errors: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            snap = table.ranges
            if len(snap.pairs) != len(snap.items):  # the native set and the items of one registration state
                errors.append("torn snapshot")

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for i in range(2000):
        table.add(4096 * (i + 1), 100)
        if i % 3 == 0:
            table.remove(4096 * (i + 1))
    stop.set()
    for t in threads:
        t.join()
    assert not errors and table.armed


def test_refusals_log_one_rate_limited_warning_with_the_count(caplog: pytest.LogCaptureFixture) -> None:
    class Fake:
        def register_buffer(self, ptr: int, size: int) -> int:
            return 0

        def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
            return [len(keys)] * len(keys)

    store = NativeMooncakeStore(Fake(), armed=True)
    store.register_buffer(4096, 4096)
    with caplog.at_level(logging.WARNING, logger="vllm.mooncake_kvaddr"):
        assert store.batch_get_into(["a", "b", "c"], [1, 4096, 2], [8, 8, 8]) == [-600, 1, -600]
        assert store.batch_get_into(["a"], [1], [8]) == [-600]
    warnings = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(warnings) == 1 and "refused 2 key(s)" in warnings[0]
    assert store.guard.refused_keys == 3


# --- the native client's own check (C++, during its conversion) --------------------------------------------------


@pytest.mark.mooncake
def test_native_client_ranges_equal_the_reference_check(master: EmbeddedMaster) -> None:
    """``NativeClient`` with ``ranges``: per key, refused (-600, not sent) exactly when the vectorised Python
    check refuses it, for matrices, lists of rows, ragged and malformed rows and the contiguous calls; nothing is
    sent when every key is refused. Keys are missing, so a key that is sent reads nothing (-704)."""
    from mooncake_kvaddr import _native

    raw = _raw_store(master)
    try:
        client = NativeClient.from_store(raw)
        assert client is not None
        rng = np.random.default_rng(11)
        tag = uuid.uuid4().hex[:8]
        for case in range(60):
            buffers = {int(p): int(n) for p, n in zip(rng.integers(1, 1 << 40, 3), rng.integers(1, 1 << 20, 3))}
            ranges = Ranges.of(buffers)
            n, w = int(rng.integers(1, 7)), int(rng.integers(1, 4))
            base = rng.choice(list(buffers), size=(n, w))
            addrs = (base + rng.integers(-512, 1 << 20, (n, w))).astype(np.int64)
            sizes = rng.integers(-1, 1 << 12, (n, w)).astype(np.int64)
            if case % 7 == 0:
                addrs[0, 0] = [0, -8, (1 << 63) - 4][case % 3]
            want_ok = ranges.cells_inside(addrs, sizes).all(axis=1)
            keys = [f"guard-native-{tag}-{case}-{i}" for i in range(n)]
            want = [-704 if ok else INVALID_PARAMS for ok in want_ok]
            before = _native.mooncake_client_call_count()
            for form in ("arrays", "lists"):
                a, s = (addrs, sizes) if form == "arrays" else (addrs.tolist(), sizes.tolist())
                assert client.batch_get_into_multi_buffers(keys, a, s, ranges=ranges.pairs) == want, (case, form)
                assert client.last_refused() == n - int(want_ok.sum())
            flat_ok = ranges.cells_inside(addrs[:, 0], sizes[:, 0])
            got = client.batch_get_into(keys, addrs[:, 0].tolist(), sizes[:, 0].tolist(), ranges=ranges.pairs)
            assert got == [-704 if ok else INVALID_PARAMS for ok in flat_ok]
            sent = 2 * int(want_ok.any()) + int(flat_ok.any())
            assert _native.mooncake_client_call_count() - before == sent  # all refused: Mooncake not called
        # Ragged rows and a row whose address and size counts differ: only that key refused.
        p = next(iter(buffers))
        rows = [[p, p + 8], [p], [p, p + 16]]
        size_rows = [[8, 8], [8], [8]]
        got = client.batch_get_into_multi_buffers(["x", "y", "z"], rows, size_rows, ranges=ranges.pairs)
        assert got == [-704, -704, INVALID_PARAMS]
        with pytest.raises(TypeError):
            client.batch_get_into_multi_buffers(["x"], [[p]], [[8]], ranges=[[p, p + 8]])  # not an int64 array
        with pytest.raises(ValueError):
            client.batch_get_into_multi_buffers(["x"], [[p]], [[8]], ranges=np.array([[p, p]], np.int64))
    finally:
        raw.close()


@pytest.mark.mooncake
@pytest.mark.parametrize("kind", KINDS)
def test_malformed_rows_refuse_only_their_key(rig_factory: Callable[[str], Rig], kind: str) -> None:
    """A row with a float, a value past 2**64, or more addresses than sizes: the native client refuses the call,
    the guard then refuses only that key (-600, not sent); the good key is stored as Mooncake stores it."""
    rig = rig_factory(kind)
    good = [rig.a.ptr, rig.a.ptr + REGION]
    for i, (row, size_row) in enumerate(
        [([rig.a.ptr + 0.5], [REGION]), ([2**64 + 1], [REGION]), ([rig.a.ptr, rig.a.ptr], [REGION])]
    ):
        keys = [rig.key(f"ok{i}"), rig.key(f"bad{i}")]
        codes = rig.store.batch_put_from_multi_buffers(keys, [good, row], [[REGION, REGION], size_row])
        assert codes == [0, INVALID_PARAMS], (i, codes)
        assert rig.raw.get(keys[0]) == ctypes.string_at(rig.a.ptr, 2 * REGION)
        assert not _exists(rig.raw, keys[1])


def test_ragged_rows_are_checked_up_to_each_rows_own_width() -> None:
    """The Python guard (the bound-method fallback) pads ragged rows into a matrix: the padding cells are not
    slices (a good short row passes), every real cell is one (a bad last cell of a short row is refused)."""
    table = RangeTable(armed=True)
    buf = np.zeros(4096, np.uint8)
    p = int(buf.ctypes.data)
    assert table.add(p, buf.nbytes)
    check = guard_module.StoreGuard("test", table)
    keys = ["a", "b", "c"]
    good = check.check_multi(keys, [[p, p + 64, p + 128], [p], [p, p + 64]], [[64, 64, 64], [64], [64, 64]])
    assert good is not None and good.good is None and good.refused == 0
    bad_last = check.check_multi(keys, [[p, p + 64, p + 128], [p], [p, p + 4096]], [[64, 64, 64], [64], [64, 64]])
    assert bad_last is not None and bad_last.good == [0, 1]
    bad_short = check.check_multi(keys, [[p, p + 64, p + 128], [p - 64], [p, p + 64]], [[64, 64, 64], [64], [64, 64]])
    assert bad_short is not None and bad_short.good == [0, 2]


def test_the_snapshot_form_of_ranged_reads_is_guarded_like_get_into_ranges() -> None:
    """Mooncake 0.3.14's ``get_into_ranges_from_snapshot(snapshot, buffer_ptrs, ...)``: checked as
    ``get_into_ranges`` is (the snapshot passed through untouched); a buffer with a slice outside gets -600
    for each of its ranges and is not sent."""
    sent: list[tuple[Any, ...]] = []

    class Fake:
        def register_buffer(self, ptr: int, size: int) -> int:
            return 0

        def get_into_ranges_from_snapshot(self, *args: Any) -> Any:
            """get_into_ranges_from_snapshot(self, snapshot: RangedReadSnapshot, buffer_ptrs: list[int], all_keys:
            list[list[str]], all_dst_offsets: list[list[list[int]]], all_src_offsets: list[list[list[int]]],
            all_sizes: list[list[list[int]]]) -> list[list[list[int]]]"""
            sent.append(args)
            return [[[len(row) for row in sizes] for sizes in args[5]][i] for i in range(len(args[1]))]

    store = NativeMooncakeStore(Fake(), armed=True)
    assert "get_into_ranges_from_snapshot" in guard_module.guarded_names()
    assert store.register_buffer(4096, 4096) == 0
    snap = object()
    got = store.get_into_ranges_from_snapshot(
        snap, [4096, 1 << 40], [["a"], ["b"]], [[[0]], [[0]]], [[[0]], [[0]]], [[[64]], [[64]]]
    )
    assert got == [[1], [[INVALID_PARAMS]]]
    assert len(sent) == 1 and sent[0][0] is snap and sent[0][1] == [4096] and sent[0][2] == [["a"]]


def test_rows_that_cannot_be_paired_with_the_keys_refuse_every_key() -> None:
    """A multi-buffer call with more or fewer address/size rows than keys: every key -600, nothing sent (the
    Python guard; Mooncake itself would answer -600 or index past the rows)."""
    sent: list[Any] = []

    class Fake:
        def register_buffer(self, ptr: int, size: int) -> int:
            return 0

        def batch_put_from_multi_buffers(self, *args: Any) -> list[int]:
            sent.append(args)
            return [0] * len(args[0])

    table = RangeTable(armed=True)
    assert table.add(4096, 4096)
    check = guard_module.StoreGuard("test", table)
    for addrs, sizes in (([[4096]], [[64], [64]]), ([[4096], [4160], [4224]], [[64], [64], [64]])):
        verdict = check.check_multi(["a", "b"], addrs, sizes)
        assert verdict is not None and verdict.good == [] and verdict.refused == 2
    store = NativeMooncakeStore(Fake(), armed=True)
    store._client = None  # the bound-method path: the Python guard decides
    assert store.register_buffer(4096, 4096) == 0
    assert store.batch_put_from_multi_buffers(["a", "b"], [[4096]], [[64], [64]]) == [INVALID_PARAMS] * 2
    assert sent == []


def test_put_from_with_metadata_checks_each_buffer_with_its_own_size() -> None:
    """``put_from_with_metadata(key, buffer_ptr, metadata_buffer_ptr, size, metadata_size)`` has two slices,
    ``(buffer_ptr, size)`` and ``(metadata_buffer_ptr, metadata_size)``: each is checked with its own size."""
    sent: list[tuple[Any, ...]] = []

    class Fake:
        def register_buffer(self, ptr: int, size: int) -> int:
            return 0

        def put_from_with_metadata(self, *args: Any) -> int:
            sent.append(args)
            return 0

    store = NativeMooncakeStore(Fake(), armed=True)
    assert store.register_buffer(4096, 4096) == 0
    tail = 8192 - 64  # the buffer's last 64 bytes
    assert store.put_from_with_metadata("a", tail, 4096, 64, 1024) == 0  # both inside
    assert store.put_from_with_metadata("b", tail, 4096, 1024, 64) == INVALID_PARAMS  # the data runs past the end
    assert store.put_from_with_metadata("c", 4096, tail, 64, 1024) == INVALID_PARAMS  # the metadata does
    assert [args[0] for args in sent] == ["a"]


def _armed_guard() -> guard_module.StoreGuard:
    """A guard whose one registered range is [4096, 8192)."""
    table = RangeTable(armed=True)
    assert table.add(4096, 4096)
    return guard_module.StoreGuard("test", table)


def test_a_range_ending_exactly_at_the_int64_maximum_is_recorded() -> None:
    """Registered buffers are ranges inside [1, 2**63): one ending exactly at 2**63 - 1 counts, one byte more
    does not."""
    top = (1 << 63) - 1
    assert RangeTable.as_range(8, top - 8) == (8, top - 8)
    assert RangeTable.as_range(8, top - 7) is None
    table = RangeTable()
    assert table.add(top - 4096, 4096) and table.ranges.items == ((top - 4096, 4096),)


def test_ranged_reads_refuse_key_counts_unlike_their_rows_and_negative_offsets() -> None:
    """``get_into_ranges``: a buffer whose key list and dst rows differ in length, or whose dst offset is
    negative (even when ``ptr + offset`` lands inside a registered range), gets -600 and is not sent; the
    other buffers are."""
    sent: list[tuple[Any, ...]] = []

    def get_into_ranges(*args: Any) -> list[Any]:
        sent.append(args)
        return [[[7] * len(row) for row in sizes] for sizes in args[4]]

    guard = _armed_guard()
    good = ([4096], [["a"]], [[[0]]], [[[0]]], [[[64]]])
    assert guard.call("get_into_ranges", get_into_ranges, good, {}) == [[[7]]]
    for bad in (
        (4096, ["b", "c"], [[0]], [[0]], [[64]]),  # two keys, one dst row
        (4160, ["b"], [[-64]], [[0]], [[64]]),  # 4160 - 64 = 4096 is inside, but the offset is negative
    ):
        sent.clear()
        args = tuple([*g, b] for g, b in zip(good, bad, strict=True))
        assert guard.call("get_into_ranges", get_into_ranges, args, {}) == [[[7]], [[INVALID_PARAMS]]], bad
        assert len(sent) == 1 and sent[0][0] == [4096] and sent[0][1] == [["a"]]


def test_a_split_ranged_put_cuts_its_per_key_offsets_to_the_keys_sent() -> None:
    """``batch_put_from_multi_buffer_ranges(keys, ptrs, sizes, all_dst_offsets)`` with one key refused: the
    per-key offsets go to Mooncake for the remaining keys only, in step with the keys."""
    sent: list[tuple[Any, ...]] = []

    def put(*args: Any) -> list[int]:
        sent.append(args)
        return [0] * len(args[0])

    guard = _armed_guard()
    args = (["bad", "good"], [[1 << 40], [4096]], [[64], [64]], [[11], [22]])
    assert guard.call("batch_put_from_multi_buffer_ranges", put, args, {}) == [INVALID_PARAMS, 0]
    assert len(sent) == 1 and list(sent[0][0]) == ["good"] and [list(r) for r in sent[0][3]] == [[22]]


def test_a_flat_call_with_sizes_not_paired_with_the_keys_refuses_every_key() -> None:
    """A flat call (one pointer and size per key) with more or fewer sizes (or pointers) than keys: every key
    refused, as for multi-buffer rows."""
    guard = _armed_guard()
    for ptrs, sizes in (([4096, 4160], [64, 64, 64]), ([4096, 4160], [64]), ([4096], [64, 64])):
        verdict = guard.check_flat(["a", "b"], ptrs, sizes)
        assert verdict is not None and verdict.good == [] and verdict.refused == 2, (ptrs, sizes)


def test_a_zero_byte_registration_is_no_range_and_keeps_the_real_one() -> None:
    """Mooncake may accept ``register_buffer(ptr, 0)``; it allows nothing and never replaces a real buffer that
    starts at the same address (fresh mutant M8-17)."""
    table = RangeTable()
    assert table.add(1 << 20, 4096)
    assert not table.add(1 << 20, 0) and not table.add(2 << 20, 0)
    assert table.ranges.items == ((1 << 20, 4096),)
    rows = np.array([[(1 << 20) + 100], [2 << 20]], np.int64)
    assert table.ranges.cells_inside(rows, np.array([[8], [1]], np.int64)).tolist() == [[True], [False]]
    assert RangeTable.as_range(1 << 20, 0) is None and RangeTable.as_range(1 << 20, 1) == (1 << 20, 1)


def test_a_registration_that_cannot_be_a_range_still_arms_the_table() -> None:
    """A buffer Mooncake accepted arms the guard even when it is no range (empty, negative, not an int): from
    then on a pointer outside every recorded range is refused, not passed through as on an unarmed table."""
    for ptr, nbytes in ((1 << 20, 0), (-4096, 4096), ("x", 4096), (1 << 20, 2**63)):
        table = RangeTable()
        assert not table.armed
        assert not table.add(ptr, nbytes)
        assert table.armed and table.ranges.items == (), (ptr, nbytes)
    calls: list[list[str]] = []

    class Fake:
        def register_buffer(self, ptr: int, size: int) -> int:
            return 0

        def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
            calls.append(keys)
            return [0] * len(keys)

    store = NativeMooncakeStore(Fake())
    assert store.batch_put_from(["k"], [4096], [16]) == [0] and calls == [["k"]]  # unarmed: Mooncake decides
    assert store.register_buffer(4096, 0) == 0
    assert store.batch_put_from(["k"], [4096], [16]) == [INVALID_PARAMS] and calls == [["k"]]


def test_an_empty_slice_inside_a_buffer_passes_every_form_of_the_check() -> None:
    """Size 0 is a slice (0 <= size, kvaddr/ranges.hpp): a single-key call and a list of numpy ints (checked one
    by one in Python) let an empty slice inside the buffer through like the array check; outside it is refused."""
    guard = _armed_guard()
    sent: list[tuple[Any, ...]] = []

    def put(*args: Any) -> int:
        sent.append(args)
        return 0

    assert guard.call("put_from", put, ("k", 4096, 0), {}) == 0 and sent == [("k", 4096, 0)]
    assert guard.call("put_from", put, ("k", 5000, 0), {}) == 0 and len(sent) == 2
    assert guard.call("put_from", put, ("k", 1 << 40, 0), {}) == INVALID_PARAMS and len(sent) == 2
    for ptrs, sizes in (
        (np.array([4096, 5000, 1 << 40], np.int64), np.array([0, 8, 0], np.int64)),
        ([np.int64(4096), np.int64(5000), np.int64(1 << 40)], [np.int64(0), np.int64(8), np.int64(0)]),
    ):
        verdict = guard.check_flat(["a", "b", "c"], ptrs, sizes)
        assert verdict is not None and verdict.good == [0, 1] and verdict.refused == 1, type(ptrs)


@pytest.mark.parametrize("form", ["positional", "keywords"])
def test_a_split_parallel_put_cuts_its_per_key_extras_whatever_the_argument_form(form: str) -> None:
    """``batch_put_tensor_with_parallelism_from(keys, ptrs, sizes, parallelisms, config, writer_partitions)``
    with one key refused: ``parallelisms`` and ``writer_partitions`` go on for the remaining keys only, whether
    they came by position (``config`` sits between them) or by keyword; ``config`` goes on unchanged."""
    sent: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def put(*args: Any, **kwargs: Any) -> list[int]:
        sent.append((args, kwargs))
        return [0] * len(args[0])

    guard = _armed_guard()
    config = object()
    lead = (["bad", "good"], [1 << 40, 4096], [64, 64])
    if form == "positional":
        args, kwargs = (*lead, [1, 2], config, [[10], [20]]), {}
    else:
        args, kwargs = lead, {"parallelisms": [1, 2], "config": config, "writer_partitions": [[10], [20]]}
    assert guard.call("batch_put_tensor_with_parallelism_from", put, args, kwargs) == [INVALID_PARAMS, 0]
    assert len(sent) == 1
    got_args, got_kwargs = sent[0]
    bound = dict(zip(["keys", "ptrs", "sizes", "parallelisms", "config", "writer_partitions"], got_args))
    bound.update(got_kwargs)
    assert list(bound["keys"]) == ["good"] and list(bound["ptrs"]) == [4096]
    assert list(bound["parallelisms"]) == [2] and [list(w) for w in bound["writer_partitions"]] == [[20]]
    assert bound["config"] is config


class _FlatFake:
    """A stand-in store for the contiguous calls: records what reaches "Mooncake" (no native client for it)."""

    def __init__(self) -> None:
        self.sent: list[tuple[list[str], list[int], list[int]]] = []

    def register_buffer(self, ptr: int, size: int) -> int:
        return 0

    def batch_get_into(self, keys: Any, ptrs: Any, sizes: Any) -> list[int]:
        self.sent.append((list(keys), [int(p) for p in ptrs], [int(s) for s in sizes]))
        return [int(s) for s in sizes]


_HUGE = 2**63 + 4096
_FLAT_FORMS: dict[str, tuple[Any, Any, list[int]]] = {
    # form: (ptrs, sizes, expected results for keys ["a", "b"]); the registered buffer is [4096, 8192)
    "int64 arrays": (np.array([4096, 1], np.int64), np.array([8, 8], np.int64), [8, INVALID_PARAMS]),
    "uint64 arrays past int64": (np.array([4096, _HUGE], np.uint64), np.array([8, 8], np.uint64), [8, INVALID_PARAMS]),
    "int32 arrays": (np.array([4096, 1], np.int32), np.array([8, 8], np.int32), [8, INVALID_PARAMS]),
    "numpy ints in a list": ([np.int64(4096), np.uint64(_HUGE)], [np.int64(8), np.uint64(8)], [8, INVALID_PARAMS]),
    "ints past int64 in a list": ([4096, 2**64 + 4096], [8, 8], [8, INVALID_PARAMS]),
    "negative size": ([4096, 4096], [8, -8], [8, INVALID_PARAMS]),
    "negative address": ([-4096, 4096], [8, 8], [INVALID_PARAMS, 8]),
    "tuples": ((4096, 1), (8, 8), [8, INVALID_PARAMS]),
    "negative size in tuples": ((4096, 4096), (-8, 8), [INVALID_PARAMS, 8]),
    "size past int64 in tuples": ((4096, 4096), (8, 2**64 - 8), [8, INVALID_PARAMS]),
    "a slice past the end": ([8184, 8185], [8, 8], [8, INVALID_PARAMS]),
    "a float and a bool": ([4096.0, True], [8, 8], [INVALID_PARAMS, INVALID_PARAMS]),
    "fewer addresses than keys": ([4096], [8, 8], [INVALID_PARAMS, INVALID_PARAMS]),
    "rows that are not sized": (4096, 8, [INVALID_PARAMS, INVALID_PARAMS]),
}


@pytest.mark.parametrize("form", sorted(_FLAT_FORMS))
def test_contiguous_calls_hold_back_every_integer_form_outside_the_registered_buffer(form: str) -> None:
    """The guard's contiguous-call check (``check_flat``) in each form vLLM or a caller may hand it: arrays of
    every width and sign, lists of numpy ints, ints past int64, tuples, negative values, floats, bools and
    unpaired rows. A key with a slice outside [4096, 8192) gets -600 and never reaches the store; the others
    reach it with their own address and size, in order."""
    ptrs, sizes, expected = _FLAT_FORMS[form]
    fake = _FlatFake()
    store = NativeMooncakeStore(fake, armed=True)
    assert store.register_buffer(4096, 4096) == 0
    assert store.batch_get_into(["a", "b"], ptrs, sizes) == expected
    good = [i for i, code in enumerate(expected) if code != INVALID_PARAMS]
    if not good:
        assert fake.sent == []
    else:
        assert fake.sent == [(["ab"[i] for i in good], [int(ptrs[i]) for i in good], [int(sizes[i]) for i in good])]


def test_ranged_reads_the_guard_cannot_read_are_refused_whole_and_miscounted_answers_raise() -> None:
    """``get_into_ranges`` with rows the guard cannot pair (a dst row longer than its size row, a buffer list
    that is not sized) raises ``GuardRefused`` (a ``TypeError``) and sends nothing; a dst offset that is not an
    int refuses its buffer (-600); a call missing an argument goes to Mooncake as it is (its binding raises);
    Mooncake answering for another number of buffers than it was sent raises instead of misplacing answers."""
    sent: list[tuple[Any, ...]] = []

    def get_into_ranges(*args: Any) -> list[Any]:
        sent.append(args)
        return [[[7] * len(row) for row in sizes] for sizes in args[4]] if len(args) == 5 else []

    guard = _armed_guard()
    for unreadable in (
        ([4096], [["a"]], [[[0, 8]]], [[[0, 0]]], [[[64]]]),  # two dst offsets, one size
        (4096, [["a"]], [[[0]]], [[[0]]], [[[64]]]),  # buffer pointers that are not a list
    ):
        with pytest.raises(guard_module.GuardRefused, match="cannot read"):
            guard.call("get_into_ranges", get_into_ranges, unreadable, {})
    assert sent == []
    text = ([4096], [["a"]], [[["0"]]], [[[0]]], [[[64]]])  # an offset that is a string
    assert guard.call("get_into_ranges", get_into_ranges, text, {}) == [[[INVALID_PARAMS]]] and sent == []
    assert guard.call("get_into_ranges", get_into_ranges, ([4096], [["a"]]), {}) == []
    assert sent == [([4096], [["a"]])]
    sent.clear()

    def short(*args: Any) -> list[Any]:
        sent.append(args)
        return []

    two = ([4096, 1 << 40], [["a"], ["b"]], [[[0]], [[0]]], [[[0]], [[0]]], [[[64]], [[64]]])
    with pytest.raises(RuntimeError, match="returned 0 results for 1"):
        guard.call("get_into_ranges", short, two, {})
    assert len(sent) == 1 and sent[0][0] == [4096]


def test_a_miscounted_ranged_read_raises_with_its_own_message() -> None:
    """Mooncake answering a split ``get_into_ranges`` for another number of buffers than it was sent raises
    ``RuntimeError`` with the message the ranged split always gave: the counts of answers and of buffers (not
    "keys": each buffer holds a row of keys), as before cf6cef7 moved the check into ``per_key.put_back``."""
    guard = _armed_guard()
    two = ([4096, 1 << 40], [["a"], ["b"]], [[[0]], [[0]]], [[[0]], [[0]]], [[[64]], [[64]]])
    for answers in ([], [[[7]], [[7]]]):
        with pytest.raises(RuntimeError) as raised:
            guard.call("get_into_ranges", lambda *args, answers=answers: answers, two, {})
        assert str(raised.value) == f"Mooncake's get_into_ranges returned {len(answers)} results for 1"


def _guard_over_a_buffer() -> tuple[guard_module.StoreGuard, int, np.ndarray]:
    """A guard whose one registered range is a 4096-byte buffer of the test's (kept alive by the caller)."""
    table = RangeTable(armed=True)
    buf = np.zeros(4096, np.uint8)
    p = int(buf.ctypes.data)
    assert table.add(p, buf.nbytes)
    return guard_module.StoreGuard("test", table), p, buf


def _recording_get(sent: list[list[str]]) -> Callable[[list[str], Any, Any], list[int]]:
    """A stand-in for an ``..._arrays`` get: records the keys sent, answers 64 bytes each."""

    def func(keys: list[str], addrs: Any, sizes: Any) -> list[int]:
        sent.append(list(keys))
        return [64] * len(keys)

    return func


@pytest.mark.parametrize("form", ["int64_ptrs_list_sizes", "int64_ptrs_uint64_sizes", "flat_int64", "extra_row"])
def test_multi_buffer_rows_in_mixed_or_malformed_array_forms_are_checked_per_key(form: str) -> None:
    """The fast path is only for two int64 ``(n, R)`` matrices of the keys' count: a matrix beside lists, an
    unsigned size past the int64 maximum, flat arrays (no rows) and a matrix with a row more than keys each get
    the per-key answer of the general check, never an exception and never a bad key admitted."""
    check, p, _buf = _guard_over_a_buffer()
    ptrs = np.array([[p, p + 64], [p - 64, p], [p + 128, p + 192]], np.int64)  # key 1 starts before the buffer
    sizes = np.full((3, 2), 64, np.int64)
    forms: dict[str, tuple[Any, Any, list[int]]] = {
        "int64_ptrs_list_sizes": (ptrs, sizes.tolist(), [0, 2]),
        "int64_ptrs_uint64_sizes": (ptrs, np.array([[64, 64], [64, 64], [1 << 63, 64]], np.uint64), [0]),
        "flat_int64": (ptrs[:, 0].copy(), sizes[:, 0].copy(), []),
        "extra_row": (np.vstack([ptrs, ptrs[:1]]), np.vstack([sizes, sizes[:1]]), []),
    }
    all_ptrs, all_sizes, good = forms[form]
    result = check.check_multi(["a", "b", "c"], all_ptrs, all_sizes)
    assert result is not None and result.good == good and result.refused == 3 - len(good)


def test_a_call_with_nothing_refused_logs_nothing_and_a_later_warning_counts_only_since_the_last(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``note_refused(0)`` (a call whose keys all passed) neither counts nor warns; after the rate limit's
    interval the next warning names the keys refused since the previous warning, no more."""
    clock = [1000.0]
    monkeypatch.setattr(guard_module, "time", type("Clock", (), {"monotonic": staticmethod(lambda: clock[0])}))
    check = _armed_guard()
    with caplog.at_level(logging.WARNING, logger="vllm.mooncake_kvaddr"):
        check.note_refused(0, "batch_get_into")
        assert check.refused_keys == 0 and not [r for r in caplog.records if "refused" in r.getMessage()]
        check.note_refused(2, "batch_get_into")  # warns: 2
        check.note_refused(1, "batch_get_into")  # within the interval: pending
        clock[0] += guard_module.WARN_INTERVAL_S + 1
        check.note_refused(1, "batch_get_into")  # warns: the pending 1 and this 1
    warnings = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(warnings) == 2 and "refused 2 key(s)" in warnings[0] and "refused 2 key(s)" in warnings[1]
    assert check.refused_keys == 4


def test_rows_checked_one_by_one_admit_a_key_only_when_every_slice_is_inside() -> None:
    """When one malformed row sends a multi-buffer call to the key-by-key check, a key with one good and one
    bad slice is still refused: every slice of a key must be inside, not any."""
    check, p, _buf = _guard_over_a_buffer()
    rows = [[p, p + 64], [p, p + 4096], [p, "not an address"], [p + 128, p + 192]]
    result = check.check_multi(["a", "b", "c", "d"], rows, [[64, 64]] * 4)
    assert result is not None and result.good == [0, 3] and result.refused == 2


def test_a_flat_call_with_an_address_array_beside_a_size_list_is_checked_per_key() -> None:
    """``check_flat`` with an int64 address array and a list of sizes: the general per-key check (no
    exception), a slice outside refused, the others passed."""
    check, p, _buf = _guard_over_a_buffer()
    result = check.check_flat(["a", "b", "c"], np.array([p, p + 4090, p + 64], np.int64), [64, 64, 64])
    assert result is not None and result.good == [0, 2] and result.refused == 1


def test_the_arrays_entry_with_a_size_list_beside_an_address_matrix_answers_per_key() -> None:
    """``call_arrays`` (the ``..._arrays`` entries) given an int64 address matrix and sizes as lists: the
    general check answers per key (-600 for the key outside, the others sent), no exception."""
    check, p, _buf = _guard_over_a_buffer()
    sent: list[list[str]] = []
    func = _recording_get(sent)
    addrs = np.array([[p], [p + 4090], [p + 64]], np.int64)
    assert check.call_arrays(["a", "b", "c"], addrs, [[64], [64], [64]], func) == [64, INVALID_PARAMS, 64]
    assert sent == [["a", "c"]]


@pytest.mark.parametrize("form", ["flat", "extra_row"])
def test_the_arrays_entry_refuses_every_key_of_matrices_that_are_not_its_rows(form: str) -> None:
    """``call_arrays`` given flat int64 arrays (no rows) or a matrix with a row more than keys: every key gets
    -600 and nothing is sent."""
    check, p, _buf = _guard_over_a_buffer()
    sent: list[list[str]] = []
    func = _recording_get(sent)
    addrs = np.array([[p], [p + 64], [p + 128]], np.int64)
    sizes = np.full((3, 1), 64, np.int64)
    if form == "flat":
        addrs, sizes = addrs[:, 0].copy(), sizes[:, 0].copy()
    else:
        addrs, sizes = np.vstack([addrs, addrs[:1]]), np.vstack([sizes, sizes[:1]])
    assert check.call_arrays(["a", "b", "c"], addrs, sizes, func) == [INVALID_PARAMS] * 3
    assert sent == []


def test_rows_converted_for_the_check_reach_a_native_client_as_matrices_flat_arguments_as_given() -> None:
    """With ``arrays_ok`` (the native client), a multi-buffer call whose rows all pass is handed the int64
    matrices the check converted; a flat call is handed its own arguments unchanged (a flat check's arrays are
    not rows)."""
    check, p, _buf = _guard_over_a_buffer()
    got: list[tuple[Any, Any]] = []

    def func(keys: list[str], ptrs: Any, sizes: Any) -> list[int]:
        got.append((ptrs, sizes))
        return [0] * len(keys)

    rows, row_sizes = [[p, p + 64], [p + 128, p + 192]], [[64, 64], [64, 64]]
    assert check.call("batch_get_into_multi_buffers", func, (["a", "b"], rows, row_sizes), {}, arrays_ok=True) == [0, 0]
    ptrs, sizes = got.pop()
    assert isinstance(ptrs, np.ndarray) and ptrs.dtype == np.int64 and ptrs.tolist() == rows
    assert isinstance(sizes, np.ndarray) and sizes.tolist() == row_sizes
    flat, flat_sizes = [p, p + 64], [64, 64]
    assert check.call("batch_get_into", func, (["a", "b"], flat, flat_sizes), {}, arrays_ok=True) == [0, 0]
    passed = got.pop()
    assert passed[0] is flat and passed[1] is flat_sizes


def test_a_refused_single_key_call_is_counted_and_warned(caplog: pytest.LogCaptureFixture) -> None:
    """A single-key method (``get_into``) with a slice outside: -600, not sent, one refused key counted."""
    check = _armed_guard()  # [4096, 8192)
    sent: list[Any] = []
    with caplog.at_level(logging.WARNING, logger="vllm.mooncake_kvaddr"):
        assert check.call("get_into", lambda *a: sent.append(a) or 0, ("k", 8000, 256), {}) == INVALID_PARAMS
    assert sent == [] and check.refused_keys == 1
    assert any("refused 1 key(s)" in r.getMessage() for r in caplog.records)


def test_a_ranged_read_needs_every_range_of_a_buffer_inside_and_counts_the_buffers_refused() -> None:
    """``get_into_ranges``: a buffer with one range inside and one past the registered range is refused whole
    (-600 for each of its ranges, not sent); the refused count is the buffers refused, not the ones sent."""
    sent: list[tuple[Any, ...]] = []

    def get_into_ranges(*args: Any) -> list[Any]:
        sent.append(args)
        return [[[7] * len(row) for row in sizes] for sizes in args[4]]

    guard = _armed_guard()  # [4096, 8192)
    args = (
        [4096, 4096, 4096],
        [["a"], ["b"], ["c"]],
        [[[0, 64]], [[0, 4090]], [[128]]],  # buffer 1: its second range runs past 8192
        [[[0, 0]], [[0, 0]], [[0]]],
        [[[64, 64]], [[64, 64]], [[64]]],
    )
    assert guard.call("get_into_ranges", get_into_ranges, args, {}) == [
        [[7, 7]], [[INVALID_PARAMS, INVALID_PARAMS]], [[7]]
    ]
    assert len(sent) == 1 and sent[0][1] == [["a"], ["c"]]
    assert guard.refused_keys == 1


@pytest.mark.parametrize("extra", ["scalar", "wrong_length"])
def test_a_split_parallel_put_passes_extras_it_cannot_cut_per_key_unchanged(extra: str) -> None:
    """A split ``batch_put_tensor_with_parallelism_from`` whose ``parallelisms`` is not one entry per key (a
    single value, or a list of another length) hands it on unchanged; only per-key lists are cut."""
    sent: list[tuple[Any, ...]] = []

    def put(*args: Any, **kwargs: Any) -> list[int]:
        sent.append(args)
        return [0] * len(args[0])

    guard = _armed_guard()
    parallelisms: Any = 4 if extra == "scalar" else [1, 2, 3]
    config = object()
    args = (["bad", "good"], [1 << 40, 4096], [64, 64], parallelisms, config, [[10], [20]])
    assert guard.call("batch_put_tensor_with_parallelism_from", put, args, {}) == [INVALID_PARAMS, 0]
    assert len(sent) == 1 and sent[0][3] is parallelisms and sent[0][4] is config
    assert [list(w) for w in sent[0][5]] == [[20]]


@pytest.mark.parametrize(
    ("ptrs", "sizes"), [([4096, 4160.5], [64, 64]), ([4096, True], [64, 64]), ([4096, 4160], [64, 64.0])]
)
def test_a_flat_list_with_one_value_that_is_no_plain_int_refuses_that_key(ptrs: list[Any], sizes: list[Any]) -> None:
    """A list of addresses or sizes is taken as int64 in bulk only when every value is a plain int: a float
    (which a bulk conversion would truncate into the registered range) or a bool refuses its own key."""
    check = _armed_guard()
    result = check.check_flat(["a", "b"], ptrs, sizes)
    assert result is not None and result.good == [0] and result.refused == 1


@pytest.mark.parametrize(
    ("signature", "pointers"),
    [
        ("batch_peek(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]", True),
        ("peek(self, key: str, buffer_ptr: int) -> int", True),
        ("peek(self, key: str, dst_pointer: int) -> int", True),
        ("peek_all(self, pointers: list[int]) -> int", True),
        ("get_size(self, key: str) -> int", False),
        ("is_exist(self, key: str) -> int\n\nbuffer_ptr: only in the text below the signature", False),
    ],
)
def test_a_pointer_parameter_in_the_signature_marks_a_method_as_taking_raw_pointers(
    signature: str, pointers: bool
) -> None:
    """``takes_pointers`` reads a (pybind11) method's signature line: a parameter named ``..._ptr``,
    ``..._ptrs``, ``..._pointer`` or ``..._pointers`` makes it a raw-pointer method (guarded, or warned about
    when the guard does not know it); other parameters and text past the signature do not."""

    def method() -> None:
        pass

    method.__doc__ = signature
    assert guard_module.takes_pointers(method) is pointers
