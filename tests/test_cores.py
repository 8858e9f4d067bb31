"""The sans-IO cores, event by event, with concrete expected actions."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sfa_rd2h.spec import wire
from sfa_rd2h.spec.errors import ProtocolError
from sfa_rd2h.spec.layout import DestLayout
from sfa_rd2h.spec.topology import tp_mapping
from sfa_rd2h.statemachines.cores.actions import Disconnect, IssueRead, RequestReady, Send
from sfa_rd2h.statemachines.cores.decode import DecodeCore, DecodeLimits
from sfa_rd2h.statemachines.cores.prefill import LayerSendError, PrefillCore

MAIN, IDX = 16, 8


def layer_meta(base: int) -> wire.LayerMeta:
    return wire.LayerMeta((base, base + 4096, base + 8192), (MAIN, MAIN, IDX), (1, 1, 1),
                          (0, 0, 1), 2, True)


LAYERS = {"l0": layer_meta(0x10000), "l1": layer_meta(0x10000)}  # two layers, one slot
DEST = DestLayout((0x900000, 0x910000, 0x920000), (MAIN, MAIN, IDX), (64, 64, 64), 2, True,
                  False)
PARAMS = {"remote_host": "10.0.0.2", "remote_port": 30000, "remote_tp_size": 1}


def prefill(p_rank: int = 0, p_tp: int = 1) -> PrefillCore:
    return PrefillCore(p_rank, tp_mapping(p_tp, 1), f"10.0.0.1:{1000 + p_rank}", LAYERS,
                       block_size=4)


def decode(**kw) -> DecodeCore:
    return DecodeCore(0, 1, {"l0": DEST, "l1": DEST}, **kw)


def sends(actions) -> list[bytes]:
    return [a.payload for a in actions if isinstance(a, Send)]


def test_prefill_handshakes_once_then_sends_ready():  # W1, C4, P2
    p = prefill()
    assert p.add_request("r1", PARAMS, [5, 6, 7], [1, 2, 3]) == "10.0.0.2:30000"
    p.schedule_chunk("r1", 10, final=True)  # 10 tokens: 2 full blocks + 1 partial (C2)
    assert p.layer_writable(0)
    assert p.begin_layer(0, 0.0) == []
    [meta] = sends(p.layer_landed(0, 0.0))
    assert isinstance(wire.decode(meta), wire.MfMeta)  # READY held until the ACK
    [ready] = sends(p.on_frame("10.0.0.2:30000", wire.RAW_ACK, 0.0))
    msg = wire.decode(ready)
    assert msg == wire.ReadReadyBatch(0, "l0", (wire.ReadReq("r1", (5, 6, 7), (1, 2, 3), 0, 0),),
                                      (), 0, 1)
    assert not p.layer_writable(1)  # S1: layer 1 shares the slot and waits for the reply
    p.on_frame("10.0.0.2:30000", wire.encode(wire.ReadDone(0)), 0.0)
    assert p.layer_writable(1)


def test_duplicate_reply_is_stale_and_peer_loss_fails_the_gate():  # S5, S4
    p = prefill()
    p.add_request("r1", PARAMS, [5], [1])
    p.schedule_chunk("r1", 4, final=True)
    p.begin_layer(0, 0.0)
    p.layer_landed(0, 0.0)
    p.on_frame("10.0.0.2:30000", wire.RAW_ACK, 0.0)
    p.on_frame("10.0.0.2:30000", wire.encode(wire.ReadDone(0)), 0.0)
    p.on_frame("10.0.0.2:30000", wire.encode(wire.ReadDone(0)), 0.0)
    assert p.stale_replies == 1
    p.begin_layer(1, 0.0)
    [ready] = sends(p.layer_landed(1, 0.0))
    assert wire.decode(ready).done_ext_ids == ("r1",)
    p.peer_gone("10.0.0.2:30000", 1.0)
    with pytest.raises(LayerSendError, match="S4: layer 0 cannot be written.*S5: peer lost"):
        p.layer_writable(0)
    assert p.layer_writable(0)  # the error was observed once; the slot is usable again


def test_prefill_rejects_bad_params_and_malformed_replies():  # C1, W3
    p = prefill()
    with pytest.raises(ProtocolError, match="remote_port"):
        p.add_request("r1", {"remote_host": "h", "remote_tp_size": 1}, [1], [1])
    with pytest.raises(ProtocolError, match="T1"):
        p.add_request("r2", dict(PARAMS, remote_tp_size=2), [1], [1])
    p.add_request("r3", PARAMS, [1], [1])  # no remote_cached_tokens: defaults to 0 (fm 7)
    p.schedule_chunk("r3", 4, True)
    p.begin_layer(0, 0.0)
    p.layer_landed(0, 0.0)
    with pytest.raises(ProtocolError):
        p.on_frame("10.0.0.2:30000", b"\xc1garbage", 0.0)
    assert p.endpoints["10.0.0.2:30000"].session.state == "handshaking"  # unchanged


def test_version_mismatch_is_refused_at_handshake():  # F3
    d = decode()
    future = wire.MfMeta("p:1", LAYERS, wire.PROTOCOL_VERSION + 1, wire.LAYOUT_VERSION)
    [reply] = sends(d.on_frame("p0", wire.encode(future), 0.0))
    ack = wire.decode(reply)
    assert not ack.accepted and "protocol version 2 from prefill, decode speaks 1" in ack.error
    p = prefill()
    p.add_request("r1", PARAMS, [1], [1])
    p.schedule_chunk("r1", 4, True)
    p.begin_layer(0, 0.0)
    p.layer_landed(0, 0.0)
    p.on_frame("10.0.0.2:30000", reply, 0.0)
    assert p.endpoints["10.0.0.2:30000"].session.state == "refused"
    with pytest.raises(LayerSendError, match="F3"):
        p.layer_writable(1)


def ready(layer=0, reqs=(("r1", (5, 6), (1, 2), 0, 0),), done=(), member=0, ratio=1):
    return wire.encode(wire.ReadReadyBatch(layer, f"l{layer}",
                                           tuple(wire.ReadReq(*r) for r in reqs), done,
                                           member, ratio))


def test_decode_reads_once_and_replies_once():  # C4, S3, R1
    d = decode()
    d.register_request("r1", [10, 11, 12], [20, 21, 22], 0.0)
    assert sends(d.on_frame("p0", wire.encode(wire.MfMeta("10.0.0.1:1000", LAYERS)), 0.0)) \
        == [wire.RAW_ACK]  # a legacy 3-field MF_META gets the raw ACK
    [read] = d.on_frame("p0", ready(done=("r1",)), 0.0)
    assert isinstance(read, IssueRead) and read.session == "10.0.0.1:1000"
    # main K and V each coalesce to one run (ids 5,6 -> 10,11), indexer too (1,2 -> 20,21)
    assert read.plan.lengths.tolist() == [2 * MAIN, 2 * MAIN, 2 * IDX]
    assert read.plan.local_addrs.tolist()[0] == 0x900000 + 10 * MAIN
    actions = d.read_result(read.read_id, 0, 0.0)
    assert sends(actions) == [wire.encode(wire.ReadDone(0))]
    assert RequestReady("r1", True) in actions
    assert d.apply_agreement("r1", True)[0].ok


def test_decode_rejects_with_read_failed_and_leaves_destinations_alone():  # W1, L1, W5
    d = decode()
    d.register_request("r1", [10, 11], [20, 21], 0.0)
    [no_meta] = sends(d.on_frame("p0", ready(), 0.0))
    assert "W1" in wire.decode(no_meta).error
    d.on_frame("p0", wire.encode(wire.MfMeta("s", {
        "l0": wire.LayerMeta((0, 4096, 8192), (MAIN * 2, MAIN, IDX), (1, 1, 1), (0, 0, 1), 2,
                             True)})), 0.0)
    [mismatch] = sends(d.on_frame("p0", ready(), 0.0))
    assert "L1: main tensor 0" in wire.decode(mismatch).error
    bad = msgpack.packb([wire.READ_READY_BATCH, 1, "l1", [["r1", [-1], [], 0, 0]], [], 0, 1],
                        use_bin_type=True)
    [malformed] = sends(d.on_frame("p0", bad, 0.0))
    failed = wire.decode(malformed)
    assert failed.layer_idx == 1 and failed.error.startswith("W5")
    assert d.on_frame("p0", b"\x00\x01", 0.0) == []  # no layer to answer: counted, dropped
    assert d.stats.rejected_frames == 2
    assert d.local_outcome("r1") is False  # R5: the request failed once


def _read_positions(read: IssueRead, base: int, block: int) -> list[int]:
    """Destination block ids a plan writes in the region starting at ``base``."""
    out = []
    for addr, n in zip(read.plan.local_addrs.tolist(), read.plan.lengths.tolist(), strict=True):
        if base <= addr < base + 0x10000:
            first = (addr - base) // block
            out += list(range(first, first + n // block))
    return out


def test_decode_cuts_the_full_lists_it_is_sent():  # T2, T3, T5, T6
    main_ids, idx_ids = (40, 41, 42, 43), (50, 51, 52, 53)
    for member, want_main, want_idx in ((0, [10, 11, 12, 13], [20, 21]), (1, [], [22, 23])):
        d = decode()
        d.register_request("r1", [10, 11, 12, 13], [20, 21, 22, 23], 0.0)
        d.on_frame("p", wire.encode(wire.MfMeta("s", LAYERS)), 0.0)
        [read] = d.on_frame("p", ready(reqs=(("r1", main_ids, idx_ids, 0, 0),), member=member,
                                       ratio=2), 0.0)
        assert _read_positions(read, 0x900000, MAIN) == want_main
        assert _read_positions(read, 0x920000, IDX) == want_idx
    # Two Decode ranks sharing the main pool each read their piece; with per-rank caches the
    # rank reads the whole main range.
    pieces = []
    for d_rank, shared in ((0, True), (1, True), (1, False)):
        d = DecodeCore(d_rank, 2, {"l0": DEST, "l1": DEST}, main_dest_shared=shared)
        d.register_request("r1", [10, 11, 12, 13], [20, 21, 22, 23], 0.0)
        d.on_frame("p", wire.encode(wire.MfMeta("s", LAYERS)), 0.0)
        [read] = d.on_frame("p", ready(reqs=(("r1", main_ids, idx_ids, 0, 0),)), 0.0)
        pieces.append(_read_positions(read, 0x900000, MAIN))
    assert pieces == [[10, 11], [12, 13], [10, 11, 12, 13]]


@pytest.mark.parametrize(("entry", "member", "error"), [
    # member 0 reads main: the whole range must fit, even where this rank reads a piece
    (("r2", (1, 2, 3), (1,), 2, 0), 0, "L1: main destination range [2, 5) outside the 4 "
                                        "registered blocks"),
    (("r2", (1,), (1, 2), 0, 3), 0, "L1: indexer destination range [3, 5) outside the 4 "
                                     "registered blocks"),
    # member 1 reads no main, so only where its main range starts is checked
    (("r2", (1, 2, 3), (1,), 4, 0), 1, None),
    (("r2", (1,), (1,), 5, 0), 1, "L1: main destination range [5, 5) outside the 4 "
                                   "registered blocks"),
])
def test_a_destination_range_past_the_registered_blocks_fails_the_layer(
        entry: tuple, member: int, error: str | None) -> None:  # L1
    """The first entry whose range leaves its request's registered blocks names the
    layer's READ_FAILED, and nothing of the layer is read; a valid entry before it
    does not hide it."""
    d = decode()
    d.register_request("r1", [10, 11], [20, 21], 0.0)
    d.register_request("r2", [30, 31, 32, 33], [40, 41, 42, 43], 0.0)
    d.on_frame("p", wire.encode(wire.MfMeta("s", LAYERS)), 0.0)
    actions = d.on_frame("p", ready(reqs=(("r1", (1, 2), (1, 2), 0, 0), entry),
                                    member=member, ratio=2), 0.0)
    reads = [a for a in actions if isinstance(a, IssueRead)]
    if error is None:
        assert len(reads) == 1 and not sends(actions)
        return
    assert not reads
    [reply] = sends(actions)
    assert wire.decode(reply).error == error


def test_an_entry_without_blocks_is_a_no_op_for_this_rank():  # T6, T4, S3
    """As the upstream Decode does: an entry with both lists empty is skipped (nothing read
    for it, nothing failed), the other entries of its READY are read as usual, and a READY
    of such entries alone is still answered READ_DONE so Prefill's slot is reused."""
    d = decode()
    d.register_request("r1", [10, 11], [20, 21], 0.0)
    d.register_request("r2", [30, 31], [40, 41], 0.0)
    d.on_frame("p", wire.encode(wire.MfMeta("s", LAYERS)), 0.0)
    [read] = d.on_frame("p", ready(reqs=(("r1", (), (), 0, 0), ("r2", (5,), (6,), 0, 0))),
                        0.0)
    assert _read_positions(read, 0x900000, MAIN) == [30]  # main K of r2 only
    assert _read_positions(read, 0x920000, IDX) == [40]
    assert sends(d.read_result(read.read_id, 0, 0.0)) == [wire.encode(wire.ReadDone(0))]
    actions = d.on_frame("p", ready(layer=1, reqs=(("r1", (), (), 0, 0),), done=("r1",)), 0.0)
    assert sends(actions) == [wire.encode(wire.ReadDone(1))]
    assert not any(isinstance(a, IssueRead) for a in actions)
    assert RequestReady("r1", True) in actions  # its final counted, nothing failed it
    assert d.local_outcome("r2") is None  # still registered, waiting for its final
    assert d.stats.replies == {"done": 2, "failed": 0}


