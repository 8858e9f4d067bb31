"""What every benchmark of ``sfa-rd2h bench`` and ``sfa-rd2h vllm-bench`` shares: the result
row, the workload sizes, timing with the collector paused, and interleaved sampling.

The machine these numbers come from is shared and noisy, so no benchmark reports a lone time:
each one runs the project and its baseline in the same run, alternately, so a burst of
background load hits both, and reports medians and their ratio.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


class BenchError(RuntimeError):
    """A baseline disagreed with the project, or a benchmark could not run."""


@dataclass(frozen=True)
class Sizes:
    """Workload of one run; ``FULL`` is what the quoted numbers use. ``QUICK`` keeps the
    workloads whose ratios the goals judge at full size and cuts repeats and sample times."""

    requests: int  # requests per layer (plan, Decode core)
    blocks: int  # blocks per request and per id list (main and indexer)
    wire_entries: int  # READY entries in the wire benchmark
    wire_ids: int  # block ids per list in the wire benchmark (main and indexer each)
    models: int  # concurrent requests of the smaller lifecycle benchmark (the larger is 4x)
    repeat: int  # samples per side
    sample_s: float  # minimum duration of one sample
    plan_blocks: tuple[int, ...]  # planning scale: block pairs per layer
    rtt_rounds: int  # round trips per side
    idle_s: float  # idle window
    layer_steps: int  # prefill steps per per-layer sample
    layer_repeat: int  # per-layer samples per side
    read_repeat: int  # samples per side of each engine read size
    pipe_repeat: int  # 256 MiB prompts per side
    # Sweeps for the charts (``--plot``): requests per layer in the Decode core and Decode
    # endpoints per Prefill layer. The sizes the figures use (``requests``, 8 endpoints) are
    # their own rows; the other points get rows of their own names.
    decode_requests: tuple[int, ...] = (16, 64, 256)
    endpoints: tuple[int, ...] = (1, 2, 4, 8)


FULL = Sizes(requests=64, blocks=32, wire_entries=64, wire_ids=300, models=1000, repeat=15,
             sample_s=0.02, plan_blocks=(1000, 10_000, 100_000), rtt_rounds=4000, idle_s=5.0,
             layer_steps=4, layer_repeat=9, read_repeat=15, pipe_repeat=9)
QUICK = Sizes(requests=64, blocks=32, wire_entries=64, wire_ids=300, models=100, repeat=5,
              sample_s=0.005, plan_blocks=(1000, 10_000, 100_000), rtt_rounds=600,
              idle_s=2.0, layer_steps=2, layer_repeat=3, read_repeat=5, pipe_repeat=3)


@dataclass
class Result:
    name: str
    median_s: float
    baseline_s: float
    unit: str  # how the table shows the medians, e.g. "us/layer"
    scale: float  # seconds -> unit
    what: str  # one line for the table: workload and baseline
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.median_s / self.baseline_s

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "median_s": self.median_s, "baseline_s": self.baseline_s,
                "ratio": self.ratio, "detail": {"unit": self.unit, "what": self.what,
                                                **self.detail}}


# --------------------------------------------------------------------------- timing


def _batch(fn: Callable[[], object], loops: int) -> float:
    """Seconds for ``loops`` back-to-back calls, with the collector paused."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        return time.perf_counter() - t0
    finally:
        if enabled:
            gc.enable()


