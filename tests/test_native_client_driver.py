"""The native Mooncake client inside the driver (docs/native-client.md, "In the driver").

A store with the native client on must give the same codes and move the same bytes as one on the bound
methods, in every transfer mode and across the region-budget split; the env variable and the config flag turn
it off (same results); a closed store refuses calls before either client is reached.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvaddr_testing import Cache, assert_blocks_equal, hashes
from kvaddr_testing import make_transfer as transfer
from mooncake_kvaddr import StoreConfig
from mooncake_kvaddr.driver.native_client import ENV_VAR, NativeClient
from mooncake_kvaddr.driver.store import MooncakeStore, StoreClosedError
from mooncake_kvaddr.driver.transfer import TransferRequest

pytestmark = pytest.mark.mooncake


@pytest.fixture(scope="module")
def bound_store(store_config: StoreConfig) -> Iterator[MooncakeStore]:
    """A second client on the module's master with the native client off (the reference)."""
    with MooncakeStore(store_config, native_client=False) as client:
        yield client


@pytest.fixture(scope="module")
def native_store(store: MooncakeStore) -> MooncakeStore:
    """The shared store, which must have the native client on where the probe says it works."""
    assert store._client is not None
    probed, reason = NativeClient.probe(store._client)
    if probed is None:
        pytest.skip(f"native client unavailable here: {reason}")
    probed.close()
    assert store.native_client_active
    return store


class _HandleSpy:
    """Stands in for a native client's C++ handle: records each transfer call, forwards everything."""

    NAMES = ("batch_get_into_multi_buffers", "batch_put_from_multi_buffers", "batch_get_into", "batch_put_from")

    def __init__(self, handle: Any, seen: list[tuple[str, type, int]]) -> None:
        self._handle = handle
        self._seen = seen

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._handle, name)
        if name not in self.NAMES:
            return target

        def recorded(keys: Any, addrs: Any, *args: Any, **kwargs: Any) -> Any:
            self._seen.append((name, type(addrs), len(keys)))
            return target(keys, addrs, *args, **kwargs)

        return recorded


def _spy(store: MooncakeStore, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, type, int]]:
    """Record (method, type of the address argument, key count) of every native call the store makes (the
    native client hands out its C++ handle's methods, so the handle is what is watched)."""
    seen: list[tuple[str, type, int]] = []
    native = store._native
    assert native is not None
    monkeypatch.setattr(native, "_handle", _HandleSpy(native._handle, seen))
    return seen


def test_config_flag_and_property(store_config: StoreConfig, bound_store: MooncakeStore) -> None:
    assert not bound_store.native_client_active
    assert StoreConfig(embedded_master=True).native_client is True
    with pytest.raises(TypeError, match="native_client"):
        StoreConfig(embedded_master=True, native_client="yes")  # type: ignore[arg-type]
    assert not MooncakeStore(store_config).native_client_active  # not set up: no client at all


@pytest.mark.parametrize(("put_mode", "get_mode"), [("multi_buffer", "multi_buffer"), ("staged", "staged"),
                                                    ("multi_buffer", "staged"), ("staged", "multi_buffer")])