def test_an_entry_without_blocks_waits_for_nothing_but_keeps_its_range_checked():  # T6, L1, C1
    """An empty entry of a request Decode does not know needs no destinations, so its
    READY is answered at once instead of waiting (C1) for them; skipping an empty entry
    is no licence for a malformed one: its destination start is still checked."""
    d = decode(destination_wait=1.0)
    d.register_request("r1", [10, 11], [20, 21], 0.0)
    d.on_frame("p", wire.encode(wire.MfMeta("s", LAYERS)), 0.0)
    actions = d.on_frame("p", ready(reqs=(("r9", (), (), 0, 0),)), 0.0)
    assert actions == [Send("p", wire.encode(wire.ReadDone(0)))]
    assert not d.has_waiting_reads() and d.stats.skipped_entries == 1
    [reply] = sends(d.on_frame("p", ready(reqs=(("r1", (), (), 3, 0),)), 0.0))
    assert wire.decode(reply).error == ("L1: main destination range [3, 3) outside the 2 "
                                        "registered blocks")


def test_every_mf_meta_is_answered():  # W1, F3
    d = decode()
    [refusal] = sends(d.on_frame("p", msgpack.packb([wire.MF_META, "s", b"junk", 1, 0, 1],
                                                    use_bin_type=True), 0.0))
    ack = wire.decode_meta_reply(refusal)
    assert not ack.accepted and "layer metadata" in ack.error
    [pp] = sends(d.on_frame("p", wire.encode(wire.MfMeta("s", LAYERS, 1, None, 0, 2)), 0.0))
    assert "X3" in wire.decode_meta_reply(pp).error
    assert "p" not in d.connections
    [ok] = sends(d.on_frame("p", wire.encode(wire.MfMeta("s", LAYERS, 1)), 0.0))
    assert ok == msgpack.packb([b"mf_meta_ack", 1], use_bin_type=True)


