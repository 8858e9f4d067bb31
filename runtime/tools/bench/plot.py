"""PNG charts of a ``sfa-rd2h bench`` report (``bench --plot DIR``), drawn with matplotlib.

matplotlib is an optional extra (``pip install '.[plot]'``): nothing here imports it until
a chart is drawn, and :func:`missing_matplotlib` lets the CLI refuse ``--plot`` before any
benchmark runs. What each chart shows is computed by :func:`chart_series`, a pure function
of the report, so the plotted numbers can be checked against the report's rows without
reading pixels:

* ``throughput_vs_size.png``: GB/s of every engine read (host, and Mooncake when it ran)
  and of the pipeline, next to its baseline (in-process copy / one batched read);
* ``cost_vs_blocks.png``: read planning in ms per layer at 1k-100k block pairs, runs and
  scattered, vs the per-block Python loop (log axes);
* ``cost_vs_requests.png``: one Decode layer in the core vs decoding its READY alone, by
  requests per layer;
* ``cost_vs_endpoints.png``: Prefill CPU per layer vs bare msgpack + ZMQ, by Decode
  endpoints.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

INSTALL_HINT = "pip install '.[plot]'"
_PROJECT, _BASELINE = "#3a6ea5", "#9a9a9a"


@dataclass(frozen=True)
class Series:
    """One line (or one set of bars) of a chart: a side of the comparison."""

    label: str
    side: str  # "project" or "baseline"
    x: tuple[Any, ...]  # numbers, or category labels on a bar chart
    y: tuple[float, ...]
    rows: tuple[str, ...]  # the report row each point comes from


@dataclass(frozen=True)
class Chart:
    file: str
    title: str
    xlabel: str
    ylabel: str
    bars: bool  # categories as grouped bars; otherwise lines over a numeric x
    log: bool  # log scale on both axes (lines only)
    series: tuple[Series, ...]


CHART_FILES = ("throughput_vs_size.png", "cost_vs_blocks.png", "cost_vs_requests.png",
               "cost_vs_endpoints.png")


def missing_matplotlib() -> str | None:
    """None when matplotlib imports; otherwise the one line to print instead of charts."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return (f"--plot needs matplotlib, an optional extra: {INSTALL_HINT} "
                "(or pip install 'sfa-rd2h[plot]')")
    return None


def _pair(label: str, base_label: str, rows: list[dict[str, Any]], x: list[Any],
          value: Any) -> tuple[Series, Series]:
    """Project and baseline series over ``rows`` (sorted already), ``value(row, seconds)``
    turning a median into the plotted unit."""
    names = tuple(r["name"] for r in rows)
    return (Series(label, "project", tuple(x),
                   tuple(value(r, r["median_s"]) for r in rows), names),
            Series(base_label, "baseline", tuple(x),
                   tuple(value(r, r["baseline_s"]) for r in rows), names))


def _gbps(row: dict[str, Any], seconds: float) -> float:
    return row["detail"]["bytes"] / seconds / 1e9


def _read_label(row: dict[str, Any]) -> str:
    if row["name"] == "pipeline":
        return f"pipeline\n{row['detail']['bytes'] >> 20} MiB"
    engine, size = row["name"].split("_read_", 1)
    if row["detail"].get("descriptors", 1) > 1:  # scattered blocks: say the total too
        size += f"\n({row['detail']['bytes'] / (1 << 20):.3g} MiB)"
    return f"{engine}\n{size}"


