"""One demo Decode rank: allocates destinations, reads each layer, agrees, verifies (C1, R1, R2)."""

from __future__ import annotations

import mmap
import os
import queue
import threading
import time
import traceback
from contextlib import ExitStack
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from sfa_rd2h.runtime.engines import (
    TransferEngine,
    TransferResult,
    make_engine,
)
from sfa_rd2h.runtime.tools.demo.process import (
    Channel,
    Plan,
    close_quietly,
    crash,
    live_threads,
    make_tracer,
    send_to_live,
)
from sfa_rd2h.runtime.tools.demo.workload import WORK_POLL_S, Patterns, engine_kwargs, n_blocks
from sfa_rd2h.spec.topology import decode_rank_port

# ---------------------------------------------------------------------------- Decode

AGREEMENT_CLOSE_S = 2.0  # shutdown: the agreement thread is joined within this
SLOW_MARGIN_S = 0.5  # slow-reader: how far past Prefill's reply timeout the slow read ends
LATE_POLL_S = 0.005  # late-destinations: between two looks at the READYs waiting (C1)
CUT_ACK_S = 30.0  # link-cut: the parent cuts the link (two `ip` calls) and acks within this


class _FaultyReads(TransferEngine):
    """A fault injected into the transfer engine: the batched reads that write into a target
    address range (the victim's destinations of one layer, or the whole layer) misbehave as
    ``mode`` says; every other read goes to the real engine.

    * ``fail`` (read-failure): the read returns a transfer error (F2).
    * ``raise`` (engine-failure): the engine raises, and keeps raising on every later read,
      as a broken engine would; the runtime hands the exception to the core (F2).
    * ``slow`` (slow-reader): the read starts only after ``delay`` seconds, longer than
      Prefill's reply timeout and this rank's read budget.
    * ``crash`` (kill-decode, restart-decode): the process is SIGKILLed mid-read.
    * ``cut`` (link-cut): before the first such read, the parent takes the Prefill host's
      link down (``on_cut`` returns once it is down); the read then goes to the real engine,
      across the cut link, as do all later ones.
    """

    name = "inject-faulty-reads"

    def __init__(self, inner: TransferEngine, mode: str, *, delay: float = 0.0,
                 on_crash: Any = None, on_cut: Any = None) -> None:
        super().__init__()
        self.inner = inner
        self.mode = mode
        self.delay = delay
        self.fired = 0
        self._on_crash = on_crash
        self._on_cut = on_cut
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

    def _hits(self, local_addrs: Any, lengths: Any) -> bool:
        ranges = self._ranges
        if ranges is None:
            return False
        lo = np.asarray(local_addrs, dtype=np.uint64)[:, None]
        hi = lo + np.asarray(lengths, dtype=np.uint64)[:, None]
        return bool(((lo < ranges[1][None, :]) & (ranges[0][None, :] < hi)).any())

    def batch_transfer_sync_read(self, session: str, local_addrs: Any, peer_addrs: Any,
                                 lengths: Any) -> int:
        broken = self.mode == "raise" and self.fired > 0
        once = self.mode == "cut" and self.fired > 0  # one cut; later reads just go through
        if not once and (broken or self._hits(local_addrs, lengths)):
            self.fired += 1
            if self.mode == "fail":
                return self._fail(TransferResult.BACKEND, "injected read failure")
            if self.mode == "raise":
                raise RuntimeError("injected transfer-engine failure")
            if self.mode == "crash":
                self._on_crash()
            if self.mode == "cut":
                self._on_cut()
            if self.mode == "slow":
                time.sleep(self.delay)  # the injected slowness itself, not a wait for anything
        result = self.inner.batch_transfer_sync_read(session, local_addrs, peer_addrs, lengths)
        self.last_error = self.inner.last_error
        return result


#: --inject value -> the read fault it injects, and the Decode rank it hits.
_READ_FAULTS = {"read-failure": "fail", "engine-failure": "raise", "slow-reader": "slow",
                "kill-decode": "crash", "restart-decode": "crash", "link-cut": "cut"}


def _ask_for_cut(chan: Channel) -> None:
    """link-cut: ask the parent (which holds the lab) to cut the Prefill host's link, and
    return once it says the link is down. Runs on the reading thread, while the rank's main
    thread waits for terminal states, so nothing else reads this pipe now."""
    chan.send("cut")
    if not chan.conn.poll(CUT_ACK_S):
        raise RuntimeError(f"link-cut: the parent did not cut the link within {CUT_ACK_S:g}s")
    reply = chan.conn.recv()
    if reply != ("cut",):
        raise RuntimeError(f"link-cut: the parent answered {reply!r}, not ('cut',)")


