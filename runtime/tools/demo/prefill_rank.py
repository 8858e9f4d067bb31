"""One demo Prefill rank: computes pattern KV layer by layer and publishes it (C2, C4, S1)."""

from __future__ import annotations

import queue
import threading
import time
from contextlib import ExitStack
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from sfa_rd2h.runtime.engines import (
    TransferEngine,
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
from sfa_rd2h.spec.topology import tp_mapping

# ---------------------------------------------------------------------------- Prefill

FETCH_JOIN_S = WORK_POLL_S + 3.0  # the intake thread ends within one long poll of its stop
FETCH_RETRY_S = 0.2  # after a failed long poll (link-cut: the host's link is down), pause


class _PrefillKv:
    """Per slot, one host buffer per cache tensor, registered with the engine by address.

    Plain numpy memory, so the demo needs no torch: the engines see only addresses and
    lengths, exactly what a torch tensor's ``tensor_region`` would give them."""

    def __init__(self, plan: Plan, engine: TransferEngine) -> None:
        self.tbytes = plan.tbytes
        self.slots: list[list[np.ndarray]] = []
        shm_only = getattr(engine, "mode", None) == "shm"
        for _ in range(plan.cfg.slots):
            row = []
            for nbytes in self.tbytes:
                if shm_only:
                    # Fallback: a shm-mode host engine serves only memory it allocated.
                    _, flat = engine.allocate(plan.p_blocks * nbytes)  # type: ignore[attr-defined]
                    arr = flat.reshape(plan.p_blocks, nbytes)
                else:
                    arr = np.empty((plan.p_blocks, nbytes), dtype=np.uint8)
                    # zeros written now, as vLLM allocates its caches: every page is faulted
                    # in here, not during the first layer's scatter (np.zeros would not)
                    arr.fill(0)
                    engine.register_memory(int(arr.ctypes.data), arr.nbytes)
                row.append(arr)
            self.slots.append(row)

    def bases(self, slot: int) -> tuple[int, ...]:
        return tuple(int(a.ctypes.data) for a in self.slots[slot])


def _layer_meta(plan: Plan, kv: _PrefillKv) -> dict[str, Any]:
    from sfa_rd2h.spec import wire

    n = len(plan.tbytes)
    return {
        f"layer.{layer}": wire.LayerMeta(kv.bases(layer % plan.cfg.slots), plan.tbytes,
                                         (1,) * n, (0, 0, 1, 1)[:n], 2, plan.cfg.indexer)
        for layer in range(plan.cfg.layers)
    }


def _prefill_fetch(plan: Plan, out: queue.Queue, stop: threading.Event) -> None:
    """Prefill scheduler's intake: long-poll the proxy until every request arrived."""
    from sfa_rd2h.runtime.metaserver import fetch_work

    got = 0
    while got < plan.n and not stop.is_set():
        try:
            jobs = fetch_work(plan.proxy_url, "prefill", "prefill-0", timeout=WORK_POLL_S)
        except OSError:
            # The proxy unreachable (link-cut: this host's link is down), or the answer
            # lost with the connection: poll again. Work a long poll took for a client
            # that went away goes back to its queue on the proxy.
            if plan.cfg.inject != "link-cut":
                raise
            stop.wait(FETCH_RETRY_S)
            continue
        for job in jobs:
            out.put(job)
            got += len(job["requests"])


def prefill_rank(plan: Plan, rank: int, chan: Channel, peers: list[Connection],
                  inbox: Connection | None) -> None:
    from sfa_rd2h.runtime.control import PrefillWorker
    from sfa_rd2h.runtime.metaserver import report_finished
    from sfa_rd2h.statemachines.cores.prefill import LayerSendError, PrefillCore

    cfg = plan.cfg
    doomed = cfg.inject == "kill-prefill" and rank == cfg.p_tp - 1  # crashes mid-layer
    # Each resource is owned by the stack from the moment it exists, so a failure or a
    # SIGTERM at any point still closes the engine (its /dev/shm files) and the trace.
    with ExitStack() as stack:
        tracer = make_tracer(plan, f"prefill{rank}", role="prefill", rank=rank)
        stack.callback(close_quietly, tracer.close)
        engine = make_engine(cfg.engine, **engine_kwargs(cfg, "prefill"))
        stack.callback(close_quietly, engine.close)
        session = engine.initialize(plan.address("prefill"), 0)
        kv = _PrefillKv(plan, engine)
        core = PrefillCore(rank, tp_mapping(cfg.p_tp, cfg.d_tp), session, _layer_meta(plan, kv),
                           block_size=cfg.block_tokens,
                           reply_timeout=cfg.timeouts()["reply_timeout"],
                           observer=tracer)
        worker = PrefillWorker(core, tracer=tracer)
        stack.callback(close_quietly, worker.close)
        pats = [Patterns(nbytes) for nbytes in plan.tbytes]
        errors: list[str] = []
        steps: list[list[str]] = []
        # Per request, the first gate error (S4) of a publication that carried it: the gate
        # of layer l's slot fails for the step that last published that slot.
        failed: dict[str, str] = {}
        last_pub: dict[int, list[str]] = {}

        def blame(layer: int, exc: LayerSendError) -> None:
            errors.append(str(exc))
            for ext in last_pub.get(layer % cfg.slots, []):
                failed.setdefault(ext, str(exc))
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
                    blame(layer, exc)
                t1 = time.perf_counter()
                worker.begin_layer(layer)
                last_pub[layer % cfg.slots] = [s[0] for s in step]
                slot = kv.slots[layer % cfg.slots]
                for req, pos, ids, idx in writes:
                    if req == stale and layer == cfg.inject_layer:
                        continue  # --inject stale-kv: published, never written (failure 4)
                    for t, arr in enumerate(slot):
                        arr[ids if t < 2 else idx] = pats[t].blocks(req, layer, pos, t)
                    if doomed and layer == cfg.inject_layer:
                        crash(tracer)  # kill-prefill: mid-layer, part of its KV written
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
                send_to_live(peers, ("step", step))  # kill-prefill: the others go on
                run_step(step)
                steps.append([s[0] for s in step])
                chan.send("step", [s[0] for s in step if s[5]])  # requests fully computed
                active = [r for r in active if r["done"] < r["tokens"]]
            send_to_live(peers, ("end",))  # the killed rank may die after its last step
            stop.set()
            fetcher.join(FETCH_JOIN_S)
        else:
            assert inbox is not None
            while True:
                msg = inbox.recv()
                if msg[0] == "end":
                    break
                run_step(msg[1])
                steps.append([s[0] for s in msg[1]])
        # Every slot's latest publication answered: its failure is observed and blamed on
        # the requests it carried (S4), then nothing is left for drain but to confirm it.
        for layer in range(min(cfg.slots, cfg.layers)):
            try:
                worker.wait_for_layer_send(layer, cfg.timeout)
            except LayerSendError as exc:
                blame(layer, exc)
        errors += worker.drain(cfg.timeout)
        if rank == 0:
            for ext in plan.index:
                report_finished(plan.proxy_url, ext, ok=ext not in failed, role="prefill",
                                error=failed.get(ext))
    # Closed: every READY was answered (drain), so no Decode read needs this memory any
    # more, and the parent never stops a Decode rank under a live connection.
    chan.send("report", {
        "role": "prefill", "rank": rank, "errors": errors, "steps": steps,
        "rtts": worker.round_trips(), "stale_replies": core.stale_replies,
        "frames_sent": worker.stats.frames_sent, "peers_lost": worker.stats.peers_lost,
        "gate_wait_seconds": timing["gate_wait"], "compute_seconds": timing["compute"],
        "request_errors": failed, "requests": sorted({e for s in steps for e in s}),
        # S1: every slot free again once drained (a slot left held would block its layer)
        "slots_held": [layer for layer in range(min(cfg.slots, cfg.layers))
                       if not worker.layer_settled(layer)],
        "threads_left": live_threads(),
    })


