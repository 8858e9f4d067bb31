"""``sfa-rd2h demo``: a whole P/D deployment on one machine, as separate OS processes.

The parent starts a real HTTP proxy/metaserver (``ProxyServer``), ``d_tp`` Decode rank
processes and ``p_tp`` Prefill rank processes, submits the workload, shows a progress bar,
and reports. It is the protocol of ``model_check.cluster`` on real processes, with the same
data model: ``pattern(req, layer, pos, tensor, nbytes)`` bytes per block, layers on a ring of
physical slots (layer ``l`` -> slot ``l % slots``), ``LayerMeta`` / ``DestLayout`` built the
same way, main KV in a Decode pool shared by the TP ranks, indexer/LIC8 scale rank-local.

Processes and what stands in for vLLM:

* **Decode rank 0** is the scheduler: it long-polls the proxy for decode work, allocates the
  main destination blocks in the shared pool (a ``/dev/shm`` file every Decode rank maps),
  sends them to the other Decode ranks (vLLM broadcasts scheduler output to its workers; here
  a pipe), registers its own destinations and posts the rendezvous (C1; ``remote_port`` is the
  Decode base port, P1/P2). Every rank allocates its own indexer blocks and registers.
* **Prefill rank 0** is the scheduler: it long-polls for prefill work (a prompt list arrives
  once every sub-request has its rendezvous, C3), allocates source blocks and forms steps of
  chunked prefill (each active request advances by ``chunk_tokens`` per step). Every Prefill
  rank runs the same steps. KV caches are ordinary torch CPU tensors registered with the
  engine by address; per layer a rank waits for the slot (S1), writes the pattern bytes of
  every block of the step, and queues the send with its device event (C4; CPU: none).
* Decode ranks agree on terminal status over a real process group (gloo on loopback for
  ``d_tp > 1``) once per round (R1, R2), then each rank verifies every destination byte of
  every successful request against the pattern.

The ranks are forked from a multiprocessing fork server that imported torch once (a clean,
single-threaded process, never this multi-threaded parent), so six ranks start in about a
second instead of each paying torch's import. The parent enforces one overall timeout (on
expiry it stops the children - SIGTERM so they close their engines and traces, SIGKILL after
a grace period - and says what was stuck), validates every process's trace with
``trace.validate`` and prints a summary. ``seconds``/``gbps`` cover submission to the last
request's terminal state (KV "compute" on Prefill included); start-up and verification are
reported separately (``startup_seconds``, ``wall_seconds``).

Injections and what they predict (the exit code is 0 only when the outcome matches):

* ``read-failure``: on Decode rank 0, every batched read of layer ``layers // 2`` that writes
  into the destinations of one victim request (a single-chunk request, the first prompt of
  the prompt list) fails, as a transfer error would (F2). Such a READY is answered
  READ_FAILED, and a failed READY fails every request it carries, so exactly the requests of
  the victim's prefill step fail - on every Decode rank (R5, R2) - and the Prefill ranks
  observe a gate error (S4). Every other request succeeds, byte-exact. The victim's job is
  submitted once every other request has finished, so that step holds the victim's job only
  (with everything in one step the prediction would still hold, but show little).
* ``layout-mismatch``: the last Decode rank registers layer ``layers // 2`` with twice the
  main block size. Every READY of that layer on that rank fails validation (L1), so every
  request - they all span every layer - fails on every rank, Prefill observes gate errors,
  and nothing hangs.
* ``stale-kv``: every Prefill rank publishes layer ``layers // 2`` of the victim request
  without writing it - known failure 4, READY before the data is there - so Decode pulls
  whatever the slot held before. The protocol cannot see this; the byte verification must.
  The run passes when every request completes and the mismatches are exactly the victim's
  blocks of that layer, reported by every Decode rank (``verified`` is then false).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import mmap
import multiprocessing as mp
import os
import queue
import secrets
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from sfa_rd2h.runtime.engines.base import (
    ENGINE_NAMES,
    EngineError,
    TransferEngine,
    TransferResult,
    make_engine,
)
from sfa_rd2h.spec.errors import ProtocolError
from sfa_rd2h.spec.topology import decode_base_port, decode_rank_port, tp_mapping

log = logging.getLogger("sfa_rd2h.demo")

INJECTIONS = ("none", "read-failure", "layout-mismatch", "stale-kv")
# Bytes per token of each tensor, in wire order: main K and V (256 x bf16 each), the
# indexer key (128 x int8) and its LIC8 scale (one fp32 per token).
BYTES_PER_TOKEN = (512, 512, 128, 4)
_INV13 = 157  # 13 * 157 = 2041 = 8 * 255 + 1: the inverse of 13 modulo 255
_SHM_DIR = "/dev/shm"


class DemoConfigError(ValueError):
    """The requested deployment is invalid; the message names the rule."""


# ============================================================================ data model


def tensor_bytes(block_tokens: int, indexer: bool, scale: bool) -> tuple[int, ...]:
    """Block bytes per tensor, main K and V first, then indexer and LIC8 scale (W1 order)."""
    n = 2 + int(indexer) + int(indexer and scale)
    return tuple(b * block_tokens for b in BYTES_PER_TOKEN[:n])


class Patterns:
    """``model_check.cluster.pattern`` for one tensor size, vectorised.

    ``pattern(seed)[k] = (13 k + seed) % 255 + 1``, and ``13 j = seed (mod 255)`` for
    ``j = 157 seed``, so every block pattern is the window ``tape[j : j + nbytes]`` of one
    tape: producing or checking a batch of blocks is a gather of rows, not arithmetic.
    """

    def __init__(self, nbytes: int) -> None:
        tape = ((np.arange(nbytes + 254, dtype=np.int64) * 13) % 255 + 1).astype(np.uint8)
        self.windows = sliding_window_view(tape, nbytes)

    def blocks(self, req: int, layer: int, pos: np.ndarray, tensor: int) -> np.ndarray:
        """``(len(pos), nbytes)`` pattern bytes of blocks ``pos`` of one request and layer."""
        seed = (req * 61 + layer * 17 + np.asarray(pos, dtype=np.int64) * 7 + tensor * 3
                + 1) % 251
        return self.windows[(seed * _INV13) % 255]


def n_blocks(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens)


# ============================================================================ configuration


@dataclass
class DemoConfig:
    p_tp: int = 4
    d_tp: int = 2
    layers: int = 8
    slots: int = 3
    requests: int = 16
    indexer: bool = True
    scale: bool = True
    engine: str = "host"
    host_mode: str = "auto"  # host engine: cma, shm, or auto (cma where permitted)
    inject: str = "none"
    timeout: float = 120.0
    kv_port: int | None = None  # Decode base port; None: a free span is picked
    trace_dir: str | None = None  # None: traces go to a temporary folder, still validated
    block_tokens: int = 128
    chunk_tokens: int = 512
    max_tokens: int = 2048
    host: str = "127.0.0.1"
    seed: int = 0
    progress: bool = True

    @property
    def inject_layer(self) -> int:
        return self.layers // 2

    def check(self) -> None:
        """Validate before anything starts; errors name the rule they enforce."""
        try:
            tp_mapping(self.p_tp, self.d_tp)
            if self.kv_port is not None:
                decode_base_port(self.kv_port, 0, self.d_tp)
        except ProtocolError as exc:
            raise DemoConfigError(str(exc)) from None
        if self.engine not in ENGINE_NAMES:
            raise DemoConfigError(f"unknown engine {self.engine!r}; known: {ENGINE_NAMES}")
        if self.inject not in INJECTIONS:
            raise DemoConfigError(f"unknown injection {self.inject!r}; known: {INJECTIONS}")
        for name, lo in (("layers", 1), ("slots", 1), ("requests", 1), ("block_tokens", 1)):
            if getattr(self, name) < lo:
                raise DemoConfigError(f"--{name.replace('_', '-')} must be >= {lo}")
        if self.chunk_tokens < self.block_tokens or self.chunk_tokens % self.block_tokens:
            raise DemoConfigError("C2: --chunk-tokens must be a positive multiple of "
                                  "--block-tokens (non-final chunks end on block boundaries)")
        if self.max_tokens < self.block_tokens:
            raise DemoConfigError("--max-tokens must be >= --block-tokens")
        if not self.timeout > 0:
            raise DemoConfigError("--timeout must be > 0")
        if self.inject != "none" and self.layers < 2:
            raise DemoConfigError("an injection needs at least 2 layers")
        if self.inject == "read-failure":
            victim_blocks = min(self.chunk_tokens, self.max_tokens) // self.block_tokens
            if not self.indexer and victim_blocks < self.d_tp:
                raise DemoConfigError(
                    f"T5: read-failure without an indexer needs a victim chunk of at least "
                    f"d_tp={self.d_tp} blocks so Decode rank 0 pulls part of it")


@dataclass
class Workload:
    jobs: list[tuple[str, list[str]]]  # (job id, prompts); one job is a prompt list (C3)
    index: dict[str, int]  # external request id -> pattern request index
    tokens: dict[str, int]
    victim: str | None  # read-failure: the request whose reads fail

    @property
    def ids(self) -> list[str]:
        return list(self.index)


def make_workload(cfg: DemoConfig) -> Workload:
    rng = np.random.default_rng(cfg.seed)
    lengths = [int(x) for x in rng.integers(cfg.block_tokens // 2 + 1, cfg.max_tokens + 1,
                                            size=cfg.requests)]
    n_list = min(4, cfg.requests // 2) if cfg.requests >= 4 else 0
    # The victim is the first prompt of the list (C3) when there is one: the list reaches
    # Prefill later than the single prompts, so its step mixes it with requests already
    # under way; otherwise the second request.
    singles = cfg.requests - n_list
    victim_i = singles if n_list else min(1, cfg.requests - 1)
    if cfg.inject == "read-failure":
        lengths[victim_i] = min(cfg.chunk_tokens, cfg.max_tokens)  # exactly one step (C2)
    filler = "the quick brown fox jumps over the lazy dog; " * (cfg.max_tokens // 40 + 2)
    prompts = [(f"[{i}] " + filler)[:n] for i, n in enumerate(lengths)]
    jobs: list[tuple[str, list[str]]] = []
    for i in range(singles):
        jobs.append((f"demo{i}", [prompts[i]]))
    if n_list:
        jobs.append((f"demo{singles}", prompts[singles:]))
    index: dict[str, int] = {}
    tokens: dict[str, int] = {}
    i = 0
    for job_id, ps in jobs:
        for k, p in enumerate(ps):
            ext = f"{job_id}-{k}"  # the proxy's sub-request ids
            index[ext] = i
            tokens[ext] = len(p.encode())  # the proxy's stand-in tokenizer
            i += 1
    victim = list(index)[victim_i] if cfg.inject in ("read-failure", "stale-kv") else None
    return Workload(jobs, index, tokens, victim)


def _engine_kwargs(cfg: DemoConfig, role: str) -> dict[str, Any]:
    if cfg.engine == "memfabric":
        return {"role": role}
    if cfg.engine == "host":
        return {"mode": cfg.host_mode}
    return {}


# ============================================================================ children

# Everything a child needs, as plain data (spawned processes get it pickled).


@dataclass
class _Plan:
    cfg: DemoConfig
    index: dict[str, int]
    tokens: dict[str, int]
    victim: str | None
    p_blocks: int
    d_blocks: int
    proxy_url: str
    base_port: int
    gloo_port: int
    pool_path: str
    trace_dir: str

    @property
    def n(self) -> int:
        return len(self.index)

    @property
    def tbytes(self) -> tuple[int, ...]:
        return tensor_bytes(self.cfg.block_tokens, self.cfg.indexer, self.cfg.scale)


class _Channel:
    """The child's end of its pipe to the parent; several threads send on it."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, *msg: Any) -> None:
        with self._lock:
            self.conn.send(msg)


