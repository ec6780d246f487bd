"""The top-level conftest of the test tree .ci/vllm-suite lays out (it is copied there as tests/conftest.py).

vLLM's repository-level conftest cannot be used as is: it imports transformers, PIL and model assets that the
Mooncake store connector tests never touch. Of its fixtures those tests use two, written here from what they
are for (docs/vllm-plugin.md, "vLLM's own tests"):

- ``temporary_enable_log_propagate``: vLLM's logger tree does not propagate to the root logger, where pytest's
  ``caplog`` listens; turn propagation on for one test (also in vLLM's logging config, which vLLM may apply
  again while the test runs);
- ``caplog_vllm``: ``caplog`` with the above, at INFO.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture()
def temporary_enable_log_propagate(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    vllm_logger_config = DEFAULT_LOGGING_CONFIG["loggers"]["vllm"]
    monkeypatch.setitem(vllm_logger_config, "propagate", True)
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)


@pytest.fixture()
def caplog_vllm(
    temporary_enable_log_propagate: None, caplog: pytest.LogCaptureFixture
) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.INFO):
        yield caplog
