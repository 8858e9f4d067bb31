"""``sfa-rd2h demo`` on the command line."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any

from sfa_rd2h.runtime import shm
from sfa_rd2h.runtime.engines import (
    ENGINE_NAMES,
)
from sfa_rd2h.runtime.tools.demo.run import run_demo
from sfa_rd2h.runtime.tools.demo.workload import (
    HOST_LAYOUTS,
    INJECTIONS,
    TP_GROUPS,
    DemoConfig,
    DemoConfigError,
)


def add_demo_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``demo`` to an argparse sub-command set; the handler is ``cmd_demo``."""
    d = DemoConfig()
    p = subparsers.add_parser(
        "demo", help="run a whole P/D deployment as separate processes and verify every byte",
        description="Run a whole Prefill/Decode deployment on this machine as separate OS "
                    "processes over real sockets and a real transfer engine; verify every "
                    "destination byte and every process's trace. Exit 0 when the outcome is "
                    "the one the configuration (and --inject) predicts, 1 otherwise, 2 for an "
                    "invalid configuration.")
    p.add_argument("--p-tp", type=int, default=d.p_tp, help="Prefill TP ranks (processes)")
    p.add_argument("--d-tp", type=int, default=d.d_tp, help="Decode TP ranks (processes)")
    p.add_argument("--layers", type=int, default=d.layers, help="cache-bearing layers")
    p.add_argument("--slots", type=int, default=d.slots,
                   help="physical KV slots on Prefill (layer l uses slot l %% slots)")
    p.add_argument("--requests", type=int, default=d.requests, help="requests to run")
    p.add_argument("--no-indexer", action="store_true", help="main KV only (no indexer)")
    p.add_argument("--no-scale", action="store_true", help="indexer without LIC8 scale")
    p.add_argument("--engine", choices=ENGINE_NAMES, default=d.engine, help="transfer engine")
    p.add_argument("--host-mode", choices=("auto", "cma", "shm"), default=d.host_mode,
                   help="host engine data path; shm serves only engine-allocated memory, so "
                        "Prefill then allocates its caches through the engine")
    p.add_argument("--inject", choices=INJECTIONS, default=d.inject,
                   help="failure to inject; the run passes when the outcome matches "
                        "what the injection predicts")
    p.add_argument("--block-tokens", type=int, default=d.block_tokens, help="tokens per block")
    p.add_argument("--chunk-tokens", type=int, default=d.chunk_tokens,
                   help="chunked-prefill tokens per request per step")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="longest prompt")
    p.add_argument("--seed", type=int, default=d.seed, help="workload seed")
    p.add_argument("--timeout", type=float, default=d.timeout,
                   help="overall seconds before everything is killed (exit 1)")
    for name, what in (("reply-timeout", "Prefill: a READY unanswered this long loses its "
                                          "reader (S5)"),
                       ("destination-wait", "Decode: how long a READY waits for its "
                                            "request's destinations (C1)"),
                       ("read-budget", "Decode: a read finishing later than this after its "
                                       "READY arrived fails (S6); between --destination-wait "
                                       "and --reply-timeout"),
                       ("request-deadline", "Decode: every contributor final by then, else "
                                            "the request fails (R1)"),
                       ("tp-timeout", "Decode: one TP-group collective (R2)")):
        p.add_argument(f"--{name}", type=float, default=None,
                       help=f"{what}; default: short under a fault injection, else bounded "
                            "by --timeout")
    p.add_argument("--cut-seconds", type=float, default=None,
                   help="--inject link-cut: how long the Prefill host's link stays down "
                        "(default: twice the fault runs' --reply-timeout)")
    p.add_argument("--kv-port", type=int, default=None,
                   help="Decode base port (default: a free span)")
    p.add_argument("--host", default=d.host, help="loopback or host address to use")
    p.add_argument("--hosts", choices=HOST_LAYOUTS, default=d.hosts,
                   help="local: every process on this host at --host; netns: the proxy, the "
                        "Decode ranks and the Prefill ranks each on a network namespace of "
                        "their own (root; needs an engine that works across hosts: mooncake)")
    p.add_argument("--trace-dir", default=None, help="keep the JSON-lines traces here")
    p.add_argument("--tp-group", choices=TP_GROUPS, default=d.tp_group,
                   help="how Decode ranks agree on terminal status: zmq (default, no torch "
                        "needed) or gloo (torch.distributed, as inside vLLM)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true",
                   help="let the ranks' stderr (engine library logs) through; by default it "
                        "goes to a log file, and its tail is shown only if the run fails")
    p.set_defaults(func=cmd_demo)
    return p


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    return DemoConfig(
        p_tp=args.p_tp, d_tp=args.d_tp, layers=args.layers, slots=args.slots,
        requests=args.requests, indexer=not args.no_indexer, scale=not args.no_scale,
        engine=args.engine, host_mode=args.host_mode, inject=args.inject,
        timeout=args.timeout, kv_port=args.kv_port, trace_dir=args.trace_dir,
        block_tokens=args.block_tokens,
        chunk_tokens=args.chunk_tokens, max_tokens=args.max_tokens, host=args.host,
        hosts=args.hosts,
        seed=args.seed, progress=not (args.json or args.quiet), tp_group=args.tp_group,
        verbose=args.verbose, reply_timeout=args.reply_timeout,
        destination_wait=args.destination_wait, read_budget=args.read_budget,
        request_deadline=args.request_deadline,
        tp_timeout=args.tp_timeout, cut_seconds=args.cut_seconds)


def cmd_demo(args: argparse.Namespace) -> int:
    """Exit 0: outcome as predicted, every byte verified, traces valid; 1: otherwise;
    2: invalid configuration (the message names the rule); 130: interrupted (Ctrl-C),
    143: stopped by SIGTERM (either way every rank stopped and everything removed)."""
    try:
        result = run_demo(config_from_args(args), exiting=True)
    except DemoConfigError as exc:
        print(f"invalid demo configuration: {exc}", file=sys.stderr)
        return 2
    if args.json:
        keys = ("ok", "requests_ok", "requests_failed", "bytes", "seconds", "gbps",
                "rtt_p50_ms", "rtt_p99_ms", "verified", "trace_valid", "topology")
        out = {k: getattr(result, k) for k in keys}
        out.update(interrupted=result.interrupted, inject=result.inject,
                   expectation=result.expectation,
                   expectation_met=result.expectation_met,
                   prefill_gate_errors=result.prefill_gate_errors,
                   failed_requests=result.failed_requests, problems=result.problems,
                   outcomes=result.outcomes, observed=result.observed)
        print(json.dumps(out))
    elif not result.interrupted:
        print(result.summary())
    if result.interrupted:
        left = shm.files_of(result.pids.values())
        where = f"left in /dev/shm: {left}" if left else "nothing left in /dev/shm"
        # From the start of the line, the progress bar's remains erased: a Ctrl-C that lands
        # inside the bar's own write leaves it unfinished, and the line would run on from it.
        start = "\r\x1b[K" if sys.stderr.isatty() else "\r"
        print(f"{start}interrupted: stopped {len(result.exit_codes)} rank process(es); {where}",
              file=sys.stderr)
        return 128 + (result.stop_signal or signal.SIGINT)
    return 0 if result.ok else 1

