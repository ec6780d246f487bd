"""Concurrent calls on one database from several threads give the serial results (docs/address-rows.md)."""

from __future__ import annotations

import random
import sys
import threading

from kvaddr_testing import oracle_regions, paired


def test_concurrent_prepare_values_equal_serial() -> None:
    native, oracle = paired(*oracle_regions(96, 96), 128, 16, address_cache_bytes=2 << 20)
    rng = random.Random(5)
    requests = []
    for _ in range(8):
        block_ids = [rng.randrange(1 << 20) for _ in range(400)]
        chunks = [(128 * i, 128 * i + 16 * rng.randint(1, 8)) for i in range(rng.randint(50, 400))]
        requests.append((chunks, block_ids, oracle.prepare_values(chunks, block_ids)))

    errors: list[BaseException] = []
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # force frequent thread switches inside the calls
    try:
        def work(offset: int) -> None:
            try:
                for round_ in range(6):
                    chunks, block_ids, expected = requests[(offset + round_) % len(requests)]
                    assert native.prepare_values(chunks, block_ids) == expected
                    arrays = native.prepare_values_array(chunks, block_ids)
                    assert arrays[0].tolist() == expected[0]
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert not errors, errors[0]


def test_one_database_shared_by_a_send_thread_and_receive_threads() -> None:
    """vLLM's sharing: one database, a send thread (plan_store + prepare_values on the missing chunks) and
    several receive threads (plan_load, plan_load_arrays), while the engine re-registers the same regions
    (fresh lists, equal values). Every result equals the serial reference."""
    from mooncake_kvaddr.core.oracle import OracleChunkedTokenDatabase

    bases, lens = oracle_regions(24, 2)
    native, oracle = paired(bases, lens, 64, 16, address_cache_bytes=64 << 10)  # small: constant eviction
    assert isinstance(oracle, OracleChunkedTokenDatabase)
    rng = random.Random(11)
    requests = []
    for _ in range(6):
        n = rng.randint(4, 40)
        hashes = [rng.randbytes(8) for _ in range(4 * n)]
        ids = [rng.randrange(1, 1 << 16) for _ in range(n)]
        token_len = 64 * n - 16 * rng.randint(0, 3)
        walked = list(oracle.process_tokens(token_len, hashes))
        chunks = [(s, e) for s, e, _ in walked]
        keys = [oracle.key_for(h) for _, _, h in walked]
        requests.append((token_len, hashes, ids, keys, chunks, oracle.prepare_values(chunks, ids)))

    errors: list[BaseException] = []
    stop = threading.Event()

    def send() -> None:
        try:
            for round_ in range(40):
                token_len, hashes, ids, keys, chunks, _ = requests[round_ % len(requests)]
                plan = native.plan_store(token_len, hashes, ids)
                assert plan.keys == keys and plan.chunks == chunks
                missing = plan.chunks[::2]
                assert native.prepare_values(missing, ids) == oracle.prepare_values(missing, ids)
        except BaseException as exc:
            errors.append(exc)

    def receive(offset: int) -> None:
        try:
            for round_ in range(40):
                token_len, hashes, ids, keys, _, rows = requests[(offset + round_) % len(requests)]
                assert tuple(native.plan_load(token_len, hashes, ids)) == (keys, *rows)
                arrays = native.plan_load_arrays(token_len, hashes, ids)
                assert arrays.keys == keys and arrays.addrs.tolist() == rows[0] and arrays.sizes.tolist() == rows[1]
        except BaseException as exc:
            errors.append(exc)

    def engine() -> None:
        while not stop.is_set():
            native.set_kv_caches_base_addr(list(bases))
            native.set_block_len(list(lens))

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        workers = [threading.Thread(target=send)] + [threading.Thread(target=receive, args=(i,)) for i in range(3)]
        reconfigure = threading.Thread(target=engine)
        reconfigure.start()
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        stop.set()
        reconfigure.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert not errors, errors[0]
