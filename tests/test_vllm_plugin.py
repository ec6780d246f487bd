"""The vLLM plugin (docs/vllm-plugin.md): shape/version checks, the self-check, patching, the environment
switch, differential checks of the patched methods against vLLM 0.33's own, and the staged store wrapper
(against an in-memory store with Mooncake's result codes, and against the real Mooncake)."""

from __future__ import annotations

import ctypes
import logging
import re
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake_kvaddr.driver.staging import StagingBuffer
from mooncake_kvaddr.integrations.vllm import layouts as vllm_layouts
from mooncake_kvaddr.integrations.vllm import plugin, transports
from mooncake_kvaddr.integrations.vllm.import_hook import AfterImportHook
from mooncake_kvaddr.integrations.vllm.staged_store import StagedMooncakeStore


def _vllm_data() -> Any:
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm==0.33.0)")
    return pytest.importorskip(plugin.DATA_MODULE, reason="vLLM has no Mooncake store module")


@pytest.fixture
def data() -> Iterator[Any]:
    """vLLM's data module, unpatched before and after the test."""
    module = _vllm_data()
    plugin.unpatch()
    yield module
    plugin.unpatch()


# --- the plugin ------------------------------------------------------------------------------------------------


@pytest.mark.vllm
def test_register_patches_once_logs_one_line_and_unpatch_restores(
    data: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(plugin.ENV_PLUGIN, raising=False)
    original = data.RankLocalStoreLayout.__dict__["prepare_values"]
    with caplog.at_level(logging.INFO, logger="vllm.mooncake_kvaddr"):
        plugin.register()
        plugin.register()  # vLLM may call plugins twice per process
    lines = [r for r in caplog.records if r.name == "vllm.mooncake_kvaddr" and "active" in r.getMessage()]
    assert len(lines) == 1 and "0.3" in lines[0].getMessage()
    assert plugin.is_patched()
    assert data.RankLocalStoreLayout.prepare_values is vllm_layouts._rank_local_prepare_values
    assert data.TPShardedStoreLayout.prepare_values is vllm_layouts._sharded_prepare_values
    assert data.LBNHCStoreLayout.prepare_values is vllm_layouts._sharded_prepare_values
    plugin.unpatch()
    assert data.RankLocalStoreLayout.__dict__["prepare_values"] is original
    assert not plugin.is_patched()


@pytest.mark.vllm
@pytest.mark.parametrize("value", ["0", "false", "OFF", "no"])
def test_environment_switch_turns_it_off(data: Any, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(plugin.ENV_PLUGIN, value)
    plugin.register()
    assert not plugin.is_patched()
    assert data.RankLocalStoreLayout.prepare_values is not vllm_layouts._rank_local_prepare_values


@pytest.mark.vllm
def test_unknown_release_is_left_untouched(data: Any) -> None:
    report = plugin.patch(data=data, version="0.31.2")
    assert not report.active and "0.31.2" in report.reason
    assert not plugin.is_patched()


@pytest.mark.vllm
def test_a_data_module_given_without_a_worker_patches_only_the_layouts(data: Any) -> None:
    """``patch(data=..., version=...)`` without ``worker`` works on that data module alone: vLLM's worker module
    is not imported in its place, so only the layouts are replaced (no transport hook, no handler, no lookup)."""
    import vllm

    report = plugin.patch(data=data, version=str(vllm.__version__))
    assert report.active
    assert report.patched == [f"{cls_name}.{name}" for cls_name, name, _ in vllm_layouts.REPLACEMENTS]
    assert not report.staged_hook and report.hook_reason == ""
    assert not plugin.is_receive_patched() and not plugin.is_send_patched()


@pytest.mark.vllm
def test_the_transport_hook_is_installed_only_on_the_worker_it_was_checked_against(data: Any) -> None:
    """vLLM's own ``MooncakeStoreWorker`` gets the transport hook (``register_kv_caches`` wrapped, the report
    says so); a worker whose ``close`` is not the function the hook was checked against keeps its methods, and
    the report names why."""
    import vllm

    worker = pytest.importorskip(plugin.WORKER_MODULE)
    version = str(vllm.__version__)
    original = worker.MooncakeStoreWorker.__dict__["register_kv_caches"]
    report = plugin.patch(data=data, worker=worker, version=version, receive=False, lookup=False, send=False)
    assert report.active and report.staged_hook and report.hook_reason == ""
    assert worker.MooncakeStoreWorker.__dict__["register_kv_caches"].__wrapped__ is original
    plugin.unpatch()
    assert worker.MooncakeStoreWorker.__dict__["register_kv_caches"] is original

    class OwnClose(worker.MooncakeStoreWorker):  # type: ignore[misc, name-defined]
        def close(self) -> None:
            return None

    fake = _module_with(worker, MooncakeStoreWorker=OwnClose)
    report = plugin.patch(data=data, worker=fake, version=version, receive=False, lookup=False, send=False)
    assert report.active and not report.staged_hook
    assert report.hook_reason.startswith("MooncakeStoreWorker.close is not the function")
    assert "register_kv_caches" not in OwnClose.__dict__ and not hasattr(OwnClose.__dict__["close"], "__wrapped__")
    assert worker.MooncakeStoreWorker.__dict__["register_kv_caches"] is original


def _module_with(data: Any, **replace: Any) -> types.ModuleType:
    fake = types.ModuleType("fake_vllm_data")
    fake.__dict__.update({k: v for k, v in vars(data).items() if not k.startswith("__")})
    fake.__dict__.update(replace)
    return fake


@pytest.mark.vllm
def test_unexpected_shape_is_left_untouched(data: Any) -> None:
    class Renamed(data.RankLocalStoreLayout):  # type: ignore[misc, name-defined]
        def prepare_values(self, chunks: Any, block_ids: Any, store_shards: Any) -> Any:
            return super().prepare_values(chunks, block_ids, store_shards)

    report = plugin.patch(data=_module_with(data, RankLocalStoreLayout=Renamed), version="0.33.0")
    assert not report.active and "store_shards" in report.reason
    report = plugin.patch(data=_module_with(data, TPShardedStoreLayout=None), version="0.33.0")
    assert not report.active and "TPShardedStoreLayout" in report.reason
    assert not plugin.is_patched()


@pytest.mark.vllm
def test_self_check_catches_a_release_that_behaves_differently(data: Any) -> None:
    class Shifted(data.RankLocalStoreLayout):  # type: ignore[misc, name-defined]
        def prepare_values(self, chunks: Any, block_ids: Any, shard_ids: Any) -> Any:
            addrs, sizes, ids = super().prepare_values(chunks, block_ids, shard_ids)
            return addrs, sizes, [i + 1 for i in ids]

    report = plugin.patch(data=_module_with(data, RankLocalStoreLayout=Shifted), version="0.33.0")
    assert not report.active and "self-check" in report.reason
    assert not plugin.is_patched()


@pytest.mark.vllm
def test_self_check_compares_types_too(data: Any) -> None:
    class NumpyInts(data.RankLocalStoreLayout):  # type: ignore[misc, name-defined]
        def prepare_value_for_block(self, block_id: int) -> Any:
            addrs, sizes = super().prepare_value_for_block(block_id)
            return [np.int64(a) for a in addrs], sizes

    with pytest.raises(AssertionError, match="prepare_value_for_block"):
        plugin.self_check(_module_with(data, RankLocalStoreLayout=NumpyInts))


@pytest.mark.vllm
def test_register_warns_once_when_it_cannot_patch(
    data: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(plugin.ENV_PLUGIN, raising=False)
    monkeypatch.setattr(plugin, "SUPPORTED_VLLM_SERIES", ("9.9.",))
    monkeypatch.setattr(plugin, "_WARNED", False)
    with caplog.at_level(logging.WARNING, logger="vllm.mooncake_kvaddr"):
        plugin.register()
        plugin.register()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "untouched" in r.getMessage()]
    assert len(warnings) == 1
    assert not plugin.is_patched()


def test_a_fresh_process_warns_on_its_first_failed_activation() -> None:
    """The one "left untouched" warning is the first one of the process: a process whose activation fails logs
    it (once), with nothing reset by hand (the test above resets the once-flag; this one starts fresh)."""
    import subprocess
    import sys

    script = (
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format='%(levelname)s %(message)s')\n"
        "from mooncake_kvaddr.integrations.vllm import plugin as p\n"
        "p.patch = lambda: p.PatchReport(vllm_version='9.9.0', reason='not a release it knows')\n"
        "p._activate()\n"
        "p._activate()\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    lines = [line for line in out.stdout.splitlines() if "left untouched" in line]
    assert lines == ["WARNING mooncake_kvaddr: vLLM left untouched: not a release it knows"]


@pytest.mark.vllm
def test_register_on_an_unknown_release_imports_no_store_module() -> None:
    """Deciding not to patch needs only ``vllm.__version__``: on a release the plugin does not know, ``register``
    imports none of vLLM's Mooncake store modules (they cost ~5 s on vLLM 0.34), installs no import hook and
    logs one warning however often it is called (docs/vllm-plugin.md, "Start-up")."""
    import subprocess
    import sys

    pytest.importorskip("vllm", reason="the child imports the installed vLLM")

    script = (
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format='%(levelname)s %(message)s')\n"
        "import vllm\n"
        "vllm.__version__ = '9.9.0'\n"
        "from mooncake_kvaddr.integrations.vllm import plugin as p\n"
        "p.register()\n"
        "p.register()\n"
        "print('IMPORTED', sorted(m for m in sys.modules if '.mooncake.store' in m))\n"
        "print('HOOKS', sum(type(f).__name__ == 'AfterImportHook' for f in sys.meta_path))\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("VLLM_PLUGINS", plugin.ENV_PLUGIN)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                         check=True)
    lines = out.stdout.splitlines()
    assert "IMPORTED []" in lines and "HOOKS 0" in lines, out.stdout
    warnings = [line for line in lines if "left untouched" in line]
    assert warnings == ["WARNING mooncake_kvaddr: vLLM left untouched: vLLM 9.9.0 is not a release this plugin knows "
                        f"({'x, '.join(plugin.SUPPORTED_VLLM_SERIES)}x)"], out.stdout


@pytest.mark.vllm
def test_unpatch_takes_a_pending_import_hook_out_of_sys_meta_path(data: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``register`` (even twice) before the store modules are imported puts one import hook on ``sys.meta_path``;
    ``unpatch`` takes it out again (nothing left behind to fire later) and patches nothing."""
    import sys

    monkeypatch.delenv(plugin.ENV_PLUGIN, raising=False)
    monkeypatch.setattr(plugin, "_WATCHED", ("kvaddr_absent_store.data", "kvaddr_absent_store.worker"))
    before = list(sys.meta_path)
    try:
        plugin.register()
        plugin.register()  # vLLM may call plugins twice per process: still one hook
        hooks = [f for f in sys.meta_path if isinstance(f, AfterImportHook)]
        assert len(hooks) == 1
        plugin.unpatch()
        assert sys.meta_path == before
        assert not plugin.is_patched()
    finally:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, AfterImportHook)]


def test_the_deferred_loader_leaves_the_module_with_its_own_loader() -> None:
    """The loader the import hook wraps runs the real one and then puts the real one back on the module and on
    its spec, so the imported module looks untouched (docs/vllm-plugin.md, "Start-up")."""
    import importlib.machinery

    class Loader:
        def create_module(self, spec: Any) -> None:
            return None

        def exec_module(self, module: types.ModuleType) -> None:
            module.ran = set(hook.executing)  # type: ignore[attr-defined]

    from mooncake_kvaddr.integrations.vllm import import_hook

    real = Loader()
    called: list[tuple[str, bool, set[str]]] = []
    hook = import_hook.AfterImportHook(
        "kvaddr_absent_store", lambda name: called.append((name, module.__loader__ is real, set(hook.executing)))
    )
    wrapped = import_hook._ThenCall(real, "kvaddr_absent_store.other", hook)
    module = types.ModuleType("kvaddr_absent_store.other")
    module.__spec__ = importlib.machinery.ModuleSpec("kvaddr_absent_store.other", wrapped)
    module.__loader__ = wrapped
    wrapped.exec_module(module)
    assert module.ran == {"kvaddr_absent_store.other"}  # type: ignore[attr-defined]  # executing while it ran
    assert module.__loader__ is real and module.__spec__.loader is real
    # After the module ran: its own loader back on it, and no longer executing.
    assert called == [("kvaddr_absent_store.other", True, set())]


def test_replacing_an_attribute_twice_keeps_vllms_original() -> None:
    from mooncake_kvaddr.integrations.vllm import registry

    class Target:
        def method(self) -> str:
            return "vllm"

    original = Target.__dict__["method"]
    try:
        registry.replace_attribute(Target, "method", lambda self: "first")
        registry.replace_attribute(Target, "method", lambda self: "second")
        assert registry.ORIGINALS[(Target, "method")] is original
        assert registry.original_of(Target, "method") is original
    finally:
        registry.ORIGINALS.pop((Target, "method"), None)


def test_restoring_puts_vllms_attributes_back_and_signature_checks_name_what_differs() -> None:
    """``restore_all`` puts back an attribute the class had and deletes one it only inherited (the base's shows
    through again); ``original_of`` finds vLLM's own method through a base class; ``signature_problem`` names a
    missing method, one without a readable signature and one with other parameters, and nothing when they
    match (the plugin then replaces nothing of that part)."""
    from mooncake_kvaddr.integrations.vllm import registry

    class Base:
        def inherited(self) -> str:
            return "base"

        def method(self, keys: list[str], ids: list[int]) -> str:
            return "vllm"

    class Child(Base):
        pass

    saved = dict(registry.ORIGINALS)
    registry.ORIGINALS.clear()
    try:
        registry.replace_attribute(Base, "method", lambda self, keys, ids: "ours")
        registry.replace_attribute(Child, "inherited", lambda self: "ours")
        assert Child().method([], []) == Child().inherited() == "ours"
        assert registry.original_of(Child, "method")(Child(), [], []) == "vllm"
        assert registry.original_of(Child, "inherited")(Child()) == "base"
        with pytest.raises(AttributeError, match=r"Child\.absent"):
            registry.original_of(Child, "absent")
        registry.restore_all()
        assert Child().method([], []) == "vllm" and Child().inherited() == "base"
        assert "inherited" not in Child.__dict__ and registry.ORIGINALS == {}
    finally:
        registry.ORIGINALS.clear()
        registry.ORIGINALS.update(saved)
    assert registry.signature_problem(Child, "method", ("keys", "ids")) == ""
    assert registry.signature_problem(Child, "method", ("keys",)) == (
        "Child.method takes ('keys', 'ids'), expected ('keys',)"
    )
    assert registry.signature_problem(Child, "absent", ()) == "Child.absent is missing"
    def unreadable(self: Any) -> None:
        pass

    unreadable.__signature__ = "not a signature"  # type: ignore[attr-defined]
    Child.odd = unreadable  # type: ignore[attr-defined]
    assert registry.signature_problem(Child, "odd", ()) == "Child.odd has no readable signature"


def test_staging_bytes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        transports.staged_settings({}, {transports.ENV_STAGING_BYTES: "0"})
    with pytest.raises(ValueError, match=f"{transports.ENV_STAGING_BYTES}: cannot parse size '-1'"):
        transports.staged_settings({}, {transports.ENV_STAGING_BYTES: "-1"})
    with pytest.raises(ValueError, match="must be > 0"):
        transports.staged_settings({transports.EXTRA_STAGING_BYTES: 0}, {})
    assert transports.staged_settings({}, {transports.ENV_STAGING_BYTES: "1"}) == (False, 1)


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (True, TypeError),  # JSON true: was 1 byte, a pool of no slot and every put silently unstaged
        (1.9, ValueError),  # was 1
        ("\uff11\uff12\uff18", ValueError),  # full-width digits: int() read 128
        (float("inf"), ValueError),  # was a bare OverflowError naming nothing
        ("inf", ValueError),
    ],
)
def test_staging_bytes_are_parsed_by_store_configs_size_parser(raw: object, error: type[Exception]) -> None:
    """Issue 39 item 3: the one byte-count parser ``StoreConfig`` uses (driver/values.py ``parse_size``), with
    the key or variable the value came from named; a unit is taken as there."""
    key = f"kv_connector_extra_config['{transports.EXTRA_STAGING_BYTES}']"
    with pytest.raises(error, match=re.escape(key)):
        transports.staged_settings({transports.EXTRA_STAGING_BYTES: raw}, {})
    if isinstance(raw, str):
        with pytest.raises(error, match=transports.ENV_STAGING_BYTES):
            transports.staged_settings({}, {transports.ENV_STAGING_BYTES: raw})
    assert transports.staged_settings({transports.EXTRA_STAGING_BYTES: "64 MiB"}, {}) == (False, 64 << 20)
    assert transports.staged_settings({transports.EXTRA_STAGING_BYTES: 4096.0}, {}) == (False, 4096)


def test_on_off_settings_that_are_neither_are_refused_with_their_name() -> None:
    """Issue 39 item 4: ``"enabled"`` left staging off and ``"disabled"`` the native client on, without a word."""
    extra_staged = f"kv_connector_extra_config['{transports.EXTRA_STAGED}']"
    with pytest.raises(ValueError, match=re.escape(f"{extra_staged}='enabled' is neither on nor off")):
        transports.staged_settings({transports.EXTRA_STAGED: "enabled"}, {})
    with pytest.raises(ValueError, match=f"{transports.ENV_STAGED}='2'"):
        transports.staged_settings({transports.EXTRA_STAGED: True}, {transports.ENV_STAGED: "2"})
    with pytest.raises(ValueError, match=f"{transports.ENV_NATIVE_CLIENT}='disabled'"):
        transports.native_client_setting({}, {transports.ENV_NATIVE_CLIENT: "disabled"})
    with pytest.raises(ValueError, match=re.escape(f"['{transports.EXTRA_NATIVE_CLIENT}']=2 is neither")):
        transports.native_client_setting({transports.EXTRA_NATIVE_CLIENT: 2}, {})
    assert transports.staged_settings({transports.EXTRA_STAGED: "Yes"}, {transports.ENV_STAGED: " "})[0] is True
    assert transports.native_client_setting({transports.EXTRA_NATIVE_CLIENT: False}, {}) is False


@pytest.mark.vllm
def test_a_plugin_switch_that_is_neither_warns_once_and_stays_off(
    data: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``MOONCAKE_KVADDR_VLLM_PLUGIN=disabled`` left the plugin on (issue 39 item 4). register() never raises
    into vLLM: one warning naming the variable, and vLLM stays untouched (the safe side). The handlers' and the
    lookup's switches likewise read off with one warning each."""
    monkeypatch.setenv(plugin.ENV_PLUGIN, "disabled")
    with caplog.at_level(logging.WARNING, logger="vllm.mooncake_kvaddr"):
        plugin.register()
    assert not plugin.is_patched()
    assert data.RankLocalStoreLayout.prepare_values is not vllm_layouts._rank_local_prepare_values
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and f"{plugin.ENV_PLUGIN}='disabled' is neither on nor off" in warnings[0], warnings
    from mooncake_kvaddr.integrations.vllm import lookup, receive, send

    for enabled, name in (
        (receive.receive_enabled, receive.ENV_RECV),
        (send.send_enabled, send.ENV_SEND),
        (lookup.lookup_enabled, lookup.ENV_LOOKUP),
    ):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vllm.mooncake_kvaddr"):
            assert enabled({name: "enabled"}) is False
            assert enabled({name: "1"}) is True and enabled({}) is True
        assert [r.getMessage() for r in caplog.records] == [
            f"mooncake_kvaddr: {name}='enabled' is neither on nor off: use one of 1, on, true, yes or 0, false, "
            "no, off; switched off"
        ]


def test_the_environments_staging_bytes_win_over_the_extra_config() -> None:
    extra = {transports.EXTRA_STAGING_BYTES: 4096}
    assert transports.staged_settings(extra, {transports.ENV_STAGING_BYTES: "8192"}) == (False, 8192)
    assert transports.staged_settings(extra, {}) == (False, 4096)
    assert transports.staged_settings({}, {}) == (False, transports.DEFAULT_STAGING_BYTES)


def test_host_caches_given_as_tuples_of_tensors_are_host_caches() -> None:
    cpu = types.SimpleNamespace(device=types.SimpleNamespace(type="cpu"))
    cuda = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"))
    assert transports._all_host({"layer.0": (cpu, cpu), "layer.1": cpu})
    assert transports._all_host([(cpu, cpu), [cpu]])
    assert not transports._all_host({"layer.0": (cpu, cuda)})
    assert not transports._all_host({})


# --- differential: patched vs vLLM's own on generated inputs ------------------------------------------------


def _same(a: Any, b: Any) -> bool:
    return vllm_layouts._same(a, b)


def _outcome(fn: Any) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except Exception as exc:
        return "raise", type(exc)


def _assert_same_outcome(reference: Any, ours: Any) -> None:
    expected, actual = _outcome(reference), _outcome(ours)
    if expected[0] == "raise":
        assert actual[0] == "raise" and issubclass(actual[1], expected[1]), (expected, actual)
    else:
        assert _same(expected, actual), (expected, actual)


@st.composite
def rank_local_cases(draw: Any) -> dict[str, Any]:
    hbs = draw(st.sampled_from([1, 16, 64, 128]))
    block_size = hbs * draw(st.sampled_from([1, 2, 4]))
    regions = draw(st.integers(0, 40))
    bases = draw(st.lists(st.integers(0, 1 << 46), min_size=regions, max_size=regions))
    lens = draw(st.lists(st.integers(1, 1 << 16), min_size=1, max_size=max(1, regions)))
    n_blocks = draw(st.integers(1, 20))
    block_ids = draw(st.lists(st.integers(0, 1 << 20), min_size=n_blocks, max_size=n_blocks))
    chunks = []
    for _ in range(draw(st.integers(0, 12))):
        first = draw(st.integers(0, n_blocks - 1))
        units = draw(st.integers(1, block_size // hbs * 2))
        odd = draw(st.sampled_from([0, 0, 0, 1]))
        chunks.append((first * block_size, first * block_size + units * hbs + odd))
    shards = [draw(st.sampled_from([0, 0, 0, 1])) for _ in chunks]
    return {"hbs": hbs, "bs": block_size, "bases": bases, "lens": lens, "ids": block_ids, "chunks": chunks,
            "shards": shards}  # fmt: skip


@pytest.mark.vllm
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=rank_local_cases())
def test_rank_local_matches_vllm(data: Any, case: dict[str, Any]) -> None:
    plugin.patch()
    original = vllm_layouts._ORIGINAL_FUNCS
    layout = data.RankLocalStoreLayout(data.KeyMetadata("m", 0, 0, 0, 0), case["bs"], case["hbs"])
    layout.set_kv_caches_base_addr(case["bases"])
    layout.set_block_len(case["lens"])
    args = (case["chunks"], case["ids"], case["shards"])
    _assert_same_outcome(
        lambda: original["RankLocalStoreLayout.prepare_values"](layout, *args), lambda: layout.prepare_values(*args)
    )
    for block_id in case["ids"][:3]:
        _assert_same_outcome(
            lambda b=block_id: original["RankLocalStoreLayout.prepare_value_for_block"](layout, b),
            lambda b=block_id: layout.prepare_value_for_block(b),
        )
    # vLLM replaces the lists, or edits them in place: both must be seen by the next call.
    layout.kv_caches_base_addr = [b + 4096 for b in case["bases"]]
    layout.block_len.append(512)
    _assert_same_outcome(
        lambda: original["RankLocalStoreLayout.prepare_values"](layout, *args), lambda: layout.prepare_values(*args)
    )
    # A new block_len list alone (the base list kept): the engine must follow it too.
    layout.block_len = [length * 2 + 1 for length in layout.block_len]
    _assert_same_outcome(
        lambda: original["RankLocalStoreLayout.prepare_values"](layout, *args), lambda: layout.prepare_values(*args)
    )
    digest = bytes(range(32))
    assert layout.key_for(0, digest) == original["RankLocalStoreLayout.key_for"](layout, 0, digest)


@pytest.mark.vllm
def test_rank_local_follows_a_changed_block_size(data: Any) -> None:
    """vLLM reads ``block_size`` on every call: a layout whose block size changed maps chunks to other blocks."""
    plugin.patch()
    original = vllm_layouts._ORIGINAL_FUNCS["RankLocalStoreLayout.prepare_values"]
    layout = data.RankLocalStoreLayout(data.KeyMetadata("m", 0, 0, 0, 0), 16, 16)
    layout.set_kv_caches_base_addr([1 << 20, 1 << 30])
    layout.set_block_len([4096])
    args = ([(32, 48)], [3, 5, 7, 9], [0])
    assert layout.prepare_values(*args) == original(layout, *args)
    layout.block_size = 32
    assert layout.prepare_values(*args) == original(layout, *args)
    assert layout.prepare_values(*args)[2] == [5]


@pytest.mark.vllm
def test_rank_local_follows_a_changed_hash_block_size(data: Any) -> None:
    """vLLM reads ``hash_block_size`` on every call too: once it grows past a chunk's span, the chunk is not a
    whole number of hash blocks and is refused as vLLM refuses it (fresh mutant M11-16: the engine kept the old
    hash block size and still planned the chunk)."""
    plugin.patch()
    original = vllm_layouts._ORIGINAL_FUNCS["RankLocalStoreLayout.prepare_values"]
    layout = data.RankLocalStoreLayout(data.KeyMetadata("m", 0, 0, 0, 0), 32, 16)
    layout.set_kv_caches_base_addr([1 << 20])
    layout.set_block_len([4096])
    args = ([(32, 48)], [3, 5, 7], [0])
    assert layout.prepare_values(*args) == original(layout, *args) == ([[(1 << 20) + 5 * 4096]], [[4096]], [5])
    layout.hash_block_size = 32
    with pytest.raises(AssertionError):
        original(layout, *args)
    with pytest.raises(AssertionError):
        layout.prepare_values(*args)


@st.composite
def sharded_cases(draw: Any) -> dict[str, Any]:
    store_tp = draw(st.sampled_from([1, 2, 4, 8]))
    local_tp = draw(st.sampled_from([d for d in (1, 2, 4, 8) if store_tp % d == 0]))
    tp_rank = draw(st.integers(0, local_tp - 1))
    block_size = draw(st.sampled_from([16, 64, 128]))
    n_blocks = draw(st.integers(1, 16))
    ids = draw(st.lists(st.integers(0, 1 << 20), min_size=n_blocks, max_size=n_blocks))
    picks = draw(st.lists(st.integers(0, n_blocks - 1), max_size=12))
    partial = draw(st.booleans()) and bool(picks)
    chunks = [(p * block_size, (p + 1) * block_size - (1 if partial and i == 0 else 0)) for i, p in enumerate(picks)]
    shard_offsets = [draw(st.integers(-1, store_tp // local_tp)) for _ in chunks]
    segments = draw(st.integers(0, 8))
    return {"store_tp": store_tp, "local_tp": local_tp, "tp_rank": tp_rank, "bs": block_size, "ids": ids,
            "chunks": chunks, "shard_offsets": shard_offsets, "segments": segments,
            "seed": draw(st.integers(0, 1 << 30)), "lbnhc": draw(st.booleans())}  # fmt: skip


@pytest.mark.vllm
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=sharded_cases())
def test_tp_sharded_matches_vllm(data: Any, case: dict[str, Any]) -> None:
    plugin.patch()
    original = vllm_layouts._ORIGINAL_FUNCS
    cls = data.LBNHCStoreLayout if case["lbnhc"] else data.LBHNCStoreLayout
    layout = cls(data.KeyMetadata("m", 0, 0, 0, 0), case["bs"], case["bs"], case["local_tp"], case["store_tp"],
                 case["tp_rank"], 16)  # fmt: skip
    rng = np.random.default_rng(case["seed"])
    for _ in range(2):  # a second registration must replace the first
        layout._set_segment_templates(
            [
                (
                    rng.integers(1 << 20, 1 << 46, case["segments"]).tolist(),
                    rng.integers(1, 1 << 20, case["segments"]).tolist(),
                    rng.integers(0, 1 << 16, case["segments"]).tolist(),
                )
                for _ in range(layout.shards_per_rank)
            ]
        )
        first = layout.local_shard_ids[0]
        shards = [first + off for off in case["shard_offsets"]]
        args = (case["chunks"], case["ids"], shards)
        _assert_same_outcome(
            lambda args=args: original["TPShardedStoreLayout.prepare_values"](layout, *args),
            lambda args=args: layout.prepare_values(*args),
        )
    digest = bytes(32)
    for shard in (first, first + layout.shards_per_rank):
        _assert_same_outcome(
            lambda s=shard: original["TPShardedStoreLayout.key_for"](layout, s, digest),
            lambda s=shard: layout.key_for(s, digest),
        )


@pytest.mark.vllm
def test_registered_torch_caches_match_vllm(data: Any) -> None:
    """Regions from real tensors (dense, per-head, partial storage), vLLM's own registration."""
    torch = pytest.importorskip("torch")
    plugin.patch()
    original = vllm_layouts._ORIGINAL_FUNCS
    num_blocks = 9
    dense = [torch.zeros(num_blocks, 16, 8, dtype=torch.float16) for _ in range(3)]
    per_head = torch.zeros(num_blocks, 16, 2, 8).transpose(1, 2)  # block not dense -> one region per head
    part = torch.zeros(num_blocks + 3, 16, 8)[2 : 2 + num_blocks]
    layout = data.RankLocalStoreLayout(data.KeyMetadata("m", 0, 0, 0, 0), 16, 16)
    layout.register_kv_caches([*dense, per_head, part], num_blocks)
    chunks = [(0, 16), (32, 48), (64, 80)]
    args = (chunks, list(range(num_blocks)), [0, 0, 0])
    assert _same(original["RankLocalStoreLayout.prepare_values"](layout, *args), layout.prepare_values(*args))


# --- the staged store wrapper ----------------------------------------------------------------------------------


class FakeMooncake:
    """In-memory store with the result codes the real Mooncake (0.3.13) gives for these calls: -704 missing,
    -600 buffer smaller than the object, multi-buffer -800 when the regions hold more than the object."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.registered: list[tuple[int, int]] = []
        self.calls: list[str] = []
        self.configs: list[Any] = []  # the config of every put, in order

    def register_buffer(self, ptr: int, size: int) -> int:
        self.registered.append((ptr, size))
        return 0

    def unregister_buffer(self, ptr: int) -> int:
        self.registered = [(p, n) for p, n in self.registered if p != ptr]
        return 0

    def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int], config: Any = None) -> list[int]:
        self.calls.append("put_from")
        self.configs.append(config)
        for key, ptr, size in zip(keys, ptrs, sizes):
            self.objects[key] = ctypes.string_at(ptr, size)
        return [0] * len(keys)

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        self.calls.append("get_into")
        out = []
        for key, ptr, size in zip(keys, ptrs, sizes):
            obj = self.objects.get(key)
            if obj is None:
                out.append(-704)
            elif size < len(obj):
                out.append(-600)
            else:
                ctypes.memmove(ptr, obj, len(obj))
                out.append(len(obj))
        return out

    def batch_put_from_multi_buffers(self, keys: list[str], addrs: Any, sizes: Any, config: Any = None) -> list[int]:
        self.calls.append("put_multi")
        self.configs.append(config)
        for key, row, lens in zip(keys, addrs, sizes):
            self.objects[key] = b"".join(ctypes.string_at(a, n) for a, n in zip(row, lens))
        return [0] * len(keys)

    def batch_get_into_multi_buffers(
        self, keys: list[str], addrs: Any, sizes: Any, same_node: bool = False
    ) -> list[int]:
        self.calls.append("get_multi")
        out = []
        for key, row, lens in zip(keys, addrs, sizes):
            obj = self.objects.get(key)
            if obj is None:
                out.append(-704)
            elif sum(lens) < len(obj):
                out.append(-600)
            elif sum(lens) > len(obj):
                out.append(-800)
            else:
                at = 0
                for a, n in zip(row, lens):
                    ctypes.memmove(a, obj[at : at + n], n)
                    at += n
                out.append(len(obj))
        return out

    def close(self) -> int:
        return 0

    def record_only(self) -> None:
        """Multi-buffer calls are recorded but touch no memory (for addresses no store may read)."""

        def put(keys: list[str], *args: Any, **kwargs: Any) -> list[int]:
            self.calls.append("put_multi")
            return [0] * len(keys)

        def get(keys: list[str], *args: Any, **kwargs: Any) -> list[int]:
            self.calls.append("get_multi")
            return [-704] * len(keys)

        self.batch_put_from_multi_buffers = put  # type: ignore[method-assign]
        self.batch_get_into_multi_buffers = get  # type: ignore[method-assign]


def _rows(cache: StagingBuffer, keys: int, regions: int, size: int) -> tuple[list[list[int]], list[list[int]]]:
    addrs = [[cache.ptr + (r * keys + k) * size for r in range(regions)] for k in range(keys)]
    return addrs, [[size] * regions for _ in range(keys)]


def test_a_staged_get_answered_with_zero_bytes_is_a_failure_code() -> None:
    """An object Mooncake reads back with 0 bytes is answered as Mooncake's multi-buffer get answers a short
    object (-800), never as 0 (which a caller checking for a negative code would take as read)."""
    inner = FakeMooncake()
    store = StagedMooncakeStore(inner, staging_bytes=1 << 16)
    cache = StagingBuffer(2 * 4 * 256)
    assert store.register_buffer(cache.ptr, cache.nbytes) == 0
    addrs, sizes = _rows(cache, 2, 4, 256)
    assert store.batch_put_from_multi_buffers(["k0", "k1"], addrs, sizes, "config") == [0, 0]
    inner.objects["k0"] = b""
    reference = FakeMooncake()
    reference.objects["k0"] = b""
    codes = store.batch_get_into_multi_buffers(["k0", "k1"], addrs, sizes)
    assert codes == [reference.batch_get_into_multi_buffers(["k0"], addrs[:1], sizes[:1])[0], 1024] == [-800, 1024]


def test_staged_round_trip_codes_and_no_stale_bytes() -> None:
    inner = FakeMooncake()
    store = StagedMooncakeStore(inner, staging_bytes=1 << 16)
    cache = StagingBuffer(8 * 4 * 256)
    assert store.register_buffer(cache.ptr, cache.nbytes) == 0
    cache.array[:] = np.arange(cache.nbytes, dtype=np.uint64).astype(np.uint8)
    want = cache.array.copy()
    addrs, sizes = _rows(cache, 8, 4, 256)
    keys = [f"k{i}" for i in range(8)]
    assert store.batch_put_from_multi_buffers(keys, addrs, sizes, "config") == [0] * 8
    assert inner.calls == ["put_from"] and store.stats.staged_puts == 1
    reference = FakeMooncake()
    reference.batch_put_from_multi_buffers(keys, addrs, sizes)
    assert inner.objects == reference.objects  # staged objects are byte-identical to multi-buffer ones

    # k3 missing, k5 shorter than its regions: neither is written; k5 is a failure (the driver's staged rule)
    # answered as Mooncake's multi-buffer get answers it (-800), without a second Mooncake call.
    del inner.objects["k3"]
    del reference.objects["k3"]
    inner.objects["k5"] = inner.objects["k5"][:512]
    reference.objects["k5"] = reference.objects["k5"][:512]
    cache.array[:] = 0
    inner.calls.clear()
    codes = store.batch_get_into_multi_buffers(keys, addrs, sizes)
    assert inner.calls == ["get_into"]
    expected = reference.batch_get_into_multi_buffers(["k3", "k5"], [addrs[3], addrs[5]], [sizes[3], sizes[5]])
    assert codes[3] == expected[0] == -704
    assert codes[5] == expected[1] == -800
    assert store.stats.short_reads == store.stats.refetched_keys == 1
    assert all(c == 1024 for i, c in enumerate(codes) if i not in (3, 5))
    # The regions of the missing key stay zero even though a slot was staged for it.
    written = np.zeros(cache.nbytes, dtype=bool)
    for k in range(8):
        if k in (3, 5):
            continue
        for a in addrs[k]:
            written[a - cache.ptr : a - cache.ptr + 256] = True
    assert (cache.array[written] == want[written]).all()
    assert (cache.array[~written] == 0).all()
    assert type(codes) is list and all(type(c) is int for c in codes)


def test_staged_call_passes_through_when_no_staging_span_frees_in_time() -> None:
    """A staging pool held by other calls never makes a call wait forever: after ``staging_wait_s`` it goes to
    Mooncake's own multi-buffer method with the same rows (list and array entries), and the same bytes move."""
    import time

    inner = FakeMooncake()
    store = StagedMooncakeStore(inner, staging_bytes=1 << 16, staging_wait_s=0.05)
    cache = StagingBuffer(4 * 2 * 256)
    assert store.register_buffer(cache.ptr, cache.nbytes) == 0
    cache.array[:] = np.arange(cache.nbytes, dtype=np.uint64).astype(np.uint8)
    want = cache.array.copy()
    addrs, sizes = _rows(cache, 4, 2, 256)
    keys = [f"k{i}" for i in range(4)]
    held = store._pool.acquire(1 << 16)  # another call holds every byte of staging
    try:
        began = time.monotonic()
        assert store.batch_put_from_multi_buffers(keys, addrs, sizes, "config") == [0] * 4
        cache.array[:] = 0
        assert store.batch_get_into_multi_buffers(keys, addrs, sizes) == [512] * 4
        assert (cache.array == want).all()
        cache.array[:] = 0
        matrices = np.array(addrs, dtype=np.int64), np.array(sizes, dtype=np.int64)
        assert store.batch_get_into_multi_buffers_arrays(keys, *matrices) == [512] * 4
        assert store.batch_put_from_multi_buffers_arrays(keys, *matrices, "config") == [0] * 4
        assert time.monotonic() - began < 5
    finally:
        held.release()
    assert (cache.array == want).all()
    assert inner.calls == ["put_multi", "get_multi", "get_multi", "put_multi"]
    # The puts that went on without staging kept their config (fresh mutant M20-16: the list entry's dropped).
    assert inner.configs == ["config", "config"]
    assert store.stats.lease_timeouts == 4 and store.stats.staged_puts == store.stats.staged_gets == 0
    assert store.stats.passthrough_puts == store.stats.passthrough_gets == 2
    # Once staging is free again, calls stage as before.
    assert store.batch_put_from_multi_buffers(keys, addrs, sizes, "config") == [0] * 4
    assert inner.calls[-1] == "put_from" and store.stats.staged_puts == 1 and inner.configs[-1] == "config"
    with pytest.raises(ValueError, match="staging_wait_s"):
        StagedMooncakeStore(inner, staging_wait_s=float("nan"))


def test_staged_passes_unregistered_memory_and_odd_calls_through() -> None:
    inner = FakeMooncake()
    inner.record_only()
    store = StagedMooncakeStore(inner, staging_bytes=1 << 16)
    cache = StagingBuffer(4096)
    other = StagingBuffer(4096)  # never registered through the wrapper
    store.register_buffer(cache.ptr, cache.nbytes)
    # Memory outside the registered buffers never reaches Mooncake (the registered-range guard: -600).
    assert store.batch_put_from_multi_buffers(["a"], [[other.ptr]], [[64]]) == [-600]
    assert store.batch_put_from_multi_buffers(["b"], [[cache.ptr + 4090]], [[64]]) == [-600]  # past the end
    assert inner.calls == []
    store.batch_put_from_multi_buffers(["c", "c"], [[cache.ptr], [cache.ptr]], [[64], [64]])  # duplicates
    store.batch_get_into_multi_buffers(["a"], [[cache.ptr]], [[64]], True)  # an argument we do not know
    store.batch_put_from_multi_buffers(["d"], [[cache.ptr]], [[0]])  # empty object
    assert inner.calls == ["put_multi", "get_multi", "put_multi"]
    assert store.stats.staged_puts == store.stats.staged_gets == 0
    store.unregister_buffer(cache.ptr)
    assert store.batch_put_from_multi_buffers(["e"], [[cache.ptr]], [[64]]) == [-600]
    assert len(inner.calls) == 3


def test_staged_put_with_other_keywords_goes_to_mooncake_with_its_arguments() -> None:
    """A staged multi-buffer put given a keyword other than ``config``, or ``config=`` beside a positional config,
    is Mooncake's own multi-buffer put with exactly those arguments (one pass-through each); ``config=`` alone is
    staged, and that config reaches Mooncake's ``batch_put_from``."""
    seen: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    class Recording(FakeMooncake):
        def batch_put_from_multi_buffers(
            self, keys: list[str], addrs: Any, sizes: Any, *args: Any, **kwargs: Any
        ) -> list[int]:
            seen.append(("put_multi", args, kwargs))
            return super().batch_put_from_multi_buffers(keys, addrs, sizes)

        def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int], config: Any = None) -> list[int]:
            seen.append(("put_from", (config,), {}))
            return super().batch_put_from(keys, ptrs, sizes, config)

    inner = Recording()
    store = StagedMooncakeStore(inner, staging_bytes=1 << 16)
    cache = StagingBuffer(4096)
    assert store.register_buffer(cache.ptr, cache.nbytes) == 0
    assert store.batch_put_from_multi_buffers(["a"], [[cache.ptr]], [[64]], replicate="r") == [0]
    assert store.batch_put_from_multi_buffers(["b"], [[cache.ptr]], [[64]], "c1", config="c2") == [0]
    assert seen == [("put_multi", (), {"replicate": "r"}), ("put_multi", ("c1",), {"config": "c2"})]
    assert store.stats.passthrough_puts == 2 and store.stats.staged_puts == 0
    assert store.batch_put_from_multi_buffers(["c"], [[cache.ptr]], [[64]], config="c3") == [0]
    assert seen[2:] == [("put_from", ("c3",), {})]
    assert store.stats.passthrough_puts == 2 and store.stats.staged_puts == 1
    assert set(inner.objects) == {"a", "b", "c"}


def test_staged_passes_through_what_staging_cannot_take(caplog: pytest.LogCaptureFixture) -> None:
    """Three calls the staged wrapper cannot stage go to Mooncake's own multi-buffer methods with their rows
    unchanged, and their bytes round-trip: an object larger than the whole staging buffer; any call once
    Mooncake refused to register the staging buffer (one warning, no second attempt); rows outside every
    registered buffer on a wrapper that is not armed (nothing registered through it: vLLM's own behaviour)."""
    cache = StagingBuffer(8192)
    cache.array[:] = np.random.default_rng(1).integers(0, 255, cache.nbytes, dtype=np.uint8)
    want = cache.array.copy()

    def round_trip(store: StagedMooncakeStore, inner: FakeMooncake, keys: list[str], addrs: Any, sizes: Any) -> None:
        assert store.batch_put_from_multi_buffers(keys, addrs, sizes) == [0] * len(keys)
        cache.array[:] = 0
        expected = [sum(row) for row in sizes]
        assert store.batch_get_into_multi_buffers(keys, addrs, sizes) == expected
        assert (cache.array == want).all()
        assert inner.calls == ["put_multi", "get_multi"]
        assert store.stats.staged_puts == store.stats.staged_gets == 0
        assert store.stats.passthrough_puts == store.stats.passthrough_gets == 1

    # An object of 8 KiB against 4 KiB of staging.
    inner = FakeMooncake()
    store = StagedMooncakeStore(inner, staging_bytes=4096)
    assert store.register_buffer(cache.ptr, cache.nbytes) == 0
    round_trip(store, inner, ["big"], [[cache.ptr, cache.ptr + 4096]], [[4096, 4096]])

    # Mooncake refuses the staging buffer: staging is off for good, with one warning.
    class Refusing(FakeMooncake):
        def register_buffer(self, ptr: int, size: int) -> int:
            return -600 if size == 1 << 16 else super().register_buffer(ptr, size)

    inner = Refusing()
    store = StagedMooncakeStore(inner, staging_bytes=1 << 16)
    assert store.register_buffer(cache.ptr, cache.nbytes) == 0
    with caplog.at_level(logging.WARNING, logger="vllm.mooncake_kvaddr"):
        round_trip(store, inner, ["a", "b"], [[cache.ptr], [cache.ptr + 4096]], [[4096], [4096]])
    assert [r.getMessage() for r in caplog.records].count(
        "mooncake_kvaddr: Mooncake refused the staging buffer (-600): staged transport off"
    ) == 1
    assert inner.registered == [(cache.ptr, cache.nbytes)]

    # Not armed (nothing registered through the wrapper): the rows are nobody's to check; Mooncake gets them.
    inner = FakeMooncake()
    store = StagedMooncakeStore(inner, staging_bytes=1 << 16)
    round_trip(store, inner, ["a", "b"], [[cache.ptr], [cache.ptr + 4096]], [[4096], [4096]])


def test_staged_takes_an_object_exactly_as_large_as_the_staging_buffer() -> None:
    inner = FakeMooncake()
    store = StagedMooncakeStore(inner, staging_bytes=4096)
    cache = StagingBuffer(8192)
    cache.array[:] = np.random.default_rng(2).integers(0, 255, cache.nbytes, dtype=np.uint8)
    want = cache.array.copy()
    assert store.register_buffer(cache.ptr, cache.nbytes) == 0
    addrs, sizes = [[cache.ptr, cache.ptr + 6144]], [[2048, 2048]]  # one 4 KiB object: the whole buffer
    assert store.batch_put_from_multi_buffers(["edge"], addrs, sizes) == [0]
    cache.array[:] = 0
    assert store.batch_get_into_multi_buffers(["edge"], addrs, sizes) == [4096]
    assert (cache.array[:2048] == want[:2048]).all() and (cache.array[6144:] == want[6144:]).all()
    assert inner.calls == ["put_from", "get_into"]
    assert store.stats.staged_puts == store.stats.staged_gets == 1
    assert store.stats.passthrough_puts == store.stats.passthrough_gets == 0


def test_staged_splits_requests_larger_than_the_staging_buffer() -> None:
    inner = FakeMooncake()
    store = StagedMooncakeStore(inner, staging_bytes=4096)
    cache = StagingBuffer(16 * 2 * 1024)
    store.register_buffer(cache.ptr, cache.nbytes)
    cache.array[:] = np.random.default_rng(0).integers(0, 255, cache.nbytes, dtype=np.uint8)
    want = cache.array.copy()
    addrs, sizes = _rows(cache, 16, 2, 1024)
    keys = [f"k{i}" for i in range(16)]
    assert store.batch_put_from_multi_buffers(keys, addrs, sizes) == [0] * 16
    cache.array[:] = 0
    assert store.batch_get_into_multi_buffers(keys, addrs, sizes) == [2048] * 16
    assert (cache.array == want).all()
    assert inner.calls.count("get_into") == 8  # two 2 KiB objects per 4 KiB span


def test_device_caches_are_passed_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugin.ENV_STAGED, "1")
    monkeypatch.setenv(plugin.ENV_NATIVE_CLIENT, "0")  # the staged wrapper alone (the native one: below)
    inner = FakeMooncake()

    def tensor(kind: str) -> Any:
        return types.SimpleNamespace(device=types.SimpleNamespace(type=kind))

    assert plugin.maybe_stage_store(inner, {"a": tensor("cuda")}, None) is inner
    assert plugin.maybe_stage_store(inner, {"a": tensor("cpu"), "b": tensor("cuda")}, None) is inner
    staged = plugin.maybe_stage_store(inner, {"a": [tensor("cpu"), tensor("cpu")]}, None)
    assert isinstance(staged, StagedMooncakeStore) and staged.wrapped is inner
    assert plugin.maybe_stage_store(staged, {"a": tensor("cpu")}, None) is staged
    monkeypatch.setenv(plugin.ENV_STAGED, "0")
    assert plugin.maybe_stage_store(inner, {"a": tensor("cpu")}, {plugin.EXTRA_STAGED: True}) is inner
    monkeypatch.delenv(plugin.ENV_STAGED)
    assert isinstance(plugin.maybe_stage_store(inner, {"a": tensor("cpu")}, {plugin.EXTRA_STAGED: True}),
                      StagedMooncakeStore)  # fmt: skip
    assert plugin.maybe_stage_store(inner, {"a": tensor("cpu")}, {}) is inner
    with pytest.raises(ValueError, match="cannot parse size 'lots'"):
        plugin.staged_settings({plugin.EXTRA_STAGING_BYTES: "lots"}, {})


class _Recorder:
    """Records ``(method, args, kwargs)`` and answers with a tag naming who answered."""

    def __init__(self, tag: str, refuse: bool = False) -> None:
        self.tag = tag
        self.refuse = refuse
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.closed = False

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("batch_"):
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))
            if self.refuse:
                raise ValueError("not accepted")
            return [self.tag, name]

        return call

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("available", [True, False])
def test_native_store_dispatch_and_fallback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, available: bool
) -> None:
    from mooncake_kvaddr.driver.native_client import NativeClient
    from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore

    bound = _Recorder("bound")
    client = _Recorder("native")
    probes: list[Any] = []

    def from_store(cls: Any, store: Any) -> Any:
        probes.append(store)
        return client if available else None

    monkeypatch.setattr(NativeClient, "from_store", classmethod(from_store))
    store = NativeMooncakeStore(bound)
    config = object()
    rows = [[1, 2], [3, 4]]
    who = "native" if available else "bound"
    with caplog.at_level(logging.INFO, logger="vllm.mooncake_kvaddr"):
        assert store.batch_get_into_multi_buffers(["a", "b"], rows, rows) == [who, "batch_get_into_multi_buffers"]
        assert store.batch_put_from_multi_buffers(["a", "b"], rows, rows, config)[0] == who
        assert store.batch_is_exist(["a"])[0] == who
        assert store.batch_get_into(["a"], [1], [2])[0] == who
        assert store.batch_put_from(["a"], [1], [2], config)[0] == who
        # Keyword arguments are Mooncake's business: always the bound method.
        assert store.batch_put_from_multi_buffers(["a"], rows, rows, config=config)[0] == "bound"
    assert probes == [bound]  # probed once, lazily
    target = client if available else bound
    assert target.calls[1] == ("batch_put_from_multi_buffers", (["a", "b"], rows, rows, config), {})
    assert bound.calls[-1] == ("batch_put_from_multi_buffers", (["a"], rows, rows), {"config": config})
    assert store.stats.native_calls == (5 if available else 0)
    assert store.stats.fallback_calls == (1 if available else 6)
    if not available:
        assert sum("no native client" in r.getMessage() for r in caplog.records) == 1
    assert store.batch_get_replica_desc is not None  # everything else is the wrapped store's
    store.close()
    assert bound.closed and (client.closed or not available)


