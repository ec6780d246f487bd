"""vLLM 0.34's environment as the 0.34 test leg sees it (.ci/test runs the ``vllm`` tests there).

The environment checks of the vLLM 0.34 leg: the installed vLLM is a 0.34 release, its Mooncake store
``layout`` module (new in 0.34) imports, our plugin's entry point imports no store module, and once they are
imported exactly what its PatchReport names is ours on vLLM's classes. The 0.34 port's own tests are marked
``vllm_release("0.34")`` like these.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_release("0.34")]

STORE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store"

# Run in a fresh interpreter: imports vLLM, runs the plugin's entry point as vLLM's plugin loader does, records
# which store modules that imported, then imports them itself, lists every class attribute that is ours and
# what the plugin's PatchReport says it replaced.
_PROBE = f"""
import importlib, inspect, json, sys
import vllm
from mooncake_kvaddr.integrations.vllm import plugin
plugin.register()
after_register = sorted(m for m in sys.modules if m.startswith({STORE!r}))
ours = []
modules = [importlib.import_module({STORE!r} + "." + name) for name in ("layout", "data", "worker")]
for module in modules:  # listed after all three are imported: the deferred patch runs at the data module's import
    for cls_name, cls in inspect.getmembers(module, inspect.isclass):
        for attr, value in vars(cls).items():
            func = getattr(value, "__func__", value)
            if (getattr(func, "__module__", None) or "").startswith("mooncake_kvaddr"):
                ours.append(cls_name + "." + attr)
report = plugin.patch()
print(json.dumps({{"version": vllm.__version__, "after_register": after_register, "ours": sorted(set(ours)),
                  "patched": report.patched, "staged_hook": report.staged_hook}}))
"""


@pytest.fixture(scope="module")
def probe() -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MOONCAKE_KVADDR_VLLM_PLUGIN": "1"},
        check=False,
    )
    if done.returncode != 0:  # not an AssertionError: the xfail below expects only its own assertion to fail
        raise RuntimeError(f"the probe failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_installed_vllm_is_034() -> None:
    import vllm

    assert vllm.__version__.startswith("0.34."), vllm.__version__


def test_store_layout_module_of_034_imports() -> None:
    layout = importlib.import_module(f"{STORE}.layout")
    # What the 0.34 port replaces first: both layouts' prepare_values and key_for.
    for cls_name in ("RankLocalStoreLayout", "TPShardedStoreLayout"):
        cls = getattr(layout, cls_name)
        assert callable(cls.prepare_values) and callable(cls.key_for)
    assert not hasattr(layout.RankLocalStoreLayout, "prepare_value_for_block")  # gone in 0.34


def test_plugin_register_imports_no_store_module(probe: dict[str, Any]) -> None:
    assert probe["version"].startswith("0.34.")
    assert probe["after_register"] == []


def test_what_is_ours_on_vllm_034_is_what_the_patch_report_names(probe: dict[str, Any]) -> None:
    patched, ours = set(probe["patched"]), set(probe["ours"])
    assert patched <= ours
    # Beyond the report's list only the staged-transport hook's wrappers of the worker may be ours.
    extra = ours - patched
    assert not extra or (probe["staged_hook"] and all(name.startswith("MooncakeStoreWorker.") for name in extra))


_FIRST = f"""
import importlib, json, sys
import vllm
from mooncake_kvaddr.integrations.vllm import plugin
plugin.register()
importlib.import_module({STORE!r} + "." + sys.argv[1])  # imports data itself, before the worker imports it
importlib.import_module({STORE!r} + ".worker")
report = plugin.patch()
print(json.dumps({{"patched": report.patched, "staged_hook": report.staged_hook,
                  "reasons": [report.receive_reason, report.lookup_reason, report.send_reason, report.hook_reason]}}))
"""


@pytest.mark.parametrize("first", ["selective_lease", "protocol"])
def test_a_store_module_the_worker_imports_imported_first_patches_every_part(first: str) -> None:
    """vLLM 0.34's ``selective_lease`` and ``protocol`` import ``data`` and are imported by ``worker``: imported
    first, ``data`` executes while they are half-executed, when ``worker`` cannot be imported yet. The deferred
    patch must wait for ``worker`` (as for ``data`` imported by ``worker``), not patch the layouts alone with no
    reason given for the worker's parts."""
    done = subprocess.run(
        [sys.executable, "-c", _FIRST, first],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MOONCAKE_KVADDR_VLLM_PLUGIN": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["reasons"] == ["", "", "", ""], result
    assert {"KVCacheStoreRecvingThread._handle_request", "MooncakeStoreWorker.lookup",
            "KVCacheStoreSendingThread._handle_request"} <= set(result["patched"]), result  # fmt: skip
    assert result["staged_hook"], result
