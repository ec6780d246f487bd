"""The vLLM plugin (integrations/vllm/plugin.py): patches vLLM 0.33's own layouts after a self-check."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from mooncake_kvaddr.integrations.vllm import plugin

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import data as V
except Exception as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"vllm==0.33.0 is not importable here: {exc!r}", allow_module_level=True)


@pytest.fixture
def patched() -> Iterator[None]:
    assert plugin.register()
    yield
    plugin.unregister()


def test_switch_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugin.ENV_SWITCH, "0")
    assert plugin.register() is False
    assert V.RankLocalStoreLayout.prepare_values.__module__.startswith("vllm")


def test_patched_layouts_match_vllm_on_generated_cases(patched: None) -> None:
    rng = random.Random(7)
    assert V.RankLocalStoreLayout.prepare_values is plugin._rank_local_prepare_values
    original = plugin._originals[(V.RankLocalStoreLayout, "prepare_values")]
    for _ in range(300):
        layout = V.RankLocalStoreLayout(V.KeyMetadata("m", 0, 0, 0, 0), 128, 128)
        layout.set_kv_caches_base_addr([rng.randrange(1 << 47) for _ in range(rng.randrange(0, 20))])
        layout.set_block_len([rng.randrange(1, 1 << 16) for _ in range(rng.randrange(1, 5))])
        ids = [rng.randrange(1 << 30) for _ in range(10)]
        chunks = [(b * 128, (b + rng.randrange(1, 3)) * 128) for b in rng.sample(range(8), 5)]
        args: tuple[Any, ...] = (chunks, ids, [0] * len(chunks))
        assert layout.prepare_values(*args) == original(layout, *args)
        layout.kv_caches_base_addr = [1 << 40]  # reassigned by the caller: seen
        assert layout.prepare_values(*args) == original(layout, *args)
        layout.block_len[0] = 77  # edited in place: seen
        assert layout.prepare_values(*args) == original(layout, *args)


def test_patched_tp_layout_after_reregistration(patched: None) -> None:
    torch = pytest.importorskip("torch")
    original = plugin._originals[(V.TPShardedStoreLayout, "prepare_values")]
    layout = V.LBNHCStoreLayout(V.KeyMetadata("m", 0, 0, 0, 0), 4, 4, 1, 2, 0, 2)
    for _ in range(2):  # registering again replaces the template arrays: the engine follows
        caches = [torch.zeros(3, 4, 2, 8, dtype=torch.float16).permute(0, 2, 1, 3) for _ in range(2)]
        layout.register_kv_caches(caches, 3)
        chunks = [(b * 4, b * 4 + 4) for b in range(3) for _ in (0, 1)]
        args = (chunks, [5, 6, 7], [0, 1] * 3)
        assert layout.prepare_values(*args) == original(layout, *args)
