"""The worker's transport hook on vLLM 0.34 (docs/vllm-plugin.md, "How the transports are installed"): vLLM's own
``MooncakeStoreWorker``, built by its ``__init__`` with a recording store or a real Mooncake client on a loopback
master, registers its KV caches through our wrapper and hands it to its transfer threads; sleep mode's
``unregister_kv_caches``/``restore_kv_caches`` reach Mooncake through the wrapper, so the registered-range guard
refuses a released region (-600) until it is registered again; ``close`` closes the store once, through it."""

from __future__ import annotations

import json
import queue
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest

from mooncake_kvaddr.integrations.vllm import plugin

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_release("0.34")]

torch = pytest.importorskip("torch")
worker_module: Any = pytest.importorskip(plugin.WORKER_MODULE)

#: Mooncake's "invalid parameters", the guard's answer for a slice outside every registered buffer.
REFUSED = -600
BLOCKS = 4


@pytest.fixture
def patched(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.delenv(plugin.ENV_STAGED, raising=False)
    monkeypatch.delenv(plugin.ENV_NATIVE_CLIENT, raising=False)
    plugin.unpatch()
    report = plugin.patch(receive=False, lookup=False, send=False)
    assert report.active and report.staged_hook and report.hook_reason == "", report
    yield report
    plugin.unpatch()


class RecordingStore:
    """A Mooncake store that registers buffers, answers gets from nothing (-704) and records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.registered: dict[int, int] = {}
        self.setup_args: tuple[Any, ...] = ()

    def setup(self, *args: Any, **kwargs: Any) -> int:
        self.setup_args = args
        return 0

    def register_buffer(self, addr: int, size: int) -> int:
        self.calls.append(("register_buffer", addr, size))
        self.registered[addr] = size
        return 0

    def unregister_buffer(self, addr: int) -> int:
        self.calls.append(("unregister_buffer", addr))
        return 0 if self.registered.pop(addr, None) is not None else -1

    def batch_get_into_multi_buffers(self, keys: list[str], addrs: Any, sizes: Any) -> list[int]:
        self.calls.append(("batch_get_into_multi_buffers", list(keys)))
        return [-704 for _ in keys]

    def batch_get_into(self, keys: list[str], addrs: Any, sizes: Any) -> list[int]:
        self.calls.append(("batch_get_into", list(keys)))
        return [-704 for _ in keys]

    def close(self) -> int:
        self.calls.append(("close",))
        return 0


def _vllm_config(extra: dict[str, Any]) -> Any:
    """What ``MooncakeStoreWorker.__init__`` reads of a VllmConfig (one rank, one full-attention group)."""
    ns = types.SimpleNamespace
    model = ns(model="org/worker034", use_mla=False, enable_sleep_mode=True, enable_cumem_allocator=False,
               get_num_layers=lambda parallel: 1, get_total_num_kv_heads=lambda: 1)  # fmt: skip
    cache = ns(block_size=16, num_gpu_blocks=BLOCKS, enable_prefix_caching=True, prefix_match_unit=None)
    cache.get_resolved_kv_cache_layout = lambda: None
    transfer = ns(kv_role="kv_both", kv_connector_extra_config=extra)
    transfer.get_from_extra_config = lambda key, default: extra.get(key, default)
    return ns(
        model_config=model,
        parallel_config=ns(pipeline_parallel_size=1, tensor_parallel_size=1, rank=1, data_parallel_index=0,
                           decode_context_parallel_size=1, prefill_context_parallel_size=1),
        kv_transfer_config=transfer,
        cache_config=cache,
        scheduler_config=ns(disable_hybrid_kv_cache_manager=True),
        kv_events_config=ns(enable_kv_cache_events=False),
        speculative_config=None,
        num_hash_lookahead_tokens=0,
    )  # fmt: skip


def _kv_cache_config() -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16)
    return KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)])


def _build_worker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, store: Any, master: str,
                  extra: dict[str, Any] | None = None) -> Any:  # fmt: skip
    """vLLM 0.34's ``MooncakeStoreWorker(vllm_config, kv_cache_config)`` with ``store`` as the
    ``MooncakeDistributedStore`` it creates (None: Mooncake's real class, set up against ``master``)."""
    if store is not None:
        fake = types.ModuleType("mooncake.store")
        fake.MooncakeDistributedStore = lambda: store  # type: ignore[attr-defined]
        fake.ReplicateConfig = type("ReplicateConfig", (), {"preferred_segment": ""})  # type: ignore[attr-defined]
        package = types.ModuleType("mooncake")
        package.store = fake  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "mooncake", package)
        monkeypatch.setitem(sys.modules, "mooncake.store", fake)
    config = {"metadata_server": "P2PHANDSHAKE", "master_server_address": master, "protocol": "tcp",
              "device_name": "", "global_segment_size": 16 << 20, "local_buffer_size": 4 << 20}  # fmt: skip
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(config))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    group = types.SimpleNamespace(world_size=1, rank_in_group=0)
    for name, value in (("get_tensor_model_parallel_rank", lambda: 0),
                        ("get_tensor_model_parallel_world_size", lambda: 1),
                        ("get_pcp_group", lambda: group), ("get_dcp_group", lambda: group),
                        ("get_ip", lambda: "127.0.0.1")):  # fmt: skip
        monkeypatch.setattr(worker_module, name, value)
    return worker_module.MooncakeStoreWorker(_vllm_config(extra or {}), _kv_cache_config())


