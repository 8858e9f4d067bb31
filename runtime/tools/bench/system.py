"""``sfa-rd2h bench``: the runtime as a whole against the floors a user compares it with.

Each benchmark here runs the real workers in two processes (the peers are
``bench.peers``) next to the bare equivalent in two processes, interleaved block by block
(ABBA) in one run, as the micro benchmarks in ``bench.micro`` are:

* control-plane round trip of a zero-block layer vs a bare DEALER/ROUTER msgpack echo;
* Prefill CPU per layer (64 requests x 8 endpoints, and 1, 2, 4 for the chart) vs msgpack
  encode + send + receive;
* CPU of an idle Prefill + Decode pair;
* the share of control-plane CPU spent in the machines (profiled with each thread's CPU
  clock, in both processes);
* pipeline efficiency: a 256 MiB, 32-layer prompt through the runtime vs one batched read;
* transfer-engine reads between processes vs an in-process copy, by size.
"""

from __future__ import annotations

import json
import os
import pstats
import selectors
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import msgpack
import numpy as np
import zmq

from sfa_rd2h.runtime.tools.bench import peers
from sfa_rd2h.runtime.tools.bench.common import BenchError, Result, Sizes, abba, compare, pct
from sfa_rd2h.spec import wire
from sfa_rd2h.spec.layout import DestLayout, plan_layer_reads

_TIMEOUT = 60.0


