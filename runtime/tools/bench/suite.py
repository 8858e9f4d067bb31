"""``sfa-rd2h bench``: the hot path timed against a baseline, in one run.

The per-layer path must be cheap, and this measures that rather than trusting it. The
machine these numbers come from is shared and noisy, so no benchmark reports a lone time:
each one times the project's operation and a baseline *in the same run*, with the repeats
interleaved (project, baseline, baseline, project, ...) so a burst of background load hits
both, and reports the median of each and their ratio. The ratio is the number to compare
across machines and commits; the absolute times only describe this machine today.

Conventions, for every row:

* ``median_s`` and ``baseline_s`` are seconds per operation (one layer, one message, one
  machine cycle, one request, one 64 MiB read), the median over ``--repeat`` samples; a sample
  runs the operation enough times in a row to last a few milliseconds, so the clock's
  resolution does not matter.
* ``ratio = median_s / baseline_s``: below 1 the project is faster than its baseline, above 1
  it pays that factor (for validation, for declared machines, for crossing processes).
* Before timing, each baseline's output is checked against the project's once (same read
  descriptors, same bytes on the wire, same end state, same bytes landed), so a fast baseline
  cannot be fast by doing less. ``detail["verified"]`` records that the check ran and held; a
  failed check aborts the run (exit 1) instead of printing a meaningless ratio.
* The garbage collector is paused inside a sample and run between samples (as ``timeit``
  does), so a collection triggered by one side's garbage is not charged to the other.

Timing goals live here, never in unit tests; the tests only check the report's structure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

from sfa_rd2h.runtime.tools.bench.common import (
    FULL,
    QUICK,
    BenchError,
    Result,
    Sizes,
    format_goals,
    judge,
)
from sfa_rd2h.spec.errors import ProtocolError

# --------------------------------------------------------------------------- driver & CLI

# The figures the issue sets goals for: (key, row, how the row gives it, goal, direction).
# "ratio" is median / baseline; "inverse" is baseline / median (a throughput ratio);
# "ms" is the row's median in milliseconds.
FIGURES: tuple[tuple[str, str, str, float | None, str], ...] = (
    ("control_rtt_ratio", "control_rtt_p50", "ratio", 1.3, "<="),
    ("control_rtt_p99_ratio", "control_rtt_p99", "ratio", None, ""),
    ("prefill_layer_cpu_ratio", "prefill_layer_cpu", "ratio", 2.0, "<="),
    ("machine_share", "machine_share", "ratio", 0.10, "<="),
    ("codec_ratio", "wire_ready_roundtrip", "ratio", 1.0, "<="),
    ("decode_layer_ratio", "decode_core_layer", "ratio", 2.0, "<="),
    ("host_read_ratio_2mib", "host_read_2MiB", "inverse", 0.8, ">="),
    ("pipeline_efficiency", "pipeline", "inverse", 0.7, ">="),
    ("plan_100k_ms", "plan_scale_100k_scattered", "ms", 20.0, "<="),
    ("ready_peak_rss_ratio", "ready_peak_rss", "ratio", 4.0, "<="),
    ("idle_cpu_fraction", "idle_cpu", "ratio", 0.01, "<"),
)
FIGURE_KEYS: tuple[str, ...] = tuple(f[0] for f in FIGURES)


def _steps() -> dict[str, Callable[[Sizes], Result | list[Result]]]:
    """Benchmark groups by name, in report order (imported here: the CLI loads this module
    for its parser, and the system rows pull in zmq and the runtime)."""
    from sfa_rd2h.runtime.tools.bench import micro, system

    return {
        "plan": micro.bench_plan,
        "wire": micro.bench_wire,
        "machines": micro.bench_machines,
        "decode_core": micro.bench_decode_core,
        "plan_scale": micro.bench_plan_scale,
        "ready_memory": micro.bench_ready_memory,
        "control": system.bench_control,
        "prefill_layer": system.bench_prefill_layer,
        "machine_share": system.bench_machine_share,
        "host_read": partial(system.bench_reads, engine="host"),
        "mooncake_read": partial(system.bench_reads, engine="mooncake"),
        "pipeline": system.bench_pipeline,
    }


STEP_NAMES: tuple[str, ...] = ("plan", "wire", "machines", "decode_core", "plan_scale",
                               "ready_memory", "control", "prefill_layer", "machine_share",
                               "host_read", "mooncake_read", "pipeline")


def mooncake_available() -> bool:
    try:
        from sfa_rd2h.runtime.engines.mooncake import load_mooncake

        load_mooncake()
    except Exception:  # noqa: BLE001 - any failure to load means "not here"
        return False
    return True


def run_benchmarks(quick: bool = False, repeat: int | None = None,
                   on_result: Callable[[Result], None] | None = None,
                   only: tuple[str, ...] | None = None) -> list[Result]:
    """Run the benchmark groups (``only`` selects some) in report order. Mooncake's table
    runs when its library loads, and not with ``quick``."""
    sizes = QUICK if quick else FULL
    if repeat is not None:
        sizes = Sizes(**{**sizes.__dict__, "repeat": repeat})
    steps = _steps()
    names = [n for n in STEP_NAMES if only is None or n in only]
    if "mooncake_read" in names and (quick or not mooncake_available()) and only is None:
        names.remove("mooncake_read")
    results: list[Result] = []
    for name in names:
        got = steps[name](sizes)
        for r in got if isinstance(got, list) else [got]:
            results.append(r)
            if on_result is not None:
                on_result(r)
    return results


def figures(results: list[Result]) -> dict[str, float | None]:
    """The top-level figures from the rows (None where the row did not run)."""
    rows = {r.name: r for r in results}
    out: dict[str, float | None] = {}
    for key, row, how, _goal, _op in FIGURES:
        r = rows.get(row)
        if r is None:
            out[key] = None
        elif how == "ratio":
            out[key] = r.ratio
        elif how == "inverse":
            out[key] = r.baseline_s / r.median_s
        else:
            out[key] = r.median_s * 1e3
    return out


def report(results: list[Result], quick: bool) -> dict[str, Any]:
    """The ``--json`` object: every row, the figures at the top level, and their goals."""
    figs = figures(results)
    goals = {key: judge(figs[key], goal, op) for key, _row, _how, goal, op in FIGURES}
    return {"rows": [r.as_json() for r in results], **figs, "goals": goals, "quick": quick,
            "cpus": os.cpu_count()}


_HEADER = f"{'benchmark':26} {'project':>10} {'baseline':>10} {'ratio':>7}  {'unit':10} what"


def format_row(r: Result) -> str:
    return (f"{r.name:26} {r.median_s * r.scale:>10.2f} {r.baseline_s * r.scale:>10.2f} "
            f"{r.ratio:>7.3f}  {r.unit:10} {r.what}")


def format_figures(rep: dict[str, Any]) -> list[str]:
    return format_goals(rep, {key: rep["goals"][key] for key in FIGURE_KEYS})


def cmd_bench(args: argparse.Namespace) -> int:
    if args.repeat is not None and args.repeat < 1:
        print("--repeat must be at least 1", file=sys.stderr)
        return 2
    only = None
    if args.only:
        only = tuple(n.strip() for n in args.only.split(",") if n.strip())
        unknown = sorted(set(only) - set(STEP_NAMES))
        if unknown:
            print(f"unknown benchmark group(s) {', '.join(unknown)}; known: "
                  f"{', '.join(STEP_NAMES)}", file=sys.stderr)
            return 2
    if args.plot:
        # Refuse before the run, not after minutes of benchmarking.
        from sfa_rd2h.runtime.tools.bench.plot import missing_matplotlib

        problem = missing_matplotlib()
        if problem is None and os.path.exists(args.plot) and not os.path.isdir(args.plot):
            problem = f"--plot {args.plot}: exists and is not a folder"
        if problem is not None:
            print(problem, file=sys.stderr)
            return 2
    show: Callable[[Result], None] | None = None
    if not args.json:
        print(f"medians of {args.repeat or (QUICK if args.quick else FULL).repeat} interleaved "
              f"samples; ratio = project / baseline; {os.cpu_count()} CPUs")
        print(_HEADER, flush=True)

        def show(r: Result) -> None:
            print(format_row(r), flush=True)

    try:
        results = run_benchmarks(args.quick, args.repeat, on_result=show, only=only)
    except (BenchError, ProtocolError, OSError, subprocess.SubprocessError) as exc:
        # A failed equality check or an engine that cannot run here: say which, exit 1,
        # rather than print a ratio that compares different work.
        print(f"bench failed: {exc}", file=sys.stderr)
        return 1
    rep = report(results, args.quick)
    if args.plot:
        from sfa_rd2h.runtime.tools.bench.plot import write_charts

        written = write_charts(rep, args.plot)
        if not args.json:
            print(f"charts: {', '.join(written)}")
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        print()
        print("\n".join(format_figures(rep)))
    return 0


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` to an argparse sub-command set; the handler is ``cmd_bench``."""
    p = subparsers.add_parser(
        "bench", help="time the hot path and the runtime against baselines (one run)",
        description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("--quick", action="store_true",
                   help="fewer repeats and shorter windows (under 2 minutes); every figure "
                        "is still reported; no Mooncake table")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: rows [{name, median_s, baseline_s, ratio, "
                        "detail}] and the figures " + ", ".join(FIGURE_KEYS))
    p.add_argument("--repeat", type=int, default=None,
                   help=f"samples per side (default {FULL.repeat}, quick {QUICK.repeat})")
    p.add_argument("--only", default=None,
                   help=f"comma-separated groups to run: {', '.join(STEP_NAMES)}")
    p.add_argument("--plot", default=None, metavar="DIR",
                   help="write PNG charts into DIR (needs matplotlib: pip install "
                        "'.[plot]'): throughput vs transfer size, cost vs blocks, vs "
                        "requests, vs endpoints, each project against baseline")
    p.set_defaults(func=cmd_bench)
    return p

