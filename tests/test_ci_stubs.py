"""The wheel matrix's import stand-ins (.ci/stubs; docs/native-client.md, "Wheel matrix") fail every call.

Read from the sources: each stub's table of functions (``STUB_CODE`` / ``STUB_NULL`` / ``STUB_CODE_MESSAGE``)
must match its linker version script, and no code may be 0 (success). With the stubs built (``.ci/stubs/
build.sh``; ``MOONCAKE_KVADDR_STUBS_DIR`` names the directory, default ``build/ci-stubs``): each library is
dlopened and every function called with null arguments must return exactly its error code or NULL, the
message out-parameters must be filled, and the library must export those functions and nothing else, each
with the symbol version its script gives. The stubs are built for the test when not given. Skipped where the
repository's ``.ci`` is absent (an installed test suite) or no C compiler is found.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STUBS = ROOT / ".ci" / "stubs"
# source stem -> the soname it is built as (.ci/stubs/build.sh)
SONAMES = {
    "libcuda": "libcuda.so.1",
    "libmlx5": "libmlx5.so.1",
    "libfabric": "libfabric.so.1",
    "libamdhip64": "libamdhip64.so.7",
    "libhsa-runtime64": "libhsa-runtime64.so.1",
}
NULL_ARGS = (None,) * 8  # more than any stubbed function takes; each ignores them

pytestmark = pytest.mark.skipif(not STUBS.is_dir(), reason="no .ci/stubs here (not a repository checkout)")


def _table(stem: str) -> dict[str, tuple[str, int | None]]:
    """name -> (kind, code) from the stub's source."""
    text = (STUBS / f"{stem}_stub.c").read_text()
    table: dict[str, tuple[str, int | None]] = {}
    pattern = r"^(STUB_CODE_MESSAGE|STUB_CODE|STUB_NULL)\((\w+)(?:,\s*([-\w]+))?\)"
    for kind, name, code in re.findall(pattern, text, re.M):
        assert name not in table, f"{name} twice in {stem}_stub.c"
        table[name] = (kind, int(code, 0) if code else None)
    assert table, f"no stub functions found in {stem}_stub.c"
    return table


def _versions(stem: str) -> dict[str, str]:
    """name -> version node ("" for the anonymous one) from the stub's version script."""
    text = re.sub(r"/\*.*?\*/", "", (STUBS / f"{stem}.map").read_text(), flags=re.S)
    names: dict[str, str] = {}
    for node, body in re.findall(r"([\w.]*)\s*\{(.*?)\}", text, re.S):
        globals_part = body.split("local:")[0].replace("global:", "")
        for name in re.findall(r"(\w+)\s*;", globals_part):
            names[name] = node
    return names


@pytest.fixture(scope="module")
def built_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built stubs: ``MOONCAKE_KVADDR_STUBS_DIR`` when set, else built here by ``.ci/stubs/build.sh`` into a
    temporary directory (so the tests run wherever a C compiler is, not only after the wheel matrix)."""
    given = os.environ.get("MOONCAKE_KVADDR_STUBS_DIR")
    if given:
        return Path(given)
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler to build .ci/stubs with")
    out = tmp_path_factory.mktemp("ci-stubs")
    subprocess.run(["bash", str(STUBS / "build.sh"), str(out)], check=True, capture_output=True, text=True)
    return out


@pytest.mark.parametrize("stem", sorted(SONAMES))
def test_every_stub_function_is_an_error_in_the_source(stem: str) -> None:
    table = _table(stem)
    assert set(table) == set(_versions(stem)), f"{stem}_stub.c and {stem}.map list different functions"
    for name, (kind, code) in table.items():
        if kind == "STUB_NULL":
            assert code is None, name
        else:
            assert code is not None and code != 0, f"{name} would report success"


@pytest.mark.parametrize("stem", sorted(SONAMES))
def test_built_stub_returns_its_error_from_every_function(built_dir: Path, stem: str) -> None:
    path = built_dir / SONAMES[stem]
    if not path.is_file():
        pytest.skip(f"{path} is not built (.ci/stubs/build.sh)")
    library = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL)
    for name, (kind, code) in _table(stem).items():
        fn = getattr(library, name)
        fn.argtypes = [ctypes.c_void_p] * len(NULL_ARGS)
        if kind == "STUB_NULL":
            fn.restype = ctypes.c_void_p
            assert fn(*NULL_ARGS) is None, f"{name} returned a pointer"
            continue
        fn.restype = ctypes.c_long
        assert fn(*NULL_ARGS) == code, name
        if kind == "STUB_CODE_MESSAGE":
            message = ctypes.c_char_p()
            fn.argtypes = [ctypes.c_long, ctypes.POINTER(ctypes.c_char_p)]
            assert fn(0, ctypes.byref(message)) == code, name
            assert message.value and b"stub" in message.value, name


@pytest.mark.parametrize("stem", sorted(SONAMES))
def test_built_stub_exports_exactly_its_table(built_dir: Path, stem: str) -> None:
    path = built_dir / SONAMES[stem]
    if not path.is_file():
        pytest.skip(f"{path} is not built (.ci/stubs/build.sh)")
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    out = subprocess.run([nm, "-D", "--defined-only", str(path)], check=True, capture_output=True, text=True).stdout
    exported: dict[str, str] = {}
    for line in out.splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[1] == "T":
            name, _, version = fields[2].partition("@@")
            exported[name] = version
    assert exported == _versions(stem)
    assert set(exported) == set(_table(stem))
