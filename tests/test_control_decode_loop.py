"""The Decode reader thread's loop (``DecodeWorker._run``): it answers on the core's own
deadlines with no other traffic, and sleeps while there is nothing to do. A raw DEALER
plays Prefill over real loopback ZMQ."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from test_control import WAIT, SteppedClock, _dealer, _recv, make_decode, make_prefill

from sfa_rd2h.runtime.control import BindError, ControlPlaneError, CurveSecurity, DecodeWorker
from sfa_rd2h.runtime.engines.host import HostEngine
from sfa_rd2h.spec import wire
from sfa_rd2h.spec.errors import ProtocolError, WireError
from sfa_rd2h.statemachines.cores.decode import DecodeCore
from sfa_rd2h.statemachines.trace import Tracer


def _handshake(sock: zmq.Socket, session: str, layers: dict[str, wire.LayerMeta]) -> None:
    sock.send(wire.encode(wire.MfMeta(session, layers, wire.PROTOCOL_VERSION)))
    assert wire.decode_meta_reply(_recv(sock)).accepted


def test_a_held_ready_is_answered_exactly_at_its_deadline_with_no_other_traffic(
        engines: tuple[HostEngine, HostEngine]) -> None:
    """C1: a READY whose destinations never come is answered when the core's deadline is
    reached (not later, not only when another frame arrives), by the reader thread's own
    poll timeout: the missing request fails (R5), and the READY, with nothing else to
    read, is done."""
    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)
    clock = SteppedClock(100.0)
    held = threading.Event()

    def observe(machine: str, key: str, event: str, src: str, dst: str, args: tuple) -> None:
        if dst == "awaiting_destinations":
            held.set()

    core = DecodeCore(0, 1, d.layouts, destination_wait=0.25, observer=observe)
    dw = DecodeWorker(core, de, 0, clock=clock)
    ctx = zmq.Context()
    sock = _dealer(ctx, dw.port, b"prefill")
    try:
        _handshake(sock, pe.session_id, p.layers)
        sock.send(wire.encode(wire.ReadReadyBatch(0, "l0", (wire.ReadReq("ghost", (1,), (1,)),),
                                                  ("ghost",))))
        assert held.wait(WAIT)
        assert not sock.poll(100)  # held: the clock has not reached the deadline
        clock.now = 100.0 + 0.25  # exactly the deadline the core set
        assert wire.decode(_recv(sock)) == wire.ReadDone(0)
        dw.register_request("ghost", [1], [1])
        assert dw.local_outcome("ghost") is False  # a layer of it went unread
    finally:
        sock.close()
        dw.close()
        ctx.term()


def _thread_cpu_seconds(native_id: int) -> float:
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_an_idle_reader_thread_sleeps_in_its_poll(engines: tuple[HostEngine, HostEngine],
                                                  ) -> None:
    """No busy polling: with a connection open, a READY held for destinations (a deadline
    ahead) and nothing else to do, the reader thread uses next to no CPU. A loop that polls
    with a zero timeout, or for writability of its always-writable sockets, spins at 100%
    of a core."""
    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)
    core = DecodeCore(0, 1, d.layouts, destination_wait=20.0)
    dw = DecodeWorker(core, de, 0)
    dw.register_request("real", [3], [3])
    ctx = zmq.Context()
    sock = _dealer(ctx, dw.port, b"prefill")
    try:
        _handshake(sock, pe.session_id, p.layers)
        # one read first: its lane rings the reader's wake-up, which must be drained
        sock.send(wire.encode(wire.ReadReadyBatch(0, "l0", (wire.ReadReq("real", (2,), (2,)),),
                                                  ("real",))))
        assert isinstance(wire.decode(_recv(sock)), wire.ReadDone)
        sock.send(wire.encode(wire.ReadReadyBatch(0, "l0", (wire.ReadReq("ghost", (1,), (1,)),),
                                                  ("ghost",))))
        assert not sock.poll(200)  # held; the reader is back in its poll
        reader = dw._thread.native_id
        assert reader is not None
        before, t0 = _thread_cpu_seconds(reader), time.monotonic()
        assert not sock.poll(1000)  # the measurement window: nothing may arrive
        used, wall = _thread_cpu_seconds(reader) - before, time.monotonic() - t0
        assert used < 0.1 * wall, f"reader thread used {used:.2f}s CPU in {wall:.2f}s idle"
    finally:
        sock.close()
        dw.close()
        ctx.term()


# --------------------------------------------------------------------------- what the reader
# reports: every bad, refused or undeliverable frame is counted, logged (throttled per kind)
# with the whole error, and traced.

LOGGER = "sfa_rd2h.runtime.control"


def _records(tracer: Tracer) -> list[dict[str, Any]]:
    tracer.close()
    return [json.loads(line) for line in tracer.path.read_text().splitlines()]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_bad_framing_is_counted_logged_whole_and_traced_cut_to_200_chars(
        engines: tuple[HostEngine, HostEngine], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A message that is not identity + one payload is dropped: counted every time, logged
    once per interval with its rank and the whole error, and traced once (the record's
    error cut to 200 characters, so a hostile frame cannot bloat the trace)."""
    _, de = engines
    d = make_decode(de, 1)
    long_error = "".join(chr(ord("a") + i % 26) for i in range(300))
    real_split = wire.split_router_frames

    def split(frames: Any) -> tuple[bytes, bytes]:
        identity, payload = real_split(frames)
        if payload == b"too-long-to-trace":
            raise WireError(long_error)
        return identity, payload

    monkeypatch.setattr(wire, "split_router_frames", split)
    tracer = Tracer(tmp_path / "d.jsonl", "d0", role="decode")
    dw = DecodeWorker(DecodeCore(0, 1, d.layouts), de, 0, tracer=tracer)
    ctx = zmq.Context()
    sock = _dealer(ctx, dw.port, b"prefill")
    try:
        with caplog.at_level("WARNING", logger=LOGGER):
            sock.send(b"too-long-to-trace")
            sock.send(b"too-long-to-trace")
            _handshake(sock, "127.0.0.1:1", {})  # FIFO: both were handled before its reply
        assert dw.stats.bad_framing == 2
        assert dw.stats.frames_received == 3
        assert _warnings(caplog) == [f"decode rank 0: dropped a message: {long_error}"]
    finally:
        sock.close()
        dw.close()
        ctx.term()
    traced = [{k: v for k, v in r.items() if k != "t"} for r in _records(tracer)
              if r.get("event") == "bad_framing"]
    assert traced == [{"k": "info", "event": "bad_framing", "error": long_error[:200]}]


