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


@pytest.mark.parametrize(
    "argv",
    [["--tokens", "0"], ["--block-size", "64", "--hash-block-size", "48"], ["--tokens", "10", "--block-size", "64"]],
)
def test_demo_rejects_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2


def test_demo_reports_configuration_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--tokens", "128", "--max-regions-per-batch", "0"]) == 2
    assert "max_regions_per_batch" in capsys.readouterr().err
