"""The Decode reader thread's loop (``DecodeWorker._run``): it answers on the core's own
deadlines with no other traffic, and sleeps while there is nothing to do. A raw DEALER
plays Prefill over real loopback ZMQ."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from test_control import WAIT, _dealer, _recv, make_decode, make_prefill

from sfa_rd2h.runtime.control import DecodeWorker
from sfa_rd2h.runtime.engines.host import HostEngine
from sfa_rd2h.spec import wire
from sfa_rd2h.statemachines.cores.decode import DecodeCore


@pytest.fixture
def engines() -> Iterator[tuple[HostEngine, HostEngine]]:
    pe, de = HostEngine(), HostEngine()
    pe.initialize()
    de.initialize()
    yield pe, de
    pe.close()
    de.close()


class SteppedClock:
    """A clock that moves only when the test moves it."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _handshake(sock: zmq.Socket, session: str, layers: dict[str, wire.LayerMeta]) -> None:
    sock.send(wire.encode(wire.MfMeta(session, layers, wire.PROTOCOL_VERSION)))
    assert wire.decode_meta_reply(_recv(sock)).accepted


def test_a_held_ready_fails_exactly_at_its_deadline_with_no_other_traffic(
        engines: tuple[HostEngine, HostEngine]) -> None:
    """C1: a READY whose destinations never come is answered READ_FAILED when the core's
    deadline is reached (not later, not only when another frame arrives), by the reader
    thread's own poll timeout."""
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
        reply = wire.decode(_recv(sock))
        assert isinstance(reply, wire.ReadFailed) and reply.layer_idx == 0
        assert reply.error == "C1: destinations of ghost not registered within 0.25s"
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
