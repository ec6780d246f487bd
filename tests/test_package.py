"""The package as a whole: its layers (docs/architecture.md), one version, public names that resolve, the bench.

Layer rules are checked twice: statically (every import statement in every module of the package, function-level
ones included, and every ``importlib.import_module``-style call whose module name is a string literal or a
module-level string constant) and at run time (a fresh interpreter imports a layer and lists ``sys.modules``).
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import json
import pkgutil
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import mooncake_kvaddr
from mooncake_kvaddr import _version

if TYPE_CHECKING:
    from mooncake_kvaddr.driver.store import MooncakeStore

PACKAGE_DIR = Path(mooncake_kvaddr.__file__).parent
TESTS_DIR = Path(__file__).resolve().parent
PYPROJECT = TESTS_DIR.parent / "pyproject.toml"

BENCH = "mooncake_kvaddr.bench"
# The suite's own modules (tests/*.py, importable as top-level names when tests/ is on the path, or as
# ``tests.*``): the package never imports them; the installed wheel does not even ship them.
TEST_MODULES: tuple[str, ...] = ("tests", *sorted(p.stem for p in TESTS_DIR.glob("*.py")))

# layer -> module prefixes it must never import (docs/architecture.md, "Layers"). "top" is the package's own
# top-level modules (``__init__``, ``__main__``, ``demo``, ...); every other layer is a subpackage.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "core": ("mooncake_kvaddr.driver", "mooncake_kvaddr.integrations", BENCH, "mooncake", *TEST_MODULES),
    "driver": ("mooncake_kvaddr.integrations", BENCH, *TEST_MODULES),
    "integrations": (BENCH, *TEST_MODULES),
    "top": (BENCH, *TEST_MODULES),
    "bench": TEST_MODULES,
}

# Calls that import the module named by their first argument (importlib.import_module, __import__,
# runpy.run_module, pkgutil.resolve_name): a literal name there is an import like any other.
_DYNAMIC_IMPORTS = frozenset({"import_module", "__import__", "run_module", "resolve_name"})


def _package_of(path: Path, module: str) -> str:
    return module if path.name == "__init__.py" else module.rsplit(".", 1)[0]


def _resolve(name: str, level: int, package: str) -> str:
    """``name`` imported ``level`` dots up from ``package`` (level 0: absolute)."""
    if not level:
        return name
    base = package.rsplit(".", level - 1)[0] if level > 1 else package
    return f"{base}.{name}" if name else base


def _literal(node: ast.expr | None, constants: dict[str, str]) -> str | None:
    """The string ``node`` stands for: a literal, or a module-level constant assigned one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    return None


def _dynamic_target(node: ast.Call, constants: dict[str, str]) -> str | None:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in _DYNAMIC_IMPORTS:
        return None
    arg = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg in ("name", "mod_name")), None)
    return _literal(arg, constants)


def _imports(path: Path, module: str) -> set[str]:
    """Every module ``path`` imports anywhere in its body, relative imports resolved against ``module``."""
    found: set[str] = set()
    package = _package_of(path, module)
    tree = ast.parse(path.read_text(), str(path))
    constants = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            name = _resolve(node.module or "", node.level, package)
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and (target := _dynamic_target(node, constants)):
            target = target.split(":", 1)[0]  # pkgutil.resolve_name's "module:attribute"
            level = len(target) - len(target.lstrip("."))
            found.add(_resolve(target[level:], level, package))
    return found


def _layer_of(path: Path) -> str | None:
    """The layer ``path`` (a module of the package) belongs to; ``None`` for a subpackage with no rules."""
    parts = path.relative_to(PACKAGE_DIR).parts
    if len(parts) == 1:
        return "top"
    return parts[0] if parts[0] in FORBIDDEN else None


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("mooncake_kvaddr", *parts))


def _package_modules() -> list[tuple[str, Path]]:
    """Every module of the package, as (dotted name, source path)."""
    return [(_module_name(p), p) for p in sorted(PACKAGE_DIR.rglob("*.py"))]


def _layer_modules(layer: str) -> list[tuple[str, Path]]:
    return [(name, p) for name, p in _package_modules() if _layer_of(p) == layer]


def _hits(names: set[str], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(n == f or n.startswith(f + ".") for f in forbidden))