def test_prefill_sends_every_member_the_full_chunk():  # T6
    payloads = []
    for p_rank in (0, 1):
        p = PrefillCore(p_rank, tp_mapping(2, 1), f"10.0.0.1:{1000 + p_rank}", LAYERS,
                        block_size=4)
        p.add_request("r1", PARAMS, [5, 6, 7], [1, 2, 3])
        p.schedule_chunk("r1", 10, final=True)
        p.begin_layer(0, 0.0)
        [meta] = p.layer_landed(0, 0.0)
        [ready_frame] = sends(p.on_frame(meta.peer, wire.RAW_ACK, 0.0))
        payloads.append(wire.decode(ready_frame))
    for member, msg in enumerate(payloads):
        assert msg.group_member_idx == member and msg.tp_ratio == 2
        assert msg.read_reqs == (wire.ReadReq("r1", (5, 6, 7), (1, 2, 3), 0, 0),)


def test_prefill_refuses_an_ack_of_another_version():  # F3 on the Prefill side
    p = prefill()
    p.add_request("r1", PARAMS, [5], [1])
    p.schedule_chunk("r1", 2, final=True)
    p.begin_layer(0, 0.0)
    [meta] = p.layer_landed(0, 0.0)
    p.on_frame(meta.peer, msgpack.packb([b"mf_meta_ack", 2], use_bin_type=True), 0.0)
    assert p.endpoints[meta.peer].session.state == "refused"
    with pytest.raises(LayerSendError, match="protocol version 2"):
        p.layer_writable(0)


def test_decode_waits_for_late_registration_and_expires():  # C1 (known failure 5)
    d = decode(destination_wait=5.0)
    d.on_frame("p0", wire.encode(wire.MfMeta("s", LAYERS)), 0.0)
    assert d.on_frame("p0", ready(), 0.0) == []
    assert d.next_deadline() == 5.0
    [read] = d.register_request("r1", [10, 11], [20, 21], 1.0)
    assert isinstance(read, IssueRead)
    assert d.on_frame("p0", ready(reqs=(("r2", (1,), (1,), 0, 0),)), 2.0) == []
    # r2 never came: it alone fails (R5), and the READY, with nothing else to read, is done
    assert sends(d.tick(7.0)) == [wire.encode(wire.ReadDone(0))]
    d.register_request("r2", [1], [1], 8.0)
    assert d.local_outcome("r2") is False  # it was failed before it was registered


def test_a_request_that_never_registers_fails_alone():  # C1, R5, S3
    """A READY naming a registered request and one whose destinations never come (its
    client left before Decode admitted it, Prefill dispatched early): when the wait ends,
    the registered one is read and completes; only the missing one fails."""
    d = decode(destination_wait=5.0)
    d.register_request("r1", [10, 11], [20, 21], 0.0)
    d.on_frame("p0", wire.encode(wire.MfMeta("s", LAYERS)), 0.0)
    both = (("r1", (5, 6), (1, 2), 0, 0), ("r2", (7,), (3,), 0, 0))
    assert d.on_frame("p0", ready(reqs=both, done=("r1", "r2")), 0.0) == []
    [read] = d.tick(5.0)
    assert isinstance(read, IssueRead)
    assert _read_positions(read, 0x900000, MAIN) == [10, 11]
    actions = d.read_result(read.read_id, 0, 5.1)
    assert sends(actions) == [wire.encode(wire.ReadDone(0))]
    assert d.local_outcome("r1") is True
    d.register_request("r2", [30], [31], 6.0)
    assert d.local_outcome("r2") is False


def test_a_request_ended_unallocated_is_awaited_no_more():  # C1, C3, R5
    """Prefill dispatched early sends READYs for a request that Decode's vLLM then ends
    before allocating it: the waiting READY is answered at once, its entry skipped, and
    so is a later one; a registered request is not forgotten."""
    d = decode(destination_wait=5.0)
    d.register_request("r1", [10, 11], [20, 21], 0.0)
    d.on_frame("p0", wire.encode(wire.MfMeta("s", LAYERS)), 0.0)
    assert d.on_frame("p0", ready(reqs=(("r2", (1,), (1,), 0, 0),)), 0.0) == []
    assert sends(d.forget_unregistered("r2", 1.0)) == [wire.encode(wire.ReadDone(0))]
    assert not d.has_waiting_reads()
    assert sends(d.on_frame("p0", ready(1, reqs=(("r2", (1,), (1,), 0, 0),)), 1.0)) == [
        wire.encode(wire.ReadDone(1))]
    assert d.stats.skipped_entries == 2
    assert d.forget_unregistered("r1", 1.0) == [] and "r1" in d.requests
    with pytest.raises(ProtocolError, match="C1: request 'r2' is already registered"):
        d.register_request("r2", [1], [1], 2.0)


def test_zero_block_member_still_acknowledges():  # T4, S3
    d = decode()
    d.register_request("r1", [10, 11], [20, 21], 0.0)
    d.on_frame("p1", wire.encode(wire.MfMeta("s", LAYERS)), 0.0)
    # A one-block chunk: member 1 of 2 reads no main (T2) and its indexer piece is empty
    # (T3), yet it answers READ_DONE and nothing is read (T4).
    actions = d.on_frame("p1", ready(reqs=(("r1", (5,), (6,), 0, 0),), member=1, ratio=2), 0.0)
    assert sends(actions) == [wire.encode(wire.ReadDone(0))]
    assert not any(isinstance(a, IssueRead) for a in actions)


