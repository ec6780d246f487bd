"""vLLM general plugin: makes the installed vLLM's Mooncake store connector use mooncake_kvaddr's native
kernels, with no change to vLLM or to the user's code (docs/vllm-plugin.md).

:func:`register` (the ``vllm.general_plugins`` entry point) checks before it replaces anything; a failed check
leaves that part vLLM's, with one warning. The replacements live beside this module, vLLM's originals in ``registry``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from mooncake_kvaddr.core.flags import flag
from mooncake_kvaddr.integrations.vllm.import_hook import AfterImportHook
from mooncake_kvaddr.integrations.vllm.registry import (
    DATA_MODULE,
    ORIGINALS,
    WORKER_MODULE,
    fingerprint,
    fingerprint_problem,
    fingerprint_source,
    replace_attribute,
    restore_all,
    static_attribute,
    vllm_functions,
)
from mooncake_kvaddr.integrations.vllm.releases import NOT_PORTED, Release, for_version, known_series
from mooncake_kvaddr.integrations.vllm.transports import (
    DEFAULT_STAGING_BYTES,
    ENV_NATIVE_CLIENT,
    ENV_STAGED,
    ENV_STAGING_BYTES,
    EXTRA_NATIVE_CLIENT,
    EXTRA_STAGED,
    EXTRA_STAGING_BYTES,
    TRANSPORT_ATTR,
    hook_shape_problem,
    maybe_stage_store,
    native_client_setting,
    staged_settings,
    wrap_worker,
)

__all__ = [
    "DATA_MODULE",
    "DEFAULT_STAGING_BYTES",
    "ENV_NATIVE_CLIENT",
    "ENV_PLUGIN",
    "ENV_STAGED",
    "ENV_STAGING_BYTES",
    "EXTRA_NATIVE_CLIENT",
    "EXTRA_STAGED",
    "EXTRA_STAGING_BYTES",
    "SUPPORTED_VLLM_SERIES",
    "TRANSPORT_ATTR",
    "WORKER_MODULE",
    "PatchReport",
    "fingerprint",
    "fingerprint_problem",
    "fingerprint_source",
    "is_patched",
    "is_receive_patched",
    "is_send_patched",
    "maybe_stage_store",
    "native_client_setting",
    "patch",
    "register",
    "staged_settings",
    "unpatch",
    "vllm_functions",
]

#: vLLM release series the plugin knows, one release module each (``releases/``).
SUPPORTED_VLLM_SERIES = known_series()
#: Set to ``0``/``false``/``off``/``no`` to keep vLLM untouched.
ENV_PLUGIN = "MOONCAKE_KVADDR_VLLM_PLUGIN"
#: Logged under vLLM's logger tree so that vLLM's own logging configuration shows the line.
logger = logging.getLogger("vllm.mooncake_kvaddr")

_STATE_LOCK = threading.RLock()
_REPORT: PatchReport | None = None
#: The report whose line :func:`register` logged (the line is logged once per patch).
_LOGGED: PatchReport | None = None
_WARNED = False

@dataclass
class PatchReport:
    """What :func:`patch` did: the vLLM version, the replaced ``Class.method`` names, whether the staged
    transport hook is installed, or why nothing was patched."""

    vllm_version: str
    patched: list[str] = field(default_factory=list)
    staged_hook: bool = False
    reason: str = ""
    #: Why vLLM's own receive handler was kept while the rest is patched ("" when it was replaced, or off).
    receive_reason: str = ""
    #: Why the worker's transport hook was not installed ("" when it was, or when there is no worker module).
    hook_reason: str = ""
    #: Why vLLM's own ``MooncakeStoreWorker.lookup`` was kept ("" when it was replaced, or off).
    lookup_reason: str = ""
    #: Why vLLM's own send handler was kept ("" when it was replaced, or off).
    send_reason: str = ""

    @property
    def active(self) -> bool:
        """True when vLLM runs with the replaced methods."""
        return bool(self.patched)


def _disabled_by_env(environ: Mapping[str, str]) -> bool:
    """True when :data:`ENV_PLUGIN` turns the plugin off, or spells neither on nor off (one warning naming it:
    register() never raises into vLLM, and a value it cannot read leaves vLLM untouched)."""
    return not flag(environ.get(ENV_PLUGIN), True, ENV_PLUGIN, or_off=logger.name)


# --- patching ---------------------------------------------------------------------------------------------------


def is_patched() -> bool:
    """True while vLLM runs with our methods. After :func:`register` deferred the work (no Mooncake store
    module imported yet, docs/vllm-plugin.md "Start-up"), this does it first: imports vLLM's Mooncake store
    modules, checks and patches, as :func:`register` did before."""
    _run_deferred()
    return bool(ORIGINALS)


def is_receive_patched() -> bool:
    """True while vLLM's receive threads run our ``_handle_request`` (resolves deferred work as
    :func:`is_patched`)."""
    return _replaced("KVCacheStoreRecvingThread", "_handle_request")


def is_send_patched() -> bool:
    """True while vLLM's send threads run our ``_handle_request`` (resolves deferred work as :func:`is_patched`)."""
    return _replaced("KVCacheStoreSendingThread", "_handle_request")