class Peer:
    """A ``bench.peers`` process: its announcement, then one JSON answer per command."""

    def __init__(self, *args: str, timeout: float = _TIMEOUT) -> None:
        cmd = [sys.executable, "-m", "sfa_rd2h.runtime.tools.bench.peers", *args]
        self._err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, text=True)
        self.timeout = timeout
        self.info = self._line()

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(self.timeout):
                raise BenchError(f"bench peer {self.proc.args[3]} said nothing within "
                                 f"{self.timeout:g}s{self._stderr()}")
        line = self.proc.stdout.readline()
        if not line:
            raise BenchError(f"bench peer {self.proc.args[3]} exited{self._stderr()}")
        return json.loads(line)

    def _stderr(self) -> str:
        self._err.seek(0)
        tail = self._err.read()[-2000:]
        return f": {tail}" if tail else ""

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._line()

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()  # end of commands: the peer shuts down
        try:
            self.proc.wait(self.timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._err.close()


@contextmanager
def running(*args: str) -> Iterator[Peer]:
    peer = Peer(*args)
    try:
        yield peer
    finally:
        peer.close()


def announcement(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    """The probe owner's first stdout line (its session and buffer address), bounded wait."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise BenchError(f"probe owner announced nothing within {timeout:g}s")
    line = proc.stdout.readline()
    try:
        return json.loads(line)
    except ValueError:
        raise BenchError(f"probe owner announced {line!r}, not JSON") from None


def _params(port: int) -> dict[str, Any]:
    return {"remote_host": "127.0.0.1", "remote_port": port, "remote_tp_size": 1}


# ----------------------------------------------------------------------------- 1. round trip

_RTT_LAYER = "model.layers.0.self_attn.attn"
_RTT_SRC = wire.LayerMeta((0x7F00_0000_0000, 0x7F10_0000_0000), (4096, 4096), (1, 1), (0, 0),
                          2, False)
_RTT_DST = DestLayout((0x7E00_0000_0000, 0x7E10_0000_0000), (4096, 4096), (16, 16), 2, False,
                      False)


class RttPrefill:
    """A Prefill worker publishing one zero-block layer per round: a fresh request whose
    final chunk completed no block, so its READY carries only the done id (no read)."""

    def __init__(self, decode_port: int) -> None:
        from sfa_rd2h.runtime.control import PrefillWorker
        from sfa_rd2h.spec.topology import tp_mapping
        from sfa_rd2h.statemachines.cores.prefill import PrefillCore

        self.core = PrefillCore(0, tp_mapping(1, 1), "127.0.0.1:1", {_RTT_LAYER: _RTT_SRC})
        self.worker = PrefillWorker(self.core)
        self.params = _params(decode_port)
        self.n = 0

    def round(self) -> None:
        w = self.worker
        ext = f"rtt-{self.n:08d}"
        self.n += 1
        w.add_request(ext, self.params, (), ())
        w.schedule_chunk(ext, 0, True)
        w.wait_for_layer_send(0, _TIMEOUT)  # S1: the previous round's reply came back
        w.begin_layer(0)
        w.layer_written(0, None)

    def rounds(self, n: int) -> list[float]:
        self.worker.stats.round_trips.clear()
        for _ in range(n):
            self.round()
        self.worker.wait_for_layer_send(0, _TIMEOUT)
        got = self.worker.round_trips()
        if len(got) != n:
            raise BenchError(f"control_rtt: {len(got)} replies to {n} READYs")
        return got

    def close(self) -> None:
        self.worker.close()


def _rtt_frames() -> tuple[bytes, bytes]:
    """The READY a round sends (for an id of the same length) and the READ_DONE it gets."""
    ready = wire.ReadReadyBatch(0, _RTT_LAYER, (), ("rtt-00000000",), 0, 1)
    return wire.encode(ready), wire.encode(wire.ReadDone(0))


class BareClient:
    """The floor: one DEALER, a pre-encoded frame out, a reply in, nothing else."""

    def __init__(self, ctx: zmq.Context, port: int) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def rounds(self, frame: bytes, n: int) -> list[float]:
        send, recv, clock = self.sock.send, self.sock.recv, time.monotonic
        out = []
        for _ in range(n):
            send(frame)
            t0 = clock()  # where the runtime stamps it: after the send returned
            recv()
            out.append(clock() - t0)
        return out


def bench_control(sizes: Sizes) -> list[Result]:
    """Round trip p50/p99, then idle CPU of the same pair (and of the bare pair)."""
    dst = {_RTT_LAYER: asdict(_RTT_DST)}
    ready, done = _rtt_frames()
    fields = (wire.READ_READY_BATCH, 0, _RTT_LAYER, (), ("rtt-00000000",), 0, 1)
    if msgpack.packb(fields) != ready or msgpack.packb((wire.READ_DONE, 0)) != done:
        raise BenchError("control_rtt: bare msgpack frames differ from the runtime's")
    ctx = zmq.Context()
    with running("decode", "--layers", json.dumps(dst)) as decode, running("echo") as echo:
        prefill = RttPrefill(decode.info["port"])
        bare = BareClient(ctx, echo.info["ports"][0])
        try:
            prefill.rounds(20)  # handshake and warm-up, not timed
            bare.rounds(ready, 20)
            if decode.ask(cmd="cpu")["replies"]["done"] != 20:
                raise BenchError("control_rtt: Decode did not answer READ_DONE to each round")
            block = max(10, sizes.rtt_rounds // 10)
            proj, base = abba([lambda: prefill.rounds(block), lambda: bare.rounds(ready, block)],
                               max(2, sizes.rtt_rounds // block))
            idle = _idle(sizes.idle_s, decode, echo)
        finally:
            prefill.close()
            bare.sock.close()
            ctx.term()
    p50, b50 = statistics.median(proj), statistics.median(base)
    p99, b99 = pct(proj, 0.99), pct(base, 0.99)
    what = (f"zero-block layer, READY sent -> READ_DONE received, Prefill and Decode workers in "
            f"two processes; vs bare DEALER/ROUTER msgpack echo ({len(proj)} samples each)")
    info = {"verified": True, "samples": [len(proj), len(base)], "ready_bytes": len(ready),
            "p50_us": [p50 * 1e6, b50 * 1e6], "p99_us": [p99 * 1e6, b99 * 1e6],
            "repeat": len(proj), "loops": [1, 1],
            "baseline": "pyzmq DEALER send / ROUTER recv, msgpack unpack+pack, send back"}
    return [Result("control_rtt_p50", p50, b50, "us/rtt", 1e6, what, info),
            Result("control_rtt_p99", p99, b99, "us/rtt", 1e6, "p99 of the same samples",
                   dict(info)),
            idle]


def _idle(window: float, decode: Peer, echo: Peer) -> Result:
    """CPU of the connected, idle pair (this process's Prefill worker and the Decode peer)
    over ``window`` seconds; nothing may poll."""
    p0, d0, e0 = time.process_time(), decode.ask(cmd="cpu")["cpu"], echo.ask(cmd="cpu")["cpu"]
    t0 = time.monotonic()
    time.sleep(window)
    wall = time.monotonic() - t0
    p1, d1, e1 = time.process_time(), decode.ask(cmd="cpu")["cpu"], echo.ask(cmd="cpu")["cpu"]
    cpu = (p1 - p0) + (d1 - d0)
    return Result(
        "idle_cpu", cpu, wall, "ms", 1e3,
        f"CPU of a connected idle Prefill + Decode pair over {wall:.1f}s; ratio = fraction "
        "of one core",
        {"verified": True, "prefill_cpu_s": p1 - p0, "decode_cpu_s": d1 - d0,
         "bare_echo_cpu_s": e1 - e0, "window_s": wall, "repeat": 1, "loops": [1, 1],
         "baseline": "the window's wall time (one core fully busy)"})


# ----------------------------------------------------------------------------- 2. per layer

LAYER_REQUESTS = 64
LAYER_ENDPOINTS = 8
LAYER_BLOCKS = 32
LAYER_LAYERS = 32  # a 32-layer model: request admission is amortized over a real depth
_BLOCK_TOKENS = 128
_LAYER_BYTES = (512 << 10, 512 << 10, 8 << 10, 256)


def _layer_metas() -> dict[str, wire.LayerMeta]:
    return {f"model.layers.{i}.self_attn.attn": wire.LayerMeta(
        tuple(0x7F00_0000_0000 + (i << 40) + (t << 36) for t in range(4)), _LAYER_BYTES,
        (1,) * 4, (0, 0, 1, 1), 2, True) for i in range(LAYER_LAYERS)}


def _layer_requests(endpoints: int = LAYER_ENDPOINTS,
                    seed: int = 5) -> list[tuple[str, int, list[int], list[int]]]:
    """(ext id, endpoint index, main ids, indexer ids) of one step's requests, dealt round
    robin over ``endpoints`` (the ids do not depend on the endpoint count)."""
    rng = np.random.default_rng(seed)
    return [(f"req-{i:05d}", i % endpoints,
             rng.permutation(1 << 16)[:LAYER_BLOCKS].tolist(),
             rng.permutation(1 << 16)[:LAYER_BLOCKS].tolist()) for i in range(LAYER_REQUESTS)]


def _bare_layer_fields(reqs: list[tuple[str, int, list[int], list[int]]], names: list[str],
                       endpoints: int = LAYER_ENDPOINTS) -> list[list[tuple[Any, ...]]]:
    """Per layer, per endpoint, the READY fields written out as plain tuples (no wire code):
    every request's full lists, and on the last layer the ids of the finished requests."""
    out = []
    for layer, name in enumerate(names):
        last = layer == len(names) - 1
        row = []
        for ep in range(endpoints):
            mine = [r for r in reqs if r[1] == ep]
            entries = tuple((ext, tuple(m), tuple(x), 0, 0) for ext, _, m, x in mine)
            done = tuple(ext for ext, *_ in mine) if last else ()
            row.append((wire.READ_READY_BATCH, layer, name, entries, done, 0, 1))
        out.append(row)
    return out


def _verify_layer_frames(ports: list[int], reqs: list[tuple[str, int, list[int], list[int]]],
                         fields: list[list[tuple[Any, ...]]]) -> None:
    """The READYs a Prefill core publishes for the step are the bare side's bytes."""
    from sfa_rd2h.spec.topology import tp_mapping
    from sfa_rd2h.statemachines.cores.actions import Send
    from sfa_rd2h.statemachines.cores.prefill import PrefillCore

    core = PrefillCore(0, tp_mapping(1, 1), "127.0.0.1:1", _layer_metas(),
                       block_size=_BLOCK_TOKENS)
    eps = [f"127.0.0.1:{p}" for p in ports]
    for ext, ep, m, x in reqs:
        core.add_request(ext, _params(ports[ep]), m, x)
        core.schedule_chunk(ext, LAYER_BLOCKS * _BLOCK_TOKENS, True)
    for layer in range(LAYER_LAYERS):
        core.begin_layer(layer, 0.0)
        sent = core.layer_landed(layer, 0.0)
        if layer == 0:  # the handshake first: acknowledge it and take the held READYs
            sent = []
            for ep in eps:
                ack = wire.encode(wire.MfMetaAck(True, wire.PROTOCOL_VERSION))
                sent += core.on_frame(ep, ack, 0.0)
        got = {a.peer: a.payload for a in sent if isinstance(a, Send)}
        for k, ep in enumerate(eps):
            if got.get(ep) != msgpack.packb(fields[layer][k]):
                raise BenchError(f"prefill_layer_cpu: layer {layer} READY to {ep} differs "
                                 "from the bare frame")


def bench_prefill_layer(sizes: Sizes) -> list[Result]:
    """Prefill process CPU per layer at each endpoint count of the sweep, against one echo
    peer: ``prefill_layer_cpu`` at 8 endpoints (the figure), ``prefill_layer_cpu_<N>ep`` at
    the others."""
    counts = sorted({*sizes.endpoints, LAYER_ENDPOINTS})
    with running("echo", "--sockets", str(counts[-1])) as echo:
        ports = echo.info["ports"]
        out = []
        for k in counts:
            proj, base = _prefill_layer(sizes, ports[:k])
            out.append(_prefill_layer_row(sizes, k, proj, base))
    return out


def profile_prefill_layer(sizes: Sizes) -> pstats.Stats:
    """The runtime side of the 8-endpoint per-layer workload alone, under the thread
    profiler (for the machine share)."""
    with running("echo", "--sockets", str(LAYER_ENDPOINTS)) as echo:
        prof = peers.ThreadProfiles()
        prof.start()
        try:
            _prefill_layer(sizes, echo.info["ports"], prof)
        except BaseException:
            prof.stop()
            raise
    stats = pstats.Stats(prof.profiles[0])
    for p in prof.profiles[1:]:
        stats.add(p)
    return stats


def _prefill_layer(sizes: Sizes, ports: list[int],
                   prof: peers.ThreadProfiles | None = None) -> tuple[list[float], list[float]]:
    """Per-layer CPU samples (runtime, bare) with one Decode endpoint per port; with
    ``prof`` (started) only the runtime side runs, ``prof`` is stopped before the worker
    closes, and no samples come back."""
    from sfa_rd2h.runtime.control import PrefillWorker
    from sfa_rd2h.spec.topology import tp_mapping
    from sfa_rd2h.statemachines.cores.prefill import PrefillCore

    n_ep = len(ports)
    reqs = _layer_requests(n_ep)
    names = list(_layer_metas())
    fields = _bare_layer_fields(reqs, names, n_ep)
    if prof is None:
        _verify_layer_frames(ports, reqs, fields)
    core = PrefillCore(0, tp_mapping(1, 1), "127.0.0.1:1", _layer_metas(),
                       block_size=_BLOCK_TOKENS)
    worker = PrefillWorker(core)
    ctx = zmq.Context()
    socks = []
    for p in ports:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{p}")
        socks.append(s)
    params = [_params(p) for p in ports]
    step = [0]

    def project_step() -> None:
        n = step[0]
        step[0] += 1
        for ext, ep, m, x in reqs:
            worker.add_request(f"{ext}.{n}", params[ep], m, x)
        for ext, *_ in reqs:
            worker.schedule_chunk(f"{ext}.{n}", LAYER_BLOCKS * _BLOCK_TOKENS, True)
        for layer in range(LAYER_LAYERS):
            worker.wait_for_layer_send(layer, _TIMEOUT)
            worker.begin_layer(layer)
            worker.layer_written(layer, None)

    def project(steps: int) -> list[float]:
        c0 = time.process_time()
        for _ in range(steps):
            project_step()
        errors = worker.drain(_TIMEOUT)  # every reply taken
        if errors:
            raise BenchError(f"prefill_layer_cpu: {errors[0]}")
        return [(time.process_time() - c0) / (steps * LAYER_LAYERS)]

    packb = msgpack.packb

    def baseline(steps: int) -> list[float]:
        c0 = time.process_time()
        for _ in range(steps):
            for row in fields:
                for s, f in zip(socks, row, strict=True):
                    s.send(packb(f))
                for s in socks:
                    s.recv()
        return [(time.process_time() - c0) / (steps * LAYER_LAYERS)]

    try:
        project(1)  # handshakes, warm-up
        baseline(1)
        if prof is not None:
            project(sizes.layer_steps * sizes.layer_repeat)
            prof.stop()
            return [], []
        proj, base = abba([lambda: project(sizes.layer_steps),
                            lambda: baseline(sizes.layer_steps)], sizes.layer_repeat)
    finally:
        worker.close()
        for s in socks:
            s.close()
        ctx.term()
    return proj, base


def _prefill_layer_row(sizes: Sizes, endpoints: int, proj: list[float],
                       base: list[float]) -> Result:
    med, bmed = statistics.median(proj), statistics.median(base)
    name = "prefill_layer_cpu" if endpoints == LAYER_ENDPOINTS else \
        f"prefill_layer_cpu_{endpoints}ep"
    return Result(
        name, med, bmed, "us/layer", 1e6,
        f"Prefill process CPU per layer, {LAYER_REQUESTS} req x {LAYER_BLOCKS} blocks to "
        f"{endpoints} Decode endpoints; vs msgpack.packb + send of the same "
        f"{endpoints} frames and {endpoints} replies",
        {"verified": True, "requests": LAYER_REQUESTS, "endpoints": endpoints,
         "layers": LAYER_LAYERS, "repeat": len(proj), "loops": [sizes.layer_steps] * 2,
         "spread": [round((max(proj) - min(proj)) / med, 3),
                    round((max(base) - min(base)) / bmed, 3)],
         "baseline": f"bare DEALERs: packb + send {endpoints} READYs, recv {endpoints} "
                     "replies, per layer"})


# ----------------------------------------------------------------------------- 3. machines

# What "machine dispatch and bookkeeping" is: everything under the Driver's entry points
# (the transitions engine, guards and effects included).
_MACHINE_ENTRIES = ("fire", "start", "can", "allowed")


def machine_time(stats: pstats.Stats) -> tuple[float, float]:
    """(seconds under the machine Driver, total profiled seconds) of ``stats``."""
    total = 0.0
    machine = 0.0
    for (path, _line, func), (_cc, _nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        total += tt
        if path.endswith(os.path.join("statemachines", "engine.py")) and \
                func in _MACHINE_ENTRIES:
            machine += ct
    return machine, total


def bench_machine_share(sizes: Sizes) -> Result:
    """Profile the round trip (both processes) and the per-layer workload; share of the
    profiled control-plane CPU spent in machine dispatch."""
    dst = {_RTT_LAYER: asdict(_RTT_DST)}
    with tempfile.TemporaryDirectory(prefix="sfa-rd2h-bench-") as tmp:
        dump = os.path.join(tmp, "decode.prof")
        with running("decode", "--layers", json.dumps(dst), "--profile", dump) as decode:
            prof = peers.ThreadProfiles()
            prof.start()
            prefill = RttPrefill(decode.info["port"])
            try:
                prefill.rounds(sizes.rtt_rounds)
            finally:
                prefill.close()
                prof.stop()
        rtt = pstats.Stats(prof.profiles[0])
        for p in prof.profiles[1:]:
            rtt.add(p)
        rtt_d = pstats.Stats(dump)
    layer = profile_prefill_layer(sizes)
    parts = {"rtt_prefill": machine_time(rtt), "rtt_decode": machine_time(rtt_d),
             "prefill_layer": machine_time(layer)}
    machine = sum(m for m, _ in parts.values())
    total = sum(t for _, t in parts.values())
    return Result(
        "machine_share", machine, total, "ms", 1e3,
        "CPU under Driver.fire/start/can (transitions, guards, effects) / all profiled "
        "control-plane CPU: round trip (both processes) + per-layer Prefill",
        {"verified": True, "repeat": 1, "loops": [1, 1],
         "parts": {k: {"machine_s": m, "total_s": t, "share": m / t if t else 0.0}
                   for k, (m, t) in parts.items()},
         "baseline": "all profiled CPU (cProfile with each thread's CPU clock)"})


# ----------------------------------------------------------------------------- 5. data plane

READ_CASES = (("64KiB", 64 << 10, 1), ("2MiB", 2 << 20, 1), ("32MiB", 32 << 20, 1),
              ("1000x16KiB", 16 << 10, 1000))


def bench_reads(sizes: Sizes, engine: str) -> list[Result]:
    """Reads from a probe owner process at each size vs ``numpy.copyto`` of as many bytes
    within this process (single-threaded, the memcpy floor)."""
    from sfa_rd2h.runtime.engines import make_engine
    from sfa_rd2h.runtime.tools.probe import ProbeBuffer, pattern

    owner_bytes = 32 << 20
    cmd = ["--role", "prefill", "--engine", engine, "--bytes", str(owner_bytes),
           "--timeout", str(_TIMEOUT), "--json"]
    proc = subprocess.Popen([sys.executable, "-m", "sfa_rd2h.runtime.tools.probe", *cmd],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    results: list[Result] = []
    try:
        info = announcement(proc, _TIMEOUT)
        eng = make_engine(engine)
        try:
            eng.initialize("127.0.0.1", 0)
            dest = ProbeBuffer(eng, owner_bytes, "cpu")
            source = pattern(owner_bytes, int(info["seed"]))
            copy_dst = np.empty(owner_bytes, dtype=np.uint8)
            copy_dst.fill(0)
            session, peer_base = str(info["session"]), int(info["addr"])
            mode = getattr(eng, "mode", engine)
            for label, block, count in READ_CASES:
                nbytes = block * count
                if count == 1:
                    offs = np.zeros(1, dtype=np.uint64)
                else:  # scattered: every other 16 KiB block of the buffer, shuffled
                    offs = np.random.default_rng(7).permutation(owner_bytes // block)[:count]
                    offs = offs.astype(np.uint64) * np.uint64(block)
                lengths = np.full(count, block, dtype=np.uint64)
                local = np.uint64(dest.addr) + offs
                remote = np.uint64(peer_base) + offs

                def read(local: np.ndarray = local, remote: np.ndarray = remote,
                         lengths: np.ndarray = lengths) -> None:
                    ret = eng.batch_transfer_sync_read(session, local, remote, lengths)
                    if ret != 0:
                        raise BenchError(f"{engine} read returned {ret}: {eng.last_error}")

                src_view, dst_view = source[:nbytes], copy_dst[:nbytes]
                dest.clear()
                read()
                rows = (offs // np.uint64(block)).astype(np.int64)
                got = dest.read_back().reshape(-1, block)[rows]
                if not np.array_equal(got, source.reshape(-1, block)[rows]):
                    raise BenchError(f"{engine}_read_{label}: bytes read differ from the owner's")
                med, base, cmp_info = compare(read, lambda s=src_view, d=dst_view: np.copyto(d, s),
                                              sizes.read_repeat, sizes.sample_s)
                results.append(Result(
                    f"{engine}_read_{label}", med, base, "us/read", 1e6,
                    f"{label} from another process ({mode}): {nbytes / med / 1e9:.2f} GB/s; "
                    f"numpy.copyto {nbytes / base / 1e9:.2f} GB/s; throughput ratio "
                    f"{base / med:.2f}",
                    {"verified": True, "bytes": nbytes, "descriptors": count, "mode": mode,
                     "engine": engine, "project_gbps": nbytes / med / 1e9,
                     "baseline_gbps": nbytes / base / 1e9, "throughput_ratio": base / med,
                     "baseline": "numpy.copyto of as many contiguous bytes in-process",
                     **cmp_info}))
        finally:
            eng.close()
    finally:
        proc.kill()  # the owner waits for a reader's report; it has nothing else to do
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    return results


# ----------------------------------------------------------------------------- 6. pipeline


def bench_pipeline(sizes: Sizes) -> Result:
    """A 1 P : 1 D pair moving a 32-layer, 256 MiB prompt through the runtime (READY per
    layer, one batched read per layer, READ_DONE) vs the host engine reading the same
    descriptors in one batch, both in this (Decode) process from the Prefill peer."""
    from sfa_rd2h.runtime.control import DecodeWorker
    from sfa_rd2h.runtime.engines import make_engine
    from sfa_rd2h.runtime.tools.probe import ProbeBuffer, pattern
    from sfa_rd2h.statemachines.cores.decode import DecodeCore

    total = peers.pipe_total_bytes()
    tb = peers.pipe_tensor_bytes() // peers.PIPE_BLOCKS
    ids = np.arange(peers.PIPE_BLOCKS, dtype=np.int64)
    with running("prefill") as prefill:
        eng = make_engine("host")
        try:
            eng.initialize("127.0.0.1", 0)
            dest = ProbeBuffer(eng, total, "cpu")
            dest.clear()
            dsts = {peers.pipe_layer_name(i): DestLayout(b, (tb,) * 2, (peers.PIPE_BLOCKS,) * 2,
                                                          2, False, False)
                    for i, b in enumerate(peers.pipe_bases(dest.addr))}
            core = DecodeCore(0, 1, dsts)
            ready: dict[str, threading.Event] = {}
            worker = DecodeWorker(core, eng, 0, on_ready=lambda r: ready[r.ext_req_id].set())
            n = [0]

            def project() -> float:
                ext = f"pipe-{n[0]:06d}"
                n[0] += 1
                ready[ext] = threading.Event()
                worker.register_request(ext, ids, ids[:0])
                t0 = time.perf_counter()
                prefill.send(cmd="run", ext=ext, params=_params(worker.port))
                if not ready[ext].wait(_TIMEOUT):
                    raise BenchError("pipeline: the request never completed on Decode")
                dt = time.perf_counter() - t0
                [fin] = worker.apply_agreement(ext, True)
                reply = prefill._line()
                if not fin.ok or reply.get("errors"):
                    raise BenchError(f"pipeline: {fin.error or reply.get('errors')}")
                return dt

            expected = pattern(total, peers.PIPE_SEED)
            project()
            if not np.array_equal(dest.read_back(), expected):
                raise BenchError("pipeline: bytes landed by the runtime differ from Prefill's")
            session = str(prefill.info["session"])
            meta = next(iter(core.connections.values()))
            plans = [plan_layer_reads(meta.layers[name], dsts[name], ids, ids, ids[:0], ids[:0])
                     for name in dsts]
            local = np.concatenate([p.local_addrs for p in plans])
            peer = np.concatenate([p.peer_addrs for p in plans])
            lengths = np.concatenate([p.lengths for p in plans])

            def batch() -> float:
                t0 = time.perf_counter()
                ret = eng.batch_transfer_sync_read(session, local, peer, lengths)
                dt = time.perf_counter() - t0
                if ret != 0:
                    raise BenchError(f"pipeline baseline read returned {ret}: {eng.last_error}")
                return dt

            dest.clear()
            batch()
            if not np.array_equal(dest.read_back(), expected):
                raise BenchError("pipeline: bytes of the one-batch read differ from Prefill's")
            proj, base = abba([lambda: [project()], lambda: [batch()]], sizes.pipe_repeat)
            worker.close()
        finally:
            eng.close()
    med, bmed = statistics.median(proj), statistics.median(base)
    return Result(
        "pipeline", med, bmed, "ms/prompt", 1e3,
        f"1P:1D, {peers.PIPE_LAYERS} layers x {peers.pipe_tensor_bytes() * 2 >> 20} MiB "
        f"({total >> 20} MiB) through the runtime, request registered -> ready: "
        f"{total / med / 1e9:.2f} GB/s; host engine, same descriptors in one batch: "
        f"{total / bmed / 1e9:.2f} GB/s",
        {"verified": True, "bytes": total, "layers": peers.PIPE_LAYERS,
         "descriptors": int(lengths.size), "efficiency": bmed / med, "repeat": len(proj),
         "loops": [1, 1], "spread": [round((max(proj) - min(proj)) / med, 3),
                                     round((max(base) - min(base)) / bmed, 3)],
         "baseline": "one batch_transfer_sync_read of all 32 layers' descriptors"})
