"""Per-key fields of Mooncake's ``ReplicateConfig`` (group ids) travel with their keys wherever a put is split or
filtered (issue #39; docs/native-client.md, "Per-key config fields").

Mooncake answers -600 for every key of a put whose group ids are not one per key. On a real master, with vLLM's
group semantics (one group id per key), every split kind stores every key and hands each part exactly its own
keys' ids: the driver's region-budget sub-batches and staged transfer rounds, the wrappers' one put per row width,
the range guard's kept keys (in Python and in the native client's C++) and the staged wrapper's staging rounds.
The routine itself (:func:`~mooncake_kvaddr.driver.per_key.config_for`) is checked without Mooncake too.
"""

from __future__ import annotations

import ctypes
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kvaddr_testing import Cache, assert_blocks_equal, hashes, make_transfer
from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata
from mooncake_kvaddr.driver import per_key
from mooncake_kvaddr.driver.master import EmbeddedMaster
from mooncake_kvaddr.driver.native_client import NativeClient
from mooncake_kvaddr.driver.staging import StagingBuffer, StagingPool
from mooncake_kvaddr.driver.store import MooncakeStore
from mooncake_kvaddr.driver.transfer import TransferRequest
from mooncake_kvaddr.integrations.vllm.guard import INVALID_PARAMS
from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore
from mooncake_kvaddr.integrations.vllm.plans import ArrayStore
from mooncake_kvaddr.integrations.vllm.staged_store import StagedMooncakeStore

mooncake = pytest.mark.mooncake
KINDS = ("native", "bound", "staged", "staged_native")


# --- helpers ---------------------------------------------------------------------------------------------------


def _config(ids: list[str] | None) -> Any:
    import mooncake.store as ms

    config = ms.ReplicateConfig()
    config.replica_num = 1
    if ids is not None:
        config.group_ids = ids
    return config


@dataclass
class Cut:
    """One call of the routine: the picked indices of a put of ``n`` keys, and the part's group ids."""

    picks: list[int]
    n: int
    ids: list[str] | None


@pytest.fixture
def cuts(monkeypatch: pytest.MonkeyPatch) -> list[Cut]:
    """Every :func:`per_key.config_for` call during the test (the Python splits and the native client's C++
    helper both look it up when they call it)."""
    seen: list[Cut] = []
    real = per_key.config_for

    def recording(config: Any, picks: Any, n: int) -> Any:
        part = real(config, picks, n)
        ids = getattr(part, "group_ids", None)
        seen.append(Cut(list(picks), n, None if ids is None else list(ids)))
        return part

    monkeypatch.setattr(per_key, "config_for", recording)
    return seen


def _raw_store(master: EmbeddedMaster) -> Any:
    import mooncake.store as ms

    store = ms.MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", master.rpc_address) == 0
    return store


def _wrap(kind: str, raw: Any, monkeypatch: pytest.MonkeyPatch, staging_bytes: int = 1 << 20) -> Any:
    if kind == "bound":
        monkeypatch.setattr(NativeClient, "from_store", classmethod(lambda cls, store: None))
    if kind in ("native", "bound"):
        return NativeMooncakeStore(raw, armed=True)
    inner = raw if kind == "staged" else NativeMooncakeStore(raw, armed=True)
    return StagedMooncakeStore(inner, staging_bytes=staging_bytes, armed=True)


class Rig:
    """A fresh Mooncake client wrapped as ``kind``, a registered cache of random bytes and one never registered."""

    def __init__(self, kind: str, master: EmbeddedMaster, monkeypatch: pytest.MonkeyPatch, staging: int) -> None:
        self.raw = _raw_store(master)
        self.store = _wrap(kind, self.raw, monkeypatch, staging)
        self.cache = StagingBuffer(64 << 10)
        self.outside = StagingBuffer(4 << 10)
        rng = np.random.default_rng(3)
        self.cache.array[:] = rng.integers(0, 255, self.cache.nbytes, dtype=np.uint8)
        assert self.store.register_buffer(self.cache.ptr, self.cache.nbytes) == 0
        self.tag = f"{kind}-{uuid.uuid4().hex[:10]}"

    def keys(self, n: int) -> list[str]:
        return [f"perkey-{self.tag}-{i}" for i in range(n)]

    def rows(self, n: int, width: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        """(n, width) int64 matrices of disjoint ``size``-byte slices of the cache."""
        at = self.cache.ptr + np.arange(n * width, dtype=np.int64).reshape(n, width) * size
        return at, np.full((n, width), size, dtype=np.int64)

    def stored(self, key: str, addrs: Any, sizes: Any) -> bool:
        """True when ``key`` holds the bytes of its slices, in order."""
        want = b"".join(ctypes.string_at(int(a), int(s)) for a, s in zip(addrs, sizes, strict=True))
        return bool(self.raw.is_exist(key) == 1) and self.raw.get(key) == want

    def close(self) -> None:
        self.store.close()


@pytest.fixture
def rigs(master: EmbeddedMaster, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Rig]]:
    made: list[Rig] = []

    def make(kind: str, staging: int = 1 << 20) -> Rig:
        rig = Rig(kind, master, monkeypatch, staging)
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.close()


