"""The control plane in one process: PrefillWorker and DecodeWorker threads over real loopback
ZMQ sockets, bytes moved by real HostEngines (the reader copies out of registered numpy
memory by address). Plus the trace validator on real and on tampered traces.

Nothing here sleeps to wait: every wait is on an Event, a Condition inside the workers, or a
ZMQ poll, each with a timeout that only bounds a failure."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from sfa_rd2h.runtime.control import (
    AgreementLoop,
    BindError,
    ControlPlaneError,
    CurveSecurity,
    DecodeWorker,
    LayerSendTimeout,
    PrefillWorker,
    terminate_within,
)
from sfa_rd2h.runtime.engines.host import HostEngine
from sfa_rd2h.runtime.tools.validate import cmd_validate
from sfa_rd2h.runtime.tp_group import SingleRankGroup
from sfa_rd2h.spec import wire
from sfa_rd2h.spec.layout import DestLayout
from sfa_rd2h.spec.topology import tp_mapping
from sfa_rd2h.statemachines.cores.actions import RequestFinished
from sfa_rd2h.statemachines.cores.decode import DecodeCore
from sfa_rd2h.statemachines.cores.prefill import LayerSendError, PrefillCore
from sfa_rd2h.statemachines.trace import Tracer, summarize, validate

TB = (64, 64, 16)  # bytes per block: main K, main V, indexer
BLOCK = 4  # tokens per block
NB = 16  # blocks per tensor on each side
WAIT = 10.0  # bound on awaiting something that should happen promptly


def _pattern(req: int, layer: int, t: int) -> int:
    return (req * 31 + layer * 7 + t + 1) % 251


@dataclass
class Prefill:
    engine: HostEngine
    slots: list[list[np.ndarray]]
    layers: dict[str, wire.LayerMeta]
    tracer: Tracer | None = None

    def core(self, **kw: Any) -> PrefillCore:
        return PrefillCore(0, tp_mapping(1, 1), self.engine.session_id, self.layers,
                           block_size=BLOCK, observer=self.tracer, **kw)

    def write(self, layer: int, req: int, main_ids: list[int], idx_ids: list[int]) -> None:
        slot = self.slots[layer % len(self.slots)]
        for t, arr in enumerate(slot):
            arr[main_ids if t < 2 else idx_ids] = _pattern(req, layer, t)


@dataclass
class Decode:
    engine: HostEngine
    dest: list[list[np.ndarray]]  # [layer][tensor]
    layouts: dict[str, DestLayout]
    tracer: Tracer | None = None
    finished: dict[str, RequestFinished] = field(default_factory=dict)
    done: threading.Condition = field(default_factory=threading.Condition)

    def on_finished(self, a: RequestFinished) -> None:
        with self.done:
            self.finished[a.ext_req_id] = a
            self.done.notify_all()

    def wait_finished(self, ext: str, timeout: float = WAIT) -> RequestFinished:
        with self.done:
            assert self.done.wait_for(lambda: ext in self.finished, timeout), \
                f"{ext} did not finish within {timeout}s"
            return self.finished[ext]

    def check(self, layer: int, req: int, main_ids: list[int], idx_ids: list[int]) -> None:
        for t, arr in enumerate(self.dest[layer]):
            got = arr[main_ids if t < 2 else idx_ids]
            assert (got == _pattern(req, layer, t)).all(), f"layer {layer} tensor {t}"


def make_prefill(engine: HostEngine, n_layers: int, n_slots: int,
                 tracer: Tracer | None = None) -> Prefill:
    slots = [[np.zeros((NB, n), np.uint8) for n in TB] for _ in range(n_slots)]
    for row in slots:
        for a in row:
            engine.register_memory(a.ctypes.data, a.nbytes)
    layers = {f"l{i}": wire.LayerMeta(tuple(a.ctypes.data for a in slots[i % n_slots]), TB,
                                      (1, 1, 1), (0, 0, 1), 2, True) for i in range(n_layers)}
    return Prefill(engine, slots, layers, tracer)


def make_decode(engine: HostEngine, n_layers: int, tracer: Tracer | None = None) -> Decode:
    dest = [[np.zeros((NB, n), np.uint8) for n in TB] for _ in range(n_layers)]
    for row in dest:
        for a in row:
            engine.register_memory(a.ctypes.data, a.nbytes)
    layouts = {f"l{i}": DestLayout(tuple(a.ctypes.data for a in dest[i]), TB, (NB,) * 3, 2,
                                   True, False) for i in range(n_layers)}
    return Decode(engine, dest, layouts, tracer)


def _watch_gate_failures(p: Prefill) -> threading.Event:
    """An Event set when any of the Prefill core's slot gates fails (its only observer)."""
    failed = threading.Event()

    def observe(machine: str, key: str, event: str, src: str, dst: str, args: tuple) -> None:
        if dst == "failed":
            failed.set()

    p.tracer = observe  # type: ignore[assignment]
    return failed


def params(port: int) -> dict[str, Any]:
    return {"remote_host": "127.0.0.1", "remote_port": port, "remote_tp_size": 1}


def run_layers(pw: PrefillWorker, p: Prefill, req: int, main_ids: list[int],
               idx_ids: list[int], n_layers: int) -> None:
    for layer in range(n_layers):
        pw.wait_for_layer_send(layer, WAIT)
        pw.begin_layer(layer)
        p.write(layer, req, main_ids, idx_ids)
        pw.layer_written(layer, None)


# --------------------------------------------------------------------------- happy path


def test_one_request_end_to_end(engines: tuple[HostEngine, HostEngine],
                                tmp_path: Path) -> None:
    pe, de = engines
    n_layers = 3  # on 2 slots: layer 2 reuses layer 0's slot, so its gate must open (S1)
    ptr = Tracer(tmp_path / "p.jsonl", "p0", role="prefill")
    dtr = Tracer(tmp_path / "d.jsonl", "d0", role="decode")
    p = make_prefill(pe, n_layers, 2, ptr)
    d = make_decode(de, n_layers, dtr)
    dcore = DecodeCore(0, 1, d.layouts, observer=dtr)
    loop = AgreementLoop(SingleRankGroup())
    dw = DecodeWorker(dcore, de, 0, tracer=dtr, on_ready=loop.notify,
                      on_finished=d.on_finished)
    loop.start(dw, until=lambda agreed: "r1" in agreed)
    pw = PrefillWorker(p.core(), tracer=ptr)
    main_ids, idx_ids = [9, 3, 5], [2, 4, 6]  # non-contiguous on purpose
    try:
        assert pw.add_request("r1", params(dw.port), main_ids, idx_ids) == dw.endpoint
        dw.register_request("r1", [1, 2, 3], [7, 8, 9])
        pw.schedule_chunk("r1", 10, True)  # 2 full blocks + a partial one, final (C2)
        run_layers(pw, p, 1, main_ids, idx_ids, n_layers)
        result = d.wait_finished("r1")
        assert result.ok and result.error is None
        for layer in range(n_layers):
            d.check(layer, 1, [1, 2, 3], [7, 8, 9])
        assert pw.drain(WAIT) == []
        assert len(pw.round_trips()) == n_layers
        assert dw.stats.reads == n_layers and dw.stats.failed_reads == 0
        assert dw.stats.bytes_read == n_layers * 3 * sum(TB)
        assert loop.wait(WAIT) and loop.error is None and loop.agreed == {"r1": True}
    finally:
        t0 = time.monotonic()
        pw.close()
        loop.close()
        dw.close()
        assert time.monotonic() - t0 < 3.0  # nothing in flight: well inside the bounds
        ptr.close()
        dtr.close()
    report = validate([tmp_path / "p.jsonl", tmp_path / "d.jsonl"])
    assert report.ok, report.summary()
    assert report.transitions > 20 and report.messages == 2 * (2 + 2 * n_layers)


def test_device_event_is_awaited_in_the_sender(engines: tuple[HostEngine, HostEngine]) -> None:
    """C4: the READY waits for the device event, and the compute thread does not."""
    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)
    entered, release = threading.Event(), threading.Event()

    class Event:
        def synchronize(self) -> None:
            entered.set()
            assert release.wait(WAIT)

    loop = AgreementLoop(SingleRankGroup())
    dw = DecodeWorker(DecodeCore(0, 1, d.layouts), de, 0, on_ready=loop.notify,
                      on_finished=d.on_finished)
    loop.start(dw, until=lambda agreed: "r" in agreed)
    core = p.core()
    pw = PrefillWorker(core)
    try:
        pw.add_request("r", params(dw.port), [1], [1])
        dw.register_request("r", [2], [3])
        pw.schedule_chunk("r", 4, True)
        pw.wait_for_layer_send(0, WAIT)
        pw.begin_layer(0)
        pw.layer_written(0, Event())  # returns at once: the compute thread never blocks
        assert entered.wait(WAIT)
        # The sender is inside synchronize(): the slot cannot have been published.
        assert [g.state for g in core.gates_of(0)] == ["writing", "writing"]
        assert dw.stats.frames_received == 0
        p.write(0, 1, [1], [1])  # the "device" finishes writing, then signals
        release.set()
        assert d.wait_finished("r").ok
        d.check(0, 1, [2], [3])
    finally:
        release.set()
        pw.close()
        loop.close()
        dw.close()


# --------------------------------------------------------------------------- failures


