"""Suite-wide rule: where `.ci/setup` installed the vLLM route, its tests must run.

The vLLM test modules guard their import with ``pytest.importorskip("vllm")`` so the suite
runs in a plain checkout; but in a venv set up by `.ci/setup` (which writes the marker
below) a skipped vLLM module would hide a broken install, so it is reported as a failure.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_MARKER = Path(sys.prefix) / ".sfa_rd2h_vllm"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if report.skipped and _MARKER.exists() and "vllm" in str(report.longrepr):
        report.outcome = "failed"
        report.longrepr = (f"{collector.nodeid}: skipped although .ci/setup installed the vLLM "
                           f"route ({_MARKER}): {report.longrepr}")