def _replaced(cls_name: str, name: str) -> bool:
    """Whether ``cls_name.name`` is replaced now, deferred work resolved first (as :func:`is_patched`)."""
    _run_deferred()
    return any(cls.__name__ == cls_name and attr == name for cls, attr in ORIGINALS)


def _fingerprint_problem(report: PatchReport, release: Release, part: str, data: ModuleType,
                         worker: ModuleType | None, layout: ModuleType) -> str:
    functions = vllm_functions(release.fingerprinted[part], data, worker, layout)
    return fingerprint_problem(report.vllm_version, functions, release.fingerprints)


def _install(report: PatchReport, release: Release, part: str, modules: tuple[ModuleType, ModuleType, ModuleType],
             cls_name: str, attr: str, shape_problem: str, build: Callable[[Any], Any],
             self_check: Callable[[Any], object]) -> None:
    """Replace ``cls_name.attr`` of the worker module with ``build(vLLM's own)`` unless the part's shape check
    (``shape_problem``) or its fingerprints name a problem, or ``self_check(replacement)`` raises; the reason
    goes to the report's ``<part>_reason``."""
    data, worker, layout = modules
    problem = shape_problem or _fingerprint_problem(report, release, part, data, worker, layout)
    if problem:
        setattr(report, f"{part}_reason", problem)
        return
    cls = getattr(worker, cls_name)
    replacement = build(static_attribute(cls, attr))
    try:
        self_check(replacement)
    except Exception as exc:
        setattr(report, f"{part}_reason", f"self-check failed: {exc}")
        return
    replace_attribute(cls, attr, replacement)
    report.patched.append(f"{cls_name}.{attr}")


def _sample_layouts(release: Release) -> Any:
    if release.sample_layouts is None:
        raise AssertionError("the release has no self-check layouts")
    return release.sample_layouts


def _patch_receive(release: Release, data: ModuleType, worker: ModuleType, layout: ModuleType,
                   report: PatchReport) -> None:
    """Replace ``KVCacheStoreRecvingThread._handle_request`` after its own shape check and self-check (the
    layouts must be patched already: the handler plans only layouts backed by our engine)."""
    from mooncake_kvaddr.integrations.vllm import receive, receive_check

    problem = receive_check.check_shape(data, worker, release.process_tokens)
    _install(report, release, "receive", (data, worker, layout), "KVCacheStoreRecvingThread", "_handle_request",
             f"unexpected shape: {problem}" if problem else "",
             lambda original: receive.make_handler(original, data, worker, release.ours, release.plan_engines,
                                                   release.kinds(data, layout)),
             lambda handler: receive_check.self_check(data, worker, handler, layouts=layout,
                                                      sample=_sample_layouts(release)))


def _patch_lookup(release: Release, data: ModuleType, worker: ModuleType, layout: ModuleType,
                  report: PatchReport) -> None:
    """Replace ``MooncakeStoreWorker.lookup`` after its own shape check, fingerprint and self-check."""
    from mooncake_kvaddr.integrations.vllm import lookup

    rules = release.lookup_rules
    _install(report, release, "lookup", (data, worker, layout), "MooncakeStoreWorker", "lookup",
             lookup.check_shape(worker, rules),
             lambda original: lookup.make_lookup(original, worker, rules),
             lambda replacement: lookup.self_check(worker, replacement, rules=rules))


def _patch_send(release: Release, data: ModuleType, worker: ModuleType, layout: ModuleType,
                report: PatchReport) -> None:
    """Replace ``KVCacheStoreSendingThread._handle_request`` after its shape check, fingerprints and self-check
    (the layouts must be patched already, as for the receive handler)."""
    from mooncake_kvaddr.integrations.vllm import send, send_check

    rules = release.send_rules
    if rules is None:
        report.send_reason = "the release has no send rules"
        return
    _install(report, release, "send", (data, worker, layout), "KVCacheStoreSendingThread", "_handle_request",
             send_check.check_shape(data, worker, rules),
             lambda original: send.make_handler(original, data, worker, release.ours, release.plan_engines,
                                                release.kinds(data, layout), rules),
             lambda handler: send_check.self_check(data, worker, handler, layouts=layout,
                                                   sample=_sample_layouts(release)))


