"""StoreConfig: defaults, size and address parsing, validation at construction, vLLM's config file (compared
with vLLM's own parser when vLLM is installed), and no process-wide side effects of importing / setting up."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mooncake_kvaddr
from mooncake_kvaddr.driver.config import (
    DEFAULT_CONFIG_ENV,
    DEFAULT_CONNECT_TIMEOUT_S,
    VLLM_CONNECTOR_KEYS,
    StoreConfig,
    parse_address,
    parse_size,
)

MiB = 1 << 20
GiB = 1 << 30


def write_json(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(data))
    return path


def test_defaults_are_tcp_p2p_and_name_no_master() -> None:
    config = StoreConfig()
    assert config.local_hostname == "127.0.0.1"
    assert config.metadata_server == "P2PHANDSHAKE"
    # No master unless asked: neither an address nor a private embedded one.
    assert config.master_server_address is None and not config.embedded_master and not config.has_master
    assert config.protocol == "tcp" and config.device_name == ""
    assert config.global_segment_size == 512 * MiB
    assert config.local_buffer_size == 16 * MiB
    assert config.tenant == config.tenant_id == "default"
    assert config.mode is None and config.topology == "embedded" and not config.enable_offload
    assert config.region_budget == 1000
    assert StoreConfig(embedded_master=True).has_master
    assert StoreConfig(master_server_address="10.0.0.1:50051").has_master


def test_region_budget_defaults_by_protocol_and_can_be_set() -> None:
    assert StoreConfig(protocol="rdma").region_budget == 1 << 20
    assert StoreConfig(protocol="RDMA").protocol == "rdma"
    assert StoreConfig(max_regions_per_batch=7).region_budget == 7


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GB", 4 * GiB),
        ("4gb", 4 * GiB),
        ("512MiB", 512 * MiB),
        ("512 MB", 512 * MiB),
        ("1.5 GB", 3 * GiB // 2),
        ("1k", 1024),
        ("0", 0),
        ("  42  ", 42),
        ("7B", 7),
        ("2T", 2 << 40),
        (".5M", MiB // 2),
        (4096, 4096),
        (3.0 * GiB, 3 * GiB),
        ("4398046511104", 4398046511104),
    ],
)
def test_parse_size(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("lots", ValueError, "cannot parse"),
        ("4 parsecs", ValueError, "unknown size unit"),
        ("4 G B", ValueError, "cannot parse"),
        ("-1GB", ValueError, "cannot parse"),
        ("", ValueError, "cannot parse"),
        (-5, ValueError, ">= 0"),
        (1.5, ValueError, "whole number"),
        (float("inf"), ValueError, "whole number"),
        (True, TypeError, "bool"),
        (None, TypeError, "NoneType"),
        ([1], TypeError, "list"),
    ],
)
def test_parse_size_rejects(value: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        parse_size(value, "global_segment_size")


def test_size_fields_are_parsed_and_errors_name_the_field() -> None:
    config = StoreConfig(global_segment_size="1GB", local_buffer_size="0")  # type: ignore[arg-type]
    assert config.global_segment_size == GiB and config.local_buffer_size == 0
    assert StoreConfig(global_segment_size=0).global_segment_size == 0
    assert StoreConfig(global_segment_size="16MiB").global_segment_size == 16 * MiB  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="local_buffer_size"):
        StoreConfig(local_buffer_size="many")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="global_segment_size"):
        StoreConfig(global_segment_size=-1)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"protocol": "udp"}, ValueError, "protocol"),
        ({"global_segment_size": "8MiB"}, ValueError, "global_segment_size: Mooncake needs 0"),
        ({"protocol": 1}, TypeError, "protocol"),
        ({"local_hostname": ""}, ValueError, "local_hostname"),
        ({"metadata_server": ""}, ValueError, "metadata_server"),
        ({"master_server_address": "  "}, ValueError, "master_server_address"),
        ({"master_server_address": 50051}, TypeError, "master_server_address"),
        ({"tenant_id": 7}, TypeError, "tenant_id"),
        ({"mode": "cluster"}, ValueError, "mode: must be one of"),
        ({"mode": "embedded", "global_segment_size": 0}, ValueError, "needs global_segment_size > 0"),
        ({"mode": "standalone-store"}, ValueError, "needs global_segment_size 0"),
        ({"enable_offload": "false"}, TypeError, "enable_offload"),
        ({"enable_offload": 2}, TypeError, "enable_offload"),
        ({"embedded_master": "yes"}, TypeError, "embedded_master"),
        ({"embedded_master": True, "master_server_address": "127.0.0.1:50051"}, ValueError, "choose one"),
        ({"setup_retries": 0}, ValueError, "setup_retries"),
        ({"setup_retries": 10**6}, ValueError, "setup_retries"),
        ({"local_hostname": "host name"}, ValueError, "local_hostname"),
        ({"local_hostname": "127.0.0.1:0"}, ValueError, "local_hostname: port"),
        ({"max_regions_per_batch": 0}, ValueError, "max_regions_per_batch"),
        ({"max_regions_per_batch": 1.5}, TypeError, "max_regions_per_batch"),
        ({"staging_buffer_size": 0}, ValueError, r"staging_buffer_size: must be > 0 \(use transfer_mode="),
        ({"staging_buffer_size": "0MiB"}, ValueError, "staging_buffer_size: must be > 0"),
        ({"setup_retries": -1}, ValueError, "setup_retries"),
        ({"close_timeout_s": 0}, ValueError, "close_timeout_s"),
        ({"connect_timeout_s": 0}, ValueError, "connect_timeout_s"),
        ({"connect_timeout_s": float("inf")}, ValueError, "connect_timeout_s"),
        ({"connect_timeout_s": "30"}, TypeError, "connect_timeout_s"),
        ({"connect_timeout_s": True}, TypeError, "connect_timeout_s"),
        ({"max_abandoned_calls": -1}, ValueError, "max_abandoned_calls"),
        ({"max_abandoned_calls": 10**6}, ValueError, "max_abandoned_calls"),
        ({"max_abandoned_calls": True}, TypeError, "max_abandoned_calls"),
        ({"max_abandoned_calls": 2.0}, TypeError, "max_abandoned_calls"),
        ({"master_start_timeout_s": "10"}, TypeError, "master_start_timeout_s"),
        ({"master_args": "-v=1"}, TypeError, "master_args"),
        ({"master_args": [1]}, TypeError, "master_args"),
    ],
)
def test_invalid_fields_are_rejected_by_name(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        StoreConfig(**kwargs)  # type: ignore[arg-type]


def test_connect_timeout_defaults_to_a_bound_under_30_s_and_loads_from_a_file(tmp_path: Path) -> None:
    assert StoreConfig().connect_timeout_s == DEFAULT_CONNECT_TIMEOUT_S and 0 < DEFAULT_CONNECT_TIMEOUT_S <= 25
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "127.0.0.1:50051", "connect_timeout_s": 3}))
    loaded = StoreConfig.from_json(path)
    assert loaded.connect_timeout_s == 3.0 and isinstance(loaded.connect_timeout_s, float)


def test_int_fields_accept_their_bounds() -> None:
    from mooncake_kvaddr.driver import config as config_module

    top = StoreConfig(
        setup_retries=config_module._MAX_SETUP_RETRIES, max_abandoned_calls=config_module._MAX_ABANDONED_CALLS_LIMIT
    )
    assert top.setup_retries == config_module._MAX_SETUP_RETRIES
    assert top.max_abandoned_calls == config_module._MAX_ABANDONED_CALLS_LIMIT
    low = StoreConfig(setup_retries=1, max_abandoned_calls=0, max_regions_per_batch=1)
    assert (low.setup_retries, low.max_abandoned_calls, low.region_budget) == (1, 0, 1)
    with pytest.raises(ValueError, match="setup_retries"):
        StoreConfig(setup_retries=config_module._MAX_SETUP_RETRIES + 1)
    with pytest.raises(ValueError, match="max_abandoned_calls"):
        StoreConfig(max_abandoned_calls=config_module._MAX_ABANDONED_CALLS_LIMIT + 1)


def test_config_is_frozen_and_normalised() -> None:
    config = StoreConfig(master_server_address=" 127.0.0.1:1234 ", master_args=["-a=1"])  # type: ignore[arg-type]
    assert config.master_server_address == "127.0.0.1:1234" and not config.embedded_master
    assert config.master_args == ("-a=1",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.protocol = "rdma"  # type: ignore[misc]


def test_from_json_reads_vllm_format(tmp_path: Path) -> None:
    path = write_json(
        tmp_path,
        {
            "local_hostname": "10.0.0.2",
            "metadata_server": "http://10.0.0.1:8080/metadata",
            "global_segment_size": "3GB",
            "local_buffer_size": 1073741824,
            "protocol": "rdma",
            "device_name": "mlx5_0",
            "master_server_address": "10.0.0.1:50051",
        },
    )
    config = StoreConfig.from_json(path)
    assert config.local_hostname == "10.0.0.2"
    assert config.global_segment_size == 3 * GiB and config.local_buffer_size == GiB
    assert config.protocol == "rdma" and config.device_name == "mlx5_0"
    assert config.master_server_address == "10.0.0.1:50051"
    assert StoreConfig.from_json(path, protocol="tcp").protocol == "tcp"


def test_from_json_errors_name_the_file_and_key(tmp_path: Path) -> None:
    path = write_json(tmp_path, {"protocol": "tcp", "segment": "1GB"})
    with pytest.raises(ValueError, match=r"mooncake\.json.*unknown key.*'segment'"):
        StoreConfig.from_json(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        StoreConfig.from_json(path)
    path.write_text("[1, 2]")
    with pytest.raises(TypeError, match="JSON object"):
        StoreConfig.from_json(path)
    with pytest.raises(ValueError, match="cannot read"):
        StoreConfig.from_json(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="unknown key"):
        StoreConfig.from_dict({}, bogus=1)


def test_from_env_and_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_json(tmp_path, {"global_segment_size": "1GB"})
    monkeypatch.delenv(DEFAULT_CONFIG_ENV, raising=False)
    with pytest.raises(ValueError, match=DEFAULT_CONFIG_ENV):
        StoreConfig.from_env()
    assert StoreConfig.load() == StoreConfig()
    assert StoreConfig.load(tenant="t1").tenant == "t1"
    assert StoreConfig.load(path).global_segment_size == GiB

    monkeypatch.setenv(DEFAULT_CONFIG_ENV, str(path))
    assert StoreConfig.from_env().global_segment_size == GiB
    assert StoreConfig.load().global_segment_size == GiB
    assert StoreConfig.load(global_segment_size="2GB").global_segment_size == 2 * GiB

    monkeypatch.setenv("OTHER_MOONCAKE", str(path))
    assert StoreConfig.from_env("OTHER_MOONCAKE", protocol="rdma").protocol == "rdma"


# ------------------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    "value",
    [2**64, "16EiB", "16384PB", str(2**64), "17179869184GB", 2.0**64, "1e3", "1_000", "0x10", "+5", "1.2.3"],
)
def test_sizes_outside_size_t_or_not_plain_numbers_are_rejected(value: object) -> None:
    with pytest.raises(ValueError, match="global_segment_size"):
        StoreConfig(global_segment_size=value)  # type: ignore[arg-type]


def test_largest_size_below_2_64_is_accepted_and_every_size_field_is_bounded() -> None:
    assert parse_size(2**64 - 1) == 2**64 - 1
    assert parse_size("16777215TB") == 16777215 << 40
    for field in ("local_buffer_size", "staging_buffer_size", "global_segment_size"):
        with pytest.raises(ValueError, match=rf"{field}: size must be below 2\*\*64"):
            StoreConfig(**{field: 2**64})  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["\uff14GB", "\u0663", "1\u0660MB", "\u00b2", "\u2167", "4\u00a0GB\u2003x"])
def test_parse_size_accepts_ascii_digits_only(text: str) -> None:
    with pytest.raises(ValueError, match="cannot parse"):
        parse_size(text)


@given(st.integers(min_value=0, max_value=2**64 - 1), st.sampled_from(["", "B", " b"]))
def test_parse_size_round_trips_any_size_t(value: int, unit: str) -> None:
    assert parse_size(f"{value}{unit}") == value == parse_size(value)


# ------------------------------------------------------------------------------------------- addresses


@pytest.mark.parametrize(
    ("address", "endpoints"),
    [
        ("127.0.0.1:50051", [("127.0.0.1", 50051)]),
        (" master.example.com:1 ", [("master.example.com", 1)]),
        ("[::1]:65535", [("[::1]", 65535)]),
        ("etcd://10.0.0.1:2379;10.0.0.2:2379", [("10.0.0.1", 2379), ("10.0.0.2", 2379)]),
        ("etcd://10.0.0.1:2379;", [("10.0.0.1", 2379)]),  # empty endpoints are skipped
        ("etcd://10.0.0.1:2379; ;10.0.0.2:2379", [("10.0.0.1", 2379), ("10.0.0.2", 2379)]),
    ],
)
def test_parse_address(address: str, endpoints: list[tuple[str, int]]) -> None:
    assert parse_address(address) == endpoints
    assert StoreConfig(master_server_address=address).master_server_address == address.strip()


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "127.0.0.1:",
        "127.0.0.1:0",
        "127.0.0.1:70000",
        "127.0.0.1:99999999999999999999",
        "127.0.0.1:-1",
        "127.0.0.1:5O051",
        "127.0.0.1:\uff15\uff10",
        ":50051",
        "::1:50051",
        "http://127.0.0.1:50051",
        "etcd://",
        "etcd://10.0.0.1",
        "127.0.0.1:50051/path",
        "my host:50051",
        "[::1",
    ],
)
def test_malformed_master_address_is_rejected_at_construction(address: str) -> None:
    # Parsed before anything connects: Mooncake would otherwise retry it for ~90 s (or ~10 min).
    started = time.monotonic()
    with pytest.raises(ValueError, match="master_server_address"):
        StoreConfig(master_server_address=address)
    assert time.monotonic() - started < 0.1


# ------------------------------------------------------------------------------------------- JSON


def test_deeply_nested_json_is_a_clear_error_not_a_recursion_error(tmp_path: Path) -> None:
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="too deeply"):
        StoreConfig.from_json(path)
    path.write_text('{"protocol": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError, match="too deeply"):
        StoreConfig.from_json(path)


def test_deeply_nested_value_in_a_dict_is_a_clear_error() -> None:
    value: object = "x"
    for _ in range(100_000):
        value = [value]
    with pytest.raises(TypeError, match="protocol: expected str, got list"):
        StoreConfig.from_dict({"protocol": value})


def test_huge_integer_literal_in_json_is_a_clear_error(tmp_path: Path) -> None:
    path = write_json(tmp_path, {})
    path.write_text('{"global_segment_size": ' + "9" * 5000 + "}")
    with pytest.raises(ValueError, match=r"mooncake\.json"):
        StoreConfig.from_json(path)


# ------------------------------------------------------------------------------------------- vLLM's file

# A config file as vLLM's Mooncake store connector documents it (every key vLLM reads from the file).
VLLM_FILE = {
    "metadata_server": "P2PHANDSHAKE",
    "master_server_address": "127.0.0.1:50051",
    "protocol": "tcp",
    "device_name": "",
    "mode": "embedded",
    "global_segment_size": "4GB",
    "local_buffer_size": "512MB",
    "enable_offload": False,
    "tenant_id": "team-a",
}
SHARED_FIELDS = (
    "metadata_server",
    "master_server_address",
    "protocol",
    "device_name",
    "mode",
    "global_segment_size",
    "local_buffer_size",
    "enable_offload",
    "tenant_id",
)


def test_vllm_config_file_loads_unchanged(tmp_path: Path) -> None:
    config = StoreConfig.from_json(write_json(tmp_path, VLLM_FILE))
    assert config.metadata_server == "P2PHANDSHAKE" and config.master_server_address == "127.0.0.1:50051"
    assert config.protocol == "tcp" and config.device_name == ""
    assert config.mode == config.topology == "embedded"
    assert config.global_segment_size == 4 * GiB and config.local_buffer_size == 512 * MiB
    assert config.enable_offload is False
    assert config.tenant_id == config.tenant == "team-a"
    standalone = {**VLLM_FILE, "mode": "standalone-store", "global_segment_size": 0, "enable_offload": True}
    config = StoreConfig.from_json(write_json(tmp_path, standalone))
    assert config.topology == "standalone-store" and config.enable_offload is True


def test_extra_config_style_dict_ignores_vllm_connector_keys(caplog: pytest.LogCaptureFixture) -> None:
    extra = {
        **VLLM_FILE,
        "load_async": True,
        "enable_lookup": True,
        "save_decode_cache": False,
        "store_tp_size": 8,
        "enable_group_semantics": "True",
        "preferred_segment": "10.0.0.2:12345",
        "cache_prefix": "v1",
        "lookup_rpc_port": 5678,
    }
    assert set(extra) - set(VLLM_FILE) <= VLLM_CONNECTOR_KEYS
    with caplog.at_level(logging.DEBUG, logger="mooncake_kvaddr.driver.config"):
        config = StoreConfig.from_dict(extra, transfer_mode="staged")
    assert config.tenant_id == "team-a" and config.transfer_mode == "staged"
    assert any("load_async" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)


def test_unknown_keys_are_errors_unless_not_strict(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match=r"unknown key.*'global_segement_size'"):
        StoreConfig.from_dict({"global_segement_size": "1GB"})
    with caplog.at_level(logging.WARNING, logger="mooncake_kvaddr.driver.config"):
        config = StoreConfig.from_dict({"future_vllm_key": 1, "protocol": "rdma"}, strict=False)
    assert config.protocol == "rdma"
    assert any("future_vllm_key" in r.getMessage() for r in caplog.records)
    with pytest.raises(TypeError, match="keys must be strings"):
        StoreConfig.from_dict({1: "x"})  # type: ignore[dict-item]


def test_tenant_is_an_alias_of_tenant_id() -> None:
    assert StoreConfig.from_dict({"tenant": "t1"}).tenant_id == "t1"
    assert StoreConfig.from_dict({"tenant": "t1", "tenant_id": " t1 "}).tenant_id == "t1"
    with pytest.raises(ValueError, match="disagree"):
        StoreConfig.from_dict({"tenant": "t1", "tenant_id": "t2"})
    # vLLM's rule: null or blank means "default"; spaces are trimmed.
    assert StoreConfig.from_dict({"tenant_id": None}).tenant_id == "default"
    assert StoreConfig(tenant_id="  ").tenant_id == "default"
    assert StoreConfig(tenant_id=" t3 ").tenant == "t3"
    config = StoreConfig(tenant_id="a")
    assert config.replace(tenant="b").tenant_id == "b" and config.replace(tenant_id="c").tenant == "c"


def test_replace_validates_and_keeps_mode_derived() -> None:
    config = StoreConfig(global_segment_size=0)
    assert config.topology == "standalone-store"
    grown = config.replace(global_segment_size="1GB", embedded_master=True)
    assert grown.topology == "embedded" and grown.global_segment_size == GiB and grown.embedded_master
    with pytest.raises(ValueError, match="protocol"):
        config.replace(protocol="udp")
    with pytest.raises(ValueError, match="unknown key"):
        config.replace(segment=1)


@functools.cache
def _load_vllm_mooncake_store() -> Any:
    """vLLM's ``vllm/distributed/mooncake_store.py`` (its config class and size parser), or None.

    The module needs nothing from the rest of vLLM, so it is loaded on its own when it can be (importing the
    ``vllm`` package pulls in torch: ~20 s here); otherwise through the package.
    """
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "distributed" / "mooncake_store.py"
    if path.is_file():
        standalone = importlib.util.spec_from_file_location("_vllm_mooncake_store_under_test", path)
        if standalone is not None and standalone.loader is not None:
            module = importlib.util.module_from_spec(standalone)
            try:
                standalone.loader.exec_module(module)
            except ImportError:
                pass
            else:
                return module
    return importlib.import_module("vllm.distributed.mooncake_store")


def vllm_mooncake_store() -> Any:
    module = _load_vllm_mooncake_store()
    if module is None:
        pytest.skip("vLLM is not installed")
    return module


def test_vllm_module_under_test_is_the_installed_one() -> None:
    module = vllm_mooncake_store()
    assert module.MooncakeStoreConfig.from_file.__qualname__ == "MooncakeStoreConfig.from_file"
    assert Path(module.__file__).parts[-3:] == ("vllm", "distributed", "mooncake_store.py")


@given(
    st.fixed_dictionaries(
        {
            "metadata_server": st.sampled_from(["P2PHANDSHAKE", "http://10.0.0.1:8080/metadata", "etcd://10.0.0.1:2379"]),
            "master_server_address": st.builds("10.0.0.{}:{}".format, st.integers(0, 255), st.integers(1, 65535)),
            "protocol": st.sampled_from(["tcp", "rdma"]),
            "device_name": st.sampled_from(["", "mlx5_0", "mlx5_0,mlx5_1"]),
            "global_segment_size": st.one_of(
                st.integers(16 * MiB, 2**52),
                st.builds(
                    "{}{}{}".format,
                    st.integers(16, 4096),
                    st.sampled_from(["", " "]),
                    st.sampled_from(["MB", "mb", "GB", "gb"]),
                ),
                st.builds("{:.2f}GB".format, st.floats(0.5, 64)),
            ),
            "local_buffer_size": st.one_of(
                st.integers(1, 2**52),
                st.builds("{}{}".format, st.integers(1, 4096), st.sampled_from(["KB", "MB", "GB", "B", ""])),
            ),
            "enable_offload": st.booleans(),
            "tenant_id": st.one_of(st.none(), st.sampled_from(["default", "a", " team ", ""])),
        },
        optional={"mode": st.just("embedded")},
    )
)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_reading_matches_vllms_own_parser(tmp_path: Path, data: dict[str, object]) -> None:
    vllm_store = vllm_mooncake_store()
    path = write_json(tmp_path, data)
    ours = StoreConfig.from_json(path)
    theirs = vllm_store.MooncakeStoreConfig.from_file(str(path))
    for field in SHARED_FIELDS:
        expected = getattr(theirs, field)
        actual = ours.topology if field == "mode" else getattr(ours, field)
        assert actual == expected, (field, data)


# ------------------------------------------------------------------------------------------- no side effects

SIDE_EFFECTS_CHILD = r"""
import json, logging, os, sys
env0 = dict(os.environ)
root = logging.getLogger()
root0 = (root.level, list(root.handlers), root.disabled, logging.root.manager.disable)
import mooncake_kvaddr
from mooncake_kvaddr import ChunkedTokenDatabase, KeyMetadata, MooncakeStore, StoreConfig
from mooncake_kvaddr.driver.store import load_mooncake
import mooncake_kvaddr.driver.transfer, mooncake_kvaddr.driver.lookup
phases = {"import": (dict(os.environ), (root.level, list(root.handlers), root.disabled, logging.root.manager.disable))}
setup = sys.argv[1] == "setup"
if setup:
    load_mooncake()
    with MooncakeStore(StoreConfig(embedded_master=True, global_segment_size="16MiB", local_buffer_size=0,
                                   setup_retries=2)) as store:
        phases["setup"] = (dict(os.environ), (root.level, list(root.handlers), root.disabled,
                                               logging.root.manager.disable))