def test_port_in_use_fails_within_a_second(engines: tuple[HostEngine, HostEngine]) -> None:
    _, de = engines
    d = make_decode(de, 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(BindError, match=r"P1.*in use") as info:
            DecodeWorker(DecodeCore(0, 1, d.layouts), de, port)
        assert time.monotonic() - t0 < 1.0
        assert f"tcp://127.0.0.1:{port}" in str(info.value)


class SteppedClock:
    """A clock that moves only when the test moves it."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _dealer(ctx: zmq.Context, port: int, identity: bytes) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def _recv(sock: zmq.Socket, timeout: float = WAIT) -> bytes:
    assert sock.poll(int(timeout * 1000)), "no reply within the bound"
    frames = [f for f in sock.recv_multipart() if f]
    assert len(frames) == 1
    return frames[0]


def test_malformed_frames_are_answered_and_the_reader_survives(
        engines: tuple[HostEngine, HostEngine], tmp_path: Path) -> None:
    """W5: garbage gets READ_FAILED where a layer is identifiable, never a crash."""
    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)
    core = DecodeCore(0, 1, d.layouts)
    tracer = Tracer(tmp_path / "d.jsonl", "d0", role="decode")
    dw = DecodeWorker(core, de, 0, tracer=tracer)
    ctx = zmq.Context()
    sock = _dealer(ctx, dw.port, b"garbage-sender")
    try:
        # A READY too short to decode, but its layer index is readable: READ_FAILED.
        sock.send(msgpack.packb([wire.READ_READY_BATCH, 3, "l0"], use_bin_type=True))
        reply = wire.decode(_recv(sock))
        assert isinstance(reply, wire.ReadFailed) and reply.layer_idx == 3
        assert "W5" in reply.error
        # Wrong framing (two payload frames), undecodable bytes, an unknown kind, a READY
        # whose layer is not an int: no layer to answer for, so no reply at all ...
        sock.send_multipart([b"one", b"two"])
        sock.send(b"\xc1\xff\x00 not msgpack")
        sock.send(msgpack.packb([b"no_such_kind", 1], use_bin_type=True))
        sock.send(msgpack.packb([wire.READ_READY_BATCH, "x"], use_bin_type=True))
        # ... which the next reply proves: it answers the MF_META sent after them (FIFO).
        meta = wire.MfMeta("127.0.0.1:1", p.layers, wire.PROTOCOL_VERSION)
        sock.send(wire.encode(meta))
        ack = wire.decode_meta_reply(_recv(sock))
        assert ack.accepted
        assert dw.stats.bad_framing == 1
        assert core.stats.rejected_frames == 4  # short READY, garbage, unknown kind, bad layer
        assert core.stats.replies == {"done": 0, "failed": 1}
        assert dw._thread.is_alive()
    finally:
        sock.close()
        ctx.term()
        t0 = time.monotonic()
        dw.close()
        assert time.monotonic() - t0 < 2.0
        tracer.close()
    # The injected READY came before any MF_META on its connection and Decode refused it
    # with READ_FAILED, which is what W1 asks of Decode: the trace is valid.
    report = validate([tmp_path / "d.jsonl"])
    assert report.ok, report.summary()


def test_validator_flags_a_read_done_for_a_ready_before_mf_meta(tmp_path: Path) -> None:
    """W1 on Decode: only READ_FAILED may answer a READY that came before MF_META."""
    ready = wire.encode(wire.ReadReadyBatch(0, "l0", (), ()))
    for reply, ok in ((wire.ReadFailed(0, "W1: no MF_META"), True), (wire.ReadDone(0), False)):
        path = tmp_path / f"{type(reply).__name__}.jsonl"
        tracer = Tracer(path, "d0", role="decode")
        tracer.message("recv", "rogue", ready)
        tracer.message("send", "rogue", wire.encode(reply))
        tracer.close()
        report = validate([path])
        assert report.ok is ok, report.summary()
        if not ok:
            assert report.divergence.rule == "W1" and "before MF_META" in str(report.divergence)


def test_wait_for_layer_send_times_out_clearly(engines: tuple[HostEngine, HostEngine]) -> None:
    """A slot whose reader never answers: a bounded, explicit error, not a hang (S1)."""
    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)
    dw = DecodeWorker(DecodeCore(0, 1, d.layouts, destination_wait=WAIT * 3,
                                  read_budget=WAIT * 4), de, 0)
    pw = PrefillWorker(p.core())
    try:
        pw.add_request("r", params(dw.port), [1], [1])  # never registered on Decode (C1)
        pw.schedule_chunk("r", 4, True)
        run_layers(pw, p, 1, [1], [1], 1)
        t0 = time.monotonic()
        with pytest.raises(LayerSendTimeout, match=r"S1: layer 0 not writable after 0.3s"):
            pw.wait_for_layer_send(0, 0.3)
        assert 0.3 <= time.monotonic() - t0 < 2.0
    finally:
        t0 = time.monotonic()
        pw.close()
        dw.close()
        assert time.monotonic() - t0 < 3.0  # a READY still waiting does not hold close()


def test_decode_restart_rehandshakes_and_fails_the_outstanding_gate(
        engines: tuple[HostEngine, HostEngine], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """S5 + W1 (known failure 2): Decode restarts on the same port while a READY is
    outstanding. The gate fails instead of hanging, naming the lost connection, and counts
    as settled (its reader will not answer); the next READY goes over a new connection
    after a new MF_META."""
    pe, de = engines
    ptr = Tracer(tmp_path / "p.jsonl", "p0", role="prefill")
    gate_failed = threading.Event()

    def p_observe(machine: str, key: str, event: str, src: str, dst: str, args: tuple) -> None:
        ptr(machine, key, event, src, dst, args)
        if dst == "failed":
            gate_failed.set()

    p = make_prefill(pe, 1, 1, ptr)
    p.tracer = p_observe  # type: ignore[assignment]  # the core's observer only
    d = make_decode(de, 1)
    waiting = threading.Event()

    def observe(machine: str, key: str, event: str, src: str, dst: str, args: tuple) -> None:
        if dst == "awaiting_destinations":
            waiting.set()

    first = DecodeWorker(DecodeCore(0, 1, d.layouts, destination_wait=WAIT * 3,
                                    read_budget=WAIT * 4, observer=observe), de, 0)
    port = first.port
    pw = PrefillWorker(p.core(), tracer=ptr)
    second = None
    try:
        pw.add_request("old", params(port), [1], [1])  # Decode never registers it
        pw.schedule_chunk("old", 4, True)
        run_layers(pw, p, 1, [1], [1], 1)
        assert waiting.wait(WAIT)  # the READY is held on Decode: its gate is outstanding
        assert first.waiting_for_destinations() == 1
        assert pw.layer_settled(0) is False
        with caplog.at_level("WARNING", logger="sfa_rd2h.runtime.control"):
            first.close()  # "restart": the process holding the port goes away
            assert gate_failed.wait(WAIT)
        lost = f"connection to Decode 127.0.0.1:{port} dropped"
        assert f"prefill rank 0: {lost}" in caplog.messages
        assert pw.layer_settled(0) is True  # failed, waiting to be observed (S4)
        assert pw.stats.peers_lost == 1
        t0 = time.monotonic()
        with pytest.raises(LayerSendError, match=f"S4: layer 0 cannot be written.*S5: {lost}"):
            pw.wait_for_layer_send(0, WAIT)
        assert time.monotonic() - t0 < WAIT

        dtr = Tracer(tmp_path / "d.jsonl", "d0", role="decode")
        core2 = DecodeCore(0, 1, d.layouts, observer=dtr)
        second = DecodeWorker(core2, de, port, tracer=dtr, on_finished=d.on_finished)
        loop = AgreementLoop(SingleRankGroup())
        second._on_ready = loop.notify
        loop.start(second, until=lambda agreed: "new" in agreed)
        pw.add_request("new", params(port), [2], [2])
        second.register_request("new", [4], [5])
        pw.schedule_chunk("new", 4, True)
        pw.begin_layer(0)  # the failed gate was observed above; the slot is free
        p.write(0, 7, [2], [2])
        pw.layer_written(0, None)
        assert d.wait_finished("new").ok
        d.check(0, 7, [4], [5])
        assert len(core2.connections) == 1  # the restarted Decode got MF_META again (W1)
        assert pw.drain(WAIT) == []
        loop.close()
    finally:
        pw.close()
        if second is not None:
            second.close()
        ptr.close()
    records = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    metas = [r["conn"] for r in records if r["k"] == "msg" and r.get("kind") == "mf_meta"]
    conns = [r for r in records if r["k"] == "conn"]
    assert len(metas) == 2 and metas[0] != metas[1]  # one handshake per connection
    assert [c["ev"] for c in conns] == ["open", "lost", "open", "close"]
    dtr.close()
    report = validate([tmp_path / "p.jsonl", tmp_path / "d.jsonl"])
    assert report.ok, report.summary()


# --------------------------------------------------------------------------- traces


def test_summarize_reads_kind_and_layer_only() -> None:
    ready = wire.encode(wire.ReadReadyBatch(5, "l5", (), (), 0, 1))
    assert summarize(ready) == ("read_ready_batch", 5)
    assert summarize(wire.encode(wire.ReadFailed(2, "x"))) == ("read_failed", 2)
    assert summarize(wire.encode(wire.ReadDone(7))) == ("read_done", 7)
    assert summarize(wire.RAW_ACK) == ("ack", None)
    assert summarize(b"\xc1") == ("malformed", None)
    assert summarize(msgpack.packb([b"read_done", "seven"])) == ("read_done", None)


def _trace(path: Path, role: str, **info: Any) -> Tracer:
    return Tracer(path, path.stem, role=role, **info)


def test_validate_reports_an_undeclared_transition_with_file_and_line(tmp_path: Path) -> None:
    t = _trace(tmp_path / "p.jsonl", "prefill")
    t("prefill_slot", "main@0x1", "start", "", "free", ())
    t("prefill_slot", "main@0x1", "begin_write", "free", "writing", (0,))
    t("prefill_slot", "main@0x1", "publish", "writing", "free", (frozenset(),))  # no landing
    t.close()
    report = validate([tmp_path / "p.jsonl"])
    d = report.divergence
    assert d is not None and d.line == 4 and d.rule == "machines"
    assert str(d).startswith(f"{tmp_path / 'p.jsonl'}:4: machines:")
    assert "'publish' is not declared from 'writing'" in d.message


@pytest.mark.parametrize("case", ["wrong_source", "final", "no_start", "bad_dest"])
def test_validate_replays_states(tmp_path: Path, case: str) -> None:
    t = _trace(tmp_path / "d.jsonl", "decode")
    t("decode_layer_read", "k", "start", "", "received", ())
    t("decode_layer_read", "k", "accept", "received", "done", ())
    if case == "wrong_source":
        t("decode_layer_read", "j", "start", "", "received", ())
        t("decode_layer_read", "j", "accept", "reading", "done", ())
        want, line = "replay is in 'received'", 5
    elif case == "final":
        t("decode_layer_read", "k", "reject", "done", "failed", ("e",))
        want, line = "leaves final state 'done'", 4
    elif case == "no_start":
        t("request_status", "r", "read_failed", "registered", "local_failed", ("e",))
        want, line = "before its start record", 4
    else:
        t("request_status", "r", "start", "", "registered", ())
        t("request_status", "r", "tp_agreed", "registered", "succeeded", (True,))
        want, line = "not declared from 'registered'", 5
    t.close()
    report = validate([tmp_path / "d.jsonl"])
    assert not report.ok and want in report.divergence.message  # type: ignore[union-attr]
    assert report.divergence.line == line  # type: ignore[union-attr]


def test_validate_cross_process_rules(tmp_path: Path) -> None:
    ready = wire.encode(wire.ReadReadyBatch(0, "l0", (), (), 0, 1))
    done = wire.encode(wire.ReadDone(0))
    meta = wire.encode(wire.MfMeta("h:1", {}, wire.PROTOCOL_VERSION, wire.LAYOUT_VERSION))

    # R2: one Decode rank says succeeded, the other failed.
    for name, end in (("d0", "succeeded"), ("d1", "failed")):
        t = _trace(tmp_path / f"{name}.jsonl", "decode")
        t("request_status", "r", "start", "", "registered", ())
        t("request_status", "r", "contributor_final", "registered", "local_ok", (0, 1))
        t("request_status", "r", "tp_agreed", "local_ok", end, (end == "succeeded",))
        t.close()
    report = validate([tmp_path / "d0.jsonl", tmp_path / "d1.jsonl"])
    assert report.divergence is not None and report.divergence.rule == "R2"
    assert report.divergence.path.endswith("d1.jsonl")

    # W1 on Prefill: READY before MF_META on a connection; S3: a reply with no READY.
    t = _trace(tmp_path / "p.jsonl", "prefill")
    t.message("send", "h:1", ready, conn="c1")
    t.message("recv", "h:1", done, conn="c1")
    t.message("recv", "h:1", done, conn="c1")
    t.close()
    report = validate([tmp_path / "p.jsonl"])
    assert [d.rule for d in report.divergences] == ["W1", "S3"]
    assert [d.line for d in report.divergences] == [2, 4]

    # S3 across processes: Prefill sent two READYs on a connection, Decode saw one.
    t = _trace(tmp_path / "p2.jsonl", "prefill")
    t.message("send", "h:1", meta, conn="c1")
    t.message("send", "h:1", ready, conn="c1")
    t.message("recv", "h:1", done, conn="c1")
    t.message("send", "h:1", ready, conn="c1")
    t.message("recv", "h:1", done, conn="c1")
    t.close()
    t = _trace(tmp_path / "d2.jsonl", "decode", endpoint="h:1")
    t.message("recv", "c1", meta)
    t.message("recv", "c1", ready)
    t.message("send", "c1", done)
    t.close()
    report = validate([tmp_path / "p2.jsonl", tmp_path / "d2.jsonl"])
    assert report.divergence is not None and report.divergence.rule == "S3"
    assert "Prefill sent READYs per layer {0: 2}" in report.divergence.message


def test_validate_command_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import argparse

    t = _trace(tmp_path / "ok.jsonl", "prefill")
    t("peer_session", "h:1", "start", "", "disconnected", ())
    t("peer_session", "h:1", "connect", "disconnected", "handshaking", ())
    t.close()
    assert cmd_validate(argparse.Namespace(traces=[str(tmp_path)], json=False)) == 0
    assert "valid: 1 trace(s)" in capsys.readouterr().out
    lines = (tmp_path / "ok.jsonl").read_text().splitlines()
    lines[2] = lines[2].replace('"dst":"handshaking"', '"dst":"established"')
    (tmp_path / "ok.jsonl").write_text("\n".join(lines) + "\n")
    assert cmd_validate(argparse.Namespace(traces=[str(tmp_path / "ok.jsonl")],
                                           json=True)) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["divergences"][0].startswith(
        f"{tmp_path / 'ok.jsonl'}:3: machines:")


def test_close_is_idempotent_and_api_after_close_is_refused(
        engines: tuple[HostEngine, HostEngine]) -> None:
    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)
    pw = PrefillWorker(p.core())
    dw = DecodeWorker(DecodeCore(0, 1, d.layouts), de, 0)
    for _ in range(2):
        pw.close()
        dw.close()
    with pytest.raises(ControlPlaneError, match="closed"):
        pw.begin_layer(0)
    with pytest.raises(ControlPlaneError, match="closed"):
        dw.register_request("r", [1], [1])
    assert not pw._thread.is_alive() and not dw._thread.is_alive()


def test_tracer_keeps_every_record_in_order_across_threads(tmp_path: Path) -> None:
    t = _trace(tmp_path / "x.jsonl", "prefill")
    done = wire.encode(wire.ReadDone(0))

    def writer(n: int) -> None:
        for i in range(700):  # crosses the flush threshold many times
            if i % 2:
                t(f"m{n}", str(i), "ev", "", "", ())
            else:
                t.message("recv", f"w{n}", done, conn=str(i))

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(WAIT)
    t.close()
    records = [json.loads(line) for line in (tmp_path / "x.jsonl").read_text().splitlines()]
    assert records[0]["k"] == "process" and records[-1]["k"] == "close"
    for n in range(4):
        seq = [int(r.get("key", r.get("conn"))) for r in records
               if r.get("m") == f"m{n}" or r.get("peer") == f"w{n}"]
        assert seq == list(range(700))


def test_validate_flags_empty_and_unclosed_traces(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    report = validate([tmp_path / "empty.jsonl"])
    assert report.divergence is not None and "empty" in report.divergence.message
    # A process that died mid-run: no close record, so its open READY is not an S3 breach,
    # but the report says it did not shut down cleanly.
    t = _trace(tmp_path / "died.jsonl", "decode")
    t.message("recv", "c1", wire.encode(wire.MfMeta("h:1", {}, wire.PROTOCOL_VERSION,
                                                    wire.LAYOUT_VERSION)))
    t.message("recv", "c1", wire.encode(wire.ReadReadyBatch(0, "l0", (), (), 0, 1)))
    t._flush()  # what a crash leaves: records that reached the file, no close
    t._file.flush()
    report = validate([tmp_path / "died.jsonl"])
    assert report.ok and report.unclosed == [str(tmp_path / "died.jsonl")]
    assert "not closed cleanly" in report.summary()
    t.close()
    report = validate([tmp_path / "died.jsonl"])
    assert report.divergence is not None and report.divergence.rule == "S3"


def test_agreement_loop_cadence_and_merge() -> None:
    """Rounds are spaced by round_wait when idle (no busy loop), a new outcome starts the
    next round at once, the loop contributes what the worker's core says at round time (not
    what the notifications said), and it ends after the round in which ``until`` holds.
    That a failed request stays failed is the core's decision (the request_status table):
    ``test_a_failed_request_cannot_become_ok_in_the_core`` below."""
    from sfa_rd2h.statemachines.cores.actions import RequestReady

    calls: list[tuple[float, dict[str, bool]]] = []
    cond = threading.Condition()

    class Recording(SingleRankGroup):
        def agree(self, local: Any) -> dict[str, bool]:
            with cond:
                calls.append((time.monotonic(), dict(local)))
                cond.notify_all()
            return super().agree(local)

    class Worker:
        applied: list[tuple[str, bool]] = []
        # What the core says at round time: "a" failed after first reporting success, which
        # the request_status table decides (the loop only asks).
        outcomes = {"a": False, "b": True}

        def local_outcome(self, ext: str) -> bool | None:
            return self.outcomes.get(ext)

        def apply_agreement(self, ext: str, ok: bool) -> list[RequestFinished]:
            self.applied.append((ext, ok))
            return []

    wait = 0.05
    loop = AgreementLoop(Recording(), round_wait=wait)
    loop.notify(RequestReady("a", True))
    loop.notify(RequestReady("a", False))  # e.g. a ratio conflict after local success
    worker = Worker()
    loop.start(worker, until=lambda agreed: "b" in agreed)  # type: ignore[arg-type]
    with cond:
        assert cond.wait_for(lambda: len(calls) >= 6, WAIT)
    assert calls[0][1] == {"a": False}
    assert all(c[1] == {} for c in calls[1:6])
    gaps = [b[0] - a[0] for a, b in zip(calls[1:6], calls[2:6], strict=False)]
    assert min(gaps) >= wait * 0.9, gaps  # idle rounds wait for round_wait
    t0 = time.monotonic()
    loop.notify(RequestReady("b", True))
    assert loop.wait(WAIT) and loop.error is None
    assert time.monotonic() - t0 < WAIT
    assert worker.applied == [("a", False), ("b", True)]
    assert loop.agreed == {"a": False, "b": True}
    assert calls[-1][1] == {"b": True}


def test_a_failed_request_cannot_become_ok_in_the_core() -> None:
    """R5 with R4, R1: once a read failed for a request, nothing that comes later makes it
    ok - not a later layer's READY carrying every contributor's final signal, not a stale
    "ok" notification, not a TP agreement that says ok - through the real Decode core and
    the agreement loop that runs it."""
    from sfa_rd2h.statemachines.cores.actions import IssueRead, RequestReady

    meta = wire.LayerMeta((0x1000, 0x2000), (16, 16), (1, 1), (0, 0), 2, False)
    dest = DestLayout((0x900000, 0x910000), (16, 16), (32, 32), 2, False, False)
    core = DecodeCore(0, 1, {"l0": dest, "l1": dest}, request_deadline=5.0)

    def ready(layer: int, ext: str, done: bool) -> bytes:
        return wire.encode(wire.ReadReadyBatch(layer, f"l{layer}", (
            wire.ReadReq(ext, (1,), (1,), 0, 0),), (ext,) if done else ()))

    core.on_frame("p0", wire.encode(wire.MfMeta("s:1", {"l0": meta, "l1": meta})), 0.0)
    for ext in ("read-failed", "deadline"):
        core.register_request(ext, [3], [3], 0.0)
    [read] = core.on_frame("p0", ready(0, "read-failed", False), 0.0)
    assert isinstance(read, IssueRead)
    assert RequestReady("read-failed", False) in core.read_result(read.read_id, -7, 0.0)
    assert RequestReady("deadline", False) in core.tick(6.0)  # R1: contributors too late
    for ext in ("read-failed", "deadline"):
        late = core.on_frame("p0", ready(1, ext, True), 7.0)  # the last layer, final signal
        assert not any(isinstance(a, IssueRead) for a in late)  # no write after failure
        assert core.local_outcome(ext) is False
        assert core.requests[ext].status.state == "local_failed"

    class CoreWorker:  # what the DecodeWorker exposes to the loop, over the bare core
        def local_outcome(self, ext: str) -> bool | None:
            return core.local_outcome(ext)

        def apply_agreement(self, ext: str, ok: bool) -> list[Any]:
            return core.apply_agreement(ext, ok)

    loop = AgreementLoop(SingleRankGroup(), round_wait=0.01)
    for ext in ("read-failed", "deadline"):
        loop.notify(RequestReady(ext, True))  # a stale "ok": the core decides, not this
    loop.start(CoreWorker(), until=lambda agreed: len(agreed) == 2)  # type: ignore[arg-type]
    assert loop.wait(WAIT) and loop.error is None
    assert loop.agreed == {"read-failed": False, "deadline": False}
    assert {ext: core.terminal[ext] for ext in loop.agreed} == loop.agreed

    # Even an agreement that says ok cannot make a locally failed request succeed.
    core.register_request("third", [4], [4], 10.0)
    [read] = core.on_frame("p0", ready(0, "third", True), 10.0)
    core.read_result(read.read_id, RuntimeError("device lost"), 10.0)
    [finished] = core.apply_agreement("third", True)
    assert isinstance(finished, RequestFinished) and not finished.ok
    assert "device lost" in (finished.error or "")
    assert core.terminal["third"] is False


def test_a_slow_registry_stalls_only_its_own_peer(
        engines: tuple[HostEngine, HostEngine]) -> None:
    """No peer can stall another: a hostile Prefill whose registry accepts and never answers
    holds up its own read, not a legitimate peer's round trip (reads run on lanes)."""
    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)
    core = DecodeCore(0, 1, d.layouts)
    dw = DecodeWorker(core, de, 0)
    dw.register_request("slow", [1], [1])
    dw.register_request("fast", [2], [2])
    ctx = zmq.Context()
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    hostile = _dealer(ctx, dw.port, b"hostile")
    legit = _dealer(ctx, dw.port, b"legit")
    try:
        hostile.send(wire.encode(wire.MfMeta(f"127.0.0.1:{silent.getsockname()[1]}",
                                             p.layers, wire.PROTOCOL_VERSION)))
        legit.send(wire.encode(wire.MfMeta(pe.session_id, p.layers, wire.PROTOCOL_VERSION)))
        for sock in (hostile, legit):
            assert wire.decode_meta_reply(_recv(sock)).accepted
        ready = wire.ReadReadyBatch(0, "l0", (wire.ReadReq("slow", (3,), (3,)),), ("slow",))
        hostile.send(wire.encode(ready))
        t0 = time.monotonic()
        legit.send(wire.encode(wire.ReadReadyBatch(0, "l0", (wire.ReadReq("fast", (4,), (4,)),),
                                                   ("fast",))))
        assert isinstance(wire.decode(_recv(legit)), wire.ReadDone)
        legit_rtt = time.monotonic() - t0
        reply = wire.decode(_recv(hostile))  # the engine gives up after its 5 s bound
        hostile_wait = time.monotonic() - t0
        assert isinstance(reply, wire.ReadFailed)  # F2: the stalled read failed, answered
        assert legit_rtt < 1.0 < hostile_wait, (legit_rtt, hostile_wait)
    finally:
        for sock in (hostile, legit):
            sock.close()
        silent.close()
        dw.close()
        ctx.term()