def _child_logging(name: str) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"[{name}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("transitions").setLevel(logging.WARNING)


def _quietly(*closers: Any) -> None:
    """Run every closer; a failing one is logged, never masks the error being unwound."""
    for close in closers:
        try:
            close()
        except Exception:  # noqa: BLE001
            log.exception("cleanup step failed")


def _tracer(plan: _Plan, name: str, **info: Any) -> Any:
    from sfa_rd2h.runtime.trace import Tracer

    return Tracer(Path(plan.trace_dir) / f"{name}.jsonl", name, **info)


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the ranks' cleanup (engines, traces)


def _child(fn: Any, name: str, plan: _Plan, rank: int, conn: Connection, *args: Any) -> None:
    """Entry point of every child: report any failure to the parent, exit non-zero."""
    # Everything imported before the fork (torch alone is ~170k objects) is permanent for
    # this process: freezing it keeps full collections from walking it mid-transfer
    # (measured: 60-180 ms pauses per rank on a 2-core box, the whole p99 round-trip tail).
    gc.freeze()
    _child_logging(name)
    signal.signal(signal.SIGTERM, _on_sigterm)
    chan = _Channel(conn)
    try:
        fn(plan, rank, chan, *args)
    except BaseException:  # noqa: BLE001 - the parent prints it and aborts the run
        try:
            chan.send("error", traceback.format_exc())
        finally:
            os._exit(1)


