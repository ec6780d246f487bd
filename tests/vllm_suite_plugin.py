"""pytest plugin for .ci/vllm-suite: vLLM's own Mooncake store connector tests with mooncake_kvaddr's vLLM plugin
on or off, for whichever vLLM release is installed (docs/vllm-plugin.md, "vLLM's own tests").

Loaded with ``-p vllm_suite_plugin``; ``MOONCAKE_KVADDR_VLLM_SUITE`` says the mode:

- ``on``: vLLM's plugin loader runs the package's entry point before collection, as in every vLLM process.
  After collection the plugin's :class:`PatchReport` says what it replaced; on a release the plugin supports
  every part must be replaced. Each replaced attribute is counted per test; a test file that calls a replaced
  vLLM function and never reaches ours (every call handed back to vLLM's) fails the run.
- ``off``: the baseline. ``MOONCAKE_KVADDR_VLLM_PLUGIN=0`` must be set and nothing may be patched at the end.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Generator
from typing import Any

import pytest

MODE_VAR = "MOONCAKE_KVADDR_VLLM_SUITE"
STORE_PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store"


def _mode() -> str:
    mode = os.environ.get(MODE_VAR, "")
    if mode not in ("on", "off"):
        raise pytest.UsageError(f"{MODE_VAR} must be 'on' or 'off', got {mode!r}")
    return mode


def _ours(value: Any) -> bool:
    func = getattr(value, "__func__", value)
    return (getattr(func, "__module__", None) or "").startswith("mooncake_kvaddr.")


def _patched_now() -> set[str]:
    """``Class.attr`` of every attribute of vLLM's imported Mooncake store modules that is the plugin's right now
    (read off vLLM's classes, not the plugin's state)."""
    found: set[str] = set()
    for name, module in list(sys.modules.items()):
        if module is None or not (name == STORE_PACKAGE or name.startswith(STORE_PACKAGE + ".")):
            continue
        for cls in list(vars(module).values()):
            if isinstance(cls, type) and cls.__module__ == name:
                found.update(f"{cls.__name__}.{attr}" for attr, value in vars(cls).items() if _ours(value))
    return found


# --- counting: which tests reach the plugin's replacements ---------------------------------------------------


class _Counter:
    """Per test, how often each replaced attribute was called and how often ours did the work itself."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.current = ""  # the running test's node id
        self.calls: dict[str, dict[str, int]] = {}  # node id -> replaced name -> calls
        self.native: dict[str, dict[str, int]] = {}  # node id -> replaced name -> calls ours planned itself
        self.fallback: dict[str, dict[str, int]] = {}  # node id -> replaced name -> calls handed to vLLM's
        self.installed: dict[tuple[type, str], Any] = {}  # (class, attr) -> the plugin's function we wrapped
        self.stats: dict[str, Any] = {}  # replaced name -> the ``stats`` of a handler or lookup

    def add(self, table: dict[str, dict[str, int]], name: str, count: int = 1) -> None:
        with self.lock:
            per_test = table.setdefault(self.current, {})
            per_test[name] = per_test.get(name, 0) + count


def _stat_total(stats: Any, prefix: str) -> int:
    """Sum of a handler's or lookup's integer counters whose name starts with ``prefix`` (``fast``: planned by
    ours; ``fallback``: handed to vLLM's own function)."""
    fields = getattr(stats, "__dataclass_fields__", None) or vars(stats)
    return sum(value for name in fields if name.startswith(prefix) and isinstance(value := getattr(stats, name), int))


def _wrap(counter: _Counter, cls: type, attr: str, func: Any) -> None:
    """Put a counting wrapper around the plugin's ``cls.attr``. A function with ``.stats`` (the handlers, the
    lookup) counts as reached only when its fast counter moved; any other replacement is ours whenever called."""
    name = f"{cls.__name__}.{attr}"
    stats = getattr(func, "stats", None)
    if stats is not None:
        counter.stats[name] = stats

    @functools.wraps(func)
    def counted(*args: Any, **kwargs: Any) -> Any:
        counter.add(counter.calls, name)
        if stats is None:
            counter.add(counter.native, name)
            return func(*args, **kwargs)
        fast, fallback = _stat_total(stats, "fast"), _stat_total(stats, "fallback")
        try:
            return func(*args, **kwargs)
        finally:
            # Another thread may run the same function meanwhile: a moved counter is attributed to this call.
            if _stat_total(stats, "fast") > fast:
                counter.add(counter.native, name)
            elif _stat_total(stats, "fallback") > fallback:
                counter.add(counter.fallback, name)

    counter.installed[(cls, attr)] = func
    setattr(cls, attr, counted)


def _unwrap(counter: _Counter) -> None:
    for (cls, attr), func in counter.installed.items():
        setattr(cls, attr, func)
    counter.installed.clear()


def _per_file(config: pytest.Config) -> list[tuple[str, int, int, int, dict[str, int]]]:
    """(file, tests, tests that called a replaced function, tests where ours did the work, per name: tests)."""
    counter = config.stash[_COUNTER]
    rows = []
    for path, nodeids in sorted(config.stash[_TESTS].items()):
        called = [n for n in nodeids if counter.calls.get(n)]
        reached = [n for n in nodeids if counter.native.get(n)]
        names: dict[str, int] = {}
        for nodeid in reached:
            for name in counter.native[nodeid]:
                names[name] = names.get(name, 0) + 1
        rows.append((path, len(nodeids), len(called), len(reached), names))
    return rows