def _patch_parts(release: Release, data: ModuleType, worker: ModuleType, layout: ModuleType, report: PatchReport,
                 receive: bool | None, lookup: bool | None, send: bool | None) -> None:
    """The worker's transport hook and the handlers, each where the release has it ported and it is not turned
    off; a part that fails keeps vLLM's own (its reason on the report), the rest stays patched."""
    if "worker" not in release.ported:
        report.hook_reason = release.not_ported
    else:
        methods = release.worker_methods
        report.hook_reason = hook_shape_problem(worker, methods) or _fingerprint_problem(
            report, release, "worker", data, worker, layout
        )
        if not report.hook_reason:
            wrap_worker(worker.MooncakeStoreWorker, through=[m for m in methods if m != "register_kv_caches"])
            report.staged_hook = True
    from mooncake_kvaddr.integrations.vllm.lookup import lookup_enabled
    from mooncake_kvaddr.integrations.vllm.receive import receive_enabled
    from mooncake_kvaddr.integrations.vllm.send import send_enabled

    parts = (
        ("receive", receive, receive_enabled, _patch_receive),
        ("lookup", lookup, lookup_enabled, _patch_lookup),
        ("send", send, send_enabled, _patch_send),
    )
    for part, wanted, enabled, patch_part in parts:
        if not (wanted if wanted is not None else enabled(os.environ)):
            continue
        if part not in release.ported:
            setattr(report, f"{part}_reason", release.not_ported)
            continue
        try:
            patch_part(release, data, worker, layout, report)
        except Exception as exc:  # the rest stays patched; only this part stays vLLM's
            setattr(report, f"{part}_reason", f"{type(exc).__name__}: {exc}")


def patch(
    *,
    data: ModuleType | None = None,
    worker: ModuleType | None = None,
    version: str | None = None,
    receive: bool | None = None,
    lookup: bool | None = None,
    send: bool | None = None,
    layout: ModuleType | None = None,
) -> PatchReport:
    """Check, self-check and patch (see the module docstring); idempotent. Returns what was done.

    ``data``/``worker``/``version`` default to the installed vLLM's modules and version (tests pass their own);
    ``layout`` to the module where the release keeps its store layouts (``data`` on 0.32/0.33).
    ``receive``: replace the receive handler (None: unless :data:`ENV_RECV` turns it off).
    ``lookup``: replace the worker's lookup (None: unless ``MOONCAKE_KVADDR_VLLM_LOOKUP`` turns it off).
    ``send``: replace the send handler (None: unless ``MOONCAKE_KVADDR_VLLM_SEND`` turns it off).
    """
    global _REPORT
    if _REPORT is not None and _REPORT.active:
        return _REPORT
    import importlib

    if data is None or version is None:
        # Imported before the lock is taken: the import hook (register) may be running this very import's
        # deferred work in another thread, holding the module's import lock while it waits for ours.
        import vllm

        version = version or str(getattr(vllm, "__version__", "unknown"))
        if not version.startswith(SUPPORTED_VLLM_SERIES):
            return PatchReport(vllm_version=version, reason=_unknown_release(version))
        data = data or importlib.import_module(DATA_MODULE)
        if worker is None:
            try:
                worker = importlib.import_module(WORKER_MODULE)
            except Exception as exc:  # worker needs vLLM's full stack; the layouts do not
                logger.debug("mooncake_kvaddr: no staged-transport hook (%s)", exc)
                worker = None
    release = for_version(version) if version.startswith(SUPPORTED_VLLM_SERIES) else None
    if release is not None and layout is None:
        layout = data if release.layout_module == DATA_MODULE else importlib.import_module(release.layout_module)
    with _STATE_LOCK:
        if _REPORT is not None and _REPORT.active:
            return _REPORT
        report = PatchReport(vllm_version=version)
        if release is None or layout is None:
            report.reason = _unknown_release(version)
            return report
        problem = release.check_shape(layout, worker)
        if problem:
            report.reason = f"vLLM {version}'s Mooncake store module has an unexpected shape: {problem}"
            return report
        try:
            release.self_check(layout)
        except Exception as exc:
            report.reason = f"self-check against vLLM {version} failed: {exc}"
            return report
        problem = _fingerprint_problem(report, release, "layouts", data, worker, layout)
        if problem:
            report.reason = f"vLLM {version}: {problem}"
            return report
        for cls_name, name, func in release.replacements:
            replace_attribute(getattr(layout, cls_name), name, func)
            report.patched.append(f"{cls_name}.{name}")
        if worker is not None:
            _patch_parts(release, data, worker, layout, report, receive, lookup, send)
        _REPORT = report
        return report


def unpatch() -> None:
    """Restore every replaced attribute (tests and benchmarks compare with and without the plugin)."""
    global _REPORT
    with _STATE_LOCK:
        restore_all()
        _REPORT = None
        _cancel_deferred()