# ---------------------------------------------------------------------------- Prefill


class _PrefillKv:
    """Per slot, one torch CPU tensor per cache tensor, registered with the engine."""

    def __init__(self, plan: _Plan, engine: TransferEngine) -> None:
        import torch

        self.tbytes = plan.tbytes
        self.slots: list[list[np.ndarray]] = []
        self._keep: list[Any] = []
        shm_only = getattr(engine, "mode", None) == "shm"
        for _ in range(plan.cfg.slots):
            row = []
            for nbytes in self.tbytes:
                if shm_only:
                    # Fallback: a shm-mode host engine serves only memory it allocated.
                    _, arr = engine.allocate(plan.p_blocks * nbytes)  # type: ignore[attr-defined]
                    t = torch.from_numpy(arr).view(plan.p_blocks, nbytes)
                else:
                    from sfa_rd2h.runtime.engines import tensor_region

                    # zeros, as vLLM allocates its caches: every page is faulted in now, not
                    # during the first layer's scatter
                    t = torch.zeros((plan.p_blocks, nbytes), dtype=torch.uint8)
                    engine.register_memory(*tensor_region(t))
                self._keep.append(t)
                row.append(t.numpy())
            self.slots.append(row)

    def bases(self, slot: int) -> tuple[int, ...]:
        return tuple(int(a.ctypes.data) for a in self.slots[slot])


def _layer_meta(plan: _Plan, kv: _PrefillKv) -> dict[str, Any]:
    from sfa_rd2h.spec import wire

    n = len(plan.tbytes)
    return {
        f"layer.{layer}": wire.LayerMeta(kv.bases(layer % plan.cfg.slots), plan.tbytes,
                                         (1,) * n, (0, 0, 1, 1)[:n], 2, plan.cfg.indexer)
        for layer in range(plan.cfg.layers)
    }


def _prefill_fetch(plan: _Plan, out: queue.Queue, stop: threading.Event) -> None:
    """Prefill scheduler's intake: long-poll the proxy until every request arrived."""
    from sfa_rd2h.runtime.metaserver import fetch_work

    got = 0
    while got < plan.n and not stop.is_set():
        for job in fetch_work(plan.proxy_url, "prefill", "prefill-0", timeout=2.0):
            out.put(job)
            got += len(job["requests"])


def _prefill_rank(plan: _Plan, rank: int, chan: _Channel, peers: list[Connection],
                  inbox: Connection | None) -> None:
    from sfa_rd2h.runtime.control import PrefillWorker
    from sfa_rd2h.runtime.metaserver import report_finished
    from sfa_rd2h.runtime.prefill_core import LayerSendError, PrefillCore

    cfg = plan.cfg
    # Each resource is owned by the stack from the moment it exists, so a failure or a
    # SIGTERM at any point still closes the engine (its /dev/shm files) and the trace.
    with ExitStack() as stack:
        tracer = _tracer(plan, f"prefill{rank}", role="prefill", rank=rank)
        stack.callback(_quietly, tracer.close)
        engine = make_engine(cfg.engine, **_engine_kwargs(cfg, "prefill"))
        stack.callback(_quietly, engine.close)
        session = engine.initialize(cfg.host, 0)
        kv = _PrefillKv(plan, engine)
        core = PrefillCore(rank, tp_mapping(cfg.p_tp, cfg.d_tp), session, _layer_meta(plan, kv),
                           block_size=cfg.block_tokens, reply_timeout=min(30.0, cfg.timeout),
                           observer=tracer)
        worker = PrefillWorker(core, tracer=tracer)
        stack.callback(_quietly, worker.close)
        pats = [Patterns(nbytes) for nbytes in plan.tbytes]
        errors: list[str] = []
        steps: list[list[str]] = []
        timing = {"gate_wait": 0.0, "compute": 0.0}
        stale = plan.index[plan.victim] if cfg.inject == "stale-kv" and plan.victim else -1
        chan.send("ready", {"session": session})

        def run_step(step: list[tuple]) -> None:
            for ext, params, main_ids, idx_ids, _tokens, _final in step:
                if params is not None:
                    worker.add_request(ext, params, main_ids, idx_ids)
            for ext, _params, _m, _i, tokens, final in step:
                worker.schedule_chunk(ext, tokens, final)
            writes = []
            for ext, _p, main_ids, idx_ids, _t, _f in step:
                lo, hi = worker.chunk(ext) or (0, 0)
                ids = np.asarray(main_ids, dtype=np.int64)[lo:hi]
                idx = np.asarray(idx_ids, dtype=np.int64)[lo:hi]
                writes.append((plan.index[ext], np.arange(lo, hi), ids, idx))
            for layer in range(cfg.layers):
                t0 = time.perf_counter()
                try:
                    worker.wait_for_layer_send(layer, cfg.timeout)
                except LayerSendError as exc:  # S4: the slot's readers failed; it is free now
                    errors.append(str(exc))
                t1 = time.perf_counter()
                worker.begin_layer(layer)
                slot = kv.slots[layer % cfg.slots]
                for req, pos, ids, idx in writes:
                    if req == stale and layer == cfg.inject_layer:
                        continue  # --inject stale-kv: published, never written (failure 4)
                    for t, arr in enumerate(slot):
                        arr[ids if t < 2 else idx] = pats[t].blocks(req, layer, pos, t)
                worker.layer_written(layer, None)  # CPU writes landed already (C4)
                timing["gate_wait"] += t1 - t0
                timing["compute"] += time.perf_counter() - t1

        if rank == 0:
            arrivals: queue.Queue = queue.Queue()
            stop = threading.Event()
            fetcher = threading.Thread(target=_prefill_fetch, args=(plan, arrivals, stop),
                                       name="prefill-fetch", daemon=True)
            fetcher.start()
            active: list[dict[str, Any]] = []
            admitted, cursor = 0, 1  # block 0 stays unused, as vLLM's null block
            while admitted < plan.n or active:
                jobs = []
                if not active:
                    try:
                        jobs.append(arrivals.get(timeout=cfg.timeout))
                    except queue.Empty:
                        raise TimeoutError(f"prefill0: only {admitted} of {plan.n} requests "
                                           f"dispatched within {cfg.timeout:g}s") from None
                while True:
                    try:
                        jobs.append(arrivals.get_nowait())
                    except queue.Empty:
                        break
                for job in jobs:
                    for r in job["requests"]:
                        ext = r["request_id"]
                        nb = n_blocks(r["num_tokens"], cfg.block_tokens)
                        ids = list(range(cursor, cursor + nb))
                        cursor += nb
                        main = ids[::-1] if plan.index[ext] % 2 else ids  # non-contiguous
                        active.append({"ext": ext, "tokens": r["num_tokens"], "done": 0,
                                       "params": r["kv_transfer_params"], "main": main,
                                       "idx": ids})
                        admitted += 1
                step = []
                for r in active:
                    r["done"] = min(r["tokens"], r["done"] + cfg.chunk_tokens)
                    step.append((r["ext"], r.pop("params", None), r["main"], r["idx"],
                                 r["done"], r["done"] == r["tokens"]))
                for peer in peers:
                    peer.send(("step", step))
                run_step(step)
                steps.append([s[0] for s in step])
                active = [r for r in active if r["done"] < r["tokens"]]
            for peer in peers:
                peer.send(("end",))
            stop.set()
            fetcher.join(5.0)
        else:
            assert inbox is not None
            while True:
                msg = inbox.recv()
                if msg[0] == "end":
                    break
                run_step(msg[1])
        errors += worker.drain(cfg.timeout)
        if rank == 0:
            for ext in plan.index:
                report_finished(plan.proxy_url, ext, ok=True, role="prefill")
    # Closed: every READY was answered (drain), so no Decode read needs this memory any
    # more, and the parent never stops a Decode rank under a live connection.
    chan.send("report", {
        "role": "prefill", "rank": rank, "errors": errors, "steps": steps,
        "rtts": worker.round_trips(), "stale_replies": core.stale_replies,
        "frames_sent": worker.stats.frames_sent, "peers_lost": worker.stats.peers_lost,
        "gate_wait_seconds": timing["gate_wait"], "compute_seconds": timing["compute"],
    })