@pytest.mark.parametrize("native_writes", [True, False])
def test_bytes_identical_to_the_bound_path(
    native_store: MooncakeStore,
    bound_store: MooncakeStore,
    model: str,
    put_mode: str,
    get_mode: str,
    native_writes: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whichever client writes, the other reads the same bytes; both readers see the same results."""
    seen = _spy(native_store, monkeypatch)
    bs, chunks, regions = 16, 9, 5
    src = Cache(regions, chunks + 1, 333, seed=3)
    dst_n, dst_b = Cache(regions, chunks + 1, 333, fill=0xAB), Cache(regions, chunks + 1, 333, fill=0xAB)
    h = hashes(model, chunks)
    ids_src = list(range(1, chunks + 1))
    ids_dst = [4, 9, 1, 7, 3, 8, 2, 6, 5]
    writer_store = native_store if native_writes else bound_store
    with (
        transfer(writer_store, model, src, bs, transfer_mode=put_mode) as writer,
        transfer(native_store, model, dst_n, bs, transfer_mode=get_mode, tp_rank=3) as reader_n,
        transfer(bound_store, model, dst_b, bs, transfer_mode=get_mode, tp_rank=3) as reader_b,
    ):
        # Half the request first, so the readers also see missing keys (a partial hit).
        half = TransferRequest("r", 5 * bs, h[:5], [ids_src[:5]])
        assert writer.store(half).stored == 5
        full = TransferRequest("r", chunks * bs, h, [ids_dst])
        got_n, got_b = reader_n.load(full), reader_b.load(full)
        assert got_n.loaded_block_ids == got_b.loaded_block_ids == set(ids_dst[:5])
        assert got_n.bytes == got_b.bytes == 5 * regions * 333
        stored = writer.store(TransferRequest("r", chunks * bs, h, [ids_src]))
        assert stored.ok and stored.stored == chunks - 5
        got_n, got_b = reader_n.load(full), reader_b.load(full)
        assert got_n.ok and got_b.ok and got_n.loaded_block_ids == got_b.loaded_block_ids == set(ids_dst)
    assert_blocks_equal(src, ids_src, dst_n, ids_dst)
    assert_blocks_equal(dst_b, ids_dst, dst_n, ids_dst)
    assert (dst_n.regions[0][0] == 0xAB).all() and (dst_n.regions[0][0] == dst_b.regions[0][0]).all()
    # The native client carried the native store's calls; multi-buffer rows went as int64 matrices.
    assert seen
    for name, kind, _ in seen:
        if name.endswith("multi_buffers"):
            assert kind is np.ndarray


def _codes(store: MooncakeStore, keys: list[str], addrs: Any, sizes: Any) -> tuple[int, ...]:
    return store.batch_get_into_multi_buffers(keys, addrs, sizes).codes


def test_store_codes_identical_across_the_region_split(
    native_store: MooncakeStore, bound_store: MooncakeStore, store_config: StoreConfig
) -> None:
    """Success, missing, too-small (-600) and too-large (-800) rows, over several sub-batches: same codes."""
    tag = uuid.uuid4().hex[:8]
    n, regions, size = 12, 4, 100
    keys = [f"split-{tag}-{i}" for i in range(n)]
    src = np.random.default_rng(5).integers(0, 256, (n, regions * size), dtype=np.uint8)
    addrs = src.ctypes.data + np.arange(n * regions, dtype=np.int64).reshape(n, regions) * size
    sizes = np.full((n, regions), size, dtype=np.int64)
    stored = native_store.batch_put_from_multi_buffers(keys[:8], addrs[:8], sizes[:8])
    assert stored.ok
    with MooncakeStore(store_config, max_regions_per_batch=2 * regions + 1) as small:  # 2 keys per call
        assert small.native_client_active
        ask = sizes.copy()
        ask[1, 0] = size - 1  # smaller than the object
        ask[2, 3] = size + 7  # larger
        results = {}
        for name, who in (("native", native_store), ("bound", bound_store), ("split", small)):
            dst = np.zeros((n, regions * (size + 7)), dtype=np.uint8)
            d_addrs = dst.ctypes.data + np.arange(n * regions, dtype=np.int64).reshape(n, regions) * (size + 7)
            codes = _codes(who, keys, d_addrs, ask)
            rows = _codes(who, keys, d_addrs.tolist(), ask.tolist())  # list rows: the same codes
            assert codes == rows
            got = [bytes(dst[i].reshape(regions, size + 7)[:, :size].tobytes()) for i in (0, 3, 7)]
            results[name] = (codes, got)
        assert results["native"] == results["bound"] == results["split"]
        codes = results["native"][0]
        assert codes[0] == regions * size and codes[8] == codes[11] == -704
        assert codes[1] < 0 and codes[2] < 0
        assert results["native"][1][0] == src[0].tobytes()
    assert small.state == "closed"


def test_env_variable_turns_it_off_with_the_same_results(
    store_config: StoreConfig, native_store: MooncakeStore, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_VAR, "0")
    bs, chunks, regions = 16, 6, 3
    src = Cache(regions, chunks + 1, 500, seed=9)
    dst_off, dst_on = Cache(regions, chunks + 1, 500), Cache(regions, chunks + 1, 500)
    h = hashes(model, chunks)
    ids = list(range(1, chunks + 1))
    with MooncakeStore(store_config) as off:
        assert not off.native_client_active
        with (
            transfer(off, model, src, bs, transfer_mode="multi_buffer") as writer,
            transfer(off, model, dst_off, bs, transfer_mode="multi_buffer") as reader_off,
            transfer(native_store, model, dst_on, bs, transfer_mode="multi_buffer") as reader_on,
        ):
            assert writer.store(TransferRequest("r", chunks * bs, h, [ids])).stored == chunks
            a = reader_off.load(TransferRequest("r", chunks * bs, h, [ids]))
            b = reader_on.load(TransferRequest("r", chunks * bs, h, [ids]))
            assert a.ok and b.ok and a.loaded_block_ids == b.loaded_block_ids == set(ids) and a.bytes == b.bytes
    assert_blocks_equal(src, ids, dst_off, ids)
    assert_blocks_equal(src, ids, dst_on, ids)


def test_closed_store_refuses_and_closes_the_native_client(store_config: StoreConfig) -> None:
    store = MooncakeStore(store_config).setup()
    assert store.native_client_active
    native = store._native
    assert native is not None and not native.closed
    keys = [f"closed-{uuid.uuid4().hex[:8]}"]
    buf = np.zeros(64, dtype=np.uint8)
    addrs = np.array([[buf.ctypes.data]], dtype=np.int64)
    sizes = np.array([[64]], dtype=np.int64)
    assert store.batch_put_from_multi_buffers(keys, addrs, sizes).ok
    store.close()
    assert native.closed and not store.native_client_active
    for call in (
        lambda: store.batch_get_into_multi_buffers(keys, addrs, sizes),
        lambda: store.batch_put_from_multi_buffers(keys, addrs, sizes),
        lambda: store.batch_get_into(keys, [buf.ctypes.data], [64]),
        lambda: store.batch_is_exist(keys),
    ):
        with pytest.raises(StoreClosedError):
            call()
    with pytest.raises(RuntimeError):
        native.batch_is_exist(keys)  # the handle itself is closed too: never reaches Mooncake


def test_matrix_rows_are_checked_without_a_row_loop(native_store: MooncakeStore) -> None:
    """int64 matrices get the same argument errors as list rows, before either client is called."""
    keys = ["a", "b"]
    good = np.ones((2, 3), dtype=np.int64)
    with pytest.raises(ValueError, match="key 0: 3 addresses but 2 sizes"):
        native_store.batch_get_into_multi_buffers(keys, good, np.ones((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="no regions"):
        native_store.batch_get_into_multi_buffers(keys, good[:, :0], good[:, :0])
    with pytest.raises(ValueError, match=r"key 1: size \[2\] is negative"):
        bad = good.copy()
        bad[1, 2] = -1
        native_store.batch_put_from_multi_buffers(keys, good, bad)
    with pytest.raises(ValueError, match="2 keys but 1 address rows"):
        native_store.batch_get_into_multi_buffers(keys, good[:1], good[:1])


def test_a_failing_probe_never_breaks_setup(
    store_config: StoreConfig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(_client: Any) -> None:
        raise OSError("simulated probe failure")

    monkeypatch.setattr(NativeClient, "from_store", staticmethod(broken))
    with caplog.at_level("WARNING"), MooncakeStore(store_config) as store:
        assert not store.native_client_active
        assert store.batch_is_exist([f"probe-{uuid.uuid4().hex[:8]}"]).present == [False]
    assert "simulated probe failure" in caplog.text
