"""Pool key strings and prefixes, the process_tokens chunk walk, and the hash views (compact and blob)."""

from __future__ import annotations

import array

import pytest

from kvaddr_testing import RecordingHashes
from mooncake_kvaddr import (
    BlobBlockHashes,
    ChunkedTokenDatabase,
    CompactChunkHashes,
    KeyMetadata,
    PoolKey,
    chunk_hashes_for_block_size,
    model_name_from_path,
)
from mooncake_kvaddr.core.oracle import OracleChunkedTokenDatabase


def test_pinned_key_strings() -> None:
    md = KeyMetadata("test-model", 0, 0, 0, 0)
    assert PoolKey(md, "deadbeef").to_string() == "test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@deadbeef"
    prefixed = KeyMetadata("test-model", 0, 0, 0, 0, cache_prefix="depA")
    assert PoolKey(prefixed, "deadbeef").to_string() == (
        "depA@test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@deadbeef"
    )


def test_a_walk_longer_than_one_window_reads_its_mask_from_the_first_chunk() -> None:
    """More than core.walk.WINDOW chunks with a list mask and a first chunk past 0: every window's mask is
    relative to the walk's first chunk, as in the reference."""
    import random

    from mooncake_kvaddr.core.walk import WINDOW

    n = WINDOW + 40
    hashes = [i.to_bytes(4, "little") for i in range(n)]
    rng = random.Random(5)
    mask = [rng.random() < 0.5 for _ in range(n)]
    md = KeyMetadata("m", 0, 0, 0, 0)
    ours = list(ChunkedTokenDatabase(md, 1).process_tokens(n, hashes, 3, chunk_mask=mask))
    reference = list(OracleChunkedTokenDatabase(md, 1).process_tokens(n, hashes, 3, chunk_mask=mask))
    assert len(reference) > WINDOW // 3
    assert ours == reference


def test_a_walk_longer_than_one_window_without_a_mask_yields_every_chunk() -> None:
    """More than core.walk.WINDOW chunks and no mask (vLLM's store path): every chunk from the first one is
    walked, window after window, as in the reference (the windowed test in test_native_argument_conversion.py
    replaces the all-chunks mask with its own, so only a real window size sees the module's)."""
    from mooncake_kvaddr.core.walk import WINDOW

    n = WINDOW + 40
    hashes = [i.to_bytes(4, "little") for i in range(n)]
    md = KeyMetadata("m", 0, 0, 0, 0)
    ours = list(ChunkedTokenDatabase(md, 1).process_tokens(n, hashes, 3))
    reference = list(OracleChunkedTokenDatabase(md, 1).process_tokens(n, hashes, 3))
    assert len(reference) == n - 3 and reference[-1][:2] == (n - 1, n)
    assert ours == reference


def test_a_mask_shorter_than_a_long_walk_ends_it_counted_from_the_first_chunk() -> None:
    """More than core.walk.WINDOW chunks, a first chunk past 0 and a mask that ends before the tokens do: the
    walk stops ``len(mask)`` chunks after its first chunk, as in the reference (fresh mutant M11-18: the stop
    was ``len(mask)`` chunks from chunk 0, so the last masked-in chunks went missing)."""
    from mooncake_kvaddr.core.walk import WINDOW

    n = WINDOW + 40
    hashes = [i.to_bytes(4, "little") for i in range(n)]
    mask = [True] * (WINDOW + 10)
    md = KeyMetadata("m", 0, 0, 0, 0)
    ours = list(ChunkedTokenDatabase(md, 1).process_tokens(n, hashes, 3, chunk_mask=mask))
    reference = list(OracleChunkedTokenDatabase(md, 1).process_tokens(n, hashes, 3, chunk_mask=mask))
    assert len(reference) == WINDOW + 10 and reference[-1][:2] == (WINDOW + 12, WINDOW + 13)
    assert ours == reference


def test_a_short_walk_with_a_long_mask_is_one_native_call() -> None:
    """The walk ends at its tokens or its mask, whichever comes first: a few chunks under a mask of more than
    two windows is the single native call over the caller's own arguments (no windows past the tokens)."""
    from mooncake_kvaddr._native import chunk_walk
    from mooncake_kvaddr.core.walk import WINDOW, walk_windows

    mask = [True, False] * (WINDOW + 3)
    args = (5 * 16, 7, 16, 16, 32, mask, 1, 0)
    windows = list(walk_windows(*args))
    assert windows == [chunk_walk(*args)]
    assert windows[0][0] == [32, 64]  # chunks 2 and 4: the mask counted from the first chunk


