"""The control plane: ZMQ sockets and threads around the sans-IO cores.

Nothing here decides anything about the protocol. The threads feed the cores events (frames,
transfer results, device events, timer expiry, peer loss) and execute the actions the cores
return (send a frame, run one batched read, report a request). Every call into a core is made
under that worker's lock; actions are executed outside it, so no lock is held across socket or
transfer I/O (principle 4). Sockets are owned by one I/O thread each (ZMQ sockets are not
thread-safe); other threads hand work over through a queue and an inproc wake-up socket.

* :class:`PrefillWorker` - one Prefill rank. One DEALER per Decode endpoint, connected lazily
  on the first frame to it; Prefill never binds (P1). A sender thread waits for each layer's
  device event before publishing it (C4), sends, feeds replies to the core, watches every
  DEALER with a socket monitor so a vanished Decode fails its outstanding reads (S5), and fires
  the core's reply timer. A connection that was lost is closed and replaced by a fresh one
  (new identity), so the next READY is preceded by a new MF_META (W1) and no frame queued for
  the old peer can reach the new one.
* :class:`DecodeWorker` - one Decode rank. One ROUTER bound at ``host:port`` (P1); a reader
  thread receives frames, answers them through the core, and runs each layer's batched read
  synchronously (C4).
* :class:`AgreementLoop` - the Decode TP ranks' terminal-status agreement (R1, R2) over a
  :class:`~sfa_rd2h.runtime.tp_group.TpGroup`.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.auth.thread
import zmq.utils.z85
from zmq.utils.monitor import recv_monitor_message

from sfa_rd2h.runtime.engines.base import TransferEngine
from sfa_rd2h.runtime.tp_group import TpGroup
from sfa_rd2h.spec import wire
from sfa_rd2h.spec.errors import ProtocolError, WireError
from sfa_rd2h.statemachines.cores.actions import (
    Action,
    Disconnect,
    IssueRead,
    RequestFinished,
    RequestReady,
    Send,
)
from sfa_rd2h.statemachines.cores.decode import DecodeCore
from sfa_rd2h.statemachines.cores.prefill import Abandoned, PrefillCore
from sfa_rd2h.statemachines.models import ReadFailed
from sfa_rd2h.statemachines.trace import REPLY_KINDS, Tracer, summarize

log = logging.getLogger(__name__)

Clock = Callable[[], float]
_RECV_BATCH = 64  # frames taken per readable event before timers and queued work run again
RTT_SAMPLES = 65536  # round-trip samples a Prefill worker keeps (the latest)
RTT_SAMPLES_PER_LAYER = 4096
REPLY_MAX_BYTES = 1 << 20  # replies and acks are small; a bigger frame drops the connection
_WARN_EVERY_S = 10.0  # one warning per kind per this many seconds, with the count suppressed
CLOSE_TIMEOUT_S = 5.0  # close(): a worker's or agreement loop's thread is joined within this
READ_LANE_IDLE_S = 30.0  # a Decode read lane with nothing to do for this long ends
ROUTER_LINGER_MS = 1000  # Decode close: queued replies still go out for this long
ROUND_WAIT_S = 0.02  # agreement: a rank joins the next TP round at most this long after the last


class _Throttled:
    """Warnings a peer can provoke, at most one per kind every ``_WARN_EVERY_S`` seconds, so
    a flood of bad frames cannot flood the log (the stats still count every frame)."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()  # read lanes warn concurrently

    def warn(self, kind: str, msg: str, *args: Any) -> bool:
        """Log unless ``kind`` was logged recently; True when it was logged."""
        now = time.monotonic()
        with self._lock:
            last, suppressed = self._last.get(kind, (-math.inf, 0))
            if now - last < _WARN_EVERY_S:
                self._last[kind] = (last, suppressed + 1)
                return False
            self._last[kind] = (now, 0)
        if suppressed:
            msg += " (%d more like it suppressed)"
            args = (*args, suppressed)
        log.warning(msg, *args)
        return True


class ControlPlaneError(RuntimeError):
    """A worker cannot start, has stopped, or its I/O thread failed."""


class BindError(ControlPlaneError):
    """The Decode ROUTER could not bind its port (in use, bad address)."""


class LanesClosed(ControlPlaneError):
    """Decode is closing: no new transfer-engine read starts."""


class WorkerTimeout(ControlPlaneError, TimeoutError):
    """A bounded wait on a worker expired; the message says what was still pending."""


class LayerSendTimeout(WorkerTimeout):
    """``wait_for_layer_send`` gave up: the slot's readers did not answer in time."""


def wait_device_event(event: Any) -> None:
    """Block until the layer's KV scatter has landed (C4).

    ``None`` stands for a CPU write, complete when the compute thread queued it. Anything
    else must have ``synchronize()``: ``torch.cuda.Event`` and ``torch.npu.Event`` do.
    """
    if event is None:
        return
    sync = getattr(event, "synchronize", None)
    if sync is None:
        raise TypeError(f"a device event needs synchronize(), got {type(event).__name__}")
    sync()


def _poll_ms(deadline: float | None, now: float) -> int:
    """Poll timeout in ms until ``deadline`` (-1: wait for a socket or the wake-up)."""
    if deadline is None:
        return -1
    return max(0, math.ceil((deadline - now) * 1000))


#: The least time a worker's close gives ``Context.term()``: term waits out each socket's
#: linger (ROUTER_LINGER_MS) and the reaper, which takes milliseconds when all is well.
TERM_MIN_S = 2.0