def test_a_protocol_error_out_of_the_core_is_counted_logged_and_the_reader_goes_on(
        engines: tuple[HostEngine, HostEngine], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The core answers what it can itself; a ProtocolError that still escapes it refuses
    that one frame: counted each time, logged once per interval naming the rank, the peer
    and the error, and the next frame is served. Kinds are throttled apart: a bad framing
    right after is logged too."""
    _, de = engines
    d = make_decode(de, 1)
    core = DecodeCore(0, 1, d.layouts)
    real_on_frame = core.on_frame

    def on_frame(peer: str, payload: bytes, now: float) -> list[Any]:
        if payload == b"refuse-me":
            raise ProtocolError("W5: refused by the test")
        return real_on_frame(peer, payload, now)

    monkeypatch.setattr(core, "on_frame", on_frame)
    dw = DecodeWorker(core, de, 0)
    ctx = zmq.Context()
    sock = _dealer(ctx, dw.port, b"prefill-7")
    try:
        with caplog.at_level("WARNING", logger=LOGGER):
            sock.send(b"refuse-me")
            sock.send(b"refuse-me")
            sock.send_multipart([b"one", b"two"])
            _handshake(sock, "127.0.0.1:1", {})  # served after the refusals (FIFO)
        assert dw.stats.rejected_frames == 2
        assert dw.stats.bad_framing == 1
        assert _warnings(caplog) == [
            f"decode rank 0: rejected frame from {b'prefill-7'.hex()}: W5: refused by the test",
            "decode rank 0: dropped a message: router frames: expected exactly one non-empty "
            "payload frame, got 2"]
        assert dw._thread.is_alive()
    finally:
        sock.close()
        dw.close()
        ctx.term()


def test_replies_to_a_vanished_prefill_are_counted_logged_traced_and_forget_it(
        engines: tuple[HostEngine, HostEngine], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """S5: two Prefill connections sent MF_META and a READY held for destinations, then went
    away. When the destinations come the reads run, and each READ_DONE is undeliverable
    (ROUTER_MANDATORY): counted each time, logged once per interval with the rank, the peer
    and ZMQ's error, traced as a send, and the core forgets each connection (its next READY
    needs a new MF_META, W1). A live Prefill is still answered."""
    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)
    tracer = Tracer(tmp_path / "d.jsonl", "d0", role="decode")
    core = DecodeCore(0, 1, d.layouts, destination_wait=WAIT)
    ready: list[str] = []
    cond = threading.Condition()

    def on_ready(a: Any) -> None:
        with cond:
            ready.append(a.ext_req_id)
            cond.notify_all()

    dw = DecodeWorker(core, de, 0, tracer=tracer, on_ready=on_ready)
    ghosts = {"r1": b"gone-1".hex(), "r2": b"gone-2".hex()}
    meta = wire.encode(wire.MfMeta(pe.session_id, p.layers, wire.PROTOCOL_VERSION))
    with dw._cond:  # what those connections sent before they vanished
        for ext, ghost in ghosts.items():
            core.on_frame(ghost, meta, time.monotonic())
            core.on_frame(ghost, wire.encode(wire.ReadReadyBatch(
                0, "l0", (wire.ReadReq(ext, (1,), (1,)),), (ext,))), time.monotonic())
    ctx = zmq.Context()
    sock = _dealer(ctx, dw.port, b"alive")
    try:
        with caplog.at_level("WARNING", logger=LOGGER):
            dw.register_request("r1", [2], [2])
            dw.register_request("r2", [3], [3])
            with cond:  # each READ_DONE was sent (and failed) before its on_ready
                assert cond.wait_for(lambda: len(ready) == 2, WAIT)
            _handshake(sock, "127.0.0.1:1", {})
        assert dw.stats.undeliverable == 2
        assert _warnings(caplog) == [
            f"decode rank 0: reply to {ghosts['r1']} undeliverable: Host unreachable"]
        assert not set(ghosts.values()) & set(core.connections)
        assert b"alive".hex() in core.connections
    finally:
        sock.close()
        dw.close()
        ctx.term()
    sends = [(r["dir"], r["peer"], r["kind"]) for r in _records(tracer) if r["k"] == "msg"]
    assert sends == [("send", ghosts["r1"], "read_done"), ("send", ghosts["r2"], "read_done"),
                     ("recv", b"alive".hex(), "mf_meta"),
                     ("send", b"alive".hex(), "mf_meta_ack")]


# --------------------------------------------------------------------------- what it shows


def test_an_ipv6_rank_shows_its_endpoint_in_brackets_and_traces_it(
        engines: tuple[HostEngine, HostEngine], tmp_path: Path) -> None:
    """P1: ``endpoint`` is what Prefill connects to and what the trace pairs connections
    by; an IPv6 host is bracketed (``[::1]:port``) so the port stays separable, an IPv4
    one is not. A Prefill reaches the rank at that endpoint."""
    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)
    ctx = zmq.Context()
    ctx.setsockopt(zmq.IPV6, 1)  # sockets of this context speak IPv6
    tracer = Tracer(tmp_path / "d.jsonl", "d0", role="decode")
    dw = DecodeWorker(DecodeCore(0, 1, d.layouts), de, 0, host="::1", tracer=tracer,
                      context=ctx)
    v4 = DecodeWorker(DecodeCore(0, 1, d.layouts), de, 0, context=ctx)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        assert dw.endpoint == f"[::1]:{dw.port}"
        assert v4.endpoint == f"127.0.0.1:{v4.port}"
        sock.connect(f"tcp://{dw.endpoint}")
        _handshake(sock, pe.session_id, p.layers)
    finally:
        sock.close()
        dw.close()
        v4.close()
        ctx.term()
    infos = [{k: v for k, v in r.items() if k != "t"} for r in _records(tracer)
             if r["k"] == "info"]
    assert infos == [{"k": "info", "endpoint": f"[::1]:{dw.port}"}]


def test_a_host_it_cannot_bind_is_named_with_the_any_port_address(
        engines: tuple[HostEngine, HostEngine]) -> None:
    """P1: with port 0 the rank binds any free port (``tcp://host:*``); when even that
    fails, the error names the address it tried and ZMQ's reason."""
    _, de = engines
    d = make_decode(de, 1)
    with pytest.raises(BindError) as info:
        DecodeWorker(DecodeCore(0, 1, d.layouts), de, 0, host="no-such-interface")
    assert str(info.value).startswith(
        "Decode rank 0 cannot bind its ROUTER on tcp://no-such-interface:* (P1): ")
    assert str(info.value).endswith(info.value.__cause__.strerror)  # type: ignore[union-attr]


def test_curve_authentication_logs_to_the_control_logger(
        engines: tuple[HostEngine, HostEngine], caplog: pytest.LogCaptureFixture) -> None:
    """Who the CURVE authenticator let in is logged where the rest of the control plane
    logs (``sfa_rd2h.runtime.control``, at DEBUG), not under pyzmq's own logger."""
    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)
    server, client = CurveSecurity.generate(), CurveSecurity.generate()
    dw = DecodeWorker(DecodeCore(0, 1, d.layouts), de, 0,
                      curve=CurveSecurity(server.public, server.secret,
                                          allowed_clients=frozenset({client.public})))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_publickey, sock.curve_secretkey = client.public, client.secret
    sock.curve_serverkey = server.public
    try:
        with caplog.at_level("DEBUG", logger=LOGGER):
            sock.connect(f"tcp://127.0.0.1:{dw.port}")
            _handshake(sock, pe.session_id, p.layers)  # authenticated before it arrived
        assert (f"ALLOWED (CURVE auth_callback) domain=* client_key={client.public!r}"
                in _warnings(caplog))
    finally:
        sock.close()
        dw.close()
        ctx.term()