def _ids(keys: list[str]) -> list[str]:
    return [f"group-of-{key}" for key in keys]


# --- the routine -------------------------------------------------------------------------------------------------


class _Plain:
    def __init__(self) -> None:
        self.group_ids: list[str] | None = None
        self.replica_num = 1


def test_the_table_names_the_group_ids() -> None:
    assert per_key.PER_KEY_CONFIG_FIELDS == ("group_ids",)


def test_a_config_without_per_key_values_or_a_whole_part_is_passed_as_is() -> None:
    plain = _Plain()
    assert per_key.config_for(plain, [1], 3) is plain  # group ids unset
    assert per_key.config_for(None, [0], 2) is None
    assert per_key.config_for(object(), [0], 2) is not None  # no such field at all: as is
    plain.group_ids = ["a", "b", "c"]
    assert per_key.config_for(plain, [0, 1, 2], 3) is plain
    assert per_key.config_for(plain, range(3), 3) is plain
    assert per_key.configs_for((), [0], 3) == ()


def test_a_part_gets_a_copy_with_its_own_keys_values_in_its_order() -> None:
    plain = _Plain()
    plain.group_ids = ["a", "b", "c", "d"]
    plain.replica_num = 3
    part = per_key.config_for(plain, [3, 1], 4)
    assert part is not plain and part.group_ids == ["d", "b"] and part.replica_num == 3
    assert plain.group_ids == ["a", "b", "c", "d"]  # the caller's config unchanged
    (again,) = per_key.configs_for((plain,), range(1, 3), 4)
    assert again.group_ids == ["b", "c"]


def test_values_not_one_per_key_stay_wrong_in_every_part() -> None:
    """Mooncake refuses the whole call then (-600 for every key): each part must be refused too, even a part
    whose key count happens to equal the number of values."""
    plain = _Plain()
    plain.group_ids = ["a", "b"]
    assert per_key.config_for(plain, [0], 5).group_ids == ["a", "b"]
    assert per_key.config_for(plain, [0, 4], 5).group_ids == ["a", "b", "b"]
    plain.group_ids = []
    assert per_key.config_for(plain, [1, 2], 3).group_ids == []
    for size in (1, 2, 3):
        plain.group_ids = ["x"] * size
        for picks in ([0], [0, 1], [0, 1, 2]):
            part = per_key.config_for(plain, picks, 4)
            assert len(part.group_ids) != len(picks)


@mooncake
def test_mooncakes_config_is_copied_field_by_field() -> None:
    import mooncake.store as ms

    config = ms.ReplicateConfig()
    config.replica_num = 2
    config.with_hard_pin = True
    config.preferred_segments = ["seg-a", "seg-b"]
    config.soft_pin_ttl_ms = 1234
    config.group_ids = ["g0", "g1", "g2"]
    part = per_key.config_for(config, [2, 0], 3)
    assert type(part) is ms.ReplicateConfig and part is not config
    assert str(part) == str(config).replace("group_ids: [g0, g1, g2]", "group_ids: [g2, g0]")
    assert config.group_ids == ["g0", "g1", "g2"]