# ---------------------------------------------------------------------------- Decode


class _FailingReads(TransferEngine):
    """``--inject read-failure``: batched reads that write into the victim's destinations of
    one layer return a transfer error (F2); everything else goes to the real engine."""

    name = "inject-read-failure"

    def __init__(self, inner: TransferEngine) -> None:
        super().__init__()
        self.inner = inner
        self.fired = 0
        self.touched: set[str] = set()
        self._ranges: tuple[np.ndarray, np.ndarray] | None = None

    def set_victim(self, starts: np.ndarray, lengths: np.ndarray) -> None:
        self._ranges = (starts.astype(np.uint64), (starts + lengths).astype(np.uint64))

    def initialize(self, host: str = "127.0.0.1", port: int = 0) -> str:
        return self.inner.initialize(host, port)

    @property
    def session_id(self) -> str:
        return self.inner.session_id

    def register_memory(self, addr: int, length: int) -> None:
        self.inner.register_memory(addr, length)

    def unregister_memory(self, addr: int) -> None:
        self.inner.unregister_memory(addr)

    def close(self) -> None:
        self.inner.close()

    def batch_transfer_sync_read(self, session: str, local_addrs: Any, peer_addrs: Any,
                                 lengths: Any) -> int:
        ranges = self._ranges
        if ranges is not None:
            lo = np.asarray(local_addrs, dtype=np.uint64)[:, None]
            hi = lo + np.asarray(lengths, dtype=np.uint64)[:, None]
            if bool(((lo < ranges[1][None, :]) & (ranges[0][None, :] < hi)).any()):
                self.fired += 1
                return self._fail(TransferResult.BACKEND, "injected read failure")
        result = self.inner.batch_transfer_sync_read(session, local_addrs, peer_addrs, lengths)
        self.last_error = self.inner.last_error
        return result


