"""The package as a whole: its layers (docs/architecture.md), one version, public names that resolve, the bench.

Layer rules are checked twice: statically (every import statement in a layer's source, function-level ones
included) and at run time (a fresh interpreter imports a layer and lists ``sys.modules``).
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
from pathlib import Path

import pytest

import mooncake_kvaddr
from mooncake_kvaddr import _version

PACKAGE_DIR = Path(mooncake_kvaddr.__file__).parent
PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"

# layer -> module prefixes it must never import (docs/architecture.md, "Layers").
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "core": ("mooncake_kvaddr.driver", "mooncake_kvaddr.integrations", "mooncake_kvaddr.bench", "mooncake"),
    "driver": ("mooncake_kvaddr.integrations", "mooncake_kvaddr.bench"),
}


def _imports(path: Path, module: str) -> set[str]:
    """Every module ``path`` imports anywhere in its body, relative imports resolved against ``module``."""
    found: set[str] = set()
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return found


def _layer_modules(layer: str) -> list[tuple[str, Path]]:
    return [
        (f"mooncake_kvaddr.{layer}." + ".".join(p.relative_to(PACKAGE_DIR / layer).with_suffix("").parts), p)
        for p in sorted((PACKAGE_DIR / layer).rglob("*.py"))
    ]


def _hits(names: set[str], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(n == f or n.startswith(f + ".") for f in forbidden))


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_sources_never_import_the_layers_above(layer: str) -> None:
    modules = _layer_modules(layer)
    assert modules, f"no modules found under {PACKAGE_DIR / layer}"
    bad = {name: hits for name, path in modules if (hits := _hits(_imports(path, name), FORBIDDEN[layer]))}
    assert not bad, f"{layer} imports what it must not: {bad}"


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


def test_bench_timing_table_rejects_an_unknown_baseline() -> None:
    from mooncake_kvaddr.bench.harness import Result, timing_table

    with pytest.raises(ValueError, match="baseline"):
        timing_table("t", [Result("a", [1.0])], "b")


def test_bench_reports_failures_with_mooncakes_codes() -> None:
    from mooncake_kvaddr.bench.tcp import describe_outcomes

    assert describe_outcomes({"ok": 4}) == "ok"
    assert describe_outcomes({"ok": 1, "transfer_failed": 3}) == "FAILED: transfer_failed (-800) x 3"
    assert describe_outcomes({"ok": 4}, "boom") == "FAILED: error: boom"