def test_a_flood_of_bad_frames_is_counted_but_not_logged_per_frame(
        engines: tuple[HostEngine, HostEngine], caplog: pytest.LogCaptureFixture) -> None:
    """A peer must not be able to flood the log: one warning per kind per interval."""
    _, de = engines
    d = make_decode(de, 1)
    dw = DecodeWorker(DecodeCore(0, 1, d.layouts), de, 0)
    ctx = zmq.Context()
    sock = _dealer(ctx, dw.port, b"flood")
    try:
        with caplog.at_level("WARNING", logger="sfa_rd2h.runtime.control"):
            for _ in range(500):
                sock.send_multipart([b"one", b"two"])  # bad framing, no reply possible
            sock.send(wire.encode(wire.MfMeta("127.0.0.1:1", {}, wire.PROTOCOL_VERSION)))
            _recv(sock)  # FIFO: every bad frame before it has been handled
        assert dw.stats.bad_framing == 500
        warnings = [r for r in caplog.records if "dropped a message" in r.getMessage()]
        assert 1 <= len(warnings) <= 2
    finally:
        sock.close()
        dw.close()
        ctx.term()


def test_round_trip_samples_are_bounded() -> None:
    from sfa_rd2h.runtime.control import RTT_SAMPLES, PrefillStats

    stats = PrefillStats()
    stats.round_trips.extend(range(RTT_SAMPLES + 10))
    assert len(stats.round_trips) == RTT_SAMPLES and stats.round_trips[0] == 10


def test_curve_lets_only_authorised_prefills_reach_decode(
        engines: tuple[HostEngine, HostEngine]) -> None:
    """Optional CURVE: an authorised Prefill moves a request; a plain peer and a CURVE peer
    with an unknown key never reach the core (their frames are not even received)."""
    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)
    server = CurveSecurity.generate()
    client = CurveSecurity.generate()
    intruder = CurveSecurity.generate()
    decode_side = CurveSecurity(server.public, server.secret,
                                allowed_clients=frozenset({client.public}))
    loop = AgreementLoop(SingleRankGroup())
    dw = DecodeWorker(DecodeCore(0, 1, d.layouts), de, 0, on_ready=loop.notify,
                      on_finished=d.on_finished, curve=decode_side)
    loop.start(dw, until=lambda agreed: "r1" in agreed)
    ctx = zmq.Context()
    plain = _dealer(ctx, dw.port, b"plain")
    stranger = ctx.socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.curve_publickey, stranger.curve_secretkey = intruder.public, intruder.secret
    stranger.curve_serverkey = server.public
    stranger.connect(f"tcp://127.0.0.1:{dw.port}")
    meta = wire.encode(wire.MfMeta(pe.session_id, p.layers, wire.PROTOCOL_VERSION))
    plain.send(meta)
    stranger.send(meta)
    pw = PrefillWorker(p.core(), curve=client.client_of(server.public))
    try:
        pw.add_request("r1", params(dw.port), [3], [4])
        dw.register_request("r1", [5], [6])
        pw.schedule_chunk("r1", 2, True)
        run_layers(pw, p, 1, [3], [4], 1)
        assert d.wait_finished("r1").ok
        d.check(0, 1, [5], [6])
        assert dw.stats.frames_received == 2  # the authorised MF_META and READY only
        assert not plain.poll(200) and not stranger.poll(200)  # nobody answered them
    finally:
        for sock in (plain, stranger):
            sock.close()
        pw.close()
        loop.close()
        dw.close()
        ctx.term()
    with pytest.raises(ControlPlaneError) as info:
        PrefillWorker(p.core(), curve=client)
    assert str(info.value) == "CURVE on Prefill needs the Decode public key (server_public)"


def test_a_malformed_curve_key_is_refused_where_the_worker_is_built(
        engines: tuple[HostEngine, HostEngine]) -> None:
    """A key that is not 40 characters of Z85 is refused by the constructor naming the
    field, not at Prefill's first connection on the sender thread (where it would pass for
    a lost Decode); a well-formed key is taken on both sides."""
    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)
    good = CurveSecurity.generate()
    z85_but_short = good.public[:35]
    for curve, field_name, key in (
            (good.client_of(b"bad"), "server_public", b"bad"),
            (CurveSecurity(good.public, b"~" * 40, good.public), "secret", b"~" * 40),
            (CurveSecurity(z85_but_short, good.secret, good.public), "public", z85_but_short)):
        with pytest.raises(ControlPlaneError) as info:
            PrefillWorker(p.core(), curve=curve)
        assert str(info.value) == (f"CURVE {field_name}: {key!r} is not a key (40 characters "
                                   "of Z85 text as zmq.curve_keypair() makes)")
    bad_client = CurveSecurity(good.public, good.secret, allowed_clients=frozenset({b"x" * 39}))
    with pytest.raises(ControlPlaneError) as info:
        DecodeWorker(DecodeCore(0, 1, d.layouts), de, 0, curve=bad_client)
    assert str(info.value) == (f"CURVE allowed_clients: {b'x' * 39!r} is not a key (40 "
                               "characters of Z85 text as zmq.curve_keypair() makes)")
    PrefillWorker(p.core(), curve=good.client_of(good.public)).close()
    DecodeWorker(DecodeCore(0, 1, d.layouts), de, 0,
                 curve=CurveSecurity(good.public, good.secret,
                                     allowed_clients=frozenset({good.public}))).close()


# --------------------------------------------------------------------------- test strength
# (issue 12) What the mutation run found unguarded in the control plane: each test states
# what a caller or an operator observes.


def test_throttled_warnings_say_how_many_they_stood_for(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """One warning per kind per interval, and the next one says how many it stood for, so an
    operator sees the size of a flood without the flood; kinds are throttled apart."""
    from types import SimpleNamespace

    from sfa_rd2h.runtime import control as control_mod

    now = [100.0]
    monkeypatch.setattr(control_mod, "time", SimpleNamespace(monotonic=lambda: now[0]))
    warn = control_mod._Throttled().warn
    every = control_mod._WARN_EVERY_S
    with caplog.at_level("WARNING", logger="sfa_rd2h.runtime.control"):
        assert warn("framing", "bad frame from %s", "p0") is True
        now[0] += every - 0.001
        assert warn("framing", "bad frame from %s", "p1") is False
        assert warn("framing", "bad frame from %s", "p2") is False
        assert warn("other", "other kind %d", 7) is True
        now[0] = 100.0 + every  # exactly one interval after the last one logged
        assert warn("framing", "bad frame from %s", "p3") is True
        now[0] += every
        assert warn("framing", "bad frame from %s", "p4") is True
    assert [r.getMessage() for r in caplog.records] == [
        "bad frame from p0", "other kind 7", "bad frame from p3 (2 more like it suppressed)",
        "bad frame from p4"]


def test_an_aborted_request_finishes_failed_with_its_reason(
        engines: tuple[HostEngine, HostEngine]) -> None:
    """C1, R1: vLLM aborts a registered request (or its rendezvous failed): the rank reports
    a failed local outcome at once, the agreed terminal status carries the reason, and a
    second abort or an abort of an unknown request changes nothing."""
    from sfa_rd2h.statemachines.cores.actions import RequestReady

    _, de = engines
    d = make_decode(de, 1)
    readies: list[RequestReady] = []
    dw = DecodeWorker(DecodeCore(0, 1, d.layouts), de, 0, on_ready=readies.append)
    try:
        dw.register_request("r", [1], [1])
        assert dw.local_outcome("r") is None
        dw.abort_request("r", "rendezvous failed")
        assert readies == [RequestReady("r", False)]
        assert dw.local_outcome("r") is False
        [finished] = dw.apply_agreement("r", False)
        assert not finished.ok and "rendezvous failed" in (finished.error or "")
        dw.abort_request("r", "again")
        dw.abort_request("never-registered", "x")
        assert readies == [RequestReady("r", False)]
    finally:
        dw.close()


def test_agreement_rounds_on_the_callers_thread() -> None:
    """The vLLM connector drives agreement itself, once per step (``round``): each round
    contributes the outcomes notified since the last one as the core states them, returns
    the terminal status of what the group agreed, and counts itself; ``wait_fresh`` says
    whether a notified outcome awaits the next round."""
    from sfa_rd2h.statemachines.cores.actions import RequestReady

    class Worker:
        outcomes = {"a": False, "b": True}  # "c" is notified but not yet locally terminal
        applied: list[tuple[str, bool]] = []

        def local_outcome(self, ext: str) -> bool | None:
            return self.outcomes.get(ext)

        def apply_agreement(self, ext: str, ok: bool) -> list[RequestFinished]:
            self.applied.append((ext, ok))
            return [RequestFinished(ext, ok, None if ok else f"{ext} failed")]

    loop = AgreementLoop(SingleRankGroup())
    worker = Worker()
    assert loop.wait_fresh(0.01) is False
    for ext in ("b", "a", "c"):
        loop.notify(RequestReady(ext, True))
    assert loop.wait_fresh(0.01) is True
    finished = loop.round(worker)  # type: ignore[arg-type]
    assert finished == [RequestFinished("a", False, "a failed"), RequestFinished("b", True, None)]
    assert worker.applied == [("a", False), ("b", True)]
    assert loop.agreed == {"a": False, "b": True} and loop.rounds == 1
    assert loop.wait_fresh(0.01) is False
    assert loop.round(worker) == [] and loop.rounds == 2  # type: ignore[arg-type]


def test_a_request_in_two_chunks_through_the_compute_api(
        engines: tuple[HostEngine, HostEngine]) -> None:
    """C2 from the compute thread: a prompt computed in two steps, the second step's block
    allocated later (``extend_request``); ``chunk`` gives the blocks each step computes,
    ``layer_settled`` whether the layer's reader is still outstanding, and every byte of
    both chunks lands. ``finish_request`` says whether the request was still tracked."""
    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)
    loop = AgreementLoop(SingleRankGroup())
    dw = DecodeWorker(DecodeCore(0, 1, d.layouts), de, 0, on_ready=loop.notify,
                      on_finished=d.on_finished)
    loop.start(dw, until=lambda agreed: "r" in agreed)
    pw = PrefillWorker(p.core())
    try:
        pw.add_request("r", params(dw.port), [5, 6], [1, 2])
        assert pw.chunk("r") is None and pw.chunk("unknown") is None
        pw.schedule_chunk("r", 2 * BLOCK, False)
        assert pw.chunk("r") == (0, 2)
        run_layers(pw, p, 1, [5, 6], [1, 2], 1)
        # Decode holds the READY until the request's destinations are registered (C1).
        assert pw.layer_settled(0) is False
        dw.register_request("r", [10, 11, 12], [13, 14, 15])
        pw.wait_for_layer_send(0, WAIT)
        assert pw.layer_settled(0) is True
        pw.extend_request("r", [7], [3])
        pw.schedule_chunk("r", 2 * BLOCK + 1, True)
        assert pw.chunk("r") == (2, 3)
        run_layers(pw, p, 1, [7], [3], 1)
        assert d.wait_finished("r").ok
        d.check(0, 1, [10, 11, 12], [13, 14, 15])
        assert pw.drain(WAIT) == []
        assert pw.finish_request("r") is False  # its final chunk was published: forgotten
        pw.add_request("s", params(dw.port), [8], [4])
        assert pw.finish_request("s") is True and pw.chunk("s") is None
    finally:
        pw.close()
        loop.close()
        dw.close()