def _fault_rank(plan: Plan) -> int:
    return plan.cfg.d_tp - 1 if plan.cfg.inject == "kill-decode" else 0


class _DecodeMemory:
    """The shared main pool (mapped from the parent's /dev/shm file) and this rank's
    indexer/scale copies, with the DestLayout of every layer."""

    def __init__(self, plan: Plan, rank: int, engine: TransferEngine) -> None:
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

    def layer_ranges(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The whole destination range of one layer, every tensor."""
        views = [v for (lay, _t), v in self.views.items() if lay == layer]
        return (np.array([int(v.ctypes.data) for v in views], dtype=np.int64),
                np.array([v.nbytes for v in views], dtype=np.int64))

    def victim_ranges(self, layer: int, main: np.ndarray, idx: np.ndarray,
                      n_tensors: int) -> tuple[np.ndarray, np.ndarray]:
        starts, lens = [], []
        for t in range(n_tensors):
            view = self.views[(layer, t)]
            ids = main if t < 2 else idx
            starts.append(int(view.ctypes.data) + ids.astype(np.int64) * view.shape[1])
            lens.append(np.full(ids.size, view.shape[1], dtype=np.int64))
        return np.concatenate(starts), np.concatenate(lens)

    def verify(self, plan: Plan, ext: str, main: np.ndarray, idx: np.ndarray,
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


class _BrokenGroupFallback:
    """R2 without a TP group: once the group is broken (a Decode rank died, so no collective
    can complete), no request can be agreed ok. Every request without a terminal state is
    then failed here, as soon as no read writes into its blocks any more (R5), instead of
    waiting forever for an agreement that cannot come; requests registered later too."""

    def __init__(self, worker: Any, loop: Any) -> None:
        self.worker = worker
        self.loop = loop
        self.error: str | None = None
        self._lock = threading.Lock()
        self._registered: set[str] = set()
        self._done: set[str] = set()

    def on_ready(self, ready: Any) -> None:  # the DecodeWorker's on_ready
        if self.error is None:
            self.loop.notify(ready)
        else:
            self._fail(ready.ext_req_id)

    def registered(self, ext: str) -> None:
        with self._lock:
            self._registered.add(ext)
            broken = self.error is not None
        if broken:
            self._fail(ext)

    def on_agreed(self, ext: str, ok: bool) -> None:
        with self._lock:
            self._done.add(ext)

    def broke(self, error: str) -> None:
        with self._lock:
            self.error = error
            pending = sorted(self._registered - self._done)
        for ext in pending:
            self._fail(ext)

    def _fail(self, ext: str) -> None:
        self.worker.abort_request(ext, f"R2: the Decode TP group is broken: {self.error}")
        with self._lock:
            if ext in self._done or self.worker.local_outcome(ext) is None:
                return  # terminal already, or a read still writes into it: on_ready comes
            self._done.add(ext)
        self.worker.apply_agreement(ext, False)


def decode_rank(plan: Plan, rank: int, chan: Channel, peers: list[Connection],
                inbox: Connection | None, incarnation: int = 0,
                expect: list[str] | None = None) -> None:
    """One Decode rank. ``incarnation`` > 0 is a restarted rank (restart-decode), which
    handles only the requests in ``expect`` (those submitted after the restart)."""
    from sfa_rd2h.runtime.control import AgreementLoop, DecodeWorker
    from sfa_rd2h.runtime.metaserver import (
        Rendezvous,
        fetch_work,
        post_rendezvous,
        report_finished,
    )
    from sfa_rd2h.runtime.tp_group import SingleRankGroup, TpGroup
    from sfa_rd2h.statemachines.cores.decode import DecodeCore

    cfg = plan.cfg
    here = plan.address("decode")  # what this rank binds and advertises
    times = cfg.timeouts()
    mine = list(plan.index) if expect is None else list(expect)
    port = decode_rank_port(plan.base_port, rank, cfg.d_tp)
    name = f"decode{rank}" + (f".{incarnation}" if incarnation else "")
    with ExitStack() as stack:  # owns every resource from creation on (see prefill_rank)
        tracer = make_tracer(plan, name, role="decode", rank=rank,
                             endpoint=f"{here}:{port}")
        stack.callback(close_quietly, tracer.close)
        engine: TransferEngine = make_engine(cfg.engine, **engine_kwargs(cfg, "decode"))
        stack.callback(close_quietly, engine.close)
        engine.initialize(here, 0)
        injector = None
        fault = _READ_FAULTS.get(cfg.inject)
        if fault is not None and rank == _fault_rank(plan) and incarnation == 0:
            # slow-reader: the read ends after Prefill's reply timeout (which is past this
            # rank's read budget) and before the request deadline: Prefill gives up on the
            # reader and may reuse the slot (S5), so the late read must fail (S6).
            slow = times["reply_timeout"] + SLOW_MARGIN_S
            engine = injector = _FaultyReads(engine, fault, delay=slow,
                                             on_crash=lambda: crash(tracer),
                                             on_cut=lambda: _ask_for_cut(chan))
        mem = _DecodeMemory(plan, rank, engine)
        stack.callback(close_quietly, mem.close)
        if injector is not None and fault == "crash":
            injector.set_victim(*mem.layer_ranges(cfg.inject_layer))
        core = DecodeCore(rank, cfg.d_tp, mem.dest, destination_wait=times["destination_wait"],
                          read_budget=times["read_budget"],
                          request_deadline=times["request_deadline"], observer=tracer)
        group: TpGroup
        if cfg.d_tp > 1 and cfg.tp_group == "gloo":
            from sfa_rd2h.runtime.tp_group import GlooTpGroup

            group = GlooTpGroup(rank, cfg.d_tp, f"tcp://{here}:{plan.tp_port}",
                                timeout=times["tp_timeout"])
        elif cfg.d_tp > 1:
            from sfa_rd2h.runtime.zmq_tp_group import ZmqTpGroup

            group = ZmqTpGroup(rank, cfg.d_tp, f"tcp://{here}:{plan.tp_port}",
                               timeout=times["tp_timeout"])
        else:
            group = SingleRankGroup()
        stack.callback(close_quietly, group.close)
        finished: queue.Queue = queue.Queue()
        worker: Any = None
        fallback = _BrokenGroupFallback(None, None)
        loop = AgreementLoop(group, on_agreed=fallback.on_agreed)  # control.ROUND_WAIT_S
        worker = DecodeWorker(core, engine, port, host=here, tracer=tracer,
                              on_ready=fallback.on_ready, on_finished=finished.put)
        fallback.worker, fallback.loop = worker, loop
        stack.callback(close_quietly, worker.close)
        stack.callback(close_quietly, lambda: loop.close(timeout=AGREEMENT_CLOSE_S))  # runs first
        loop.start(worker, until=lambda agreed: len(agreed) >= len(mine))
        allocated: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        idx_pool = np.roll(np.arange(1, plan.d_blocks), 5 * rank)  # rank-local indexer blocks
        cursor = [0]
        failure: list[str] = []
        waited = [0]  # late-destinations: READYs found waiting when the victim registered
        live_peers = list(peers)

        def register(ext: str, main: np.ndarray) -> None:
            nb = main.size
            idx = idx_pool[cursor[0]:cursor[0] + nb]
            cursor[0] += nb
            allocated[ext] = (main, idx)
            if injector is not None and fault != "crash" and ext == plan.victim:
                injector.set_victim(*mem.victim_ranges(cfg.inject_layer, main, idx,
                                                       len(plan.tbytes)))
            worker.register_request(ext, main.tolist(), idx.tolist())
            fallback.registered(ext)

        def share(ext: str, main: np.ndarray) -> None:
            """Rank 0 hands the allocation to the other ranks (vLLM: the scheduler output);
            a rank that died (kill-decode) is skipped, its pipe is broken."""
            send_to_live(live_peers, ("register", ext, main))
            register(ext, main)

        def register_late(ext: str, main: np.ndarray) -> None:
            """late-destinations: the rendezvous went out before the destinations were
            registered; register once a READY waits for them (C1), within the wait."""
            end = time.monotonic() + times["destination_wait"]
            poll = threading.Event()  # never set: a bounded pause between two looks
            while worker.waiting_for_destinations() == 0 and time.monotonic() < end:
                poll.wait(LATE_POLL_S)
            waited[0] = worker.waiting_for_destinations()
            share(ext, main)

        def scheduler() -> None:
            try:
                if rank == 0:
                    main_cursor, fetched = 1, 0  # block 0 stays unused
                    late: list[threading.Thread] = []
                    while fetched < len(mine):
                        for item in fetch_work(plan.proxy_url, "decode", "decode-0",
                                               timeout=WORK_POLL_S):
                            ext = item["request_id"]
                            nb = n_blocks(item["num_tokens"], cfg.block_tokens)
                            main = np.arange(main_cursor, main_cursor + nb)
                            main_cursor += nb
                            delay = cfg.inject == "late-destinations" and ext == plan.victim
                            if not delay:
                                share(ext, main)
                            post_rendezvous(plan.metaserver_url or item["metaserver"],
                                            Rendezvous(
                                request_id=ext, remote_engine_id="demo-decode",
                                remote_host=here, remote_port=plan.base_port,
                                remote_tp_size=cfg.d_tp, remote_cached_tokens=0))
                            if delay:
                                t = threading.Thread(target=register_late, args=(ext, main),
                                                     name=f"{name}-late", daemon=True)
                                t.start()
                                late.append(t)
                            fetched += 1
                    for t in late:
                        t.join(times["destination_wait"] + cfg.timeout)
                else:
                    assert inbox is not None
                    for _ in range(len(mine)):
                        _, ext, main = inbox.recv()
                        register(ext, main)
            except BaseException as exc:  # noqa: BLE001 - the main thread reports it
                failure.append(traceback.format_exc())
                finished.put(exc)

        def watch_group() -> None:
            """The agreement loop ends when every request is agreed, or when the group
            broke (a collective timed out): then the fallback fails what is left."""
            loop.wait(cfg.timeout)
            if loop.error is not None:
                fallback.broke(repr(loop.error))

        sched = threading.Thread(target=scheduler, name=f"{name}-scheduler", daemon=True)
        watcher = threading.Thread(target=watch_group, name=f"{name}-watch", daemon=True)
        chan.send("ready", {"endpoint": worker.endpoint})
        sched.start()
        watcher.start()
        outcomes: dict[str, tuple[bool, str | None]] = {}
        reported: dict[str, int] = {}  # request -> times its terminal state was reported
        deadline = time.monotonic() + cfg.timeout
        while len(outcomes) < len(mine):
            try:
                item = finished.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(mine) - set(outcomes))
                raise TimeoutError(f"{name}: no terminal state within "
                                   f"{cfg.timeout:g}s for {missing}") from None
            if isinstance(item, BaseException):
                raise RuntimeError(f"decode scheduler failed:\n{failure[0]}")
            reported[item.ext_req_id] = reported.get(item.ext_req_id, 0) + 1
            outcomes[item.ext_req_id] = (item.ok, item.error)
            if rank == 0:
                report_finished(plan.proxy_url, item.ext_req_id, ok=item.ok, role="decode",
                                error=item.error)
                chan.send("finished", item.ext_req_id, item.ok, item.error)
        watcher.join(cfg.timeout)
        sched.join(cfg.timeout)
        pats = [Patterns(nbytes) for nbytes in plan.tbytes]
        t0 = time.perf_counter()
        mismatches: list[tuple[str, int, int, str]] = []
        for ext, (ok, _err) in outcomes.items():
            if ok:
                mismatches += mem.verify(plan, ext, *allocated[ext], pats)
        chan.send("report", {
            "role": "decode", "rank": rank, "incarnation": incarnation,
            "outcomes": {ext: ok for ext, (ok, _e) in outcomes.items()},
            "errors": {ext: e for ext, (ok, e) in outcomes.items() if not ok},
            # R5: a failed request's destination blocks are reported as load errors, once
            "load_errors": {ext: int(allocated[ext][0].size) for ext, (ok, _e)
                            in outcomes.items() if not ok and ext in allocated},
            "reported_twice": sorted(ext for ext, n in reported.items() if n > 1),
            "allocated": {ext: int(m.size) for ext, (m, _i) in allocated.items()},
            "mismatches": [m[3] for m in mismatches[:20]], "n_mismatches": len(mismatches),
            "mismatch_at": sorted({(m[0], m[1]) for m in mismatches}),
            "verify_seconds": time.perf_counter() - t0,
            "bytes": worker.stats.bytes_read, "reads": worker.stats.reads,
            "failed_reads": worker.stats.failed_reads, "rounds": loop.rounds,
            "read_seconds": worker.stats.read_seconds,
            "injected": injector.fired if injector is not None else 0,
            "group_error": fallback.error, "late_waited": waited[0],
        })
        # Stay up until the parent says every Prefill rank is done (their last replies
        # must not meet a closed ROUTER).
        chan.conn.recv()
    chan.send("closed", live_threads())
