"""Run a callback right after a watched module is first executed, without importing it (docs/vllm-plugin.md,
"Start-up"): the plugin's entry point defers its checks and patch to the first import of vLLM's store modules.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Collection
from types import ModuleType
from typing import Any

__all__ = ["AfterImportHook"]


class AfterImportHook:
    """A ``sys.meta_path`` finder that finds nothing itself: for a module of ``watched`` it asks the finders after
    it and wraps the loader of the spec they return, so that ``on_executed(name)`` runs right after the module
    is executed (the real loader is put back on the module first). Whoever inserts it takes it out."""

    def __init__(self, watched: Collection[str], on_executed: Callable[[str], None]) -> None:
        self._watched = watched
        self._on_executed = on_executed
        self._local = threading.local()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self._watched or getattr(self._local, "busy", False):
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
            spec.loader = _ThenCall(spec.loader, fullname, self._on_executed)
        return spec


class _ThenCall:
    """A loader that runs the real one, puts it back on the module (so the module looks untouched), then calls
    the hook's callback."""

    def __init__(self, loader: Any, name: str, then: Callable[[str], None]) -> None:
        self._loader = loader
        self._name = name
        self._then = then

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._then(self._name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
