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
from sfa_rd2h.runtime.tools.demo.process import Channel, Plan, close_quietly, make_tracer
from sfa_rd2h.runtime.tools.demo.workload import Patterns, engine_kwargs, n_blocks
from sfa_rd2h.spec.topology import decode_rank_port

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


def decode_rank(plan: Plan, rank: int, chan: Channel, peers: list[Connection],
                 inbox: Connection | None) -> None:
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
    port = decode_rank_port(plan.base_port, rank, cfg.d_tp)
    with ExitStack() as stack:  # owns every resource from creation on (see prefill_rank)
        tracer = make_tracer(plan, f"decode{rank}", role="decode", rank=rank,
                         endpoint=f"{cfg.host}:{port}")
        stack.callback(close_quietly, tracer.close)
        engine: TransferEngine = make_engine(cfg.engine, **engine_kwargs(cfg, "decode"))
        stack.callback(close_quietly, engine.close)
        engine.initialize(cfg.host, 0)
        injector = None
        if cfg.inject == "read-failure" and rank == 0:
            engine = injector = _FailingReads(engine)
        mem = _DecodeMemory(plan, rank, engine)
        stack.callback(close_quietly, mem.close)
        core = DecodeCore(rank, cfg.d_tp, mem.dest, destination_wait=min(30.0, cfg.timeout),
                          request_deadline=cfg.timeout, observer=tracer)
        group: TpGroup
        if cfg.d_tp > 1 and cfg.tp_group == "gloo":
            from sfa_rd2h.runtime.tp_group import GlooTpGroup

            group = GlooTpGroup(rank, cfg.d_tp, f"tcp://{cfg.host}:{plan.tp_port}",
                                timeout=cfg.timeout)
        elif cfg.d_tp > 1:
            from sfa_rd2h.runtime.zmq_tp_group import ZmqTpGroup

            group = ZmqTpGroup(rank, cfg.d_tp, f"tcp://{cfg.host}:{plan.tp_port}",
                               timeout=cfg.timeout)
        else:
            group = SingleRankGroup()
        stack.callback(close_quietly, group.close)
        finished: queue.Queue = queue.Queue()
        loop = AgreementLoop(group, round_wait=0.02)
        worker = DecodeWorker(core, engine, port, host=cfg.host, tracer=tracer,
                              on_ready=loop.notify, on_finished=finished.put)
        stack.callback(close_quietly, worker.close)
        stack.callback(close_quietly, lambda: loop.close(timeout=2.0))  # runs first: it uses worker
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