def test_conflicting_ratios_fail_the_request():  # R1, T1 (known failure 3)
    d = decode()
    d.register_request("r1", [10, 11], [20, 21], 0.0)
    for peer in ("p0", "p1"):
        d.on_frame(peer, wire.encode(wire.MfMeta("s", LAYERS)), 0.0)
    d.on_frame("p0", ready(reqs=(("r1", (5,), (6,), 0, 0),), member=1, ratio=2), 0.0)
    d.on_frame("p1", ready(reqs=(("r1", (5,), (6,), 0, 0),), done=("r1",), member=0, ratio=1),
               0.0)
    assert d.local_outcome("r1") is False
    assert "tp_ratio=1" in d.requests["r1"].status.error


def test_local_completion_stands_once_reached():  # R2, R5
    d = decode()
    d.register_request("r1", [10, 11], [20, 21], 0.0)
    for peer in ("p0", "p1"):
        d.on_frame(peer, wire.encode(wire.MfMeta("s", LAYERS)), 0.0)
    d.on_frame("p0", ready(reqs=(), done=("r1",), member=0, ratio=1), 0.0)
    assert d.local_outcome("r1") is True  # may already be on its way to the TP group
    late = d.on_frame("p1", ready(reqs=(("r1", (5,), (5,), 0, 0),), done=("r1",), member=1,
                                  ratio=2), 0.0)
    assert not any(isinstance(a, IssueRead) for a in late)  # no write after completion
    assert d.local_outcome("r1") is True and d.stats.skipped_entries == 1


def test_a_later_ready_never_overtakes_one_still_waiting_for_the_same_request():  # C1, R1
    """Layer 0's READY names x and z and waits for z's destinations; another peer's READY
    naming z is refused, which is failure evidence for z; then the final layer's READY
    names x and z. It must wait behind layer 0's, not be served at once because z counts as
    failed now: served, x would be final, and reported complete, with layer 0 never read.
    When layer 0's wait expires, both are served, in order."""
    d = decode(destination_wait=1.0)
    d.register_request("x", [10, 11], [20, 21], 0.0)
    for peer in ("p0", "p1"):
        d.on_frame(peer, wire.encode(wire.MfMeta("s", LAYERS)), 0.0)
    both = (("x", (5,), (1,), 0, 0), ("z", (6,), (2,), 0, 0))
    assert d.on_frame("p0", ready(layer=0, reqs=both), 0.0) == []  # waits for z (C1)
    refused = wire.encode(wire.ReadReadyBatch(0, "l9", (wire.ReadReq("z", (6,), (2,)),), ()))
    assert isinstance(wire.decode(sends(d.on_frame("p1", refused, 0.1))[0]), wire.ReadFailed)
    assert d.on_frame("p0", ready(layer=1, reqs=both, done=("x",)), 0.2) == []  # behind it
    reads = [a for a in d.tick(1.5) if isinstance(a, IssueRead)]
    assert len(reads) == 2
    assert sends(d.read_result(reads[0].read_id, 0, 1.6)) == [wire.encode(wire.ReadDone(0))]
    assert d.local_outcome("x") is None  # layer 1, the final, not yet read
    last = d.read_result(reads[1].read_id, 0, 1.6)
    assert sends(last) == [wire.encode(wire.ReadDone(1))] and RequestReady("x", True) in last


def test_a_read_that_fails_after_every_final_still_fails_the_request():  # R5, F2, R1
    """Ratio 2: member 1's layer-0 read (its indexer piece, T2) is still in flight when
    both members' finals have come (member 1's last READY names no block here), so the
    request is locally complete but not yet reported (a read writes into it). That read
    then fails: the request fails. Before, it was reported ok with a block never written."""
    d = decode()
    d.register_request("r1", [10, 11], [20, 21], 0.0)
    for peer in ("p0", "p1"):
        d.on_frame(peer, wire.encode(wire.MfMeta("s", LAYERS)), 0.0)
    entry = (("r1", (5, 6), (1, 2), 0, 0),)
    [late] = d.on_frame("p1", ready(reqs=entry, member=1, ratio=2), 0.0)
    assert isinstance(late, IssueRead)
    for layer in (0, 1):
        [read] = d.on_frame("p0", ready(layer=layer, reqs=entry, member=0, ratio=2,
                                        done=("r1",) if layer else ()), 0.0)
        assert RequestReady("r1", True) not in d.read_result(read.read_id, 0, 0.0)
    d.on_frame("p1", ready(layer=1, reqs=(), done=("r1",), member=1, ratio=2), 0.0)
    assert d.requests["r1"].status.state == "local_ok" and d.local_outcome("r1") is None
    actions = d.read_result(late.read_id, 7, 0.0)
    assert sends(actions) == [wire.encode(wire.ReadFailed(0, "F2: batched read returned 7"))]
    assert RequestReady("r1", False) in actions and d.local_outcome("r1") is False
    assert "F2" in d.requests["r1"].status.error


def test_next_step_may_be_scheduled_before_the_last_layer_lands():  # C2, C4
    p = prefill()
    p.add_request("r1", PARAMS, [5, 6, 7], [1, 2, 3])
    p.schedule_chunk("r1", 4, final=False)  # step 1: block 0
    for layer in (0, 1):
        if layer == 1:
            p.on_frame("10.0.0.2:30000", wire.RAW_ACK, 0.0)
            p.on_frame("10.0.0.2:30000", wire.encode(wire.ReadDone(0)), 0.0)
        p.begin_layer(layer, 0.0)
        if layer == 0:
            p.layer_landed(0, 0.0)
    p.schedule_chunk("r1", 10, final=True)  # step 2 planned while layer 1 is in flight
    [ready] = sends(p.layer_landed(1, 0.0))
    assert wire.decode(ready).read_reqs[0].p_main_block_ids == (5,)  # still step 1's chunk
    assert p.requests["r1"].chunk == (1, 3)


def test_finished_request_is_no_longer_published():  # C2
    p = prefill()
    p.add_request("r1", PARAMS, [5, 6], [1, 2])
    p.add_request("r2", PARAMS, [7], [3])
    for ext in ("r1", "r2"):
        p.schedule_chunk(ext, 4, final=False)
    p.begin_layer(0, 0.0)
    assert p.finish_request("r2") and not p.finish_request("r2")
    p.layer_landed(0, 0.0)
    [ready] = sends(p.on_frame("10.0.0.2:30000", wire.RAW_ACK, 0.0))
    assert [e.ext_req_id for e in wire.decode(ready).read_reqs] == ["r1", "r2"]  # planned
    p.on_frame("10.0.0.2:30000", wire.encode(wire.ReadDone(0)), 0.0)
    p.begin_layer(1, 0.0)
    [ready] = sends(p.layer_landed(1, 0.0))
    assert [e.ext_req_id for e in wire.decode(ready).read_reqs] == ["r1"]


def test_tombstones_are_bounded():  # R5 memory on a long-running Decode
    d = decode(limits=DecodeLimits(tombstones=3))
    for i in range(5):
        d.register_request(f"r{i}", [i], [i], 0.0)
        d.on_frame("p0", wire.encode(wire.MfMeta("s", LAYERS)), 0.0)
        d.on_frame("p0", ready(reqs=(), done=(f"r{i}",)), 0.0)
        d.apply_agreement(f"r{i}", True)
    assert list(d.terminal) == ["r2", "r3", "r4"]