def __getattr__(name: str) -> Any:
    # The layouts' self-check, imported on first use: the entry point must not load the native module.
    if name == "self_check":
        from mooncake_kvaddr.integrations.vllm.layouts import self_check

        return self_check
    if name == "ENV_RECV":  # the receive handler's switch, defined with it
        from mooncake_kvaddr.integrations.vllm.receive import ENV_RECV

        return ENV_RECV
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- start-up: the entry point defers its work to the first import of the Mooncake store modules ---------------

_WATCHED = (DATA_MODULE, WORKER_MODULE)
_HOOK: AfterImportHook | None = None


def _store_module_executed(name: str) -> None:
    """A module of the store package finished executing: patch now, unless another one is still executing (it
    imports this one: ``worker`` imports ``data``, and on vLLM 0.34 ``protocol`` and ``selective_lease`` do,
    which ``worker`` imports; ``worker`` cannot be imported before they finish). The hook fires again then."""
    hook = _HOOK
    if hook is not None and hook.executing:
        return
    _run_deferred()


def _cancel_deferred() -> bool:
    """Take the hook out of ``sys.meta_path``; True when one was pending."""
    global _HOOK
    with _STATE_LOCK:
        hook, _HOOK = _HOOK, None
        if hook is None:
            return False
        try:
            sys.meta_path.remove(hook)
        except ValueError:
            pass
        return True


def _run_deferred() -> None:
    """The work :func:`register` deferred, if it is still pending (never raises)."""
    if _HOOK is not None and _cancel_deferred():
        _activate()


def register() -> None:
    """The ``vllm.general_plugins`` entry point: patch vLLM unless turned off; never raises.

    vLLM runs it in every process, most of which never build a Mooncake store worker. So when vLLM's Mooncake
    store modules are not imported yet, it only checks the release and installs an import hook; the checks
    and the patch run when one of those modules is first imported (or when :func:`is_patched` is asked),
    with the same log line (docs/vllm-plugin.md, "Start-up")."""
    global _HOOK
    if _disabled_by_env(os.environ):
        logger.debug("mooncake_kvaddr: vLLM plugin turned off by %s", ENV_PLUGIN)
        return
    try:
        with _STATE_LOCK:
            if (_REPORT is not None and _REPORT.active) or _HOOK is not None:
                return
            if not any(name in sys.modules for name in _WATCHED):
                import vllm

                version = str(getattr(vllm, "__version__", "unknown"))
                if not version.startswith(SUPPORTED_VLLM_SERIES):
                    # Deciding needs only the version: a release we do not know is never imported into.
                    _warn_once(_unknown_release(version))
                    return
                _HOOK = AfterImportHook(DATA_MODULE.rpartition(".")[0], _store_module_executed)
                sys.meta_path.insert(0, _HOOK)
                logger.debug("mooncake_kvaddr: patches vLLM %s on first import of its Mooncake store", version)
                return
    except Exception as exc:  # a plugin must never break vLLM's start-up
        logger.warning("mooncake_kvaddr: vLLM left untouched: %s: %s", type(exc).__name__, exc)
        return
    _activate()


def _activate() -> None:
    """Check, self-check and patch now; log the one line (or the one warning). Never raises."""
    global _LOGGED
    try:
        report = patch()
    except Exception as exc:  # a plugin must never break vLLM's start-up
        logger.warning("mooncake_kvaddr: vLLM left untouched: %s: %s", type(exc).__name__, exc)
        return
    with _STATE_LOCK:
        if report.active and report is _LOGGED:
            return  # patched (and logged) before
        _LOGGED = report
    if report.active:
        logger.info(
            "mooncake_kvaddr: native Mooncake store paths active for vLLM %s: %s%s",
            report.vllm_version,
            ", ".join(report.patched),
            " (+ staged-transport hook)" if report.staged_hook else "",
        )
        _kept("store transports off (vLLM's worker kept as is)", report.hook_reason)
        _kept("vLLM's own receive handler kept", report.receive_reason)
        _kept("vLLM's own lookup kept", report.lookup_reason)
        _kept("vLLM's own send handler kept", report.send_reason)
    else:
        _warn_once(report.reason)


def _kept(what: str, reason: str) -> None:
    """One line for a part that stays vLLM's (none without a ``reason``): a warning, or INFO where the release has it
    not ported (by design)."""
    if not reason:
        return
    level = logging.INFO if reason.startswith(NOT_PORTED) else logging.WARNING
    logger.log(level, "mooncake_kvaddr: %s: %s", what, reason)


def _unknown_release(version: str) -> str:
    return f"vLLM {version} is not a release this plugin knows ({'x, '.join(SUPPORTED_VLLM_SERIES)}x)"


def _warn_once(reason: str) -> None:
    """The one warning of a process whose vLLM stays untouched."""
    global _WARNED
    with _STATE_LOCK:
        if _WARNED:
            return
        _WARNED = True
    logger.warning("mooncake_kvaddr: vLLM left untouched: %s", reason)