def _register(worker: Any, caches: dict[str, Any]) -> tuple[mock.MagicMock, mock.MagicMock]:
    """``register_kv_caches`` with vLLM's transfer threads replaced by mocks recording what they were given."""

    def thread(*args: Any, **kwargs: Any) -> Any:
        for value in (*args, *kwargs.values()):
            if hasattr(value, "wait") and hasattr(value, "set"):
                value.set()
        return mock.MagicMock(request_queue=queue.Queue())  # nothing in flight: close does not wait

    with (
        mock.patch.object(worker_module, "KVCacheStoreSendingThread", side_effect=thread) as send,
        mock.patch.object(worker_module, "KVCacheStoreRecvingThread", side_effect=thread) as recv,
    ):
        worker.register_kv_caches(caches)
    return send, recv


def _caches() -> dict[str, Any]:
    return {"layer0": torch.zeros(BLOCKS, 2, 16, 8, dtype=torch.float16)}


def test_the_hook_wraps_exactly_the_release_methods(patched: Any) -> None:
    """On 0.34 the worker part is ported: register, sleep mode's two methods and close are wrapped (vLLM's
    functions kept as ``__wrapped__``) and unpatching puts vLLM's back."""
    from mooncake_kvaddr.integrations.vllm.releases import v0_34

    cls = worker_module.MooncakeStoreWorker
    assert "worker" in v0_34.RELEASE.ported and "worker" in v0_34.FINGERPRINTED
    originals = {}
    for name in ("__init__", *v0_34.WORKER_METHODS):
        wrapper = cls.__dict__[name]
        assert wrapper.__qualname__ == f"MooncakeStoreWorker.{name}"
        originals[name] = wrapper.__wrapped__
    plugin.unpatch()
    assert all(cls.__dict__[name] is original for name, original in originals.items())