def _early_failure(d: DecodeCore, ext: str, peer: str = "p0") -> None:
    """A READY for an unregistered request that fails at once (layout mismatch, L1)."""
    bad = {"l0": wire.LayerMeta((0, 4096, 8192), (MAIN * 2, MAIN, IDX), (1, 1, 1), (0, 0, 1),
                                2, True)}
    d.on_frame(peer, wire.encode(wire.MfMeta("s", bad)), 0.0)
    [reply] = sends(d.on_frame(peer, ready(reqs=((ext, (5,), (6,), 0, 0),)), 0.0))
    assert isinstance(wire.decode(reply), wire.ReadFailed)


def test_failure_evidence_survives_a_flood_of_other_failures():  # R5 (hostile peer)
    d = decode(limits=DecodeLimits(early_failures=4))
    _early_failure(d, "victim")
    for i in range(200):  # far past the exact table: the rest go to the hashed set
        _early_failure(d, f"flood-{i}")
    d.register_request("victim", [10, 11], [20, 21], 0.0)
    assert d.local_outcome("victim") is False  # the evidence was not evicted
    d.register_request("flood-150", [12], [22], 0.0)
    assert d.local_outcome("flood-150") is False
    assert "early failures at once" in d.requests["flood-150"].status.error


def test_a_peer_without_mf_meta_cannot_fail_or_poison_requests():  # W1, R5
    d = decode()
    d.register_request("r1", [10, 11], [20, 21], 0.0)
    [reply] = sends(d.on_frame("rogue", ready(reqs=(("r1", (5,), (6,), 0, 0),
                                                    ("r2", (5,), (6,), 0, 0))), 0.0))
    assert "W1" in wire.decode(reply).error
    assert d.requests["r1"].status.state == "registered"  # still served normally
    d.register_request("r2", [12], [22], 0.0)
    assert d.requests["r2"].status.state == "registered"  # no tombstone from the rogue


def test_waiting_readys_are_bounded_by_count_and_bytes():  # C1 (hostile peer)
    d = decode(limits=DecodeLimits(waiting_readys=2, waiting_bytes=10_000))
    d.on_frame("p0", wire.encode(wire.MfMeta("s", LAYERS)), 0.0)
    assert d.on_frame("p0", ready(reqs=(("a", (1,), (1,), 0, 0),)), 0.0) == []
    assert d.on_frame("p0", ready(reqs=(("b", (1,), (1,), 0, 0),)), 0.0) == []
    [refused] = sends(d.on_frame("p0", ready(reqs=(("c", (1,), (1,), 0, 0),)), 0.0))
    assert "limit is 2 READYs" in wire.decode(refused).error
    big = ready(reqs=(("d", tuple(range(3000)), (), 0, 0),))
    d2 = decode(limits=DecodeLimits(waiting_bytes=len(big) - 1))
    d2.on_frame("p0", wire.encode(wire.MfMeta("s", LAYERS)), 0.0)
    [refused] = sends(d2.on_frame("p0", big, 0.0))
    assert "bytes" in wire.decode(refused).error
    # A waiting READY keeps its frame, not the decoded message.
    assert [r.msg for r in d.waiting_reads()] == [None, None]
    [read] = d.register_request("a", [10], [20], 1.0)
    assert isinstance(read, IssueRead)


def test_connection_table_is_bounded_and_keeps_only_known_layers():  # W1 (hostile peers)
    d = decode(limits=DecodeLimits(connections=2, connection_idle=60.0))
    junk = dict(LAYERS, **{f"junk{i}": layer_meta(0x10000) for i in range(50)})
    for peer in ("p0", "p1"):
        [ack] = sends(d.on_frame(peer, wire.encode(wire.MfMeta("s", junk, 1)), 0.0))
        assert wire.decode_meta_reply(ack).accepted
    assert set(d.connections["p0"].layers) == {"l0", "l1"}
    [full] = sends(d.on_frame("p2", wire.encode(wire.MfMeta("s", LAYERS, 1)), 30.0))
    assert "limit of 2" in wire.decode_meta_reply(full).error
    d.on_frame("p1", ready(reqs=()), 50.0)  # p1 is active; p0 idles
    [ok] = sends(d.on_frame("p2", wire.encode(wire.MfMeta("s", LAYERS, 1)), 70.0))
    assert wire.decode_meta_reply(ok).accepted
    assert set(d.connections) == {"p1", "p2"}


def test_cost_per_event_does_not_grow_with_waiting_readys():  # issue: bound the work
    # Count machine work instead of timing it: a registration touches only its own READY,
    # and a tick before any deadline touches nothing.
    fired: list[tuple] = []
    d = decode(limits=DecodeLimits(waiting_readys=100_000, waiting_bytes=1 << 30),
               observer=lambda *a: fired.append(a))
    d.on_frame("p0", wire.encode(wire.MfMeta("s", LAYERS)), 0.0)
    for i in range(20_000):
        d.on_frame("p0", ready(reqs=((f"w{i}", (1,), (1,), 0, 0),)), 0.0)
    fired.clear()
    d.register_request("w7", [10], [20], 1.0)
    assert len(fired) <= 3  # the request's start, its READY's destinations_arrived, accept
    fired.clear()
    assert d.tick(2.0) == [] and fired == []
    assert len(sends(d.tick(11.0))) == 19_999  # every other READY expires now, once




def test_prefill_replaces_the_connection_of_a_peer_that_timed_out():  # S5, W1
    p = PrefillCore(0, tp_mapping(1, 1), "10.0.0.1:1000", LAYERS, block_size=4,
                    reply_timeout=5.0)
    p.add_request("r1", PARAMS, [5], [1])
    p.schedule_chunk("r1", 2, final=True)
    p.begin_layer(0, 0.0)
    [meta] = p.layer_landed(0, 0.0)
    p.on_frame(meta.peer, wire.RAW_ACK, 0.0)
    assert p.tick(4.9) == []
    [gone] = p.tick(5.0)
    assert gone == Disconnect(meta.peer, "no reply within 5.0s")
    assert p.endpoints[meta.peer].session.state == "disconnected"


def test_an_engine_that_raises_fails_the_read():  # F2
    d = decode()
    d.register_request("r1", [10, 11], [20, 21], 0.0)
    d.on_frame("p0", wire.encode(wire.MfMeta("s", LAYERS)), 0.0)
    [read] = d.on_frame("p0", ready(done=("r1",)), 0.0)
    [reply, *rest] = d.read_result(read.read_id, RuntimeError("device lost"), 0.0)
    failed = wire.decode(reply.payload)
    assert isinstance(failed, wire.ReadFailed)
    assert failed.error == "F2: transfer engine raised RuntimeError: device lost"
    assert d.local_outcome("r1") is False
    # Only an exact 0 is success: True (== 1 to Python) and False (== 0) are not results.
    d.register_request("r2", [12], [22], 0.0)
    [read] = d.on_frame("p0", ready(reqs=(("r2", (5,), (1,), 0, 0),), done=("r2",)), 0.0)
    [reply, *rest] = d.read_result(read.read_id, False, 0.0)  # type: ignore[arg-type]
    assert isinstance(wire.decode(reply.payload), wire.ReadFailed)


