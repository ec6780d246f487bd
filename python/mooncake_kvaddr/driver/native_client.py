"""Mooncake's C++ client called directly, without its Python binding (:class:`NativeClient`).

Mooncake's bound batch methods convert ``list[list[int]]`` arguments element by element with the GIL held; ours takes
int64 arrays (or lists, converted once by our C++) and calls the client with the GIL released, code for code the
bound results. It stays off, with one logged reason, unless the platform, the Mooncake version and every symbol check
out (docs/native-client.md); a ``close()`` racing a call is the caller's to exclude (as :class:`MooncakeStore` does).
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.metadata
import logging
import os
import platform
import sys
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final, Protocol

from mooncake_kvaddr.core.flags import flag

if TYPE_CHECKING:
    from mooncake_kvaddr import _native

__all__ = [
    "ENV_VAR",
    "VERIFIED_VERSIONS",
    "KeyBlob",
    "NativeClient",
    "NativeClientUnavailable",
    "mooncake_distribution",
    "store_library",
]

logger = logging.getLogger(__name__)

ENV_VAR: Final = "MOONCAKE_KVADDR_NATIVE_CLIENT"
# (distribution, version) pairs this path was verified against: exactly the wheels the wheel matrix
# (.ci/wheels) runs the native-client tests on, each of which passed them (docs/native-client.md, "Verified
# with"; tests/test_native_client_wheel.py keeps the two lists equal). Device wheels were run on host memory.
VERIFIED_VERSIONS: Final = frozenset(
    {
        ("mooncake-transfer-engine-non-cuda", "0.3.13.post1"),
        ("mooncake-transfer-engine", "0.3.13.post1"),
        ("mooncake-transfer-engine-cuda13", "0.3.13.post1"),
        ("mooncake-transfer-engine-cuda13", "0.3.14"),
        ("mooncake-transfer-engine-efa-non-cuda", "0.3.13.post1"),
        ("mooncake-transfer-engine-efa", "0.3.13.post1"),
        ("mooncake-transfer-engine-efa-cuda13", "0.3.13.post1"),
        ("mooncake-transfer-engine-rocm", "0.3.13.post1"),
    }
)
_UNVERIFIED: Final = "unverified"
_logged: set[str] = set()


class NativeClientUnavailable(RuntimeError):
    """The native path cannot be used here; the message says why."""


class KeyBlob:
    """Keys as one flat byte blob cut at ``offsets`` (int64, ``n + 1`` entries, first 0, last ``len(data)``)."""

    __slots__ = ("data", "offsets")

    def __init__(self, data: bytes | bytearray | memoryview, offsets: Any) -> None:
        self.data = data
        self.offsets = offsets

    def __len__(self) -> int:
        return max(len(self.offsets) - 1, 0)


Keys = Sequence[str] | Sequence[bytes] | KeyBlob


class _GetMulti(Protocol):
    def __call__(
        self, keys: Keys, addrs: Any, sizes: Any, prefer_alloc_in_same_node: bool = False, *, ranges: Any = None
    ) -> list[int]: ...


class _PutMulti(Protocol):
    def __call__(self, keys: Keys, addrs: Any, sizes: Any, config: Any = None, *, ranges: Any = None) -> list[int]: ...


class _GetInto(Protocol):
    def __call__(self, keys: Keys, ptrs: Any, sizes: Any, *, ranges: Any = None) -> list[int]: ...


class _PutFrom(Protocol):
    def __call__(self, keys: Keys, ptrs: Any, sizes: Any, config: Any = None, *, ranges: Any = None) -> list[int]: ...


class _IsExist(Protocol):
    def __call__(self, keys: Keys) -> list[int]: ...


# The Mooncake wheels (all ship the import package ``mooncake``); asked first because scanning every installed
# distribution is slow.
_KNOWN_DISTRIBUTIONS: Final = (
    "mooncake-transfer-engine-non-cuda",
    "mooncake-transfer-engine",
    "mooncake-transfer-engine-cuda13",
    "mooncake-transfer-engine-efa",
    "mooncake-transfer-engine-efa-non-cuda",
    "mooncake-transfer-engine-efa-cuda13",
    "mooncake-transfer-engine-musa",
    "mooncake-transfer-engine-npu",
    "mooncake-transfer-engine-rocm",
)


def _is_extension(module: ModuleType | None) -> bool:
    """``module`` was loaded from a shared library (not a ``.py`` file or a namespace)."""
    if module is None:
        return False
    if isinstance(getattr(module, "__loader__", None), importlib.machinery.ExtensionFileLoader):
        return True
    location = getattr(module, "__file__", None)
    return isinstance(location, str) and location.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def _store_extension() -> ModuleType | None:
    """The loaded extension module that holds Mooncake's store (and so ``RealClient``), if any.

    Up to 0.3.13 that is ``mooncake.store`` itself (``mooncake/store.so``). From 0.3.14 on ``mooncake.store``
    is a package that re-exports an extension (``mooncake/_store.cpython-*.so``); it is found as the module
    that defines the ``MooncakeDistributedStore`` class the package hands out, whatever its file is called."""
    module = sys.modules.get("mooncake.store")
    if module is None:
        return None
    if _is_extension(module):
        return module
    try:
        cls = getattr(module, "MooncakeDistributedStore", None)
    except Exception:  # a package __getattr__ that fails (e.g. an unsupported backend) tells us nothing
        return None
    defining = sys.modules.get(getattr(cls, "__module__", None) or "")
    return defining if _is_extension(defining) else None


def store_library() -> str | None:
    """Path of the shared library Python loaded Mooncake's store from (None if ``mooncake.store`` is not
    imported, or its classes do not come from an extension module)."""
    location = getattr(_store_extension(), "__file__", None)
    return location if isinstance(location, str) and location else None


def _owns(dist: importlib.metadata.Distribution, library: str) -> bool:
    """``dist``'s installed-files record lists ``library`` (compared as real paths)."""
    wanted = os.path.realpath(library)
    name = os.path.basename(wanted)
    for entry in dist.files or ():
        if entry.name == name and os.path.realpath(str(dist.locate_file(entry))) == wanted:
            return True
    return False


