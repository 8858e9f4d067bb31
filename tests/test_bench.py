"""``sfa-rd2h bench`` reports every benchmark and every figure with consistent numbers.

Only the report's structure is checked here. How fast anything is belongs to the benchmark
run itself (medians and ratios of one run on one machine); a timing threshold in a unit test
would fail on a busy shared machine and say nothing about the code.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sfa_rd2h.runtime.tools.bench import plot as bench_plot
from sfa_rd2h.runtime.tools.bench.plot import CHART_FILES, chart_series
from sfa_rd2h.runtime.tools.bench.suite import FIGURE_KEYS, STEP_NAMES
from sfa_rd2h.runtime.tools.cli import main


def run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(list(argv))
    return rc, out.getvalue()


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # One quick run (about 35 s idle, 55 s beside two CPU hogs) serves every test below; it
    # is the part that takes time. It runs as a user runs it, in a process of its own: in
    # the suite's own process, late in a run under the stress script's hogs, it once took
    # over 300 s (still plotting) with whatever earlier tests left in the process beside it.
    charts = tmp_path_factory.mktemp("bench") / "charts"
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from sfa_rd2h.runtime.tools.cli import main; "
         "sys.exit(main())", "bench", "--quick", "--json", "--plot", str(charts)],
        capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(proc.stdout)
    rep["_charts"] = charts
    return rep


def test_every_figure_is_a_number_with_its_goal(report: dict[str, Any]) -> None:
    for key in FIGURE_KEYS:
        assert isinstance(report[key], float), key
        assert report[key] >= 0, key
        assert set(report["goals"][key]) == {"goal", "met"}
    # Each goal is judged from its own figure, so the two cannot disagree.
    assert report["goals"]["codec_ratio"]["met"] == (report["codec_ratio"] <= 1.0)
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
    # The sweeps behind the charts: the figures' rows keep their sizes, the other points
    # have rows of their own.
    assert by_name["decode_core_layer"]["requests"] == 64
    # the figure is a step's later layer; its first layer, planned afresh, is shown beside it
    assert by_name["decode_core_layer"]["repeats"] is True
    assert by_name["decode_core_layer_cold"]["repeats"] is False
    assert by_name["decode_core_layer_cold"]["requests"] == 64
    assert [by_name[f"decode_core_layer_{n}req"]["requests"] for n in (16, 256)] == [16, 256]
    assert [by_name[f"prefill_layer_cpu_{n}ep"]["endpoints"] for n in (1, 2, 4)] == [1, 2, 4]


_PNG = b"\x89PNG\r\n\x1a\n"


def test_plot_writes_four_png_charts(report: dict[str, Any]) -> None:
    written = sorted(p.name for p in report["_charts"].iterdir())
    assert written == sorted(CHART_FILES)
    for name in CHART_FILES:
        data = (report["_charts"] / name).read_bytes()
        assert data.startswith(_PNG), name
        assert len(data) > 10_000, name  # axes, labels and data, not an empty canvas


def _plotted(series: bench_plot.Series, rows: dict[str, dict[str, Any]]) -> list[float]:
    """What each point of ``series`` must be, recomputed from its row of the report."""
    out = []
    for name, y in zip(series.rows, series.y, strict=True):
        row = rows[name]
        seconds = row["median_s" if series.side == "project" else "baseline_s"]
        unit = row["detail"]["unit"]
        expected = {"us/read": row["detail"].get("bytes", 0) / seconds / 1e9,
                    "ms/prompt": row["detail"].get("bytes", 0) / seconds / 1e9,
                    "ms/layer": seconds * 1e3, "us/layer": seconds * 1e6}[unit]
        assert y == pytest.approx(expected, rel=1e-12), (series.label, name)
        out.append(y)
    return out


def test_each_chart_plots_the_reports_rows_project_and_baseline(
        report: dict[str, Any]) -> None:
    rows = {row["name"]: row for row in report["rows"]}
    charts = {c.file: c for c in chart_series(report)}
    assert list(charts) == list(CHART_FILES)
    for chart in charts.values():
        assert {s.side for s in chart.series} == {"project", "baseline"}, chart.file
        for s in chart.series:
            _plotted(s, rows)
    shown = {c.file: sorted({n for s in c.series for n in s.rows}) for c in charts.values()}
    assert shown["throughput_vs_size.png"] == sorted(
        ["host_read_64KiB", "host_read_2MiB", "host_read_32MiB", "host_read_1000x16KiB",
         "pipeline"])
    assert shown["cost_vs_blocks.png"] == sorted(n for n in rows if n.startswith("plan_scale_"))
    assert len(shown["cost_vs_blocks.png"]) == 6
    assert shown["cost_vs_requests.png"] == sorted(
        ["decode_core_layer_16req", "decode_core_layer", "decode_core_layer_256req"])
    assert shown["cost_vs_endpoints.png"] == sorted(
        ["prefill_layer_cpu_1ep", "prefill_layer_cpu_2ep", "prefill_layer_cpu_4ep",
         "prefill_layer_cpu"])
    # x is what the chart's axis says: requests, endpoints, block pairs, in order.
    [dec, _] = charts["cost_vs_requests.png"].series
    assert dec.x == (16, 64, 256)
    assert charts["cost_vs_endpoints.png"].series[0].x == (1, 2, 4, 8)
    assert all(s.x == (1000, 10_000, 100_000) for s in charts["cost_vs_blocks.png"].series)


def _row(name: str, median_s: float, baseline_s: float, unit: str,
         **detail: Any) -> dict[str, Any]:
    return {"name": name, "median_s": median_s, "baseline_s": baseline_s,
            "ratio": median_s / baseline_s, "detail": {"unit": unit, **detail}}


def test_throughput_chart_shows_mooncake_rows_when_they_ran() -> None:
    rep = {"rows": [_row("mooncake_read_2MiB", 2e-3, 1e-4, "us/read", bytes=2 << 20),
                    _row("host_read_2MiB", 4e-4, 1e-4, "us/read", bytes=2 << 20),
                    _row("wire_ready_roundtrip", 1.0, 1.0, "us/msg")]}
    [size, blocks, requests, endpoints] = chart_series(rep)
    assert [s.rows for s in size.series] == [("host_read_2MiB", "mooncake_read_2MiB")] * 2
    assert size.series[0].x == ("host\n2MiB", "mooncake\n2MiB")
    assert size.series[0].y == pytest.approx(((2 << 20) / 4e-4 / 1e9, (2 << 20) / 2e-3 / 1e9))
    assert size.series[1].y == pytest.approx(((2 << 20) / 1e-4 / 1e9,) * 2)
    # Rows that did not run leave their charts empty; the files are still drawn.
    assert blocks.series == requests.series == endpoints.series == ()


def test_charts_draw_exactly_the_computed_series(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    rep = {"rows": [_row("decode_core_layer", 2e-3, 5e-4, "us/layer", requests=64),
                    _row("decode_core_layer_16req", 1e-3, 2e-4, "us/layer", requests=16)],
           "quick": True, "cpus": 2}
    drawn: list[bench_plot.Chart] = []
    monkeypatch.setattr(bench_plot, "_draw", lambda chart, path, note: drawn.append(chart))
    paths = bench_plot.write_charts(rep, str(tmp_path / "new"))
    assert drawn == chart_series(rep)
    assert paths == [str(tmp_path / "new" / f) for f in CHART_FILES]


def test_plot_without_matplotlib_exits_2_before_benchmarking(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    ran: list[Any] = []
    monkeypatch.setattr("sfa_rd2h.runtime.tools.bench.suite.run_benchmarks",
                        lambda *a, **k: ran.append(a) or [])
    assert main(["bench", "--quick", "--plot", str(tmp_path / "charts")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "matplotlib" in err and "pip install '.[plot]'" in err
    assert ran == [] and not (tmp_path / "charts").exists()


def test_plot_into_a_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "bench.svg"
    target.write_text("")
    assert main(["bench", "--quick", "--only", "wire", "--plot", str(target)]) == 2
    assert "not a folder" in capsys.readouterr().err


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