def test_prefill_block_table_grows_with_chunked_prefill():  # C2
    p = prefill()
    p.add_request("r1", PARAMS, [5], [1])
    with pytest.raises(ProtocolError, match="outside"):
        p.schedule_chunk("r1", 10, final=True)  # 3 blocks, only 1 allocated so far
    p.extend_request("r1", [6, 7], [2, 3])
    p.schedule_chunk("r1", 10, final=True)
    assert p.requests["r1"].chunk == (0, 3)
    assert p.requests["r1"].main_ids.tolist() == [5, 6, 7]
    with pytest.raises(ProtocolError, match="C2: request 'nope' is not tracked"):
        p.extend_request("nope", [1], [1])


def test_decode_abort_fails_a_waiting_request_once():  # C1, R1, R5
    d = decode()
    d.register_request("r1", [10, 11], [20, 21], 0.0)
    [ready_action] = d.abort_request("r1", "vLLM aborted it", 1.0)
    assert ready_action == RequestReady("r1", False)
    assert d.abort_request("r1", "again", 2.0) == []
    assert d.abort_request("unknown", "x", 2.0) == []
    assert "C1: vLLM aborted it" in d.requests["r1"].status.error


def test_a_read_that_ends_past_its_budget_is_refused():  # S6, S5
    d = decode(read_budget=30.0)
    d.register_request("r1", [10, 11], [20, 21], 0.0)
    d.on_frame("p0", wire.encode(wire.MfMeta("10.0.0.1:1000", LAYERS)), 0.0)
    [read] = d.on_frame("p0", ready(done=("r1",)), 100.0)
    # The engine reports every byte landed, but Prefill gave up on this reader after its
    # reply timeout and may have rewritten the slot during the copy.
    actions = d.read_result(read.read_id, 0, 131.0)
    [reply] = sends(actions)
    failed = wire.decode(reply)
    assert isinstance(failed, wire.ReadFailed) and failed.error.startswith("S6: ")
    assert RequestReady("r1", False) in actions  # R5: the request fails, once
    with pytest.raises(ProtocolError, match="S6: destination_wait=40 must be below"):
        decode(destination_wait=40.0, read_budget=30.0)


def test_prefill_never_reports_final_where_it_gave_up_on_a_layer():  # S7, S5, R1
    two_slots = {"l0": layer_meta(0x10000), "l1": layer_meta(0x20000)}
    p = PrefillCore(0, tp_mapping(1, 1), "10.0.0.1:1000", two_slots, block_size=4)
    ep = "10.0.0.2:30000"
    p.add_request("r1", PARAMS, [5], [1])
    p.add_request("r2", dict(PARAMS, remote_host="10.0.0.3"), [6], [2])
    p.schedule_chunk("r1", 4, final=True)
    p.schedule_chunk("r2", 4, final=True)
    p.begin_layer(0, 0.0)
    p.layer_landed(0, 0.0)
    p.on_frame(ep, wire.RAW_ACK, 0.0)
    p.on_frame("10.0.0.3:30000", wire.RAW_ACK, 0.0)
    p.on_frame("10.0.0.3:30000", wire.encode(wire.ReadDone(0)), 0.0)
    p.begin_layer(1, 60.0)  # planned (other slot) while r1's layer-0 READY is unanswered
    [gone] = p.tick(60.0)  # S5: no reply within the reply timeout
    assert gone == Disconnect(ep, "no reply within 60.0s")
    with pytest.raises(LayerSendError):
        p.layer_writable(0)
    frames = [wire.decode(f) for f in sends(p.layer_landed(1, 60.0))]
    # The final layer goes to the other endpoint as planned; r1's endpoint gets nothing
    # that could make Decode complete r1 without the layer it never read.
    assert [(m.layer_idx, m.done_ext_ids) for m in frames
            if isinstance(m, wire.ReadReadyBatch)] == [(1, ("r2",))]
    assert not any(isinstance(m, wire.MfMeta) for m in frames)


def test_a_replayed_final_ready_reads_nothing_again():  # R4, S1
    """The original was read; by the time a replay arrives the slot may hold other KV."""
    d = decode()
    d.register_request("r1", [10, 11], [20, 21], 0.0)
    d.on_frame("p0", wire.encode(wire.MfMeta("10.0.0.1:1000", LAYERS)), 0.0)
    final = ready(layer=1, done=("r1",), member=0, ratio=2)  # member 1 still outstanding
    [read] = d.on_frame("p0", final, 0.0)
    assert isinstance(read, IssueRead) and len(read.plan) > 0
    d.read_result(read.read_id, 0, 0.0)
    replay = d.on_frame("p0", final, 1.0)
    assert not any(isinstance(a, IssueRead) for a in replay)
    assert sends(replay) == [wire.encode(wire.ReadDone(1))]  # still one reply per READY (S3)
    assert d.requests["r1"].status.state == "registered"  # and it advanced nothing (R4)


def test_an_unacknowledged_handshake_gives_up_in_seconds():  # S5, W1 (hung Decode)
    p = PrefillCore(0, tp_mapping(1, 1), "10.0.0.1:1000", LAYERS, block_size=4,
                    reply_timeout=60.0, handshake_timeout=5.0)
    p.add_request("r1", PARAMS, [5], [1])
    p.schedule_chunk("r1", 4, final=True)
    p.begin_layer(0, 100.0)
    [meta] = sends(p.layer_landed(0, 100.0))  # the READY waits for the ack
    assert p.next_deadline() == 105.0
    assert p.tick(104.9) == []
    [gone] = p.tick(105.0)
    assert gone == Disconnect("10.0.0.2:30000", "MF_META not acknowledged within 5.0s")
    with pytest.raises(LayerSendError, match="S5: MF_META not acknowledged"):
        p.layer_writable(0)
    assert p.next_deadline() is None  # nothing is held any more