def test_read_lanes_are_named_after_the_rank(engines: tuple[HostEngine, HostEngine]) -> None:
    """A thread dump names the thread a batched read runs on: ``decode<rank>-read-<n>``."""
    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)
    names: list[str] = []

    class Recording:
        def batch_transfer_sync_read(self, *args: Any) -> int:
            names.append(threading.current_thread().name)
            return de.batch_transfer_sync_read(*args)

    dw = DecodeWorker(DecodeCore(3, 4, d.layouts), Recording(), 0)  # type: ignore[arg-type]
    ctx = zmq.Context()
    sock = _dealer(ctx, dw.port, b"prefill")
    try:
        _handshake(sock, pe.session_id, p.layers)
        dw.register_request("r", [2], [2])
        sock.send(wire.encode(wire.ReadReadyBatch(0, "l0", (wire.ReadReq("r", (1,), (1,)),),
                                                  ("r",))))
        assert isinstance(wire.decode(_recv(sock)), wire.ReadDone)
        assert names == ["decode3-read-0"]
    finally:
        sock.close()
        dw.close()
        ctx.term()


def test_frames_queued_behind_a_dropped_or_refused_one_are_served_before_the_timers(
        engines: tuple[HostEngine, HostEngine], monkeypatch: pytest.MonkeyPatch) -> None:
    """A dropped (bad framing) or refused (ProtocolError) frame does not end the batch the
    reader took: the frames queued behind it are answered before it turns to its timers.
    Here a held READY's deadline is reached while two more MF_METAs wait behind a bad and a
    refused frame: both acks come before the READ_FAILED. The frames come over inproc (the
    ROUTER binds it on the reader thread), so they are all queued before the reader, held
    in a frame of the test's, goes on."""
    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)
    clock = SteppedClock(100.0)
    held, gated, release = threading.Event(), threading.Event(), threading.Event()
    inproc = f"inproc://decode-loop-{os.getpid()}-{id(held)}"

    def observe(machine: str, key: str, event: str, src: str, dst: str, args: tuple) -> None:
        if dst == "awaiting_destinations":
            held.set()

    core = DecodeCore(0, 1, d.layouts, destination_wait=5.0, observer=observe)
    real_on_frame = core.on_frame

    def on_frame(peer: str, payload: bytes, now: float) -> list[Any]:
        if payload == b"bind-inproc":  # on the reader thread, which owns the ROUTER
            dw._router.bind(inproc)
            gated.set()
            return []
        if payload == b"gate":
            gated.set()
            assert release.wait(WAIT)
            return []
        if payload == b"refuse-me":
            raise ProtocolError("W5: refused by the test")
        return real_on_frame(peer, payload, now)

    monkeypatch.setattr(core, "on_frame", on_frame)
    ctx = zmq.Context()
    dw = DecodeWorker(core, de, 0, clock=clock, context=ctx)
    tcp = _dealer(ctx, dw.port, b"binder")
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        tcp.send(b"bind-inproc")
        assert gated.wait(WAIT)
        gated.clear()
        sock.connect(inproc)
        _handshake(sock, pe.session_id, p.layers)
        sock.send(wire.encode(wire.ReadReadyBatch(0, "l0", (wire.ReadReq("ghost", (1,), (1,)),),
                                                  ("ghost",))))
        assert held.wait(WAIT)
        sock.send(b"gate")
        assert gated.wait(WAIT)  # the reader is in the gate frame
        meta = wire.encode(wire.MfMeta(pe.session_id, p.layers, wire.PROTOCOL_VERSION))
        sock.send_multipart([b"one", b"two"])
        sock.send(meta)
        sock.send(b"refuse-me")
        sock.send(meta)  # inproc: all of them are queued at the ROUTER now
        clock.now = 105.0  # the held READY's deadline
        release.set()
        replies = [wire.decode(_recv(sock)) for _ in range(3)]
        # then the held READY's deadline: its missing request fails alone (R5), the READY is done
        assert [type(r) for r in replies] == [wire.MfMetaAck, wire.MfMetaAck, wire.ReadDone]
        assert dw.stats.bad_framing == 1 and dw.stats.rejected_frames == 1
    finally:
        release.set()
        sock.close()
        tcp.close()
        dw.close()
        ctx.term()