def test_a_copy_that_would_lose_a_field_is_refused_and_other_objects_are_copied() -> None:
    """A field neither a property nor in the instance dict would be lost by the copy: its ``str`` (Mooncake's
    lists every field) tells, and the put is refused rather than sent with a changed config. An object without
    a no-argument constructor is copied by ``copy.copy``."""

    class Slotted:
        __slots__ = ("_ids", "_secret")

        def __init__(self) -> None:
            self._ids: list[str] | None = None
            self._secret = 0

        @property
        def group_ids(self) -> list[str] | None:
            return self._ids

        @group_ids.setter
        def group_ids(self, value: list[str] | None) -> None:
            self._ids = value

        def __str__(self) -> str:
            return f"Slotted({self._secret}, {self._ids})"

    slotted = Slotted()
    slotted.group_ids = ["a", "b"]
    slotted._secret = 7
    with pytest.raises(TypeError, match="cannot copy"):
        per_key.config_for(slotted, [1], 2)

    class NeedsArgs:
        def __init__(self, replicas: int) -> None:
            self.replicas = replicas
            self.group_ids = ["a", "b", "c"]

    part = per_key.config_for(NeedsArgs(4), [2], 3)
    assert part.replicas == 4 and part.group_ids == ["c"]


# --- the driver's region budget ----------------------------------------------------------------------------------


@mooncake
@pytest.mark.parametrize("call", ["batch_put_from_multi_buffers", "batch_put_from"])
def test_a_put_the_region_budget_splits_gives_each_sub_batch_its_own_group_ids(
    store: MooncakeStore, key_prefix: str, cuts: list[Cut], call: str
) -> None:
    multi = call == "batch_put_from_multi_buffers"
    n, width, size = (40, 5, 256) if multi else (100, 1, 512)  # 200 regions / 100 keys with a budget of 64
    data = np.random.default_rng(8).integers(0, 255, n * width * size, dtype=np.uint8)
    base = int(data.ctypes.data)
    keys = [f"{key_prefix}/{i}" for i in range(n)]
    ids = _ids(keys)
    config = _config(ids)
    if multi:
        addrs = [[base + (k * width + j) * size for j in range(width)] for k in range(n)]
        result = store.batch_put_from_multi_buffers(keys, addrs, [[size] * width] * n, config)
    else:
        result = store.batch_put_from(keys, [base + k * size for k in range(n)], [size] * n, config)
    assert result.codes == (0,) * n  # one config with every id: every key -600
    assert config.group_ids == ids
    assert len(cuts) > 1 and [i for cut in cuts for i in cut.picks] == list(range(n))
    assert all(cut.n == n and cut.ids == [ids[i] for i in cut.picks] for cut in cuts)
    assert store.batch_is_exist(keys).present == [True] * n
    back = np.zeros_like(data)
    got = store.batch_get_into(keys, [int(back.ctypes.data) + k * width * size for k in range(n)], [width * size] * n)
    assert got.ok and bytes(back) == bytes(data)


@mooncake
def test_group_ids_not_one_per_key_fail_every_sub_batch_as_the_whole_put_would(
    store: MooncakeStore, key_prefix: str
) -> None:
    """Mooncake refuses a put whose group ids are not one per key; split by the budget (64 regions: sub-batches
    of 64 keys and 36), it is refused whole still, even where a sub-batch has as many keys as there are ids."""
    data = np.zeros(100 * 64, dtype=np.uint8)
    keys = [f"{key_prefix}/{i}" for i in range(100)]
    for count in (36, 64, 99):
        config = _config([f"g{i}" for i in range(count)])
        result = store.batch_put_from(keys, [int(data.ctypes.data) + 64 * k for k in range(100)], [64] * 100, config)
        assert result.codes == (INVALID_PARAMS,) * 100, count
    assert store.batch_is_exist(keys).present == [False] * 100


# --- the driver's staged transfer: staging rounds -----------------------------------------------------------------


