"""End-to-end demo: store one request's KV cache in Mooncake, look it up, load it elsewhere, verify.

``python -m mooncake_kvaddr demo [--tokens N] [--regions R] [--block-size B] [--mode M] [--json PATH] [--verbose]``;
what it runs, what it prints and which timings are re-measurements: docs/python-api.md, "The demo". It says what
it waits for as it goes, and allocates only what the transfer paths it runs need.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from mooncake_kvaddr._cli import native_log, verbose_requested
from mooncake_kvaddr.core.database import ChunkedTokenDatabase
from mooncake_kvaddr.core.hashes import chunk_hashes_for_block_size
from mooncake_kvaddr.core.metadata import KeyMetadata
from mooncake_kvaddr.driver.config import TRANSFER_MODES, StoreConfig
from mooncake_kvaddr.driver.master import MasterError
from mooncake_kvaddr.driver.rules import choose_auto_mode, copies_in_memory
from mooncake_kvaddr.driver.staging import SLOT_ALIGNMENT, StagingPool
from mooncake_kvaddr.driver.store import MooncakeStore, StoreError
from mooncake_kvaddr.driver.store_setup import PROGRESS
from mooncake_kvaddr.driver.transfer import KVTransfer, TransferRequest

__all__ = ["build_parser", "chained_hashes", "kv_cache", "main", "run", "run_or_report"]

_T = TypeVar("_T")

_RESULT_TIMEOUT_S = 300.0
_MODE_HELP = (
    "transfer mode (docs/transfer-modes.md): staged (one contiguous staging slot per key, native gather/scatter), "
    "multi_buffer (every region handed to Mooncake), auto (default: direct for one region per key; otherwise, "
    "when Mooncake copies in memory - the demo's own embedded master - multi_buffer, except loads of keys with "
    "at most 8 regions under 4 KiB, which are staged; over the network - a master named by --config - staged "
    "for regions under 32 KiB or objects up to 512 KiB, else multi_buffer)"
)


def build_parser() -> argparse.ArgumentParser:
    """The demo's arguments (one function, so that a new option or mode is one more ``add_argument``)."""
    parser = argparse.ArgumentParser(
        prog="python -m mooncake_kvaddr demo",
        description="Store one request's KV cache in Mooncake, look it up, load it into a second cache, "
        "verify every byte, and print where the time went. Ctrl-C ends it at any moment (exit status 130).",
        epilog="python -m mooncake_kvaddr demo --cluster [--chunks N] [--no-oplog]: the same through etcd and two "
        "HA masters on loopback, killing the leader mid-run ('demo --cluster --help' says more).",
    )
    parser.add_argument("--tokens", type=int, default=65_536, help="tokens in the request (default 65536)")
    parser.add_argument("--regions", type=int, default=64, help="KV-cache regions, K and V per layer (64)")
    parser.add_argument("--block-size", type=int, default=128, help="tokens per block = per chunk (128)")
    parser.add_argument("--hash-block-size", type=int, default=None, help="tokens per hash (block size)")
    parser.add_argument("--block-bytes", type=int, default=2048, help="bytes per block per region (2048)")
    parser.add_argument("--recv-threads", type=int, default=1, help="receive threads of the loader (1)")
    parser.add_argument("--tp-rank", type=int, default=0, help="loader's tp rank: rotates its key order (0)")
    parser.add_argument(
        "--max-regions-per-batch",
        type=int,
        default=None,
        help="regions per Mooncake call (default: the config's; 1000 on tcp, which real TCP needs; "
        "a single-process run takes Mooncake's memcpy path and is faster with no splitting)",
    )
    parser.add_argument(
        "--mode",
        choices=TRANSFER_MODES,
        default="auto",
        help=_MODE_HELP,
    )
    parser.add_argument("--config", type=Path, default=None, help="StoreConfig JSON (else env / embedded)")
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help='write the result as JSON here ({"verified": false, "error": ...} until a run ends with a report)',
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic cache contents (0 to 2**64-1)")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show Mooncake's own log lines (also: MOONCAKE_KVADDR_VERBOSE=1); hidden by default",
    )
    return parser


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("tokens", "regions", "block_size", "block_bytes", "recv_threads"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    hbs = args.block_size if args.hash_block_size is None else args.hash_block_size
    if hbs <= 0 or args.block_size % hbs:
        parser.error("--hash-block-size must divide --block-size")
    if args.tokens < args.block_size:
        parser.error("--tokens must be at least one block")
    if not 0 <= args.seed < 2**64:
        parser.error("--seed must be from 0 to 2**64-1")
    try:
        args.verbose = verbose_requested(args.verbose)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def chained_hashes(count: int, seed: int) -> list[bytes]:
    """Prefix-chained sha256 hashes, as vLLM computes block hashes (each covers everything before it)."""
    hashes: list[bytes] = []
    previous = seed.to_bytes(8, "little")
    for i in range(count):
        previous = hashlib.sha256(previous + i.to_bytes(8, "little")).digest()
        hashes.append(previous)
    return hashes


def kv_cache(regions: int, num_blocks: int, block_bytes: int, rng: np.random.Generator | None) -> list[Any]:
    """``regions`` arrays of ``num_blocks`` blocks: random bytes, or zeros when ``rng`` is None."""
    if rng is None:
        return [np.zeros((num_blocks, block_bytes), dtype=np.uint8) for _ in range(regions)]
    return [rng.integers(0, 256, (num_blocks, block_bytes), dtype=np.uint8) for _ in range(regions)]


def _config(args: argparse.Namespace, data_bytes: int) -> StoreConfig:
    config = StoreConfig.load(args.config)
    if not config.has_master:
        # The demo is self-contained: with no master named, it asks for a private one on loopback.
        config = config.replace(embedded_master=True)
    # An embedded master's pool is this client's segment alone: make sure the request fits, with slack.
    needed = data_bytes + data_bytes // 4 + (64 << 20)
    if config.embedded_master and config.global_segment_size < needed:
        config = config.replace(global_segment_size=needed)
    if args.max_regions_per_batch is not None:
        config = config.replace(max_regions_per_batch=args.max_regions_per_batch)
    return config


def planned_modes(args: argparse.Namespace, config: StoreConfig) -> tuple[str, str]:
    """(store mode, load mode) the demo's transfers will resolve to: the rule ``KVTransfer.register_kv_caches``
    applies (docs/transfer-modes.md, "How auto chooses"), known before anything is allocated for it."""
    if args.mode == "multi_buffer":
        return "multi_buffer", "multi_buffer"
    if args.regions == 1:
        return "direct", "direct"
    if args.mode == "staged":
        return "staged", "staged"
    local = copies_in_memory(config)
    return (
        choose_auto_mode(args.regions, args.block_bytes, local_copy=local, direction="store"),
        choose_auto_mode(args.regions, args.block_bytes, local_copy=local, direction="load"),
    )


def _say(line: str) -> None:
    """One progress line, out at once (it says what the demo now waits for)."""
    print(line, flush=True)


class _ProgressLines(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, PROGRESS, False):
            _say(f"{record.getMessage()} ...")


@contextlib.contextmanager
def _setup_progress() -> Iterator[None]:
    """Print the store's set-up progress records (where it connects, what it waits for) for the block."""
    source = logging.getLogger("mooncake_kvaddr.driver.store")
    handler = _ProgressLines(logging.INFO)
    level = source.level
    source.addHandler(handler)
    source.setLevel(logging.INFO)
    try:
        yield
    finally:
        source.removeHandler(handler)
        source.setLevel(level)


@contextlib.contextmanager
def _timed(into: dict[str, float], name: str) -> Iterator[None]:
    """Time the block into ``into[name]``, in seconds (nothing when it raises)."""
    started = time.perf_counter()
    yield
    into[name] = time.perf_counter() - started


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the demo; returns the JSON report (``verified`` tells whether every byte matched)."""
    block_size = args.block_size
    hbs = args.hash_block_size or block_size
    token_len = args.tokens // block_size * block_size
    chunks = token_len // block_size
    num_blocks = chunks + 1  # block 0 is vLLM's null block and is never used for data
    data_bytes = chunks * args.regions * args.block_bytes
    timings: dict[str, float] = {}  # the run's steps, in order
    remeasured: dict[str, float] = {}  # parts of a step timed again on their own afterwards

    config = _config(args, data_bytes)
    metadata = KeyMetadata("demo-model", 0, 0, 0, 0)
    with _timed(timings, "setup"), _setup_progress():
        store = MooncakeStore(config).setup()
    _say(f"store set up in {timings['setup']:.2f} s")
    pool = None
    try:
        if "staged" in planned_modes(args, config):
            # One pool for both sides (as a worker's send and receive threads share one), pre-faulted here.
            with _timed(timings, "staging_pool"):
                pool = StagingPool(min(config.staging_buffer_size, data_bytes + chunks * SLOT_ALIGNMENT))
        # The caches are built once the store is up: a master that cannot be reached is reported first.
        rng = np.random.default_rng(args.seed)
        with _timed(timings, "build_cache"):
            cache_a = kv_cache(args.regions, num_blocks, args.block_bytes, rng)
            cache_b = kv_cache(args.regions, num_blocks, args.block_bytes, None)
            ids_a = [int(b) for b in rng.permutation(np.arange(1, num_blocks))]
            ids_b = [int(b) for b in rng.permutation(np.arange(1, num_blocks))]
            hashes = chained_hashes(token_len // hbs, args.seed)
        writer = KVTransfer(
            store, [ChunkedTokenDatabase(metadata, block_size, hbs)], transfer_mode=args.mode, staging_pool=pool
        )
        reader_db = ChunkedTokenDatabase(metadata, block_size, hbs)
        reader = KVTransfer(
            store,
            [reader_db],
            tp_rank=args.tp_rank,
            num_recv_threads=args.recv_threads,
            transfer_mode=args.mode,
            staging_pool=pool,
        )
        try:
            writer.register_kv_caches(cache_a, num_blocks)
            reader.register_kv_caches(cache_b, num_blocks)
            _say(
                f"storing {chunks} chunks x {args.regions} regions ({data_bytes / (1 << 20):.1f} MiB, store "
                f"{writer.store_mode}), looking them up, loading them into a second cache ({reader.mode}), verifying"
            )

            stored = writer.submit_store(TransferRequest("demo", token_len, hashes, [ids_a])).result(_RESULT_TIMEOUT_S)
            for phase, seconds in stored.timings.items():
                timings[f"store_{phase}"] = seconds

            # A prompt one token longer than what was stored: the whole stored prefix is a hit.
            with _timed(timings, "lookup"):
                hit = reader.lookup(token_len + 1, hashes)
            full_hit = reader.lookup(token_len, hashes)  # everything cached: the last block is recomputed

            loaded = reader.submit_load(TransferRequest("demo", hit, hashes, [ids_b])).result(_RESULT_TIMEOUT_S)
            for phase, seconds in loaded.timings.items():
                timings[f"load_{phase}"] = seconds

            with _timed(timings, "verify"):
                verified = (
                    stored.ok
                    and loaded.ok
                    and hit == token_len
                    and full_hit == token_len - block_size
                    and all(np.array_equal(a[ids_a], b[ids_b]) for a, b in zip(cache_a, cache_b, strict=True))
                )

            # Re-measurements, after the run: the load's fused plan split into its two halves (keys, address
            # rows), and in multi-buffer mode Mooncake's own share of the get (converting the argument lists,
            # GIL held), each timed again on its own.
            with _timed(remeasured, "load_plan_keys"):
                reader_db.keys_for(list(chunk_hashes_for_block_size(hashes, hbs, block_size))[:chunks])
            with _timed(remeasured, "load_plan_address_rows"):
                addrs, sizes, _ = reader_db.prepare_values(
                    [(c * block_size, (c + 1) * block_size) for c in range(chunks)], ids_b
                )
            if loaded.mode == "multi_buffer":
                conversion = statistics.median(store.time_argument_conversion(addrs, sizes) for _ in range(3))
                remeasured["load_get_mooncake_argument_conversion"] = conversion
        finally:
            writer.close()
            reader.close()
    finally:
        _say("closing the store (Mooncake's client takes about 2 s to stop)")
        with _timed(timings, "close"):
            store.close()

    def ms(seconds: float) -> float:
        return round(seconds * 1e3, 3)

    # The native copy between the KV cache and staging, apart from Mooncake's transfer: only where a path staged.
    copy = {name: ms(result.timings[name]) for name, result in (("gather", stored), ("scatter", loaded))
            if name in result.timings}
    return {
        "verified": bool(verified),
        "mode": {"requested": args.mode, "store": stored.mode, "load": loaded.mode},
        "copy_ms": copy,
        "transfer_ms": {"put": ms(stored.timings.get("put", 0.0)), "get": ms(loaded.timings.get("get", 0.0))},
        "staging_pool_bytes": pool.capacity if pool is not None else 0,
        "chunks": chunks,
        "regions": args.regions,
        "bytes": data_bytes,
        "tokens": token_len,
        "block_size": block_size,
        "block_bytes": args.block_bytes,
        "lookup_hit_tokens": hit,
        "stored_chunks": stored.stored,
        "loaded_bytes": loaded.bytes,
        "failed_block_ids": sorted(loaded.failed_block_ids),
        "master": "embedded" if config.embedded_master else config.master_server_address,
        "region_budget": config.region_budget,
        "timings_ms": {name: ms(seconds) for name, seconds in timings.items()},
        "remeasured_ms": {name: ms(seconds) for name, seconds in remeasured.items()},
    }


def _print_report(report: dict[str, Any]) -> None:
    mib = report["bytes"] / (1 << 20)
    print(
        f"KV cache: {report['chunks']} chunks x {report['regions']} regions x {report['block_bytes']} B "
        f"= {mib:.1f} MiB ({report['tokens']} tokens, block size {report['block_size']}, "
        f"master {report['master']}, <= {report['region_budget']} regions per Mooncake call)"
    )
    mode = report["mode"]
    pool_mib = report["staging_pool_bytes"] / (1 << 20)
    staging = f", staging pool {pool_mib:.1f} MiB" if pool_mib else ""
    print(f"transfer mode: {mode['requested']} -> store {mode['store']}, load {mode['load']}{staging}")
    # Rated where something moved: a step that stored or loaded nothing has no rate.
    moved = {"store": report["stored_chunks"], "load": report["loaded_bytes"]}
    rated = {name for name in ("store_put", "load_get", "store_gather", "load_scatter") if moved[name.split("_")[0]]}
    timings, remeasured = report["timings_ms"], report["remeasured_ms"]
    width = max(len(name) for name in (*timings, *remeasured))

    def show(name: str, ms: float) -> None:
        rate = f"  ({mib / (ms / 1e3):.0f} MiB/s)" if name in rated and ms > 0 else ""
        print(f"  {name:<{width}} {ms:10.2f} ms{rate}")

    print("steps, in order:")
    for name, ms in timings.items():
        show(name, ms)
    if remeasured:
        print("re-measured after the run (parts of the steps above, each timed again on its own):")
        for name, ms in remeasured.items():
            show(name, ms)
    copy, transfer = report["copy_ms"], report["transfer_ms"]
    if copy:
        print(f"copy (native {' + '.join(copy)}): {sum(copy.values()):.2f} ms")
    print(f"Mooncake transfer (put + get): {transfer['put'] + transfer['get']:.2f} ms")
    print(f"lookup hit: {report['lookup_hit_tokens']} tokens; loaded {report['loaded_bytes']} bytes")
    print("verified: every byte identical" if report["verified"] else "NOT VERIFIED")


def run_or_report(
    name: str, verbose: bool, job: Callable[[], _T], errors: tuple[type[BaseException], ...]
) -> _T | None:
    """``job()`` with Mooncake's native log lines hidden unless ``verbose``; on one of ``errors``, ``None``
    after printing "<name> failed: ..." and Mooncake's last log lines on standard error (both demos)."""
    failure: BaseException | None = None
    native_tail = ""
    with native_log(verbose) as native:
        try:
            return job()
        except errors as exc:
            failure = exc
            native_tail = native.tail()
    print(f"{name} failed: {type(failure).__name__}: {failure}", file=sys.stderr)
    if native_tail:
        print(f"Mooncake's last log lines (--verbose shows them all):\n{native_tail}", file=sys.stderr)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (0 only if every byte was verified)."""
    args = _parse(argv)
    if args.json is not None:  # written before the run: a path it cannot write is refused before anything starts
        try:
            args.json.write_text(json.dumps({"verified": False, "error": "the run did not end (see stderr)"}) + "\n")
        except OSError as exc:
            print(f"demo: cannot write --json {args.json}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    errors = (StoreError, MasterError, ImportError, OSError, ValueError)
    report = run_or_report("demo", args.verbose, lambda: run(args), errors)
    if report is None:
        return 2
    _print_report(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
