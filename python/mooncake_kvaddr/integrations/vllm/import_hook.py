"""Run a callback right after a watched module is first executed, without importing it (docs/vllm-plugin.md,
"Start-up"): the plugin's entry point defers its checks and patch to the first import of vLLM's store modules.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["AfterImportHook"]


class AfterImportHook:
    """A ``sys.meta_path`` finder that finds nothing itself: for a module of the package ``package`` it asks the
    finders after it and wraps the loader of the spec they return, so that ``on_executed(name)`` runs right after
    the module is executed (the real loader is put back on the module first). :attr:`executing` names the
    package's modules being executed meanwhile (one importing another is executing while the other runs).
    Whoever inserts it takes it out."""

    def __init__(self, package: str, on_executed: Callable[[str], None]) -> None:
        self._prefix = package + "."
        self._on_executed = on_executed
        self._local = threading.local()
        self.executing: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not fullname.startswith(self._prefix) or getattr(self._local, "busy", False):
            return None
        self._local.busy = True
        try:
            spec = None
            for finder in list(sys.meta_path):
                find = None if finder is self else getattr(finder, "find_spec", None)
                spec = find(fullname, path, target) if find is not None else None
                if spec is not None:
                    break
        finally:
            self._local.busy = False
        if spec is not None and spec.loader is not None and callable(getattr(spec.loader, "exec_module", None)):
            spec.loader = _ThenCall(spec.loader, fullname, self)
        return spec


class _ThenCall:
    """A loader that runs the real one (its module in the hook's ``executing`` meanwhile), puts it back on the
    module (so the module looks untouched), then calls the hook's callback."""

    def __init__(self, loader: Any, name: str, hook: AfterImportHook) -> None:
        self._loader = loader
        self._name = name
        self._hook = hook

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._hook.executing.add(self._name)
        try:
            self._loader.exec_module(module)
        finally:
            self._hook.executing.discard(self._name)
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._hook._on_executed(self._name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