phases["close"] = (dict(os.environ), (root.level, list(root.handlers), root.disabled, logging.root.manager.disable))
pkg = logging.getLogger("mooncake_kvaddr")
out = {
    name: {"env_same": env == env0, "env_diff": sorted(set(env.items()) ^ set(env0.items())),
           "root_same": state == root0}
    for name, (env, state) in phases.items()
}
out["null_handler"] = any(isinstance(h, logging.NullHandler) for h in pkg.handlers)
out["loggers"] = sorted(n for n in logging.root.manager.loggerDict if n.startswith("mooncake_kvaddr"))
print(json.dumps(out))
"""


def run_side_effects_child(mode: str, env: dict[str, str]) -> dict[str, object]:
    # The package under test, wherever it was imported from (the source tree in place, or an installed copy).
    python = Path(mooncake_kvaddr.__file__).resolve().parent.parent
    child_env = {**env, "PYTHONPATH": os.pathsep.join([str(python), str(Path(__file__).resolve().parent)])}
    done = subprocess.run(
        [sys.executable, "-c", SIDE_EFFECTS_CHILD, mode], env=child_env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_import_leaves_environment_and_root_logger_alone() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MC_")}
    out = run_side_effects_child("import", env)
    assert out["import"] == {"env_same": True, "env_diff": [], "root_same": True}
    assert out["null_handler"] is True


@pytest.mark.mooncake
@pytest.mark.parametrize("user_level", [None, "INFO"])
def test_store_setup_leaves_environment_and_root_logger_alone(user_level: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MC_")}
    if user_level is not None:
        env["MC_LOG_LEVEL"] = user_level  # a user's choice is kept as it is
    out = run_side_effects_child("setup", env)
    for phase in ("import", "setup", "close"):
        assert out[phase] == {"env_same": True, "env_diff": [], "root_same": True}, phase
    assert all(name.startswith("mooncake_kvaddr") for name in out["loggers"])  # type: ignore[attr-defined]


def test_one_on_off_reader_for_every_switch() -> None:
    """core.flags.flag: the spelling every environment switch and config key shares (docs/configuration.md)."""
    from mooncake_kvaddr.core.flags import flag

    for default in (False, True):
        for on in ("1", "true", "TRUE", " on ", "Yes", True, 1):
            assert flag(on, default, "VAR") is True
        for off in ("0", "false", "Off", " no", False, 0):
            assert flag(off, default, "VAR") is False
        for unset in (None, "", "  "):
            assert flag(unset, default, "VAR") is default
        # Neither on nor off: refused with the setting named (issue 39 item 4), never read as the default.
        for neither in ("2", "maybe", "enabled", 2, 1.0):
            with pytest.raises(ValueError, match=r"^VAR=.* is neither on nor off: use one of 1, on, true, yes"):
                flag(neither, default, "VAR")
            assert flag(neither, True, "VAR", or_off="mooncake_kvaddr.test") is False


def test_an_int_field_out_of_range_names_its_bound_open_or_closed() -> None:
    """A field with only a lower bound says ``>= low``; one with both bounds says ``in low..high``."""
    with pytest.raises(ValueError, match=r"max_regions_per_batch: must be >= 1, got 0"):
        StoreConfig(max_regions_per_batch=0)
    with pytest.raises(ValueError, match=r"setup_retries: must be in 1\.\.\d+, got 0"):
        StoreConfig(setup_retries=0)


@pytest.mark.parametrize("args", [{"--a": 1}, {"--a"}, 5])
def test_master_args_must_be_a_list_or_tuple_of_strings(args: Any) -> None:
    """``master_args`` given as a dict, a set or an int is a ``TypeError`` naming the field (a dict's keys or
    a set's items are not taken as arguments)."""
    with pytest.raises(TypeError, match="master_args: expected a list of strings"):
        StoreConfig(master_args=args)


def test_replace_keeps_the_tenant_unless_it_is_changed() -> None:
    """``replace`` of another field keeps ``tenant_id``; ``replace(tenant=...)`` (the alias) changes it."""
    config = StoreConfig(tenant_id="team-a")
    assert config.replace(max_regions_per_batch=5).tenant_id == "team-a"
    assert config.replace(tenant="team-b").tenant_id == "team-b"
