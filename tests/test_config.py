"""StoreConfig: defaults, size parsing, validation, and the JSON / environment constructors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from mooncake_kvaddr.driver.config import DEFAULT_CONFIG_ENV, StoreConfig, parse_size

MiB = 1 << 20
GiB = 1 << 30


def write_json(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(data))
    return path


def test_defaults_start_an_embedded_master_over_tcp_p2p() -> None:
    config = StoreConfig()
    assert config.local_hostname == "127.0.0.1"
    assert config.metadata_server == "P2PHANDSHAKE"
    assert config.master_server_address is None and config.embedded_master
    assert config.protocol == "tcp" and config.device_name == ""
    assert config.global_segment_size == 512 * MiB
    assert config.local_buffer_size == 16 * MiB
    assert config.tenant == "default"
    assert config.region_budget == 1000


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
        ({"tenant": None}, TypeError, "tenant"),
        ({"max_regions_per_batch": 0}, ValueError, "max_regions_per_batch"),
        ({"max_regions_per_batch": 1.5}, TypeError, "max_regions_per_batch"),
        ({"setup_retries": -1}, ValueError, "setup_retries"),
        ({"close_timeout_s": 0}, ValueError, "close_timeout_s"),
        ({"master_start_timeout_s": "10"}, TypeError, "master_start_timeout_s"),
        ({"master_args": "-v=1"}, TypeError, "master_args"),
        ({"master_args": [1]}, TypeError, "master_args"),
    ],
)
def test_invalid_fields_are_rejected_by_name(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        StoreConfig(**kwargs)  # type: ignore[arg-type]


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