def terminate_within(ctx: zmq.Context, timeout: float, what: str) -> bool:
    """``ctx.term()`` on a thread of its own, waited for ``timeout``; True when it ended.

    term() returns once libzmq has reaped every socket of the context, and a TP group's
    context was caught never finishing that (a closed ROUTER left unreaped under load; see
    runtime/zmq_tp_group.py). All the workers' sockets are closed by now, so nothing is lost
    by not waiting: a term that does not end is logged and left to finish or to die with
    the process, rather than wedging the caller's shutdown (vLLM's, in a connector).
    """
    thread = threading.Thread(target=ctx.term, name=f"{what} zmq-term", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        log.warning("%s: zmq Context.term() did not end within %.1fs (libzmq still reaping "
                    "a closed socket); left running, shutdown goes on", what, timeout)
        return False
    return True


class _Wake:
    """An inproc PAIR: any thread rings, the I/O thread polls the other end."""

    _ids = itertools.count()

    def __init__(self, ctx: zmq.Context, name: str) -> None:
        addr = f"inproc://sfa-rd2h-wake-{name}-{os.getpid()}-{next(self._ids)}"
        self.rx = ctx.socket(zmq.PAIR)
        self.rx.bind(addr)
        self._tx = ctx.socket(zmq.PAIR)
        self._tx.connect(addr)
        self._lock = threading.Lock()  # several threads may ring; PAIR is not thread-safe

    def ring(self) -> None:
        with self._lock:
            if self._tx.closed:
                return
            try:
                self._tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # the queue is full of wake-ups already: the I/O thread will wake

    def drain(self) -> None:
        while True:
            try:
                self.rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def close_tx(self) -> None:
        with self._lock:
            self._tx.close(linger=0)


# ============================================================================ Prefill


@dataclass(frozen=True)
class CurveSecurity:
    """Optional ZMQ CURVE on the control sockets (off unless given), so that on a cluster
    network only Prefill processes holding an authorised key can talk to a Decode ROUTER
    and Prefill knows it talks to the real Decode.

    Decode uses ``public``/``secret`` as the server keypair and accepts only clients whose
    public key is in ``allowed_clients`` (an empty set accepts any CURVE client, which still
    encrypts and authenticates the server). Prefill uses its own ``public``/``secret`` and
    ``server_public``, the Decode key. Keys are Z85 text as ``zmq.curve_keypair()`` makes.
    """

    public: bytes
    secret: bytes
    server_public: bytes = b""
    allowed_clients: frozenset[bytes] = frozenset()

    @classmethod
    def generate(cls) -> CurveSecurity:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    def client_of(self, server_public: bytes) -> CurveSecurity:
        return CurveSecurity(self.public, self.secret, server_public, self.allowed_clients)


def _check_curve_keys(curve: CurveSecurity, *fields: str) -> None:
    """Refuse a malformed key where the worker is built: libzmq takes any 40-character Z85
    key and refuses others only when the socket option is set, which on Prefill happens on
    the sender thread at the first connection and would look like a lost Decode."""
    for name in fields:
        keys = getattr(curve, name)
        for key in (sorted(keys) if isinstance(keys, frozenset) else (keys,)):
            try:
                ok = isinstance(key, bytes) and len(key) == 40 and \
                    len(zmq.utils.z85.decode(key)) == 32
            except (ValueError, KeyError):  # a length or a character Z85 does not have
                ok = False
            if not ok:
                raise ControlPlaneError(
                    f"CURVE {name}: {repr(key)[:60]} is not a key (40 characters of Z85 text "
                    "as zmq.curve_keypair() makes)")


class _CurveAllowList:
    """ZAP credentials provider: a CURVE client is let in only with an authorised key."""

    def __init__(self, allowed: frozenset[bytes]) -> None:
        self._allowed = {bytes(k) for k in allowed}

    def callback(self, domain: str, key: bytes) -> bool:
        if not self._allowed:
            return True
        return zmq.utils.z85.encode(key) in self._allowed or key in self._allowed


@dataclass
class PrefillStats:
    frames_sent: int = 0
    frames_received: int = 0
    rejected_frames: int = 0  # replies the core refused (ProtocolError) or bad framing
    peers_lost: int = 0
    # seconds, READY sent -> reply: the latest samples only, so a long run stays bounded
    round_trips: deque[float] = field(default_factory=lambda: deque(maxlen=RTT_SAMPLES))
    rtt_by_layer: dict[int, deque[float]] = field(default_factory=dict)


@dataclass(eq=False)
class _Dealer:
    endpoint: str
    sock: zmq.Socket
    monitor: zmq.Socket
    conn: str  # identity hex: what the Decode core calls this peer
    sent_at: dict[int, float] = field(default_factory=dict)  # layer -> READY sent


class _Worker:
    """What both workers share: one I/O thread woken through an inproc socket, a condition
    that guards the core, and a bounded shutdown."""

    _what = "worker"  # names the thread in errors, e.g. "prefill sender thread"
    _cond: threading.Condition
    _closing: bool
    _failure: BaseException | None
    _wake: _Wake
    _thread: threading.Thread
    _ctx: zmq.Context
    _own_ctx: bool

    def _start(self, name: str) -> None:
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:  # pragma: no cover - each worker defines its loop
        raise NotImplementedError

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise ControlPlaneError(f"{self._what} failed: {self._failure!r}")
        if self._closing:
            raise ControlPlaneError(f"{self._what} is closed")

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the thread and close every socket; the thread is joined within ``timeout``."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._wake.ring()
        self._thread.join(timeout)
        alive = self._thread.is_alive()
        self._wake.close_tx()
        if alive:
            # Its sockets are still in use (e.g. a sender stuck in a device event), so the
            # context cannot be terminated under it.
            raise ControlPlaneError(f"{self._what} did not stop within {timeout}s")
        if self._own_ctx and not self._ctx.closed:
            terminate_within(self._ctx, max(TERM_MIN_S, timeout), self._what)

    def __enter__(self) -> _Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PrefillWorker(_Worker):
    """Threads and sockets of one Prefill rank around a :class:`PrefillCore`.

    Compute-thread API, per step: ``add_request`` for new requests, ``schedule_chunk`` for
    every request of the step, then per layer ``wait_for_layer_send`` (S1), ``begin_layer``,
    the KV scatter, and ``layer_written(layer, event)`` with the scatter's device event
    (``None`` on CPU). The sender thread waits for that event, never the compute thread.
    """

    def __init__(self, core: PrefillCore, *, tracer: Tracer | None = None,
                 context: zmq.Context | None = None, clock: Clock = time.monotonic,
                 curve: CurveSecurity | None = None,
                 on_abandoned: Callable[[Abandoned], None] | None = None) -> None:
        if curve is not None:
            if not curve.server_public:
                raise ControlPlaneError("CURVE on Prefill needs the Decode public key "
                                        "(server_public)")
            _check_curve_keys(curve, "public", "secret", "server_public")
        self._curve = curve
        # Told, on the sender thread, of every request given up on for an endpoint (S5, S7);
        # it must not block (the vLLM connector queues an HTTP report).
        self._on_abandoned = on_abandoned
        self.core = core
        self.stats = PrefillStats()
        self._tracer = tracer
        self._warn = _Throttled()
        self._clock = clock
        self._cond = threading.Condition()
        self._tasks: deque[tuple[int, Any]] = deque()
        self._outbox: deque[Send] = deque()
        self._busy = False  # the sender holds a task it has not published yet
        self._closing = False
        self._failure: BaseException | None = None
        self._own_ctx = context is None
        self._ctx = zmq.Context() if context is None else context
        self._wake = _Wake(self._ctx, f"prefill{core.p_rank}")
        self._dealers: dict[str, _Dealer] = {}
        self._by_socket: dict[zmq.Socket, tuple[str, bool]] = {}  # -> (endpoint, is_monitor)
        self._poller = zmq.Poller()
        self._seq = itertools.count()
        self._what = f"prefill {core.p_rank} sender thread"
        self._start(f"prefill{core.p_rank}-sender")

    # ------------------------------------------------------------------ compute thread
    def _wait(self, ready: Callable[[], bool], timeout: float, what: Callable[[], str],
              error: type[WorkerTimeout] = WorkerTimeout) -> None:
        """Wait on the condition (lock held) until ``ready()``; bounded by ``timeout``."""
        deadline = self._clock() + timeout
        while True:
            self._check_alive()
            if ready():
                return
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise error(what())
            self._cond.wait(remaining)

    def add_request(self, ext_req_id: str, kv_transfer_params: Mapping[str, Any],
                    main_block_ids: Sequence[int], indexer_block_ids: Sequence[int]) -> str:
        """Track a request dispatched with ``do_remote_decode`` (C2); returns its endpoint."""
        with self._cond:
            self._check_alive()
            return self.core.add_request(ext_req_id, kv_transfer_params, main_block_ids,
                                         indexer_block_ids)

    def extend_request(self, ext_req_id: str, main_block_ids: Sequence[int],
                       indexer_block_ids: Sequence[int]) -> None:
        """vLLM allocated blocks for a later chunk of the request (C2)."""
        with self._cond:
            self._check_alive()
            self.core.extend_request(ext_req_id, main_block_ids, indexer_block_ids)

    def finish_request(self, ext_req_id: str) -> bool:
        """vLLM finished or aborted the request: stop publishing it (its READYs already
        planned stand, S3). Returns whether it was still tracked."""
        with self._cond:
            self._check_alive()
            return self.core.finish_request(ext_req_id)

    def layer_settled(self, layer_idx: int) -> bool:
        """Whether no reader of the layer's slots is outstanding: each slot is free, or its
        latest publication was answered (or its reader declared lost) and the failure
        waits to be observed by the compute path (S1, S4, S5). Never blocks."""
        with self._cond:
            return all(g.state in ("free", "failed") for g in self.core.gates_of(layer_idx))

    def schedule_chunk(self, ext_req_id: str, computed_tokens: int, final: bool) -> None:
        """Plan this step's chunk of a request (C2).

        The core plans each layer's READY when the layer begins, so this never waits for
        the sender to publish the previous step.
        """
        with self._cond:
            self._check_alive()
            self.core.schedule_chunk(ext_req_id, computed_tokens, final)

    def chunk(self, ext_req_id: str) -> tuple[int, int] | None:
        """Block positions ``[start, stop)`` this step computes for the request, if any."""
        with self._cond:
            req = self.core.requests.get(ext_req_id)
            return None if req is None else req.chunk

    def wait_for_layer_send(self, layer_idx: int, timeout: float) -> None:
        """Block until every slot of the layer may be overwritten (S1, M1).

        Raises ``LayerSendError`` if a reader of the slot's previous owner failed (S4) - the
        failure is then observed and the slot is free again - and :class:`LayerSendTimeout`
        if the readers did not answer within ``timeout`` seconds.
        """
        def pending() -> str:
            gates = self.core.gates_of(layer_idx)
            held = "; ".join(f"{g.key} {g.state} owner=layer {g.owner} pending "
                             f"{sorted(g.pending)}" for g in gates)
            return f"S1: layer {layer_idx} not writable after {timeout}s: {held}"

        with self._cond:
            self._wait(lambda: self.core.layer_writable(layer_idx), timeout, pending,
                       LayerSendTimeout)

    def begin_layer(self, layer_idx: int) -> None:
        """The compute thread is about to scatter this layer's KV (S1)."""
        with self._cond:
            self._check_alive()
            actions = self.core.begin_layer(layer_idx, self._clock())
            self._outbox.extend(a for a in actions if isinstance(a, Send))
        if actions:
            self._wake.ring()

    def layer_written(self, layer_idx: int, event: Any = None) -> None:
        """Queue the layer's send task; the sender publishes it once ``event`` landed (C4)."""
        with self._cond:
            self._check_alive()
            self._tasks.append((layer_idx, event))
        self._wake.ring()
        if event is None:
            # The write has landed (CPU). vLLM's CPU worker pins all its threads, the sender
            # too, to the worker's cores: on one core the woken sender otherwise waits for
            # the compute thread's time slice before the READY leaves. One yield hands it
            # the core now (layer_written to landed, p90 3.1 ms -> 0.1 ms on a shared core).
            os.sched_yield()

    def drain(self, timeout: float) -> list[str]:
        """Wait until every queued layer is published and every slot answered, then observe
        held failures (S4). Returns their messages, one per failed physical slot group."""
        def settled() -> bool:
            return not self._tasks and not self._busy and all(
                g.state in ("free", "failed") for g in self.core.gates.values())

        def what() -> str:
            busy = {k: (g.state, sorted(g.pending)) for k, g in self.core.gates.items()
                    if g.state not in ("free", "failed")}
            return f"drain: {len(self._tasks)} task(s) queued, slots still busy: {busy}"

        errors: list[str] = []
        with self._cond:
            self._wait(settled, timeout, what)
            for layer in range(len(self.core.layer_names)):
                try:
                    self.core.layer_writable(layer)
                except ProtocolError as exc:
                    errors.append(str(exc))
        return errors

    def round_trips(self) -> list[float]:
        with self._cond:
            return list(self.stats.round_trips)

    # ------------------------------------------------------------------ sender thread
    def _run(self) -> None:
        self._poller.register(self._wake.rx, zmq.POLLIN)
        try:
            while True:
                with self._cond:
                    if self._closing:
                        return
                    task = self._tasks.popleft() if self._tasks else None
                    self._busy = task is not None
                    sends = list(self._outbox)
                    self._outbox.clear()
                    deadline = self.core.next_deadline()
                self._execute(sends)
                if task is not None:
                    self._land(*task)
                    timeout = 0  # more tasks may be queued; still service the sockets
                else:
                    timeout = _poll_ms(deadline, self._clock())
                events = dict(self._poller.poll(timeout))
                if self._wake.rx in events:
                    self._wake.drain()
                for sock in events:
                    ref = self._by_socket.get(sock)
                    if ref is None:
                        continue  # the wake-up, or a DEALER dropped earlier in this pass
                    endpoint, is_monitor = ref
                    if is_monitor:
                        self._monitor_events(endpoint)
                    else:
                        self._recv_replies(endpoint)
                self._timers()
                self._report_abandoned()
        except BaseException as exc:  # noqa: BLE001 - reported to every API caller
            log.exception("prefill rank %d sender thread failed", self.core.p_rank)
            with self._cond:
                self._failure = exc
                self._cond.notify_all()
        finally:
            for endpoint in list(self._dealers):
                self._drop(endpoint, "close")
            self._wake.rx.close(linger=0)

    def _report_abandoned(self) -> None:
        with self._cond:
            abandoned = self.core.take_abandoned()
        if self._on_abandoned is None:
            return
        for item in abandoned:
            try:
                self._on_abandoned(item)
            except Exception:  # noqa: BLE001 - a report is advice; the sender thread goes on
                log.exception("prefill rank %d: reporting %s failed", self.core.p_rank,
                              item.ext_req_id)

    def _land(self, layer_idx: int, event: Any) -> None:
        wait_device_event(event)  # C4: never publish before the scatter landed
        with self._cond:
            actions = self.core.layer_landed(layer_idx, self._clock())
            self._busy = False
            self._cond.notify_all()
        self._execute(actions)

    def _timers(self) -> None:
        now = self._clock()
        with self._cond:
            deadline = self.core.next_deadline()
            if deadline is None or now < deadline:
                return
            actions = self.core.tick(now)
            self._cond.notify_all()
        self._execute(actions)

    def _connect(self, endpoint: str) -> _Dealer:
        sock = self._ctx.socket(zmq.DEALER)
        identity = f"p{self.core.p_rank}.{os.getpid()}.{next(self._seq)}".encode()
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, REPLY_MAX_BYTES)  # a hostile Decode cannot bloat us
        if self._curve is not None:
            sock.curve_publickey = self._curve.public
            sock.curve_secretkey = self._curve.secret
            sock.curve_serverkey = self._curve.server_public
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            sock.connect(f"tcp://{endpoint}")
        except zmq.ZMQError:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            raise
        dealer = _Dealer(endpoint, sock, monitor, identity.hex())
        self._dealers[endpoint] = dealer
        self._by_socket[sock] = (endpoint, False)
        self._by_socket[monitor] = (endpoint, True)
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)
        if self._tracer is not None:
            self._tracer.connection("open", endpoint, dealer.conn)
        return dealer

    def _drop(self, endpoint: str, why: str) -> None:
        dealer = self._dealers.pop(endpoint, None)
        if dealer is None:
            return
        for sock in (dealer.sock, dealer.monitor):
            self._by_socket.pop(sock, None)
            self._poller.unregister(sock)
        dealer.sock.disable_monitor()
        dealer.monitor.close(linger=0)
        dealer.sock.close(linger=0)
        if self._tracer is not None:
            self._tracer.connection(why, endpoint, dealer.conn)

    def _lose(self, endpoint: str, reason: str) -> None:
        """The peer vanished or a send failed: the core fails its outstanding reads (S4,
        S5) and the connection is replaced on the next frame (W1)."""
        log.warning("prefill rank %d: %s", self.core.p_rank, reason)
        self.stats.peers_lost += 1
        with self._cond:
            self.core.peer_gone(endpoint, self._clock(), reason)
            self._cond.notify_all()
        self._drop(endpoint, "lost")

    def _execute(self, actions: Sequence[Action]) -> None:
        lost: set[str] = set()
        for action in actions:
            if isinstance(action, Disconnect):  # the core gave up on this peer (S5)
                self.stats.peers_lost += 1
                log.warning("prefill rank %d: %s: %s", self.core.p_rank, action.peer,
                            action.reason)
                self._drop(action.peer, "lost")
                continue
            if not isinstance(action, Send):
                raise ControlPlaneError(f"Prefill core returned {type(action).__name__}")
            if action.peer in lost:
                continue  # produced for the connection that just died (its session reset)
            dealer = self._dealers.get(action.peer)
            try:
                if dealer is None:
                    dealer = self._connect(action.peer)
                dealer.sock.send(action.payload, zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                lost.add(action.peer)
                self._lose(action.peer, f"send to {action.peer} failed: {exc}")
                continue
            self.stats.frames_sent += 1
            layer = wire.layer_of(action.payload)
            if layer is not None:
                dealer.sent_at[layer] = self._clock()
            if self._tracer is not None:
                self._tracer.message("send", action.peer, action.payload, conn=dealer.conn)

    def _recv_replies(self, endpoint: str) -> None:
        for _ in range(_RECV_BATCH):
            dealer = self._dealers.get(endpoint)
            if dealer is None:
                return
            try:
                frames = dealer.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            now = self._clock()
            self.stats.frames_received += 1
            payload = [f for f in frames if f]
            if len(payload) != 1:
                self.stats.rejected_frames += 1
                self._warn.warn("framing", "prefill rank %d: %d non-empty frames from %s, "
                                "expected 1", self.core.p_rank, len(payload), endpoint)
                continue
            frame = payload[0]
            if self._tracer is not None:
                self._tracer.message("recv", endpoint, frame, conn=dealer.conn)
            kind, layer = summarize(frame)
            if kind in REPLY_KINDS and layer is not None:
                sent = dealer.sent_at.pop(layer, None)
                if sent is not None:
                    rtt = now - sent
                    self.stats.round_trips.append(rtt)
                    self.stats.rtt_by_layer.setdefault(
                        layer, deque(maxlen=RTT_SAMPLES_PER_LAYER)).append(rtt)
            try:
                with self._cond:
                    actions = self.core.on_frame(endpoint, frame, now)
                    self._cond.notify_all()
            except ProtocolError as exc:
                # The core changed nothing; the reply timeout covers a lost acknowledgement.
                self.stats.rejected_frames += 1
                self._warn.warn("rejected", "prefill rank %d: rejected frame from %s: %s",
                                self.core.p_rank, endpoint, exc)
                continue
            self._execute(actions)

    def _monitor_events(self, endpoint: str) -> None:
        dealer = self._dealers.get(endpoint)
        while dealer is not None:
            try:
                event = recv_monitor_message(dealer.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._lose(endpoint, f"connection to Decode {endpoint} dropped")
                return


# ============================================================================ Decode


@dataclass
class _ReadLanes:
    """Transfer-engine reads off the reader thread: one lane (a thread with a FIFO) per
    Prefill session, so a peer whose registry or memory is slow delays only its own reads,
    never another peer's frames or reads. A lane idle for ``idle_s`` ends; with ``max_lanes``
    lanes busy, further sessions share lanes by hash (still never the reader thread)."""

    def __init__(self, read: Callable[[IssueRead], int | BaseException],
                 done: Callable[[IssueRead, int | BaseException], None], name: str, *,
                 max_lanes: int = 16, idle_s: float = READ_LANE_IDLE_S) -> None:
        self._read, self._done, self._name = read, done, name
        self._max, self._idle = max_lanes, idle_s
        self._lock = threading.Lock()
        self._lanes: dict[str, tuple[queue.SimpleQueue, threading.Thread]] = {}
        self._closed = False

    def submit(self, action: IssueRead) -> None:
        with self._lock:
            if self._closed:
                raise LanesClosed(f"{self._name}: read lanes are closed")
            lane = self._lanes.get(action.session)
            if lane is None and len(self._lanes) >= self._max:
                keys = sorted(self._lanes)
                lane = self._lanes[keys[hash(action.session) % len(keys)]]
            if lane is None:
                q: queue.SimpleQueue = queue.SimpleQueue()
                t = threading.Thread(target=self._run, args=(action.session, q),
                                     name=f"{self._name}-read-{len(self._lanes)}", daemon=True)
                lane = self._lanes[action.session] = (q, t)
                t.start()
            lane[0].put(action)

    def _run(self, session: str, q: queue.SimpleQueue) -> None:
        while True:
            try:
                action = q.get(timeout=self._idle)
            except queue.Empty:
                with self._lock:
                    if q.empty():  # nothing was queued since: retire the lane
                        self._lanes.pop(session, None)
                        return
                continue
            if action is None:
                return
            self._done(action, self._read(action))

    def close(self, timeout: float) -> bool:
        """Let queued reads finish and stop every lane; False if one is still busy."""
        with self._lock:
            self._closed = True
            lanes = list(self._lanes.values())
        for q, _ in lanes:
            q.put(None)
        deadline = time.monotonic() + timeout
        for _, t in lanes:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for _, t in lanes)


class DecodeStats:
    frames_received: int = 0
    bad_framing: int = 0  # multipart messages that are not identity + one payload
    rejected_frames: int = 0  # ProtocolError from the core (its own stats count W5 frames)
    frames_sent: int = 0
    undeliverable: int = 0  # replies to a Prefill connection that is gone
    reads: int = 0
    failed_reads: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0


class DecodeWorker(_Worker):
    """The ROUTER and reader thread of one Decode rank around a :class:`DecodeCore`.

    Other threads talk to the core through the lock-protected methods below
    (``register_request``, ``local_outcome``, ``apply_agreement``); frames and reads they
    cause are handed to the reader thread, which owns the socket. ``on_ready`` and
    ``on_finished`` are called with ``RequestReady`` / ``RequestFinished`` from whichever
    thread produced them (the reader, or the caller of ``register_request`` /
    ``apply_agreement``); they must be quick and thread-safe.
    """

    def __init__(
        self,
        core: DecodeCore,
        engine: TransferEngine,
        port: int,
        *,
        host: str = "127.0.0.1",
        tracer: Tracer | None = None,
        on_ready: Callable[[RequestReady], None] | None = None,
        on_finished: Callable[[RequestFinished], None] | None = None,
        context: zmq.Context | None = None,
        clock: Clock = time.monotonic,
        linger_ms: int = ROUTER_LINGER_MS,
        max_frame_bytes: int = 4 * wire.MAX_FRAME_BYTES,
        curve: CurveSecurity | None = None,
    ) -> None:
        if curve is not None:
            _check_curve_keys(curve, "public", "secret", "allowed_clients")
        self.core = core
        self.engine = engine
        self.stats = DecodeStats()
        self._tracer = tracer
        self._warn = _Throttled()
        self._on_ready = on_ready
        self._on_finished = on_finished
        self._clock = clock
        self._linger_ms = linger_ms
        self._cond = threading.Condition()
        self._actions: deque[Action] = deque()
        self._closing = False
        self._failure: BaseException | None = None
        self._own_ctx = context is None
        self._ctx = zmq.Context() if context is None else context
        self._wake = _Wake(self._ctx, f"decode{core.d_rank}")
        self._auth: zmq.auth.thread.ThreadAuthenticator | None = None
        self._router = self._ctx.socket(zmq.ROUTER)
        if curve is not None:
            # ZAP runs on its own thread; a client without an authorised key never reaches
            # the reader thread or the core.
            self._auth = zmq.auth.thread.ThreadAuthenticator(self._ctx, log=log)
            self._auth.start()
            self._auth.configure_curve_callback("*", _CurveAllowList(curve.allowed_clients))
            self._router.curve_server = True
            self._router.curve_publickey = curve.public
            self._router.curve_secretkey = curve.secret
        # Replies to a vanished identity raise instead of vanishing silently (counted).
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Frames up to a few times the wire limit reach the core, which rejects oversized
        # READYs with READ_FAILED (W5); beyond that ZMQ drops the connection (memory bound).
        self._router.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        addr = f"tcp://{host}:{port}" if port else f"tcp://{host}:*"
        try:
            self._router.bind(addr)
        except zmq.ZMQError as exc:
            self._router.close(linger=0)
            if self._auth is not None:
                self._auth.stop()
            self._wake.close_tx()
            self._wake.rx.close(linger=0)
            if self._own_ctx:
                terminate_within(self._ctx, TERM_MIN_S, f"decode {core.d_rank}")
            raise BindError(f"Decode rank {core.d_rank} cannot bind its ROUTER on {addr} "
                            f"(P1): {exc.strerror}") from exc
        bound = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.port = int(bound.rsplit(":", 1)[1])
        shown = f"[{host}]" if ":" in host else host
        self.endpoint = f"{shown}:{self.port}"
        if tracer is not None:
            tracer.info(endpoint=self.endpoint)
        self._what = f"decode {core.d_rank} reader thread"
        self._results: deque[tuple[IssueRead, int | BaseException]] = deque()
        self._lanes = _ReadLanes(self._read, self._read_done, f"decode{core.d_rank}")
        self._start(f"decode{core.d_rank}-reader")

    # ------------------------------------------------------------------ other threads
    def _dispatch(self, actions: Sequence[Action]) -> None:
        """Run callbacks here; hand frames and reads to the reader thread."""
        io = [a for a in actions if isinstance(a, Send | IssueRead)]
        if io:
            with self._cond:
                self._actions.extend(io)
            self._wake.ring()
        for a in actions:
            if isinstance(a, RequestReady | RequestFinished):
                self._callback(a)

    def _callback(self, action: RequestReady | RequestFinished) -> None:
        fn = self._on_ready if isinstance(action, RequestReady) else self._on_finished
        if fn is not None:
            fn(action)

    def register_request(self, ext_req_id: str, main_dest: Sequence[int],
                         indexer_dest: Sequence[int], *, own_main: int = 0,
                         own_indexer: int = 0) -> None:
        """The scheduler allocated this request's destinations (C1); the first ``own_main``
        / ``own_indexer`` of them hold Decode's own prefix and are never written (C5)."""
        with self._cond:
            self._check_alive()
            actions = self.core.register_request(ext_req_id, main_dest, indexer_dest,
                                                 self._clock(), own_main=own_main,
                                                 own_indexer=own_indexer)
        self._dispatch(actions)
        self._wake.ring()  # the reader thread must take the request's deadline into account

    def abort_request(self, ext_req_id: str, reason: str) -> None:
        """vLLM aborted the request, or its rendezvous failed (C1, R1)."""
        with self._cond:
            self._check_alive()
            actions = self.core.abort_request(ext_req_id, reason, self._clock())
        self._dispatch(actions)

    def forget_unregistered(self, ext_req_id: str) -> None:
        """vLLM ended the request before allocating it: READYs stop waiting for it (C1)."""
        with self._cond:
            self._check_alive()
            actions = self.core.forget_unregistered(ext_req_id, self._clock())
        self._dispatch(actions)

    def local_outcome(self, ext_req_id: str) -> bool | None:
        with self._cond:
            return self.core.local_outcome(ext_req_id)

    def waiting_for_destinations(self) -> int:
        """How many READYs wait for their request's destinations (C1); never blocks on I/O."""
        with self._cond:
            return len(self.core.waiting_reads())

    def apply_agreement(self, ext_req_id: str, all_ok: bool) -> list[RequestFinished]:
        """The TP group agreed on the request (R1, R2); returns the terminal status."""
        with self._cond:
            self._check_alive()
            actions = self.core.apply_agreement(ext_req_id, all_ok)
        self._dispatch(actions)
        return [a for a in actions if isinstance(a, RequestFinished)]

    # ------------------------------------------------------------------ reader thread
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake.rx, zmq.POLLIN)
        try:
            while True:
                with self._cond:
                    if self._closing:
                        return
                    pending = list(self._actions)
                    self._actions.clear()
                    for a, result in self._results:  # reads the lanes finished
                        pending += self.core.read_result(a.read_id, result, self._clock())
                    self._results.clear()
                    deadline = self.core.next_deadline()
                timeout = 0 if pending else _poll_ms(deadline, self._clock())
                self._execute(pending)
                events = dict(poller.poll(timeout))
                if self._wake.rx in events:
                    self._wake.drain()
                if self._router in events:
                    self._recv_frames()
                now = self._clock()
                with self._cond:
                    deadline = self.core.next_deadline()
                    due = deadline is not None and now >= deadline
                    actions = self.core.tick(now) if due else []
                self._execute(actions)
        except BaseException as exc:  # noqa: BLE001 - reported to every API caller
            log.exception("decode rank %d reader thread failed", self.core.d_rank)
            with self._cond:
                self._failure = exc
                self._cond.notify_all()
        finally:
            self._router.close(linger=self._linger_ms)
            self._wake.rx.close(linger=0)

    def _recv_frames(self) -> None:
        for _ in range(_RECV_BATCH):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.stats.frames_received += 1
            try:
                identity, payload = wire.split_router_frames(frames)
            except WireError as exc:
                self.stats.bad_framing += 1
                logged = self._warn.warn("framing", "decode rank %d: dropped a message: %s",
                                         self.core.d_rank, exc)
                if logged and self._tracer is not None:
                    self._tracer.info(event="bad_framing", error=str(exc)[:200])
                continue
            peer = identity.hex()
            if self._tracer is not None:
                self._tracer.message("recv", peer, payload)
            try:
                with self._cond:
                    actions = self.core.on_frame(peer, payload, self._clock())
            except ProtocolError as exc:
                self.stats.rejected_frames += 1
                self._warn.warn("rejected", "decode rank %d: rejected frame from %s: %s",
                                self.core.d_rank, peer, exc)
                continue
            self._execute(actions)

    def _read_done(self, action: IssueRead, result: int | BaseException) -> None:
        """On a lane: hand the result to the reader thread, which owns core and socket."""
        with self._cond:
            self._results.append((action, result))
        self._wake.ring()

    def _execute(self, actions: Sequence[Action]) -> None:
        for a in actions:
            if isinstance(a, Send):
                self._send(a)
            elif isinstance(a, IssueRead):
                try:
                    self._lanes.submit(a)  # its result comes back through _read_done
                except LanesClosed as exc:
                    # Closing: the reader still answers while the lanes drain, and a read
                    # that can no longer start fails (F2) instead of ending this thread.
                    self._read_done(a, exc)
            else:
                self._callback(a)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the lanes (queued reads finish, bounded by ``timeout``), then the reader."""
        deadline = time.monotonic() + timeout
        lanes_done = self._lanes.close(timeout)
        if self._auth is not None:
            self._auth.stop()
        read_stuck = None if lanes_done else (
            f"decode {self.core.d_rank}: a transfer-engine read did not finish within "
            f"{timeout}s")
        try:
            super().close(max(0.1, deadline - time.monotonic()))
        except ControlPlaneError as exc:
            # A read that never returns is the cause to name first; under load the reader
            # thread can be late as well, and its error alone would hide the read.
            if read_stuck is None:
                raise
            raise ControlPlaneError(f"{read_stuck}; also: {exc}") from None
        if read_stuck is not None:
            raise ControlPlaneError(read_stuck)

    def _send(self, a: Send) -> None:
        if self._tracer is not None:
            self._tracer.message("send", a.peer, a.payload)
        try:
            self._router.send_multipart([bytes.fromhex(a.peer), a.payload], zmq.NOBLOCK)
            self.stats.frames_sent += 1
        except (zmq.ZMQError, ValueError) as exc:
            # The Prefill connection is gone (EHOSTUNREACH) or its queue is full; the core
            # did its part (exactly one reply), and Prefill's monitor fails its gate (S5).
            self.stats.undeliverable += 1
            self._warn.warn("undeliverable", "decode rank %d: reply to %s undeliverable: %s",
                        self.core.d_rank, a.peer, exc)
            with self._cond:
                self.core.connection_lost(a.peer)

    def _read(self, a: IssueRead) -> int | BaseException:
        """One engine call; what it returned or raised goes to the core, which decides (F2)."""
        plan = a.plan
        t0 = time.perf_counter()
        result: int | BaseException
        try:
            result = int(self.engine.batch_transfer_sync_read(
                a.session, plan.local_addrs, plan.peer_addrs, plan.lengths))
        except Exception as exc:  # noqa: BLE001 - an engine must not raise; if it does, F2
            log.exception("decode rank %d: transfer engine raised", self.core.d_rank)
            result = exc
        ok = isinstance(result, int) and result == 0
        with self._cond:  # lanes run concurrently
            self.stats.read_seconds += time.perf_counter() - t0
            if ok:
                self.stats.reads += 1
                self.stats.bytes_read += plan.total_bytes
            else:
                self.stats.failed_reads += 1
        if not ok:
            reason = getattr(self.engine, "last_error", "")
            self._warn.warn("read", "decode rank %d: batched read from %s failed (%s): %s",
                        self.core.d_rank, a.session, result, reason)
            if isinstance(result, int) and reason:
                # The number alone says little to whoever reads the request's error (the
                # client, through the connector's report): carry the engine's words.
                result = ReadFailed(result, reason)
        return result


# ============================================================================ agreement


class AgreementLoop:
    """Decode TP ranks agree on terminal status (R1, R2), one collective per round.

    Cadence (it stands in for vLLM's scheduler step, where ``get_finished`` runs once per
    step on every worker): a rank joins the next round as soon as its core reported a new
    local outcome (``notify``, wired as the worker's ``on_ready``), or ``round_wait``
    seconds after its previous round, whichever comes first - waiting on a condition, not
    sleeping. Because ``TpGroup.agree`` is a collective, a round completes when the last
    rank joins, so every request is agreed at most about ``round_wait`` after the slowest
    rank finished it, and every rank calls ``agree`` the same number of times.

    Each rank stops after the round in which ``until(agreed)`` first holds; ``agreed`` is
    identical on every rank after every round, so they all stop after the same round.
    ``close()`` stops a rank early (abort): the other ranks' next round then fails with the
    group's timeout instead of hanging.
    """

    def __init__(self, group: TpGroup, *, round_wait: float = ROUND_WAIT_S,
                 on_agreed: Callable[[str, bool], None] | None = None,
                 clock: Clock = time.monotonic) -> None:
        if not round_wait > 0:
            raise ValueError("round_wait must be > 0")
        self.group = group
        self.round_wait = round_wait
        self.rounds = 0
        self.agreed: dict[str, bool] = {}
        self.error: BaseException | None = None
        self._on_agreed = on_agreed
        self._clock = clock
        self._cond = threading.Condition()
        self._fresh: set[str] = set()
        self._closing = False
        self._thread: threading.Thread | None = None

    def notify(self, ready: RequestReady) -> None:
        """A local outcome is ready (the DecodeWorker's ``on_ready``): join a round soon."""
        with self._cond:
            self._fresh.add(ready.ext_req_id)
            self._cond.notify_all()

    def take_local(self, worker: DecodeWorker) -> dict[str, bool]:
        """The outcomes to contribute to the next round, read from the core at round time
        rather than from the notifications: the ``request_status`` table decides what a
        request's local outcome is (a failure after an earlier success sticks, R4)."""
        with self._cond:
            fresh, self._fresh = self._fresh, set()
        local = {}
        for ext in sorted(fresh):
            outcome = worker.local_outcome(ext)
            if outcome is not None:
                local[ext] = outcome
        return local

    def round(self, worker: DecodeWorker) -> list[RequestFinished]:
        """One collective round on the caller's thread (inside vLLM, once per step from
        ``get_transfer_results``, so every rank joins every collective in vLLM's order):
        contribute the local outcomes, apply what the group agreed, return the terminal
        status of those requests."""
        local = self.take_local(worker)
        agreed = self.group.agree(local)
        self.rounds += 1
        finished: list[RequestFinished] = []
        for ext_req_id, ok in agreed.items():
            finished += worker.apply_agreement(ext_req_id, ok)
            with self._cond:
                self.agreed[ext_req_id] = ok
        return finished

    def wait_fresh(self, timeout: float) -> bool:
        """Block until some local outcome awaits the next round; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._fresh), timeout)

    def start(self, worker: DecodeWorker, until: Callable[[Mapping[str, bool]], bool]) -> None:
        if self._thread is not None:
            raise ControlPlaneError("agreement loop already started")
        self._thread = threading.Thread(target=self.run, args=(worker, until),
                                        name=f"decode{self.group.rank}-agree", daemon=True)
        self._thread.start()

    def run(self, worker: DecodeWorker, until: Callable[[Mapping[str, bool]], bool]) -> None:
        """The loop itself (``start`` runs it on a thread)."""
        last = self._clock()
        try:
            while not until(self.agreed):
                with self._cond:
                    deadline = last + self.round_wait
                    while not self._fresh and not self._closing:
                        remaining = deadline - self._clock()
                        if remaining <= 0:
                            break
                        self._cond.wait(remaining)
                    if self._closing:
                        return
                local = self.take_local(worker)
                agreed = self.group.agree(local)  # collective: every rank, every round
                last = self._clock()
                self.rounds += 1
                for ext_req_id, ok in agreed.items():
                    worker.apply_agreement(ext_req_id, ok)
                    with self._cond:
                        self.agreed[ext_req_id] = ok
                        self._cond.notify_all()
                    if self._on_agreed is not None:
                        self._on_agreed(ext_req_id, ok)
        except BaseException as exc:  # noqa: BLE001 - surfaced through .error / join()
            log.exception("agreement loop on rank %d failed", self.group.rank)
            self.error = exc
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()

    def wait(self, timeout: float) -> bool:
        """Block until the loop has ended; True when it did within ``timeout``."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise ControlPlaneError(
                    f"agreement loop did not stop within {timeout}s (blocked in a collective "
                    "until the group's timeout)")
