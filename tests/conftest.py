"""Shared fixtures: an embedded Mooncake master per test module and a store client on it.

Tests marked ``@pytest.mark.mooncake`` are skipped (with the import error as the reason) when
``mooncake.store`` cannot be imported; everything else runs without Mooncake. Every master a test starts
is stopped, and a session-wide check fails the run if a ``mooncake_master`` child outlives the tests.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake_kvaddr.driver.config import StoreConfig
from mooncake_kvaddr.driver.master import EmbeddedMaster, process_is_running
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [item for item in items if item.get_closest_marker("mooncake") is not None]
    if not marked:
        return
    error = mooncake_import_error()
    if error is None:
        return
    skip = pytest.mark.skip(reason=f"mooncake.store is not importable: {error}")
    for item in marked:
        item.add_marker(skip)


def _master_children() -> list[int]:
    """PIDs of live ``mooncake_master`` processes whose parent is this test process."""
    me = os.getpid()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.find("(") + 1 : stat.rfind(")")]
        fields = stat[stat.rfind(")") + 2 :].split()
        if name == "mooncake_master" and int(fields[1]) == me and process_is_running(int(entry.name)):
            found.append(int(entry.name))
    return found


@pytest.fixture(scope="session", autouse=True)
def no_leaked_masters() -> Iterator[None]:
    """Fail the session if any test left a master running."""
    before = set(_master_children())
    yield
    leaked = set(_master_children()) - before
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
