"""``sfa-rd2h bench`` reports every benchmark with consistent numbers.

Only the report's structure is checked here. How fast anything is belongs to the benchmark
run itself (medians and ratios of one run on one machine); a timing threshold in a unit test
would fail on a busy shared machine and say nothing about the code.
"""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import pytest

from sfa_rd2h.runtime.tools.bench import BENCHMARKS, QUICK_SKIPS
from sfa_rd2h.runtime.tools.cli import main


def run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(list(argv))
    return rc, out.getvalue()


@pytest.fixture(scope="module")
def report() -> list[dict[str, Any]]:
    # One quick run serves every test below; it is the part that takes time.
    rc, out = run_cli("bench", "--quick", "--json")
    assert rc == 0
    return json.loads(out)


def test_every_benchmark_is_reported_once_in_order(report: list[dict[str, Any]]) -> None:
    expected = [name for name in BENCHMARKS if name not in QUICK_SKIPS]
    assert [row["name"] for row in report] == expected
    for row in report:
        assert set(row) == {"name", "median_s", "baseline_s", "ratio", "detail"}


def test_medians_are_positive_and_ratio_is_their_quotient(
    report: list[dict[str, Any]],
) -> None:
    for row in report:
        assert row["median_s"] > 0 and row["baseline_s"] > 0, row["name"]
        assert row["ratio"] == pytest.approx(row["median_s"] / row["baseline_s"], rel=1e-12)
        assert row["detail"]["repeat"] >= 1 and all(n >= 1 for n in row["detail"]["loops"])


def test_baselines_were_checked_against_the_project(report: list[dict[str, Any]]) -> None:
    # Each baseline's output was compared with the project's before timing (same read
    # descriptors, same frame bytes, same end state); the report says so per row.
    for row in report:
        assert row["detail"]["verified"] is True, row["name"]
    by_name = {row["name"]: row["detail"] for row in report}
    plan = by_name["plan_layer_reads"]
    assert 0 < plan["descriptors"] <= plan["block_pairs"]
    growth = by_name["machine_requests_4n"]["growth"]
    assert growth["to_models"] == 4 * growth["from_models"]


def test_table_output_names_every_row() -> None:
    rc, out = run_cli("bench", "--quick", "--repeat", "1")
    assert rc == 0
    for name in BENCHMARKS:
        assert name in out
    assert "skipped with --quick: host_engine_read" in out


def test_repeat_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--quick", "--repeat", "0"]) == 2
    assert "--repeat" in capsys.readouterr().err
