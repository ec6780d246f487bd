"""What a user of the driver API meets with arguments of the wrong type: a clear exception naming the argument,
never a transfer that accepts it and then fails every request, or a message about some other name."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fake_mooncake import fake_store
from kvaddr_testing import Cache, hashes
from kvaddr_testing import make_transfer as transfer
from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata
from mooncake_kvaddr.driver.staging import StagingBuffer, StagingPool
from mooncake_kvaddr.driver.store import MooncakeStore
from mooncake_kvaddr.driver.transfer import KVTransfer, TransferRequest
from mooncake_kvaddr.integrations.vllm import data as M


def _db() -> ChunkedTokenDatabase:
    return ChunkedTokenDatabase(KeyMetadata("m", 0, 0, 0, 0), 16)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"tp_rank": 1.5}, TypeError, "tp_rank"),
        ({"tp_rank": "1"}, TypeError, "tp_rank"),
        ({"tp_rank": True}, TypeError, "tp_rank"),
        ({"num_recv_threads": "2"}, TypeError, "num_recv_threads"),
        ({"num_recv_threads": 2.0}, TypeError, "num_recv_threads"),
        ({"num_recv_threads": True}, TypeError, "num_recv_threads"),
        ({"disk_offload_buffer_budget_bytes": "1GB"}, TypeError, "disk_offload_buffer_budget_bytes"),
        ({"disk_offload_buffer_budget_bytes": 1.5}, TypeError, "disk_offload_buffer_budget_bytes"),
        ({"disk_offload_usable_ratio": "0.5"}, TypeError, "disk_offload_usable_ratio"),
        ({"disk_offload_usable_ratio": True}, TypeError, "disk_offload_usable_ratio"),
        ({"start_threads": "no"}, TypeError, "start_threads"),
    ],
)
def test_kvtransfer_refuses_an_argument_of_the_wrong_type_by_name(
    kwargs: dict[str, Any], error: type, name: str
) -> None:
    """tp_rank=1.5 was accepted and then failed every load ('slice indices must be integers'); "1" or "2" raised
    a comparison TypeError naming nothing; start_threads="no" started the threads."""
    store = MooncakeStore(master_server_address="127.0.0.1:1")
    with pytest.raises(error, match=name):
        KVTransfer(store, [_db()], **{"start_threads": False, **kwargs})


def test_kvtransfer_takes_numpy_integers_as_ints() -> None:
    store = MooncakeStore(master_server_address="127.0.0.1:1")
    xfer = KVTransfer(store, [_db()], tp_rank=np.int64(3), num_recv_threads=np.int32(2),
                      disk_offload_buffer_budget_bytes=np.int64(4096), start_threads=False)
    try:
        assert xfer.tp_rank == 3 and type(xfer.tp_rank) is int
        assert xfer.disk_offload_buffer_budget_bytes == 4096
    finally:
        xfer.close()


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"token_len": "48"}, "token_len"),
        ({"token_len": True}, "token_len"),
        ({"skip_tokens": "16"}, "skip_tokens"),
        ({"skip_tokens": 16.0}, "skip_tokens"),
        ({"block_ids": None}, "block_ids"),
    ],
)
def test_a_request_field_of_the_wrong_type_is_named(monkeypatch: pytest.MonkeyPatch, fields: dict[str, Any],
                                                    name: str) -> None:
    """A store raises TypeError naming the field (it said "unsupported operand type(s) for //", "mask_num must be
    an int" or "object of type 'NoneType' has no len()", and token_len=True stored nothing without a word); a load
    reports the same TypeError in ``error``."""
    with fake_store(monkeypatch) as (store, _fake):
        cache = Cache(2, 5, 256, seed=1)
        with transfer(store, "m", cache, 16, transfer_mode="multi_buffer", start_threads=False) as xfer:
            request = TransferRequest(**{"req_id": "r", "token_len": 48, "block_hashes": hashes("m", 3),
                                         "block_ids": [[1, 2, 3]], **fields})
            with pytest.raises(TypeError, match=f"^{name}: "):
                xfer.store(request)
            loaded = xfer.load(request)
    assert loaded.error is not None and loaded.error.startswith(f"TypeError: {name}: ") and not loaded.ok


def test_numpy_integer_request_fields_give_plain_int_results(monkeypatch: pytest.MonkeyPatch) -> None:
    with fake_store(monkeypatch) as (store, _fake):
        cache = Cache(2, 5, 256, seed=1)
        with transfer(store, "m", cache, 16, transfer_mode="multi_buffer", start_threads=False) as xfer:
            stored = xfer.store(TransferRequest("r", np.int64(48), hashes("m", 3), [[1, 2, 3]],
                                                skip_tokens=np.int32(0)))
    assert stored.stored == 3 and stored.saved_tokens == 48 and type(stored.saved_tokens) is int


def test_a_numpy_integer_tail_boundary_group_is_that_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """``(np.int64(0), 16)`` was refused with "group_id 0 is not one of the 1 KV-cache groups" while a numpy
    num_tokens was taken; a bool group stays refused."""
    with fake_store(monkeypatch) as (store, _fake):
        db = M.ChunkedTokenDatabase(M.KeyMetadata("tail", 0, 0, 0, 0), 8, 4)
        caches = [np.zeros((8, 24), np.float32) for _ in range(2)]
        h = hashes("tail", 4)
        with KVTransfer(store, [db], transfer_mode="multi_buffer", start_threads=False) as xfer:
            xfer.register_kv_caches(caches, 8)
            assert xfer.store(TransferRequest("t", 16, h, [[1, 2]])).stored == 2
            plain = xfer.load(TransferRequest("t", 16, h, [[3, 4]], tail_key_boundaries=[(0, 16)]))
            numpy = xfer.load(TransferRequest("t", 16, h, [[5, 6]], tail_key_boundaries=[(np.int64(0), 16)]))
            assert plain.ok and numpy.ok and numpy.loaded_block_ids == {5, 6}
            with pytest.raises(ValueError, match="group_id True"):
                xfer.load(TransferRequest("t", 16, h, [[5, 6]], tail_key_boundaries=[(True, 16)]))


@pytest.mark.parametrize("cls", [StagingBuffer, StagingPool])
@pytest.mark.parametrize("nbytes", ["1GB", None, 4096.5, True])
def test_a_staging_size_of_the_wrong_type_is_refused_by_name(cls: type, nbytes: Any) -> None:
    """StagingBuffer("1GB") raised "'<' not supported between instances of 'str' and 'int'", 4096.5 a numpy
    message about '8192.5', and True made a one-byte buffer."""
    with pytest.raises(TypeError, match=r"^nbytes: expected int"):
        cls(nbytes)


def test_a_numpy_staging_size_is_that_size() -> None:
    assert StagingBuffer(np.int64(4096)).nbytes == 4096
    assert StagingPool(np.int32(8192)).buffer.nbytes == 8192
