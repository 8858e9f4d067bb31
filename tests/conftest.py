"""Suite-wide rules: where `.ci/setup` installed everything (the vLLM route included), no
test may skip; and a failing test's report must not crash the run.

The vLLM test modules guard their import with ``pytest.importorskip("vllm")`` so the suite
runs in a plain checkout; but in a venv set up by `.ci/setup` (which writes the marker
below) a skipped vLLM module would hide a broken install, so it is reported as a failure.
"""

from __future__ import annotations

import ast
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from vllm_platform import MARKER as _MARKER
from vllm_platform import NO_CPU_PLATFORM, promise

_PROMISE = promise()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # type: ignore[no-untyped-def]
    """Where `.ci/setup` installed everything, a test has no reason to skip: a skip there
    hides a test that stopped running, so it is reported as a failure."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and _PROMISE is not None and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid}: skipped although .ci/setup installed everything "
                           f"({_MARKER}): {report.longrepr}")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    # The scheduler-only venv (vLLM 0.33, no CPU build) promises no forward pass: there a
    # module that needs one may skip, saying so; any other vLLM skip is a broken install.
    allowed = _PROMISE == "scheduler" and NO_CPU_PLATFORM in str(report.longrepr)
    if report.skipped and _PROMISE is not None and "vllm" in str(report.longrepr) \
            and not allowed:
        report.outcome = "failed"
        report.longrepr = (f"{collector.nodeid}: skipped although .ci/setup installed the vLLM "
                           f"route ({_MARKER}): {report.longrepr}")


# CPython before 3.11.8 keeps ast.parse's recursion depth in shared module state, so two
# threads parsing at once (pytest rendering a failure while a server thread formats a
# traceback, which parses source for its carets) raise "SystemError: AST constructor
# recursion depth mismatch" (CPython gh-106905). Inside pytest's reporting that turns one
# failed test into an INTERNALERROR that ends the whole run, so parsing is serialized here.
if sys.version_info < (3, 11, 8):
    _parse_lock = threading.Lock()
    _unlocked_parse = ast.parse

    def _serialized_parse(*args, **kwargs):  # type: ignore[no-untyped-def]
        with _parse_lock:
            return _unlocked_parse(*args, **kwargs)

    ast.parse = _serialized_parse


# Scenario tables: a test appends rows (``scenario_table`` fixture), and they are printed in
# the terminal summary, whatever ``-s``/``-r`` say, so a CI log always shows them.
_SCENARIO_ROWS = pytest.StashKey[list]()


@pytest.fixture
def scenario_table(request: pytest.FixtureRequest) -> list:
    """Rows ``(scenario, outcome)`` for the end-of-run table; the outcome must be computed
    from what the test observed."""
    return request.config.stash.setdefault(_SCENARIO_ROWS, [])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int,
                            config: pytest.Config) -> None:
    rows = config.stash.get(_SCENARIO_ROWS, [])
    if not rows:
        return
    terminalreporter.section("fault scenarios: scenario -> outcome, as observed")
    width = max(len(name) for name, _ in rows)
    for name, outcome in sorted(rows):
        terminalreporter.write_line(f"{name:<{width}}  {outcome}")


@pytest.fixture
def engines() -> Iterator[Any]:
    """Two initialised host engines, Prefill's and Decode's (the control-plane tests)."""
    from sfa_rd2h.runtime.engines.host import HostEngine

    pe, de = HostEngine(), HostEngine()
    pe.initialize()
    de.initialize()
    yield pe, de
    pe.close()
    de.close()
