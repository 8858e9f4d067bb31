"""Sans-IO protocol core of one Prefill TP rank.

It owns the completion gates of the physical slots (``prefill_slot`` machine, S1-S5), the
handshake with every Decode endpoint (``peer_session``, W1, F3) and the per-request chunk
progress (C2). Events come in as method calls with an explicit ``now``; what must happen on
the wire comes back as actions. No sockets, threads, clocks or devices here: the threaded
runtime and the model checker drive the very same object.

Per layer the work is O(endpoints) messages; block arithmetic is numpy slicing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from sfa_rd2h.spec import wire
from sfa_rd2h.spec.errors import ProtocolError
from sfa_rd2h.spec.params import RemoteDecode, parse_remote_decode
from sfa_rd2h.spec.timing import HANDSHAKE_TIMEOUT_S, REPLY_TIMEOUT_S, check_timeouts
from sfa_rd2h.spec.topology import TpMapping
from sfa_rd2h.statemachines.cores.actions import Action, Disconnect, Send
from sfa_rd2h.statemachines.engine import Driver, Observer
from sfa_rd2h.statemachines.models import PeerSession, SlotGate


class LayerSendError(ProtocolError):
    """A layer's READY was answered with READ_FAILED or its reader vanished (S4)."""


@dataclass(eq=False)
class PrefillRequest:
    """C2: what Prefill tracks per request."""

    ext_req_id: str
    endpoint: str
    main_ids: np.ndarray
    indexer_ids: np.ndarray
    sent_blocks: int = 0  # blocks already planned into READYs of every layer
    chunk: tuple[int, int] | None = None
    final: bool = False


@dataclass(frozen=True)
class Abandoned:
    """A request whose KV an endpoint will never get complete from this rank (S7)."""

    endpoint: str
    ext_req_id: str
    reason: str


@dataclass(eq=False)
class _Publication:
    """The READYs of one layer still waiting for their endpoint's handshake."""

    layer_idx: int
    payload: bytes


@dataclass(frozen=True)
class _Planned:
    """One endpoint's READY of a planned layer, and what it was built from (S7 may have
    to rebuild it without a request abandoned before the layer landed)."""

    payload: bytes
    frames: wire.ReadyFrames
    done: tuple[str, ...]

    def ext_ids(self) -> frozenset[str]:
        return frozenset([e.ext_req_id for e in self.frames.read_reqs] + list(self.done))


_ABANDONED_KEPT = 65536


@dataclass(eq=False)
class _Endpoint:
    session: PeerSession
    held: list[_Publication] = field(default_factory=list)
    handshake_since: float = 0.0  # when the MF_META now awaiting its ack was sent


def slot_keys(meta: wire.LayerMeta) -> tuple[str, str | None]:
    """S2: gates are named by storage address, never by layer name."""
    main = f"main@{meta.base_addrs[0]:#x}"
    idx = f"indexer@{meta.base_addrs[meta.main_tensor_count]:#x}" if meta.has_indexer else None
    return main, idx