def _provides(name: str, library: str | None) -> str | None:
    """Version of distribution ``name`` if it is installed (and its files include ``library``, when given)."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    if library is not None and not _owns(dist, library):
        return None
    return dist.version


def _candidates() -> Iterator[str]:
    """The known Mooncake wheels, then (only if none provides it) every distribution that installs ``mooncake``."""
    yield from _KNOWN_DISTRIBUTIONS
    try:
        names = importlib.metadata.packages_distributions().get("mooncake", [])
    except Exception:  # metadata of unrelated packages can be broken; then we know nothing
        return
    yield from sorted(set(names))


@functools.cache
def _distribution_of(library: str | None) -> tuple[str, str] | None:
    for name in _candidates():
        version = _provides(name, library)
        if version is not None:
            return name, version
    return None


def mooncake_distribution() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed wheel whose store library (:func:`store_library`) Python
    loaded, if known; before ``mooncake.store`` is imported, the first Mooncake wheel installed."""
    return _distribution_of(store_library())


class NativeClient:
    """Calls ``mooncake::RealClient`` directly; build it with :meth:`from_store` or :meth:`probe`.

    Methods mirror ``MooncakeDistributedStore``'s and return the same per-key codes as a ``list[int]``:
    keys as a sequence of ``str``/``bytes`` or a :class:`KeyBlob`; multi-buffer addresses/sizes as two 2-D
    int64 (or uint64) arrays of shape ``(keys, regions)`` or as sequences of rows; the contiguous calls take
    1-D arrays or sequences. Invalid input raises ``ValueError``/``TypeError`` before Mooncake is called.
    Thread-safe (calls release the GIL). Each method is its C++ handle's, returned by an attribute read that
    first checks the client is not stale: look it up for every call (``client.batch_get_into(...)``).
    """

    def __init__(self, store: Any, handle: Any, distribution: tuple[str, str] | None) -> None:
        """Use :meth:`from_store`."""
        self._store = store
        self._handle = handle
        self._distribution = distribution

    # ------------------------------------------------------------------ construction

    @classmethod
    def probe(cls, store: Any, *, symbol_overrides: dict[str, str] | None = None) -> tuple[NativeClient | None, str]:
        """``(client, "")`` if the native path works for ``store`` (a set-up ``MooncakeDistributedStore``),
        else ``(None, reason)``. Nothing of Mooncake is called to find out. ``symbol_overrides`` (tests
        only) replaces the mangled names looked up."""
        try:
            return cls._open(store, symbol_overrides), ""
        except NativeClientUnavailable as exc:
            return None, str(exc)

    @classmethod
    def from_store(cls, store: Any) -> NativeClient | None:
        """The native client for ``store``, or ``None`` (the reason is logged once at INFO)."""
        client, reason = cls.probe(store)
        if client is None and reason not in _logged:
            _logged.add(reason)
            logger.info("native Mooncake client off: %s", reason)
        return client

    @classmethod
    def _open(cls, store: Any, symbol_overrides: dict[str, str] | None) -> NativeClient:
        raw = os.environ.get(ENV_VAR)
        setting = (raw or "").strip().lower()
        try:
            wanted = setting == _UNVERIFIED or flag(raw, True, ENV_VAR)
        except ValueError as exc:  # the bound methods always work: an unreadable switch is off, said loudly
            logger.warning("native Mooncake client off: %s (or %s)", exc, _UNVERIFIED)
            raise NativeClientUnavailable(str(exc)) from None
        if not wanted:
            raise NativeClientUnavailable(f"disabled by {ENV_VAR}={raw}")
        if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
            raise NativeClientUnavailable(
                f"implemented for x86-64 Linux only (this is {sys.platform}/{platform.machine()})"
            )
        try:
            from mooncake_kvaddr import _native
        except ImportError as exc:
            raise NativeClientUnavailable(f"native extension not importable: {exc}") from exc
        why = _native.mooncake_client_platform_reason()
        if why:
            raise NativeClientUnavailable(why)
        module = sys.modules.get("mooncake.store")
        if module is None or type(store) is not getattr(module, "MooncakeDistributedStore", None):
            raise NativeClientUnavailable(f"not a mooncake.store.MooncakeDistributedStore: {type(store).__name__}")
        library = store_library()
        if not library:
            raise NativeClientUnavailable(
                f"mooncake.store's classes do not come from a loaded extension module "
                f"({getattr(module, '__file__', None)!r}, class module {type(store).__module__!r})"
            )
        distribution = mooncake_distribution()
        if distribution not in VERIFIED_VERSIONS and setting != _UNVERIFIED:
            raise NativeClientUnavailable(
                f"Mooncake {distribution or 'of unknown version'} is not a verified version "
                f"({sorted(VERIFIED_VERSIONS)}); {ENV_VAR}={_UNVERIFIED} tries it anyway (all checks still apply)"
            )
        get_capsule = getattr(store, "_get_pyclient_capsule", None)
        if get_capsule is None:
            raise NativeClientUnavailable("this Mooncake store has no _get_pyclient_capsule (not the C++ store)")
        capsule = get_capsule()
        if capsule is None:
            raise NativeClientUnavailable("the store is not set up (or closed)")
        try:
            handle = _native.MooncakeClient(capsule, library, module.ReplicateConfig(), symbol_overrides, KeyBlob)
        except RuntimeError as exc:
            raise NativeClientUnavailable(str(exc)) from exc
        return cls(store, handle, distribution)

    # ------------------------------------------------------------------ properties

    @property
    def library(self) -> str:
        """Path of the store library (``store.so``, or ``_store*.so`` from 0.3.14 on) whose client is called."""
        return str(self._handle.library)

    @property
    def slots(self) -> dict[str, int]:
        """Vtable slot of each method used (diagnostics only: methods are found by name)."""
        return dict(self._handle.slots)

    @property
    def distribution(self) -> tuple[str, str] | None:
        """``(distribution, version)`` of the Mooncake wheel in use."""
        return self._distribution

    @property
    def closed(self) -> bool:
        """True after :meth:`close` (or once the store was found closed / set up again)."""
        return bool(self._handle.closed)

    def close(self) -> None:
        """Drop this object's reference to Mooncake's client; later calls raise ``RuntimeError``."""
        self._handle.close()

    # ------------------------------------------------------------------ calls

    # Each call is the C++ handle's own bound method, handed out after the staleness check: calling it leaves no
    # frame of this module on the stack when Mooncake is called (docs/architecture.md, "The load path"). The
    # handle takes a KeyBlob as one argument (it knows the type from _open) and ``ranges`` by keyword only.

    def _checked(self) -> _native.MooncakeClient:
        """The handle, after checking that the store still holds this client (not closed, not set up again)."""
        handle: _native.MooncakeClient = self._handle
        if not handle.same_client(self._store._get_pyclient_capsule()):
            handle.close()
            raise RuntimeError("the Mooncake store was closed or set up again: this native client is stale")
        return handle

    @property
    def batch_get_into_multi_buffers(self) -> _GetMulti:
        """``(keys, addrs, sizes, prefer_alloc_in_same_node=False, *, ranges=None)``; per key: bytes read (> 0)
        or a negative Mooncake error code.

        ``ranges`` (the registered-range guard, docs/native-client.md): a ``(n, 2)`` int64 array of ``[start,
        end)`` pairs; a key with any slice not inside one of them (or negative, null, wrapping) gets -600 and is
        not sent to Mooncake (checked in C++, GIL released for matrices); :func:`last_refused` counts them."""
        return self._checked().batch_get_into_multi_buffers

    @property
    def batch_put_from_multi_buffers(self) -> _PutMulti:
        """``(keys, addrs, sizes, config=None, *, ranges=None)``; per key: 0 or a negative code. ``config``: a
        ``mooncake.store.ReplicateConfig`` (None: default). ``ranges``: as for
        :attr:`batch_get_into_multi_buffers`."""
        return self._checked().batch_put_from_multi_buffers

    @property
    def batch_get_into(self) -> _GetInto:
        """``(keys, ptrs, sizes, *, ranges=None)``: one contiguous buffer per key. Per key: bytes read or a
        negative code (``ranges``: the guard)."""
        return self._checked().batch_get_into

    @property
    def batch_put_from(self) -> _PutFrom:
        """``(keys, ptrs, sizes, config=None, *, ranges=None)``: one contiguous buffer per key. Per key: 0 or a
        negative code (``ranges``: the guard)."""
        return self._checked().batch_put_from

    @staticmethod
    def last_refused() -> int:
        """Keys the calling thread's last call with ``ranges`` refused (-600, not sent to Mooncake)."""
        from mooncake_kvaddr import _native

        native: Any = _native  # the stub is the lead's to extend (docs/native-client.md)
        return int(native.mooncake_client_last_refused())

    @property
    def batch_is_exist(self) -> _IsExist:
        """``(keys)``; per key: 1 present, 0 absent, negative on error. Grants a read lease, like the bound
        method."""
        return self._checked().batch_is_exist

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"NativeClient({state}, {self.library}, {self._distribution})"