class GcPauses:
    """This process's garbage-collector pauses while installed (a context manager): each
    collection's generation and how long it held the interpreter. A full collection walks
    every tracked object, and a process that imported vLLM holds about 600k of them: 0.4 s
    here when idle, with every thread of the process (a client, a proxy) held meanwhile."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._began: float | None = None
        self._pauses: list[tuple[int, float]] = []  # (generation, seconds)

    def _hook(self, phase: str, info: dict[str, int]) -> None:
        # Runs in whichever thread collects, under the GIL: collections never overlap.
        if phase == "start":
            self._began = self._clock()
        elif self._began is not None:
            self._pauses.append((info["generation"], self._clock() - self._began))
            self._began = None

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._hook)

    def take(self) -> dict[str, Any]:
        """The pauses since the last take: how many, how many full, the longest, the sum."""
        pauses, self._pauses = self._pauses, []
        return {"collections": len(pauses), "full": sum(g == 2 for g, _ in pauses),
                "max_ms": round(max((s for _, s in pauses), default=0.0) * 1e3, 3),
                "total_ms": round(sum(s for _, s in pauses) * 1e3, 3)}


def freeze_heap() -> None:
    """Collect once, then leave everything alive now out of every later collection, as
    vLLM's own servers do after start-up (``freeze_gc_heap``): full collections then walk
    only what was allocated since, not the imports."""
    gc.collect()
    gc.freeze()


def _loops_for(fn: Callable[[], object], sample_s: float) -> int:
    """Calls per sample so that one sample lasts at least ``sample_s`` (like timeit.autorange)."""
    loops = 1
    while True:
        took = _batch(fn, loops)
        if took >= sample_s or loops >= 1 << 20:
            return loops
        # Aim just past the target, but grow at most 10x per step: the first call of a
        # cold function can be unrepresentatively fast or slow.
        want = math.ceil(loops * sample_s * 1.1 / took) if took > 0 else loops * 10
        loops = min(loops * 10, max(loops + 1, want))


def compare(project: Callable[[], object], baseline: Callable[[], object], repeat: int,
            sample_s: float, loops: int | None = None) -> tuple[float, float, dict[str, Any]]:
    """Median seconds per call of ``project`` and ``baseline``, sampled alternately.

    The order flips every round (ABBA), so neither side always runs right after the other's
    caches and allocations. ``loops`` fixes the calls per sample (for operations that
    already last milliseconds); otherwise each side is calibrated to ``sample_s``.
    """
    n_p = loops or _loops_for(project, sample_s)
    n_b = loops or _loops_for(baseline, sample_s)
    p_times: list[float] = []
    b_times: list[float] = []
    sides = [(project, n_p, p_times), (baseline, n_b, b_times)]
    for i in range(max(1, repeat)):
        for fn, n, out in sides if i % 2 == 0 else reversed(sides):
            out.append(_batch(fn, n) / n)
    info = {"repeat": len(p_times), "loops": [n_p, n_b],
            "spread": [_spread(p_times), _spread(b_times)]}
    return statistics.median(p_times), statistics.median(b_times), info


def _spread(times: list[float]) -> float:
    """(max - min) / median of the samples: how noisy this side was in this run."""
    med = statistics.median(times)
    return round((max(times) - min(times)) / med, 3) if med > 0 else 0.0



def abba(sides: list[Callable[[], list[float]]], blocks: int) -> list[list[float]]:
    """Run each side's sample block ``blocks`` times, order flipped every round."""
    out: list[list[float]] = [[] for _ in sides]
    order = list(range(len(sides)))
    for i in range(blocks):
        for k in order if i % 2 == 0 else reversed(order):
            out[k] += sides[k]()
    return out


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` by rank (no interpolation), as the tables quote it."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def goal_met(value: float | None, goal: float | None, op: str) -> bool | None:
    if value is None or goal is None:
        return None
    return {"<=": value <= goal, "<": value < goal, ">=": value >= goal}[op]


def judge(value: float | None, goal: float | None, op: str) -> dict[str, Any]:
    """A figure's entry in a report's ``goals``: ``{"goal": "<= 1.1", "met": True}``;
    ``met`` is None where the figure was not measured or has no goal."""
    return {"goal": None if goal is None else f"{op} {goal:g}",
            "met": goal_met(value, goal, op)}


def format_goals(values: Mapping[str, float | None],
                 goals: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The goals as text lines: figure, value, goal, met (yes / NO / - unmeasured)."""
    width = max([26, *map(len, goals)])
    lines = [f"{'figure':{width}} {'value':>10}  goal      met"]
    for key, g in goals.items():
        v = values.get(key)
        shown = "-" if v is None else f"{v:.3f}"
        met = {True: "yes", False: "NO", None: "-"}[g["met"]]
        lines.append(f"{key:{width}} {shown:>10}  {g['goal'] or '-':9} {met}")
    return lines