def test_device_events_are_awaited_through_synchronize() -> None:
    """C4: None is a CPU write (already complete); anything else is synchronised, and what
    cannot be is refused by name."""
    from sfa_rd2h.runtime.control import wait_device_event

    synced: list[str] = []

    class Event:
        def synchronize(self) -> None:
            synced.append("event")

    wait_device_event(None)
    wait_device_event(Event())
    assert synced == ["event"]
    with pytest.raises(TypeError) as info:
        wait_device_event(object())
    assert str(info.value) == "a device event needs synchronize(), got object"


def test_poll_timeouts_never_wake_before_the_deadline() -> None:
    from sfa_rd2h.runtime.control import _poll_ms

    assert _poll_ms(None, 5.0) == -1  # no deadline: wait for a socket or the wake-up
    assert _poll_ms(5.0, 5.0) == 0 and _poll_ms(4.0, 5.0) == 0
    assert _poll_ms(5.0001, 5.0) == 1  # rounded up, not down to a busy 0
    assert _poll_ms(6.5, 5.0) == 1500


def test_curve_allow_list_takes_keys_in_either_encoding() -> None:
    from sfa_rd2h.runtime.control import _CurveAllowList

    client, stranger = CurveSecurity.generate(), CurveSecurity.generate()
    raw = zmq.utils.z85.decode(client.public)  # what ZAP hands the callback
    assert _CurveAllowList(frozenset({client.public})).callback("*", raw) is True
    assert _CurveAllowList(frozenset({raw})).callback("*", raw) is True
    assert _CurveAllowList(frozenset({client.public})).callback(
        "*", zmq.utils.z85.decode(stranger.public)) is False
    assert _CurveAllowList(frozenset()).callback("*", raw) is True  # empty: any CURVE client
    keys = client.client_of(b"server-key")
    assert (keys.public, keys.secret, keys.server_public) == (
        client.public, client.secret, b"server-key")


def test_read_lanes_one_per_session_shared_beyond_the_bound_and_retired_when_idle() -> None:
    """A lane per Prefill session; beyond ``max_lanes`` sessions share the existing lanes;
    an idle lane ends and a later read gets a new one; close waits for queued reads and says
    when one is still busy; nothing is accepted after close."""
    from types import SimpleNamespace

    from sfa_rd2h.runtime.control import _ReadLanes

    threads: dict[str, list[threading.Thread]] = {}
    done: list[tuple[str, Any]] = []
    cond = threading.Condition()
    gate = threading.Event()
    gate.set()

    def read(a: Any) -> int:
        threads.setdefault(a.session, []).append(threading.current_thread())
        assert gate.wait(WAIT)
        return 7

    def finished(a: Any, result: Any) -> None:
        with cond:
            done.append((a.session, result))
            cond.notify_all()

    def wait_done(n: int) -> None:
        with cond:
            assert cond.wait_for(lambda: len(done) >= n, WAIT)

    lanes = _ReadLanes(read, finished, "d0", max_lanes=2, idle_s=0.05)
    for session in ("a", "b", "a", "c"):
        lanes.submit(SimpleNamespace(session=session))  # type: ignore[arg-type]
    wait_done(4)
    assert sorted(done) == [("a", 7), ("a", 7), ("b", 7), ("c", 7)]
    assert [t.name for t in threads["a"]] == ["d0-read-0", "d0-read-0"]
    assert [t.name for t in threads["b"]] == ["d0-read-1"]
    assert threads["c"][0] in (threads["a"][0], threads["b"][0])  # shares a lane
    first = threads["a"][0]
    first.join(WAIT)  # idle for idle_s with nothing queued: the lane ends
    assert not first.is_alive()
    lanes.submit(SimpleNamespace(session="a"))  # type: ignore[arg-type]
    wait_done(5)
    assert threads["a"][-1] is not first
    gate.clear()
    lanes.submit(SimpleNamespace(session="a"))  # type: ignore[arg-type]
    assert lanes.close(0.05) is False  # a read is still running
    gate.set()
    assert lanes.close(WAIT) is True
    wait_done(6)
    with pytest.raises(ControlPlaneError, match="^d0: read lanes are closed$"):
        lanes.submit(SimpleNamespace(session="a"))  # type: ignore[arg-type]


def test_prefill_counts_what_decode_answered_and_refuses_bad_replies(
        engines: tuple[HostEngine, HostEngine], caplog: pytest.LogCaptureFixture) -> None:
    """Against a raw Decode: undecodable replies and replies in several frames are counted
    as rejected and logged, change nothing, and the layer's slot opens only on its real
    READ_DONE, which is the one round trip measured."""
    pe, _ = engines
    p = make_prefill(pe, 1, 1)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    pw = PrefillWorker(p.core())
    try:
        pw.add_request("r", params(port), [1], [1])
        pw.schedule_chunk("r", 4, True)
        with caplog.at_level("WARNING", logger="sfa_rd2h.runtime.control"):
            run_layers(pw, p, 1, [1], [1], 1)
            assert router.poll(int(WAIT * 1000))
            ident, meta = [f for f in router.recv_multipart() if f]
            assert isinstance(wire.decode(meta), wire.MfMeta)
            router.send_multipart([ident, wire.encode(wire.MfMetaAck(True, 1))])
            assert router.poll(int(WAIT * 1000))
            _, ready = [f for f in router.recv_multipart() if f]
            assert isinstance(wire.decode(ready), wire.ReadReadyBatch)
            router.send_multipart([ident, b"one", b"two"])
            router.send_multipart([ident, b"\xc1 not msgpack"])
            router.send_multipart([ident, b"\xc1 again"])
            assert pw.layer_settled(0) is False
            router.send_multipart([ident, wire.encode(wire.ReadDone(0))])
            pw.wait_for_layer_send(0, WAIT)
        assert pw.stats.frames_sent == 2 and pw.stats.frames_received == 5
        assert pw.stats.rejected_frames == 3  # every bad reply counts, whatever came before
        assert len(pw.round_trips()) == 1 and list(pw.stats.rtt_by_layer) == [0]
        assert list(pw.stats.rtt_by_layer[0]) == pw.round_trips()
        # one warning per kind (the second undecodable reply is throttled), each whole
        assert caplog.messages == [
            f"prefill rank 0: 2 non-empty frames from 127.0.0.1:{port}, expected 1",
            f"prefill rank 0: rejected frame from 127.0.0.1:{port}: "
            "not valid msgpack: reserved or invalid format byte"]
    finally:
        pw.close()
        router.close()
        ctx.term()


def test_decode_turns_every_engine_outcome_into_the_reply_and_the_stats(
        engines: tuple[HostEngine, HostEngine], caplog: pytest.LogCaptureFixture) -> None:
    """F2 through the worker: an engine that raises and one that returns non-zero both fail
    the layer with READ_FAILED saying why, are counted and logged; a read that lands is a
    READ_DONE and counts its bytes."""
    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)
    outcomes: list[Any] = [RuntimeError("device lost"), -3, None]

    class Scripted:  # the Decode engine: answers the next scripted outcome, then the real one
        name = "scripted"
        last_error = "LOCAL_RANGE: scripted"

        def batch_transfer_sync_read(self, *args: Any) -> int:
            outcome = outcomes.pop(0)
            if isinstance(outcome, Exception):
                raise outcome
            return de.batch_transfer_sync_read(*args) if outcome is None else outcome

    dw = DecodeWorker(DecodeCore(0, 1, d.layouts), Scripted(), 0)  # type: ignore[arg-type]
    ctx = zmq.Context()
    sock = _dealer(ctx, dw.port, b"prefill-0")
    try:
        sock.send(wire.encode(wire.MfMeta(pe.session_id, p.layers, wire.PROTOCOL_VERSION)))
        assert wire.decode_meta_reply(_recv(sock)).accepted
        replies = []
        with caplog.at_level("WARNING", logger="sfa_rd2h.runtime.control"):
            for i, ext in enumerate(("raises", "non-zero", "lands")):
                dw.register_request(ext, [i + 1], [i + 1])
                sock.send(wire.encode(wire.ReadReadyBatch(
                    0, "l0", (wire.ReadReq(ext, (i,), (i,)),), (ext,))))
                replies.append(wire.decode(_recv(sock)))
        assert isinstance(replies[0], wire.ReadFailed)
        assert "F2: transfer engine raised RuntimeError: device lost" in replies[0].error
        assert isinstance(replies[1], wire.ReadFailed) and "-3" in replies[1].error
        assert replies[2] == wire.ReadDone(0)
        assert (dw.stats.reads, dw.stats.failed_reads) == (1, 2)
        assert dw.stats.bytes_read == sum(TB)
        dw.close()  # the reader counts a reply just after sending it: count once it stopped
        assert dw.stats.frames_sent == 4
        assert "decode rank 0: transfer engine raised" in caplog.messages
        # One warning per kind per interval: the first failed read speaks for both.
        assert [m for m in caplog.messages if "batched read" in m] == [
            f"decode rank 0: batched read from {pe.session_id} failed (device lost): "
            "LOCAL_RANGE: scripted"]
    finally:
        sock.close()
        dw.close()
        ctx.term()


class _Outcomes:
    """What an AgreementLoop asks of a DecodeWorker: every notified request succeeded."""

    def __init__(self) -> None:
        self.applied: list[tuple[str, bool]] = []

    def local_outcome(self, ext: str) -> bool | None:
        return True

    def apply_agreement(self, ext: str, ok: bool) -> list[RequestFinished]:
        self.applied.append((ext, ok))
        return []


def test_agreement_loop_thread_is_named_a_daemon_started_once_and_stopped_by_close() -> None:
    """An operator finds the loop as ``decode<rank>-agree`` among the threads; an unclosed
    loop does not hold up interpreter exit (daemon); a second start is refused by name;
    ``wait`` is bounded while the loop runs; ``close`` stops an idle loop at once, however
    long its round wait, and a loop never started has nothing to wait for or stop."""
    idle = AgreementLoop(SingleRankGroup())
    assert idle.wait(0) is True
    idle.close()  # never started: returns, nothing to join

    loop = AgreementLoop(SingleRankGroup(), round_wait=3600.0)
    worker = _Outcomes()
    loop.start(worker, until=lambda agreed: False)  # type: ignore[arg-type]
    try:
        [thread] = [t for t in threading.enumerate() if t.name == "decode0-agree"]
        assert thread.daemon is True
        with pytest.raises(ControlPlaneError) as info:
            loop.start(worker, until=lambda agreed: False)  # type: ignore[arg-type]
        assert str(info.value) == "agreement loop already started"
        waited: list[bool] = []
        waiter = threading.Thread(target=lambda: waited.append(loop.wait(0.05)))
        waiter.start()
        waiter.join(WAIT)
        assert waited == [False]  # the loop is still running: wait gave up after 0.05 s
    finally:
        t0 = time.monotonic()
        loop.close()
        assert time.monotonic() - t0 < 1.0  # not the round wait, nor close's own bound
    assert not thread.is_alive() and thread not in threading.enumerate()
    assert loop.wait(0) is True and loop.rounds == 0 and loop.error is None
    waiter.join(WAIT)


def test_agreement_loop_close_says_when_a_collective_holds_it() -> None:
    """A rank blocked in ``agree`` (a peer rank is gone) cannot stop at once: close gives up
    after its bound and says why, and the loop ends once the collective returns."""
    from sfa_rd2h.statemachines.cores.actions import RequestReady

    entered, release = threading.Event(), threading.Event()

    class Stuck(SingleRankGroup):
        def agree(self, local: Any) -> dict[str, bool]:
            entered.set()
            assert release.wait(WAIT)
            return super().agree(local)

    loop = AgreementLoop(Stuck(), round_wait=3600.0)
    worker = _Outcomes()
    loop.notify(RequestReady("r", True))
    loop.start(worker, until=lambda agreed: False)  # type: ignore[arg-type]
    try:
        assert entered.wait(WAIT)
        with pytest.raises(ControlPlaneError) as info:
            loop.close(0.05)
        assert str(info.value) == ("agreement loop did not stop within 0.05s (blocked in a "
                                   "collective until the group's timeout)")
    finally:
        release.set()
    assert loop.wait(WAIT) and loop.error is None
    assert worker.applied == [("r", True)] and loop.rounds == 1  # then it saw close


def test_agreement_loop_runs_a_round_at_once_for_a_notified_outcome() -> None:
    """A notified outcome is agreed at once, not after the round wait; each round counts;
    ``on_agreed`` hears every agreed request with its outcome."""
    from sfa_rd2h.statemachines.cores.actions import RequestReady

    first = threading.Event()
    agreed: list[tuple[str, bool]] = []

    def on_agreed(ext: str, ok: bool) -> None:
        agreed.append((ext, ok))
        first.set()

    loop = AgreementLoop(SingleRankGroup(), round_wait=3600.0, on_agreed=on_agreed)
    worker = _Outcomes()
    loop.notify(RequestReady("a", True))
    loop.start(worker, until=lambda agreed: "b" in agreed)  # type: ignore[arg-type]
    try:
        assert first.wait(WAIT)
        loop.notify(RequestReady("b", True))
        assert loop.wait(WAIT) and loop.error is None
        assert worker.applied == [("a", True), ("b", True)] and loop.rounds == 2
        assert agreed == worker.applied  # the operator's callback hears every agreement
    finally:
        loop.close()