def test_a_prefill_that_stops_reading_loses_its_replies_but_blocks_no_one(
        engines: tuple[HostEngine, HostEngine], monkeypatch: pytest.MonkeyPatch) -> None:
    """S5: replies to a Prefill that stopped reading pile up to the high-water mark; beyond
    it each reply is dropped and counted as undeliverable at once, instead of blocking the
    reader (and every other Prefill it serves) until that one reads again. Over inproc with
    a receive HWM of 1 the queue holds about 1001 replies, so of 1200 some are dropped, and
    every one of them was either queued or counted."""
    _, de = engines
    d = make_decode(de, 1)
    n = 1200
    bound, all_handled = threading.Event(), threading.Event()
    inproc = f"inproc://decode-loop-{os.getpid()}-{id(bound)}"
    stuck = b"stuck".hex()
    core = DecodeCore(0, 1, d.layouts)
    real_on_frame = core.on_frame
    seen = [0]

    def on_frame(peer: str, payload: bytes, now: float) -> list[Any]:
        if payload == b"bind-inproc":  # on the reader thread, which owns the ROUTER
            dw._router.bind(inproc)
            bound.set()
            return []
        if peer == stuck:
            seen[0] += 1
            if seen[0] == n:  # its reply goes out before the reader takes another frame
                all_handled.set()
        return real_on_frame(peer, payload, now)

    monkeypatch.setattr(core, "on_frame", on_frame)
    ctx = zmq.Context()
    dw = DecodeWorker(core, de, 0, context=ctx)
    other = _dealer(ctx, dw.port, b"other")
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"stuck")
    sock.setsockopt(zmq.RCVHWM, 1)
    try:
        other.send(b"bind-inproc")
        assert bound.wait(WAIT)
        sock.connect(inproc)
        meta = wire.encode(wire.MfMeta("127.0.0.1:1", {}, wire.PROTOCOL_VERSION))
        for _ in range(n):
            sock.send(meta)  # and never read the replies (yet)
        assert all_handled.wait(WAIT)
        _handshake(other, "127.0.0.1:2", {})  # served after the stuck peer's frames
        dropped = dw.stats.undeliverable
        assert dropped > 0
        queued = 0
        while sock.poll(0):
            assert wire.decode_meta_reply(sock.recv()).accepted
            queued += 1
        assert queued + dropped == n
    finally:
        sock.close()
        other.close()
        dw.close()
        ctx.term()


