"""Bad input gets a clear answer and loses nothing (W5, S3): fuzzing the cores' inputs."""

from __future__ import annotations

from collections import Counter

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from sfa_rd2h.spec import wire
from sfa_rd2h.spec.errors import ProtocolError
from sfa_rd2h.spec.layout import DestLayout
from sfa_rd2h.spec.topology import tp_mapping
from sfa_rd2h.statemachines.cores.actions import IssueRead, Send
from sfa_rd2h.statemachines.cores.decode import DecodeCore
from sfa_rd2h.statemachines.cores.prefill import PrefillCore

META = wire.LayerMeta((0x1000, 0x2000, 0x3000), (16, 16, 8), (1, 1, 1), (0, 0, 1), 2, True)
DEST = DestLayout((0x900000, 0x910000, 0x920000), (16, 16, 8), (32, 32, 32), 2, True, False)

values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
    | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=20)


def _ready_fields(draw: st.DrawFn) -> list:
    fields = [wire.READ_READY_BATCH, draw(st.integers(0, 3)), "l0",
              [["r1", [1, 2], [1, 2], 0, 0]], ["r1"], 0, 1]
    for _ in range(draw(st.integers(0, 3))):
        i = draw(st.integers(1, len(fields) - 1))
        fields[i] = draw(values)
    return fields[: draw(st.integers(1, len(fields) + 1))]


@st.composite
def hostile_frames(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["bytes", "structure", "ready"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "structure":
        return msgpack.packb(draw(values), use_bin_type=True)
    return msgpack.packb(_ready_fields(draw), use_bin_type=True)


def _decode_core() -> DecodeCore:
    core = DecodeCore(0, 1, {"l0": DEST}, destination_wait=1.0)
    core.register_request("r1", list(range(4)), list(range(4)), 0.0)
    core.on_frame("p0", wire.encode(wire.MfMeta("s:1", {"l0": META})), 0.0)
    return core


@st.composite
def readys_for_some_request(draw: st.DrawFn) -> bytes:
    """Well-formed READYs for the registered request or for ones never registered (those
    wait for their destinations, C1)."""
    ext = draw(st.sampled_from(["r1", "r2", "r3"]))
    return wire.encode(wire.ReadReadyBatch(
        draw(st.integers(0, 3)), "l0", (wire.ReadReq(ext, (1, 2), (1, 2), 0, 0),),
        (ext,) if draw(st.booleans()) else ()))


@settings(max_examples=400, deadline=None)
@given(frames=st.lists(st.one_of(hostile_frames(), readys_for_some_request()), min_size=1,
                       max_size=6))
def test_decode_answers_every_identifiable_layer_exactly_once(frames):
    core = _decode_core()
    waiting: Counter[int] = Counter()  # layers of READYs that wait for destinations (C1)
    for frame in frames:
        before = len(core.waiting_reads())
        actions = core.on_frame("p0", frame, 0.0)  # never raises
        for a in actions:
            if isinstance(a, IssueRead):
                actions += core.read_result(a.read_id, 0, 0.0)
        replies = _replies(actions)
        layer = wire.layer_of(frame)
        if layer is None:
            assert replies == []  # nothing to answer it with
            assert len(core.waiting_reads()) == before
        elif len(core.waiting_reads()) == before + 1:
            assert replies == []  # it waits; answered when its wait ends
            waiting[layer] += 1
        else:
            # S3: one reply, for that layer, whatever was wrong with the rest of the frame
            assert len(core.waiting_reads()) == before
            assert [r.layer_idx for r in replies] == [layer]
    # Bounded waits end: the missing requests fail (R5) and every READY still waiting is
    # served for the rest, which ends in its one reply (C1, S3).
    actions = core.tick(10.0)
    for a in list(actions):
        if isinstance(a, IssueRead):
            actions += core.read_result(a.read_id, 0, 10.0)
    final = _replies(actions)
    assert Counter(r.layer_idx for r in final) == waiting
    assert not core.has_waiting_reads()
    assert _replies(core.tick(20.0)) == []  # and exactly once


def _replies(actions: list) -> list:
    decoded = [wire.decode(a.payload) for a in actions if isinstance(a, Send)]
    return [r for r in decoded if isinstance(r, wire.ReadDone | wire.ReadFailed)]


def _replies_to_prefill(draw: st.DrawFn) -> bytes:
    """Well-formed replies, for any layer: only one for the outstanding layer 0 counts."""
    layer = draw(st.integers(0, 3))
    if draw(st.booleans()):
        return wire.encode(wire.ReadDone(layer))
    return wire.encode(wire.ReadFailed(layer, draw(st.text(max_size=8))))


@settings(max_examples=300, deadline=None)
@given(frame=st.one_of(hostile_frames(), st.composite(_replies_to_prefill)()))
def test_prefill_rejects_hostile_replies_without_changing_state(frame):
    """A frame from Decode that is not a reply to an outstanding READY raises
    ``ProtocolError`` (malformed, not a reply, an ack out of turn) or is counted stale (a
    reply for a layer with no READY outstanding); either way no gate, session or request
    changes. Only a well-formed reply for layer 0 settles layer 0's gates (S3, S4)."""
    core = PrefillCore(0, tp_mapping(1, 1), "p:1", {"l0": META}, block_size=4)
    core.add_request("r1", {"remote_host": "d", "remote_port": 7000, "remote_tp_size": 1},
                     [1], [1])
    core.schedule_chunk("r1", 4, True)
    core.begin_layer(0, 0.0)
    core.layer_landed(0, 0.0)
    core.on_frame("d:7000", wire.RAW_ACK, 0.0)

    def state() -> list:
        return ([(k, g.state, set(g.pending), g.owner) for k, g in core.gates.items()]
                + [(e, ep.session.state) for e, ep in core.endpoints.items()]
                + sorted(core.requests))

    before, stale = state(), core.stale_replies
    assert [s for _, s, _, _ in before[:len(core.gates)]] == ["awaiting_replies"] * 2
    try:
        msg = wire.decode(frame)
    except ProtocolError:
        msg = None
    try:
        actions = core.on_frame("d:7000", frame, 0.0)
    except ProtocolError:
        assert not isinstance(msg, wire.ReadDone | wire.ReadFailed)  # replies are accepted
        assert state() == before and core.stale_replies == stale
        return
    assert isinstance(msg, wire.ReadDone | wire.ReadFailed), msg  # nothing else is
    assert actions == []
    if msg.layer_idx != 0:
        assert state() == before and core.stale_replies == stale + 1
    else:  # the one legitimate reply: the gates of layer 0 no longer wait for it
        assert all(not g.is_pending("d:7000") for g in core.gates.values())
        assert state() != before and core.stale_replies == stale


def test_ready_memory_is_bounded_by_the_bytes_received():  # W5, C1 (hostile peer)
    """A READY of the largest legal size, 1-byte ids (the worst case for growth), for
    requests Decode does not know yet: held while it waits (C1), the receiving process's
    peak RSS grows by under 4x the bytes in flight (decoding it whole once cost ~7x), and
    once it is answered it is back near its start. Measured in a child process, so nothing
    else this process holds counts (``sfa-rd2h bench`` measures three at once)."""
    from sfa_rd2h.runtime.tools.bench.micro import ready_memory

    mem = ready_memory(frames=1)
    assert mem["bytes"] > wire.MAX_FRAME_BYTES - (4 << 20)  # within 4 MiB of the limit
    assert mem["peak"] < 4 * mem["bytes"], mem
    assert mem["after"] < mem["bytes"] // 10, mem