class _DecodeMemory:
    """The shared main pool (mapped from the parent's /dev/shm file) and this rank's
    indexer/scale copies, with the DestLayout of every layer."""

    def __init__(self, plan: _Plan, rank: int, engine: TransferEngine) -> None:
        from sfa_rd2h.spec.layout import DestLayout

        cfg, tb, nb = plan.cfg, plan.tbytes, plan.d_blocks
        fd = os.open(plan.pool_path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        pool = np.frombuffer(self._mm, dtype=np.uint8)
        # Fault every page in before any read lands (destinations are allocated up front, as
        # vLLM's caches are); the pool is still all zeros, so ranks may do this concurrently.
        pool[::mmap.PAGESIZE] = 0
        engine.register_memory(int(pool.ctypes.data), pool.size)
        self.views: dict[tuple[int, int], np.ndarray] = {}  # (layer, tensor) -> blocks
        off = 0
        for layer in range(cfg.layers):
            for t in range(2):
                self.views[(layer, t)] = pool[off:off + nb * tb[t]].reshape(nb, tb[t])
                off += nb * tb[t]
        self._local = []
        for t in range(2, len(tb)):
            arr = np.empty((cfg.layers, nb, tb[t]), dtype=np.uint8)
            arr.fill(0)  # touches every page now, unlike np.zeros
            engine.register_memory(int(arr.ctypes.data), arr.nbytes)
            self._local.append(arr)
            for layer in range(cfg.layers):
                self.views[(layer, t)] = arr[layer]
        self.dest: dict[str, DestLayout] = {}
        for layer in range(cfg.layers):
            views = [self.views[(layer, t)] for t in range(len(tb))]
            block_bytes = list(tb)
            capacity = [nb] * len(tb)
            if (cfg.inject == "layout-mismatch" and rank == cfg.d_tp - 1
                    and layer == cfg.inject_layer):
                # L1: this rank registers the layer with another main block size; half the
                # blocks keep every registered address inside the real region.
                block_bytes[:2] = [b * 2 for b in tb[:2]]
                capacity[:2] = [nb // 2] * 2
            self.dest[f"layer.{layer}"] = DestLayout(
                tuple(int(v.ctypes.data) for v in views), tuple(block_bytes), tuple(capacity),
                2, cfg.indexer, cfg.indexer and cfg.scale)

    def victim_ranges(self, layer: int, main: np.ndarray, idx: np.ndarray,
                      n_tensors: int) -> tuple[np.ndarray, np.ndarray]:
        starts, lens = [], []
        for t in range(n_tensors):
            view = self.views[(layer, t)]
            ids = main if t < 2 else idx
            starts.append(int(view.ctypes.data) + ids.astype(np.int64) * view.shape[1])
            lens.append(np.full(ids.size, view.shape[1], dtype=np.int64))
        return np.concatenate(starts), np.concatenate(lens)

    def verify(self, plan: _Plan, ext: str, main: np.ndarray, idx: np.ndarray,
               pats: list[Patterns]) -> list[tuple[str, int, int, str]]:
        """Every destination byte of a successful request against the pattern."""
        req = plan.index[ext]
        pos = np.arange(main.size)
        bad = []
        for layer in range(plan.cfg.layers):
            for t, pat in enumerate(pats):
                got = self.views[(layer, t)][main if t < 2 else idx]
                want = pat.blocks(req, layer, pos, t)
                if not np.array_equal(got, want):
                    wrong = np.flatnonzero((got != want).any(axis=1))
                    bad.append((ext, layer, t, f"{ext} layer {layer} tensor {t}: "
                                f"{wrong.size} block(s) differ, first at position "
                                f"{int(wrong[0])}"))
        return bad

    def close(self) -> None:
        self.views.clear()
        self._local.clear()


def _decode_rank(plan: _Plan, rank: int, chan: _Channel, peers: list[Connection],
                 inbox: Connection | None) -> None:
    from sfa_rd2h.runtime.control import AgreementLoop, DecodeWorker
    from sfa_rd2h.runtime.decode_core import DecodeCore
    from sfa_rd2h.runtime.metaserver import (
        Rendezvous,
        fetch_work,
        post_rendezvous,
        report_finished,
    )
    from sfa_rd2h.runtime.tp_group import GlooTpGroup, SingleRankGroup, TpGroup

    cfg = plan.cfg
    port = decode_rank_port(plan.base_port, rank, cfg.d_tp)
    with ExitStack() as stack:  # owns every resource from creation on (see _prefill_rank)
        tracer = _tracer(plan, f"decode{rank}", role="decode", rank=rank,
                         endpoint=f"{cfg.host}:{port}")
        stack.callback(_quietly, tracer.close)
        engine: TransferEngine = make_engine(cfg.engine, **_engine_kwargs(cfg, "decode"))
        stack.callback(_quietly, engine.close)
        engine.initialize(cfg.host, 0)
        injector = None
        if cfg.inject == "read-failure" and rank == 0:
            engine = injector = _FailingReads(engine)
        mem = _DecodeMemory(plan, rank, engine)
        stack.callback(_quietly, mem.close)
        core = DecodeCore(rank, cfg.d_tp, mem.dest, destination_wait=min(30.0, cfg.timeout),
                          request_deadline=cfg.timeout, observer=tracer)
        group: TpGroup
        if cfg.d_tp > 1:
            group = GlooTpGroup(rank, cfg.d_tp, f"tcp://{cfg.host}:{plan.gloo_port}",
                                timeout=cfg.timeout)
        else:
            group = SingleRankGroup()
        stack.callback(_quietly, group.close)
        finished: queue.Queue = queue.Queue()
        loop = AgreementLoop(group, round_wait=0.02)
        worker = DecodeWorker(core, engine, port, host=cfg.host, tracer=tracer,
                              on_ready=loop.notify, on_finished=finished.put)
        stack.callback(_quietly, worker.close)
        stack.callback(_quietly, lambda: loop.close(timeout=2.0))  # runs first: it uses worker
        loop.start(worker, until=lambda agreed: len(agreed) >= plan.n)
        allocated: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        idx_pool = np.roll(np.arange(1, plan.d_blocks), 5 * rank)  # rank-local indexer blocks
        cursor = [0]
        failure: list[str] = []

        def register(ext: str, main: np.ndarray) -> None:
            nb = main.size
            idx = idx_pool[cursor[0]:cursor[0] + nb]
            cursor[0] += nb
            allocated[ext] = (main, idx)
            if injector is not None and ext == plan.victim:
                injector.set_victim(*mem.victim_ranges(cfg.inject_layer, main, idx,
                                                       len(plan.tbytes)))
            worker.register_request(ext, main.tolist(), idx.tolist())

        def scheduler() -> None:
            try:
                if rank == 0:
                    main_cursor, fetched = 1, 0  # block 0 stays unused
                    while fetched < plan.n:
                        for item in fetch_work(plan.proxy_url, "decode", "decode-0", timeout=2.0):
                            ext = item["request_id"]
                            nb = n_blocks(item["num_tokens"], cfg.block_tokens)
                            main = np.arange(main_cursor, main_cursor + nb)
                            main_cursor += nb
                            for peer in peers:
                                peer.send(("register", ext, main))
                            register(ext, main)
                            post_rendezvous(item["metaserver"], Rendezvous(
                                request_id=ext, remote_engine_id="demo-decode",
                                remote_host=cfg.host, remote_port=plan.base_port,
                                remote_tp_size=cfg.d_tp, remote_cached_tokens=0))
                            fetched += 1
                else:
                    assert inbox is not None
                    for _ in range(plan.n):
                        _, ext, main = inbox.recv()
                        register(ext, main)
            except BaseException as exc:  # noqa: BLE001 - the main thread reports it
                failure.append(traceback.format_exc())
                finished.put(exc)

        sched = threading.Thread(target=scheduler, name=f"decode{rank}-scheduler", daemon=True)
        chan.send("ready", {"endpoint": worker.endpoint})
        sched.start()
        outcomes: dict[str, tuple[bool, str | None]] = {}
        deadline = time.monotonic() + cfg.timeout
        while len(outcomes) < plan.n:
            try:
                item = finished.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(plan.index) - set(outcomes))
                raise TimeoutError(f"decode{rank}: no terminal state within "
                                   f"{cfg.timeout:g}s for {missing}") from None
            if isinstance(item, BaseException):
                raise RuntimeError(f"decode scheduler failed:\n{failure[0]}")
            outcomes[item.ext_req_id] = (item.ok, item.error)
            if rank == 0:
                report_finished(plan.proxy_url, item.ext_req_id, ok=item.ok, role="decode",
                                error=item.error)
                chan.send("finished", item.ext_req_id, item.ok, item.error)
        if not loop.wait(cfg.timeout):
            raise RuntimeError("agreement loop did not end after every request was agreed")
        if loop.error is not None:
            raise RuntimeError(f"agreement failed: {loop.error!r}")
        sched.join(cfg.timeout)
        pats = [Patterns(nbytes) for nbytes in plan.tbytes]
        t0 = time.perf_counter()
        mismatches: list[tuple[str, int, int, str]] = []
        for ext, (ok, _err) in outcomes.items():
            if ok:
                mismatches += mem.verify(plan, ext, *allocated[ext], pats)
        chan.send("report", {
            "role": "decode", "rank": rank,
            "outcomes": {ext: ok for ext, (ok, _e) in outcomes.items()},
            "errors": {ext: e for ext, (ok, e) in outcomes.items() if not ok},
            "mismatches": [m[3] for m in mismatches[:20]], "n_mismatches": len(mismatches),
            "mismatch_at": sorted({(m[0], m[1]) for m in mismatches}),
            "verify_seconds": time.perf_counter() - t0,
            "bytes": worker.stats.bytes_read, "reads": worker.stats.reads,
            "failed_reads": worker.stats.failed_reads, "rounds": loop.rounds,
            "read_seconds": worker.stats.read_seconds,
            "injected": injector.fired if injector is not None else 0,
        })
        # Stay up until the parent says every Prefill rank is done (their last replies
        # must not meet a closed ROUTER).
        chan.conn.recv()


# ============================================================================ parent


@dataclass
class DemoResult:
    ok: bool
    requests_ok: int
    requests_failed: int
    bytes: int
    seconds: float
    gbps: float
    rtt_p50_ms: float | None
    rtt_p99_ms: float | None
    verified: bool
    trace_valid: bool
    topology: dict[str, Any]
    inject: str = "none"
    expectation: str = ""
    expectation_met: bool = False
    prefill_gate_errors: int = 0
    failed_requests: list[str] = field(default_factory=list)
    outcomes_agree: bool = True
    trace_report: str = ""
    trace_dir: str | None = None
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    ports: list[int] = field(default_factory=list)
    proxy_url: str = ""
    problems: list[str] = field(default_factory=list)
    complete: bool = False  # every rank reported (the run was not aborted)
    processes: dict[str, dict[str, Any]] = field(default_factory=dict)  # per-rank counters
    startup_seconds: float = 0.0  # spawning the processes until every one is ready
    wall_seconds: float = 0.0  # the whole run, start-up, verification and shutdown included

    def summary(self) -> str:
        topo = self.topology
        lines = [
            f"sfa-rd2h demo: p_tp={topo['p_tp']} d_tp={topo['d_tp']} (ratio {topo['ratio']}), "
            f"{topo['layers']} layers on {topo['slots']} slots, indexer={topo['indexer']} "
            f"scale={topo['scale']}, engine={topo['engine']}, inject={self.inject}",
            f"  requests ok/failed : {self.requests_ok}/{self.requests_failed}",
            f"  bytes moved        : {self.bytes:,} in {self.seconds:.3f}s = "
            f"{self.gbps:.3f} GB/s",
            f"  layer round trip   : p50 {_ms(self.rtt_p50_ms)}  p99 {_ms(self.rtt_p99_ms)}",
            f"  verification       : {self._verification()}",
            f"  traces             : {self.trace_report}",
            f"  expectation        : {self.expectation} -> "
            f"{'met' if self.expectation_met else 'NOT MET'}",
        ]
        if self.prefill_gate_errors:
            lines.append(f"  prefill gate errors: {self.prefill_gate_errors} (S4)")
        lines += [f"  problem: {p}" for p in self.problems]
        lines.append("OK" if self.ok else "FAILED")
        return "\n".join(lines)

    def _verification(self) -> str:
        if not self.complete:
            return "not done (the run did not complete)"
        if self.verified:
            return f"every destination byte of the {self.requests_ok} successful request(s) " \
                   "matches"
        predicted = self.inject == "stale-kv" and self.expectation_met
        return "MISMATCH" + (" (the predicted one)" if predicted else "")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f} ms"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _free_span(host: str, n: int, attempts: int = 50) -> int:
    """A base port with ``n`` consecutive free ports (P1: base + tp_rank)."""
    for _ in range(attempts):
        base = _free_port(host)
        if base + n - 1 > 65535:
            continue
        held: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                held.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise DemoConfigError(f"P1: no span of {n} free ports found on {host}")


