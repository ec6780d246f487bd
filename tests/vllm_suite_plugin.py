"""pytest plugin for .ci/vllm-suite: vLLM's own Mooncake store connector tests with mooncake_kvaddr's vLLM plugin
on or off (docs/vllm-plugin.md, "vLLM's own tests").

Loaded with ``-p vllm_suite_plugin``; ``MOONCAKE_KVADDR_VLLM_SUITE`` says the mode:

- ``on``: before anything is collected, vLLM's own plugin loader (``vllm.plugins.load_general_plugins()``) runs
  the package's ``vllm.general_plugins`` entry point, as in every vLLM process. After collection (vLLM's test
  modules have imported the Mooncake store modules by then) vLLM's classes must carry the plugin's methods,
  both handlers and the lookup included, and ``plugin.is_patched()`` must say so; at the end they must still be there.
  The summary prints how many requests each handler planned itself and how many it handed to vLLM's.
- ``off``: the baseline. ``MOONCAKE_KVADDR_VLLM_PLUGIN=0`` must be set (vLLM loads its plugins itself in some
  code paths) and nothing may be patched at the end.

A failed requirement is a usage error of the whole run (pytest exits non-zero), never a skipped test.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

MODE_VAR = "MOONCAKE_KVADDR_VLLM_SUITE"
RECEIVE_MODULE = "mooncake_kvaddr.integrations.vllm.receive"
PLUGIN_MODULE = "mooncake_kvaddr.integrations.vllm.plugin"


def _mode() -> str:
    mode = os.environ.get(MODE_VAR, "")
    if mode not in ("on", "off"):
        raise pytest.UsageError(f"{MODE_VAR} must be 'on' or 'off', got {mode!r}")
    return mode


def _vllm_classes() -> tuple[Any, Any]:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import data, worker

    return data, worker


def _patched_now() -> list[str]:
    """vLLM's attributes that are the plugin's right now (read off vLLM's classes, not the plugin's state)."""
    data, worker = _vllm_classes()
    found = []
    for cls, name in (
        (data.RankLocalStoreLayout, "prepare_values"),
        (data.RankLocalStoreLayout, "key_for"),
        (data.TPShardedStoreLayout, "prepare_values"),
        (data.TPShardedStoreLayout, "key_for"),
        (worker.KVCacheStoreRecvingThread, "_handle_request"),
        (worker.KVCacheStoreSendingThread, "_handle_request"),
        (worker.MooncakeStoreWorker, "lookup"),
    ):
        func = cls.__dict__.get(name)
        if getattr(func, "__module__", "").startswith("mooncake_kvaddr."):
            found.append(f"{cls.__name__}.{name}")
    return found


def pytest_configure(config: pytest.Config) -> None:
    mode = _mode()
    config.stash[_MODE] = mode
    if mode == "off":
        if os.environ.get("MOONCAKE_KVADDR_VLLM_PLUGIN") != "0":
            raise pytest.UsageError("the baseline run needs MOONCAKE_KVADDR_VLLM_PLUGIN=0")
        return
    import vllm.plugins

    vllm.plugins.load_general_plugins()


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.stash[_MODE] != "on":
        return
    found = _patched_now()
    if len(found) != _EXPECTED:
        raise pytest.UsageError(f"the plugin is not active after collection (patched: {found})")
    from mooncake_kvaddr.integrations.vllm import plugin

    if not plugin.is_patched() or not plugin.is_receive_patched():
        raise pytest.UsageError("plugin.is_patched()/is_receive_patched() is False with the plugin's methods in place")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    mode = session.config.stash.get(_MODE, None)
    if mode is None:
        return
    found = _patched_now()
    ok = len(found) == _EXPECTED if mode == "on" else not found
    if not ok:
        session.config.stash[_PROBLEM] = f"plugin {mode}, but vLLM's patched attributes at the end: {found}"
        session.exitstatus = pytest.ExitCode.USAGE_ERROR


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    mode = config.stash.get(_MODE, None)
    if mode is None:
        return
    problem = config.stash.get(_PROBLEM, "")
    if problem:
        terminalreporter.write_line(f"vllm-suite: FAILED: {problem}", red=True)
    line = f"vllm-suite: mooncake_kvaddr plugin {mode}"
    if mode == "on":
        _, worker = _vllm_classes()
        for what, cls in (("receive", worker.KVCacheStoreRecvingThread), ("send", worker.KVCacheStoreSendingThread)):
            stats = getattr(cls.__dict__.get("_handle_request"), "stats", None)
            if stats is not None:
                line += (
                    f"; {what} handler: {stats.fast_requests} request(s) planned natively, "
                    f"{stats.fallback_requests} handed to vLLM's handler (last reason: {stats.last_fallback or '-'})"
                )
    terminalreporter.write_line(line)


#: The replaced attributes :func:`_patched_now` reads: four layout methods, both handlers, the lookup.
_EXPECTED = 7
_MODE = pytest.StashKey[str]()
_PROBLEM = pytest.StashKey[str]()