def test_build_prefix_overrides_and_key_string() -> None:
    md = KeyMetadata("Kimi-K2.6-NVFP4", 3, 1, 3, 0, group_id=2)
    assert PoolKey.build_prefix(md) == "Kimi-K2.6-NVFP4@tp_rank:3@pcp1@dcp3@pp_rank:0@group:2"
    assert PoolKey.build_prefix(md, tp_rank=0, pcp_rank=0, dcp_rank=1, pp_rank=4) == (
        "Kimi-K2.6-NVFP4@tp_rank:0@pcp0@dcp1@pp_rank:4@group:2"
    )
    assert PoolKey.build_prefix(md, tp_rank=-1).startswith("Kimi-K2.6-NVFP4@tp_rank:-1@")
    assert PoolKey.build_key_string("p", "ab") == "p@ab"


def test_pool_key_hash_eq_order() -> None:
    a = PoolKey(KeyMetadata("m", 0, 0, 0, 0), "aa")
    b = PoolKey(KeyMetadata("m", 0, 0, 0, 0), "bb")
    c = PoolKey(KeyMetadata("m", 0, 0, 0, 0, cache_prefix="x"), "aa")
    assert a == PoolKey(KeyMetadata("m", 0, 0, 0, 0), "aa")
    assert hash(a) == hash(PoolKey(KeyMetadata("m", 0, 0, 0, 0), "aa"))
    assert a != c and hash(a) != hash(c)
    assert a < b and sorted([b, a]) == [a, b]
    assert len({a, b, c}) == 3


def test_model_name_from_path() -> None:
    assert model_name_from_path("deepseek-ai/DeepSeek-V3") == "DeepSeek-V3"
    assert model_name_from_path("/models/Qwen3-8B/") == "Qwen3-8B"
    assert model_name_from_path("plain") == "plain"


@pytest.mark.parametrize("db_class", [ChunkedTokenDatabase, OracleChunkedTokenDatabase])
def test_key_for_hex_and_prefix(db_class: type) -> None:
    db = db_class(KeyMetadata("t", 1, 0, 0, 0, group_id=0), 16)
    assert db.key_for(b"a0") == "t@tp_rank:1@pcp0@dcp0@pp_rank:0@group:0@6130"
    assert db.key_for(memoryview(b"h11")) == "t@tp_rank:1@pcp0@dcp0@pp_rank:0@group:0@683131"
    assert db.key_for(bytes(range(250, 256))) .endswith("@fafbfcfdfeff")


DB_CLASSES = [ChunkedTokenDatabase, OracleChunkedTokenDatabase]


@pytest.mark.parametrize("db_class", DB_CLASSES)
@pytest.mark.parametrize(
    ("token_len", "kwargs", "expected", "accessed"),
    [
        (96, dict(mask_num=64), [(64, 96, 11)], [11]),
        (128, dict(mask_num=64, chunk_mask=[False, True]), [(96, 128, 15)], [15]),
        (128, dict(mask_num=64, put_step=2, put_step_rank=1), [(96, 128, 15)], [15]),
        (128, dict(put_step=2, put_step_rank=2), [], []),
        (120, dict(), [(0, 32, 3), (32, 64, 7), (64, 96, 11), (96, 120, 14)], [3, 7, 11, 14]),
    ],
)
def test_process_tokens_pinned(db_class: type, token_len: int, kwargs: dict, expected: list, accessed: list) -> None:
    db = db_class(KeyMetadata("t", 0, 0, 0, 0), 32, 8)
    hashes = RecordingHashes([bytes([i]) for i in range(16)])
    got = list(db.process_tokens(token_len, hashes, **kwargs))
    assert got == [(s, e, bytes([h])) for s, e, h in expected]
    assert hashes.accessed == accessed


