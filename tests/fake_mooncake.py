"""An in-memory stand-in for Mooncake's ``MooncakeDistributedStore``, with a fake clock and a hung peer.

Objects live in a dict; bytes move with ``ctypes`` between the addresses the driver passes, so a
:class:`~mooncake_kvaddr.driver.transfer.KVTransfer` over a :class:`~mooncake_kvaddr.driver.store.MooncakeStore`
on this client moves real bytes without the Mooncake wheel. Time is a :class:`FakeClock` that each transfer
call advances: :func:`fake_store` installs it as the driver's clock, so a test can make a call "take" 60 s
(Mooncake's transfer timeout against a hung peer) in no time at all.

The result codes follow Mooncake's (docs/configuration.md): put 0, get bytes read, ``-704`` not found,
``-600`` destination smaller than the object, ``-800`` destination larger / transfer failed.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest

from mooncake_kvaddr.driver import store as store_module
from mooncake_kvaddr.driver import store_calls, store_setup
from mooncake_kvaddr.driver.store import MooncakeStore

#: Mooncake's fixed transfer timeout against a peer that hangs (docs/multihost.md).
HUNG_CALL_S = 60.0
TRANSFER_CALLS = ("batch_get_into", "batch_put_from", "batch_get_into_multi_buffers", "batch_put_from_multi_buffers")


class FakeClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeMooncake:
    """The client. ``call_seconds``: fake seconds every transfer call takes. ``hang_from``: transfer call
    number (1-based) from which every call hangs: it takes :data:`HUNG_CALL_S` and fails every key ``-800``
    without moving a byte. ``fail_fast``: every transfer call fails ``-800`` at once (1 fake second).
    ``exist_seconds``: fake seconds every ``batch_is_exist`` takes. ``short_reads``: keys whose gets answer one
    byte less than they copied."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.objects: dict[str, bytes] = {}
        self.calls: list[tuple[str, int]] = []  # (method, keys) of every transfer call
        self.call_seconds = 0.0
        self.hang_from: int | None = None
        self.fail_fast = False
        self.exist_seconds = 0.0
        #: Keys whose gets copy every byte but answer one byte less (a short read: never counted as loaded).
        self.short_reads: set[str] = set()

    # ------------------------------------------------------------------ lifecycle and odds and ends

    def setup(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def close(self) -> int:
        return 0

    def register_buffer(self, ptr: int, size: int) -> int:
        return 0

    def unregister_buffer(self, ptr: int) -> int:
        return 0

    def health_check(self) -> int:
        return 0

    def remove_all(self, force: bool) -> int:
        n = len(self.objects)
        self.objects.clear()
        return n

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        self.clock.advance(self.exist_seconds)
        return [1 if k in self.objects else 0 for k in keys]

    # ------------------------------------------------------------------ transfers

    def transfer_calls(self) -> list[int]:
        """Key counts of the transfer calls so far."""
        return [n for _, n in self.calls]

    def _failed(self, name: str, keys: Sequence[str]) -> bool:
        """Record the call and advance the clock; whether it fails every key (-800) without moving bytes."""
        self.calls.append((name, len(keys)))
        if self.hang_from is not None and len(self.calls) >= self.hang_from:
            self.clock.advance(HUNG_CALL_S)
            return True
        if self.fail_fast:
            self.clock.advance(1.0)
            return True
        self.clock.advance(self.call_seconds)
        return False

    def _put(self, key: str, data: bytes) -> int:
        self.objects.setdefault(key, data)  # first write wins
        return 0

    def _get(self, key: str, regions: Sequence[tuple[int, int]]) -> int:
        data = self.objects.get(key)
        if data is None:
            return -704
        total = sum(size for _, size in regions)
        if total < len(data):
            return -600
        if total > len(data):
            return -800
        offset = 0
        for address, size in regions:
            ctypes.memmove(address, data[offset : offset + size], size)
            offset += size
        return len(data) - 1 if key in self.short_reads else len(data)

    def batch_put_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], config: Any) -> list[int]:
        if self._failed("batch_put_from", keys):
            return [-800] * len(keys)
        return [self._put(k, ctypes.string_at(p, s)) for k, p, s in zip(keys, ptrs, sizes, strict=True)]

    def batch_get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        if self._failed("batch_get_into", keys):
            return [-800] * len(keys)
        return [self._get(k, [(p, s)]) for k, p, s in zip(keys, ptrs, sizes, strict=True)]

    def batch_put_from_multi_buffers(
        self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]], config: Any
    ) -> list[int]:
        if self._failed("batch_put_from_multi_buffers", keys):
            return [-800] * len(keys)
        return [
            self._put(k, b"".join(ctypes.string_at(a, s) for a, s in zip(row_a, row_s, strict=True)))
            for k, row_a, row_s in zip(keys, addrs, sizes, strict=True)
        ]

    def batch_get_into_multi_buffers(
        self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        if not keys:
            return []
        if self._failed("batch_get_into_multi_buffers", keys):
            return [-800] * len(keys)
        rows = zip(keys, addrs, sizes, strict=True)
        return [self._get(k, list(zip(row_a, row_s, strict=True))) for k, row_a, row_s in rows]


def install_fake_module(monkeypatch: pytest.MonkeyPatch, module: Any) -> None:
    """Make ``MooncakeStore.setup`` use ``module`` as Mooncake's, against a master nobody has to start: the
    wait for an external master (``store_setup.wait_for_master``) returns at once."""
    monkeypatch.setattr(store_module, "load_mooncake", lambda: module)
    monkeypatch.setattr(store_setup, "wait_for_master", lambda config, address: None)


@contextmanager
def fake_store(monkeypatch: pytest.MonkeyPatch, **config: Any) -> Iterator[tuple[MooncakeStore, FakeMooncake]]:
    """A ready :class:`MooncakeStore` on a :class:`FakeMooncake` whose clock is the driver's clock."""
    clock = FakeClock()
    client = FakeMooncake(clock)
    module = SimpleNamespace(MooncakeDistributedStore=lambda: client, ReplicateConfig=lambda: None)
    install_fake_module(monkeypatch, module)
    monkeypatch.setattr(store_calls, "_now", clock)
    config.setdefault("master_server_address", "127.0.0.1:1")
    with MooncakeStore(**config) as store:
        yield store, client