def test_agreement_round_is_due_when_the_clock_reaches_the_deadline() -> None:
    """With the clock exactly at the round's deadline the round runs: the loop does not
    spin on zero-length waits until the clock moves on."""
    import itertools

    ticks = itertools.chain([0.0], itertools.repeat(1.0))  # start, then at the deadline
    loop = AgreementLoop(SingleRankGroup(), round_wait=1.0, clock=lambda: next(ticks))
    loop.start(_Outcomes(), until=lambda agreed: loop.rounds >= 1)  # type: ignore[arg-type]
    try:
        assert loop.wait(WAIT) and loop.error is None and loop.rounds == 1
    finally:
        loop.close()


def test_read_lanes_keep_a_session_on_its_lane_and_spread_the_overflow() -> None:
    """Below the bound a session's reads all run on its own lane, in order; beyond it each
    further session goes to the lane its hash picks, so the overflow is spread over the
    lanes rather than piled on one; lanes are daemon threads (an engine call that never
    returns does not hold up interpreter exit)."""
    from types import SimpleNamespace

    from sfa_rd2h.runtime.control import _ReadLanes

    ran: list[tuple[Any, str]] = []
    cond = threading.Condition()

    def read(a: Any) -> int:
        with cond:
            ran.append((a.session, threading.current_thread().name))
        return 0

    def finished(a: Any, result: Any) -> None:
        with cond:
            cond.notify_all()

    def wait_ran(n: int) -> None:
        with cond:
            assert cond.wait_for(lambda: len(ran) >= n, WAIT)

    lanes = _ReadLanes(read, finished, "d3")
    try:
        for _ in range(3):
            lanes.submit(SimpleNamespace(session="a"))  # type: ignore[arg-type]
        wait_ran(3)
        assert ran == [("a", "d3-read-0")] * 3
        assert [t.daemon for t in threading.enumerate() if t.name.startswith("d3-")] == [True]
    finally:
        assert lanes.close(WAIT) is True
    # Integer sessions hash to themselves: with two lanes (sessions 0 and 1), session 2
    # belongs on lane 0's thread and session 3 on lane 1's.
    ran.clear()
    lanes = _ReadLanes(read, finished, "d4", max_lanes=2)
    try:
        for session in (0, 1, 2, 3):
            lanes.submit(SimpleNamespace(session=session))  # type: ignore[arg-type]
        wait_ran(4)
        assert sorted(ran) == [(0, "d4-read-0"), (1, "d4-read-1"), (2, "d4-read-0"),
                               (3, "d4-read-1")]
    finally:
        assert lanes.close(WAIT) is True


def test_curve_client_keys_keep_everything_but_the_server_key() -> None:
    keys = CurveSecurity(b"pub", b"sec", b"old-server", frozenset({b"peer"}))
    assert keys.client_of(b"new-server") == CurveSecurity(b"pub", b"sec", b"new-server",
                                                         frozenset({b"peer"}))


def _raw_decode(ctx: zmq.Context) -> tuple[zmq.Socket, int]:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    return router, router.bind_to_random_port("tcp://127.0.0.1")


def _take(router: zmq.Socket) -> tuple[bytes, Any]:
    assert router.poll(int(WAIT * 1000)), "no frame within the bound"
    ident, payload = [f for f in router.recv_multipart() if f]
    return ident, wire.decode(payload)


def test_drain_names_the_busy_slots_then_returns_every_held_failure(
        engines: tuple[HostEngine, HostEngine]) -> None:
    """drain against a raw Decode that fails layer 0, leaves layer 1 unanswered and
    completes layer 2: it times out naming exactly the busy slots (state and readers), not
    the free or failed ones; once layer 1 is answered it returns the held failure's message
    (S4), and the slot is free again."""
    from sfa_rd2h.runtime.control import WorkerTimeout

    pe, _ = engines
    p = make_prefill(pe, 3, 3)
    ctx = zmq.Context()
    router, port = _raw_decode(ctx)
    core = p.core()
    pw = PrefillWorker(core)
    try:
        pw.add_request("r", params(port), [1], [1])
        pw.schedule_chunk("r", 4, True)
        run_layers(pw, p, 1, [1], [1], 3)
        ident, meta = _take(router)
        assert isinstance(meta, wire.MfMeta)
        router.send_multipart([ident, wire.encode(wire.MfMetaAck(True, 1))])
        for layer in range(3):
            _, ready = _take(router)
            assert ready.layer_idx == layer
        router.send_multipart([ident, wire.encode(wire.ReadFailed(0, "F2: device lost"))])
        router.send_multipart([ident, wire.encode(wire.ReadDone(2))])
        pw.wait_for_layer_send(2, WAIT)  # replies are handled in order: layer 0's too
        assert pw.layer_settled(0) is True
        with pytest.raises(WorkerTimeout) as info:
            pw.drain(0.2)
        busy = {g.key: ("awaiting_replies", [f"127.0.0.1:{port}"]) for g in core.gates_of(1)}
        assert str(info.value) == f"drain: 0 task(s) queued, slots still busy: {busy}"
        router.send_multipart([ident, wire.encode(wire.ReadDone(1))])
        failed = f"layer 0 via 127.0.0.1:{port}: F2: device lost"
        assert pw.drain(WAIT) == [f"S4: layer 0 cannot be written: {failed}; {failed}"]
        assert [g.state for g in core.gates.values()] == ["free"] * 6
    finally:
        pw.close()
        router.close()
        ctx.term()


def test_every_lost_decode_is_counted_and_named(
        engines: tuple[HostEngine, HostEngine], caplog: pytest.LogCaptureFixture) -> None:
    """S5 with two Decodes reading one layer: both vanish; each loss is counted and logged,
    and the slot fails once both readers are accounted for, naming the first loss."""
    pe, _ = engines
    p = make_prefill(pe, 1, 1)
    failed = _watch_gate_failures(p)
    ctx = zmq.Context()
    (a, port_a), (b, port_b) = _raw_decode(ctx), _raw_decode(ctx)
    pw = PrefillWorker(p.core())
    try:
        pw.add_request("ra", params(port_a), [1], [1])
        pw.add_request("rb", params(port_b), [2], [2])
        pw.schedule_chunk("ra", 4, True)
        pw.schedule_chunk("rb", 4, True)
        run_layers(pw, p, 1, [1, 2], [1, 2], 1)
        for router in (a, b):
            ident, meta = _take(router)
            assert isinstance(meta, wire.MfMeta)
            router.send_multipart([ident, wire.encode(wire.MfMetaAck(True, 1))])
            assert isinstance(_take(router)[1], wire.ReadReadyBatch)
        with caplog.at_level("WARNING", logger="sfa_rd2h.runtime.control"):
            a.close()
            b.close()
            assert failed.wait(WAIT)
        assert pw.stats.peers_lost == 2
        lost = sorted(f"connection to Decode 127.0.0.1:{port} dropped"
                      for port in (port_a, port_b))
        assert sorted(m for m in caplog.messages if "dropped" in m) == [
            f"prefill rank 0: {m}" for m in lost]
        with pytest.raises(LayerSendError) as info:
            pw.wait_for_layer_send(0, WAIT)
        first = [f"layer 0 via 127.0.0.1:{port}: S5: connection to Decode 127.0.0.1:{port} "
                 "dropped" for port in (port_a, port_b)]
        assert str(info.value) in [f"S4: layer 0 cannot be written: {f}; {f}" for f in first]
    finally:
        pw.close()
        a.close()
        b.close()
        ctx.term()


def test_a_reply_timeout_replaces_the_connection(
        engines: tuple[HostEngine, HostEngine]) -> None:
    """S5: a Decode that leaves a READY unanswered past the reply timeout loses its
    connection: the gate fails naming the timeout, the timed-out connection is closed (the
    Decode sees it go), and the next READY to that Decode goes over a new connection, after
    a new MF_META, never over the old one."""
    from zmq.utils.monitor import recv_monitor_message

    pe, _ = engines
    p = make_prefill(pe, 1, 1)
    ctx = zmq.Context()
    router, port = _raw_decode(ctx)
    gone = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    pw = PrefillWorker(p.core(reply_timeout=0.5))
    try:
        pw.add_request("r1", params(port), [1], [1])
        pw.schedule_chunk("r1", 4, True)
        run_layers(pw, p, 1, [1], [1], 1)
        old, meta = _take(router)
        assert isinstance(meta, wire.MfMeta)
        router.send_multipart([old, wire.encode(wire.MfMetaAck(True, 1))])
        assert isinstance(_take(router)[1], wire.ReadReadyBatch)
        with pytest.raises(LayerSendError) as info:  # the READY is never answered
            pw.wait_for_layer_send(0, WAIT)
        late = f"layer 0 via 127.0.0.1:{port}: S5: no reply within 0.5s"
        assert str(info.value) == f"S4: layer 0 cannot be written: {late}; {late}"
        assert gone.poll(int(WAIT * 1000)), "the timed-out connection is still open"
        assert recv_monitor_message(gone)["event"] == zmq.EVENT_DISCONNECTED
        assert pw.stats.peers_lost == 1
        pw.add_request("r2", params(port), [2], [2])
        pw.schedule_chunk("r2", 4, True)
        pw.begin_layer(0)  # the failed gate was observed above; the slot is free
        p.write(0, 2, [2], [2])
        pw.layer_written(0, None)
        new, meta = _take(router)
        assert isinstance(meta, wire.MfMeta)  # a new handshake (W1) ...
        assert new != old, "the READY after a reply timeout reused the timed-out connection"
        router.send_multipart([new, wire.encode(wire.MfMetaAck(True, 1))])
        ident, ready = _take(router)  # ... and the READY over the new connection
        assert ident == new and isinstance(ready, wire.ReadReadyBatch)
        router.send_multipart([new, wire.encode(wire.ReadDone(0))])
        pw.wait_for_layer_send(0, WAIT)
        assert pw.drain(WAIT) == []
    finally:
        pw.close()
        gone.close()
        router.close()
        ctx.term()


def test_a_ready_held_for_destinations_is_read_once_they_are_registered(
        engines: tuple[HostEngine, HostEngine]) -> None:
    """C1: a READY that came before its request was registered waits on Decode; the
    registration (on the scheduler's thread) starts the read, and the READ_DONE follows."""
    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)
    waiting = threading.Event()

    def observe(machine: str, key: str, event: str, src: str, dst: str, args: tuple) -> None:
        if dst == "awaiting_destinations":
            waiting.set()

    dw = DecodeWorker(DecodeCore(0, 1, d.layouts, observer=observe), de, 0)
    ctx = zmq.Context()
    sock = _dealer(ctx, dw.port, b"prefill-0")
    try:
        sock.send(wire.encode(wire.MfMeta(pe.session_id, p.layers, wire.PROTOCOL_VERSION)))
        assert wire.decode_meta_reply(_recv(sock)).accepted
        p.write(0, 5, [3], [4])
        sock.send(wire.encode(wire.ReadReadyBatch(0, "l0", (wire.ReadReq("late", (3,), (4,)),),
                                                  ("late",))))
        assert waiting.wait(WAIT) and dw.waiting_for_destinations() == 1
        dw.register_request("late", [7], [8])
        assert wire.decode(_recv(sock)) == wire.ReadDone(0)
        d.check(0, 5, [7], [8])
        assert dw.waiting_for_destinations() == 0 and dw.stats.reads == 1
    finally:
        sock.close()
        dw.close()
        ctx.term()


def test_a_failed_read_is_logged_even_when_the_engine_keeps_no_last_error(
        engines: tuple[HostEngine, HostEngine], caplog: pytest.LogCaptureFixture) -> None:
    """An engine need not have ``last_error``: the warning then ends after the result, and
    the time the read took is what the stats add up."""
    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)

    class Failing:
        name = "failing"

        def batch_transfer_sync_read(self, *args: Any) -> int:
            return -3

    dw = DecodeWorker(DecodeCore(0, 1, d.layouts), Failing(), 0)  # type: ignore[arg-type]
    ctx = zmq.Context()
    sock = _dealer(ctx, dw.port, b"prefill-0")
    try:
        sock.send(wire.encode(wire.MfMeta("127.0.0.1:1", p.layers, wire.PROTOCOL_VERSION)))
        assert wire.decode_meta_reply(_recv(sock)).accepted
        dw.register_request("r", [1], [1])
        t0 = time.perf_counter()
        with caplog.at_level("WARNING", logger="sfa_rd2h.runtime.control"):
            sock.send(wire.encode(wire.ReadReadyBatch(0, "l0", (wire.ReadReq("r", (1,), (1,)),),
                                                      ("r",))))
            assert isinstance(wire.decode(_recv(sock)), wire.ReadFailed)
        elapsed = time.perf_counter() - t0
        assert [m for m in caplog.messages if "batched read" in m] == [
            "decode rank 0: batched read from 127.0.0.1:1 failed (-3): "]
        assert dw.stats.failed_reads == 1 and 0 < dw.stats.read_seconds <= elapsed
    finally:
        sock.close()
        dw.close()
        ctx.term()


