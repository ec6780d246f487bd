"""End to end with vLLM 0.33's own code (docs/vllm-plugin.md): the real ``KVCacheStoreSendingThread`` and
``KVCacheStoreRecvingThread`` store and load a request through a real Mooncake master with CPU torch KV
caches registered through vLLM's layout — without the plugin, with it, and with the staged transport —
and the loaded bytes are compared with the stored ones. Also: a load of keys that were never stored
reports vLLM's load error and writes nothing into the caches (no stale staging bytes)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from mooncake_kvaddr.integrations.vllm import layouts as vllm_layouts
from mooncake_kvaddr.integrations.vllm import plugin

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]


@pytest.fixture(scope="module")
def bench() -> Any:
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm==0.33.0)")
    pytest.importorskip("torch", reason="torch is not installed (comes with vLLM)")
    pytest.importorskip(plugin.WORKER_MODULE, reason="vLLM has no Mooncake store worker module")
    from mooncake_kvaddr.bench import vllm_plugin

    return vllm_plugin


@pytest.fixture(autouse=True)
def _unpatched() -> Iterator[None]:
    plugin.unpatch()
    yield
    plugin.unpatch()


@pytest.mark.parametrize(
    "mode",
    ["vllm", "plugin", "staged", "native", "staged_native", "native_fallback", "recv", "recv_staged", "recv_native"],
)
def test_store_then_load_with_vllms_threads(
    bench: Any, master: Any, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mooncake_kvaddr.driver.native_client import NativeClient

    if mode == "native_fallback":
        # No native client: every call goes to Mooncake's bound methods, with identical results.
        monkeypatch.setattr(NativeClient, "from_store", classmethod(lambda cls, store: None))
    native = "native" in mode
    staged = "staged" in mode
    shape = bench.RigShape(blocks=12, regions=6, region_bytes=2048)
    with bench.plugin_mode(mode if mode.startswith("recv") or mode == "vllm" else "plugin"):
        rig = bench.VllmStoreRig(master.rpc_address, shape, staged=staged, native=native,
                                 recv_threads=2, staging_bytes=1 << 20, model=f"e2e/{mode}")  # fmt: skip
        handler = rig._worker.KVCacheStoreRecvingThread._handle_request
        sender = rig._worker.KVCacheStoreSendingThread._handle_request
        assert hasattr(handler, "stats") == mode.startswith("recv") == hasattr(sender, "stats")
        fast = handler.stats.fast_requests if mode.startswith("recv") else 0
        stored = sender.stats.fast_requests if mode.startswith("recv") else 0
        try:
            if mode.endswith("native"):
                client, why = NativeClient.probe(rig.raw_store)
                if client is None:
                    pytest.skip(f"native Mooncake client unavailable here: {why}")
                client.close()
            hashes = rig.hashes(11, shape.blocks)
            rig.fill(3)
            expected = rig.snapshot()
            rig.store_request(f"store-{mode}", hashes)
            rig.zero()
            assert not rig.verify(expected)
            assert rig.load_requests([f"load-{mode}-a", f"load-{mode}-b"], hashes) == set()
            assert rig.verify(expected)
            if mode.startswith("recv"):  # the store and both loads planned by our handlers
                assert handler.stats.fast_requests == fast + 2
                assert sender.stats.fast_requests == stored + 1
            if staged:
                assert rig.store.stats.staged_puts >= 1 and rig.store.stats.staged_gets >= 2
                assert rig.store.stats.passthrough_gets == 0
            native_store = rig.store.wrapped if staged and native else rig.store
            if native:
                stats = native_store.stats
                if mode == "native_fallback":
                    assert native_store.native_client is None
                    assert stats.native_calls == 0 and stats.fallback_calls >= 3  # exist, put, gets
                else:
                    assert native_store.native_client is not None
                    assert stats.fallback_calls == 0 and stats.native_calls >= 3
            elif not staged:
                assert rig.store is rig.raw_store
            layout = rig.db.store_layout
            assert (vllm_layouts.ENGINE_ATTR in layout.__dict__) == (mode != "vllm")

            # Keys never stored: vLLM reports the blocks as failed, nothing is written into the caches.
            rig.zero()
            failed = rig.load_requests([f"missing-{mode}"], rig.hashes(99, shape.blocks))
            assert failed and failed <= set(rig.block_ids())
            assert all(not bool(cache.any()) for cache in rig.caches)
        finally:
            rig.close()


@pytest.mark.parametrize("mode", ["vllm", "recv_native", "recv_staged", "recv_staged_native", "recv_bound"])
def test_a_hybrid_model_with_group_semantics_stores_every_key(
    bench: Any, master: Any, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's ``"enable_group_semantics": "true"``: its send thread sets one group id per key on its
    ReplicateConfig and makes one put. A model of two groups with rows of different widths makes that put two
    puts through our wrappers (one per width): each must carry its own keys' group ids, or Mooncake answers -600
    for every key and the request's KV cache is never stored (issue #39). Stored, loaded, byte for byte."""
    from mooncake_kvaddr.driver.native_client import NativeClient

    if mode == "recv_bound":
        monkeypatch.setattr(NativeClient, "from_store", classmethod(lambda cls, store: None))
    shape = bench.RigShape(blocks=8, regions=6, region_bytes=2048)
    native = mode not in ("vllm", "recv_staged")
    with bench.plugin_mode("vllm" if mode == "vllm" else "recv"):
        rig = bench.VllmStoreRig(master.rpc_address, shape, staged="staged" in mode, native=native, groups=2,
                                 staging_bytes=1 << 20, model=f"e2e/groups-{mode}")  # fmt: skip
        try:
            rig.sender.enable_group_semantics = True
            rig.sender.supports_group_ids = True
            sender = rig._worker.KVCacheStoreSendingThread._handle_request
            stored = sender.stats.fast_requests if mode != "vllm" else 0
            hashes = rig.hashes(17, shape.blocks)
            rig.fill(7)
            expected = rig.snapshot()
            rig.store_request(f"groups-{mode}", hashes, timeout=30)
            if mode != "vllm":
                assert sender.stats.fast_requests == stored + 1  # our handler made the put
            rig.zero()
            assert rig.load_requests([f"groups-load-{mode}"], hashes) == set()
            assert rig.verify(expected)
        finally:
            rig.close()