@mooncake
def test_a_kvtransfer_store_staged_in_several_rounds_gives_each_round_its_keys_group_ids(
    store: MooncakeStore, model: str, cuts: list[Cut]
) -> None:
    """``KVTransfer`` in staged mode with a ``ReplicateConfig`` holding one group id per key of the request:
    40 keys through a pool of 16 keys each round are three ``batch_put_from`` calls, each with its own keys'
    ids cut from the whole request (``driver/path_staged.py``); every block stored and loaded back."""
    bs, chunks, regions, block_bytes = 16, 40, 4, 256
    src, dst = Cache(regions, chunks + 1, block_bytes, seed=9), Cache(regions, chunks + 1, block_bytes)
    h = hashes(model, chunks)
    block_ids = list(range(1, chunks + 1))
    pool = StagingPool(16 * regions * block_bytes)  # 16 keys per round
    keys = ChunkedTokenDatabase(KeyMetadata(model, 0, 0, 0, 0, group_id=0), bs).keys_for(h)
    ids = _ids(keys)
    config = _config(ids)
    with (
        make_transfer(store, model, src, bs, staging_pool=pool, replicate_config=config) as writer,
        make_transfer(store, model, dst, bs, staging_pool=pool) as reader,
    ):
        assert writer.mode == "staged"
        assert writer.store(TransferRequest("r", chunks * bs, h, [block_ids])).ok
        assert config.group_ids == ids
        rounds = [cut for cut in cuts if cut.n == chunks]
        assert [cut.picks for cut in rounds] == [list(range(0, 16)), list(range(16, 32)), list(range(32, 40))]
        assert all(cut.ids == [ids[i] for i in cut.picks] for cut in rounds)
        assert store.batch_is_exist(keys).present == [True] * chunks
        assert reader.load(TransferRequest("r", chunks * bs, h, [block_ids])).ok
        assert_blocks_equal(src, block_ids, dst, block_ids)


# --- the wrappers: one put per row width ---------------------------------------------------------------------------


@mooncake
@pytest.mark.parametrize("kind", KINDS)
def test_a_put_of_rows_of_two_widths_gives_each_width_its_keys_group_ids(
    rigs: Callable[..., Rig], kind: str, cuts: list[Cut]
) -> None:
    """The send handler's put for a hybrid model (rows of different widths): one array put per width through
    each wrapper the plugin installs; every key stored with its own bytes."""
    rig = rigs(kind)
    n = 8
    keys = rig.keys(n)
    addrs, sizes = rig.rows(n, 3, 512)
    widths = np.array([3, 2, 3, 2, 2, 3, 3, 2], dtype=np.int64)
    sizes[np.arange(3)[None, :] >= widths[:, None]] = 0  # padding cells, as the send handler pads them
    ids = _ids(keys)
    config = _config(ids)
    assert rig.store.batch_put_from_multi_buffers_ragged(keys, addrs, sizes, widths, config) == [0] * n
    assert config.group_ids == ids
    for i, key in enumerate(keys):
        assert rig.stored(key, addrs[i, : widths[i]], sizes[i, : widths[i]]), key
    widest, narrow = [i for i in range(n) if widths[i] == 3], [i for i in range(n) if widths[i] == 2]
    split = [cut for cut in cuts if cut.n == n]
    assert [(cut.picks, cut.ids) for cut in split[:2]] == [
        (widest, [ids[i] for i in widest]),
        (narrow, [ids[i] for i in narrow]),
    ]


def test_an_array_store_that_keeps_the_default_array_put_hands_each_width_its_config() -> None:
    """A store that subclasses ``ArrayStore`` for its ragged entries but offers only Mooncake's list put: the
    default array put passes the config on with the rows, so each width's put gets its own keys' group ids and the
    rest of the config (fresh mutant M26-11: dropped there)."""

    class ListOnly(ArrayStore):
        def __init__(self) -> None:
            self.puts: list[tuple[list[str], list[list[int]], Any]] = []

        def batch_get_into_multi_buffers_arrays(self, keys: list[str], addrs: Any, sizes: Any) -> Any:
            raise AssertionError("not loaded here")

        def batch_put_from_multi_buffers(self, keys: Any, addrs: Any, sizes: Any, *config: Any) -> list[int]:
            assert type(addrs) is list and type(sizes) is list
            self.puts.append((list(keys), sizes, *config))
            return [0] * len(keys)

    store = ListOnly()
    keys = ["k0", "k1", "k2", "k3"]
    addrs = np.arange(1, 9, dtype=np.int64).reshape(4, 2) * 4096
    sizes = np.array([[8, 8], [8, 0], [8, 8], [8, 0]], dtype=np.int64)
    plain = _Plain()
    plain.group_ids = _ids(keys)
    plain.replica_num = 3
    assert store.batch_put_from_multi_buffers_arrays(keys, addrs, sizes, plain) == [0] * 4
    assert len(store.puts[0]) == 3 and store.puts[0][2] is plain
    store.puts.clear()
    widths = np.array([2, 1, 2, 1], dtype=np.int64)
    assert store.batch_put_from_multi_buffers_ragged(keys, addrs, sizes, widths, plain) == [0] * 4
    assert [(part[0], part[1]) for part in store.puts] == [(["k0", "k2"], [[8, 8], [8, 8]]), (["k1", "k3"], [[8], [8]])]
    for part_keys, _, *config in store.puts:
        assert len(config) == 1, "the put reached the store without its config"
        assert config[0].group_ids == _ids(part_keys) and config[0].replica_num == 3
    assert plain.group_ids == _ids(keys)