def _reference_layer(entries: list[tuple], dests: list[tuple[list[int], list[int]]],
                     member: int, ratio: int, d_rank: int, d_tp: int,
                     shared: bool, owns: list[tuple[int, int]] | None = None,
                     ) -> tuple[list[int], list[int], list[int]] | str:
    """What one layer of ``entries`` reads, entry by entry with the single-entry cut less
    the positions below each request's own prefix (C5), or the first L1 refusal in the
    order the core names it (T2, T3, T5, T6, L1)."""
    from sfa_rd2h.spec.errors import LayoutError
    from sfa_rd2h.spec.layout import plan_layer_reads
    from sfa_rd2h.spec.topology import decode_cut

    pairs: list[list[int]] = [[], [], [], []]
    owns = owns or [(0, 0)] * len(entries)
    for (_, main, idx, m_start, i_start), (m_dest, i_dest), (own_m, own_i) in zip(
            entries, dests, owns, strict=True):
        cut = decode_cut(len(main), len(idx), m_start, i_start, member, ratio, d_rank, d_tp,
                         main_shared=shared)
        (m_lo, m_hi), (i_lo, i_hi) = cut.main, cut.indexer
        m_lo = min(max(m_lo, own_m - m_start), m_hi)
        i_lo = min(max(i_lo, own_i - i_start), i_hi)
        checks = [("main", m_start, m_start + len(main), len(m_dest))] if member == 0 else []
        checks.append(("main", m_start + m_lo, m_start + m_hi, len(m_dest)))
        if idx:
            checks += [("indexer", i_start, i_start + len(idx), len(i_dest)),
                       ("indexer", i_start + i_lo, i_start + i_hi, len(i_dest))]
        for what, lo, hi, size in checks:
            if lo < 0 or hi > size:
                return (f"L1: {what} destination range [{lo}, {hi}) outside the {size} "
                        "registered blocks")
        pairs[0] += main[m_lo:m_hi]
        pairs[1] += m_dest[m_start + m_lo:m_start + m_hi]
        pairs[2] += idx[i_lo:i_hi]
        pairs[3] += i_dest[i_start + i_lo:i_start + i_hi]
    try:
        plan = plan_layer_reads(LAYERS["l0"], DEST, *pairs)
    except LayoutError as exc:
        return str(exc)
    return plan.local_addrs.tolist(), plan.peer_addrs.tolist(), plan.lengths.tolist()


def _served(d: DecodeCore, layer: int, reqs: tuple, member: int, ratio: int):  # type: ignore[no-untyped-def]
    actions = d.on_frame("p", ready(layer, reqs, member=member, ratio=ratio), 0.0)
    reads = [a for a in actions if isinstance(a, IssueRead)]
    if not reads:  # refused, or nothing to read: answered at once
        [reply] = sends(actions)
        answer = wire.decode(reply)
        return (([], [], []) if isinstance(answer, wire.ReadDone) else answer.error), actions
    [read] = reads
    plan = read.plan
    return ((plan.local_addrs.tolist(), plan.peer_addrs.tolist(), plan.lengths.tolist()),
            d.read_result(read.read_id, 0, 0.0))


@given(data=st.data(), ratio=st.sampled_from([1, 2]), d_tp=st.sampled_from([1, 2]),
       shared=st.booleans())
@settings(max_examples=200, deadline=None)
def test_a_layer_reads_what_its_entries_cut_one_by_one_would_read(  # T2, T3, T5, T6, L1, C4
        data: st.DataObject, ratio: int, d_tp: int, shared: bool) -> None:
    """The whole layer is cut, range-checked and planned in one pass (main and indexer
    joined): the same plan, or the same first L1 refusal, as cutting and checking each
    entry alone, dropping what lies below the request's own prefix (C5), and planning
    their pieces; and the next layer of the same requests, which reuses the joined and
    proved destinations, reads the same again."""
    member, d_rank = data.draw(st.integers(0, ratio - 1)), data.draw(st.integers(0, d_tp - 1))
    pool = data.draw(st.sampled_from([8, 64]))  # a small pool makes requests share blocks
    ids = st.lists(st.integers(0, 63), max_size=4)
    entries, dests = [], []
    for i in range(data.draw(st.integers(1, 4))):
        entries.append((f"r{i}", data.draw(ids), data.draw(ids), data.draw(st.integers(0, 5)),
                        data.draw(st.integers(0, 5))))
        dests.append(tuple(data.draw(st.lists(st.integers(0, pool - 1), max_size=6,
                                              unique=True)) for _ in range(2)))
    owns = [(data.draw(st.integers(0, len(m))), data.draw(st.integers(0, len(i))))
            if data.draw(st.booleans()) else (0, 0) for m, i in dests]
    d = DecodeCore(d_rank, d_tp, {"l0": DEST, "l1": DEST}, main_dest_shared=shared)
    for (ext, *_), (m_dest, i_dest), (own_m, own_i) in zip(entries, dests, owns, strict=True):
        d.register_request(ext, m_dest, i_dest, 0.0, own_main=own_m, own_indexer=own_i)
    d.on_frame("p", wire.encode(wire.MfMeta("s", LAYERS)), 0.0)
    want = _reference_layer(entries, dests, member, ratio, d_rank, d_tp, shared, owns)
    first, _ = _served(d, 0, tuple(entries), member, ratio)
    assert first == want
    if not isinstance(want, str):  # a refused layer fails its requests: no second layer
        second, _ = _served(d, 1, tuple(entries), member, ratio)
        assert second == want


def test_decode_never_writes_its_own_prefix_whatever_a_ready_names():  # C5, T6, T5, T3
    """Prefill dispatched before the rendezvous names the request from position 0; Decode
    computed the first block itself. Every Decode rank drops that block from its own
    piece, so the pieces still tile exactly the rest, and an entry wholly inside the
    prefix is a no-op that is still answered."""
    main_ids, idx_ids = (40, 41, 42, 43), (50, 51, 52, 53)
    main_dest, idx_dest = [10, 11, 12, 13], [20, 21, 22, 23]
    read_main, read_idx = [], []
    for d_rank in (0, 1):
        for member in (0, 1):
            d = DecodeCore(d_rank, 2, {"l0": DEST, "l1": DEST})
            d.register_request("r1", main_dest, idx_dest, 0.0, own_main=1, own_indexer=1)
            d.on_frame("p", wire.encode(wire.MfMeta("s", LAYERS)), 0.0)
            [read] = d.on_frame("p", ready(reqs=(("r1", main_ids, idx_ids, 0, 0),),
                                           member=member, ratio=2), 0.0)
            read_main += _read_positions(read, 0x900000, MAIN)
            if d_rank == 0:  # every Decode rank assembles the whole indexer (T3)
                read_idx += _read_positions(read, 0x920000, IDX)
    assert sorted(read_main) == [11, 12, 13] and sorted(read_idx) == [21, 22, 23]
    d = decode()
    d.register_request("r1", main_dest, idx_dest, 0.0, own_main=2, own_indexer=2)
    d.on_frame("p", wire.encode(wire.MfMeta("s", LAYERS)), 0.0)
    assert sends(d.on_frame("p", ready(reqs=(("r1", (40, 41), (50, 51), 0, 0),)), 0.0)) == [
        wire.encode(wire.ReadDone(0))]
    [read] = d.on_frame("p", ready(1, reqs=(("r1", main_ids, idx_ids, 0, 0),)), 0.0)
    assert _read_positions(read, 0x900000, MAIN) == [12, 13]
    for own in (-1, 5, 1.5):
        with pytest.raises(ProtocolError, match=f"C5: own_main={own!r} of request 'r2'"):
            d.register_request("r2", [1, 2, 3, 4], [5], 0.0, own_main=own)
    with pytest.raises(ProtocolError, match="C5: own_indexer=2 .* its 1 registered blocks"):
        d.register_request("r2", [1, 2], [5], 0.0, own_indexer=2)


