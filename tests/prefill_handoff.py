"""What the connector costs Prefill's compute thread per step when it shares one core with
the sender thread, as vLLM's CPU worker pins them: ``python tests/prefill_handoff.py
[--steps 1500] [--layers 2] [--compute-ms 1.5] [--core 0]`` runs a :class:`PrefillWorker`
pinned to one core, one request of 4 blocks a step, a busy stand-in for each layer's
compute, and the bench's echo peer as Decode, and prints one JSON object: medians of
``begin_layer`` and ``layer_written`` on the compute thread, the step's whole connector
overhead (wall minus the stand-in compute), and READY-to-reply. Not a test: a measurement
the README quotes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from sfa_rd2h.runtime.control import PrefillWorker
from sfa_rd2h.runtime.tools.bench.system import running
from sfa_rd2h.spec import wire
from sfa_rd2h.spec.topology import tp_mapping
from sfa_rd2h.statemachines.cores.prefill import PrefillCore

WARMUP_STEPS = 100


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure(steps: int, layers: int, compute_s: float) -> dict[str, float]:
    metas = {f"model.layers.{i}.self_attn.attn": wire.LayerMeta(
        (0x7F00_0000_0000 + (i << 40),), (8192,), (1,), (0,), 1, False)
        for i in range(layers)}
    begin: list[float] = []
    written: list[float] = []
    overhead: list[float] = []
    with running("echo", "--sockets", "1") as echo:
        params = {"remote_host": "127.0.0.1", "remote_port": echo.info["ports"][0],
                  "remote_tp_size": 1}
        worker = PrefillWorker(PrefillCore(0, tp_mapping(1, 1), "127.0.0.1:1", metas,
                                           block_size=16))
        try:
            for n in range(steps + WARMUP_STEPS):
                ext = f"req-{n}"
                start = time.perf_counter()
                worker.add_request(ext, params, [n % 100, n % 100 + 100, 300, 301], [])
                worker.schedule_chunk(ext, 64, True)
                for layer in range(layers):
                    worker.wait_for_layer_send(layer, 10.0)
                    t0 = time.perf_counter()
                    worker.begin_layer(layer)
                    t1 = time.perf_counter()
                    _busy(compute_s)
                    t2 = time.perf_counter()
                    worker.layer_written(layer, None)
                    t3 = time.perf_counter()
                    if n >= WARMUP_STEPS:
                        begin.append(t1 - t0)
                        written.append(t3 - t2)
                worker.finish_request(ext)
                if n >= WARMUP_STEPS:
                    overhead.append(time.perf_counter() - start - layers * compute_s)
                for layer in range(layers):  # every reply in before the next step (S1)
                    worker.wait_for_layer_send(layer, 10.0)
            replies = worker.round_trips()[WARMUP_STEPS * layers:]
        finally:
            worker.close()
    if len(replies) != steps * layers:
        raise SystemExit(f"{len(replies)} replies to {steps * layers} READYs")
    ms = 1e3
    return {"begin_layer_ms": statistics.median(begin) * ms,
            "layer_written_ms": statistics.median(written) * ms,
            "step_overhead_ms": statistics.median(overhead) * ms,
            "ready_to_reply_ms": statistics.median(replies) * ms,
            "steps": steps, "layers": layers}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--compute-ms", type=float, default=1.5)
    p.add_argument("--core", type=int, default=0)
    args = p.parse_args()
    os.sched_setaffinity(0, {args.core})  # the sender thread inherits it, as in vLLM
    print(json.dumps(measure(args.steps, args.layers, args.compute_ms / 1e3)))


if __name__ == "__main__":
    main()