def test_every_module_belongs_to_a_layer_with_rules() -> None:
    # A new subpackage (as ``testing/`` once was) must be given its rules here and in docs/architecture.md.
    unplaced = [name for name, path in _package_modules() if _layer_of(path) is None]
    assert not unplaced, f"modules outside every layer of docs/architecture.md: {unplaced}"
    assert {_layer_of(path) for _, path in _package_modules()} == set(FORBIDDEN)


# The developers' guide: a module docstring says why the module exists in a few lines; detail goes to docs/.
MAX_MODULE_DOCSTRING_LINES = 7


def _long_docstrings(paths: list[Path]) -> dict[str, int]:
    """Each file whose module docstring has more than MAX_MODULE_DOCSTRING_LINES lines, with its line count."""
    counts = {str(p): len((ast.get_docstring(ast.parse(p.read_text(), str(p)), clean=False) or "").splitlines())
              for p in paths}
    return {p: n for p, n in counts.items() if n > MAX_MODULE_DOCSTRING_LINES}


def test_module_docstrings_are_at_most_seven_lines() -> None:
    paths = sorted(PACKAGE_DIR.rglob("*.py"))
    assert len(paths) > 20  # the scan saw the package, not an empty directory
    assert not (long := _long_docstrings(paths)), f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines: {long}"


def test_docstring_check_counts_every_line_of_a_module_docstring(tmp_path: Path) -> None:
    # What makes the rule able to fail: eight lines are caught, seven (and none) pass.
    eight, seven, bare = tmp_path / "eight.py", tmp_path / "seven.py", tmp_path / "bare.py"
    eight.write_text('"""One.\n\n3\n4\n5\n6\n7\n8\n"""\nX = 1\n')
    seven.write_text('"""One.\n\n3\n4\n5\n6\n7\n"""\nX = 1\n')
    bare.write_text("X = 1\n")
    assert _long_docstrings([eight, seven, bare]) == {str(eight): 8}


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_sources_never_import_the_layers_above(layer: str) -> None:
    modules = _layer_modules(layer)
    assert modules, f"no modules found for layer {layer} under {PACKAGE_DIR}"
    bad = {name: hits for name, path in modules if (hits := _hits(_imports(path, name), FORBIDDEN[layer]))}
    assert not bad, f"{layer} imports what it must not: {bad}"


def test_nothing_outside_the_bench_imports_it() -> None:
    # The rule the layer table implies, stated once over the whole package: only bench/ itself imports bench.
    outside = [(name, path) for name, path in _package_modules() if _layer_of(path) != "bench"]
    assert len(outside) > 20  # the scan saw the library, not an empty directory
    bad = {name: hits for name, path in outside if (hits := _hits(_imports(path, name), (BENCH,)))}
    assert not bad, f"the library imports the bench: {bad}"


def test_import_scanner_sees_function_level_and_relative_imports(tmp_path: Path) -> None:
    # The scanner is what makes the layer test able to fail: pin that it sees the imports that are easy to miss.
    source = tmp_path / "mod.py"
    source.write_text("def f():\n    from mooncake_kvaddr.driver import store\n    from ..driver import master\n")
    names = _imports(source, "mooncake_kvaddr.core.mod")
    assert _hits(names, FORBIDDEN["core"]) == [
        "mooncake_kvaddr.driver",
        "mooncake_kvaddr.driver.master",
        "mooncake_kvaddr.driver.store",
    ]


def test_import_scanner_sees_dynamic_imports_by_name(tmp_path: Path) -> None:
    source = tmp_path / "mod.py"
    source.write_text(
        "import importlib, runpy, pkgutil\n"
        "BENCH_MODULE = 'mooncake_kvaddr.bench.tcp'\n"
        "def f():\n"
        "    importlib.import_module('mooncake_kvaddr.bench.harness')\n"
        "    importlib.import_module(name='..bench.workload', package=__package__)\n"
        "    importlib.import_module(BENCH_MODULE)\n"
        "    __import__('kvaddr_testing')\n"
        "    runpy.run_module('mooncake_kvaddr.bench', run_name='__main__')\n"
        "    pkgutil.resolve_name('mooncake_kvaddr.bench.cli:main')\n"
    )
    names = _imports(source, "mooncake_kvaddr.driver.mod")
    assert _hits(names, FORBIDDEN["driver"]) == [
        "kvaddr_testing",
        "mooncake_kvaddr.bench",
        "mooncake_kvaddr.bench.cli",
        "mooncake_kvaddr.bench.harness",
        "mooncake_kvaddr.bench.tcp",
        "mooncake_kvaddr.bench.workload",
    ]