def _bounded(call: Any) -> list[Any]:
    """Run ``call`` on a helper thread, joined within WAIT: [result] or [exception], or []
    if it is still running (a wait that should have ended)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    helper = threading.Thread(target=run, daemon=True)
    helper.start()
    helper.join(WAIT)
    return out


def test_wait_for_layer_send_with_no_time_left_fails_at_once_naming_each_slot(
        engines: tuple[HostEngine, HostEngine]) -> None:
    """S1 on a clock that does not move between readings (a coarse clock): a wait whose
    time is up raises at once instead of spinning until the clock moves, and the message
    names every slot of the layer with its state, owner and pending readers."""
    pe, _ = engines
    p = make_prefill(pe, 1, 1)
    core = p.core()
    pw = PrefillWorker(core, clock=lambda: 5.0)
    try:
        pw.begin_layer(0)  # the compute thread is writing the layer: not writable
        [exc] = _bounded(lambda: pw.wait_for_layer_send(0, 0.0))
        assert isinstance(exc, LayerSendTimeout)
        held = "; ".join(f"{g.key} writing owner=layer 0 pending []" for g in core.gates_of(0))
        assert str(exc) == f"S1: layer 0 not writable after 0.0s: {held}"
        assert " owner=layer 0 pending []; " in held  # two slots: main and indexer
    finally:
        pw.close()


def test_drain_wakes_when_a_layer_nobody_reads_lands(
        engines: tuple[HostEngine, HostEngine]) -> None:
    """A drain already waiting while the sender holds the last layer's task returns as
    soon as the layer lands: a layer no request reads frees its slots at once, and nothing
    else would wake the drain."""
    pe, _ = engines
    p = make_prefill(pe, 1, 1)
    entered, release, draining = threading.Event(), threading.Event(), threading.Event()
    drainer: list[threading.Thread] = []

    def clock() -> float:
        if threading.current_thread() in drainer:
            draining.set()  # drain read its deadline with the worker's lock held
        return time.monotonic()

    class Landing:
        def synchronize(self) -> None:
            entered.set()
            assert release.wait(WAIT)

    pw = PrefillWorker(p.core(), clock=clock)
    try:
        pw.begin_layer(0)  # no request scheduled: the layer has no readers
        pw.layer_written(0, Landing())
        assert entered.wait(WAIT)  # the sender holds the task
        out: list[Any] = []
        drainer.append(threading.Thread(target=lambda: out.append(pw.drain(2 * WAIT)),
                                        daemon=True))
        drainer[0].start()
        assert draining.wait(WAIT)  # the sender cannot land before drain is waiting
        release.set()
        drainer[0].join(WAIT)
        assert out == [[]] and pw.layer_settled(0) is True
    finally:
        release.set()
        pw.close()
        for t in drainer:
            t.join(WAIT)


def test_agreement_loop_rejects_a_round_wait_that_is_not_positive() -> None:
    for wait in (0, -1.0, float("nan")):
        with pytest.raises(ValueError) as info:
            AgreementLoop(SingleRankGroup(), round_wait=wait)
        assert str(info.value) == "round_wait must be > 0"


def test_a_failed_collective_ends_the_loop_for_good(
        caplog: pytest.LogCaptureFixture) -> None:
    """The collective raised (a peer rank is gone): the loop logs it once with the rank,
    keeps the exception for the caller, and stays ended - running it again joins no
    further collective, so this rank cannot get out of step with the others."""
    calls: list[dict[str, bool]] = []
    boom = RuntimeError("rank 0: peer gone")

    class Broken(SingleRankGroup):
        @property
        def rank(self) -> int:
            return 2

        def agree(self, local: Any) -> dict[str, bool]:
            calls.append(dict(local))
            raise boom

    loop = AgreementLoop(Broken(), round_wait=0.01)
    with caplog.at_level("ERROR", logger="sfa_rd2h.runtime.control"):
        loop.start(_Outcomes(), until=lambda agreed: False)  # type: ignore[arg-type]
        assert loop.wait(WAIT)
    assert loop.error is boom and calls == [{}] and loop.rounds == 0
    [record] = [r for r in caplog.records if r.name == "sfa_rd2h.runtime.control"]
    assert record.getMessage() == "agreement loop on rank 2 failed"
    assert record.exc_info is not None and record.exc_info[1] is boom
    loop.run(_Outcomes(), until=lambda agreed: False)  # type: ignore[arg-type]
    assert calls == [{}]


def test_decode_expires_a_request_when_the_clock_reaches_its_deadline(
        engines: tuple[HostEngine, HostEngine]) -> None:
    """R1 with no traffic at all: the reader wakes for the request's deadline by itself and
    fails the request when the clock reads exactly the deadline (not one tick later)."""
    from sfa_rd2h.statemachines.cores.actions import RequestReady

    _, de = engines
    d = make_decode(de, 1)
    now = [100.0]
    readies: list[RequestReady] = []
    expired = threading.Event()

    def on_ready(a: RequestReady) -> None:
        readies.append(a)
        expired.set()

    dw = DecodeWorker(DecodeCore(0, 1, d.layouts, request_deadline=0.2), de, 0,
                      on_ready=on_ready, clock=lambda: now[0])
    try:
        dw.register_request("r", [1], [1])
        now[0] = 100.0 + 0.2  # where the reader finds the clock when its poll times out
        assert expired.wait(WAIT)
        assert readies == [RequestReady("r", False)] and dw.local_outcome("r") is False
    finally:
        dw.close()


def test_decode_wakes_for_a_deadline_while_no_frame_arrives(
        engines: tuple[HostEngine, HostEngine]) -> None:
    """R1: once the registration's wake-up is handled, nothing else arrives; the reader
    still wakes for the request's deadline by itself and fails the request."""
    from sfa_rd2h.statemachines.cores.actions import RequestReady

    _, de = engines
    d = make_decode(de, 1)
    readies: list[RequestReady] = []
    expired = threading.Event()

    def on_ready(a: RequestReady) -> None:
        readies.append(a)
        expired.set()

    dw = DecodeWorker(DecodeCore(0, 1, d.layouts, request_deadline=0.2), de, 0,
                      on_ready=on_ready)
    try:
        t0 = time.monotonic()
        dw.register_request("r", [1], [1])
        assert expired.wait(WAIT)
        assert time.monotonic() - t0 >= 0.2
        assert readies == [RequestReady("r", False)]
    finally:
        dw.close()


def test_worker_threads_are_named_daemons(engines: tuple[HostEngine, HostEngine]) -> None:
    """What an operator sees in a thread dump: ``prefill<rank>-sender`` and
    ``decode<rank>-reader``; both are daemons, so a worker left open does not hold up
    interpreter exit."""
    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)
    pw = PrefillWorker(p.core())
    dw = DecodeWorker(DecodeCore(0, 1, d.layouts), de, 0)
    try:
        names = {t.name: t.daemon for t in threading.enumerate()}
        assert names["prefill0-sender"] is True and names["decode0-reader"] is True
    finally:
        pw.close()
        dw.close()


def test_a_failed_io_thread_is_logged_and_named_to_every_caller(
        engines: tuple[HostEngine, HostEngine], caplog: pytest.LogCaptureFixture) -> None:
    """The sender fails (its device event raised) and the reader fails (a callback on it
    raised): each is logged once with its rank, and every later API call says which thread
    failed and with what."""
    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)
    lost, bug = RuntimeError("device lost"), RuntimeError("callback bug")

    class Broken:
        def synchronize(self) -> None:
            raise lost

    raised = threading.Event()

    def on_ready(a: Any) -> None:
        raised.set()
        raise bug

    pw = PrefillWorker(p.core())
    dw = DecodeWorker(DecodeCore(0, 1, d.layouts, request_deadline=0.05), de, 0,
                      on_ready=on_ready)
    try:
        with caplog.at_level("ERROR", logger="sfa_rd2h.runtime.control"):
            pw.begin_layer(0)
            pw.layer_written(0, Broken())
            with pytest.raises(ControlPlaneError) as info:
                pw.drain(WAIT)  # wakes when the sender records its failure
            assert str(info.value) == "prefill 0 sender thread failed: RuntimeError('device lost')"
            dw.register_request("r", [1], [1])  # its deadline calls on_ready on the reader
            assert raised.wait(WAIT)
            dw.close()  # joins the reader, which has recorded its failure
        with pytest.raises(ControlPlaneError) as info:
            dw.register_request("s", [2], [2])
        assert str(info.value) == "decode 0 reader thread failed: RuntimeError('callback bug')"
        with pytest.raises(ControlPlaneError) as info:
            pw.begin_layer(0)
        assert str(info.value) == "prefill 0 sender thread failed: RuntimeError('device lost')"
        records = [(r.getMessage(), r.exc_info[1] if r.exc_info else None)
                   for r in caplog.records if r.name == "sfa_rd2h.runtime.control"]
        assert records == [("prefill rank 0 sender thread failed", lost),
                           ("decode rank 0 reader thread failed", bug)]
    finally:
        pw.close()
        dw.close()


class _HeldRead:
    """A transfer engine whose reads wait for ``release`` (``reading`` says one began)."""

    def __init__(self) -> None:
        self.reading, self.release = threading.Event(), threading.Event()

    def batch_transfer_sync_read(self, *args: Any) -> int:
        self.reading.set()
        assert self.release.wait(WAIT)
        return 0


def _introduced(ctx: zmq.Context, dw: DecodeWorker, p: Prefill) -> zmq.Socket:
    """A Prefill connection to ``dw`` whose MF_META was accepted."""
    sock = _dealer(ctx, dw.port, b"prefill-0")
    sock.send(wire.encode(wire.MfMeta("127.0.0.1:1", p.layers, wire.PROTOCOL_VERSION)))
    assert wire.decode_meta_reply(_recv(sock)).accepted
    return sock


def test_decode_close_is_bounded_and_says_what_held_it(
        engines: tuple[HostEngine, HostEngine]) -> None:
    """close(timeout): a reader busy in a slow callback is waited for within the bound; one
    that does not return is reported after it (at least 0.1 s); a transfer-engine read that
    does not return is reported by name."""
    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)

    # A callback that takes 0.3 s: close(WAIT) waits for it and succeeds.
    entered = threading.Event()

    def slow(a: Any) -> None:
        entered.set()
        threading.Event().wait(0.3)  # the callback's own work

    dw = DecodeWorker(DecodeCore(0, 1, d.layouts, request_deadline=0.05), de, 0,
                      on_ready=slow)
    dw.register_request("r", [1], [1])
    assert entered.wait(WAIT)
    assert _bounded(lambda: dw.close(WAIT)) == [None]

    # A callback that does not return: close gives up after its bound and says so.
    entered.clear()
    release = threading.Event()

    def stuck(a: Any) -> None:
        entered.set()
        assert release.wait(WAIT)

    dw = DecodeWorker(DecodeCore(0, 1, d.layouts, request_deadline=0.05), de, 0,
                      on_ready=stuck)
    try:
        dw.register_request("r", [1], [1])
        assert entered.wait(WAIT)
        [exc] = _bounded(lambda: dw.close(0.05))
        assert isinstance(exc, ControlPlaneError)
        assert str(exc) == "decode 0 reader thread did not stop within 0.1s"
    finally:
        release.set()
        dw.close()

    # A read that does not return.
    stuck = _HeldRead()
    dw = DecodeWorker(DecodeCore(0, 1, d.layouts), stuck, 0)  # type: ignore[arg-type]
    ctx = zmq.Context()
    sock = _introduced(ctx, dw, p)
    try:
        dw.register_request("r", [1], [1])
        sock.send(wire.encode(wire.ReadReadyBatch(0, "l0", (wire.ReadReq("r", (1,), (1,)),),
                                                  ("r",))))
        assert stuck.reading.wait(WAIT)
        [exc] = _bounded(lambda: dw.close(0.05))
        assert isinstance(exc, ControlPlaneError)
        # the stuck read is named first; a reader thread late under load is added after it
        assert str(exc).startswith(
            "decode 0: a transfer-engine read did not finish within 0.05s"), str(exc)
    finally:
        stuck.release.set()
        sock.close()
        dw.close()
        ctx.term()


def test_a_ready_that_arrives_while_decode_closes_is_answered_read_failed(
        engines: tuple[HostEngine, HostEngine]) -> None:
    """close() stops the read lanes first and lets their reads finish while the reader
    still serves the socket. A READY arriving in that window can start no read: it is
    answered READ_FAILED (F2), the read in flight still gets its READ_DONE, and close()
    ends cleanly. Before, the refused read ended the reader thread with an error, and the
    replies still owed were never sent."""
    pe, de = engines
    p = make_prefill(pe, 2, 2)
    d = make_decode(de, 2)
    slow = _HeldRead()
    dw = DecodeWorker(DecodeCore(0, 1, d.layouts), slow, 0)  # type: ignore[arg-type]
    ctx = zmq.Context()
    sock = _introduced(ctx, dw, p)
    try:
        dw.register_request("r", [1], [1])
        dw.register_request("s", [2], [2])
        sock.send(wire.encode(wire.ReadReadyBatch(0, "l0", (wire.ReadReq("r", (1,), (1,)),),
                                                  ())))
        assert slow.reading.wait(WAIT)
        assert dw._lanes.close(0.0) is False  # close()'s first step: r's read still runs
        sock.send(wire.encode(wire.ReadReadyBatch(1, "l1", (wire.ReadReq("s", (2,), (2,)),),
                                                  ())))
        refused = wire.decode(_recv(sock))
        assert isinstance(refused, wire.ReadFailed) and refused.layer_idx == 1, refused
        assert "read lanes are closed" in refused.error
        slow.release.set()
        assert wire.decode(_recv(sock)) == wire.ReadDone(0)
        assert _bounded(lambda: dw.close(WAIT)) == [None]
    finally:
        slow.release.set()
        sock.close()
        dw.close()
        ctx.term()


def test_workers_close_their_own_context_and_leave_a_shared_one_open(
        engines: tuple[HostEngine, HostEngine]) -> None:
    """A context the caller passed stays usable after the workers close (the caller owns
    it); a context a worker made itself is terminated by close, so closed workers hold no
    file descriptors, even while the caller still references them."""
    import gc
    import os

    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)

    def cycle(ctx: zmq.Context | None) -> list[Any]:
        pw = PrefillWorker(p.core(), context=ctx)
        dw = DecodeWorker(DecodeCore(0, 1, d.layouts), de, 0, context=ctx)
        pw.close()
        dw.close()
        return [pw, dw]  # kept: closing must release the context, not the garbage collector

    def open_fds() -> int:
        gc.collect()
        return len(os.listdir("/proc/self/fd"))

    cycle(None)  # whatever is opened once per process is opened now
    before = open_fds()
    shared = zmq.Context()
    closed = cycle(shared)
    assert not shared.closed
    shared.socket(zmq.PAIR).close()  # still usable
    shared.term()
    closed += [w for _ in range(3) for w in cycle(None)]
    assert open_fds() == before and len(closed) == 8


def test_a_context_term_that_does_not_end_is_logged_not_waited_for(
        engines: tuple[HostEngine, HostEngine], caplog: pytest.LogCaptureFixture) -> None:
    """libzmq was caught never finishing a context's term() (a closed ROUTER not reaped,
    under load); a worker's close must not wedge its caller's shutdown on it. Here a socket
    left open in the worker's own context holds term() for real: close returns, says so,
    and the term ends by itself once that socket goes."""
    _, de = engines
    d = make_decode(de, 1)
    dw = DecodeWorker(DecodeCore(0, 1, d.layouts), de, 0)
    stray = dw._ctx.socket(zmq.PAIR)  # term() waits for every socket of the context
    with caplog.at_level(logging.WARNING, logger="sfa_rd2h.runtime.control"):
        dw.close(timeout=0.5)
    assert "zmq Context.term() did not end within 2.0s" in caplog.text
    [term] = [t for t in threading.enumerate() if t.name.endswith("zmq-term")]
    assert term.daemon and not dw._ctx.closed
    stray.close(linger=0)
    term.join(10)
    assert not term.is_alive() and dw._ctx.closed
    held = zmq.Context()
    sock = held.socket(zmq.PAIR)
    assert terminate_within(held, 0.05, "held") is False
    sock.close(linger=0)
    assert terminate_within(zmq.Context(), 5.0, "free") is True


