"""The end-to-end demo, run small: it must verify every byte, write its JSON report, keep Mooncake's log
lines out of the terminal unless asked, and use a configured master (embedding one only without)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mooncake_kvaddr.demo as demo_module
from mooncake_kvaddr import __version__
from mooncake_kvaddr._cli import VERBOSE_ENV
from mooncake_kvaddr.demo import main
from mooncake_kvaddr.driver import rules
from mooncake_kvaddr.driver.master import EmbeddedMaster, free_ports

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
    phases = ("setup", "store_keys", "store_prepare", "store_put", "lookup", "load_plan", "load_get", "close")
    for phase in phases:
        assert timings[phase] > 0, phase  # every step ran and was timed
    steps = list(timings)
    assert steps[0] == "setup" and steps[-1] == "close"  # the steps, in the order they ran
    assert steps.index("store_put") < steps.index("lookup") < steps.index("load_get") < steps.index("verify")
    # Re-measurements are kept apart from the steps, never mixed into them.
    assert set(report["remeasured_ms"]) >= {"load_plan_keys", "load_plan_address_rows"}
    assert not set(report["remeasured_ms"]) & set(timings)
    assert report["master"] == "embedded"
    out = capsys.readouterr().out
    assert "verified: every byte identical" in out
    steps_at, remeasured_at = out.index("steps, in order:"), out.index("re-measured after the run")
    assert steps_at < out.index("  store_put ") < remeasured_at < out.index("  load_plan_keys ")
    assert out.index("starting an embedded Mooncake master") < out.index("store set up in")


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
    timings, remeasured = report["timings_ms"], report["remeasured_ms"]
    out = capsys.readouterr().out
    if resolved == "staged":
        assert report["staging_pool_bytes"] > 0 and timings["staging_pool"] >= 0
        assert report["copy_ms"] == {"gather": timings["store_gather"], "scatter": timings["load_scatter"]}
        assert timings["store_gather"] > 0 and timings["load_scatter"] > 0
        assert "load_get_mooncake_argument_conversion" not in remeasured
        assert "copy (native gather + scatter)" in out
    else:
        # Nothing staged: no pool allocated, no copy timed or printed.
        assert report["staging_pool_bytes"] == 0 and report["copy_ms"] == {}
        assert "staging_pool" not in timings and "store_gather" not in timings and "load_scatter" not in timings
        assert remeasured["load_get_mooncake_argument_conversion"] >= 0
        assert "copy (native" not in out and "staging pool" not in out
    assert report["transfer_ms"] == {"put": timings["store_put"], "get": timings["load_get"]}
    assert f"transfer mode: {mode} -> store {resolved}, load {resolved}" in out


@pytest.mark.mooncake
@pytest.mark.parametrize(
    ("regions", "block_bytes", "store_mode", "load_mode"),
    [
        (64, 2048, "multi_buffer", "multi_buffer"),  # the default shape: auto picks multi-buffer in memory
        (4, 2048, "multi_buffer", "staged"),  # few small regions: loads staged, stores multi-buffer
        (1, 2048, "direct", "direct"),
    ],
)
def test_demo_auto_allocates_and_prints_only_the_paths_it_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], regions: int, block_bytes: int, store_mode: str,
    load_mode: str,
) -> None:
    report_path = tmp_path / "demo.json"
    argv = ["--tokens", "512", "--block-size", "64", "--regions", str(regions), "--block-bytes", str(block_bytes)]
    assert main([*argv, "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["mode"] == {"requested": "auto", "store": store_mode, "load": load_mode}
    args = demo_module._parse(argv)
    # What the demo planned before allocating anything is what the transfers resolved.
    assert demo_module.planned_modes(args, demo_module._config(args, report["bytes"])) == (store_mode, load_mode)
    staged = "staged" in (store_mode, load_mode)
    assert (report["staging_pool_bytes"] > 0) == staged == ("staging_pool" in report["timings_ms"])
    assert set(report["copy_ms"]) == ({"scatter"} if load_mode == "staged" else set())
    out = capsys.readouterr().out
    assert ("copy (native scatter)" in out) == (load_mode == "staged") and "gather" not in out


def test_demo_help_says_what_auto_does(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    # The rule of rules.choose_auto_mode, with its thresholds as the code has them.
    assert f"at most {rules.AUTO_MEMORY_LOAD_STAGED_MAX_REGIONS} regions" in text
    assert f"under {rules.AUTO_MEMORY_LOAD_STAGED_BELOW >> 10} KiB" in text
    assert f"regions under {rules.AUTO_NETWORK_STAGED_BELOW >> 10} KiB" in text
    assert f"objects up to {rules.AUTO_NETWORK_STAGED_OBJECT_MAX >> 10} KiB" in text
    assert "direct for one region per key" in text and "staged for more than one region" not in text


@pytest.mark.mooncake
def test_demo_names_an_unreachable_master_within_its_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (port,) = free_ports(1)
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps({"master_server_address": f"127.0.0.1:{port}", "connect_timeout_s": 1}))
    started = time.monotonic()
    assert main([*SMALL, "--config", str(config)]) == 2
    assert time.monotonic() - started < 5
    out, err = capsys.readouterr()
    assert f"connecting to the Mooncake master at 127.0.0.1:{port}: waiting up to 1 s" in out
    assert f"cannot reach the Mooncake master at 127.0.0.1:{port}" in err and "connect_timeout_s" in err


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
    monkeypatch.delenv(VERBOSE_ENV, raising=False)

    def failing_run(args: object) -> dict[str, object]:
        import os

        os.write(2, b"E1201 00:00:00.000000 1 fake.cpp:1] native trouble\n")
        raise ValueError("boom")

    monkeypatch.setattr(demo_module, "run", failing_run)
    assert main(SMALL) == 2
    err = capsys.readouterr().err
    assert "demo failed: ValueError: boom" in err and "native trouble" in err


def test_top_level_version_and_help_match_the_commands() -> None:
    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "mooncake_kvaddr", *argv], capture_output=True, text=True,
                              timeout=120)

    version = run("--version")
    assert version.returncode == 0 and version.stdout == f"mooncake_kvaddr {__version__}\n"
    assert run("-V").stdout == version.stdout
    help_text = run("--help")
    assert help_text.returncode == 0
    text = " ".join(help_text.stdout.split())
    assert "--version" in text and "vLLM 0.33" in text and "oracle and the numpy approach" not in text
    assert "Ctrl-C" in text and "130" in text
    unknown = run("frobnicate")
    assert unknown.returncode == 2 and "expected demo or bench" in unknown.stderr
