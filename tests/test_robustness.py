"""Bad input gets a clear answer and loses nothing (W5, S3): fuzzing the cores' inputs."""

from __future__ import annotations

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


@settings(max_examples=400, deadline=None)
@given(frames=st.lists(hostile_frames(), min_size=1, max_size=6))
def test_decode_answers_every_identifiable_layer_exactly_once(frames):
    core = _decode_core()
    for frame in frames:
        actions = core.on_frame("p0", frame, 0.0)  # never raises
        for a in actions:
            if isinstance(a, IssueRead):
                actions += core.read_result(a.read_id, 0, 0.0)
        replies = [wire.decode(a.payload) for a in actions if isinstance(a, Send)]
        replies = [r for r in replies if isinstance(r, wire.ReadDone | wire.ReadFailed)]
        layer = wire.layer_of(frame)
        if layer is None:
            assert replies == []
        elif not core.has_waiting_reads():
            # S3: one reply, for that layer, whatever was wrong with the rest of the frame
            assert [r.layer_idx for r in replies] == [layer]
    actions = core.tick(10.0)  # bounded waits end: no READY is left unanswered
    assert not core.has_waiting_reads()


@settings(max_examples=300, deadline=None)
@given(frame=hostile_frames())
def test_prefill_rejects_hostile_replies_without_changing_state(frame):
    core = PrefillCore(0, tp_mapping(1, 1), "p:1", {"l0": META}, block_size=4)
    core.add_request("r1", {"remote_host": "d", "remote_port": 7000, "remote_tp_size": 1},
                     [1], [1])
    core.schedule_chunk("r1", 4, True)
    core.begin_layer(0, 0.0)
    core.layer_landed(0, 0.0)
    core.on_frame("d:7000", wire.RAW_ACK, 0.0)
    before = [(g.state, set(g.pending)) for g in core.gates.values()]
    try:
        core.on_frame("d:7000", frame, 0.0)
    except ProtocolError:
        assert [(g.state, set(g.pending)) for g in core.gates.values()] == before
