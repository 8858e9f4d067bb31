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

import functools
import heapq
import itertools
import operator
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from sfa_rd2h.spec import wire
from sfa_rd2h.spec.errors import ProtocolError
from sfa_rd2h.spec.layout import (
    DestLayout,
    JoinedPairs,
    ReadPlan,
    plan_joined,
    validate_layer,
)
from sfa_rd2h.spec.timing import (
    DESTINATION_WAIT_S,
    READ_BUDGET_S,
    REQUEST_DEADLINE_S,
    check_timeouts,
)
from sfa_rd2h.spec.topology import Cuts, decode_cuts
from sfa_rd2h.statemachines.cores.actions import (
    Action,
    IssueRead,
    RequestFinished,
    RequestReady,
    Send,
)
from sfa_rd2h.statemachines.engine import Driver, Observer
from sfa_rd2h.statemachines.models import LayerRead, RequestStatus

#: R1: the error of a request that failed on another rank of the TP group, not this one.
ANOTHER_RANK_FAILED = "R1: another Decode TP rank failed"


@dataclass(eq=False)
class DecodeRequest:
    status: RequestStatus
    main_dest: np.ndarray
    indexer_dest: np.ndarray
    deadline: float
    ratio: int | None = None
    inflight: int = 0  # batched reads in flight that write into this request
    # C5: positions below these (main, indexer) are Decode's own local prefix hit
    own_main: int = 0
    own_indexer: int = 0


@dataclass(eq=False)
class ServedReady:
    """One READY being served, with what the core decided for it."""

    peer: str
    # None: a malformed frame whose layer was identifiable, or a READY waiting for its
    # destinations, which keeps only its frame (``payload``) instead of the ~8x larger
    # decoded message
    msg: wire.ReadReadyBatch | None
    read: LayerRead
    deadline: float = 0.0
    live: tuple[str, ...] = ()
    # Whether the READY came on a connection with an accepted MF_META: only such a READY
    # may fail requests or leave failure evidence (an unauthenticated peer cannot).
    trusted: bool = False
    payload: bytes | None = None
    seq: int = -1  # its key among the waiting READYs (not id(): the checker deep-copies)
    # the count of request changes when its read was issued, if every request it reads
    # was registered then (while the count stays, they all still are); -1 otherwise
    quiet: int = -1