def _check_ports_free(host: str, base: int, n: int) -> None:
    """P1: say now, not from a child a second later, that a Decode port is taken."""
    for rank in range(n):
        port = decode_rank_port(base, rank, n)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZMQ binds
            try:
                s.bind((host, port))
            except OSError as exc:
                raise DemoConfigError(f"P1: Decode rank {rank} port {host}:{port} is not "
                                      f"free: {exc.strerror}") from None


@dataclass(eq=False)
class _Proc:
    name: str
    proc: Any
    conn: Connection
    ready: bool = False
    report: dict[str, Any] | None = None
    eof: bool = False
    exited: bool = False


def _percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values), q)) if values else None


class _Abort(Exception):
    pass


# Imported once by the fork server; every rank process forks from it, so six ranks do not
# each pay torch's import (seconds of CPU on a small machine).
_PRELOAD = ["sfa_rd2h.runtime.demo", "sfa_rd2h.runtime.control", "sfa_rd2h.runtime.metaserver",
            "torch", "torch.distributed"]


def _mp_context() -> Any:
    """Separate OS processes started from a clean, single-threaded fork server (never a fork
    of this multi-threaded parent); plain spawn where the platform has no fork server."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        return ctx
    return mp.get_context("spawn")


def run_demo(cfg: DemoConfig) -> DemoResult:
    """Run the whole deployment; raises ``DemoConfigError`` for an invalid configuration."""
    from sfa_rd2h.runtime.metaserver import ProxyServer
    from sfa_rd2h.runtime.trace import validate

    cfg.check()
    if cfg.kv_port is not None:
        _check_ports_free(cfg.host, cfg.kv_port, cfg.d_tp)
    try:  # fail here, with the engine's own message, if it cannot exist on this machine
        make_engine(cfg.engine, **_engine_kwargs(cfg, "decode")).close()
    except EngineError as exc:
        raise DemoConfigError(str(exc)) from None
    mapping = tp_mapping(cfg.p_tp, cfg.d_tp)
    work = make_workload(cfg)
    total_blocks = sum(n_blocks(t, cfg.block_tokens) for t in work.tokens.values())
    tb = tensor_bytes(cfg.block_tokens, cfg.indexer, cfg.scale)
    base_port = cfg.kv_port if cfg.kv_port is not None else _free_span(cfg.host, cfg.d_tp)
    decode_base_port(base_port, 0, cfg.d_tp)
    ports = [decode_rank_port(base_port, d, cfg.d_tp) for d in range(cfg.d_tp)]
    topology = {"p_tp": cfg.p_tp, "d_tp": cfg.d_tp, "ratio": mapping.ratio,
                "layers": cfg.layers, "slots": cfg.slots, "indexer": cfg.indexer,
                "scale": cfg.indexer and cfg.scale, "engine": cfg.engine,
                "host_mode": cfg.host_mode if cfg.engine == "host" else None,
                "base_port": base_port, "requests": cfg.requests,
                "block_tokens": cfg.block_tokens, "chunk_tokens": cfg.chunk_tokens}

    tmp = tempfile.mkdtemp(prefix="sfa-rd2h-demo-")
    trace_dir = cfg.trace_dir or os.path.join(tmp, "traces")
    os.makedirs(trace_dir, exist_ok=True)
    for old in Path(trace_dir).glob("*.jsonl"):
        old.unlink()  # a stale trace from another run would be validated with this one
    pool_path = os.path.join(_SHM_DIR if os.path.isdir(_SHM_DIR) else tmp,
                             f"sfa_rd2h.demo.{os.getpid()}.{secrets.token_hex(4)}.pool")
    d_blocks = total_blocks + 1
    with open(pool_path, "wb") as f:
        f.truncate(cfg.layers * d_blocks * (tb[0] + tb[1]))
    proxy = ProxyServer(cfg.host)
    proxy_url = proxy.start()
    plan = _Plan(cfg, work.index, work.tokens, work.victim, total_blocks + 1, d_blocks,
                 proxy_url, base_port, _free_port(cfg.host), pool_path, trace_dir)
    ctx = _mp_context()
    procs: list[_Proc] = []
    problems: list[str] = []
    finished: dict[str, bool] = {}
    t_start = t_ready = t_submit = t_last = time.monotonic()
    deadline = t_start + cfg.timeout
    bar = None
    try:
        d_links = [ctx.Pipe(duplex=False) for _ in range(cfg.d_tp - 1)]  # (recv, send)
        p_links = [ctx.Pipe(duplex=False) for _ in range(cfg.p_tp - 1)]
        for role, tp, links, fn in (("decode", cfg.d_tp, d_links, _decode_rank),
                                    ("prefill", cfg.p_tp, p_links, _prefill_rank)):
            for r in range(tp):
                mine, theirs = ctx.Pipe()
                peers = [s for _, s in links] if r == 0 else []
                inbox = links[r - 1][0] if r > 0 else None
                name = f"{role}{r}"
                proc = ctx.Process(target=_child, name=name, daemon=True,
                                   args=(fn, name, plan, r, theirs, peers, inbox))
                proc.start()
                theirs.close()
                procs.append(_Proc(name, proc, mine))
        for link in (*d_links, *p_links):
            link[0].close()
            link[1].close()

        def drain(p: _Proc) -> None:
            while not p.eof and p.conn.poll():
                try:
                    msg = p.conn.recv()
                except EOFError:
                    p.eof = True  # the sentinel says how it ended
                    return
                handle(p, msg)

        def pump(until: Any, stage: str) -> None:
            while not until():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise _Abort(f"timeout after {cfg.timeout:g}s while {stage}")
                live = {p.conn: p for p in procs if not p.eof}
                sentinels = {p.proc.sentinel: p for p in procs if not p.exited}
                for obj in wait([*live, *sentinels], timeout=remaining):
                    if obj in live:
                        drain(live[obj])
                        continue
                    p = sentinels[obj]
                    drain(p)  # a report sent just before exiting is still in the pipe
                    p.proc.join(1.0)
                    p.exited = True
                    if p.report is None or p.proc.exitcode != 0:
                        raise _Abort(f"{p.name} exited with code {p.proc.exitcode} "
                                     f"while {stage}")

        def handle(p: _Proc, msg: tuple) -> None:
            nonlocal t_last
            kind = msg[0]
            if kind == "ready":
                p.ready = True
            elif kind == "finished":
                finished[msg[1]] = msg[2]
                t_last = time.monotonic()
                if bar is not None:
                    bar.update(1)
            elif kind == "report":
                p.report = msg[1]
            elif kind == "error":
                raise _Abort(f"{p.name} failed:\n{msg[1]}")

        pump(lambda: all(p.ready for p in procs), "starting processes")
        t_ready = time.monotonic()
        from tqdm import tqdm

        bar = tqdm(total=plan.n, desc="requests", unit="req", disable=not cfg.progress,
                   file=sys.stderr, leave=False)
        t_submit = time.monotonic()
        # read-failure: the victim's job arrives once every other request finished, so the
        # failure visibly hits its prefill step only (see the module docstring).
        late = [j for j in work.jobs if work.victim in {f"{j[0]}-{k}" for k in range(len(j[1]))}]
        for job_id, prompts in work.jobs:
            if (job_id, prompts) not in late:
                proxy.submit(prompts, "decode-0", "prefill-0", job_id=job_id)
        if late:
            n_late = len(late[0][1])
            pump(lambda: len(finished) >= plan.n - n_late, "moving KV")
            proxy.submit(late[0][1], "decode-0", "prefill-0", job_id=late[0][0])
        pump(lambda: len(finished) >= plan.n, "moving KV")
        pump(lambda: all(p.report is not None for p in procs), "collecting reports")
        for p in procs:
            if p.name.startswith("decode"):
                p.conn.send(("stop",))
        join_deadline = time.monotonic() + 10.0
        for p in procs:
            p.proc.join(max(0.0, join_deadline - time.monotonic()))
            if p.proc.exitcode != 0:
                problems.append(f"{p.name} exited with code {p.proc.exitcode}")
    except _Abort as exc:
        problems.append(str(exc))
        problems += _stuck(procs, finished, plan, proxy)
    finally:
        if bar is not None:
            bar.close()
        _stop_children(procs)
        proxy.close()
        try:
            os.unlink(pool_path)
        except FileNotFoundError:
            pass

    traces = sorted(str(p) for p in Path(trace_dir).glob("*.jsonl"))
    report = validate(traces)
    if len(traces) != len(procs):
        problems.append(f"{len(traces)} trace file(s) for {len(procs)} processes")
    if report.unclosed:
        problems.append(f"traces not closed cleanly: {report.unclosed}")
    trace_valid = report.ok and not report.unclosed and len(traces) == len(procs)
    result = _assess(cfg, work, plan, procs, finished, trace_valid, report.summary(), problems,
                     t_last - t_submit, topology)
    result.trace_dir = cfg.trace_dir
    result.exit_codes = {p.name: p.proc.exitcode for p in procs}
    result.ports = ports
    result.proxy_url = proxy_url
    result.startup_seconds = round(t_ready - t_start, 3)
    result.wall_seconds = round(time.monotonic() - t_start, 3)
    if cfg.trace_dir is None:
        for t in traces:
            os.unlink(t)
        os.rmdir(trace_dir)
    os.rmdir(tmp)
    return result


def _stop_children(procs: list[_Proc], grace: float = 3.0) -> None:
    """Every child ends here: SIGTERM lets a rank close its engine and trace; SIGKILL after
    ``grace``; then the shared-memory files of a killed rank (named by its pid) go too."""
    alive = [p for p in procs if p.proc.is_alive()]
    for p in alive:
        p.proc.terminate()
    end = time.monotonic() + grace
    for p in alive:
        p.proc.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.proc.is_alive():
            p.proc.kill()
        p.proc.join(5.0)
        p.conn.close()
        if p.proc.exitcode != 0 and p.proc.pid is not None:
            # A rank that did not finish cleanly may not have closed its engine.
            for leaked in Path(_SHM_DIR).glob(f"sfa_rd2h.{p.proc.pid}.*"):
                leaked.unlink(missing_ok=True)


def _stuck(procs: list[_Proc], finished: dict[str, bool], plan: _Plan,
           proxy: Any) -> list[str]:
    """What a timed-out or aborted run was waiting for."""
    out = []
    missing = [ext for ext in plan.index if ext not in finished]
    if missing:
        out.append(f"requests never finished: {missing}")
    waiting = [p.name for p in procs if p.report is None]
    if waiting:
        out.append(f"no report from: {waiting}")
    for job in sorted({ext.rsplit('-', 1)[0] for ext in missing}):
        try:
            st = proxy.status(job)
        except KeyError:
            continue
        states = {r["request_id"]: r["state"] for r in st["requests"]}
        out.append(f"proxy job {job}: dispatched={st['dispatched']} {states}")
    return out


_BULKY = ("rtts", "steps", "outcomes", "errors", "mismatches", "mismatch_at")


def _assess(cfg: DemoConfig, work: Workload, plan: _Plan, procs: list[_Proc],
            finished: dict[str, bool], trace_valid: bool, trace_summary: str,
            problems: list[str], seconds: float, topology: dict[str, Any]) -> DemoResult:
    reports = {p.name: p.report for p in procs if p.report is not None}
    decode = [reports.get(f"decode{d}") for d in range(cfg.d_tp)]
    prefill = [reports.get(f"prefill{p}") for p in range(cfg.p_tp)]
    complete = all(r is not None for r in decode + prefill)
    outcomes = [r["outcomes"] for r in decode if r is not None]
    agree = bool(outcomes) and all(o == outcomes[0] for o in outcomes) and \
        set(outcomes[0]) == set(plan.index)
    if complete and not agree:
        problems.append(f"R2: Decode ranks disagree on outcomes: {outcomes}")
    final = outcomes[0] if outcomes else finished
    failed = sorted(ext for ext, ok in final.items() if not ok)
    n_ok = sum(1 for ok in final.values() if ok)
    gate_errors = sum(len(r["errors"]) for r in prefill if r is not None)
    verified = complete and all(r["n_mismatches"] == 0 for r in decode if r is not None)
    if cfg.inject != "stale-kv":
        for r in decode:
            if r is not None and r["mismatches"]:
                problems.append(f"decode{r['rank']} byte mismatches: {r['mismatches'][:3]}")
    nbytes = sum(r["bytes"] for r in decode if r is not None)
    rtts = [x for r in prefill if r is not None for x in r["rtts"]]

    if cfg.inject == "none":
        expectation = "every request succeeds, no Prefill gate error"
        met = n_ok == plan.n and gate_errors == 0
    elif cfg.inject == "read-failure":
        steps = prefill[0]["steps"] if prefill[0] is not None else []
        predicted = sorted({e for s in steps if work.victim in s for e in s})
        fired = decode[0]["injected"] if decode[0] is not None else 0
        expectation = (f"exactly the requests of {work.victim}'s prefill step fail "
                       f"({len(predicted)}: {predicted}), the others succeed; the injected "
                       f"read failure fired and Prefill observed a gate error")
        met = bool(predicted) and failed == predicted and fired > 0 and gate_errors > 0
    elif cfg.inject == "layout-mismatch":
        expectation = (f"every request fails (layer {cfg.inject_layer} mismatches on decode"
                       f"{cfg.d_tp - 1}); Prefill observed gate errors")
        met = n_ok == 0 and len(failed) == plan.n and gate_errors > 0
    else:
        want = [[work.victim, cfg.inject_layer]]
        seen = [[list(x) for x in r["mismatch_at"]] for r in decode if r is not None]
        expectation = (f"every request completes; every Decode rank finds the bytes of "
                       f"{work.victim} layer {cfg.inject_layer}, and only those, stale")
        met = n_ok == plan.n and bool(seen) and all(s == want for s in seen)
    if complete and not met:
        problems.append(f"outcome does not match the expectation: {len(failed)} failed "
                        f"{failed}, {gate_errors} gate error(s)")
    if not trace_valid and "DIVERGENCE" in trace_summary:
        problems.append(f"trace validation: {trace_summary}")
    # stale-kv predicts a failed verification; met already says it failed exactly as predicted
    bytes_ok = verified or cfg.inject == "stale-kv"
    ok = complete and agree and met and bytes_ok and trace_valid and not problems
    return DemoResult(
        complete=complete,
        ok=ok, requests_ok=n_ok, requests_failed=len(failed), bytes=nbytes,
        seconds=round(seconds, 6), gbps=round(nbytes / seconds / 1e9, 4) if seconds > 0 else 0.0,
        rtt_p50_ms=None if not rtts else round(_percentile(rtts, 50) * 1e3, 3),  # type: ignore[operator]
        rtt_p99_ms=None if not rtts else round(_percentile(rtts, 99) * 1e3, 3),  # type: ignore[operator]
        verified=verified, trace_valid=trace_valid, topology=topology, inject=cfg.inject,
        expectation=expectation, expectation_met=met, prefill_gate_errors=gate_errors,
        failed_requests=failed, outcomes_agree=agree, trace_report=trace_summary,
        problems=problems,
        processes={name: {k: v for k, v in r.items() if k not in _BULKY}
                   for name, r in reports.items()})


# ============================================================================ CLI


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
    p.add_argument("--kv-port", type=int, default=None,
                   help="Decode base port (default: a free span)")
    p.add_argument("--host", default=d.host, help="loopback or host address to use")
    p.add_argument("--trace-dir", default=None, help="keep the JSON-lines traces here")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
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
        seed=args.seed, progress=not (args.json or args.quiet))


def cmd_demo(args: argparse.Namespace) -> int:
    """Exit 0: outcome as predicted, every byte verified, traces valid; 1: otherwise;
    2: invalid configuration (the message names the rule)."""
    try:
        result = run_demo(config_from_args(args))
    except DemoConfigError as exc:
        print(f"invalid demo configuration: {exc}", file=sys.stderr)
        return 2
    if args.json:
        keys = ("ok", "requests_ok", "requests_failed", "bytes", "seconds", "gbps",
                "rtt_p50_ms", "rtt_p99_ms", "verified", "trace_valid", "topology")
        out = {k: getattr(result, k) for k in keys}
        out.update(inject=result.inject, expectation=result.expectation,
                   expectation_met=result.expectation_met,
                   prefill_gate_errors=result.prefill_gate_errors,
                   failed_requests=result.failed_requests, problems=result.problems)
        print(json.dumps(out))
    else:
        print(result.summary())
    return 0 if result.ok else 1