# --- hooks ----------------------------------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    mode = _mode()
    config.stash[_MODE] = mode
    config.stash[_COUNTER] = _Counter()
    config.stash[_TESTS] = {}
    if mode == "off":
        if os.environ.get("MOONCAKE_KVADDR_VLLM_PLUGIN") != "0":
            raise pytest.UsageError("the baseline run needs MOONCAKE_KVADDR_VLLM_PLUGIN=0")
        return
    import vllm.plugins

    vllm.plugins.load_general_plugins()


def pytest_collection_finish(session: pytest.Session) -> None:
    config = session.config
    for item in session.items:
        config.stash[_TESTS].setdefault(item.nodeid.split("::")[0], []).append(item.nodeid)
    if config.stash[_MODE] != "on":
        return
    from mooncake_kvaddr.integrations.vllm import plugin, registry
    from mooncake_kvaddr.integrations.vllm.releases import NOT_PORTED

    plugin.is_patched()  # runs the deferred check and patch if the import hook has not yet
    report = plugin.patch()  # the report of that patch (a fresh, inactive one when nothing was patched)
    config.stash[_REPORT] = report
    reasons = {
        "layouts": report.reason,
        "transport hook": report.hook_reason,
        "receive handler": report.receive_reason,
        "lookup": report.lookup_reason,
        "send handler": report.send_reason,
    }
    if report.vllm_version.startswith(plugin.SUPPORTED_VLLM_SERIES):
        # Every part the release module has ported must be replaced; one it has not says so (NOT_PORTED).
        problems = [f"{what}: {why}" for what, why in reasons.items() if why and not why.startswith(NOT_PORTED)]
        if problems or not report.active:
            raise pytest.UsageError(
                f"vLLM {report.vllm_version} is a release the plugin supports, but a ported part is not replaced: "
                + ("; ".join(problems) or "nothing patched")
            )
    missing = set(report.patched) - _patched_now()
    if missing:
        raise pytest.UsageError(f"the PatchReport names {sorted(missing)}, but vLLM's classes do not carry ours")
    counter = config.stash[_COUNTER]
    for (cls, attr), _original in list(registry.ORIGINALS.items()):
        if f"{cls.__name__}.{attr}" in report.patched:
            _wrap(counter, cls, attr, cls.__dict__[attr])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    counter = item.config.stash[_COUNTER]
    counter.current = item.nodeid
    try:
        return (yield)
    finally:
        counter.current = ""


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    mode = config.stash.get(_MODE, None)
    if mode is None:
        return
    _unwrap(config.stash[_COUNTER])
    found = _patched_now()
    problems = []
    if mode == "off" and found:
        problems.append(f"plugin off, but vLLM's attributes are ours at the end: {sorted(found)}")
    report = config.stash.get(_REPORT, None)
    if mode == "on" and report is not None and set(report.patched) - found:
        problems.append(f"plugin on, but no longer ours at the end: {sorted(set(report.patched) - found)}")
    if mode == "on":
        for path, _tests, called, reached, _names in _per_file(config):
            if called and not reached:
                problems.append(f"{path}: {called} test(s) called a replaced vLLM function, none reached ours")
    if problems:
        config.stash[_PROBLEM] = problems
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    mode = config.stash.get(_MODE, None)
    if mode is None:
        return
    for problem in config.stash.get(_PROBLEM, []):
        terminalreporter.write_line(f"vllm-suite: FAILED: {problem}", red=True)
    report = config.stash.get(_REPORT, None)
    if mode == "off" or report is None:
        terminalreporter.write_line(f"vllm-suite: mooncake_kvaddr plugin {mode}")
        return
    if report.active:
        terminalreporter.write_line(
            f"vllm-suite: plugin on, vLLM {report.vllm_version}: replaced {', '.join(report.patched)}"
        )
    else:
        terminalreporter.write_line(
            f"vllm-suite: plugin on, vLLM {report.vllm_version}: replaced nothing ({report.reason})"
        )
    for path, tests, called, reached, names in _per_file(config):
        detail = ", ".join(f"{name} {count}" for name, count in sorted(names.items()))
        terminalreporter.write_line(
            f"vllm-suite: {path}: {tests} test(s), {called} called a replaced function, {reached} reached ours"
            + (f" ({detail})" if detail else "")
        )
    counter = config.stash[_COUNTER]
    for name in sorted({name for per_test in counter.calls.values() for name in per_test}):
        native = sum(per_test.get(name, 0) for per_test in counter.native.values())
        fallback = sum(per_test.get(name, 0) for per_test in counter.fallback.values())
        calls = sum(per_test.get(name, 0) for per_test in counter.calls.values())
        line = f"vllm-suite: {name}: {calls} call(s) in the tests, {native} done by ours, {fallback} handed to vLLM's"
        stats = counter.stats.get(name)
        if stats is not None:  # the function's own counters also count the calls of its self-check at patch time
            line += f" (its stats, self-check included: {_stat_total(stats, 'fast')} natively, "
            line += f"{_stat_total(stats, 'fallback')} to vLLM's)"
        terminalreporter.write_line(line)


_MODE = pytest.StashKey[str]()
_COUNTER = pytest.StashKey[_Counter]()
_TESTS = pytest.StashKey[dict[str, list[str]]]()
_REPORT = pytest.StashKey[Any]()
_PROBLEM = pytest.StashKey[list[str]]()