def test_armed_native_store_hands_keyword_calls_to_mooncake_with_their_keywords(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Armed, as the plugin installs it, the native-client wrapper still gives a call with keyword arguments to
    Mooncake's own method with those keywords (a native call would drop them); the same call without keywords
    goes to the native client."""
    from mooncake_kvaddr.driver.native_client import NativeClient
    from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore

    class Bound(_Recorder):
        def register_buffer(self, ptr: int, size: int) -> int:
            return 0

    class Client(_Recorder):
        def last_refused(self) -> int:
            return 0

    bound, client = Bound("bound"), Client("native")
    monkeypatch.setattr(NativeClient, "from_store", classmethod(lambda cls, store: client))
    store = NativeMooncakeStore(bound, armed=True)
    buf = StagingBuffer(4096)
    assert store.register_buffer(buf.ptr, buf.nbytes) == 0
    rows, sizes, config = [[buf.ptr, buf.ptr + 64]], [[64, 64]], object()
    assert store.batch_put_from_multi_buffers(["a"], rows, sizes, config=config)[0] == "bound"
    assert bound.calls == [("batch_put_from_multi_buffers", (["a"], rows, sizes), {"config": config})]
    assert client.calls == [] and store.stats.fallback_calls == 1
    assert store.batch_put_from_multi_buffers(["a"], rows, sizes, config)[0] == "native"
    assert len(bound.calls) == 1 and store.stats.native_calls == 1


def test_native_store_refused_arguments_go_to_mooncake(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from mooncake_kvaddr.driver.native_client import NativeClient
    from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore

    bound = _Recorder("bound")
    client = _Recorder("native", refuse=True)
    monkeypatch.setattr(NativeClient, "from_store", classmethod(lambda cls, store: client))
    store = NativeMooncakeStore(bound)
    with caplog.at_level(logging.INFO, logger="vllm.mooncake_kvaddr"):
        for _ in range(3):
            assert store.batch_get_into_multi_buffers(["a"], "odd", "odd") == ["bound", "batch_get_into_multi_buffers"]
    assert len(client.calls) == 3 and len(bound.calls) == 3
    assert sum("arguments not accepted" in r.getMessage() for r in caplog.records) == 1


def test_native_client_setting_and_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore

    monkeypatch.delenv(plugin.ENV_NATIVE_CLIENT, raising=False)
    monkeypatch.delenv(plugin.ENV_STAGED, raising=False)
    inner = FakeMooncake()

    def tensor(kind: str) -> Any:
        return types.SimpleNamespace(device=types.SimpleNamespace(type=kind))

    assert plugin.native_client_setting(None, {})  # on by default (it falls back where unverified)
    assert not plugin.native_client_setting({plugin.EXTRA_NATIVE_CLIENT: False}, {})
    assert not plugin.native_client_setting({plugin.EXTRA_NATIVE_CLIENT: "off"}, {})
    assert plugin.native_client_setting({plugin.EXTRA_NATIVE_CLIENT: True}, {})
    assert not plugin.native_client_setting({plugin.EXTRA_NATIVE_CLIENT: True}, {plugin.ENV_NATIVE_CLIENT: "0"})
    assert plugin.native_client_setting({plugin.EXTRA_NATIVE_CLIENT: False}, {plugin.ENV_NATIVE_CLIENT: "1"})
    off = {plugin.EXTRA_NATIVE_CLIENT: False}
    assert plugin.maybe_stage_store(inner, {"a": tensor("cuda")}, off) is inner
    default = plugin.maybe_stage_store(inner, {"a": tensor("cuda")}, None)
    assert isinstance(default, NativeMooncakeStore) and default.wrapped is inner
    gpu = plugin.maybe_stage_store(inner, {"a": tensor("cuda")}, {plugin.EXTRA_NATIVE_CLIENT: "yes"})
    assert isinstance(gpu, NativeMooncakeStore) and gpu.wrapped is inner  # device caches: just the call
    assert plugin.maybe_stage_store(gpu, {"a": tensor("cuda")}, {plugin.EXTRA_NATIVE_CLIENT: True}) is gpu
    both = plugin.maybe_stage_store(
        inner, {"a": tensor("cpu")}, {plugin.EXTRA_NATIVE_CLIENT: True, plugin.EXTRA_STAGED: True}
    )
    assert isinstance(both, StagedMooncakeStore) and isinstance(both.wrapped, NativeMooncakeStore)
    monkeypatch.setenv(plugin.ENV_NATIVE_CLIENT, "1")
    assert isinstance(plugin.maybe_stage_store(inner, {"a": tensor("cpu")}, off), NativeMooncakeStore)
    monkeypatch.setenv(plugin.ENV_NATIVE_CLIENT, "0")
    assert plugin.maybe_stage_store(inner, {"a": tensor("cpu")}, None) is inner


@pytest.mark.mooncake
def test_staged_codes_equal_real_mooncake(master: Any) -> None:
    from mooncake.store import MooncakeDistributedStore

    raw = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", master.rpc_address) == 0
    try:
        store = StagedMooncakeStore(raw, staging_bytes=1 << 20)
        cache = StagingBuffer(8 * 4 * 512)
        assert store.register_buffer(cache.ptr, cache.nbytes) == 0
        cache.array[:] = np.random.default_rng(5).integers(0, 255, cache.nbytes, dtype=np.uint8)
        want = cache.array.copy()
        addrs, sizes = _rows(cache, 8, 4, 512)
        keys = [f"staged-real-{i}" for i in range(8)]
        assert store.batch_put_from_multi_buffers(keys[:6], addrs[:6], sizes[:6]) == [0] * 6
        # k6: regions hold more than the stored object (stored from 2 regions); k7: missing.
        assert raw.batch_put_from_multi_buffers([keys[6]], [addrs[6][:2]], [sizes[6][:2]]) == [0]
        cache.array[:] = 0
        staged = store.batch_get_into_multi_buffers(keys, addrs, sizes)
        got = cache.array.copy()
        cache.array[:] = 0
        direct = raw.batch_get_into_multi_buffers(keys, addrs, sizes)
        assert staged == direct
        assert staged[:6] == [2048] * 6 and staged[6] < 0 and staged[7] < 0
        assert (got == cache.array).all()
        region = 8 * 512  # bytes per region row of all keys
        for k in range(6):
            for r in range(4):
                at = r * region + k * 512
                assert (got[at : at + 512] == want[at : at + 512]).all()
        store.close()
    finally:
        raw.close()


_LOADER = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
from vllm.plugins import load_general_plugins
load_general_plugins()
from mooncake_kvaddr.integrations.vllm import layouts as vllm_layouts
from mooncake_kvaddr.integrations.vllm import plugin, transports
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import data
patched = data.RankLocalStoreLayout.prepare_values is vllm_layouts._rank_local_prepare_values
print("PATCHED" if patched else "UNTOUCHED", flush=True)
"""


@pytest.mark.vllm
@pytest.mark.parametrize("switch", [None, "0"])
def test_vllms_own_plugin_loader_runs_the_entry_point(tmp_path: Any, switch: str | None) -> None:
    """vLLM's ``load_general_plugins`` finds the ``vllm.general_plugins`` entry point (declared by a stand-in
    dist-info, since the project is not pip-installed here) and the plugin patches vLLM, or leaves it alone
    when switched off."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    _vllm_data()
    dist = tmp_path / "mooncake_kvaddr_plugin_probe-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mooncake-kvaddr-plugin-probe\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nmooncake_kvaddr = mooncake_kvaddr.integrations.vllm.plugin:register\n"
    )
    package_root = Path(plugin.__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", plugin.ENV_PLUGIN)}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(package_root)])
    if switch is not None:
        env[plugin.ENV_PLUGIN] = switch
    done = subprocess.run(
        [sys.executable, "-c", _LOADER], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == ("PATCHED" if switch is None else "UNTOUCHED")
    active_lines = [line for line in done.stdout.splitlines() if "native Mooncake store paths active" in line]
    assert len(active_lines) == (1 if switch is None else 0)


def test_staged_bounds_check_slice_by_slice_when_a_column_spans_buffers() -> None:
    inner = FakeMooncake()
    inner.record_only()
    store = StagedMooncakeStore(inner, staging_bytes=1 << 16)
    first, second = StagingBuffer(4096), StagingBuffer(4096)
    store.register_buffer(first.ptr, first.nbytes)
    store.register_buffer(second.ptr, second.nbytes)
    # One region column whose keys live in different buffers: every slice is inside one, so it is staged.
    assert store.batch_put_from_multi_buffers(["x", "y"], [[first.ptr], [second.ptr]], [[256], [256]]) == [0, 0]
    assert inner.calls == ["put_from"]
    # A slice that starts in a buffer and ends past it is never staged, nor sent (the guard: -600).
    assert store.batch_put_from_multi_buffers(["z"], [[first.ptr + 4000]], [[256]]) == [-600]
    # Near the top of the address space: no overflow, no staging, not sent.
    assert store.batch_put_from_multi_buffers(["w"], [[(1 << 63) - 8]], [[256]]) == [-600]
    assert inner.calls == ["put_from"]


# --- the worker hook: vLLM's worker keeps its store; the transfer threads get the wrapper ---------------------


class _HookStore:
    """A Mooncake stand-in for the worker hook: refuses to register ``bad``; counts closes."""

    def __init__(self, bad: int) -> None:
        self.bad = bad
        self.registered: list[tuple[int, int]] = []
        self.gets: list[list[str]] = []
        self.closes = 0

    def register_buffer(self, ptr: int, size: int) -> int:
        self.registered.append((ptr, size))
        return -1 if ptr == self.bad else 0

    def batch_get_into_multi_buffers(self, keys: list[str], addrs: Any, sizes: Any) -> list[int]:
        self.gets.append(list(keys))
        return [sum(row) for row in sizes]

    def close(self) -> int:
        self.closes += 1
        return 0


class _StandInWorker:
    """What the hook relies on in ``MooncakeStoreWorker`` (docs/vllm-plugin.md): ``register_kv_caches`` registers
    every buffer through ``self.store`` and hands ``self.store`` to the threads it starts; ``close`` drops and
    closes it once."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any) -> None:
        self.store: Any = kv_cache_config
        self.threads: list[Any] = []

    def register_kv_caches(self, kv_caches: Any) -> None:
        for ptr, size in kv_caches:
            if self.store.register_buffer(ptr, size) != 0:
                logging.getLogger("stand-in").error("register_buffer failed for %#x", ptr)
        self.threads.append(types.SimpleNamespace(store=self.store))

    def close(self) -> None:
        store, self.store = self.store, None
        if store is not None:
            store.close()


def test_worker_hook_keeps_vllms_store_and_wraps_the_threads(
    data: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from mooncake_kvaddr.driver.store import StoreClosedError
    from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore

    monkeypatch.delenv(plugin.ENV_NATIVE_CLIENT, raising=False)
    monkeypatch.delenv(plugin.ENV_STAGED, raising=False)
    good, bad = 0x10000, 0x40000
    raw = _HookStore(bad)
    transports.wrap_worker(_StandInWorker)
    try:
        worker = _StandInWorker(types.SimpleNamespace(kv_transfer_config=None), raw)
        with caplog.at_level(logging.WARNING, logger="vllm.mooncake_kvaddr"):
            worker.register_kv_caches([(good, 4096), (bad, 4096)])
            worker.threads[0].store.register_buffer(bad, 4096)  # the same refusal again: no second line
        assert worker.store is raw  # vLLM's own object, for vLLM and its tests
        transport = worker.threads[0].store
        assert isinstance(transport, NativeMooncakeStore) and transport.wrapped is raw
        assert raw.registered == [(good, 4096), (bad, 4096), (bad, 4096)]
        ours = [r for r in caplog.records if r.name == "vllm.mooncake_kvaddr"]
        assert len(ours) == 1 and ours[0].levelno == logging.WARNING, ours
        assert hex(bad) in ours[0].getMessage() and "-600" in ours[0].getMessage()
        # The guard knows what was registered: the good buffer passes, the refused one gets -600.
        codes = transport.batch_get_into_multi_buffers(["k0", "k1"], [[good], [bad]], [[64], [64]])
        assert codes == [64, -600] and raw.gets == [["k0"]]
        worker.close()
        worker.close()
        assert raw.closes == 1 and worker.store is None
        with pytest.raises(StoreClosedError):
            transport.batch_get_into_multi_buffers(["k0"], [[good]], [[64]])
    finally:
        plugin.unpatch()
    assert not hasattr(_StandInWorker.close, "__wrapped__")  # unpatch restores the worker's methods


def test_staged_over_native_warns_once_per_refused_buffer(caplog: pytest.LogCaptureFixture) -> None:
    from mooncake_kvaddr.integrations.vllm.native_store import NativeMooncakeStore

    raw = _HookStore(bad=0x40000)
    stacked = StagedMooncakeStore(NativeMooncakeStore(raw, armed=True), staging_bytes=1 << 12, armed=True)
    alone = StagedMooncakeStore(_HookStore(bad=0x40000), staging_bytes=1 << 12, armed=True)
    with caplog.at_level(logging.WARNING, logger="vllm.mooncake_kvaddr"):
        for store in (stacked, alone):
            for _ in range(2):
                assert store.register_buffer(0x40000, 4096) == -1
            assert store.register_buffer(0x10000, 4096) == 0
    lines = [r for r in caplog.records if "register_buffer" in r.getMessage()]
    assert len(lines) == 2 and all(r.levelno == logging.WARNING for r in lines)


# --- start-up: nothing is imported or checked until the Mooncake store modules are ------------------------------

_DEFERRED = """
import logging, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
import vllm
from mooncake_kvaddr.integrations.vllm import layouts as vllm_layouts
from mooncake_kvaddr.integrations.vllm import plugin, transports
start = time.perf_counter()
plugin.register()
plugin.register()
took = time.perf_counter() - start
print("LOADED" if any(m in sys.modules for m in (plugin.DATA_MODULE, plugin.WORKER_MODULE)) else "DEFERRED")
print(f"REGISTER_MS {took * 1e3:.3f}")
first = sys.argv[1]
if first == "is_patched":
    print("IS_PATCHED", plugin.is_patched())
else:
    __import__(plugin.DATA_MODULE if first == "data" else plugin.WORKER_MODULE)
data = sys.modules[plugin.DATA_MODULE]
worker = sys.modules[plugin.WORKER_MODULE]
ours = data.RankLocalStoreLayout.__dict__["prepare_values"] is vllm_layouts._rank_local_prepare_values
handler = worker.KVCacheStoreRecvingThread.__dict__["_handle_request"]
print("PATCHED" if ours and handler.__module__.endswith("receive") else "UNTOUCHED")
print("LOADERS", type(data.__loader__).__name__, type(worker.__spec__.loader).__name__)
print("HOOKS", sum(type(f).__name__ == "AfterImportHook" for f in sys.meta_path))
"""


@pytest.mark.vllm
@pytest.mark.parametrize("first", ["data", "worker", "is_patched"])
def test_register_defers_until_the_store_modules_are_imported(first: str) -> None:
    import os
    import subprocess
    import sys

    _vllm_data()
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", plugin.ENV_PLUGIN, plugin.ENV_RECV)}
    done = subprocess.run(
        [sys.executable, "-c", _DEFERRED, first], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.splitlines()
    assert "DEFERRED" in out
    took = float(next(line for line in out if line.startswith("REGISTER_MS")).split()[1])
    assert took < 50, took  # docs/vllm-plugin.md, "Start-up": ~0.1 ms measured
    assert "PATCHED" in out and "HOOKS 0" in out
    assert "LOADERS SourceFileLoader SourceFileLoader" in out  # the modules look as if never hooked
    if first == "is_patched":
        assert "IS_PATCHED True" in out
    assert sum("native Mooncake store paths active" in line for line in out) == 1
    assert not any("WARNING" in line and "mooncake_kvaddr" in line for line in out)


def test_the_entry_points_series_are_the_release_modules() -> None:
    """``register`` decides on ``known_series()`` without importing a release module; the two must agree, and no
    two release modules claim one series (docs/architecture.md, "Where a change goes")."""
    from mooncake_kvaddr.integrations.vllm import releases

    claimed = [series for release in releases.releases() for series in release.series]
    assert sorted(claimed) == sorted(releases.known_series())
    assert len(set(claimed)) == len(claimed)
    assert releases.for_version("0.33.0") is not releases.for_version("0.34.0")
    assert releases.for_version("0.31.0") is None and releases.for_version("0.3.4") is None


def test_vllm_release_modules_in_ci() -> None:
    """Every release module in ``integrations/vllm/releases/`` is exercised by CI: ``.ci/setup`` installs a vLLM
    of each module's series, vLLM's own store suite runs on it with the plugin on (``.ci/run`` calls
    ``.ci/vllm-suite`` for it), and a release other than the main environment's has its test leg in
    ``.ci/test`` over ``tests/test_vllm0XX*.py`` files that carry its ``vllm_release`` marker."""
    import re
    from pathlib import Path

    from mooncake_kvaddr.integrations.vllm import releases

    root = Path(__file__).resolve().parent.parent
    if not (root / ".ci").is_dir():
        pytest.skip("no .ci here (not a repository checkout: the wheel leg runs a copy of tests/)")
    setup = (root / ".ci" / "setup").read_text()
    run = (root / ".ci" / "run").read_text()
    legs = (root / ".ci" / "test").read_text()
    installed = set(re.findall(r"^VLLM\w*_VERSION=(\d+\.\d+\.\d+)$", setup, re.M))
    modules = sorted(p.stem for p in (root / "python/mooncake_kvaddr/integrations/vllm/releases").glob("v*.py"))
    assert [f"v{r.series[-1].replace('.', '_').strip('_')}" for r in releases.releases()] == modules
    main_env = re.search(r"^VLLM_VERSION=(\d+\.\d+)\.", setup, re.M)
    assert main_env is not None
    for release in releases.releases():
        assert any(version.startswith(release.series) for version in installed), (release.series, installed)
        series = release.series[-1].rstrip(".")
        if series == main_env.group(1):
            assert "bash .ci/vllm-suite" in run
            continue
        tag = series.replace(".", "")
        assert f"tests/test_vllm{tag}*.py" in legs, series
        files = sorted(root.glob(f"tests/test_vllm{tag}*.py"))
        assert files and all(f'vllm_release("{series}")' in f.read_text() for f in files), files
        assert re.search(rf"PYTHON=\S*{tag}\S* bash \.ci/vllm-suite", run), series