class PrefillCore:
    """One Prefill TP rank's view of the protocol."""

    def __init__(
        self,
        p_rank: int,
        mapping: TpMapping,
        session: str,
        layers: Mapping[str, wire.LayerMeta],
        *,
        block_size: int = 128,
        reply_timeout: float = REPLY_TIMEOUT_S,
        handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
        observer: Observer | None = None,
    ) -> None:
        self.p_rank = p_rank
        self.mapping = mapping
        self.member = mapping.group_member_idx(p_rank)
        self.session = session
        self.layer_names: tuple[str, ...] = tuple(layers)
        self.block_size = block_size
        check_timeouts(reply_timeout=reply_timeout, handshake_timeout=handshake_timeout)
        self.reply_timeout = reply_timeout
        self.handshake_timeout = handshake_timeout
        # The versioned 6-field form: the fork checks it, upstream reads its first 3 fields.
        self._meta = wire.MfMeta(session, dict(layers), wire.PROTOCOL_VERSION)
        self._meta_payload = wire.encode(self._meta)
        self._slots = Driver("prefill_slot", observer)
        self._sessions = Driver("peer_session", observer)
        self.gates: dict[str, SlotGate] = {}
        self._layer_gates: list[tuple[SlotGate, ...]] = []
        for name in self.layer_names:
            keys = [k for k in self._gate_keys(name, layers[name]) if k is not None]
            for k in keys:
                if k not in self.gates:
                    self.gates[k] = self._slots.start(SlotGate(k))
            self._layer_gates.append(tuple(self.gates[k] for k in keys))
        self._published_at: dict[str, float] = {}
        # layer -> per endpoint: the READY, what it carries, the requests it names
        self._planned: dict[int, dict[str, _Planned]] = {}
        # layer -> per endpoint: the requests its last published READY named
        self._carried: dict[int, dict[str, frozenset[str]]] = {}
        # (endpoint, request) pairs Prefill gave up on (S7): never reported final there;
        # bounded, oldest forgotten first (a request that old has no READY left to send).
        self._abandoned: dict[tuple[str, str], None] = {}
        # The same pairs as they are given up on, with the reason, until the runtime takes
        # them (take_abandoned) to tell whoever waits for those requests; bounded alike.
        self._newly_abandoned: deque[Abandoned] = deque(maxlen=_ABANDONED_KEPT)
        self._step: dict[str, tuple[wire.ReadyFrames, tuple[str, ...]]] | None = None
        self.endpoints: dict[str, _Endpoint] = {}
        self.requests: dict[str, PrefillRequest] = {}
        self.stale_replies = 0  # S5: duplicates and replies to an earlier publication

    # ----------------------------------------------------------------- requests (C2)
    def add_request(self, ext_req_id: str, kv_transfer_params: Mapping,
                    main_block_ids: Sequence[int], indexer_block_ids: Sequence[int]) -> str:
        """Track a request dispatched with ``do_remote_decode``; return its endpoint (P2).

        Blocks Decode already holds (``remote_cached_tokens``) are never sent.
        """
        if ext_req_id in self.requests:
            raise ProtocolError(f"C2: request {ext_req_id!r} is already tracked")
        remote = self._parse_params(kv_transfer_params)
        endpoint = remote.endpoint(self.p_rank, self.mapping)
        req = PrefillRequest(
            ext_req_id, endpoint,
            np.asarray(main_block_ids, dtype=np.int64),
            np.asarray(indexer_block_ids, dtype=np.int64))
        req.sent_blocks = min(remote.remote_cached_tokens // self.block_size, len(req.main_ids))
        self.requests[ext_req_id] = req
        self._step = None
        return endpoint

    def extend_request(self, ext_req_id: str, main_block_ids: Sequence[int],
                       indexer_block_ids: Sequence[int]) -> None:
        """Append the blocks vLLM allocated for a later chunk of the request (C2). Positions
        never move once allocated, so what earlier READYs named keeps its meaning."""
        req = self.requests.get(ext_req_id)
        if req is None:
            raise ProtocolError(f"C2: request {ext_req_id!r} is not tracked")
        self._step = None
        if len(main_block_ids):
            req.main_ids = np.concatenate(
                [req.main_ids, np.asarray(main_block_ids, dtype=np.int64)])
        if len(indexer_block_ids):
            req.indexer_ids = np.concatenate(
                [req.indexer_ids, np.asarray(indexer_block_ids, dtype=np.int64)])

    def schedule_chunk(self, ext_req_id: str, computed_tokens: int, final: bool) -> None:
        """This step computes the request's prompt up to ``computed_tokens`` (C2): the READYs
        cover the blocks completed since the last chunk, the final chunk its partial block."""
        req = self.requests[ext_req_id]
        stop = self._chunk_stop(computed_tokens, final)
        if not req.sent_blocks <= stop <= len(req.main_ids):
            raise ProtocolError(
                f"C2: chunk of {ext_req_id!r} ends at block {stop}, outside "
                f"[{req.sent_blocks}, {len(req.main_ids)}]")
        req.chunk = (req.sent_blocks, stop)
        req.final = final
        self._step = None

    def finish_request(self, ext_req_id: str) -> bool:
        """vLLM finished or aborted the request: stop publishing it. Layers already planned
        keep their READYs, so every reader a slot waits for still gets its READY (S3).
        Returns whether the request was still tracked."""
        self._step = None
        return self.requests.pop(ext_req_id, None) is not None

    # Hooks: the model checker's seeded bugs override these, nothing else does.
    def _parse_params(self, params: Mapping) -> RemoteDecode:
        return parse_remote_decode(params)

    def _chunk_stop(self, computed_tokens: int, final: bool) -> int:
        full, partial = divmod(computed_tokens, self.block_size)
        return full + (1 if final and partial else 0)

    def _encode_ready(self, frames: wire.ReadyFrames, layer_idx: int, layer_name: str,
                      done: tuple[str, ...]) -> bytes:
        return frames.encode(layer_idx, layer_name, done)

    def _gate_keys(self, layer_name: str, meta: wire.LayerMeta) -> tuple[str, str | None]:
        return slot_keys(meta)

    def _entry(self, req: PrefillRequest, start: int, stop: int) -> wire.ReadReq | None:
        """T6: every member sends the chunk's full lists and Decode cuts its share, as
        upstream does; a chunk that completed no block sends no entry, as upstream's
        Prefill does (a Decode skips such an entry, so sending one would only cost bytes)."""
        if stop == start:
            return None
        return wire.ReadReq(req.ext_req_id, req.main_ids[start:stop],
                            req.indexer_ids[start:stop], start, start)

    # ----------------------------------------------------------------- compute path
    def gates_of(self, layer_idx: int) -> tuple[SlotGate, ...]:
        return self._layer_gates[layer_idx]

    def layer_writable(self, layer_idx: int) -> bool:
        """Whether every slot of the layer is free (S1); raises a held failure (S4)."""
        gates = self._layer_gates[layer_idx]
        failed = [g for g in gates if g.state == "failed"]
        if failed:
            errors = "; ".join(g.error or "" for g in failed)
            for g in failed:
                self._slots.fire(g, "observe_error")
            raise LayerSendError(f"S4: layer {layer_idx} cannot be written: {errors}")
        return all(g.state == "free" for g in gates)

    def begin_layer(self, layer_idx: int, now: float) -> list[Action]:
        """The compute path is about to scatter this layer's KV into its slots (S1).

        The layer's READYs are planned now, from this step's chunks, and sent when the
        scatter lands; so the compute path may schedule the next step's chunks while the
        sender is still waiting for this step's device events.
        """
        for g in self._layer_gates[layer_idx]:
            self._slots.fire(g, "begin_write", layer_idx)
        self._planned[layer_idx] = self._ready_plans(layer_idx)
        if layer_idx == len(self.layer_names) - 1:
            self._close_chunks()
        return []

    def layer_landed(self, layer_idx: int, now: float) -> list[Action]:
        """The layer's device event signalled (C4): publish READY to every endpoint."""
        gates = self._layer_gates[layer_idx]
        for g in gates:
            self._slots.fire(g, "scatter_landed")
        by_endpoint: dict[str, bytes] = {}
        carried: dict[str, frozenset[str]] = {}
        for ep, plan in self._planned.pop(layer_idx).items():
            payload, ids = self._without_abandoned(ep, plan, layer_idx)
            if payload:
                by_endpoint[ep], carried[ep] = payload, ids
        self._carried[layer_idx] = carried
        readers = frozenset(by_endpoint)
        for g in gates:
            self._slots.fire(g, "publish", readers)
            self._published_at[g.key] = now
        actions: list[Action] = []
        for endpoint, payload in by_endpoint.items():
            actions += self._send_ready(endpoint, _Publication(layer_idx, payload), now)
        return actions

    def _step_frames(self) -> dict[str, tuple[wire.ReadyFrames, tuple[str, ...]]]:
        """Per endpoint, this step's entries (validated and packed once, since every layer
        of a step carries the same ones) and the requests whose final chunk it is. Built on
        the step's first layer; any change to the requests or their chunks drops it."""
        if self._step is None:
            entries: dict[str, list[wire.ReadReq]] = {}
            done: dict[str, list[str]] = {}
            for req in self.requests.values():
                if req.chunk is None or (req.endpoint, req.ext_req_id) in self._abandoned:
                    continue
                entry = self._entry(req, *req.chunk)
                if entry is not None:
                    entries.setdefault(req.endpoint, []).append(entry)
                if req.final:
                    done.setdefault(req.endpoint, []).append(req.ext_req_id)
            self._step = {
                ep: (wire.ReadyFrames(entries.get(ep, ()), self.member, self.mapping.ratio),
                     tuple(done.get(ep, ())))
                for ep in [*entries, *(ep for ep in done if ep not in entries)]
            }
        return self._step

    def _ready_plans(self, layer_idx: int) -> dict[str, _Planned]:
        last_layer = layer_idx == len(self.layer_names) - 1
        name = self.layer_names[layer_idx]
        return {
            ep: _Planned(self._encode_ready(frames, layer_idx, name, done if last_layer else ()),
                         frames, done if last_layer else ())
            for ep, (frames, done) in self._step_frames().items()
            if frames.read_reqs or (last_layer and done)
        }

    def _without_abandoned(self, endpoint: str, plan: _Planned,
                           layer_idx: int) -> tuple[bytes, frozenset[str]]:
        """The planned READY and the requests it names, re-encoded without those abandoned
        on this endpoint since it was planned (S7); an empty READY if none is left."""
        ids = plan.ext_ids()
        if not self._abandoned or not any((endpoint, i) in self._abandoned for i in ids):
            return plan.payload, ids
        keep = [e for e in plan.frames.read_reqs
                if (endpoint, e.ext_req_id) not in self._abandoned]
        done = tuple(i for i in plan.done if (endpoint, i) not in self._abandoned)
        if not keep and not done:
            return b"", frozenset()
        frames = wire.ReadyFrames(keep, self.member, self.mapping.ratio)
        return (self._encode_ready(frames, layer_idx, self.layer_names[layer_idx], done),
                frozenset([e.ext_req_id for e in keep] + list(done)))

    def _close_chunks(self) -> None:
        self._step = None
        for ext in list(self.requests):
            req = self.requests[ext]
            if req.chunk is None:
                continue
            req.sent_blocks = req.chunk[1]
            req.chunk = None
            if req.final:
                del self.requests[ext]

    # ----------------------------------------------------------------- endpoints (W1, F3)
    def _endpoint(self, endpoint: str) -> _Endpoint:
        ep = self.endpoints.get(endpoint)
        if ep is None:
            ep = self.endpoints[endpoint] = _Endpoint(self._sessions.start(PeerSession(endpoint)))
        return ep

    def _send_ready(self, endpoint: str, pub: _Publication, now: float) -> list[Action]:
        ep = self._endpoint(endpoint)
        state = ep.session.state
        if state == "established":
            return [Send(endpoint, pub.payload)]
        if state == "refused":
            self._fail_reader(endpoint, pub.layer_idx, ep.session.error or "F3: refused")
            return []
        ep.held.append(pub)
        if state == "disconnected":
            self._sessions.fire(ep.session, "connect")
            ep.handshake_since = now
            return [Send(endpoint, self._meta_payload)]
        return []

    # ----------------------------------------------------------------- replies
    def on_frame(self, endpoint: str, frame: bytes, now: float) -> list[Action]:
        """A frame from a Decode endpoint. Malformed input raises ``ProtocolError`` and
        changes nothing; the runtime logs it and the reply timeout covers the lost ack."""
        ep = self.endpoints.get(endpoint)
        if ep is None:
            raise ProtocolError(f"W3: frame from unknown endpoint {endpoint!r}")
        msg = wire.decode_meta_reply(frame) if frame == wire.RAW_ACK else wire.decode(frame)
        if isinstance(msg, wire.MfMetaAck):
            if ep.session.state != "handshaking":
                raise ProtocolError(
                    f"W1: MF_META acknowledgement from {endpoint!r} in session state "
                    f"{ep.session.state!r}")
            return self._on_meta_reply(endpoint, ep, msg)
        if isinstance(msg, wire.ReadDone):
            self._on_reply(endpoint, msg.layer_idx, None)
        elif isinstance(msg, wire.ReadFailed):
            self._on_reply(endpoint, msg.layer_idx, msg.error)
        else:
            raise ProtocolError(f"W3: unexpected {type(msg).__name__} from Decode {endpoint!r}")
        return []

    def _on_meta_reply(self, endpoint: str, ep: _Endpoint, ack: wire.MfMetaAck) -> list[Action]:
        try:
            wire.check_meta_ack(ack)  # F3 holds on this side too
        except ProtocolError as exc:
            ack = wire.MfMetaAck(False, ack.protocol_version, ack.layout_version, str(exc))
        if ack.accepted:
            self._sessions.fire(ep.session, "meta_acked")
            held, ep.held = ep.held, []
            return [Send(endpoint, pub.payload) for pub in held]
        self._sessions.fire(ep.session, "meta_refused", ack.error)
        held, ep.held = ep.held, []
        for pub in held:
            self._fail_reader(endpoint, pub.layer_idx, ack.error)
        return []

    def _match_reply(self, endpoint: str, layer_idx: int) -> list[tuple[SlotGate, str]]:
        """S5: the gates a reply counts for - the layer's own slots, still owned by that
        layer and waiting for exactly this endpoint - with the reader it accounts for."""
        if not 0 <= layer_idx < len(self._layer_gates):
            return []
        return [(g, endpoint) for g in self._layer_gates[layer_idx]
                if g.state == "awaiting_replies" and g.owner == layer_idx
                and g.is_pending(endpoint)]

    def _on_reply(self, endpoint: str, layer_idx: int, error: str | None) -> None:
        # S5: a reply counts only on an established session; before the MF_META ack no
        # READY of this session was sent, so nothing can have been answered yet.
        ep = self.endpoints[endpoint]
        matches = self._match_reply(endpoint, layer_idx) \
            if ep.session.state == "established" else []
        if not matches:
            self.stale_replies += 1
            return
        for g, reader in matches:
            if error is None:
                self._slots.fire(g, "reply_done", reader)
            else:
                self._slots.fire(g, "reply_failed", reader, error)

    def _fail_reader(self, endpoint: str, layer_idx: int, error: str) -> None:
        for g, reader in self._match_reply(endpoint, layer_idx):
            self._slots.fire(g, "reply_failed", reader, error)

    # ----------------------------------------------------------------- faults (S5)
    def peer_gone(self, endpoint: str, now: float, reason: str = "peer lost") -> None:
        """The endpoint disconnected or restarted: fail its outstanding reads, and start
        over with MF_META on the next READY (W1)."""
        ep = self.endpoints.get(endpoint)
        if ep is None:
            return
        ep.held.clear()
        self._reset_session(ep)
        for g in self.gates.values():
            if g.state == "awaiting_replies" and g.is_pending(endpoint):
                self._abandon(endpoint, g.owner, reason)
                self._slots.fire(g, "reader_lost", endpoint, f"S5: {reason}")

    def take_abandoned(self) -> list[Abandoned]:
        """The requests given up on for an endpoint since the last call (S5, S7), oldest
        first: their KV will never be complete there, so the runtime tells the request's
        owner at once rather than let it wait for Decode's request deadline (R1)."""
        taken = list(self._newly_abandoned)
        self._newly_abandoned.clear()
        return taken

    def _abandon(self, endpoint: str, layer_idx: int | None, reason: str) -> None:
        """S7: the requests a lost READY named never get reported final to that endpoint,
        so Decode cannot complete them without the layer it never read; they expire there
        (R1) instead."""
        ids = self._carried.get(layer_idx, {}).get(endpoint, frozenset()) \
            if layer_idx is not None else frozenset()
        for ext in sorted(ids):
            if (endpoint, ext) not in self._abandoned:
                self._newly_abandoned.append(Abandoned(endpoint, ext, reason))
            self._abandoned[(endpoint, ext)] = None
        while len(self._abandoned) > _ABANDONED_KEPT:
            del self._abandoned[next(iter(self._abandoned))]
        if ids:
            self._step = None

    def _reset_session(self, ep: _Endpoint) -> None:
        if ep.session.state != "disconnected":
            self._sessions.fire(ep.session, "peer_lost")

    def tick(self, now: float) -> list[Action]:
        """Declare lost every endpoint that left a READY unanswered for ``reply_timeout``,
        or its MF_META unacknowledged for ``handshake_timeout`` (a hung Decode then costs a
        new connection seconds), and have its connection replaced (S5: a late reply must not
        count later)."""
        late = {
            ep: f"no reply within {self.reply_timeout}s"
            for g in self.gates.values()
            if g.state == "awaiting_replies"
            and now - self._published_at[g.key] >= self.reply_timeout
            for ep in g.pending
        }
        for name, ep in self.endpoints.items():
            if ep.held and now - ep.handshake_since >= self.handshake_timeout:
                late.setdefault(name, f"MF_META not acknowledged within "
                                      f"{self.handshake_timeout}s")
        actions: list[Action] = []
        for endpoint in sorted(late):
            reason = late[endpoint]
            self.peer_gone(endpoint, now, reason)
            actions += self._disconnect(endpoint, reason)
        return actions

    # Hook: the model checker's seeded bugs override this, nothing else does.
    def _disconnect(self, endpoint: str, reason: str) -> list[Action]:
        return [Disconnect(endpoint, reason)]

    def next_deadline(self) -> float | None:
        times = [self._published_at[g.key] + self.reply_timeout
                 for g in self.gates.values() if g.state == "awaiting_replies"]
        times += [ep.handshake_since + self.handshake_timeout
                  for ep in self.endpoints.values() if ep.held]
        return min(times, default=None)