def test_close_gives_replies_a_stuck_prefill_never_takes_only_the_linger_period(
        engines: tuple[HostEngine, HostEngine]) -> None:
    """Replies still queued at close go out for ``linger_ms`` and are then dropped: a
    Prefill that stopped reading (its socket buffers full of READ_FAILEDs carrying a
    transfer engine's long error) cannot hold up the close of a rank that owns its ZMQ
    context, which terminates that context."""
    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)
    n = 200  # replies of ~60 KB each: far more than the socket buffers hold
    answered = threading.Semaphore(0)

    class Failing:
        def batch_transfer_sync_read(self, *args: Any) -> int:
            raise RuntimeError("x" * 60000)

    dw = DecodeWorker(DecodeCore(0, 1, d.layouts), Failing(), 0,  # type: ignore[arg-type]
                      linger_ms=100, on_ready=lambda a: answered.release())  # own context
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(f"tcp://127.0.0.1:{dw.port}")
    closed = threading.Event()
    try:
        _handshake(sock, pe.session_id, p.layers)
        for i in range(n):
            ext = f"r{i}"
            dw.register_request(ext, [1], [1])
            sock.send(wire.encode(wire.ReadReadyBatch(0, "l0", (wire.ReadReq(ext, (1,), (1,)),),
                                                      (ext,))))
        for _ in range(n):  # each READ_FAILED was handed to ZMQ before its on_ready
            assert answered.acquire(timeout=WAIT)

        def close() -> None:
            dw.close()
            closed.set()

        threading.Thread(target=close, daemon=True).start()
        assert closed.wait(3.0), "close waited for replies the peer never takes"
    finally:
        sock.close()  # lets a close that waited on it finish
        if not closed.wait(WAIT):
            dw.close()
        ctx.term()


def test_close_of_a_stuck_reader_gives_up_after_its_own_timeout(
        engines: tuple[HostEngine, HostEngine]) -> None:
    """close(timeout) is bounded by ``timeout`` (at least 0.1 s for the reader), counted
    from the call: a reader stuck in a callback is reported while it is still stuck, not
    waited for."""
    _, de = engines
    d = make_decode(de, 1)
    entered, release = threading.Event(), threading.Event()

    def stuck(a: Any) -> None:
        entered.set()
        assert release.wait(WAIT)

    dw = DecodeWorker(DecodeCore(0, 1, d.layouts, request_deadline=0.05), de, 0,
                      on_ready=stuck)
    out: list[BaseException | None] = []
    stuck_when_closed: list[bool] = []

    def close() -> None:
        try:
            dw.close(0.05)
            out.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)
        stuck_when_closed.append(not release.is_set())

    dw.register_request("r", [1], [1])
    assert entered.wait(WAIT)
    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    closer.join(3.0)
    release.set()
    closer.join(WAIT)
    dw.close()
    assert stuck_when_closed == [True]
    [exc] = out
    assert isinstance(exc, ControlPlaneError)
    assert str(exc) == "decode 0 reader thread did not stop within 0.1s"
