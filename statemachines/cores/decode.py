"""Sans-IO protocol core of one Decode TP rank.

It keeps the MF_META of every Prefill connection (W1, F3), runs one ``decode_layer_read``
machine per READY (validation L1, bounded wait for destinations C1, one batched read C4,
exactly one reply S3) and one ``request_status`` machine per external request (R1-R5).
Prefill sends every contributor the chunk's full block lists; this core cuts its own share
of each entry when it plans the read (T2, T3, T5, T6), exactly as the upstream Decode does,
so mixed deployments move every block once.
Inputs are raw frames, transfer results and ``now``; outputs are actions. The same object
runs under the ZMQ reader thread and under the model checker.

Nothing is written for a request once it left ``registered`` (R5, "no write after terminal"):
its entries are dropped from later READYs, and its terminal state is reached only when no
read that covers it is still in flight.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from sfa_rd2h.spec import wire
from sfa_rd2h.spec.errors import ProtocolError
from sfa_rd2h.spec.layout import DestLayout, ReadPlan, plan_layer_reads, validate_layer
from sfa_rd2h.spec.topology import Cut, decode_cut
from sfa_rd2h.statemachines.cores.actions import (
    Action,
    IssueRead,
    RequestFinished,
    RequestReady,
    Send,
)
from sfa_rd2h.statemachines.engine import Driver, Observer
from sfa_rd2h.statemachines.models import LayerRead, RequestStatus


@dataclass(eq=False)
class DecodeRequest:
    status: RequestStatus
    main_dest: np.ndarray
    indexer_dest: np.ndarray
    deadline: float
    ratio: int | None = None
    inflight: int = 0  # batched reads in flight that write into this request


@dataclass(eq=False)
class ServedReady:
    """One READY being served, with what the core decided for it."""

    peer: str
    msg: wire.ReadReadyBatch | None  # None: a malformed frame whose layer was identifiable
    read: LayerRead
    deadline: float = 0.0
    live: tuple[str, ...] = ()


@dataclass
class DecodeStats:
    rejected_frames: int = 0
    skipped_entries: int = 0  # entries of requests that are already terminal (R5)
    replies: dict[str, int] = field(default_factory=lambda: {"done": 0, "failed": 0})


class DecodeCore:
    """One Decode TP rank's view of the protocol."""

    def __init__(
        self,
        d_rank: int,
        d_tp: int,
        dest_layouts: Mapping[str, DestLayout],
        *,
        destination_wait: float = 10.0,
        request_deadline: float = 300.0,
        memory: int = 65536,
        main_dest_shared: bool = True,
        observer: Observer | None = None,
    ) -> None:
        self.d_rank = d_rank
        self.d_tp = d_tp
        # T5: the main destination is one pool shared by the Decode TP ranks (Ascend's CPU
        # pool), so each rank reads a piece; False for a per-rank KV cache (vLLM on CPU).
        self.main_dest_shared = main_dest_shared
        self.dest_layouts = dict(dest_layouts)
        self.destination_wait = destination_wait
        self.request_deadline = request_deadline
        self._reads = Driver("decode_layer_read", observer)
        self._requests = Driver("request_status", observer)
        self.connections: dict[str, wire.MfMeta] = {}
        self.requests: dict[str, DecodeRequest] = {}
        # Tombstones (ext id -> succeeded) let late READYs be skipped instead of waited for
        # (R5); failures of not-yet-registered requests fail them on registration. Both are
        # bounded, oldest first, so a long-running Decode does not grow without limit.
        self.terminal: dict[str, bool] = {}
        self._failed_unregistered: dict[str, str] = {}
        self.memory = memory
        self._waiting: list[ServedReady] = []
        self._inflight: dict[int, ServedReady] = {}
        self._read_ids = itertools.count(1)
        self._serial = itertools.count()
        self.stats = DecodeStats()

    # ----------------------------------------------------------------- requests (C1)
    def register_request(self, ext_req_id: str, main_dest: Sequence[int],
                         indexer_dest: Sequence[int], now: float) -> list[Action]:
        """vLLM allocated this request's destinations; READYs for it may now be served."""
        if ext_req_id in self.requests or ext_req_id in self.terminal:
            raise ProtocolError(f"C1: request {ext_req_id!r} is already registered")
        status = self._requests.start(RequestStatus(ext_req_id))
        req = self.requests[ext_req_id] = DecodeRequest(
            status, np.asarray(main_dest, dtype=np.int64),
            np.asarray(indexer_dest, dtype=np.int64), now + self.request_deadline)
        actions: list[Action] = []
        early = self._failed_unregistered.pop(ext_req_id, None)
        if early is not None:
            self._requests.fire(status, "read_failed", early)
            actions += self._maybe_ready(req)
        still_waiting = []
        for ready in self._waiting:
            if ext_req_id in ready.read.missing:
                ready.read.missing = ready.read.missing - {ext_req_id}
                if not ready.read.missing:
                    self._reads.fire(ready.read, "destinations_arrived")
                    actions += self._plan(ready, now)
                    continue
            still_waiting.append(ready)
        self._waiting = still_waiting
        return actions

    def local_outcome(self, ext_req_id: str) -> bool | None:
        """True/False once this rank is locally terminal and no read still writes into the
        request's blocks; None before that (R1 agreement input)."""
        req = self.requests.get(ext_req_id)
        if req is None or req.inflight or req.status.state == "registered":
            return None
        return req.status.state == "local_ok"

    def apply_agreement(self, ext_req_id: str, all_ok: bool) -> list[Action]:
        """The TP group agreed (R1, R2): make the request terminal and forget its blocks."""
        req = self.requests.get(ext_req_id)
        if req is None or self.local_outcome(ext_req_id) is None:
            raise ProtocolError(f"R1: request {ext_req_id!r} is not ready for TP agreement")
        self._requests.fire(req.status, "tp_agreed", all_ok)
        self._forget(ext_req_id)
        ok = req.status.state == "succeeded"
        _remember(self.terminal, ext_req_id, ok, self.memory)
        error = req.status.error or (None if ok else "R1: another Decode TP rank failed")
        return [RequestFinished(ext_req_id, ok, error)]

    def _maybe_ready(self, req: DecodeRequest) -> list[Action]:
        outcome = self.local_outcome(req.status.key)
        return [] if outcome is None else [RequestReady(req.status.key, outcome)]

    def _fail_request(self, ext_req_id: str, error: str) -> list[Action]:
        req = self.requests.get(ext_req_id)
        if req is None or not self._requests.can(req.status, "read_failed"):
            return []
        self._requests.fire(req.status, "read_failed", error)
        return self._maybe_ready(req)

    # ----------------------------------------------------------------- frames
    def on_frame(self, peer: str, payload: bytes, now: float) -> list[Action]:
        """One payload frame from a Prefill connection (the ZMQ identity is ``peer``)."""
        try:
            msg = wire.decode(payload)
        except ProtocolError as exc:
            self.stats.rejected_frames += 1
            refusal = wire.meta_refusal(payload, str(exc))
            if refusal is not None:  # W1: an MF_META we cannot accept is answered, why included
                self.connections.pop(peer, None)
                return [Send(peer, refusal)]
            return self._answer_malformed(peer, payload, exc)
        if isinstance(msg, wire.MfMeta):
            return self._on_meta(peer, msg)
        if isinstance(msg, wire.ReadReadyBatch):
            return self._on_ready(peer, msg, now)
        self.stats.rejected_frames += 1
        return []

    def _answer_malformed(self, peer: str, payload: bytes, exc: ProtocolError) -> list[Action]:
        """W5: answer what can be answered, so the sender's gate does not hang."""
        layer = wire.layer_of(payload)
        if layer is None:
            return []
        read = self._reads.start(LayerRead(self._read_key(peer, layer), layer))
        return self._reject(ServedReady(peer, None, read), f"W5: {exc}")

    def _on_meta(self, peer: str, msg: wire.MfMeta) -> list[Action]:
        ack = wire.check_versions(msg)
        if ack.accepted:
            self.connections[peer] = msg
        else:
            self.connections.pop(peer, None)
        return [Send(peer, wire.encode_meta_reply(msg, ack))]

    def _read_key(self, peer: str, layer_idx: int) -> str:
        return f"{peer}/L{layer_idx}/{next(self._serial)}"

    def _on_ready(self, peer: str, msg: wire.ReadReadyBatch, now: float) -> list[Action]:
        read = self._reads.start(LayerRead(self._read_key(peer, msg.layer_idx), msg.layer_idx))
        ready = ServedReady(peer, msg, read)
        meta = self.connections.get(peer)
        if meta is None:
            return self._reject(ready, f"W1: READY for layer {msg.layer_idx} before MF_META "
                                       "on this connection")
        src = meta.layers.get(msg.layer_name)
        dst = self.dest_layouts.get(msg.layer_name)
        if src is None or dst is None:
            side = "prefill MF_META" if src is None else "decode registration"
            return self._reject(ready, f"L1: layer {msg.layer_name!r} is missing from {side}")
        try:
            self._validate_layout(src, dst)
        except ProtocolError as exc:
            return self._reject(ready, str(exc))
        empty = next((e.ext_req_id for e in msg.read_reqs
                      if not e.p_main_block_ids and not e.p_indexer_block_ids), None)
        if empty is not None:
            return self._reject(ready, f"T6: entry for {empty!r} carries no block at all")
        missing = frozenset(
            e.ext_req_id for e in msg.read_reqs
            if e.ext_req_id not in self.requests and e.ext_req_id not in self.terminal
            and e.ext_req_id not in self._failed_unregistered)
        if missing:
            return self._await_destinations(ready, missing, now)
        return self._plan(ready, now)

    # Hooks: the model checker's seeded bugs override these, nothing else does.
    def _validate_layout(self, src: wire.LayerMeta, dst: DestLayout) -> None:
        validate_layer(src, dst)  # L1, before anything is planned

    def _ratio_conflict(self, req: DecodeRequest, msg: wire.ReadReadyBatch) -> bool:
        # known failure 3: never trust the first ratio seen for a request
        return req.ratio != msg.tp_ratio

    def _final_signal(self, req: DecodeRequest, msg: wire.ReadReadyBatch) -> tuple[int, int]:
        return msg.group_member_idx, msg.tp_ratio

    def _await_destinations(self, ready: ServedReady, missing: frozenset[str],
                            now: float) -> list[Action]:
        """C1 (known failure 5): wait a bounded time for vLLM to register destinations."""
        ready.read.missing = missing
        self._reads.fire(ready.read, "accept")
        ready.deadline = now + self.destination_wait
        self._waiting.append(ready)
        return []

    def _is_live(self, req: DecodeRequest) -> bool:
        return req.status.state == "registered"

    def _forget(self, ext_req_id: str) -> None:
        del self.requests[ext_req_id]

    def _cut(self, entry: wire.ReadReq, n_indexer: int, member: int, ratio: int) -> Cut:
        """T6: what this rank reads of an entry that carries the chunk's full lists."""
        return decode_cut(len(entry.p_main_block_ids), n_indexer, entry.main_dest_start,
                          entry.indexer_dest_start, member, ratio, self.d_rank, self.d_tp,
                          main_shared=self.main_dest_shared)

    def _plan_layer(self, src: wire.LayerMeta, dst: DestLayout, live: list[wire.ReadReq],
                    msg: wire.ReadReadyBatch) -> ReadPlan:
        """One plan for the whole layer: each live entry is cut to this rank's share (T6),
        then the block ids of every entry are joined so the layout is checked once and numpy
        builds and coalesces all descriptors in one pass."""
        if not live:
            return ReadPlan.empty()
        member, ratio = msg.group_member_idx, msg.tp_ratio
        main_src, main_dst, idx_src, idx_dst = [], [], [], []
        for e in live:
            req = self.requests[e.ext_req_id]
            n_idx = len(e.p_indexer_block_ids) if dst.has_indexer else 0
            cut = self._cut(e, n_idx, member, ratio)
            lo, hi = cut.main
            if member == 0:  # L1: the whole range must fit before any piece is read
                _dest_slice(req.main_dest, e.main_dest_start, len(e.p_main_block_ids), "main")
            main_src.append(e.p_main_block_ids[lo:hi])
            main_dst.append(_dest_slice(req.main_dest, e.main_dest_start + lo, hi - lo, "main"))
            lo, hi = cut.indexer
            _dest_slice(req.indexer_dest, e.indexer_dest_start, n_idx, "indexer")
            idx_src.append(e.p_indexer_block_ids[lo:hi])
            idx_dst.append(_dest_slice(req.indexer_dest, e.indexer_dest_start + lo, hi - lo,
                                       "indexer"))
        return plan_layer_reads(src, dst, _join(main_src), np.concatenate(main_dst),
                                _join(idx_src), np.concatenate(idx_dst))

    def _transfer_result(self, result: int) -> int:
        return result

    def _must_reply(self, ready: ServedReady) -> bool:
        return True

    def _live_entries(self, msg: wire.ReadReadyBatch) -> tuple[list[wire.ReadReq], list[Action]]:
        """The entries still to be written, after the contributor's ratio is checked against
        what earlier contributors of each request said (R1, T1; known failure 3). Requests
        that are locally complete or failed take no more writes (R5)."""
        live: list[wire.ReadReq] = []
        actions: list[Action] = []
        for entry in msg.read_reqs:
            req = self.requests.get(entry.ext_req_id)
            if req is not None and self._is_live(req):
                if req.ratio is None:
                    req.ratio = msg.tp_ratio
                elif self._ratio_conflict(req, msg):
                    self._requests.fire(
                        req.status, "ratio_conflict",
                        f"T1: contributor {msg.group_member_idx} reports tp_ratio="
                        f"{msg.tp_ratio}, request already has tp_ratio={req.ratio}")
                    actions += self._maybe_ready(req)
                    continue
                live.append(entry)
            else:
                self.stats.skipped_entries += 1
        return live, actions

    def _plan(self, ready: ServedReady, now: float) -> list[Action]:
        """Build one batched read for every live request of the layer (C4, L1)."""
        msg = ready.msg
        meta = self.connections.get(ready.peer)
        if meta is None:  # the connection restarted while this READY waited
            return self._reject(ready, "W1: connection lost its MF_META while waiting")
        src = meta.layers[msg.layer_name]
        dst = self.dest_layouts[msg.layer_name]
        live, actions = self._live_entries(msg)
        try:
            plan = self._plan_layer(src, dst, live, msg)
        except ProtocolError as exc:
            return actions + self._reject(ready, str(exc))
        ready.live = tuple(e.ext_req_id for e in live)
        ready.read.n_reads = len(plan)
        self._reads.fire(ready.read, "accept")
        if ready.read.state == "done":
            return actions + self._finish(ready)
        read_id = next(self._read_ids)
        self._inflight[read_id] = ready
        for ext in ready.live:
            self.requests[ext].inflight += 1
        return actions + [IssueRead(read_id, meta.p_session, plan)]

    def read_result(self, read_id: int, result: int, now: float) -> list[Action]:
        """The batched read ``read_id`` returned ``result`` (0 = every byte landed, F2)."""
        ready = self._inflight.pop(read_id, None)
        if ready is None:
            raise ProtocolError(f"C4: result for unknown read {read_id}")
        for ext in ready.live:
            req = self.requests.get(ext)
            if req is not None:
                req.inflight -= 1
        self._reads.fire(ready.read, "read_completed", self._transfer_result(result))
        return self._finish(ready)

    def _reject(self, ready: ServedReady, error: str) -> list[Action]:
        self._reads.fire(ready.read, "reject", error)
        return self._finish(ready)

    def _finish(self, ready: ServedReady) -> list[Action]:
        """Exactly one reply per READY (S3), then request bookkeeping (R1, R4, R5)."""
        read, msg = ready.read, ready.msg
        actions: list[Action] = []
        if read.state == "done":
            self.stats.replies["done"] += 1
            if self._must_reply(ready):
                actions.append(Send(ready.peer, wire.encode(wire.ReadDone(read.layer_idx))))
            for ext in msg.done_ext_ids:
                req = self.requests.get(ext)
                if req is None or not self._requests.can(req.status, "contributor_final"):
                    continue
                self._requests.fire(req.status, "contributor_final",
                                    *self._final_signal(req, msg))
                actions += self._maybe_ready(req)
            # a request whose last read just landed may now be ready for agreement
            for ext in ready.live:
                req = self.requests.get(ext)
                if (req is not None and req.status.state != "registered"
                        and ext not in msg.done_ext_ids):
                    actions += self._maybe_ready(req)
        else:
            self.stats.replies["failed"] += 1
            error = read.error or "read failed"
            actions.append(Send(ready.peer, wire.encode(wire.ReadFailed(read.layer_idx, error))))
            if msg is not None:
                for entry in msg.read_reqs:
                    req = self.requests.get(entry.ext_req_id)
                    if req is None:
                        if entry.ext_req_id not in self.terminal:
                            if entry.ext_req_id not in self._failed_unregistered:
                                _remember(self._failed_unregistered, entry.ext_req_id, error,
                                          self.memory)
                    elif req.status.state == "registered":
                        actions += self._fail_request(entry.ext_req_id, error)
                    else:
                        actions += self._maybe_ready(req)
        return actions

    # ----------------------------------------------------------------- time
    def tick(self, now: float) -> list[Action]:
        """Expire bounded waits: READYs whose destinations never came (C1) and requests
        whose contributors never finished."""
        actions: list[Action] = []
        expired = [r for r in self._waiting if now >= r.deadline]
        self._waiting = [r for r in self._waiting if now < r.deadline]
        for ready in expired:
            missing = ", ".join(sorted(ready.read.missing))
            self._reads.fire(ready.read, "wait_expired",
                             f"C1: destinations of {missing} not registered within "
                             f"{self.destination_wait}s")
            actions += self._finish(ready)
        for req in list(self.requests.values()):
            if req.status.state == "registered" and now >= req.deadline:
                self._requests.fire(req.status, "deadline_expired",
                                    f"R1: contributors incomplete after {self.request_deadline}s")
                actions += self._maybe_ready(req)
        return actions

    def has_waiting_reads(self) -> bool:
        return bool(self._waiting)

    def next_deadline(self) -> float | None:
        times = [r.deadline for r in self._waiting]
        times += [r.deadline for r in self.requests.values() if r.status.state == "registered"]
        return min(times, default=None)

    def connection_lost(self, peer: str) -> None:
        """A Prefill connection went away: its next READY needs a new MF_META (W1)."""
        self.connections.pop(peer, None)


def _remember(table: dict, key: str, value: object, limit: int) -> None:
    """Insert, evicting the oldest entries beyond ``limit`` (dicts keep insertion order)."""
    table[key] = value
    while len(table) > limit:
        del table[next(iter(table))]


def _join(id_lists: list[tuple[int, ...]]) -> np.ndarray:
    """Concatenate block id tuples into one int64 array without per-id Python work."""
    total = sum(len(ids) for ids in id_lists)
    return np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int64, count=total)


def _dest_slice(dest: np.ndarray, start: int, count: int, what: str) -> np.ndarray:
    """L1: the destination range of an entry must lie inside the registered blocks."""
    if start < 0 or start + count > dest.size:
        raise ProtocolError(
            f"L1: {what} destination range [{start}, {start + count}) outside the "
            f"{dest.size} registered blocks")
    return dest[start:start + count]
