"""Generated cases and recording stores for tests/test_vllm034.py (vLLM 0.34's own functions beside ours).

Every builder takes a ``random.Random`` and vLLM's modules, and returns plain arguments both sides are called
with; nothing here knows which side is vLLM's. Values stay inside int64 (where vLLM's numpy would wrap, ours
raises OverflowError by design: pinned separately in the test module).
"""

from __future__ import annotations

import math
import queue
import random
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from mooncake_kvaddr.integrations.vllm.receive import ArrayStore

# --- outcomes ---------------------------------------------------------------------------------------------------


def outcome(call: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    """``("ok", value)`` or ``("raise", exception type)``."""
    try:
        return "ok", call(*args)
    except Exception as exc:  # the type is what is compared
        return "raise", type(exc)


def same(expected: Any, actual: Any) -> bool:
    """Equal values of identical Python types, recursively through lists and tuples."""
    if type(expected) is not type(actual):
        return False
    if isinstance(expected, (list, tuple)):
        return len(expected) == len(actual) and all(same(e, a) for e, a in zip(expected, actual))
    return bool(expected == actual)


def compare(what: str, theirs: Callable[..., Any], ours: Callable[..., Any], *args: Any) -> str:
    """Run vLLM's function and ours on the same arguments: equal values of identical types, or both raise with
    ours an instance of vLLM's exception type. Returns the outcome's name ("ok" or vLLM's exception type)."""
    expected = outcome(theirs, *args)
    actual = outcome(ours, *args)
    if expected[0] == "raise":
        assert actual[0] == "raise" and issubclass(actual[1], expected[1]), (
            f"{what}: vLLM raises {expected[1].__name__}, ours gives {actual!r}; args={_short(args)}"
        )
        return str(expected[1].__name__)
    assert same(expected, actual), f"{what}: vLLM gives {_short(expected)}, ours {_short(actual)}; args={_short(args)}"
    return "ok"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 1500 else text[:1500] + "..."


# --- rank-local layouts (regions set directly) -------------------------------------------------------------------


def rank_local_case(
    rng: random.Random, layout_mod: ModuleType, metadata: Any
) -> tuple[Any, list[tuple[str, tuple[Any, ...]]]]:
    """A ``RankLocalStoreLayout`` whose ``block_stride`` and ``block_len`` lists are set directly (stride apart
    from length, lists of other lengths than the regions), and ``(label, (chunks, block_ids, shard_ids))``
    batches for it: multi-block chunks, partial tails, gaps, any order, empty, and every error vLLM raises."""
    hbs = rng.choice([1, 4, 16, 32])
    block = hbs * rng.choice([1, 2, 4])
    layout = layout_mod.RankLocalStoreLayout(metadata, block, hbs)
    regions = rng.choice([0, 1, 2, 3, 3, 5, 8])
    bases = [rng.randrange(1 << 20, 1 << 44) for _ in range(regions)]
    count = rng.randint(1, max(1, regions)) if rng.random() < 0.9 else regions + 1
    strides = [rng.choice([256, 4096, 8192, 30_208, 1 << 20]) for _ in range(count)]
    lens = [max(1, s - rng.choice([0, 64, 512, s // 2, s - 1])) for s in strides]
    shape = rng.random()
    if shape < 0.03:
        strides, lens = [], []  # regions but no stride: vLLM divides by zero
    elif shape < 0.06 and len(lens) > 1:
        lens = lens[:-1]  # fewer lengths than strides: vLLM indexes past block_len
    elif shape < 0.08:
        lens = [s + rng.choice([1, 64]) for s in strides]  # longer than the stride (vLLM computes it as given)
    if rng.random() < 0.5:
        layout.set_kv_caches_base_addr(bases)
        layout.set_block_len(list(strides))
        layout.block_len = lens
    else:
        layout.kv_caches_base_addr = bases
        layout.block_stride = strides
        layout.block_len = lens
    blocks = rng.randint(1, 12)
    block_ids: Any = [rng.randrange(0, 1 << 20) for _ in range(blocks)]
    if rng.random() < 0.1:
        block_ids = tuple(block_ids)
    token_len = blocks * block - rng.randrange(0, block // hbs) * hbs
    span = block * rng.choice([1, 1, 2, 3])
    chunks = [(s, min(s + span, token_len)) for s in range(0, token_len, span)]
    if rng.random() < 0.3:
        chunks = [c for c in chunks if rng.random() < 0.7] or chunks[:1]
    if rng.random() < 0.2:
        rng.shuffle(chunks)
    batches: list[tuple[str, tuple[Any, ...]]] = [("ok", (chunks, block_ids, [0] * len(chunks)))]
    error = rng.choice(
        ["unaligned", "shard", "count", "past", "negative start", "negative span", "negative id", "empty", "tuple"]
    )
    bad: list[Any] = list(chunks)
    shards: Any = [0] * len(chunks)
    at = rng.randrange(len(bad))
    start, end = bad[at]
    ids = block_ids
    if error == "unaligned" and hbs > 1:
        bad[at] = (start, end + rng.randint(1, hbs - 1))
    elif error == "shard":
        shards[at] = rng.choice([1, -1, 2])
    elif error == "count":
        shards = shards[:-1] if rng.random() < 0.5 else [*shards, 0]
    elif error == "past":
        bad[at] = (len(block_ids) * block + start % block, len(block_ids) * block + start % block + block)
    elif error == "negative start":
        k = rng.randint(1, len(block_ids) + 1)  # past the front: IndexError
        bad[at] = (-k * block, -k * block + block)
    elif error == "negative span":
        bad[at] = (end, start)
    elif error == "negative id":
        ids = [-rng.randint(1, 9) if i == start // block else b for i, b in enumerate(block_ids)]
    elif error == "empty":
        bad, shards = [], []
    elif error == "tuple":  # chunks as lists, shard ids as a tuple
        bad = [list(c) for c in bad]
        shards = tuple(shards)
    batches.append((error, (bad, ids, shards)))
    return layout, batches


def edit_in_place(rng: random.Random, layout: Any) -> None:
    """Change the region lists the way a caller could after a first call: in place, or with new lists."""
    how = rng.choice(["len", "stride", "base", "new"])
    if how == "len" and layout.block_len:
        layout.block_len[0] = max(1, layout.block_len[0] - 64)
    elif how == "stride" and layout.block_stride:
        layout.block_stride[-1] += 4096
    elif how == "base" and layout.kv_caches_base_addr:
        layout.kv_caches_base_addr[0] += 1 << 20
    else:
        layout.block_stride = [s + 512 for s in layout.block_stride]


# --- TP-shared layouts (templates through vLLM's setter) ---------------------------------------------------------

TP_PAIRS = [(1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (2, 8), (4, 8), (1, 8), (4, 4)]


def templates(rng: random.Random, per_block: int, shards: int, width: int, ragged: bool) -> list[Any]:
    """Segment templates per Store chunk of a block and local shard (ragged: widths differ between chunks; the
    shards of one chunk always have one width, as vLLM's setter requires)."""
    out = []
    for _ in range(per_block):
        chunk = []
        w = rng.randint(1, width + 1) if ragged else width
        for _ in range(shards):
            chunk.append(
                (
                    [rng.randrange(1 << 20, 1 << 44) for _ in range(w)],
                    [rng.choice([4096, 65_536, 1 << 20, 3 << 20]) for _ in range(w)],
                    [rng.choice([64, 128, 512, 1000]) for _ in range(w)],
                )
            )
        out.append(chunk)
    return out


def sharded_layout(rng: random.Random, layout_mod: ModuleType, metadata: Any) -> Any:
    """A ``TPShardedStoreLayout`` with Store chunks of a whole block or below, several shard counts and TP sizes,
    templates installed through vLLM's ``_set_segment_templates`` (mostly one width: stacked arrays)."""
    hbs = rng.choice([1, 4, 16])
    block = hbs * rng.choice([1, 2, 4, 8])
    chunk = block // rng.choice([d for d in (1, 2, 4, 8) if block % d == 0])
    local_tp, store_tp = rng.choice(TP_PAIRS)
    layout = layout_mod.TPShardedStoreLayout(
        metadata, block, hbs, local_tp, store_tp, rng.randrange(local_tp), chunk if rng.random() < 0.9 else None
    )
    ragged = rng.random() < 0.1
    layout._set_segment_templates(
        templates(rng, block // layout.store_chunk_size, layout.shards_per_rank, rng.randint(1, 5), ragged)
    )
    return layout


def sharded_batches(rng: random.Random, layout: Any) -> list[tuple[str, tuple[Any, ...]]]:
    """Batches of Store chunks (16 or fewer: vLLM's loop; more: its vectorised path and our engine), each a
    valid one and one with an error: boundary, shard, block index, count mismatch, negative ids."""
    chunk = layout.store_chunk_size
    per_block = layout.block_size // chunk
    owned = list(layout.local_shard_ids)
    blocks = rng.randint(1, 10)
    block_ids: Any = [rng.randrange(0, 1 << 20) for _ in range(blocks)]
    n = rng.choice([rng.randint(1, 16), rng.randint(17, 120)])
    picks = [rng.randrange(blocks * per_block) for _ in range(n)]
    if rng.random() < 0.5:
        picks.sort()
    chunks = []
    for p in picks:
        start = p * chunk
        chunks.append((start, start + (chunk if rng.random() < 0.85 else rng.randint(1, chunk))))
    shards = [rng.choice(owned) for _ in chunks]
    batches: list[tuple[str, tuple[Any, ...]]] = [("ok", (chunks, block_ids, shards))]
    for _ in range(rng.choice([1, 1, 2])):  # sometimes two errors in one batch (which one vLLM reports first)
        error = rng.choice(
            ["boundary", "zero span", "long span", "negative span", "shard", "negative shard", "block index",
             "count", "negative id", "negative start", "far negative start", "tuple ids"]
        )  # fmt: skip
        chunks, block_ids, shards = (list(x) for x in batches[-1][1])
        at = rng.randrange(len(chunks))
        start, end = chunks[at]
        if error == "boundary" and chunk > 1:
            off = rng.randint(1, chunk - 1)
            chunks[at] = (start + off, end + off)
        elif error == "zero span":
            chunks[at] = (start, start)
        elif error == "long span":
            chunks[at] = (start, start + chunk + rng.randint(1, chunk))
        elif error == "negative span":
            chunks[at] = (start, start - chunk)
        elif error == "shard" and shards:
            shards[at % len(shards)] = rng.choice([owned[0] - 1, owned[-1] + 1]) if owned[0] > 0 else owned[-1] + 1
        elif error == "negative shard" and shards:
            shards[at % len(shards)] = -rng.randint(1, 3)
        elif error == "block index":
            chunks[at] = (start + len(block_ids) * layout.block_size, end + len(block_ids) * layout.block_size)
        elif error == "count":
            shards = shards[:-1] if rng.random() < 0.5 else [*shards, owned[0]]
        elif error == "negative id":
            block_ids[start // layout.block_size % len(block_ids)] = -rng.randint(1, 5)
        elif error == "negative start":  # Python's negative index: the last blocks
            chunks[at] = (start - len(block_ids) * layout.block_size, end - len(block_ids) * layout.block_size)
        elif error == "far negative start":
            chunks[at] = (start - 3 * len(block_ids) * layout.block_size, end - 3 * len(block_ids) * layout.block_size)
        elif error == "tuple ids":
            block_ids = tuple(block_ids)
        batches.append((error, (chunks, block_ids, shards)))
    return batches


# --- TP-shared layouts from real CPU tensors ---------------------------------------------------------------------


def attention_caches(torch: Any, cache_layout: Any, layers: int, blocks: int, kernel: int, heads: int,
                     states: int, content: int) -> list[Any]:  # fmt: skip
    """Per-layer views of one physical buffer in ``cache_layout``'s axis order ([L, B, H, N, C] permuted), with
    ``kernel`` kernel blocks per block (B split into B, K next to each other, N into K x states): 4-D views
    (B, H, N, C) when kernel is 1, else 5-D (B, K, H, S, C)."""
    order = list(cache_layout.value)  # physical order of the logical axes L=0, B=1, H=2, N=3, C=4
    if kernel == 1:
        logical = (layers, blocks, heads, states, content)
        physical = torch.empty(tuple(logical[a] for a in order), dtype=torch.float16)
        view = physical.permute(tuple(order.index(a) for a in range(5)))
        return list(view.unbind(0))
    # Six logical axes L=0, B=1, K=2, H=3, S=4, C=5; K sits right after B in memory.
    mapping = {0: [0], 1: [1, 2], 2: [3], 3: [4], 4: [5]}
    order6 = [a for axis in order for a in mapping[axis]]
    logical6 = (layers, blocks, kernel, heads, states, content)
    physical = torch.empty(tuple(logical6[a] for a in order6), dtype=torch.float16)
    view = physical.permute(tuple(order6.index(a) for a in range(6)))
    return list(view.unbind(0))


def attention_layout(rng: random.Random, torch: Any, layout_mod: ModuleType, spec_cls: Any, metadata: Any,
                     cache_layout: Any, kernel_blocks: bool, block_sizes: tuple[int, ...] = (4, 8, 12, 16),
                     hbs: int | None = None) -> tuple[Any, list[Any]]:  # fmt: skip
    """vLLM's attention layout class for ``cache_layout`` with caches registered through its own
    ``register_kv_caches`` (returned with the tensors, which must outlive the layout's use). ``hbs``: the hash
    block size (the Store chunk a multiple of it), else 1 or the chunk."""
    local_tp, store_tp = rng.choice([(1, 1), (1, 2), (2, 4), (1, 4), (2, 2), (4, 8)])
    local_heads = rng.choice([h for h in (1, 2, 4, 8) if (h * local_tp) % store_tp == 0])
    block = rng.choice(block_sizes)
    kernel = rng.choice([k for k in (2, 3, 4) if block % k == 0]) if kernel_blocks else 1
    head_size = rng.choice([1, 2, 4])
    spec = spec_cls(block_size=block, num_kv_heads=local_heads, head_size=head_size, dtype=torch.float16)
    step = hbs or 1
    chunk = rng.choice([c for c in range(step, block + 1, step) if block % c == 0])
    layers = rng.randint(1, 3)
    blocks = rng.randint(2, 6)
    cls = layout_mod.ATTENTION_STORE_LAYOUTS[cache_layout]
    layout = cls(
        metadata, block, hbs or rng.choice([1, chunk]), local_tp, store_tp, rng.randrange(local_tp),
        (spec,) * layers, store_chunk_size=chunk,
    )  # fmt: skip
    caches = attention_caches(torch, cache_layout, layers, blocks, kernel, local_heads, block // kernel, 2 * head_size)
    layout.register_kv_caches(caches, blocks)
    return layout, caches


def mamba_spec(torch: Any, mamba_type: Any, spec_cls: Any, kind: str, local_tp: int, dim_first: bool) -> Any:
    """A GDN or Mamba2 state spec shaped as vLLM's own layout tests build them (uint8 states)."""
    if kind == "gdn":
        factor = 4 // local_tp
        conv = (6 * factor, 3)
        ssm = (factor, 2, 2)
        backend = mamba_type.GDN_ATTN
    else:
        conv = ((8 + 2 * local_tp * 2) // local_tp, 3)
        ssm = (4 // local_tp, 2, 2)
        backend = mamba_type.MAMBA2
    if not dim_first:
        conv = conv[::-1]
    return spec_cls(block_size=16, shapes=(conv, ssm), dtypes=(torch.uint8, torch.uint8), mamba_type=backend)


def mamba_cache(rng: random.Random, torch: Any, blocks: int, state_bytes: int) -> Any:
    """A (blocks, 1, 1, bytes) uint8 cache: packed, or a view of padded pages (block stride above the state)."""
    pad = rng.choice([0, 0, 16, 100])
    raw = torch.empty((blocks, state_bytes + pad), dtype=torch.uint8)
    return raw[:, : state_bytes + rng.choice([0, pad])].unsqueeze(1).unsqueeze(1)


# --- the receive handler --------------------------------------------------------------------------------------


def _answer(behaviour: str, keys: list[str]) -> Any:
    if behaviour == "raise":
        raise RuntimeError("store down")
    if behaviour == "short":
        return [4096] * (len(keys) - 1)
    codes = [-704 if sum(key.encode()) % 3 == 0 else 4096 for key in keys]  # per key: batching changes nothing
    if behaviour == "fail":
        return codes
    if behaviour == "tuple":  # other iterables of codes, some failed, some zero (not a failure)
        return tuple(0 if c > 0 and len(key) % 2 else c for c, key in zip(codes, keys))
    if behaviour == "iter":
        return iter(codes)
    if behaviour == "numpy":
        return np.asarray(codes, dtype=np.int64)
    return [4096] * len(keys)


class ListStore:
    """A store offering only Mooncake's list call; records each call with the Python types of what it got."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.calls: list[tuple[Any, ...]] = []

    def batch_get_into_multi_buffers(self, keys: Any, addrs: Any, sizes: Any) -> Any:
        rows = [list(r) for r in addrs], [list(r) for r in sizes]
        self.calls.append((list(keys), *rows, types_of(keys, addrs, sizes)))
        return _answer(self.behaviour, list(keys))


def types_of(keys: Any, addrs: Any, sizes: Any) -> tuple[Any, ...]:
    """The Python types a store call got: containers, rows, values."""
    return (
        type(keys), type(addrs), type(sizes),
        frozenset(type(r) for r in addrs) | frozenset(type(r) for r in sizes),
        frozenset(type(v) for r in addrs for v in r) | frozenset(type(v) for r in sizes for v in r),
    )  # fmt: skip


LIST_TYPES = (list, list, list, frozenset({list}), frozenset({int}))


class WrapperLikeStore(ListStore, ArrayStore):
    """Offers the array entry as our store wrappers do and, like them, keeps ``ArrayStore``'s ragged entry:
    rows of different widths become one array call per width (first-seen width first). Each array call is
    recorded as the Mooncake call it becomes."""

    def __init__(self, behaviour: str) -> None:
        super().__init__(behaviour)
        self.ragged = 0

    def batch_get_into_multi_buffers_arrays(self, keys: Any, addrs: Any, sizes: Any) -> Any:
        assert type(keys) is list and all(type(k) is str for k in keys)
        assert isinstance(addrs, np.ndarray) and isinstance(sizes, np.ndarray)
        assert addrs.dtype == np.int64 and sizes.dtype == np.int64 and addrs.ndim == 2
        assert addrs.shape == sizes.shape and addrs.shape[0] == len(keys)
        return self.batch_get_into_multi_buffers(keys, addrs.tolist(), sizes.tolist())  # recorded as lists

    def batch_get_into_multi_buffers_ragged(self, keys: Any, addrs: Any, sizes: Any, widths: Any) -> Any:
        self.ragged += 1
        return super().batch_get_into_multi_buffers_ragged(keys, addrs, sizes, widths)


def as_wrapper_calls(calls: list[tuple[Any, ...]], behaviour: str) -> list[tuple[Any, ...]]:
    """vLLM's list calls as our wrappers pass them on to Mooncake: a call whose rows differ in width becomes one
    call per width, in the order each width first appears (a raising or short-answering store stops after the
    first of them, as the wrapper's merge does)."""
    out: list[tuple[Any, ...]] = []
    for keys, addrs, sizes, _types in calls:
        widths = [len(r) for r in addrs]
        parts = []
        for w in dict.fromkeys(widths):
            picks = [i for i, x in enumerate(widths) if x == w]
            part = [keys[i] for i in picks], [addrs[i] for i in picks], [sizes[i] for i in picks]
            parts.append((*part, types_of(*part)))
        if behaviour in ("raise", "short"):
            parts = parts[:1]
        out.extend(parts)
    return out


class Coord:
    def __init__(self, masks: Any) -> None:
        self.masks = masks

    def load_mask(self, block_hashes: Any, token_len: int) -> Any:
        return self.masks


def run_handler(worker: ModuleType, handler: Any, store: Any, case: dict[str, Any]) -> tuple[Any, ...]:
    """``handler`` on a fresh vLLM 0.34 receive thread; every observable side effect."""
    records: list[tuple[Any, ...]] = []
    errors: list[tuple[Any, list[int]]] = []

    def record(**kwargs: Any) -> None:
        assert kwargs.pop("duration_seconds") >= 0
        records.append(tuple(sorted(kwargs.items())))

    q: queue.Queue[Any] = queue.Queue()
    q.put(case["meta"])
    q.get()
    thread = worker.KVCacheStoreRecvingThread(
        store, Coord(case["masks"]), case["dbs"], case["block_size"], case["tp_rank"], threading.Event(),
        disk_offload_buffer_budget_bytes=case["budget"], record_operation=record, request_queue=q,
        group_participates=case["participates"], is_hma_required=case["hma"],
    )  # fmt: skip
    report = thread._report_load_error

    def report_and_record(req_id: Any, block_ids: Any) -> None:
        errors.append((req_id, list(block_ids)))
        report(req_id, block_ids)

    thread._report_load_error = report_and_record
    try:
        handler(thread, case["meta"])
        result: Any = "ok"
    except Exception as exc:
        result = type(exc)
    return (
        result,
        store.calls,
        records,
        errors,
        sorted(thread.get_and_clear_block_ids_with_load_errors()),
        sorted(thread.get_and_clear_failed_requests()),
        sorted(thread.get_and_clear_finished_requests()),
        q.unfinished_tasks,
    )


class LayoutPool:
    """Layouts built once from real tensors (kept alive here) and reused by many requests: ``(layout, the Store
    chunk its database walks by)``."""

    def __init__(self, items: list[tuple[Any, int, Any]]) -> None:
        self.items = items

    def get(self, rng: random.Random) -> tuple[Any, int]:
        layout, chunk, _tensors = rng.choice(self.items)
        return layout, chunk


#: Raw budgets equal to one key's staging estimate (its bytes rounded up to 4096, plus 8192 of padding): a key
#: exactly at the budget is loaded alone, one byte over it skips the request.
EXACT_BUDGETS = (12_288, 16_384, 20_480)


def receive_case(
    rng: random.Random, data: ModuleType, layout_mod: ModuleType, pool: LayoutPool | None
) -> dict[str, Any]:
    """One load request for vLLM 0.34's receive thread: 1-3 KV-cache groups (rank-local with chunks of a block;
    TP-shared with Store chunks below a block, masks read per physical block; tensor-built layouts from
    ``pool``), sometimes a database whose chunk is not its layout's (vLLM's handler then plans it)."""
    metadata = data.KeyMetadata(rng.choice(["m/x", "modèle/ü"]), rng.randrange(4), 0, 0, 0)
    hbs = 16
    groups = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(["rank_local", "rank_local", "sharded", "sharded", "sharded", "tensor"])
        if kind == "tensor" and pool is not None:
            layout, chunk = pool.get(rng)
            groups.append((layout, chunk, layout.hash_block_size))
            continue
        if kind == "rank_local":
            block = rng.choice([16, 32, 64])
            layout = layout_mod.RankLocalStoreLayout(metadata, block, hbs)
            regions = rng.choice([2, 3]) if rng.random() < 0.6 else rng.randint(0, 5)
            layout.set_kv_caches_base_addr([rng.randrange(1 << 20, 1 << 40) for _ in range(regions)])
            strides = [rng.choice([4096, 8192]) for _ in range(rng.randint(1, max(1, regions)))]
            layout.set_block_len(strides)
            layout.block_len = [s - rng.choice([0, 256, 2048]) for s in strides]
            chunk = block if rng.random() < 0.93 else 2 * block
        else:
            block = rng.choice([32, 64, 128])
            chunk = block // rng.choice([d for d in (1, 2, 4) if block // d >= hbs])
            local_tp, store_tp = rng.choice([(1, 1), (1, 2), (2, 4), (2, 2), (1, 4), (4, 8)])
            layout = layout_mod.TPShardedStoreLayout(metadata, block, hbs, local_tp, store_tp,
                                                     rng.randrange(local_tp), chunk)  # fmt: skip
            width = rng.choice([2, 2, 3]) if rng.random() < 0.6 else rng.randint(1, 4)
            layout._set_segment_templates(
                [
                    [
                        (
                            [rng.randrange(1 << 20, 1 << 40) for _ in range(width)],
                            [rng.choice([4096, 65_536]) for _ in range(width)],
                            [rng.choice([128, 512]) for _ in range(width)],
                        )
                        for _ in range(layout.shards_per_rank)
                    ]
                    for _ in range(block // chunk)
                ]
            )
            if rng.random() < 0.05:
                chunk = block if chunk != block else block // 2  # not the layout's Store chunk
        groups.append((layout, chunk, hbs))
    lcm = math.lcm(*(g[0].block_size for g in groups))
    blocks = rng.choice([0, 1, 2, 3, 4, 5, 6, 8])
    token_len = blocks * lcm
    if rng.random() < 0.3:
        token_len = max(0, token_len - hbs * rng.randint(1, 3))  # a partial tail chunk
    if rng.random() < 0.02:
        token_len += 3  # not hash-block aligned: vLLM asserts
    n_hashes = max(0, token_len // hbs + rng.choice([0, 0, 0, 0, 0, 1, 3, -1]))
    hashes = [rng.randbytes(32) for _ in range(n_hashes)]
    block_hashes: Any = hashes
    if rng.random() < 0.5:
        block_hashes = data.BlobBlockHashes(memoryview(b"".join(hashes)), 32)
    dbs, masks, block_ids = [], [], []
    for layout, chunk, group_hbs in groups:
        dbs.append(data.ChunkedTokenDatabase(metadata, chunk, group_hbs, layout))
        physical = -(-token_len // layout.block_size)
        mask: Any = [rng.random() < 0.8 for _ in range(max(0, physical + rng.randint(-2, 2)))]
        if rng.random() < 0.05:  # truthy values other than bools, or a tuple (vLLM reads each item's truth)
            mask = [rng.choice([1, 0, 2, None, True]) for _ in mask] if rng.random() < 0.5 else tuple(mask)
        masks.append(mask)
        ids_len = max(0, physical - (1 if rng.random() < 0.03 else 0))
        ids: Any = [rng.randrange(0, 2000) for _ in range(ids_len)]
        block_ids.append(tuple(ids) if rng.random() < 0.05 else ids)
    tails = []
    for g in range(len(groups) + 1):  # a boundary for a group that does not exist is ignored
        if token_len >= hbs and rng.random() < 0.35:
            tails.append(data.TailKeyBoundary(g, rng.randrange(0, token_len + 1, hbs)))
    spec = data.LoadSpec(
        vllm_cached_tokens=rng.choice([0, 0, 0, 0, 8, 16, 17, 32, 64, 100, token_len]),
        kvpool_cached_tokens=token_len, can_load=True, token_len=token_len, tail_key_boundaries=tuple(tails),
    )  # fmt: skip
    meta = data.ReqMeta(
        req_id=f"req-{rng.randrange(1000)}", token_len_chunk=token_len, block_ids=tuple(block_ids),
        block_hashes=block_hashes, load_spec=spec,
    )  # fmt: skip
    return {
        "dbs": dbs,
        "masks": tuple(masks),
        "participates": [rng.random() < 0.85 for _ in groups],
        "block_size": rng.choice([16, 32, 64]),
        "tp_rank": rng.randint(0, 7),
        "hma": rng.random() < 0.2,
        "meta": meta,
        # Disk-offload staging budgets: none, one that holds everything, ones that split the load, one below a
        # single key's estimate (vLLM skips the request).
        "budget": rng.choice([None, None, None, 1 << 30, 13_000, 30_000, 60_000, 120_000, 5_000, *EXACT_BUDGETS]),
    }