# --- the range guard: the kept keys ---------------------------------------------------------------------------


@mooncake
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("entry", ["lists", "arrays", "arrays_entry", "flat", "flat_keyword"])
def test_the_keys_the_guard_keeps_go_on_with_their_own_group_ids(
    rigs: Callable[..., Rig], kind: str, entry: str, cuts: list[Cut]
) -> None:
    """A key with a slice outside the registered buffers gets -600 and the others are stored ([0, -600, 0, 0],
    not four -600s): the Python guard's split and the native client's C++ guard hand Mooncake the kept keys'
    group ids only."""
    rig = rigs(kind)
    keys = rig.keys(4)
    width = 1 if entry.startswith("flat") else 2
    addrs, sizes = rig.rows(4, width, 256)
    addrs[1, 0] = rig.outside.ptr  # never registered through the wrapper
    ids = _ids(keys)
    config = _config(ids)
    store = rig.store
    if entry == "lists":
        codes = store.batch_put_from_multi_buffers(keys, addrs.tolist(), sizes.tolist(), config)
    elif entry == "arrays":
        codes = store.batch_put_from_multi_buffers(keys, addrs, sizes, config)
    elif entry == "arrays_entry":
        codes = store.batch_put_from_multi_buffers_arrays(keys, addrs, sizes, config)
    elif entry == "flat":
        codes = store.batch_put_from(keys, addrs[:, 0].tolist(), sizes[:, 0].tolist(), config)
    else:
        codes = store.batch_put_from(keys, addrs[:, 0].tolist(), sizes[:, 0].tolist(), config=config)
    assert codes == [0, INVALID_PARAMS, 0, 0]
    assert config.group_ids == ids
    assert rig.raw.is_exist(keys[1]) != 1
    for i in (0, 2, 3):
        assert rig.stored(keys[i], addrs[i], sizes[i]), keys[i]
    kept = [0, 2, 3]
    assert any(cut.picks == kept and cut.n == 4 and cut.ids == [ids[i] for i in kept] for cut in cuts), cuts


# --- the staged wrapper: staging rounds ----------------------------------------------------------------------------


@mooncake
@pytest.mark.parametrize("kind", ["staged", "staged_native"])
@pytest.mark.parametrize("entry", ["lists", "arrays_entry"])
def test_a_put_staged_in_several_rounds_gives_each_round_its_keys_group_ids(
    rigs: Callable[..., Rig], kind: str, entry: str, cuts: list[Cut]
) -> None:
    """Eight 1 KiB objects through a 4 KiB staging buffer: two rounds of four keys, each round a
    ``batch_put_from`` with its own keys' group ids; every object stored byte for byte."""
    rig = rigs(kind, staging=4096)
    n = 8
    keys = rig.keys(n)
    addrs, sizes = rig.rows(n, 2, 512)
    ids = _ids(keys)
    config = _config(ids)
    if entry == "lists":
        codes = rig.store.batch_put_from_multi_buffers(keys, addrs.tolist(), sizes.tolist(), config)
    else:
        codes = rig.store.batch_put_from_multi_buffers_arrays(keys, addrs, sizes, config)
    assert codes == [0] * n
    assert rig.store.stats.staged_puts == 1 and rig.store.stats.passthrough_puts == 0
    assert config.group_ids == ids
    for i, key in enumerate(keys):
        assert rig.stored(key, addrs[i], sizes[i]), key
    rounds = [cut for cut in cuts if cut.n == n]
    assert [cut.picks for cut in rounds] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert all(cut.ids == [ids[i] for i in cut.picks] for cut in rounds)
