"""The end-to-end demo, run small: it must verify every byte, write its JSON report, keep Mooncake's log
lines out of the terminal unless asked, and use a configured master (embedding one only without)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mooncake_kvaddr._cli import VERBOSE_ENV
from mooncake_kvaddr.demo import main
from mooncake_kvaddr.driver.master import EmbeddedMaster

SMALL = ["--tokens", "512", "--regions", "4", "--block-size", "64", "--block-bytes", "512"]
# A glog line as Mooncake prints it: severity letter, MMDD, time.
MOONCAKE_LOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d", re.MULTILINE)


@pytest.mark.mooncake
def test_demo_small_verifies_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report_path = tmp_path / "demo.json"
    argv = ["--tokens", "2048", "--regions", "8", "--block-size", "64", "--block-bytes", "1024"]
    assert main([*argv, "--recv-threads", "2", "--tp-rank", "3", "--json", str(report_path)]) == 0

    report = json.loads(report_path.read_text())
    assert report["verified"] is True
    assert report["chunks"] == 32 and report["regions"] == 8 and report["bytes"] == 32 * 8 * 1024
    assert report["lookup_hit_tokens"] == 2048 and report["failed_block_ids"] == []
    timings = report["timings_ms"]
    phases = ("setup", "store_keys", "store_prepare", "store_put", "lookup", "load_plan", "load_get", "keys_only")
    for phase in (*phases, "close"):
        assert timings[phase] > 0, phase  # every phase ran and was timed
    assert report["master"] == "embedded"
    assert "verified: every byte identical" in capsys.readouterr().out


@pytest.mark.mooncake
@pytest.mark.parametrize(("mode", "resolved"), [("staged", "staged"), ("multi_buffer", "multi_buffer")])
def test_demo_mode_reports_copy_apart_from_transfer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str, resolved: str
) -> None:
    report_path = tmp_path / "demo.json"
    argv = ["--tokens", "1024", "--regions", "6", "--block-size", "64", "--block-bytes", "768", "--mode", mode]
    assert main([*argv, "--tp-rank", "1", "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["verified"] is True
    assert report["mode"] == {"requested": mode, "store": resolved, "load": resolved}
    timings = report["timings_ms"]
    if resolved == "staged":
        assert report["staging_pool_bytes"] > 0
        assert report["copy_ms"]["gather"] == timings["store_gather"] > 0
        assert report["copy_ms"]["scatter"] == timings["load_scatter"] > 0
        assert "mooncake_argument_conversion" not in timings
    else:
        assert report["staging_pool_bytes"] == 0 and report["copy_ms"] == {"gather": 0.0, "scatter": 0.0}
        assert timings["mooncake_argument_conversion"] >= 0
    assert report["transfer_ms"] == {"put": timings["store_put"], "get": timings["load_get"]}
    out = capsys.readouterr().out
    assert f"transfer mode: {mode} -> store {resolved}, load {resolved}" in out and "copy (native gather" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["--tokens", "0"],
        ["--block-size", "64", "--hash-block-size", "48"],
        ["--tokens", "10", "--block-size", "64"],
        ["--mode", "fast"],
    ],
)
def test_demo_rejects_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2


def test_demo_reports_configuration_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--tokens", "128", "--max-regions-per-batch", "0"]) == 2
    assert "max_regions_per_batch" in capsys.readouterr().err


@pytest.mark.mooncake
def test_demo_is_quiet_by_default_and_verbose_on_request(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    monkeypatch.delenv("MC_LOG_LEVEL", raising=False)
    assert main(SMALL) == 0
    out, err = capfd.readouterr()
    assert "verified: every byte identical" in out
    assert not MOONCAKE_LOG_LINE.search(err) and "Local segment descriptor" not in err, err[-2000:]

    assert main([*SMALL, "--verbose"]) == 0
    assert MOONCAKE_LOG_LINE.search(capfd.readouterr().err)
    monkeypatch.setenv(VERBOSE_ENV, "1")
    assert main(SMALL) == 0
    assert MOONCAKE_LOG_LINE.search(capfd.readouterr().err)


@pytest.mark.mooncake
def test_demo_uses_the_configured_master_and_embeds_one_only_without(
    tmp_path: Path, master: EmbeddedMaster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps({"master_server_address": master.rpc_address, "global_segment_size": "64MB"}))
    report_path = tmp_path / "demo.json"
    assert main([*SMALL, "--config", str(config), "--json", str(report_path)]) == 0
    assert json.loads(report_path.read_text())["master"] == master.rpc_address

    config.write_text(json.dumps({"protocol": "tcp", "tenant_id": "demo"}))  # names no master
    assert main([*SMALL, "--config", str(config), "--json", str(report_path)]) == 0
    assert json.loads(report_path.read_text())["master"] == "embedded"


def test_demo_failure_shows_mooncakes_last_lines(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import mooncake_kvaddr.demo as demo_module

    monkeypatch.delenv(VERBOSE_ENV, raising=False)

    def failing_run(args: object) -> dict[str, object]:
        import os

        os.write(2, b"E1201 00:00:00.000000 1 fake.cpp:1] native trouble\n")
        raise ValueError("boom")

    monkeypatch.setattr(demo_module, "run", failing_run)
    assert main(SMALL) == 2
    err = capsys.readouterr().err
    assert "demo failed: ValueError: boom" in err and "native trouble" in err
