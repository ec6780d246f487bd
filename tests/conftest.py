"""Shared fixtures: an embedded Mooncake master per test module and a store client on it.

Tests marked ``@pytest.mark.mooncake`` are skipped (with the import error as the reason) when
``mooncake.store`` cannot be imported. Tests marked ``vllm`` are for vLLM 0.32/0.33 unless
``vllm_release(...)`` names their releases; those for another release than the installed one are deselected
(docs/development.md, "Tests"). Every master a test starts is stopped, and a session-wide check fails the run
if a ``mooncake_master`` child outlives the tests.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvaddr_testing import live_children
from mooncake_kvaddr.driver.config import StoreConfig
from mooncake_kvaddr.driver.master import EmbeddedMaster
from mooncake_kvaddr.driver.store import MooncakeStore

# Room for every shared-store test at once (the pool is the sum of all mounted segments).
SHARED_SEGMENT = "256MiB"
# Small enough that the shared client splits most batches, so every test exercises splitting.
SHARED_REGION_BUDGET = 64


@functools.cache
def mooncake_import_error() -> str | None:
    """Why ``mooncake.store`` cannot be imported, or None if it can."""
    from mooncake_kvaddr.driver.store import load_mooncake

    try:
        load_mooncake()
    except ImportError as exc:
        return str(exc)
    return None


#: The vLLM release series a test marked ``vllm`` is for when it carries no ``vllm_release`` marker.
DEFAULT_VLLM_SERIES = ("0.32", "0.33")
_DESELECTED = pytest.StashKey[str]()


@functools.cache
def installed_vllm_series() -> str | None:
    """The installed vLLM's release series ("0.34" for 0.34.0), read from its metadata (no import), or None."""
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None
    return ".".join(version.split(".")[:2])


def vllm_series_of(item: pytest.Item) -> tuple[str, ...] | None:
    """The vLLM series a test is for (None: any, it does not compare against vLLM)."""
    marker = item.get_closest_marker("vllm_release")
    if marker is None:
        return DEFAULT_VLLM_SERIES if item.get_closest_marker("vllm") is not None else None
    if item.get_closest_marker("vllm") is None:
        raise pytest.UsageError(f"{item.nodeid}: vllm_release without the vllm marker")
    if not marker.args or not all(isinstance(a, str) and re.fullmatch(r"\d+\.\d+", a) for a in marker.args):
        raise pytest.UsageError(f"{item.nodeid}: vllm_release takes series such as '0.34', got {marker.args!r}")
    return tuple(marker.args)


def _deselect_other_vllm_releases(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect (not skip) the tests written for other vLLM releases than the installed one."""
    installed = installed_vllm_series()
    kept: list[pytest.Item] = []
    deselected: list[pytest.Item] = []
    dropped: dict[tuple[str, ...], int] = {}
    for item in items:
        series = vllm_series_of(item)
        if installed is None or series is None or installed in series:
            kept.append(item)
        else:
            deselected.append(item)
            dropped[series] = dropped.get(series, 0) + 1
    if not deselected:
        return
    config.hook.pytest_deselected(items=deselected)
    items[:] = kept
    version = importlib.metadata.version("vllm")
    detail = ", ".join(f"{'/'.join(series)}: {count}" for series, count in sorted(dropped.items()))
    config.stash[_DESELECTED] = (
        f"vllm_release: {sum(dropped.values())} test(s) deselected, written for other vLLM releases than the "
        f"installed {version} ({detail})"
    )


#: Test files written for one release series: ``test_vllm034*.py`` is for 0.34 (its tests carry the marker too).
_RELEASE_FILE = re.compile(r"test_vllm(\d)(\d\d)\w*\.py")
_IGNORED_FILES: list[str] = []


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A release's own test files are not even imported under another installed release: importing them there
    could only skip at module level (the marker's deselection acts on collected tests)."""
    match = _RELEASE_FILE.fullmatch(collection_path.name)
    if match is None:
        return None
    # Without vLLM (the wheel leg's venv) no release's files are collected: each is about its installed release.
    if f"{int(match.group(1))}.{int(match.group(2))}" == installed_vllm_series():
        return None
    if collection_path.name not in _IGNORED_FILES:
        _IGNORED_FILES.append(collection_path.name)
    return True


def pytest_report_collectionfinish(config: pytest.Config) -> list[str]:
    line = config.stash.get(_DESELECTED, "")
    lines = [line] if line else []
    if _IGNORED_FILES:
        names = ", ".join(sorted(_IGNORED_FILES))
        installed = installed_vllm_series()
        under = f"under vLLM {installed}" if installed else "without vLLM"
        lines.append(f"vllm_release: not collected {under}: {names}")
    return lines


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _deselect_other_vllm_releases(config, items)
    marked = [item for item in items if item.get_closest_marker("mooncake") is not None]
    if not marked:
        return
    error = mooncake_import_error()
    if error is None:
        return
    skip = pytest.mark.skip(reason=f"mooncake.store is not importable: {error}")
    for item in marked:
        item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def no_leaked_masters() -> Iterator[None]:
    """Fail the session if any test left a master running."""
    before = set(live_children("mooncake_master"))
    yield
    leaked = set(live_children("mooncake_master")) - before
    assert not leaked, f"mooncake_master processes leaked by the tests: {sorted(leaked)}"


@pytest.fixture(scope="module")
def master() -> Iterator[EmbeddedMaster]:
    """A master on free loopback ports, ready, shared by one test module."""
    if mooncake_import_error() is not None:
        pytest.skip(f"mooncake.store is not importable: {mooncake_import_error()}")
    with EmbeddedMaster() as running:
        yield running


@pytest.fixture(scope="module")
def store_config(master: EmbeddedMaster) -> StoreConfig:
    """Client configuration for the module's master."""
    return StoreConfig(
        master_server_address=master.rpc_address,
        global_segment_size=SHARED_SEGMENT,
        local_buffer_size=0,
        max_regions_per_batch=SHARED_REGION_BUDGET,
    )


@pytest.fixture(scope="module")
def store(store_config: StoreConfig) -> Iterator[MooncakeStore]:
    """A ready client shared by one test module (closing one takes 1-2 s, so tests share it)."""
    with MooncakeStore(store_config) as client:
        yield client


@pytest.fixture
def key_prefix(request: pytest.FixtureRequest) -> str:
    """A prefix unique to the test, so tests sharing a store never see each other's keys."""
    return f"{request.node.name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def model(key_prefix: str) -> str:
    """A model name unique to the test: its keys never collide with another test's."""
    return key_prefix.replace("@", "_")