def test_a_proof_of_distinct_destinations_holds_for_those_requests_only():  # L1
    """Two requests registered with one block in common would race into it: a layer that
    reads both is refused, though the layer before proved its own requests' blocks
    distinct (the proof is kept for the same destinations only)."""
    d = decode()
    d.register_request("r1", [10, 11], [20], 0.0)
    d.register_request("r2", [11, 12], [21], 0.0)
    d.register_request("r3", [30, 31], [22], 0.0)
    d.on_frame("p", wire.encode(wire.MfMeta("s", LAYERS)), 0.0)
    plan, _ = _served(d, 0, (("r1", (1, 2), (1,), 0, 0), ("r3", (3, 4), (2,), 0, 0)), 0, 1)
    assert plan[0][0] == 0x900000 + 10 * MAIN
    error, _ = _served(d, 1, (("r1", (1, 2), (1,), 0, 0), ("r2", (3, 4), (2,), 0, 0)), 0, 1)
    assert error == "L1: main tensor 0 destination block id 11 appears more than once"


def test_registered_destinations_are_the_cores_own_copy():  # C1, L1
    """What vLLM registered is what is read: changing the caller's array afterwards
    changes nothing, so a layer's joined destinations may be reused by the next."""
    import numpy as np

    blocks = np.array([10, 11], dtype=np.int64)
    d = decode()
    d.register_request("r1", blocks, [20, 21], 0.0)
    blocks[:] = [40, 41]
    d.on_frame("p", wire.encode(wire.MfMeta("s", LAYERS)), 0.0)
    for layer in (0, 1):
        plan, _ = _served(d, layer, (("r1", (5, 6), (1, 2), 0, 0),), 0, 1)
        assert plan[0][0] == 0x900000 + 10 * MAIN


# A second layer of other bases, whose destinations hold 16 blocks: ids that fit layer 0
# may not fit it.
LAYERS_APART = {"l0": layer_meta(0x10000), "l1": layer_meta(0x50000)}
DEST_SMALL = DestLayout((0xA00000, 0xA10000, 0xA20000), (MAIN, MAIN, IDX), (16, 16, 16), 2,
                        True, False)


def _apart_core(regs: list[tuple[str, list[int], list[int]]], **kw) -> DecodeCore:  # type: ignore[no-untyped-def]
    d = DecodeCore(0, 1, {"l0": DEST, "l1": DEST_SMALL}, **kw)
    for ext, main, idx in regs:
        d.register_request(ext, main, idx, 0.0)
    d.on_frame("p", wire.encode(wire.MfMeta("s", LAYERS_APART)), 0.0)
    return d


@given(data=st.data(), ratio=st.sampled_from([1, 2]))
@settings(max_examples=150, deadline=None)
def test_a_steps_next_layer_reads_what_it_would_read_alone(  # L1, C4, T6
        data: st.DataObject, ratio: int) -> None:
    """The step's next layer repeats the entries: planned from what the layer before
    learned, it reads exactly what a core serving that layer alone reads, or is refused
    with the same words (its own capacity and bases); so do the layers after it."""
    member = data.draw(st.integers(0, ratio - 1))
    ids = st.lists(st.integers(0, 63), max_size=4)
    entries, regs = [], []
    for i in range(data.draw(st.integers(1, 4))):
        entries.append((f"r{i}", data.draw(ids), data.draw(ids), data.draw(st.integers(0, 2)),
                        data.draw(st.integers(0, 2))))
        regs.append((f"r{i}", *(data.draw(st.lists(st.integers(0, 40), max_size=6,
                                                    unique=True)) for _ in range(2))))
    d = _apart_core(regs)
    first, _ = _served(d, 0, tuple(entries), member, ratio)
    if isinstance(first, str):  # a refused layer fails its requests: no second layer
        return
    alone, _ = _served(_apart_core(regs), 1, tuple(entries), member, ratio)
    second, _ = _served(d, 1, tuple(entries), member, ratio)
    assert second == alone
    if not isinstance(second, str):  # and the layers after it read their own again
        assert _served(d, 0, tuple(entries), member, ratio)[0] == first
        assert _served(d, 1, tuple(entries), member, ratio)[0] == alone


def test_a_request_aborted_between_layers_is_not_read_by_the_next():  # R5, C1
    """The next layer's READY has the same bytes, but a request of it was aborted since:
    its blocks are no longer written, the other request's still are."""
    regs = [("r1", [10, 11], [2]), ("r2", [12, 13], [3])]
    entries = (("r1", (1, 2), (1,), 0, 0), ("r2", (3, 4), (2,), 0, 0))
    d = _apart_core(regs)
    _served(d, 0, entries, 0, 1)
    d.abort_request("r2", "vLLM aborted it", 0.0)
    alone = _apart_core(regs)
    alone.abort_request("r2", "vLLM aborted it", 0.0)
    want, _ = _served(alone, 1, entries, 0, 1)
    got, _ = _served(d, 1, entries, 0, 1)
    assert got == want
    assert want[0] == [0xA00000 + 10 * MAIN, 0xA10000 + 10 * MAIN, 0xA20000 + 2 * IDX]  # r1's


def test_an_id_registered_again_is_read_into_its_new_blocks():  # C1, L1, R5
    """A request finished, its tombstone evicted, and its id registered again with other
    blocks: a READY with the same bytes as the one read before waits for the new
    registration (C1) and then reads into the new blocks, not the old ones."""
    d = _apart_core([("r1", [10, 11], [20, 21])], limits=DecodeLimits(tombstones=1))
    entries = (("r1", (1, 2), (1, 2), 0, 0),)
    before, _ = _served(d, 0, entries, 0, 1)
    for ext in ("r1", "r9"):  # r9's tombstone pushes r1's out
        if ext == "r9":
            d.register_request("r9", [1], [1], 0.0)
        d.abort_request(ext, "gone", 0.0)
        d.apply_agreement(ext, False)
    assert d.on_frame("p", ready(0, entries), 0.0) == []  # waits for r1's destinations
    [read] = d.register_request("r1", [30, 31], [5, 6], 0.0)
    assert isinstance(read, IssueRead)
    assert read.plan.local_addrs.tolist()[0] == 0x900000 + 30 * MAIN
    assert before[0][0] == 0x900000 + 10 * MAIN
    d.read_result(read.read_id, 0, 0.0)
    again, _ = _served(d, 0, entries, 0, 1)
    assert again[0][0] == 0x900000 + 30 * MAIN


def test_a_request_aborted_while_a_later_layer_is_read_is_ready_when_it_lands():  # C1, R1
    """A step's second layer is being read when vLLM aborts the request: no RequestReady
    while the read writes into its blocks, and one as soon as the read lands."""
    d = _apart_core([("r1", [10, 11], [2])])
    entries = (("r1", (1, 2), (1,), 0, 0),)
    _served(d, 0, entries, 0, 1)
    [read] = [a for a in d.on_frame("p", ready(1, entries), 0.0) if isinstance(a, IssueRead)]
    assert d.abort_request("r1", "vLLM aborted it", 0.0) == []
    done = d.read_result(read.read_id, 0, 0.0)
    assert RequestReady("r1", False) in done
    assert sends(done) == [wire.encode(wire.ReadDone(1))]