@pytest.mark.parametrize(("first", "second"), [("vllm", "staged"), ("vllm", "native"), ("native", "staged_native")])
def test_objects_interoperate_between_modes(bench: Any, master: Any, first: str, second: str) -> None:
    """Stored by one mode, loaded through the other (and the other way): same bytes."""
    shape = bench.RigShape(blocks=6, regions=4, region_bytes=2048)
    model = f"e2e/interop-{first}-{second}"
    plain = bench.VllmStoreRig(master.rpc_address, shape, native=first == "native", model=model)
    staged = bench.VllmStoreRig(master.rpc_address, shape, staged=second.startswith("staged"),
                                native=second.endswith("native"), staging_bytes=1 << 20, model=model)  # fmt: skip
    try:
        plain.fill(21)
        expected = plain.snapshot()
        hashes = plain.hashes(31, shape.blocks)
        plain.store_request("interop-store", hashes)
        with bench.plugin_mode("plugin"):
            assert staged.load_requests(["interop-load"], hashes) == set()
        assert staged.verify(expected)
        staged.fill(22)
        expected = staged.snapshot()
        other = plain.hashes(32, shape.blocks)
        with bench.plugin_mode("plugin"):
            staged.store_request("interop-store-2", other)
        assert plain.load_requests(["interop-load-2"], other) == set()
        assert plain.verify(expected)
    finally:
        plain.close()
        staged.close()


def test_quick_bench_runs_and_bytes_match(bench: Any, master: Any) -> None:
    rows = bench.run(quick=True, reps=1, master_address=master.rpc_address)
    assert [row["mode"] for row in rows] == list(bench.MODES)
    for row in rows:
        assert row["bytes_ok"], row
        assert row["cpu_gil_ms"] > 0 and row["wall_4req_4thr_ms"] > 0


def test_quick_bench_over_tcp_between_processes_moves_the_bytes(bench: Any, master: Any) -> None:
    """``remote``: vLLM's worker holds no segment, a separate ``mooncake_client`` does (TCP between
    processes); the environment the run raises Mooncake's TCP limits in is restored afterwards."""
    import os

    before = {name: os.environ.get(name) for name in bench.REMOTE_TCP_ENV}
    rows = bench.run(quick=True, reps=1, master_address=master.rpc_address, modes=("vllm", "recv_staged"),
                     remote=True)  # fmt: skip
    assert [row["mode"] for row in rows] == ["vllm", "recv_staged"]
    for row in rows:
        assert row["remote"] and row["bytes_ok"], row
    assert {name: os.environ.get(name) for name in bench.REMOTE_TCP_ENV} == before


def test_offload_and_hybrid_loads_take_the_fast_path(bench: Any) -> None:
    """The receive-cases bench section on the quick request: a disk-offload budget that splits the load and a
    model with two groups of different row widths load the stored bytes exactly, vLLM alone and with the
    plugin, and the plugin's handler plans both itself (no request handed to vLLM's)."""
    from mooncake_kvaddr.bench import vllm_receive_cases

    rows = vllm_receive_cases.run(quick=True, reps=1)  # a master per rig (see run)
    assert [(row["case"], row["mode"]) for row in rows] == [
        (case, mode) for case in vllm_receive_cases.CASES for mode in vllm_receive_cases.MODES
    ]
    assert all(row["bytes_ok"] for row in rows)
    assert [row.get("recv_fallbacks") for row in rows] == [None, 0, None, 0]


def test_rig_group_split() -> None:
    from mooncake_kvaddr.bench.vllm_rig import _group_split

    assert _group_split(100, 1) == [(0, 100)]
    assert _group_split(100, 2) == [(0, 67), (67, 100)]
    assert _group_split(32, 2) == [(0, 22), (22, 32)]
    assert _group_split(3, 3) == [(0, 1), (1, 2), (2, 3)]
    assert _group_split(7, 3) == [(0, 5), (5, 6), (6, 7)]
    with pytest.raises(ValueError):
        _group_split(2, 3)