def test_the_bench_and_test_modules_are_forbidden_names() -> None:
    # Guard the rule table itself: the tests' helpers are named, and the bench may use every library layer.
    assert {"tests", "conftest", "kvaddr_testing", "fake_mooncake"} <= set(TEST_MODULES)
    assert all(BENCH in FORBIDDEN[layer] for layer in ("core", "driver", "integrations", "top"))
    assert _hits({"mooncake_kvaddr.core", "mooncake_kvaddr.driver", "mooncake_kvaddr.integrations"},
                 FORBIDDEN["bench"]) == []


def _modules_after(statement: str) -> list[str]:
    """``sys.modules`` names after running ``statement`` in a fresh interpreter."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    loaded: list[str] = json.loads(out.stdout.splitlines()[-1])
    return loaded


def test_importing_the_core_loads_no_driver_and_no_mooncake() -> None:
    core = "; ".join(f"import {name}" for name, _ in _layer_modules("core"))
    loaded = _modules_after(f"import mooncake_kvaddr; {core}")
    assert "mooncake_kvaddr.core.database" in loaded  # the probe really imported the core
    assert _hits(set(loaded), FORBIDDEN["core"]) == []


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_importing_a_layer_loads_nothing_it_must_not(layer: str) -> None:
    # ``__main__`` modules run a command when imported (bench/__main__.py runs the benchmark): leave them out.
    names = [name for name, _ in _layer_modules(layer) if not name.endswith(".__main__")]
    loaded = _modules_after("import mooncake_kvaddr; " + "; ".join(f"import {name}" for name in names))
    assert set(names) <= set(loaded)  # the probe really imported the layer
    assert _hits(set(loaded), FORBIDDEN[layer]) == []


def test_the_bench_command_runs_the_bench_in_a_child_process() -> None:
    # ``python -m mooncake_kvaddr bench`` reaches the benchmark without importing it into the library's process.
    out = subprocess.run([sys.executable, "-m", "mooncake_kvaddr", "bench", "--help"], capture_output=True,
                         text=True, check=True, timeout=120)
    assert "usage: python -m mooncake_kvaddr.bench" in out.stdout
    loaded = _modules_after("from mooncake_kvaddr.__main__ import main; main(['--help'])")
    assert _hits(set(loaded), (BENCH,)) == []


def test_driver_names_load_lazily() -> None:
    assert "mooncake_kvaddr.driver" not in _modules_after("import mooncake_kvaddr")
    assert "mooncake_kvaddr.driver.store" in _modules_after("import mooncake_kvaddr; mooncake_kvaddr.MooncakeStore")


def _modules_with_all() -> list[str]:
    """Every public module of the package that declares ``__all__`` (private and ``__main__`` modules skipped)."""
    names = ["mooncake_kvaddr"]
    for info in pkgutil.walk_packages([str(PACKAGE_DIR)], "mooncake_kvaddr."):
        if not info.name.rsplit(".", 1)[-1].startswith("_"):
            names.append(info.name)
    return [n for n in names if hasattr(importlib.import_module(n), "__all__")]


@pytest.mark.parametrize("module_name", _modules_with_all())
def test_all_names_resolve(module_name: str) -> None:
    module = importlib.import_module(module_name)
    names = module.__all__
    assert len(names) == len(set(names)), f"{module_name}.__all__ has duplicates"
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"{module_name}.__all__ names that do not resolve: {missing}"


def test_dir_lists_the_lazy_names() -> None:
    assert set(mooncake_kvaddr.__all__) <= set(dir(mooncake_kvaddr))


def test_version_is_written_once() -> None:
    assert mooncake_kvaddr.__version__ == _version.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", _version.__version__)
    if PYPROJECT.is_file():  # absent when the suite runs from an installed copy without the source tree
        text = PYPROJECT.read_text()
        assert re.search(r'^dynamic = \["version"\]', text, re.M), "pyproject.toml must read the version"
        assert not re.search(r"^version\s*=", text, re.M), "pyproject.toml must not write a version of its own"
        assert 'metadata.version.input = "python/mooncake_kvaddr/_version.py"' in text


def test_installed_metadata_carries_the_same_version() -> None:
    try:
        installed = importlib.metadata.version("mooncake_kvaddr")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("mooncake_kvaddr is imported from the source tree, not installed")
    assert installed == mooncake_kvaddr.__version__


# ------------------------------------------------------------------------------------------ the bench


def test_bench_tables_name_their_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    from mooncake_kvaddr.bench import addresses
    from mooncake_kvaddr.bench.harness import NUMPY_BASELINE
    from mooncake_kvaddr.bench.workload import Shape

    out = addresses.run(Shape(tokens=1024, regions=2), reps=1)
    assert out["baseline"].startswith(NUMPY_BASELINE)
    assert out["rows"][NUMPY_BASELINE]["speedup_vs_baseline"] == pytest.approx(1.0)
    assert f"baseline: {NUMPY_BASELINE}" in capsys.readouterr().out


def test_bench_vllm_releases_table_names_its_baseline_per_release(capsys: pytest.CaptureFixture[str]) -> None:
    # The side-by-side of vLLM releases: every ratio is against the same release's vLLM alone on the same case
    # and metric, never across releases; a part with no figure has no ratio.
    from mooncake_kvaddr.bench.vllm_releases import ALONE, PLUGIN, _row, summarise

    def result(release: str, alone: float, plugin: float | None) -> dict[str, object]:
        rows = [_row(release, "receive thread", "receive", "GIL ms", ALONE, alone),
                _row(release, "receive thread", "receive", "GIL ms", PLUGIN, plugin, "" if plugin else "not ported")]
        return {"vllm": release, "parts": {}, "rows": rows}

    out = summarise([result("0.33.0", 40.0, 2.0), result("0.34.0", 50.0, None)], ["a note"])
    rows = out["rows"]
    assert rows["0.33.0 / receive / GIL ms / with the plugin"]["ratio"] == pytest.approx(20.0)
    assert rows["0.34.0 / receive / GIL ms / vLLM alone"]["ratio"] == pytest.approx(1.0)
    assert rows["0.34.0 / receive / GIL ms / with the plugin"]["ratio"] is None
    assert rows["0.34.0 / receive / GIL ms / with the plugin"]["baseline"] == "vLLM 0.34.0 alone"
    assert out["releases"] == ["0.33.0", "0.34.0"] and out["notes"] == ["a note"]
    printed = capsys.readouterr().out
    assert "baseline: the same release's vLLM alone on the same case and metric" in printed


def test_bench_timing_table_rejects_an_unknown_baseline() -> None:
    from mooncake_kvaddr.bench.harness import Result, timing_table

    with pytest.raises(ValueError, match="baseline"):
        timing_table("t", [Result("a", [1.0])], "b")


def test_bench_reports_failures_with_mooncakes_codes() -> None:
    from mooncake_kvaddr.bench.tcp import describe_outcomes

    assert describe_outcomes({"ok": 4}) == "ok"
    assert describe_outcomes({"ok": 1, "transfer_failed": 3}) == "FAILED: transfer_failed (-800) x 3"
    assert describe_outcomes({"ok": 4}, "boom") == "FAILED: error: boom"


#: The most modules of the package a multi-buffer ``KVTransfer.load`` may cross on its way to Mooncake's call
#: (docs/architecture.md, "The load path").
LOAD_PATH_MODULES = 5


def _package_stack(frame: types.FrameType | None) -> list[str]:
    """The package's modules on the call stack from ``frame`` outwards, outermost first, each named once."""
    modules: list[str] = []
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("mooncake_kvaddr.") and name not in modules:
            modules.append(name)
        frame = frame.f_back
    return modules[::-1]