def test_fake_store_register_sleep_wake_close(patched: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from mooncake_kvaddr.driver.store import StoreClosedError
    from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore

    raw = RecordingStore()
    worker = _build_worker(monkeypatch, tmp_path, raw, "127.0.0.1:1")
    assert worker.store is raw and raw.setup_args[0] == "127.0.0.1"
    caches = _caches()
    send, recv = _register(worker, caches)
    addr = caches["layer0"].untyped_storage().data_ptr()
    size = caches["layer0"].untyped_storage().nbytes()
    assert worker.store is raw  # vLLM's own object again after the call
    transport = send.call_args.args[0]
    assert isinstance(transport, NativeMooncakeStore) and transport.wrapped is raw
    assert recv.call_count >= 1 and all(call.args[0] is transport for call in recv.call_args_list)
    assert raw.calls == [("register_buffer", addr, size)]
    assert transport.ranges.armed and worker._device_regions == {addr: size}

    def get() -> list[int]:
        result: list[int] = transport.batch_get_into_multi_buffers(["k"], [[addr]], [[64]])
        return result

    assert get() == [-704] and raw.calls[-1] == ("batch_get_into_multi_buffers", ["k"])
    raw.calls.clear()
    worker.unregister_kv_caches()  # sleep: the region leaves Mooncake and the guard's table
    assert raw.calls == [("unregister_buffer", addr)] and worker.store is raw
    assert get() == [REFUSED] and raw.calls == [("unregister_buffer", addr)]  # refused, never sent
    worker.unregister_kv_caches()  # asleep already: nothing to do
    assert raw.calls == [("unregister_buffer", addr)]
    worker.restore_kv_caches()  # wake: the same region again
    assert raw.calls[-1] == ("register_buffer", addr, size) and worker.store is raw
    assert get() == [-704] and raw.calls[-1] == ("batch_get_into_multi_buffers", ["k"])
    raw.calls.clear()
    worker.close()
    worker.close()
    assert raw.calls == [("close",)] and worker.store is None
    with pytest.raises(StoreClosedError):
        get()


def test_without_the_hooks_store_sleep_mode_is_vllms(patched: Any, monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:  # fmt: skip
    """A worker whose store was replaced after registration (not the one our wrapper wraps): sleep mode and
    close act on that store, as vLLM alone does, and never on the wrapper."""
    raw = RecordingStore()
    worker = _build_worker(monkeypatch, tmp_path, raw, "127.0.0.1:1")
    caches = _caches()
    send, _ = _register(worker, caches)
    transport = send.call_args.args[0]
    other = RecordingStore()
    other.registered = dict(raw.registered)
    worker.store = other
    worker.unregister_kv_caches()
    worker.restore_kv_caches()
    worker.close()
    addr = caches["layer0"].untyped_storage().data_ptr()
    assert [c[0] for c in other.calls] == ["unregister_buffer", "register_buffer", "close"]
    assert raw.calls == [("register_buffer", addr, raw.registered[addr])]
    assert transport.ranges.ranges.all_inside(np.array([[addr]], np.int64), np.array([[64]], np.int64))


def test_staged_transport_follows_sleep_mode(patched: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With the staged transport (host caches) around the native wrapper, sleep mode's calls go through the
    outer wrapper, and both guards follow."""
    from mooncake_kvaddr.integrations.vllm.staged_store import StagedMooncakeStore

    raw = RecordingStore()
    worker = _build_worker(monkeypatch, tmp_path, raw, "127.0.0.1:1",
                           {"mooncake_kvaddr_staged": True, "mooncake_kvaddr_staging_bytes": 1 << 16})  # fmt: skip
    caches = _caches()
    send, _ = _register(worker, caches)
    transport = send.call_args.args[0]
    assert isinstance(transport, StagedMooncakeStore)
    addr = caches["layer0"].untyped_storage().data_ptr()
    worker.unregister_kv_caches()
    assert transport.batch_get_into_multi_buffers(["k"], [[addr]], [[64]]) == [REFUSED]
    assert transport.wrapped.batch_get_into_multi_buffers(["k"], [[addr]], [[64]]) == [REFUSED]
    assert not any(c[0].startswith("batch_get_into") for c in raw.calls)
    worker.restore_kv_caches()
    assert transport.batch_get_into_multi_buffers(["k"], [[addr]], [[64]]) == [-704]
    assert any(c[0].startswith("batch_get_into") for c in raw.calls)
    worker.close()
    assert raw.calls[-1] == ("close",) and sum(c == ("close",) for c in raw.calls) == 1


@pytest.mark.mooncake
def test_real_mooncake_register_sleep_wake_close(patched: Any, master: Any, monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:  # fmt: skip
    """vLLM's worker sets up a real Mooncake client on the loopback master; an object put from the registered
    cache is read back through the wrapper, refused (-600) while asleep, and read back again after waking."""
    from mooncake_kvaddr.driver.store import StoreClosedError

    worker = _build_worker(monkeypatch, tmp_path, None, master.rpc_address)
    raw = worker.store
    caches = _caches()
    send, _ = _register(worker, caches)
    transport = send.call_args.args[0]
    assert transport.wrapped is raw and worker.store is raw
    tensor = caches["layer0"]
    addr, block = tensor.data_ptr(), tensor[0].nbytes
    tensor[0].fill_(3)
    key = f"worker034-{tmp_path.name}"
    try:
        assert transport.batch_put_from_multi_buffers([key], [[addr]], [[block]], worker.store_replicate_config) == [0]
        tensor[0].zero_()
        assert transport.batch_get_into_multi_buffers([key], [[addr]], [[block]]) == [block]
        assert bool((tensor[0] == 3).all())
        worker.unregister_kv_caches()
        tensor[0].zero_()
        assert transport.batch_get_into_multi_buffers([key], [[addr]], [[block]]) == [REFUSED]
        assert not bool(tensor[0].any())
        worker.restore_kv_caches()
        assert transport.batch_get_into_multi_buffers([key], [[addr]], [[block]]) == [block]
        assert bool((tensor[0] == 3).all())
    finally:
        worker.close()
    assert worker.store is None
    with pytest.raises(StoreClosedError):
        transport.batch_get_into_multi_buffers([key], [[addr]], [[block]])


@pytest.mark.parametrize("change", ["params", "missing"])
def test_a_worker_whose_sleep_methods_differ_keeps_vllms(change: str) -> None:
    """A ``MooncakeStoreWorker`` whose ``restore_kv_caches`` takes other parameters (or has none) gets no hook:
    the report says why, and no method of it is wrapped."""
    restore = (lambda self, force: None) if change == "params" else None
    changed = type("MooncakeStoreWorker", (worker_module.MooncakeStoreWorker,), {"restore_kv_caches": restore})
    fake = types.ModuleType(worker_module.__name__)
    fake.__dict__.update({k: v for k, v in vars(worker_module).items() if not k.startswith("__")})
    fake.MooncakeStoreWorker = changed  # type: ignore[attr-defined]
    plugin.unpatch()
    try:
        report = plugin.patch(worker=fake, receive=False, lookup=False, send=False)
        assert report.active and not report.staged_hook
        expected = "takes ('force',), expected ()" if change == "params" else "restore_kv_caches is missing"
        assert report.hook_reason.startswith("unexpected shape: MooncakeStoreWorker.restore_kv_caches")
        assert expected in report.hook_reason
        assert not any(hasattr(changed.__dict__.get(name), "__wrapped__") for name in vars(changed))
        assert "register_kv_caches" not in changed.__dict__
    finally:
        plugin.unpatch()