def test_decode_logs_and_traces_every_dropped_or_refused_frame(
        engines: tuple[HostEngine, HostEngine], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """A message with bad framing is dropped, a frame the core refuses (ProtocolError) is
    rejected; both are counted, each kind is logged once per interval saying why, the trace
    keeps every frame received and sent with its direction and each dropped message with
    its error, and the reader goes on serving."""
    from sfa_rd2h.spec.errors import ProtocolError

    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)

    class Refusing(DecodeCore):
        def on_frame(self, peer: str, payload: bytes, now: float) -> list[Any]:
            if payload == b"refuse me":
                raise ProtocolError("T9: refused by the core")
            return super().on_frame(peer, payload, now)

    tracer = Tracer(tmp_path / "d.jsonl", "d0", role="decode")
    dw = DecodeWorker(Refusing(0, 1, d.layouts), de, 0, tracer=tracer)
    ctx = zmq.Context()
    sock = _dealer(ctx, dw.port, b"p0")
    peer = b"p0".hex()
    try:
        with caplog.at_level("WARNING", logger="sfa_rd2h.runtime.control"):
            sock.send_multipart([b"one", b"two"])
            sock.send(b"refuse me")
            sock.send(b"refuse me")
            sock.send(wire.encode(wire.MfMeta(pe.session_id, p.layers, wire.PROTOCOL_VERSION)))
            assert wire.decode_meta_reply(_recv(sock)).accepted  # FIFO: the others were handled
        assert (dw.stats.bad_framing, dw.stats.rejected_frames) == (1, 2)
        assert dw.stats.frames_received == 4
        framing = "router frames: expected exactly one non-empty payload frame, got 2"
        assert caplog.messages == [f"decode rank 0: dropped a message: {framing}",
                                   f"decode rank 0: rejected frame from {peer}: "
                                   "T9: refused by the core"]
    finally:
        sock.close()
        dw.close()
        ctx.term()
        tracer.close()
    records = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    seen = [{k: v for k, v in r.items() if k != "t"} for r in records
            if r["k"] in ("msg", "info")]
    assert seen == [
        {"k": "info", "endpoint": dw.endpoint},
        {"k": "info", "event": "bad_framing", "error": framing},
        {"k": "msg", "dir": "recv", "peer": peer, "kind": "malformed"},
        {"k": "msg", "dir": "recv", "peer": peer, "kind": "malformed"},
        {"k": "msg", "dir": "recv", "peer": peer, "kind": "mf_meta"},
        {"k": "msg", "dir": "send", "peer": peer, "kind": "mf_meta_ack"},
    ]


def test_idle_workers_sleep_instead_of_spinning(engines: tuple[HostEngine, HostEngine]) -> None:
    """After handling a wake-up, an idle worker's I/O thread blocks in its poll: over a
    quiet 0.3 s it reads its clock a handful of times at most, not once per spin of a busy
    loop (which would burn a core on every rank)."""
    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)
    reads = {"prefill": 0, "decode": 0}

    def counting(role: str) -> Any:
        def clock() -> float:
            reads[role] += 1
            return time.monotonic()
        return clock

    pw = PrefillWorker(p.core(), clock=counting("prefill"))
    dw = DecodeWorker(DecodeCore(0, 1, d.layouts), de, 0, clock=counting("decode"))
    ctx = zmq.Context()
    sock = _dealer(ctx, dw.port, b"idle-peer")  # a connected peer: the ROUTER is writable
    try:
        sock.send(wire.encode(wire.MfMeta(pe.session_id, p.layers, wire.PROTOCOL_VERSION)))
        assert wire.decode_meta_reply(_recv(sock)).accepted
        dw.register_request("r", [1], [1])  # rings the reader's wake-up
        pw.begin_layer(0)
        pw.layer_written(0, None)  # rings the sender's wake-up; no reader: the slot frees
        pw.drain(WAIT)
        reads.update(prefill=0, decode=0)
        threading.Event().wait(0.3)  # a quiet interval: nothing to await, only to observe
        assert reads["prefill"] < 10 and reads["decode"] < 10, reads
    finally:
        sock.close()
        pw.close()
        dw.close()
        ctx.term()


def test_a_reply_to_a_vanished_prefill_is_counted_and_forgets_its_connection(
        engines: tuple[HostEngine, HostEngine], caplog: pytest.LogCaptureFixture) -> None:
    """The Prefill connection is gone by the time its READYs are answered (they waited for
    their destinations): each reply is counted as undeliverable, the first is logged, and
    the core forgets the connection's MF_META (a returning peer must send it again, W1)."""
    pe, de = engines
    p = make_prefill(pe, 1, 1)
    d = make_decode(de, 1)
    held: list[str] = []
    answered: list[Any] = []
    cond = threading.Condition()

    def observe(machine: str, key: str, event: str, src: str, dst: str, args: tuple) -> None:
        if dst == "awaiting_destinations":
            with cond:
                held.append(key)
                cond.notify_all()

    def on_ready(a: Any) -> None:  # a request's outcome comes right after its reply
        with cond:
            answered.append(a)
            cond.notify_all()

    core = DecodeCore(0, 1, d.layouts, observer=observe)
    dw = DecodeWorker(core, de, 0, on_ready=on_ready)
    # The vanishing peer has a context of its own: terminating it returns only once its
    # socket is closed, so its FIN is on the loopback wire before what follows. (Closed in a
    # shared context, its I/O thread could send the FIN after the round trips below.)
    gone_ctx, ctx = zmq.Context(), zmq.Context()
    gone, other = _dealer(gone_ctx, dw.port, b"gone"), _dealer(ctx, dw.port, b"other")
    meta = wire.encode(wire.MfMeta(pe.session_id, p.layers, wire.PROTOCOL_VERSION))
    try:
        gone.send(meta)
        assert wire.decode_meta_reply(_recv(gone)).accepted
        for ext in ("late1", "late2"):
            gone.send(wire.encode(wire.ReadReadyBatch(0, "l0", (wire.ReadReq(ext, (3,), (4,)),),
                                                      (ext,))))
        with cond:
            assert cond.wait_for(lambda: len(held) == 2, WAIT)
        gone.close()
        gone_ctx.term()
        # Round trips on another connection, each begun after the FIN: the Decode side's one
        # ZMQ I/O thread sees the FIN no later than the first one's bytes (loopback keeps
        # their order), and then needs a few turns of its loop, each of which a round trip
        # forces, to hand the connection's end to the ROUTER (engine, session, pipe). The
        # ROUTER takes that in before its next send: by then it has dropped "gone".
        round_trips = 4
        for _ in range(round_trips):
            other.send(meta)
            assert wire.decode_meta_reply(_recv(other)).accepted
        assert b"gone".hex() in core.connections
        with caplog.at_level("WARNING", logger="sfa_rd2h.runtime.control"):
            dw.register_request("late1", [7], [8])
            dw.register_request("late2", [9], [10])
            with cond:
                assert cond.wait_for(lambda: len(answered) == 2, WAIT)
        # The second reply (READ_FAILED: its connection lost its MF_META) is undeliverable too.
        # Sent: the MF_META replies, one to "gone" and one per round trip.
        assert (dw.stats.undeliverable, dw.stats.frames_sent) == (2, 1 + round_trips)
        assert caplog.messages == [f"decode rank 0: reply to {b'gone'.hex()} undeliverable: "
                                   "Host unreachable"]
        assert list(core.connections) == [b"other".hex()]
    finally:
        gone.close()
        gone_ctx.term()
        other.close()
        dw.close()
        ctx.term()


