"""Which Mooncake wheel the native client's probe sees (driver/native_client.py; docs/native-client.md).

With whatever wheel is installed (the main environment's, or one venv of the wheel matrix, .ci/wheels), the
probe must find the shared library Python loaded the store from - ``mooncake/store.so`` up to 0.3.13,
``mooncake/_store*.so`` behind the ``mooncake.store`` package from 0.3.14 on - and name the distribution that
installed exactly that file, at its installed version. Nothing is built and no master is started. The
layout rules themselves are also checked on stand-in modules, so both layouts are covered whichever wheel
is installed.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import os
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from mooncake_kvaddr.driver import native_client as nc

EXTENSION_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


@pytest.mark.mooncake
def test_probe_finds_the_loaded_store_library_and_its_distribution() -> None:
    import mooncake
    import mooncake.store as ms

    library = nc.store_library()
    assert library is not None and os.path.isfile(library)
    assert library.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
    # It is the extension that defines the class mooncake.store hands out, inside the imported package.
    defining = sys.modules[ms.MooncakeDistributedStore.__module__]
    assert os.path.realpath(str(defining.__file__)) == os.path.realpath(library)
    package_dir = os.path.realpath(os.path.dirname(str(mooncake.__file__)))
    assert os.path.dirname(os.path.realpath(library)) == package_dir

    distribution = nc.mooncake_distribution()
    assert distribution is not None, f"no installed distribution owns {library}"
    name, version = distribution
    assert name.startswith("mooncake-transfer-engine")
    dist = importlib.metadata.distribution(name)
    assert dist.version == version
    owned = {os.path.realpath(str(dist.locate_file(entry))) for entry in dist.files or ()}
    assert os.path.realpath(library) in owned


def _fake_layout(monkeypatch: pytest.MonkeyPatch, tmp_path: Any, *, package: bool, extension: bool) -> str:
    """Stand-in ``mooncake.store``: an extension itself (``package=False``), or a package re-exporting the
    store class from ``mooncake._fake_store`` (an extension when ``extension``, else a ``.py`` module)."""
    defining_name = "mooncake.store" if not package else "mooncake._fake_store"
    suffix = EXTENSION_SUFFIX if extension else ".py"
    defining_file = str(tmp_path / (("store" if not package else "_fake_store") + suffix))
    defining = types.ModuleType(defining_name)
    defining.__file__ = defining_file
    store_class = type("MooncakeDistributedStore", (), {"__module__": defining_name})
    defining.MooncakeDistributedStore = store_class  # type: ignore[attr-defined]
    if package:
        front = types.ModuleType("mooncake.store")
        front.__file__ = str(tmp_path / "store" / "__init__.py")

        def __getattr__(name: str) -> Any:  # re-exports lazily, as Mooncake 0.3.14's package does
            if name == "MooncakeDistributedStore":
                return store_class
            raise AttributeError(name)

        front.__getattr__ = __getattr__  # type: ignore[method-assign]
        monkeypatch.setitem(sys.modules, "mooncake._fake_store", defining)
        monkeypatch.setitem(sys.modules, "mooncake.store", front)
    else:
        monkeypatch.setitem(sys.modules, "mooncake.store", defining)
    return defining_file


def test_store_library_of_a_store_so_layout(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    expected = _fake_layout(monkeypatch, tmp_path, package=False, extension=True)
    assert nc.store_library() == expected


def test_store_library_behind_a_store_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    expected = _fake_layout(monkeypatch, tmp_path, package=True, extension=True)
    assert nc.store_library() == expected


def test_no_store_library_when_the_class_comes_from_python(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    _fake_layout(monkeypatch, tmp_path, package=True, extension=False)
    assert nc.store_library() is None


def test_no_store_library_before_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "mooncake.store", raising=False)
    assert nc.store_library() is None


def test_probe_refuses_a_package_whose_class_is_not_from_an_extension(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    _fake_layout(monkeypatch, tmp_path, package=True, extension=False)
    store = sys.modules["mooncake.store"].MooncakeDistributedStore()
    native, reason = nc.NativeClient.probe(store)
    assert native is None and "do not come from a loaded extension module" in reason


def test_a_file_no_distribution_owns_has_no_distribution(tmp_path: Any) -> None:
    stray = tmp_path / ("store" + EXTENSION_SUFFIX)
    stray.write_bytes(b"")
    assert nc._distribution_of.__wrapped__(str(stray)) is None


def test_verified_versions_are_exactly_the_wheel_matrix_legs() -> None:
    """The verified set never grows beyond what the wheel matrix runs (.ci/wheels, its LEGS table)."""
    script = Path(__file__).resolve().parents[1] / ".ci" / "wheels"
    if not script.is_file():
        pytest.skip("no .ci/wheels here (not a repository checkout)")
    legs = re.findall(r'^\s*"[\w.-]+\|([\w.-]+)==([\w.]+)\|', script.read_text(), re.M)
    assert legs, "no legs found in .ci/wheels"
    assert set(legs) == set(nc.VERIFIED_VERSIONS)