@pytest.mark.parametrize("db_class", DB_CLASSES)
def test_process_tokens_is_lazy_and_asserts(db_class: type) -> None:
    db = db_class(KeyMetadata("t", 0, 0, 0, 0), 32, 8)
    hashes = [bytes([i]) for i in range(4)]
    lazy = db.process_tokens(33, hashes)  # misaligned token_len: nothing raised yet
    with pytest.raises(AssertionError):
        next(iter(lazy))
    with pytest.raises(AssertionError):
        list(db.process_tokens(64, hashes))  # needs 8 hashes
    with pytest.raises(AssertionError):
        list(db.process_tokens(32, hashes, put_step=0))
    assert list(db.process_tokens(64, [])) == []


def test_blob_block_hashes() -> None:
    hashes = [bytes([i]) * 16 for i in range(5)]
    blob = memoryview(b"".join(hashes))
    view = BlobBlockHashes(blob, 16)
    assert len(view) == 5
    assert [bytes(h) for h in view] == hashes
    assert bytes(view[-1]) == hashes[-1]
    assert [bytes(h) for h in view[1:3]] == hashes[1:3]
    assert isinstance(view[0], memoryview)
    with pytest.raises(IndexError):
        view[5]
    with pytest.raises(IndexError):
        view[-6]
    assert len(BlobBlockHashes(memoryview(b""), 0)) == 0
    assert view[0].hex() == hashes[0].hex()


def test_blob_block_hashes_of_a_one_dimensional_view_of_wider_items_count_bytes() -> None:
    words = array.array("I", range(1, 9))  # one dimension, 8 items of 4 bytes: 32 bytes
    raw = words.tobytes()
    view = BlobBlockHashes(memoryview(words), 4)
    assert len(view) == 8 and view.blob.format == "B" and len(view.blob) == 32
    assert [bytes(h) for h in view] == [raw[i : i + 4] for i in range(0, 32, 4)]
    with pytest.raises(ValueError, match="multiple of hash_len"):
        BlobBlockHashes(memoryview(words), 3)  # 32 bytes, not 8 items, are cut into hashes


def test_blob_block_hashes_of_a_two_dimensional_byte_view_count_bytes() -> None:
    """A C-contiguous 2-D buffer of bytes (format ``B``, a numpy ``(n, hash_len)`` uint8 matrix say) is read as
    its flat bytes: one hash per ``hash_len`` bytes, not one per row of the first dimension."""
    raw = bytes(range(48))
    view = BlobBlockHashes(memoryview(raw).cast("B", (3, 16)), 8)
    assert len(view) == 6 and view.blob.ndim == 1 and len(view.blob) == 48
    assert [bytes(h) for h in view] == [raw[i : i + 8] for i in range(0, 48, 8)]


def test_compact_chunk_hashes_refuse_a_hash_block_size_that_is_not_positive() -> None:
    """A hash block size of 0 or below is the same ``ValueError`` as one that does not divide the block size
    (not a ``ZeroDivisionError`` from the division check), and the message names both sizes."""
    hashes = [bytes([i]) for i in range(8)]
    for hash_block_size in (0, -4):
        message = rf"block_size \(16\) must be a multiple of hash_block_size \({hash_block_size}\)"
        with pytest.raises(ValueError, match=message):
            CompactChunkHashes(hashes, hash_block_size, 16)
        with pytest.raises(ValueError):
            chunk_hashes_for_block_size(hashes, hash_block_size, 16)


def test_compact_chunk_hashes() -> None:
    hashes = [bytes([i]) for i in range(10)]
    assert chunk_hashes_for_block_size(hashes, 16, 16) is hashes
    view = chunk_hashes_for_block_size(hashes, 4, 16)
    assert isinstance(view, CompactChunkHashes)
    assert len(view) == 2
    assert list(view) == [hashes[3], hashes[7]]
    assert view[-1] == hashes[7] and view[0:2] == [hashes[3], hashes[7]]
    with pytest.raises(IndexError):
        view[2]
    blob_view = chunk_hashes_for_block_size(BlobBlockHashes(b"".join(hashes), 1), 2, 4)
    assert [bytes(h) for h in blob_view] == [hashes[1], hashes[3], hashes[5], hashes[7], hashes[9]]
    with pytest.raises(ValueError):
        CompactChunkHashes(hashes, 3, 16)
