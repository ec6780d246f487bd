"""The end-to-end demo, run small: it must verify every byte and write its JSON report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncake_kvaddr.demo import main


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
    for phase in ("store_keys", "store_prepare", "store_put", "lookup", "load_plan", "load_get", "keys_only"):
        assert timings[phase] >= 0
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