@dataclass(frozen=True)
class DecodeLimits:
    """The bound of every table a Decode core keeps, so no peer can grow it without limit.

    An overflow refuses the newest work with an error that names the limit; it never drops
    evidence of an older failure (R5).
    """

    #: finished requests remembered so late READYs are skipped (oldest forgotten first:
    #: a late READY for a forgotten request only waits and fails, it writes nothing)
    tombstones: int = 65536
    #: requests failed before vLLM registered them, remembered exactly; beyond this they go
    #: into a fixed-size hashed set that may fail an innocent request but never lets a
    #: failed one succeed
    early_failures: int = 65536
    #: READYs waiting for destinations (C1), by count and by the size of their frames
    waiting_readys: int = 4096
    waiting_bytes: int = 256 * 1024 * 1024
    #: Prefill connections with an accepted MF_META (W1); when full, one idle for
    #: ``connection_idle`` seconds gives way, otherwise the new MF_META is refused
    connections: int = 4096
    connection_idle: float = 600.0


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
        destination_wait: float = DESTINATION_WAIT_S,
        read_budget: float = READ_BUDGET_S,
        request_deadline: float = REQUEST_DEADLINE_S,
        main_dest_shared: bool = True,
        limits: DecodeLimits | None = None,
        observer: Observer | None = None,
    ) -> None:
        self.d_rank = d_rank
        self.d_tp = d_tp
        # T5: the main destination is one pool shared by the Decode TP ranks (Ascend's CPU
        # pool), so each rank reads a piece; False for a per-rank KV cache (vLLM on CPU).
        self.main_dest_shared = main_dest_shared
        self.dest_layouts = dict(dest_layouts)
        check_timeouts(destination_wait=destination_wait, read_budget=read_budget)
        self.destination_wait = destination_wait
        self.read_budget = read_budget
        self.request_deadline = request_deadline
        self.limits = limits or DecodeLimits()
        self._reads = Driver("decode_layer_read", observer)
        self._requests = Driver("request_status", observer)
        self.connections: dict[str, wire.MfMeta] = {}
        self._last_seen: dict[str, float] = {}  # connection -> last frame, oldest first
        self.requests: dict[str, DecodeRequest] = {}
        # Tombstones (ext id -> succeeded) let late READYs be skipped instead of waited for
        # (R5); failures of not-yet-registered requests fail them on registration.
        self.terminal: dict[str, bool] = {}
        self._failed_unregistered: dict[str, str] = {}
        self._failed_overflow = bytearray(_OVERFLOW_BITS // 8)
        self._overflowed = 0
        # READYs waiting for destinations, indexed by the ids they wait for, and one heap
        # of deadlines (READYs and requests), so the cost of a frame, a registration or a
        # tick does not grow with how much is waiting.
        self._waiting_by_id: dict[str, list[ServedReady]] = {}
        self._waiting: dict[int, ServedReady] = {}  # seq -> ready, arrival order
        self._waiting_bytes = 0
        self._deadlines: list[tuple[float, int, str, object]] = []
        self._inflight: dict[int, ServedReady] = {}
        self._read_ids = itertools.count(1)
        self._serial = itertools.count()
        # the destinations last planned, joined, and what planning learned of the pairs
        self._last_joined: tuple[list[np.ndarray], np.ndarray, JoinedPairs | None] = (
            [], _NO_BLOCKS, None)
        # the last layer whose entries were all live, for the step's next layer (_Step)
        self._step: _Step | None = None
        # requests registered and transitions fired so far (a request's entry in
        # ``requests``, its state, ratio and finals change only with this count)
        self._request_changes = 0
        self.stats = DecodeStats()

    # ----------------------------------------------------------------- requests (C1)
    def register_request(self, ext_req_id: str, main_dest: Sequence[int],
                         indexer_dest: Sequence[int], now: float, *, own_main: int = 0,
                         own_indexer: int = 0) -> list[Action]:
        """vLLM allocated this request's destinations; READYs for it may now be served.

        ``own_main`` / ``own_indexer``: how many leading positions of each list Decode
        computed itself (its local prefix hit). No read ever writes them (C5), whatever
        positions a READY names."""
        if ext_req_id in self.requests or ext_req_id in self.terminal:
            raise ProtocolError(f"C1: request {ext_req_id!r} is already registered")
        main, indexer = _frozen_ids(main_dest), _frozen_ids(indexer_dest)
        for name, own, dest in (("own_main", own_main, main),
                                ("own_indexer", own_indexer, indexer)):
            if not (isinstance(own, int) and 0 <= own <= dest.size):
                raise ProtocolError(f"C5: {name}={own!r} of request {ext_req_id!r} is not a "
                                    f"position in its {dest.size} registered blocks")
        status = self._requests.start(RequestStatus(ext_req_id))
        self._request_changes += 1
        req = self.requests[ext_req_id] = DecodeRequest(
            status, main, indexer, now + self.request_deadline,
            own_main=own_main, own_indexer=own_indexer)
        heapq.heappush(self._deadlines, (req.deadline, next(self._serial), "request", ext_req_id))
        actions: list[Action] = []
        early = self._failed_unregistered.pop(ext_req_id, None)
        if early is None and self._maybe_failed(ext_req_id):
            early = ("R5: a READY for this request may have failed before it was registered "
                     f"(more than {self.limits.early_failures} early failures at once); "
                     "failing it rather than risking missing KV")
        if early is not None:
            self._fire_request(status, "read_failed", early)
            actions += self._maybe_ready(req)
        return actions + self._stop_awaiting(ext_req_id, now)

    def forget_unregistered(self, ext_req_id: str, now: float) -> list[Action]:
        """vLLM ended a request before allocating its destinations (its client left before
        Decode admitted it, while Prefill, dispatched early, C3, already sends): it will
        never be registered. READYs stop waiting for it and skip its entries (R5), so
        Prefill's slots are answered now rather than when ``destination_wait`` runs out
        (C1). A no-op for a registered or terminal request."""
        if ext_req_id in self.requests or ext_req_id in self.terminal:
            return []
        _remember(self.terminal, ext_req_id, False, self.limits.tombstones)
        self._failed_unregistered.pop(ext_req_id, None)
        return self._stop_awaiting(ext_req_id, now)

    def _stop_awaiting(self, ext_req_id: str, now: float) -> list[Action]:
        """The READYs that waited for ``ext_req_id``'s destinations wait no more for it;
        those that wait for nothing else are served now (C1)."""
        actions: list[Action] = []
        for ready in self._waiting_by_id.pop(ext_req_id, ()):
            if self._waiting.get(ready.seq) is not ready:
                continue
            ready.read.missing = ready.read.missing - {ext_req_id}
            if not ready.read.missing:
                actions += self._serve_waiting(ready, "destinations_arrived", now)
        return actions

    def _serve_waiting(self, ready: ServedReady, event: str, now: float) -> list[Action]:
        """A READY waits for destinations no more (``event``): plan it for the requests
        that are registered; the others' entries are skipped (R5)."""
        self._stop_waiting(ready)
        ready.read.missing = frozenset()
        self._reads.fire(ready.read, event)
        return self._plan(ready, now)

    def abort_request(self, ext_req_id: str, reason: str, now: float) -> list[Action]:
        """Give up on a registered request now (vLLM aborted it, or its rendezvous could not
        be posted): its deadline is brought forward through ``deadline_expired`` (R1, C1),
        later entries for it are skipped (R5), and its ``RequestReady`` comes once no read
        writes into its blocks any more. A no-op for an unknown or terminal request."""
        req = self.requests.get(ext_req_id)
        if req is None or not self._requests.can(req.status, "deadline_expired"):
            return []
        self._fire_request(req.status, "deadline_expired", f"C1: {reason}")
        return self._maybe_ready(req)

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
        self._fire_request(req.status, "tp_agreed", all_ok)
        self._forget(ext_req_id)
        ok = req.status.state == "succeeded"
        _remember(self.terminal, ext_req_id, ok, self.limits.tombstones)
        error = req.status.error or (None if ok else ANOTHER_RANK_FAILED)
        return [RequestFinished(ext_req_id, ok, error)]

    def _fire_request(self, status: RequestStatus, trigger: str, *args: object) -> None:
        """Fire a request's machine; every change to the requests goes through here or
        ``register_request``, so an unchanged count means unchanged requests."""
        self._request_changes += 1
        self._requests.fire(status, trigger, *args)

    def _maybe_ready(self, req: DecodeRequest) -> list[Action]:
        outcome = self.local_outcome(req.status.key)
        return [] if outcome is None else [RequestReady(req.status.key, outcome)]

    def _fail_request(self, ext_req_id: str, error: str) -> list[Action]:
        req = self.requests.get(ext_req_id)
        if req is None or not self._requests.can(req.status, "read_failed"):
            return []
        self._fire_request(req.status, "read_failed", error)
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
            return self._on_meta(peer, msg, now)
        if isinstance(msg, wire.ReadReadyBatch):
            if peer in self._last_seen:  # least recently used connections first
                del self._last_seen[peer]
                self._last_seen[peer] = now
            return self._on_ready(peer, msg, now, payload)
        self.stats.rejected_frames += 1
        return []

    def _answer_malformed(self, peer: str, payload: bytes, exc: ProtocolError) -> list[Action]:
        """W5: answer what can be answered, so the sender's gate does not hang."""
        layer = wire.layer_of(payload)
        if layer is None:
            return []
        read = self._reads.start(LayerRead(self._read_key(peer, layer), layer))
        return self._reject(ServedReady(peer, None, read), f"W5: {exc}")

    def _on_meta(self, peer: str, msg: wire.MfMeta, now: float) -> list[Action]:
        ack = wire.check_versions(msg)
        if ack.accepted and peer not in self.connections and not self._room_for(now):
            ack = wire.MfMetaAck(
                False, ack.protocol_version, ack.layout_version,
                f"W1: {len(self.connections)} connections reached the limit of "
                f"{self.limits.connections} and none was idle for "
                f"{self.limits.connection_idle}s")
        if ack.accepted:
            # Only the layers this rank registered can ever be read; the rest is not kept.
            known = {n: m for n, m in msg.layers.items() if n in self.dest_layouts}
            self.connections[peer] = replace(msg, layers=known)
            self._last_seen.pop(peer, None)
            self._last_seen[peer] = now
        else:
            self.connection_lost(peer)
        return [Send(peer, wire.encode_meta_reply(msg, ack))]

    def _room_for(self, now: float) -> bool:
        """Whether one more connection fits, giving way to the least recently used one if it
        has been idle long enough (its next READY is refused under W1)."""
        if len(self.connections) < self.limits.connections:
            return True
        oldest = next(iter(self._last_seen), None)
        if oldest is None or now - self._last_seen[oldest] < self.limits.connection_idle:
            return False
        self.connection_lost(oldest)
        return True

    def _read_key(self, peer: str, layer_idx: int) -> str:
        return f"{peer}/L{layer_idx}/{next(self._serial)}"

    def _on_ready(self, peer: str, msg: wire.ReadReadyBatch, now: float,
                  payload: bytes = b"") -> list[Action]:
        read = self._reads.start(LayerRead(self._read_key(peer, msg.layer_idx), msg.layer_idx,
                                           received_at=now, read_budget=self.read_budget))
        meta = self.connections.get(peer)
        ready = ServedReady(peer, msg, read, trusted=meta is not None, payload=payload)
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
        # A step's next layer (see _plan) waits for nothing: its requests were all live.
        body = wire.ready_body(payload) if payload and len(payload) <= _KEPT_BODY_BYTES else None
        key = None if body is None else (body, self._request_changes)
        if key is not None and self._step is not None and self._step.key == key:
            return self._plan(ready, now, key)
        # T6: an entry with both lists empty reads nothing, so it waits for no destinations
        # A READY also waits where an earlier one still waits for the same request: failure
        # evidence that came in between (another peer's refused READY, a false positive of
        # the hashed set) must not let a later layer, a final one above all, overtake it.
        known = self.requests.__contains__
        missing = frozenset() if all(map(known, map(_EXT_ID, msg.read_reqs))) else frozenset(
            e.ext_req_id for e in msg.read_reqs
            if (len(e.p_main_block_ids) or len(e.p_indexer_block_ids))
            and e.ext_req_id not in self.requests and e.ext_req_id not in self.terminal
            and (e.ext_req_id in self._waiting_by_id
                 or (e.ext_req_id not in self._failed_unregistered
                     and not self._maybe_failed(e.ext_req_id))))
        if missing:
            if (len(self._waiting) >= self.limits.waiting_readys
                    or self._waiting_bytes + len(payload) > self.limits.waiting_bytes):
                return self._reject(ready, (
                    f"C1: {len(self._waiting)} READYs ({self._waiting_bytes} bytes) already wait "
                    f"for destinations, the limit is {self.limits.waiting_readys} READYs and "
                    f"{self.limits.waiting_bytes} bytes"))
            return self._await_destinations(ready, missing, now)
        return self._plan(ready, now, key)

    # Hooks: the model checker's seeded bugs override these, nothing else does.
    def _validate_layout(self, src: wire.LayerMeta, dst: DestLayout) -> None:
        # L1 for every READY, before anything is planned; cheap, since spec.layout
        # remembers the (source, destination) pairs that passed
        validate_layer(src, dst)

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
        if ready.payload:
            ready.msg = None  # the frame is kept instead; decoded again when it is served
        ready.seq = next(self._serial)
        self._waiting[ready.seq] = ready
        self._waiting_bytes += len(ready.payload or b"")
        for ext in missing:
            self._waiting_by_id.setdefault(ext, []).append(ready)
        heapq.heappush(self._deadlines, (ready.deadline, next(self._serial), "ready", ready))
        return []

    def _stop_waiting(self, ready: ServedReady) -> None:
        self._waiting.pop(ready.seq, None)
        self._waiting_bytes -= len(ready.payload or b"")
        for ext in ready.read.missing:
            waiters = self._waiting_by_id.get(ext)
            if waiters is not None:
                waiters[:] = [r for r in waiters if r is not ready]
                if not waiters:
                    del self._waiting_by_id[ext]
        if ready.msg is None and ready.payload:
            msg = wire.decode(ready.payload)  # it decoded once already
            assert isinstance(msg, wire.ReadReadyBatch)
            ready.msg = msg
        ready.payload = None

    def _is_live(self, req: DecodeRequest) -> bool:
        return req.status.state == "registered"

    def _forget(self, ext_req_id: str) -> None:
        del self.requests[ext_req_id]

    def _cuts(self, n_main: np.ndarray, n_indexer: np.ndarray, main_start: np.ndarray,
              indexer_start: np.ndarray, member: int, ratio: int) -> Cuts:
        """T6: what this rank reads of each entry of a layer (entries carry the chunk's
        full lists)."""
        if ratio == 1 and member == 0 and self.d_tp == 1 and self.d_rank == 0:
            # One piece of one: decode_cuts' arithmetic would only hand back every list
            # whole (T2: member 0 reads main, T5: one Decode rank, T3: one contributor).
            nothing = np.zeros(n_main.size, dtype=np.int64)
            return Cuts(nothing, n_main, nothing, n_indexer)
        return decode_cuts(n_main, n_indexer, main_start, indexer_start, member, ratio,
                           self.d_rank, self.d_tp, main_shared=self.main_dest_shared)

    def _plan_layer(self, src: wire.LayerMeta, dst: DestLayout, live: list[wire.ReadReq],
                    msg: wire.ReadReadyBatch, key: tuple | None = None) -> ReadPlan:
        """One plan for the whole layer: the live entries are cut to this rank's share in
        one numpy pass (T6), their ranges checked against the registered destinations
        (L1), and the block ids of every entry, main then indexer, joined into one array
        so the layout is checked once and numpy checks, builds and coalesces all
        descriptors in one pass (C4). ``key``: where every entry is live, the READY's
        bytes past its layer (``wire.ready_body``) and the count of request changes."""
        if not live:
            return _EMPTY_PLAN
        # The same body and no request changed (so the same request objects, with the
        # same read-only destinations) cut (T6) and join into the very pairs that passed
        # the L1 range checks for the last layer: those are taken again, and only the
        # layout's part of planning runs (its limits, L1, and its bases, C4).
        cut = (dst.has_indexer, self.d_rank, self.d_tp, self.main_dest_shared)
        step = self._step
        if key is not None and step is not None and step.key == key and step.cut == cut:
            plan, step.pairs = plan_joined(src, dst, step.src_ids, step.dst_ids, step.split,
                                           known=step.pairs)
            return plan
        plan, src_ids, joined, split, pairs = self._plan_entries(src, dst, live, msg)
        if key is None or joined.size > _KEPT_IDS:
            self._step = None
            return plan
        reqs = [self.requests[e.ext_req_id] for e in live]
        self._step = _Step(key, cut, tuple(map(_EXT_ID, live)), reqs,
                           all(r.status.state == "registered" for r in reqs), src_ids, joined,
                           split, pairs)
        return plan

    def _plan_entries(self, src: wire.LayerMeta, dst: DestLayout, live: list[wire.ReadReq],
                      msg: wire.ReadReadyBatch
                      ) -> tuple[ReadPlan, np.ndarray, np.ndarray, int, JoinedPairs | None]:
        """:meth:`_plan_layer` entry by entry: the plan, and the joined source and
        destination ids, main's count and what planning learned of them."""
        member, ratio = msg.group_member_idx, msg.tp_ratio
        reqs = [self.requests[e.ext_req_id] for e in live]
        # One list per field, each turned into an array by one call: on a few dozen
        # entries that is cheaper than one row per entry.
        main = _Lists([e.p_main_block_ids for e in live], [r.main_dest for r in reqs],
                      [e.main_dest_start for e in live])
        if dst.has_indexer:
            idx = _Lists([e.p_indexer_block_ids for e in live], [r.indexer_dest for r in reqs],
                         [e.indexer_dest_start for e in live])
        else:  # a layer without indexer reads none, wherever it starts
            idx = _Lists([], [], [0] * len(live), counts=[0] * len(live),
                         sizes=[0] * len(live))
        cuts = self._cuts(main.n, idx.n, main.start, idx.start, member, ratio)
        owns = [self._own_prefix(r) for r in reqs]
        if any(a or b for a, b in owns):
            cuts = _without_own_prefix(cuts, main.start, idx.start, owns)
        main_whole, idx_whole = not cuts.main_lo.any(), not cuts.indexer_lo.any()
        # L1 first as one test per group that every range ends inside its destination and
        # no piece starts before it (starts are >= 0 by ReadReq's own checks), which every
        # valid layer passes; only a layer that fails it is checked range by range, for
        # the refusal's words and their order. Member 0 reads main, so all of main's range
        # must fit (T2); the indexer's whole range must fit for every member.
        if (main.outside(cuts.main_lo, cuts.main_hi, main_whole, whole_range=member == 0)
                or idx.outside(cuts.indexer_lo, cuts.indexer_hi, idx_whole, whole_range=True)):
            _check_ranges(main, idx, cuts, member)
        main_src, main_dst = main.pieces(cuts.main_lo, cuts.main_hi, main_whole)
        idx_src, idx_dst = idx.pieces(cuts.indexer_lo, cuts.indexer_hi, idx_whole)
        split = sum(map(len, main_src))
        dests = main_dst + idx_dst
        last, joined, pairs = self._last_joined
        if len(last) != len(dests) or not all(map(operator.is_, last, dests)):
            joined = np.concatenate(dests)
            joined.flags.writeable = False
        src_ids = np.concatenate(main_src + idx_src)
        plan, pairs = plan_joined(src, dst, src_ids, joined, split, known=pairs)
        # Every layer of a step serves the same requests with the same ids: from the second
        # layer on, the same whole destination arrays (read-only since registration) are
        # not joined again, and pairs equal by value to the last layer's are not proved
        # distinct again nor cut into runs again (L1 still checks their ranges against
        # this layer's layout, C4 adds its bases). Large layers are not kept.
        self._last_joined = (dests, joined, pairs if joined.size <= _KEPT_IDS else None)
        return plan, src_ids, joined, split, pairs

    def _own_prefix(self, req: DecodeRequest) -> tuple[int, int]:
        """C5: the (main, indexer) positions below which ``req``'s blocks are Decode's own."""
        return req.own_main, req.own_indexer

    def _transfer_result(self, result: int | BaseException) -> int | BaseException:
        return result

    def _must_reply(self, ready: ServedReady) -> bool:
        return True

    def _live_entries(self, msg: wire.ReadReadyBatch) -> tuple[list[wire.ReadReq], list[Action]]:
        """The entries still to be written, after the contributor's ratio is checked against
        what earlier contributors of each request said (R1, T1; known failure 3). Requests
        that are locally complete or failed take no more writes (R5)."""
        live: list[wire.ReadReq] = []
        actions: list[Action] = []
        member = msg.group_member_idx
        # R4: a final-layer READY this contributor already delivered is a replay; what it
        # names was read when the original came, and its slot may hold other KV since (S1).
        replayed = {e for e in msg.done_ext_ids if (r := self.requests.get(e)) is not None
                    and member in r.status.finals} if msg.done_ext_ids else ()
        get, is_live = self.requests.get, self._is_live
        for entry in msg.read_reqs:
            req = get(entry.ext_req_id)
            if req is not None and is_live(req) and entry.ext_req_id not in replayed:
                if req.ratio is None:
                    req.ratio = msg.tp_ratio
                elif self._ratio_conflict(req, msg):
                    self._fire_request(
                        req.status, "ratio_conflict",
                        f"T1: contributor {msg.group_member_idx} reports tp_ratio="
                        f"{msg.tp_ratio}, request already has tp_ratio={req.ratio}")
                    actions += self._maybe_ready(req)
                    continue
                live.append(entry)
            else:
                self.stats.skipped_entries += 1
        return live, actions

    def _plan(self, ready: ServedReady, now: float, key: tuple | None = None) -> list[Action]:
        """Build one batched read for every live request of the layer (C4, L1). ``key``:
        the READY's bytes past its layer (``wire.ready_body``) and the count of request
        changes when it came, if it came with its frame; None otherwise."""
        msg = ready.msg
        meta = self.connections.get(ready.peer)
        if meta is None:  # the connection restarted while this READY waited
            return self._reject(ready, "W1: connection lost its MF_META while waiting")
        src = meta.layers.get(msg.layer_name)
        if src is None:  # a new MF_META on this connection dropped the layer meanwhile
            return self._reject(ready, f"L1: layer {msg.layer_name!r} left the MF_META of "
                                       "this connection while the READY waited")
        dst = self.dest_layouts[msg.layer_name]
        # Every layer of a step sends the same entries (the frame's bytes past the layer
        # tell) while no request changes: then the entries are all live again, as they
        # were for the last layer, with nothing to skip or fail (R5, T1).
        step = self._step
        if key is not None and step is not None and step.key == key:
            live, actions = list(msg.read_reqs), []
        else:
            step = None
            live, actions = self._live_entries(msg)
            if len(live) != len(msg.read_reqs):
                key = None
        try:
            plan = self._plan_layer(src, dst, live, msg, key)
        except ProtocolError as exc:
            return actions + self._reject(ready, str(exc))
        step = self._step if key is not None else None
        if step is not None and step.key != key:  # nothing was kept for this layer
            step = None
        ready.live = step.live if step is not None else tuple(map(_EXT_ID, live))
        if step is not None and step.registered:
            ready.quiet = self._request_changes
        ready.read.n_reads = len(plan)
        self._reads.fire(ready.read, "accept")
        if ready.read.state == "done":
            return actions + self._finish(ready)
        read_id = next(self._read_ids)
        self._inflight[read_id] = ready
        for req in step.reqs if step is not None else map(self.requests.__getitem__,
                                                           ready.live):
            req.inflight += 1
        return actions + [IssueRead(read_id, meta.p_session, plan)]

    def read_result(self, read_id: int, result: int | BaseException,
                    now: float) -> list[Action]:
        """The batched read ``read_id`` returned ``result`` (0 = every byte landed) or raised
        it at ``now``: anything but 0 fails the layer (F2), and so does a read that finished
        past the read budget (S6)."""
        ready = self._inflight.pop(read_id, None)
        if ready is None:
            raise ProtocolError(f"C4: result for unknown read {read_id}")
        for req in map(self.requests.get, ready.live):
            if req is not None:
                req.inflight -= 1
        self._reads.fire(ready.read, "read_completed", self._transfer_result(result), now)
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
                actions.append(Send(ready.peer, _read_done(read.layer_idx)))
            for ext in msg.done_ext_ids:
                req = self.requests.get(ext)
                if req is None or not self._requests.can(req.status, "contributor_final"):
                    continue
                self._fire_request(req.status, "contributor_final",
                                    *self._final_signal(req, msg))
                actions += self._maybe_ready(req)
            # a request whose last read just landed may now be ready for agreement (none
            # is, where every request it read is still registered)
            if ready.quiet != self._request_changes:
                for ext, req in zip(ready.live, map(self.requests.get, ready.live),
                                    strict=True):
                    if (req is not None and req.status.state != "registered"
                            and ext not in msg.done_ext_ids):
                        actions += self._maybe_ready(req)
        else:
            self.stats.replies["failed"] += 1
            error = read.error or "read failed"
            actions.append(Send(ready.peer, wire.encode(wire.ReadFailed(read.layer_idx, error))))
            if msg is not None and ready.trusted:
                for entry in msg.read_reqs:
                    req = self.requests.get(entry.ext_req_id)
                    if req is None:
                        if entry.ext_req_id not in self.terminal:
                            self._remember_failure(entry.ext_req_id, error)
                    elif req.status.state in ("registered", "local_ok"):  # R5
                        actions += self._fail_request(entry.ext_req_id, error)
                    else:
                        actions += self._maybe_ready(req)
        return actions

    # ----------------------------------------------------------------- time
    def tick(self, now: float) -> list[Action]:
        """Expire bounded waits: READYs whose destinations never came (C1) and requests
        whose contributors never finished. Costs O(log n) per expiry, not O(waiting)."""
        actions: list[Action] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, kind, what = heapq.heappop(self._deadlines)
            if kind == "ready":
                ready = what
                assert isinstance(ready, ServedReady)
                if self._waiting.get(ready.seq) is not ready:
                    continue
                missing = sorted(ready.read.missing)
                error = (f"C1: destinations of {', '.join(missing)} not registered within "
                         f"{self.destination_wait}s")
                # Only the missing requests are at fault: they fail (on registration, if it
                # ever comes, R5), and the READY is served for the others.
                for ext in missing:
                    self._remember_failure(ext, error)
                actions += self._serve_waiting(ready, "wait_expired", now)
                for ext in missing:  # the READYs queued behind it for these wait no more
                    actions += self._stop_awaiting(ext, now)
            else:
                req = self.requests.get(str(what))
                if req is not None and req.status.state == "registered" and \
                        now >= req.deadline:
                    self._fire_request(req.status, "deadline_expired",
                                        f"R1: contributors incomplete after "
                                        f"{self.request_deadline}s")
                    actions += self._maybe_ready(req)
        return actions

    def has_waiting_reads(self) -> bool:
        return bool(self._waiting)

    def waiting_reads(self) -> list[ServedReady]:
        """The READYs waiting for destinations, in arrival order."""
        return list(self._waiting.values())

    def next_deadline(self) -> float | None:
        while self._deadlines:
            deadline, _, kind, what = self._deadlines[0]
            if kind == "ready" and self._waiting.get(what.seq) is what:  # type: ignore[union-attr]
                return deadline
            if kind == "request":
                req = self.requests.get(str(what))
                if req is not None and req.status.state == "registered":
                    return deadline
            heapq.heappop(self._deadlines)  # settled since it was pushed
        return None

    # ----------------------------------------------------------------- failure evidence
    def _remember_failure(self, ext_req_id: str, error: str) -> None:
        """R5: a request failed before vLLM registered it must fail on registration. The
        exact table is bounded; beyond it the id goes into a fixed-size hashed set, which
        may fail an innocent request later but never lets a failed one succeed."""
        if ext_req_id in self._failed_unregistered:
            return
        if len(self._failed_unregistered) < self.limits.early_failures:
            self._failed_unregistered[ext_req_id] = error
            return
        self._overflowed += 1
        for bit in _overflow_bits(ext_req_id):
            self._failed_overflow[bit >> 3] |= 1 << (bit & 7)

    def _maybe_failed(self, ext_req_id: str) -> bool:
        if not self._overflowed:
            return False
        return all(self._failed_overflow[bit >> 3] & (1 << (bit & 7))
                   for bit in _overflow_bits(ext_req_id))

    def connection_lost(self, peer: str) -> None:
        """A Prefill connection went away: its next READY needs a new MF_META (W1)."""
        self.connections.pop(peer, None)
        self._last_seen.pop(peer, None)


_OVERFLOW_BITS = 1 << 20
# The most ids and frame bytes a core keeps from the last layer it planned, for the next
# layer of the step: a READY past them is planned afresh, and none is held after it.
_KEPT_IDS = 1 << 18
_KEPT_BODY_BYTES = 1 << 20
_NO_BLOCKS = np.zeros(0, dtype=np.int64)
_NO_BLOCKS.flags.writeable = False
_EXT_ID = operator.attrgetter("ext_req_id")
# A layer with nothing to read plans nothing; its arrays are empty, so one plan serves all.
_EMPTY_PLAN = ReadPlan.empty()


@functools.lru_cache(maxsize=4096)
def _read_done(layer_idx: int) -> bytes:
    """W3 READ_DONE for a layer: the same few bytes for every READY of that layer."""
    return wire.encode(wire.ReadDone(layer_idx))


def _overflow_bits(ext_req_id: str) -> tuple[int, int]:
    data = ext_req_id.encode("utf-8", "surrogatepass")
    return (zlib.crc32(data) % _OVERFLOW_BITS,
            zlib.crc32(data, 0x9E3779B9) % _OVERFLOW_BITS)


def _remember(table: dict, key: str, value: object, limit: int) -> None:
    """Insert, evicting the oldest entries beyond ``limit`` (dicts keep insertion order)."""
    table[key] = value
    while len(table) > limit:
        del table[next(iter(table))]


def _frozen_ids(ids: Sequence[int]) -> np.ndarray:
    """A request's destination blocks as the core's own read-only int64 copy: no caller
    can change them under a read, and an array seen again holds the same blocks."""
    arr = np.array(ids, dtype=np.int64)
    arr.flags.writeable = False
    return arr


@dataclass(eq=False)
class _Step:
    """The last layer a core planned with every entry live, which the step's next layers
    repeat: what identifies it (``key``: the READY's bytes past its layer and the count of
    request changes; ``cut``: what else decides the cut), its requests, whether they were
    all registered, and the joined pairs it was planned from."""

    key: tuple
    cut: tuple
    live: tuple[str, ...]
    reqs: list[DecodeRequest]
    registered: bool  # every one of them (a seeded bug may read others)
    src_ids: np.ndarray
    dst_ids: np.ndarray
    split: int
    pairs: JoinedPairs | None


class _Lists:
    """One group (main or indexer) of a layer's live entries: per entry its source ids, the
    request's registered destination blocks and the entry's destination start, as lists;
    the counts and starts also as int64 arrays (the cut takes them), the destination sizes
    only when a range has to be checked against them."""

    def __init__(self, ids: list[np.ndarray], dests: list[np.ndarray], starts: list[int],
                 *, counts: list[int] | None = None, sizes: list[int] | None = None) -> None:
        self.ids, self.dests, self.starts = ids, dests, starts
        self.counts = list(map(len, ids)) if counts is None else counts
        self.sizes = list(map(len, dests)) if sizes is None else sizes
        self.n = np.array(self.counts, dtype=np.int64)
        self.from_zero = not any(starts)
        self.start = np.zeros(len(starts), dtype=np.int64) if self.from_zero else \
            np.array(starts, dtype=np.int64)
        # every list starts its destination and is as long: it fits, read whole or cut
        self.fills = self.from_zero and self.counts == self.sizes

    @functools.cached_property
    def size(self) -> np.ndarray:
        return np.array(self.sizes, dtype=np.int64)

    def outside(self, lo: np.ndarray, hi: np.ndarray, lo_zero: bool, *,
                whole_range: bool) -> bool:
        """Whether a piece ``[start + lo, start + hi)`` may leave its destination or, with
        ``whole_range``, the whole list may: a test no valid group fails, and which the
        range-by-range check settles. Pieces at most their lists (``lo_zero``, ``hi`` the
        counts themselves) of lists that fill their destinations cannot."""
        if lo_zero and hi is self.n and self.fills:
            return False
        end = np.maximum(hi, self.n) if whole_range and hi is not self.n else hi
        return bool((self.start + end > self.size).any()) or not lo_zero and lo.min() < 0

    def pieces(self, lo: np.ndarray, hi: np.ndarray,
               from_zero: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Entry ``i``'s source ids at positions ``[lo[i], hi[i])`` and the destination
        blocks they land in, from ``starts[i] + lo[i]`` on. The ranges were checked
        against the destinations (L1); ``from_zero``: every ``lo`` is 0."""
        if not self.ids:
            return [], []
        his = self.counts if hi is self.n else hi.tolist()
        if from_zero and his == self.counts:  # every piece is its whole list ...
            if self.fills:
                return self.ids, self.dests  # ... and fills its destination
            return self.ids, [d[at:at + c] for d, at, c
                              in zip(self.dests, self.starts, self.counts, strict=True)]
        los = [0] * len(his) if from_zero else lo.tolist()
        src = [ids[a:b] for ids, a, b in zip(self.ids, los, his, strict=True)]
        dst = [d[at + a:at + b] for d, at, a, b
               in zip(self.dests, self.starts, los, his, strict=True)]
        return src, dst


def _without_own_prefix(cuts: Cuts, main_start: np.ndarray, indexer_start: np.ndarray,
                        owns: list[tuple[int, int]]) -> Cuts:
    """C5: this rank's share of each entry less the positions Decode computed itself. A
    Prefill that did not know Decode's local prefix hit (dispatched before the rendezvous,
    or one count for a whole prompt list) names them; each rank drops the same positions
    from its own piece, so the pieces stay disjoint (T6) and cover exactly the rest."""
    own = np.array(owns, dtype=np.int64).reshape(-1, 2)
    main_lo = np.minimum(np.maximum(cuts.main_lo, own[:, 0] - main_start), cuts.main_hi)
    idx_lo = np.minimum(np.maximum(cuts.indexer_lo, own[:, 1] - indexer_start),
                        cuts.indexer_hi)
    return Cuts(main_lo, cuts.main_hi, idx_lo, cuts.indexer_hi)


def _check_ranges(main: _Lists, idx: _Lists, cuts: Cuts, member: int) -> None:
    """L1, in the order a reader expects the first error: per entry, the whole main range
    (member 0 reads main, so all of it must fit before any piece is read), this rank's
    piece of it, then the same two for the indexer. One row per check, so the four are
    tested in a handful of array operations."""
    has_idx = idx.n > 0
    starts = np.stack((main.start, main.start + cuts.main_lo,
                       idx.start, idx.start + cuts.indexer_lo))
    ends = np.stack((main.start + main.n, main.start + cuts.main_hi,
                     idx.start + idx.n, idx.start + cuts.indexer_hi))
    bad = (starts < 0) | (ends > np.stack((main.size, main.size, idx.size, idx.size)))
    if member != 0:
        bad[0] = False
    bad[2:] &= has_idx
    if bad.any():
        entry = int(np.flatnonzero(bad.any(axis=0))[0])
        check = int(np.flatnonzero(bad[:, entry])[0])
        what = "main" if check < 2 else "indexer"
        lo, hi = int(starts[check, entry]), int(ends[check, entry])
        size = main.size if check < 2 else idx.size
        raise ProtocolError(f"L1: {what} destination range [{lo}, {hi}) outside the "
                            f"{int(size[entry])} registered blocks")
