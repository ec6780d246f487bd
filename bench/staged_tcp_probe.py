"""Staged vs multi-buffer over real TCP: the segment lives in a separate ``mooncake_client`` process and this
process is a pure client (issue 6 target: load and store >= 10x faster staged). Not part of the package.

python bench/staged_tcp_probe.py [--chunks 300] [--regions 100] [--block-bytes 2048] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path

import mooncake
import numpy as np

from mooncake_kvaddr import ChunkedTokenDatabase, EmbeddedMaster, KeyMetadata, MooncakeStore, StoreConfig
from mooncake_kvaddr.master import free_ports
from mooncake_kvaddr.transfer import KVTransfer, TransferRequest


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunks", type=int, default=300)
    parser.add_argument("--regions", type=int, default=100)
    parser.add_argument("--block-bytes", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    chunks, regions, bb, bs = args.chunks, args.regions, args.block_bytes, 128
    data = chunks * regions * bb
    nb = chunks + 1
    rng = np.random.default_rng(0)
    src = [rng.integers(0, 256, (nb, bb), dtype=np.uint8) for _ in range(regions)]
    dst = [np.ones((nb, bb), dtype=np.uint8) for _ in range(regions)]
    ids = list(range(1, nb))
    hashes = [i.to_bytes(8, "little") * 4 for i in range(chunks)]
    request = TransferRequest("r", chunks * bs, hashes, [ids])
    client_bin = Path(mooncake.__file__).parent / "mooncake_client"
    with EmbeddedMaster() as master:
        (port,) = free_ports(1)
        segment_mb = (2 * data >> 20) + 64
        holder = subprocess.Popen(
            [str(client_bin), "-host=127.0.0.1", f"-port={port}", f"-global_segment_size={segment_mb}MB",
             f"-master_server_address={master.rpc_address}", "-metadata_server=P2PHANDSHAKE", "-protocol=tcp"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(1.0)
            config = StoreConfig(master_server_address=master.rpc_address, global_segment_size=0, local_buffer_size=0)
            with MooncakeStore(config) as store:
                print(f"{chunks} keys x {regions} x {bb} B = {data / (1 << 20):.1f} MiB over TCP to pid {holder.pid}; "
                      f"region budget {config.region_budget}; medians of {args.reps}")
                for mode in ("staged", "multi_buffer"):
                    md = KeyMetadata(f"tcp-{mode}", 0, 0, 0, 0)
                    w = KVTransfer(store, [ChunkedTokenDatabase(md, bs)], transfer_mode=mode, start_threads=False)
                    r = KVTransfer(store, [ChunkedTokenDatabase(md, bs)], transfer_mode=mode, start_threads=False)
                    w.register_kv_caches(src, nb)
                    r.register_kv_caches(dst, nb)
                    loads, stores = [], []
                    for _ in range(args.reps):
                        store.remove_all(force=True)
                        t = time.perf_counter()
                        st = w.store(request)
                        stores.append(time.perf_counter() - t)
                        for region in dst:
                            region[:] = 1
                        t = time.perf_counter()
                        ld = r.load(request)
                        loads.append(time.perf_counter() - t)
                        same = all(np.array_equal(a[1:], b[1:]) for a, b in zip(src, dst, strict=True))
                        ok = st.ok and ld.ok and same
                        if not ok:
                            print(f"  {mode}: store {st.outcomes} load {ld.outcomes} {ld.error}")
                    print(f"  {mode:12} store {statistics.median(stores) * 1e3:9.1f} ms   load "
                          f"{statistics.median(loads) * 1e3:9.1f} ms   verified {ok}")
                    w.close()
                    r.close()
        finally:
            holder.terminate()
            holder.wait(10)


if __name__ == "__main__":
    main()