def chart_series(rep: dict[str, Any]) -> list[Chart]:
    """The four charts of ``rep`` (a ``bench --json`` report), in ``CHART_FILES`` order.
    A chart whose rows did not run (``--only``) has no series."""
    rows = rep["rows"]
    reads = [r for r in rows if re.fullmatch(r"(host|mooncake)_read_\w+", r["name"])]
    reads.sort(key=lambda r: (r["name"].startswith("mooncake"), r["detail"]["bytes"],
                              r["detail"].get("descriptors", 1)))
    reads += [r for r in rows if r["name"] == "pipeline"]
    plan = [r for r in rows if r["name"].startswith("plan_scale_")]
    decode = sorted((r for r in rows if re.fullmatch(r"decode_core_layer(_\d+req)?", r["name"])),
                    key=lambda r: r["detail"]["requests"])
    prefill = sorted((r for r in rows if re.fullmatch(r"prefill_layer_cpu(_\d+ep)?", r["name"])),
                     key=lambda r: r["detail"]["endpoints"])

    def ms(_row: dict[str, Any], s: float) -> float:
        return s * 1e3

    def us(_row: dict[str, Any], s: float) -> float:
        return s * 1e6

    plan_series: list[Series] = []
    for kind in ("runs", "scattered"):
        mine = sorted((r for r in plan if r["detail"]["contiguous"] == (kind == "runs")),
                      key=lambda r: r["detail"]["block_pairs"])
        if mine:
            plan_series += _pair(f"plan_layer_reads, {kind}", f"per-block Python loop, {kind}",
                                 mine, [r["detail"]["block_pairs"] for r in mine], ms)
    return [
        Chart(CHART_FILES[0], "Data plane: throughput, project vs baseline", "transfer",
              "GB/s", True, False,
              _pair("project: engine read between processes / runtime pipeline",
                    "baseline: in-process numpy.copyto / one batched read", reads,
                    [_read_label(r) for r in reads], _gbps) if reads else ()),
        Chart(CHART_FILES[1], "Read planning: cost vs block pairs per layer",
              "block pairs per layer (x 4 tensors)", "ms per layer", False, True,
              tuple(plan_series)),
        Chart(CHART_FILES[2], "Decode core: one layer vs decoding its READY",
              "requests per layer (32 blocks each)", "us per layer", False, True,
              _pair("Decode core: on_frame(READY) -> read_result -> READ_DONE",
                    "baseline: wire.decode of the READY", decode,
                    [r["detail"]["requests"] for r in decode], us) if decode else ()),
        Chart(CHART_FILES[3], "Prefill: process CPU per layer vs bare ZMQ",
              "Decode endpoints (64 requests x 32 blocks)", "us CPU per layer", False, False,
              _pair("Prefill worker (cores, machines, ZMQ threads)",
                    "baseline: msgpack.packb + send, recv replies", prefill,
                    [r["detail"]["endpoints"] for r in prefill], us) if prefill else ()),
    ]