def test_decodes_that_never_answer_are_each_given_up_counted_and_named(
        engines: tuple[HostEngine, HostEngine], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """S5: two Decodes acknowledge MF_META and never answer the READY; after the reply
    timeout the core gives up on each: every loss is counted and logged with its reason,
    and each connection is closed as lost in the trace."""
    pe, _ = engines
    tracer = Tracer(tmp_path / "p.jsonl", "p0", role="prefill")
    p = make_prefill(pe, 1, 1)
    failed = _watch_gate_failures(p)
    ctx = zmq.Context()
    (a, port_a), (b, port_b) = _raw_decode(ctx), _raw_decode(ctx)
    pw = PrefillWorker(p.core(reply_timeout=0.3), tracer=tracer)
    try:
        pw.add_request("ra", params(port_a), [1], [1])
        pw.add_request("rb", params(port_b), [2], [2])
        pw.schedule_chunk("ra", 4, True)
        pw.schedule_chunk("rb", 4, True)
        with caplog.at_level("WARNING", logger="sfa_rd2h.runtime.control"):
            run_layers(pw, p, 1, [1, 2], [1, 2], 1)
            for router in (a, b):
                ident, meta = _take(router)
                router.send_multipart([ident, wire.encode(wire.MfMetaAck(True, 1))])
                assert isinstance(_take(router)[1], wire.ReadReadyBatch)
            assert failed.wait(WAIT)
            pw.close()  # the sender has executed what the timeout produced
        assert pw.stats.peers_lost == 2
        assert sorted(caplog.messages) == sorted(
            f"prefill rank 0: 127.0.0.1:{port}: no reply within 0.3s"
            for port in (port_a, port_b))
    finally:
        pw.close()
        a.close()
        b.close()
        ctx.term()
        tracer.close()
    records = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    events = sorted((r["peer"], r["ev"]) for r in records if r["k"] == "conn")
    assert events == sorted((f"127.0.0.1:{port}", ev) for port in (port_a, port_b)
                            for ev in ("open", "lost"))


@contextlib.contextmanager
def _landed_or_failed() -> Iterator[None]:
    try:
        yield
    except ControlPlaneError:
        pass


def test_a_core_action_the_sender_cannot_run_stops_it_by_name(
        engines: tuple[HostEngine, HostEngine]) -> None:
    """The sender runs only Send and Disconnect; anything else from the core is a bug that
    stops the sender, and callers are told which action it was."""
    from sfa_rd2h.statemachines.cores.actions import RequestReady

    pe, _ = engines
    p = make_prefill(pe, 1, 1)

    class Foreign(PrefillCore):
        def layer_landed(self, layer_idx: int, now: float) -> list[Any]:
            return [*super().layer_landed(layer_idx, now), RequestReady("r", True)]

    core = Foreign(0, tp_mapping(1, 1), pe.session_id, p.layers, block_size=BLOCK)
    pw = PrefillWorker(core)
    try:
        pw.begin_layer(0)
        pw.layer_written(0, None)
        with _landed_or_failed():
            pw.drain(WAIT)  # returns once the layer landed, or raises if the failure came first
        pw.close()  # joins the sender, which fails right after landing the layer
        with pytest.raises(ControlPlaneError) as info:
            pw.begin_layer(0)
        assert str(info.value) == ("prefill 0 sender thread failed: "
                                   "ControlPlaneError('Prefill core returned RequestReady')")
    finally:
        pw.close()


# --------------------------------------------------------------------------- the Prefill
# sender, against a raw Decode: what its trace, stats, log and sockets show.


def _handshake_raw(router: zmq.Socket) -> bytes:
    """Play Decode: take the MF_META, accept it; the connection's identity."""
    ident, meta = _take(router)
    assert isinstance(meta, wire.MfMeta)
    router.send_multipart([ident, wire.encode(wire.MfMetaAck(True, 1))])
    return ident


def _serve_one_layer(router: zmq.Socket) -> bytes:
    """Play Decode for a new connection: accept its MF_META, answer its layer-0 READY."""
    ident = _handshake_raw(router)
    assert isinstance(_take(router)[1], wire.ReadReadyBatch)
    router.send_multipart([ident, wire.encode(wire.ReadDone(0))])
    return ident


def _publish(pw: PrefillWorker, p: Prefill, port: int, ext: str, block: int,
             n_layers: int = 1) -> None:
    """Track ``ext`` for the Decode on ``port`` (block ``block`` on both sides) and run its
    only chunk through ``n_layers`` layers."""
    pw.add_request(ext, params(port), [block], [block])
    pw.schedule_chunk(ext, 4, True)
    run_layers(pw, p, block, [block], [block], n_layers)


def test_prefill_traces_each_frame_and_connection_with_its_peer_and_identity(
        engines: tuple[HostEngine, HostEngine], tmp_path: Path) -> None:
    """The Prefill trace names, for every frame, its direction, the Decode endpoint and the
    connection (the identity Decode sees), and records the connection's open and close:
    what the validator joins with the Decode trace."""
    pe, _ = engines
    p = make_prefill(pe, 1, 1)
    tracer = Tracer(tmp_path / "p.jsonl", "p0", role="prefill")
    ctx = zmq.Context()
    router, port = _raw_decode(ctx)
    pw = PrefillWorker(p.core(), tracer=tracer)
    try:
        _publish(pw, p, port, "r", 1)
        ident = _serve_one_layer(router)
        pw.wait_for_layer_send(0, WAIT)
    finally:
        pw.close()
        router.close()
        ctx.term()
        tracer.close()
    records = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    peer, conn = f"127.0.0.1:{port}", ident.hex()
    assert [{k: v for k, v in r.items() if k != "t"} for r in records
            if r["k"] in ("msg", "conn")] == [
        {"k": "conn", "ev": "open", "peer": peer, "conn": conn},
        {"k": "msg", "dir": "send", "peer": peer, "kind": "mf_meta", "conn": conn},
        {"k": "msg", "dir": "recv", "peer": peer, "kind": "mf_meta_ack", "conn": conn},
        {"k": "msg", "dir": "send", "peer": peer, "kind": "read_ready_batch", "layer": 0,
         "conn": conn},
        {"k": "msg", "dir": "recv", "peer": peer, "kind": "read_done", "layer": 0,
         "conn": conn},
        {"k": "conn", "ev": "close", "peer": peer, "conn": conn},
    ]


def test_round_trips_count_only_replies_once_per_ready_and_stay_bounded_per_layer(
        engines: tuple[HostEngine, HostEngine], monkeypatch: pytest.MonkeyPatch) -> None:
    """A round trip is READY sent -> its reply, measured once: a non-reply frame naming the
    layer (rejected) is not one, nor is a duplicate reply (which must not stop the sender).
    Each sample lies within the test's own elapsed time, and each layer keeps only its
    latest samples (here the bound is 1) while the overall series keeps them all."""
    from sfa_rd2h.runtime import control as control_mod

    monkeypatch.setattr(control_mod, "RTT_SAMPLES_PER_LAYER", 1)
    pe, _ = engines
    p = make_prefill(pe, 2, 2)
    ctx = zmq.Context()
    router, port = _raw_decode(ctx)
    pw = PrefillWorker(p.core())
    t0 = time.monotonic()
    try:
        _publish(pw, p, port, "r1", 1, 2)
        ident = _handshake_raw(router)
        assert [_take(router)[1].layer_idx for _ in range(2)] == [0, 1]
        not_a_reply = wire.encode(wire.ReadReadyBatch(1, "l1", (), ()))
        router.send_multipart([ident, not_a_reply])
        router.send_multipart([ident, wire.encode(wire.ReadDone(0))])
        pw.wait_for_layer_send(0, WAIT)  # FIFO: the frame before it was handled too
        assert pw.stats.rejected_frames == 1
        assert len(pw.round_trips()) == 1 and list(pw.stats.rtt_by_layer) == [0]
        router.send_multipart([ident, wire.encode(wire.ReadDone(0))])  # a duplicate
        router.send_multipart([ident, wire.encode(wire.ReadDone(1))])
        pw.wait_for_layer_send(1, WAIT)
        assert len(pw.round_trips()) == 2
        _publish(pw, p, port, "r2", 2, 2)
        for layer in (0, 1):
            assert _take(router)[1].layer_idx == layer
            router.send_multipart([ident, wire.encode(wire.ReadDone(layer))])
        assert pw.drain(WAIT) == []
        elapsed = time.monotonic() - t0
        rtts = pw.round_trips()
        assert len(rtts) == 4 and all(0 <= rtt <= elapsed for rtt in rtts), (rtts, elapsed)
        assert {layer: list(s) for layer, s in pw.stats.rtt_by_layer.items()} == {
            0: [rtts[2]], 1: [rtts[3]]}
    finally:
        pw.close()
        router.close()
        ctx.term()


def test_prefill_gives_up_on_a_silent_decode_when_the_clock_reaches_the_reply_deadline(
        engines: tuple[HostEngine, HostEngine]) -> None:
    """S5 on a clock that moves only when the test moves it: the READY was sent at 100.0
    with a 0.25 s reply timeout; once the clock reads exactly 100.25 (not later) the sender
    gives the Decode up by itself, with no other traffic, and the slot fails saying why."""
    pe, _ = engines
    p = make_prefill(pe, 1, 1)
    failed = _watch_gate_failures(p)
    clock = SteppedClock(100.0)
    ctx = zmq.Context()
    router, port = _raw_decode(ctx)
    pw = PrefillWorker(p.core(reply_timeout=0.25), clock=clock)
    try:
        _publish(pw, p, port, "r", 1)
        _handshake_raw(router)
        assert isinstance(_take(router)[1], wire.ReadReadyBatch)
        clock.now = 100.25  # exactly the deadline
        assert failed.wait(WAIT), "the reply deadline passed and the slot is still held"
        assert pw.stats.peers_lost == 1
        late = f"layer 0 via 127.0.0.1:{port}: S5: no reply within 0.25s"
        with pytest.raises(LayerSendError) as info:
            pw.wait_for_layer_send(0, WAIT)
        assert str(info.value) == f"S4: layer 0 cannot be written: {late}; {late}"
    finally:
        pw.close()
        router.close()
        ctx.term()


def test_a_decode_address_zmq_refuses_fails_its_readers_and_spares_the_other_decode(
        engines: tuple[HostEngine, HostEngine], caplog: pytest.LogCaptureFixture) -> None:
    """A request names a Decode host ZMQ cannot connect to (a space in it): the send to it
    fails, is counted and logged once saying why, and fails that Decode's read of the slot
    (S5); the other Decode of the same layer still gets its MF_META and READY, the sender
    goes on, and the slot fails naming the bad address."""
    pe, _ = engines
    p = make_prefill(pe, 1, 1)
    ctx = zmq.Context()
    router, port = _raw_decode(ctx)
    pw = PrefillWorker(p.core())
    bad = {**params(port), "remote_host": "decode 0"}
    try:
        pw.add_request("bad", bad, [1], [1])  # first: its send comes first
        pw.add_request("good", params(port), [2], [2])
        pw.schedule_chunk("bad", 4, True)
        pw.schedule_chunk("good", 4, True)
        with caplog.at_level("WARNING", logger="sfa_rd2h.runtime.control"):
            run_layers(pw, p, 1, [1, 2], [1, 2], 1)
            _serve_one_layer(router)
            with pytest.raises(LayerSendError) as info:
                pw.wait_for_layer_send(0, WAIT)
        why = (f"send to decode 0:{port} failed: Invalid argument "
               f"(addr='tcp://decode 0:{port}')")
        assert caplog.messages == [f"prefill rank 0: {why}"]
        assert pw.stats.peers_lost == 1 and pw.stats.frames_sent == 2
        failed = f"layer 0 via decode 0:{port}: S5: {why}"
        assert str(info.value) == f"S4: layer 0 cannot be written: {failed}; {failed}"
        assert pw.drain(WAIT) == []  # the sender is alive and the slot free again
    finally:
        pw.close()
        router.close()
        ctx.term()


def test_an_idle_prefill_sleeps_with_a_connection_open_or_being_retried(
        engines: tuple[HostEngine, HostEngine]) -> None:
    """The sender blocks in its poll when there is nothing to do: with a connection open and
    every READY answered (its sockets are writable: polling for that would spin), and while
    ZMQ keeps retrying a Decode that refuses connections every 100 ms (those attempts are
    no reason to wake). Over each quiet interval it reads its clock a few times at most (what
    it was finishing), not once per spin or per retry."""
    pe, _ = engines
    p = make_prefill(pe, 1, 1)
    reads = [0]
    published = threading.Event()

    def clock() -> float:
        reads[0] += 1
        return time.monotonic()

    def observe(machine: str, key: str, event: str, src: str, dst: str, args: tuple) -> None:
        if dst == "awaiting_replies":
            published.set()

    p.tracer = observe  # type: ignore[assignment]
    ctx = zmq.Context()
    router, port = _raw_decode(ctx)
    refusing = socket.socket()  # bound, never listening: every connection is refused
    refusing.bind(("127.0.0.1", 0))
    pw = PrefillWorker(p.core(), clock=clock)
    try:
        _publish(pw, p, port, "r", 1)
        _serve_one_layer(router)
        assert pw.drain(WAIT) == []
        reads[0] = 0
        assert not router.poll(300)  # a quiet interval: nothing to await, only to observe
        assert reads[0] < 10, f"{reads[0]} clock reads while idle with a connection open"
        published.clear()
        pw.add_request("r2", params(refusing.getsockname()[1]), [2], [2])
        pw.schedule_chunk("r2", 4, True)
        run_layers(pw, p, 2, [2], [2], 1)
        assert published.wait(WAIT)  # the MF_META follows at once; then nothing to do
        reads[0] = 0
        assert not router.poll(1000)  # about ten connection attempts
        assert reads[0] < 6, f"{reads[0]} clock reads while ZMQ retried the connection"
    finally:
        pw.close()
        router.close()
        refusing.close()
        ctx.term()


class _Recording(zmq.Context):
    """A context that keeps a weak reference to each DEALER made in it: which of a worker's
    connections are still held, and with what options."""

    dealers: list[Any] = []

    def __init__(self) -> None:
        super().__init__()
        self.dealers = []

    def socket(self, socket_type: int, *args: Any, **kwargs: Any) -> Any:
        import weakref

        sock = super().socket(socket_type, *args, **kwargs)
        if socket_type == zmq.DEALER:
            self.dealers.append(weakref.ref(sock))
        return sock

    def open_dealers(self) -> list[zmq.Socket]:
        return [s for s in (ref() for ref in self.dealers) if s is not None and not s.closed]


def test_a_replaced_connection_is_released_and_each_keeps_its_options(
        engines: tuple[HostEngine, HostEngine], monkeypatch: pytest.MonkeyPatch) -> None:
    """S5: a Decode that never answered loses its connection, and the next READY goes over a
    new one; the old connection is released (nothing in the worker holds its socket, so a
    long run that loses connections does not pile them up). Every connection the sender
    uses closes at once when dropped (linger 0) and refuses replies over 1 MiB."""
    import gc

    from sfa_rd2h.runtime.control import REPLY_MAX_BYTES

    pe, _ = engines
    p = make_prefill(pe, 1, 1)
    ctx = _Recording()
    router, port = _raw_decode(ctx)
    core = p.core(reply_timeout=0.3)
    options: list[tuple[int, int]] = []
    real_on_frame = core.on_frame

    def on_frame(endpoint: str, frame: bytes, now: float) -> list[Any]:
        # on the sender thread, which owns the connections: their options in effect
        options.extend((s.getsockopt(zmq.LINGER), s.getsockopt(zmq.MAXMSGSIZE))
                       for s in ctx.open_dealers())
        return real_on_frame(endpoint, frame, now)

    monkeypatch.setattr(core, "on_frame", on_frame)
    pw = PrefillWorker(core, context=ctx)
    try:
        _publish(pw, p, port, "r1", 1)
        old = _handshake_raw(router)
        assert isinstance(_take(router)[1], wire.ReadReadyBatch)
        with pytest.raises(LayerSendError):  # never answered: the connection is given up
            pw.wait_for_layer_send(0, WAIT)
        _publish(pw, p, port, "r2", 2)
        new = _handshake_raw(router)
        assert new != old and isinstance(_take(router)[1], wire.ReadReadyBatch)
        router.send_multipart([new, wire.encode(wire.ReadDone(0))])
        assert pw.drain(WAIT) == []
        gc.collect()
        held = [ref() for ref in ctx.dealers]
        assert len(held) == 2 and held[0] is None, "the lost connection is still held"
        assert held[1] is not None and not held[1].closed
        # three replies came (two acks, a READ_DONE); at each, exactly one connection open
        assert options == [(0, REPLY_MAX_BYTES)] * 3
    finally:
        pw.close()
        router.close()
        ctx.term()


def test_replies_already_queued_count_before_the_reply_timer_fires(
        engines: tuple[HostEngine, HostEngine]) -> None:
    """S5 is about replies that did not come: when the sender returns to its sockets with
    the clock already at a READY's reply deadline, a reply queued for it is handled first,
    even behind a wake-up in the same poll and behind a badly framed and an undecodable
    frame in the same batch, so a Decode that answered in time is not given up.

    The replies come over inproc (the sender connects its DEALER there itself, while it
    waits on a layer's device event), so all of them are queued before it goes on."""
    pe, _ = engines
    p = make_prefill(pe, 3, 3)
    clock = SteppedClock(100.0)
    ctx = _Recording()
    router, port = _raw_decode(ctx)
    inproc = f"inproc://prefill-queued-{id(ctx)}"
    pusher = ctx.socket(zmq.ROUTER)
    pusher.setsockopt(zmq.LINGER, 0)
    pusher.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a frame it cannot route raises
    pusher.bind(inproc)
    entered, release = threading.Event(), threading.Event()

    class Held:
        def synchronize(self) -> None:  # on the sender thread, which owns the DEALER
            [dealer] = ctx.open_dealers()
            dealer.connect(inproc)
            entered.set()
            assert release.wait(WAIT)

    pw = PrefillWorker(p.core(reply_timeout=5.0), clock=clock, context=ctx)
    try:
        _publish(pw, p, port, "r", 1)  # layer 0's READY goes out at 100.0: due by 105.0
        ident = _handshake_raw(router)
        assert _take(router)[1].layer_idx == 0
        pw.wait_for_layer_send(1, WAIT)
        pw.begin_layer(1)
        pw.layer_written(1, Held())
        assert entered.wait(WAIT)
        pw.wait_for_layer_send(2, WAIT)
        pw.begin_layer(2)
        pw.layer_written(2, None)  # rings the sender's wake-up while it waits
        pusher.send_multipart([ident, b"one", b"two"])
        pusher.send_multipart([ident, b"\xc1 not msgpack"])
        pusher.send_multipart([ident, wire.encode(wire.ReadDone(0))])
        clock.now = 105.0
        release.set()
        pw.wait_for_layer_send(0, WAIT)  # answered in time: free, not failed
        assert pw.stats.rejected_frames == 2 and pw.stats.peers_lost == 0
    finally:
        release.set()
        pw.close()
        pusher.close()
        router.close()
        ctx.term()


def test_a_decode_that_takes_no_more_frames_fails_the_send_instead_of_blocking_the_sender(
        engines: tuple[HostEngine, HostEngine], caplog: pytest.LogCaptureFixture) -> None:
    """S5: a Decode whose queue is full (its high-water mark reached) costs its connection
    at once: the send fails, is counted and logged saying why, and that Decode's reads of
    every published layer fail; the sender is not blocked in the send (which would hold up
    every other Decode and the compute thread's waits), and the READYs after the failed one
    are dropped with the connection, not sent over a new one without MF_META (W1).

    Made deterministic: every socket of the worker's context queues one frame at most; the
    TCP connection never comes up (the port refuses), so the MF_META fills it; the sender
    also connects its DEALER to an inproc ROUTER that acknowledges MF_META and reads
    nothing, so the six READYs released by the acknowledgement overflow that queue."""
    n = 6
    pe, _ = engines
    p = make_prefill(pe, n, n)
    failed = _watch_gate_failures(p)
    ctx = _Recording()
    ctx.setsockopt(zmq.SNDHWM, 1)  # the default for every socket made in it
    refusing = socket.socket()  # bound, never listening: every connection is refused
    refusing.bind(("127.0.0.1", 0))
    port = refusing.getsockname()[1]
    inproc = f"inproc://prefill-full-{id(ctx)}"
    decode = ctx.socket(zmq.ROUTER)
    decode.setsockopt(zmq.LINGER, 0)
    decode.setsockopt(zmq.RCVHWM, 1)
    decode.bind(inproc)
    identity: list[bytes] = []
    bridged = threading.Event()

    class Bridge:
        def synchronize(self) -> None:  # on the sender thread, which owns the DEALER
            [dealer] = ctx.open_dealers()
            dealer.connect(inproc)
            identity.append(dealer.getsockopt(zmq.IDENTITY))
            bridged.set()

    pw = PrefillWorker(p.core(), context=ctx)
    try:
        pw.add_request("r", params(port), [1], [1])
        pw.schedule_chunk("r", 4, True)
        with caplog.at_level("WARNING", logger="sfa_rd2h.runtime.control"):
            for layer in range(n):  # layer 0 sends MF_META; every READY waits for its ack
                pw.begin_layer(layer)
                p.write(layer, 1, [1], [1])
                pw.layer_written(layer, Bridge() if layer == n - 1 else None)
            assert bridged.wait(WAIT)
            decode.send_multipart([identity[0], wire.encode(wire.MfMetaAck(True, 1))])
            assert failed.wait(WAIT), "no send failed: the sender is blocked in one"
            errors = pw.drain(WAIT)
    finally:
        try:
            pw.close()  # a sender stuck in a send does not stop: this raises
        finally:
            decode.close()
            refusing.close()
    ctx.term()  # only once the worker has closed its sockets
    why = f"send to 127.0.0.1:{port} failed: Resource temporarily unavailable"
    assert caplog.messages == [f"prefill rank 0: {why}"]
    fails = [f"layer {i} via 127.0.0.1:{port}: S5: {why}" for i in range(n)]
    assert errors == [f"S4: layer {i} cannot be written: {f}; {f}" for i, f in enumerate(fails)]
    assert pw.stats.peers_lost == 1 and 1 <= pw.stats.frames_sent < n
    assert len(ctx.dealers) == 1, "a READY went out over a new connection"