def _assert_load_path(stacks: list[list[str]]) -> None:
    """One Mooncake call, reached from the transfer face through at most LOAD_PATH_MODULES modules, the
    driver's call layer last."""
    assert len(stacks) == 1, stacks
    modules = stacks[0]
    assert modules[0] == "mooncake_kvaddr.driver.transfer", modules
    assert modules[-1] == "mooncake_kvaddr.driver.store_calls", modules
    assert len(modules) <= LOAD_PATH_MODULES, modules


def test_a_multi_buffer_load_reaches_mooncake_through_five_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """The package's modules on the call stack when a load's get reaches Mooncake (the in-memory stand-in): at
    most five, transfer face first and the driver's call layer last. A new layer in between fails here."""
    import numpy as np

    from fake_mooncake import fake_store
    from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata, KVTransfer
    from mooncake_kvaddr.driver.transfer import TransferRequest

    stacks: list[list[str]] = []

    def watch(frame: types.FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code.co_name.startswith("batch_get_into") and "fake_mooncake" in (
            frame.f_code.co_filename
        ):
            stacks.append(_package_stack(frame.f_back))

    with fake_store(monkeypatch) as (store, _fake):
        db = ChunkedTokenDatabase(KeyMetadata("m", 0, 1, 1, 0), 16)
        caches = [np.zeros((8, 256), np.uint8) for _ in range(3)]
        transfer = KVTransfer(store, [db], transfer_mode="multi_buffer", start_threads=False)
        try:
            transfer.register_kv_caches(caches, 8)
            request = TransferRequest("r", 32, [b"\x00" * 4, b"\x01" * 4], [[1, 2]])
            assert transfer.store(request).stored == 2
            sys.setprofile(watch)
            try:
                loaded = transfer.load(request)
            finally:
                sys.setprofile(None)
        finally:
            transfer.close()
    assert loaded.ok and loaded.loaded_block_ids == {1, 2} and loaded.mode == "multi_buffer"
    _assert_load_path(stacks)


@pytest.mark.mooncake
def test_a_multi_buffer_load_on_the_native_client_reaches_mooncake_through_five_modules(
    store: MooncakeStore, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same bound on the default path: a real Mooncake store (an embedded master on loopback) with our
    native client. The stack is taken where the client's C++ handle is called (its
    ``batch_get_into_multi_buffers`` calls Mooncake): no module of the package may stand between the call layer
    and the handle. (A profile hook's ``c_call`` does not fire there on CPython 3.11: a bound builtin method
    called with ``*args`` is not traced, so a stand-in for the handle records the stack and calls the handle.)"""
    import numpy as np

    from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata, KVTransfer, _native
    from mooncake_kvaddr.driver.native_client import NativeClient
    from mooncake_kvaddr.driver.transfer import TransferRequest

    native = store._native
    if native is None:
        assert store._client is not None
        probed, reason = NativeClient.probe(store._client)
        assert probed is None, "the native client works here, yet the store does not use it"
        pytest.skip(f"native client unavailable here: {reason}")
    handle = native._handle
    stacks: list[list[str]] = []
    made: list[int] = []  # Mooncake calls each handle call made

    class Handle:
        """The handle, recording the package's modules on the stack of each multi-buffer get."""

        def __getattr__(self, name: str) -> object:
            return getattr(handle, name)

        def batch_get_into_multi_buffers(self, *args: object, **kwargs: object) -> object:
            stacks.append(_package_stack(sys._getframe(1)))
            before = _native.mooncake_client_call_count()
            try:
                return handle.batch_get_into_multi_buffers(*args, **kwargs)
            finally:
                made.append(_native.mooncake_client_call_count() - before)

    db = ChunkedTokenDatabase(KeyMetadata(model, 0, 1, 1, 0), 16)
    caches = [np.zeros((8, 256), np.uint8) for _ in range(3)]
    transfer = KVTransfer(store, [db], transfer_mode="multi_buffer", start_threads=False)
    try:
        transfer.register_kv_caches(caches, 8)
        for i, cache in enumerate(caches):
            cache[1:3] = (np.arange(2 * 256).reshape(2, 256) * 7 + i) % 251
        request = TransferRequest("r", 32, [b"\x02" * 4, b"\x03" * 4], [[1, 2]])
        assert transfer.store(request).stored == 2
        expected = [cache[1:3].copy() for cache in caches]
        monkeypatch.setattr(native, "_handle", Handle())
        loaded = transfer.load(TransferRequest("r", 32, request.block_hashes, [[5, 6]]))
    finally:
        transfer.close()
    assert loaded.ok and loaded.loaded_block_ids == {5, 6} and loaded.mode == "multi_buffer"
    assert all((cache[5:7] == want).all() for cache, want in zip(caches, expected, strict=True))
    # The native client's handle called Mooncake for the load's get (Mooncake's bound method was not used).
    assert made == [1], made
    _assert_load_path(stacks)