def _draw(chart: Chart, path: str, note: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global state, Agg by default
    from matplotlib.ticker import NullLocator

    fig = Figure(figsize=(8, 4.8), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    fig.suptitle(chart.title, fontsize=12)
    ax.set_title(note, fontsize=8, color="#666666")
    ax.set_xlabel(chart.xlabel)
    ax.set_ylabel(chart.ylabel)
    if not chart.series:
        ax.text(0.5, 0.5, "no rows for this chart in this run", ha="center", va="center",
                transform=ax.transAxes)
    elif chart.bars:
        cats = list(chart.series[0].x)
        width = 0.8 / len(chart.series)
        for k, s in enumerate(chart.series):
            pos = [cats.index(c) + (k - (len(chart.series) - 1) / 2) * width for c in s.x]
            bars = ax.bar(pos, s.y, width, label=s.label,
                          color=_PROJECT if s.side == "project" else _BASELINE)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_xticks(range(len(cats)), cats, fontsize=8)
    else:
        for s in chart.series:
            scattered = "scattered" in s.label
            ax.plot(s.x, s.y, marker="o", label=s.label,
                    color=_PROJECT if s.side == "project" else _BASELINE,
                    linestyle="--" if scattered else "-")
        if chart.log:
            ax.set_xscale("log")
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        xs = sorted({x for s in chart.series for x in s.x})
        ax.set_xticks(xs, [f"{x:g}" for x in xs])  # the measured points, nothing between
        ax.xaxis.set_minor_locator(NullLocator())
        ax.grid(True, which="major", alpha=0.3)
    if chart.series:
        ax.legend(fontsize=8)
    # No timestamp or version in the file, so the same report draws the same bytes.
    fig.savefig(path, format="png", metadata={"Software": None})


def write_charts(rep: dict[str, Any], out_dir: str) -> list[str]:
    """Draw the four charts of ``rep`` into ``out_dir`` (created); their paths."""
    os.makedirs(out_dir, exist_ok=True)
    note = (f"sfa-rd2h bench{' --quick' if rep.get('quick') else ''}, "
            f"{rep.get('cpus')} CPUs; medians of interleaved samples")
    paths = []
    for chart in chart_series(rep):
        path = os.path.join(out_dir, chart.file)
        _draw(chart, path, note)
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------- vllm-bench

SERVING_FILES = ("ttft_cdf.png", "throughput_vs_concurrency.png", "sfa_ttft_breakdown.png")


def _titled(title: str, note: str) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    fig.suptitle(title, fontsize=11)
    ax.set_title(note, fontsize=8, color="#666666")
    return fig, ax


def write_serving_charts(rep: dict[str, Any], out_dir: str) -> list[str]:
    """The three ``vllm-bench --plot`` charts of ``rep`` (its ``--json`` object): TTFT CDFs
    per system (one panel per scenario), output throughput vs concurrency per system, and
    where ``sfa``'s TTFT goes per scenario. Their paths."""
    from matplotlib.figure import Figure

    os.makedirs(out_dir, exist_ok=True)
    note = (f"sfa-rd2h vllm-bench, {rep['workload']['requests']} requests, seed "
            f"{rep['workload']['seed']}, {rep.get('cpus')} CPUs; medians over rounds")
    paths = [os.path.join(out_dir, f) for f in SERVING_FILES]
    samples = rep["ttft_samples"]
    scenarios = list(samples)
    fig = Figure(figsize=(4 * max(1, len(scenarios)), 4), dpi=100, layout="constrained")
    fig.suptitle(f"TTFT CDF per system\n{note}", fontsize=10)
    for k, sc in enumerate(scenarios):
        ax = fig.add_subplot(1, len(scenarios), k + 1)
        for name, xs in samples[sc].items():
            if xs:
                s = sorted(x * 1e3 for x in xs)
                ax.step(s, [(i + 1) / len(s) for i in range(len(s))], where="post",
                        label=name)
        ax.set_title(sc, fontsize=9)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(paths[0], format="png", metadata={"Software": None})

    fig, ax = _titled("output throughput vs concurrency", note)
    for name in rep["systems"]:
        pts = sorted((int(r["scenario"][1:]), r["throughput_tok_s"]) for r in rep["rows"]
                     if r["system"] == name and re.fullmatch(r"c\d+", r["scenario"])
                     and r["throughput_tok_s"] is not None)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(paths[1], format="png", metadata={"Software": None})

    fig, ax = _titled("where sfa's TTFT goes (median per phase)", note)
    parts = (("client_to_prefill_call_ms",
              "client -> Prefill call (Decode's rendezvous unless dispatched early)"),
             ("prefill_compute_and_push_ms", "Prefill compute + layer pushes"),
             ("first_token_after_prefill_ms", "Decode's first token after Prefill"))
    bd = rep.get("sfa_ttft_breakdown") or {}
    cats = [sc for sc in bd if bd[sc]]
    bottom = [0.0] * len(cats)
    for key, label in parts:
        ys = [max(0.0, bd[sc].get(key) or 0.0) for sc in cats]
        ax.bar(cats, ys, bottom=bottom, label=label)
        bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
    ax.set_ylabel("ms")
    ax.legend(fontsize=8)
    fig.savefig(paths[2], format="png", metadata={"Software": None})
    return paths
