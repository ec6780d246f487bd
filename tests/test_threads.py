"""Concurrent calls on one database from several threads give the serial results."""

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
