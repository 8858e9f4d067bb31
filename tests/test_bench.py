"""``sfa-rd2h bench`` reports every benchmark and every figure with consistent numbers.

Only the report's structure is checked here. How fast anything is belongs to the benchmark
run itself (medians and ratios of one run on one machine); a timing threshold in a unit test
would fail on a busy shared machine and say nothing about the code.
"""

from __future__ import annotations

import contextlib
import io
import json
import xml.etree.ElementTree as ET
from typing import Any

import pytest

from sfa_rd2h.runtime.tools.bench import FIGURE_KEYS, STEP_NAMES
from sfa_rd2h.runtime.tools.bench_plot import render_chart
from sfa_rd2h.runtime.tools.cli import main


def run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(list(argv))
    return rc, out.getvalue()


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # One quick run (about 20-40 s) serves every test below; it is the part that takes time.
    chart = tmp_path_factory.mktemp("bench") / "bench.svg"
    rc, out = run_cli("bench", "--quick", "--json", "--plot", str(chart))
    assert rc == 0
    rep = json.loads(out)
    rep["_chart"] = chart.read_text()
    return rep


def test_every_figure_is_a_number_with_its_goal(report: dict[str, Any]) -> None:
    for key in FIGURE_KEYS:
        assert isinstance(report[key], float), key
        assert report[key] >= 0, key
        assert set(report["goals"][key]) == {"goal", "met"}
    # Each goal is judged from its own figure, so the two cannot disagree.
    assert report["goals"]["codec_ratio"]["met"] == (report["codec_ratio"] <= 1.5)
    assert report["goals"]["idle_cpu_fraction"]["met"] == (report["idle_cpu_fraction"] < 0.01)


def test_every_row_is_consistent_and_was_verified(report: dict[str, Any]) -> None:
    names = [row["name"] for row in report["rows"]]
    assert len(names) == len(set(names))
    for expected in ("control_rtt_p50", "control_rtt_p99", "idle_cpu", "prefill_layer_cpu",
                     "machine_share", "wire_ready_roundtrip", "decode_core_layer",
                     "host_read_64KiB", "host_read_2MiB", "host_read_32MiB",
                     "host_read_1000x16KiB", "pipeline", "plan_scale_100k_scattered"):
        assert expected in names
    for row in report["rows"]:
        assert set(row) == {"name", "median_s", "baseline_s", "ratio", "detail"}
        assert row["median_s"] > 0 and row["baseline_s"] > 0, row["name"]
        assert row["ratio"] == pytest.approx(row["median_s"] / row["baseline_s"], rel=1e-12)
        # Each baseline's output was compared with the project's before timing (same read
        # descriptors, same frame bytes, same bytes landed); the report says so per row.
        assert row["detail"]["verified"] is True, row["name"]
    by_name = {row["name"]: row["detail"] for row in report["rows"]}
    assert by_name["pipeline"]["bytes"] >= 256 << 20
    assert by_name["pipeline"]["layers"] == 32
    growth = by_name["machine_requests_4n"]["growth"]
    assert growth["to_models"] == 4 * growth["from_models"]
    assert by_name["prefill_layer_cpu"]["requests"] == 64
    assert by_name["prefill_layer_cpu"]["endpoints"] == 8


def test_chart_is_svg_with_one_bar_pair_per_data_plane_row(report: dict[str, Any]) -> None:
    root = ET.fromstring(report["_chart"])
    assert root.tag.endswith("svg")
    texts = "".join(report["_chart"].split())
    for name in ("host_read_2MiB", "pipeline"):
        assert name in texts
    assert render_chart(report) == report["_chart"]


def test_table_output_names_rows_and_figures() -> None:
    rc, out = run_cli("bench", "--quick", "--repeat", "1", "--only", "plan,wire")
    assert rc == 0
    assert "plan_layer_reads" in out and "wire_ready_roundtrip" in out
    for key in FIGURE_KEYS:
        assert key in out
    assert "codec_ratio" in out


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--quick", "--repeat", "0"]) == 2
    assert "--repeat" in capsys.readouterr().err
    assert main(["bench", "--only", "nope"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and all(name in err for name in STEP_NAMES)
