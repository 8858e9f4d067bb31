"""Wire codec tests: exact encodings, legacy forms (W4), rejection of malformed input (W5),
the F3 handshake, and properties that no input makes a decoder raise anything but
``WireError``."""

from __future__ import annotations

import re
import sys
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sfa_rd2h.spec import wire, wire_decode, wire_encode
from sfa_rd2h.spec.errors import VersionMismatch, WireError
from sfa_rd2h.spec.wire import (
    LAYOUT_VERSION,
    MAX_BLOCK_ID,
    MAX_BLOCKS_PER_ENTRY,
    MAX_ERROR_LEN,
    MAX_FRAME_BYTES,
    MAX_ID_LEN,
    MAX_LAYER_IDX,
    MAX_TP_RATIO,
    MF_META,
    MF_META_ACK,
    PROTOCOL_VERSION,
    RAW_ACK,
    READ_DONE,
    READ_FAILED,
    READ_READY_BATCH,
    LayerMeta,
    LayerTable,
    MfMeta,
    MfMetaAck,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
    ReadReq,
    ReadyFrames,
    check_meta_ack,
    check_versions,
    decode,
    decode_layer_metadata,
    decode_meta_reply,
    encode,
    encode_layer_metadata,
    encode_meta_reply,
    external_request_id,
    layer_of,
    meta_refusal,
    ready_body,
    split_router_frames,
)

EACH = "; every per-tensor list must have one entry per tensor"
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# A main layer with K, V, indexer and LIC8 scale, and one without indexer.
META_FULL = LayerMeta(
    base_addrs=(0x10000, 0x20000, 0x30000, 0x40000),
    block_len=(4096, 512, 1024, 16),
    block_size_scale=(1, 1, 2, 2),
    tensor_group_idx=(0, 0, 1, 1),
    main_tensor_count=2,
    has_indexer=True,
)
META_MAIN = LayerMeta(
    base_addrs=(0x50000, 0x60000),
    block_len=(4096, 512),
    block_size_scale=(1, 1),
    tensor_group_idx=(0, 0),
    main_tensor_count=2,
    has_indexer=False,
)
LAYERS = {"model.layers.1.self_attn": META_FULL, "model.layers.0.self_attn": META_MAIN}


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def meta_map(**override: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "base_addrs": [1, 2],
        "block_len": [8, 8],
        "block_size_scale": [1, 1],
        "tensor_group_idx": [0, 0],
        "main_tensor_count": 2,
        "has_indexer": False,
    }
    base.update(override)
    return {k: v for k, v in base.items() if v is not _DROP}


_DROP = object()


def ready_fields(**override: Any) -> list[Any]:
    fields = {
        "kind": READ_READY_BATCH,
        "layer_idx": 3,
        "layer_name": "model.layers.3.self_attn",
        "read_reqs": [["req-a", [1, 2, 3], [7, 8], 4, 9]],
        "done_ext_ids": ["req-a"],
        "group_member_idx": 0,
        "tp_ratio": 1,
    }
    fields.update(override)
    return list(fields.values())


# ------------------------------------------------------------------ exact encodings


def test_layer_metadata_blob_is_the_documented_map() -> None:
    blob = encode_layer_metadata({"l0": META_FULL})
    assert blob == pack(
        {
            "l0": {
                "base_addrs": [0x10000, 0x20000, 0x30000, 0x40000],
                "block_len": [4096, 512, 1024, 16],
                "block_size_scale": [1, 1, 2, 2],
                "tensor_group_idx": [0, 0, 1, 1],
                "main_tensor_count": 2,
                "has_indexer": True,
            }
        }
    )


def test_legacy_mf_meta_exact_bytes() -> None:
    blob = encode_layer_metadata(LAYERS)
    assert encode(MfMeta("h:1", LAYERS)) == msgpack.packb(
        (b"mf_meta", "h:1", blob), use_bin_type=True
    )


def test_versioned_mf_meta_appends_versions() -> None:
    blob = encode_layer_metadata(LAYERS)
    msg = MfMeta("h:1", LAYERS, PROTOCOL_VERSION, LAYOUT_VERSION)
    assert encode(msg) == pack([MF_META, "h:1", blob, PROTOCOL_VERSION, LAYOUT_VERSION])
    assert decode(encode(msg)) == msg


def test_ready_and_replies_exact_bytes() -> None:
    ready = ReadReadyBatch(
        layer_idx=5,
        layer_name="model.layers.5.self_attn",
        read_reqs=(ReadReq("r1", (10, 11), (12,), 3, 4),),
        done_ext_ids=("r1",),
        group_member_idx=1,
        tp_ratio=2,
    )
    assert encode(ready) == pack(
        [b"read_ready_batch", 5, "model.layers.5.self_attn", [["r1", [10, 11], [12], 3, 4]],
         ["r1"], 1, 2]
    )  # fmt: skip
    assert encode(ReadDone(5)) == pack([b"read_done", 5])
    assert encode(ReadFailed(5, "boom")) == pack([b"read_failed", 5, "boom"])
    assert encode(MfMetaAck(False, 1, 1, "no")) == pack([b"mf_meta_ack", False, 1, 1, "no"])


_ids = st.lists(st.integers(0, MAX_BLOCK_ID), max_size=20)
_ext = st.text(min_size=1, max_size=12)
_entries = st.lists(st.builds(ReadReq, _ext, _ids, _ids, st.integers(0, MAX_BLOCK_ID),
                              st.integers(0, MAX_BLOCK_ID)), max_size=6)


@settings(max_examples=200, deadline=None)
@given(entries=_entries, done=st.lists(_ext, max_size=4), ratio=st.integers(1, MAX_TP_RATIO),
       layer=st.integers(0, MAX_LAYER_IDX), name=st.text(min_size=1, max_size=40),
       data=st.data())
def test_ready_frames_are_the_bytes_of_the_message(entries: list[ReadReq], done: list[str],
                                                   ratio: int, layer: int, name: str,
                                                   data: st.DataObject) -> None:
    # Prefill packs a step's entries once and joins them into each layer's READY: the
    # bytes must be exactly those of the message encoded whole.
    member = data.draw(st.integers(0, ratio - 1))
    frames = ReadyFrames(entries, member, ratio)
    for d in ((), tuple(done)):
        msg = ReadReadyBatch(layer, name, tuple(entries), d, member, ratio)
        assert frames.encode(layer, name, d) == encode(msg)


def _refusal(build: Any) -> str:
    with pytest.raises(WireError) as info:
        build()
    return str(info.value)


def test_ready_frames_refuse_what_the_message_refuses() -> None:
    """In the message's own words."""
    assert _refusal(lambda: ReadyFrames((), 2, 2)) == _refusal(
        lambda: ReadReadyBatch(0, "l", (), (), 2, 2)) == (
        "group_member_idx: 2 must be below tp_ratio=2")
    entry = ReadReq("a", (1,), (2,))
    frames = ReadyFrames((entry,))
    for args in ((MAX_LAYER_IDX + 1, "l", ()), (0, "", ()), (0, "l", ("",))):
        assert _refusal(lambda a=args: frames.encode(*a)) == _refusal(
            lambda a=args: ReadReadyBatch(a[0], a[1], (entry,), a[2]))
    assert _refusal(lambda: frames.encode(-1, "l")) == "layer_idx: -1 is out of range [0, 65535]"
    assert _refusal(lambda: frames.encode(0, "")) == "layer_name: must not be empty"


def test_ready_frames_default_to_a_single_contributor() -> None:
    """Without a member index and ratio, the frames are those of a group of one (W4)."""
    entry = ReadReq("a", (1,), (2,), 3, 4)
    frames = ReadyFrames([entry])
    assert (frames.read_reqs, frames.group_member_idx, frames.tp_ratio) == ((entry,), 0, 1)
    assert frames.encode(5, "l5", ("a",)) == encode(ReadReadyBatch(5, "l5", (entry,), ("a",)))
    grouped = ReadyFrames([entry], 1, 4)
    assert (grouped.group_member_idx, grouped.tp_ratio) == (1, 4)


def test_layer_order_is_preserved() -> None:
    table = decode_layer_metadata(encode_layer_metadata(LAYERS))
    assert list(table) == ["model.layers.1.self_attn", "model.layers.0.self_attn"]
    msg = decode(encode(MfMeta("h:1", LAYERS)))
    assert isinstance(msg, MfMeta)
    assert list(msg.layers) == list(LAYERS)
    assert encode(msg) == encode(MfMeta("h:1", LAYERS))


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize(
    "msg",
    [
        MfMeta("host:5000", LAYERS),
        MfMeta("host:5000", {}, 1, 1),
        MfMetaAck(True, 1, 1),
        MfMetaAck(False, 1, 1, "F3: protocol version 2 from prefill, decode speaks 1"),
        ReadReadyBatch(0, "l", (), ()),
        ReadReadyBatch(
            MAX_LAYER_IDX,
            "l",
            (ReadReq("a", (0, MAX_BLOCK_ID), (), 0, MAX_BLOCK_ID), ReadReq("b", (), (5,))),
            ("a", "b"),
            MAX_TP_RATIO - 1,
            MAX_TP_RATIO,
        ),
        ReadDone(0),
        ReadFailed(7, ""),
        ReadFailed(7, "transfer returned -3 ü"),
    ],
    ids=lambda m: type(m).__name__,
)
def test_round_trip(msg: Any) -> None:
    assert decode(encode(msg)) == msg
    hash(msg)  # frozen values are usable as dict keys / set members


def test_layer_meta_properties() -> None:
    assert META_FULL.ext_block_bytes == (4096, 512, 2048, 32)
    assert META_FULL.has_scale and META_FULL.indexer_tensor_idx == 2
    assert META_FULL.scale_tensor_idx == 3 and META_FULL.tensor_count == 4
    assert not META_MAIN.has_scale and META_MAIN.indexer_tensor_idx is None
    no_scale = LayerMeta((1, 2, 3), (1, 1, 1), (1, 1, 1), (0, 0, 1), 2, True)
    assert no_scale.has_indexer and not no_scale.has_scale and no_scale.scale_tensor_idx is None


def test_constructors_normalise_lists_and_numpy() -> None:
    req = ReadReq("r", [1, 2], np.array([3, 4], dtype=np.int32), np.int64(5), 0)
    # block ids become read-only arrays as narrow as their values allow
    assert req.p_main_block_ids.tolist() == [1, 2] and req.p_indexer_block_ids.tolist() == [3, 4]
    assert req.p_main_block_ids.dtype == np.uint8 and not req.p_main_block_ids.flags.writeable
    assert type(req.main_dest_start) is int
    assert ReadReq("r", [70000], [300], 0, 0).p_indexer_block_ids.dtype == np.uint16
    assert ReadReq("r", [70000], [], 0, 0).p_main_block_ids.dtype == np.uint32
    with pytest.raises(WireError, match="expected int, got float"):
        ReadReq("r", np.array([1.5]), ())
    meta = LayerMeta([1], [2], [3], [0], 1, False)
    assert meta.base_addrs == (1,)
    assert MfMeta("s", {"l": meta}).layers == {"l": meta}
    assert isinstance(MfMeta("s", {"l": meta}).layers, LayerTable)


def test_layer_table_is_immutable_and_hashable() -> None:
    msg = MfMeta("h:1", LAYERS)
    assert hash(msg) == hash(MfMeta("h:1", dict(reversed(list(LAYERS.items())))))
    with pytest.raises(TypeError):
        msg.layers["x"] = META_MAIN  # type: ignore[index]


# ------------------------------------------------------------------ legacy forms (W4)


def test_legacy_ready_without_contributor_fields() -> None:
    msg = decode(pack(ready_fields()[:5]))
    assert isinstance(msg, ReadReadyBatch)
    assert (msg.group_member_idx, msg.tp_ratio) == (0, 1)
    assert msg.read_reqs == (ReadReq("req-a", (1, 2, 3), (7, 8), 4, 9),)
    assert msg.done_ext_ids == ("req-a",)


def test_legacy_two_field_read_req() -> None:
    msg = decode(pack(ready_fields(read_reqs=[["req-b", [4, 5]]])[:5]))
    assert isinstance(msg, ReadReadyBatch)
    assert msg.read_reqs == (ReadReq("req-b", (4, 5), (4, 5), 0, 0),)


def test_appended_fields_are_ignored() -> None:
    fields = ready_fields(read_reqs=[["r", [1], [2], 0, 0, "future", {"x": 1}]])
    msg = decode(pack([*fields, "future-field", [1, 2]]))
    assert isinstance(msg, ReadReadyBatch)
    assert msg.read_reqs == (ReadReq("r", (1,), (2,)),)
    assert decode(pack([READ_DONE, 2, None])) == ReadDone(2)
    assert decode(pack([READ_FAILED, 2, "e", 9])) == ReadFailed(2, "e")
    assert decode(pack([MF_META_ACK, True, 1, 1, "", "x"])) == MfMetaAck(True, 1, 1)
    blob = encode_layer_metadata(LAYERS)
    assert decode(pack([MF_META, "h:1", blob, 1, 0, 1, 4])) == MfMeta("h:1", LAYERS, 1)


# ------------------------------------------------------------------ ROUTER framing


@pytest.mark.parametrize(
    "frames",
    [[b"id", b"", b"p"], [b"id", b"p"], [b"id", b"", b"", b"p", b""], (b"id", bytearray(b"p"))],
)
def test_split_router_frames(frames: Any) -> None:
    assert split_router_frames(frames) == (b"id", b"p")


@pytest.mark.parametrize(
    ("frames", "text"),
    [
        ([b"id"], "router frames: expected identity and payload, got 1 frame(s)"),
        ([b"id", b""], "router frames: expected exactly one non-empty payload frame, got 0"),
        ([b"id", b"a", b"b"],
         "router frames: expected exactly one non-empty payload frame, got 2"),
        ([b"", b"p"], "router frames[0]: empty identity"),
        ([b"id", "p"], "router frames[1]: expected bytes, got str 'p'"),
        (b"idp", "router frames: expected a sequence of frames, got bytes b'idp'"),
    ],
)
def test_split_router_frames_rejects(frames: Any, text: str) -> None:
    """The whole message: it names the frame and shows the offending value."""
    with pytest.raises(WireError) as info:
        split_router_frames(frames)
    assert str(info.value) == text


# ------------------------------------------------------------------ F3 handshake


def test_legacy_meta_is_version_one_and_gets_raw_ack() -> None:
    legacy = MfMeta("h:1", LAYERS)
    ack = check_versions(legacy)
    assert ack == MfMetaAck(True, PROTOCOL_VERSION)
    assert encode_meta_reply(legacy, ack) == RAW_ACK == b"ACK"
    assert decode_meta_reply(RAW_ACK) == MfMetaAck(True, 1)
    check_meta_ack(decode_meta_reply(RAW_ACK))


def test_versioned_meta_is_the_forks_six_fields_and_gets_its_exact_ack() -> None:
    msg = MfMeta("h:1", LAYERS, PROTOCOL_VERSION)
    assert msgpack.unpackb(encode(msg), raw=False)[3:] == [1, 0, 1]  # version, pp_rank, pp_size
    ack = check_versions(msg)
    frame = encode_meta_reply(msg, ack)
    assert frame == pack([b"mf_meta_ack", 1])  # what the fork's Prefill accepts, byte for byte
    assert decode_meta_reply(frame) == ack
    check_meta_ack(ack)
    # The largest pipeline a frame can name is read, and refused by Decode (X3), not by
    # the codec.
    widest = decode(pack([MF_META, "h:1", encode_layer_metadata(LAYERS), 1, 65534, 65535]))
    assert isinstance(widest, MfMeta) and (widest.pp_rank, widest.pp_size) == (65534, 65535)
    assert check_versions(widest).error.startswith("X3: prefill pipeline rank 65534 of 65535")


def test_earlier_project_form_still_gets_its_five_field_ack() -> None:
    msg = MfMeta("h:1", LAYERS, PROTOCOL_VERSION, LAYOUT_VERSION)
    assert len(msgpack.unpackb(encode(msg), raw=False)) == 5
    frame = encode_meta_reply(msg, check_versions(msg))
    assert frame == pack([b"mf_meta_ack", True, 1, 1, ""])
    check_meta_ack(decode_meta_reply(frame))


def test_refusal_of_a_versioned_meta_is_an_answer_that_says_why() -> None:
    msg = MfMeta("h:1", LAYERS, 2)
    frame = encode_meta_reply(msg, check_versions(msg))
    fields = msgpack.unpackb(frame, raw=False)
    assert fields[:3] == [b"mf_meta_ack", 0, 1] and "protocol version 2" in fields[3]
    with pytest.raises(VersionMismatch, match="protocol version 2 from prefill"):
        check_meta_ack(decode_meta_reply(frame))
    pp = check_versions(MfMeta("h:1", LAYERS, 1, None, 1, 2))
    assert not pp.accepted and "X3: prefill pipeline rank 1 of 2" in pp.error


def test_undecodable_meta_is_refused_not_ignored() -> None:
    bad = pack([MF_META, "h:1", b"not a map", 1, 0, 1])
    with pytest.raises(WireError):
        decode(bad)
    refusal = meta_refusal(bad, "layer metadata: broken")
    assert refusal is not None
    ack = decode_meta_reply(refusal)
    assert not ack.accepted and "layer metadata: broken" in ack.error
    # The earlier 5-field form is refused in its own ack form.
    old = meta_refusal(pack([MF_META, "h", b"x", 1, 1]), "no")
    assert old is not None and decode_meta_reply(old).layout_version == LAYOUT_VERSION
    assert meta_refusal(pack([READ_DONE, 1]), "x") is None
    assert meta_refusal(b"\xc1garbage", "x") is None
    # Each form is refused in the ack form its sender reads: the fork's 4-field refusal for
    # the versioned form, the 5-field one for this project's earlier form.
    assert meta_refusal(pack([MF_META, "h", b"x", 1, 0, 1]), "no") == pack(
        [MF_META_ACK, 0, PROTOCOL_VERSION, "W1: MF_META refused: no"])
    assert meta_refusal(pack([MF_META, "h", b"x", 1, 1]), "no") == pack(
        [MF_META_ACK, False, PROTOCOL_VERSION, LAYOUT_VERSION, "W1: MF_META refused: no"])
    # An MF_META cut after its kind is still an MF_META, and still answered.
    assert decode_meta_reply(meta_refusal(pack([MF_META]), "short") or b"").error == (
        "W1: MF_META refused: short")
    # A str kind is another encoder's frame, not an MF_META (kinds are msgpack bin).
    assert meta_refusal(pack(["mf_meta", "h:1", b"x"]), "x") is None


def test_predecessor_layer_map_takes_upstream_defaults() -> None:
    three = {"l0": {"base_addrs": [4096, 8192, 12288], "block_len": [64, 64, 16],
                    "tensor_group_idx": [0, 0, 0]}}
    layers = decode_layer_metadata(pack(three))
    meta = layers["l0"]
    assert meta.block_size_scale == (1, 1, 1)
    assert meta.main_tensor_count == 2
    assert meta.has_indexer  # more addresses than main tensors
    two = {"l0": {"base_addrs": [4096, 8192], "block_len": [64, 64],
                  "tensor_group_idx": [0, 0]}}
    assert not decode_layer_metadata(pack(two))["l0"].has_indexer


def test_version_mismatch_names_both_versions() -> None:
    ack = check_versions(MfMeta("h:1", LAYERS, 2, 1))
    assert not ack.accepted
    assert ack.error == "F3: protocol version 2 from prefill, decode speaks 1"
    ack = check_versions(MfMeta("h:1", LAYERS, 1, 7))
    assert ack.error == "F3: layout version 7 from prefill, decode speaks 1"
    pipelined = check_versions(MfMeta("h:1", LAYERS, 1, None, 1, 2))
    assert pipelined.error == "X3: prefill pipeline rank 1 of 2; decode serves pp_size 1 only"
    both = check_versions(MfMeta("h:1", LAYERS, 3, 4))
    assert both.error == ("F3: protocol version 3 from prefill, decode speaks 1; "
                          "F3: layout version 4 from prefill, decode speaks 1")
    with pytest.raises(VersionMismatch, match="decode refused the handshake: F3: protocol"):
        check_meta_ack(decode_meta_reply(encode_meta_reply(MfMeta("h", {}, 3, 4), both)))
    with pytest.raises(VersionMismatch, match="decode speaks protocol version 9, prefill speaks 1"):
        check_meta_ack(MfMetaAck(True, 9))
    with pytest.raises(VersionMismatch, match="decode speaks layout version 2"):
        check_meta_ack(MfMetaAck(True, 1, 2))
    # A refusal without a reason still says it was refused, and that no reason came.
    with pytest.raises(VersionMismatch) as info:
        check_meta_ack(decode_meta_reply(pack([MF_META_ACK, 0, 1, ""])))
    assert str(info.value) == "F3: decode refused the handshake: no reason given"


def test_refused_legacy_meta_is_not_a_raw_ack() -> None:
    legacy = MfMeta("h:1", LAYERS)
    refusal = MfMetaAck(False, 1, None, "F3: no")
    assert encode_meta_reply(legacy, refusal) != RAW_ACK


@pytest.mark.parametrize(
    ("frame", "text"),
    [(pack([READ_DONE, 1]), "got ReadDone"), (b"ACK!", "not valid msgpack"), (None, "bytes")],
)
def test_decode_meta_reply_rejects(frame: Any, text: str) -> None:
    with pytest.raises(WireError, match=re.escape(text)):
        decode_meta_reply(frame)


def test_messages_built_locally_refuse_what_they_cannot_send() -> None:
    """Prefill builds MF_META from its own layer table: a table that is no mapping, or one
    that holds something other than layouts, is refused by name before anything is sent."""
    with pytest.raises(WireError) as info:
        MfMeta("h:1", ["l0", "l1"])  # type: ignore[arg-type]
    assert str(info.value) == "layers: expected a mapping, got list ['l0', 'l1']"
    for layers, text in (({"l0": 5}, "layers['l0']: expected LayerMeta, got int 5"),
                         ({"": META_MAIN}, "layer name: must not be empty")):
        with pytest.raises(WireError) as info:
            encode_layer_metadata(layers)  # type: ignore[arg-type]
        assert str(info.value) == text
    table = LayerTable(LAYERS)
    assert encode_layer_metadata(table) == encode_layer_metadata(LAYERS)
    for args, text in (((-1,), "protocol_version: -1 is out of range [0, 4294967295]"),
                       ((1, -1), "layout_version: -1 is out of range [0, 4294967295]"),
                       ((1, None, 0, 0), "pp_size: 0 is out of range [1, 65535]"),
                       ((1, None, 2, 2), "pp_rank: 2 is out of range [0, 1]")):
        with pytest.raises(WireError) as info:
            MfMeta("h:1", {}, *args)
        assert str(info.value) == text
    for args, text in ((("", (1,), (1,)), "ext_req_id: must not be empty"),
                       (("r", (1,), (1,), -1),
                        "main_dest_start: -1 is out of range [0, 2147483647]"),
                       (("r", (1,), (1,), 0, -1),
                        "indexer_dest_start: -1 is out of range [0, 2147483647]"),
                       (("r", (1,), (-1,)), "p_indexer_block_ids[0]: -1 is out of range "
                                             "[0, 2147483647]")):
        with pytest.raises(WireError) as info:
            ReadReq(*args)
        assert str(info.value) == text
    entry = ReadReq("r", (1,), (1,))
    listed = ReadReadyBatch(0, "l", [entry], ["r"])  # type: ignore[arg-type]
    assert (listed.read_reqs, listed.done_ext_ids) == ((entry,), ("r",))
    for args, text in (((-1, "l", (), ()), "layer_idx: -1 is out of range [0, 65535]"),
                       ((0, "l", "r", ()), "read_reqs: expected a list, got str 'r'"),
                       ((0, "l", (), "r"), "done_ext_ids: expected a list, got str 'r'")):
        with pytest.raises(WireError) as info:
            ReadReadyBatch(*args)
        assert str(info.value) == text
    # Decode's answer likewise.
    for args, text in (((1, 1), "accepted: expected bool, got int 1"),
                       ((True, 1, -1), "layout_version: -1 is out of range [0, 4294967295]"),
                       ((False, 1, None, b"no"), "error: expected str, got bytes b'no'")):
        with pytest.raises(WireError) as info:
            MfMetaAck(*args)
        assert str(info.value) == text
    # As many layers as a model may have, and not one more.
    many = [(f"model.layers.{i}", META_MAIN) for i in range(wire.MAX_LAYERS)]
    assert len(LayerTable(many)) == wire.MAX_LAYERS
    with pytest.raises(WireError) as info:
        LayerTable([*many, ("one.more", META_MAIN)])
    assert str(info.value) == f"layers: more than {wire.MAX_LAYERS} layers"


def test_mf_meta_layout_version_needs_a_protocol_version() -> None:
    with pytest.raises(WireError, match="without a protocol_version"):
        MfMeta("h:1", LAYERS, None, 1)
    with pytest.raises(WireError, match="pp_rank"):
        MfMeta("h:1", LAYERS, 1, None, 2, 2)


# ------------------------------------------------------------------ helpers


def test_external_request_id() -> None:
    assert external_request_id("chatcmpl-abc-0123abcd") == "chatcmpl-abc"
    assert external_request_id("x" * 10) == "x"
    for bad in ("123456789", "", None):
        with pytest.raises(WireError):
            external_request_id(bad)  # type: ignore[arg-type]
    # the longest external id the wire carries is accepted, one more is refused by name
    assert external_request_id("a" * MAX_ID_LEN + "-0123abcd") == "a" * MAX_ID_LEN
    with pytest.raises(WireError) as info:
        external_request_id("a" * (MAX_ID_LEN + 1) + "-0123abcd")
    assert str(info.value) == (f"vllm request id: external id of {MAX_ID_LEN + 1} characters "
                               f"exceeds {MAX_ID_LEN}")
    with pytest.raises(WireError) as info:
        external_request_id("123456789")
    assert str(info.value) == ("vllm request id '123456789': must be longer than its "
                               "9-character engine suffix")
    with pytest.raises(WireError) as info:
        external_request_id(b"chatcmpl-abc-0123abcd")  # type: ignore[arg-type]
    assert str(info.value).startswith("vllm request id: expected str, got bytes b'chatcmpl")


def test_a_decoder_bug_in_layer_metadata_still_surfaces_as_wire_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """W5 backstop: whatever goes wrong inside the decoder reaches the caller as a
    WireError that names it, never as another exception type."""
    def broken(blob: bytes) -> None:
        raise KeyError("l7")

    monkeypatch.setattr(wire_decode, "_decode_layer_table", broken)
    with pytest.raises(WireError) as info:
        decode_layer_metadata(encode_layer_metadata(LAYERS))
    assert str(info.value) == "internal decoder error: KeyError: 'l7'"


def test_layer_of() -> None:
    assert layer_of(encode(ReadReadyBatch(42, "l", (), ()))) == 42
    # Field 1 is readable even when the rest of the frame is garbage or cut off.
    assert layer_of(pack([READ_READY_BATCH, 7, 3]) + b"\xc1\xc1") == 7
    assert layer_of(pack([READ_READY_BATCH, 9])) == 9  # cut after the index
    assert layer_of(pack([READ_READY_BATCH, 0, "x"])) == 0  # the bounds are layers too
    assert layer_of(pack([READ_READY_BATCH, MAX_LAYER_IDX])) == MAX_LAYER_IDX
    assert layer_of(pack(ready_fields(layer_idx=11, layer_name=b"bad"))[:25]) == 11
    assert layer_of(b"\x97" + pack(READ_READY_BATCH) + pack(12)) == 12
    # A current READY's layer index in each msgpack width, canonical or not.
    head = b"\x97" + pack(READ_READY_BATCH)
    assert layer_of(head + b"\xcc\xc8") == 200
    assert layer_of(head + b"\xcd\x01\x00") == 256
    assert layer_of(head + b"\xce\x00\x00\x00\x05") == 5
    assert layer_of(head + b"\xce\x00\x01\x11\x70") is None  # 70000: no such layer
    assert layer_of(head + b"\xcd\x01") is None  # cut inside the index
    # A READY with a W4 appendix and a long name: read from its first 64 bytes.
    long_ready = pack([*ready_fields(layer_idx=11, layer_name="n" * 100), "appendix"])
    assert len(long_ready) > 64 and layer_of(long_ready) == 11
    for bad in (
        pack([READ_READY_BATCH, True]),
        pack([READ_READY_BATCH, -1]),
        pack([READ_READY_BATCH, MAX_LAYER_IDX + 1]),
        pack([READ_READY_BATCH]),
        pack([READ_DONE, 3]),
        pack(["read_ready_batch", 3]),
        pack({"k": 1}),
        b"",
        b"\xc1",
        "text",
        None,
    ):
        assert layer_of(bad) is None  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(entries=_entries, done=st.lists(_ext, max_size=4), ratio=st.integers(1, MAX_TP_RATIO),
       layers=st.lists(st.tuples(st.integers(0, MAX_LAYER_IDX),
                                 st.text(min_size=1, max_size=300)), min_size=2, max_size=2),
       data=st.data())
def test_a_readys_body_is_the_bytes_past_its_layer_whatever_the_layer(  # W2
        entries: list[ReadReq], done: list[str], ratio: int, layers: list[tuple[int, str]],
        data: st.DataObject) -> None:
    """``ready_body``: the READY's entries, finished ids, member and ratio exactly as
    packed, the same for every layer index (fixint, uint8, uint16) and name (fixstr, str8,
    str16), so equal bodies are equal entries."""
    member = data.draw(st.integers(0, ratio - 1))
    tail = b"".join(pack(f) for f in (
        [[e.ext_req_id, e.p_main_block_ids.tolist(), e.p_indexer_block_ids.tolist(),
          e.main_dest_start, e.indexer_dest_start] for e in entries],
        done, member, ratio))
    for layer, name in layers:
        frame = encode(ReadReadyBatch(layer, name, tuple(entries), tuple(done), member, ratio))
        assert ready_body(frame) == tail
        assert ready_body(bytearray(frame)) == ready_body(memoryview(frame)) == tail
    head = b"\x97" + pack(READ_READY_BATCH)
    for index in (b"\xce\x00\x00\x00\x05", b"\xcf" + bytes(7) + b"\x05"):  # wider than needed
        assert ready_body(head + index + pack("l") + tail) == tail


@given(junk=st.binary(max_size=40))
@settings(max_examples=200, deadline=None)
def test_a_body_is_none_for_what_is_no_current_ready_and_never_raises(junk: bytes) -> None:
    """Other messages, legacy READYs, frames cut before their name ends, layer indexes or
    names of forms no READY has: None. Past the header anything gives None or bytes."""
    frame = encode(ReadReadyBatch(3, "x" * 40, (ReadReq("r", [1], [2], 0, 0),), ()))
    head = b"\x97" + pack(READ_READY_BATCH)
    for bad in (encode(ReadDone(3)), b"", junk, head, head + b"\x03", head + b"\x03\xd9",
                head + b"\x03\xd9\x28xx", head + b"\xc0" + pack("l"),
                head + b"\xff" + pack("l"), head + b"\x03\x01",
                *(frame[:k] for k in range(len(head) + 42)),
                b"\x95" + pack(READ_READY_BATCH) + b"\x03" + pack("l")):
        assert ready_body(bad) is None
    for bad in (None, "text", 7):
        assert ready_body(bad) is None  # type: ignore[arg-type]
    assert ready_body(head + junk) is None or isinstance(ready_body(head + junk), bytes)


def test_error_text_is_repaired_not_refused() -> None:
    assert len(ReadFailed(1, "x" * (MAX_ERROR_LEN + 10)).error) == MAX_ERROR_LEN
    long_wide = ReadFailed(1, "é" * MAX_ERROR_LEN)
    assert len(long_wide.error.encode()) <= MAX_ERROR_LEN
    assert decode(encode(long_wide)) == long_wide
    # A cut that falls inside a character drops that character, never the reply.
    odd = ReadFailed(1, "x" + "é" * (MAX_ERROR_LEN // 2))
    assert odd.error == "x" + "é" * (MAX_ERROR_LEN // 2 - 1)
    surrogate = ReadFailed(1, "bad \udcff path")
    assert surrogate.error == "bad ? path"
    assert decode(encode(surrogate)) == surrogate
    with pytest.raises(WireError, match="not encodable as UTF-8"):
        ReadReq("\udcff", (), ())


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"block_len": (1,)}, "block_len: has 1 entries but base_addrs has 2" + EACH),
        ({"block_size_scale": (1,)}, "block_size_scale: has 1 entries but base_addrs has 2" + EACH),
        ({"tensor_group_idx": (0, 0, 0)},
         "tensor_group_idx: has 3 entries but base_addrs has 2" + EACH),
        ({"main_tensor_count": 0}, "main_tensor_count: 0 is out of range [1, 16]"),
        ({"has_indexer": 1}, "has_indexer: expected bool, got int 1"),
        ({"block_size_scale": (1, 0)}, "block_size_scale[1]: 0 is out of range [1, 65536]"),
        ({"base_addrs": (-1, 0)}, f"base_addrs[0]: -1 is out of range [0, {2**64 - 1}]"),
        ({"base_addrs": (2**64, 0)}, f"base_addrs[0]: {2**64} is out of range [0, {2**64 - 1}]"),
        ({"main_tensor_count": 1},
         "base_addrs: 2 tensors do not fit main_tensor_count=1, has_indexer=False (expected 1)"),
        ({"has_indexer": True, "base_addrs": (1,), "block_len": (8,), "block_size_scale": (1,),
          "tensor_group_idx": (0,)},
         "base_addrs: 1 tensors do not fit main_tensor_count=2, has_indexer=True "
         "(expected 3 or 4)"),
        ({"tensor_group_idx": (0, True)}, "tensor_group_idx[1]: expected int, got bool True"),
        ({"base_addrs": "12"}, "base_addrs: expected a list of ints, got str '12'"),
    ],
)
def test_layer_meta_rejects(kwargs: dict[str, Any], text: str) -> None:
    """Each refusal in full: the field, the offending value and what was expected."""
    fields: dict[str, Any] = {
        "base_addrs": (1, 2),
        "block_len": (8, 8),
        "block_size_scale": (1, 1),
        "tensor_group_idx": (0, 0),
        "main_tensor_count": 2,
        "has_indexer": False,
    }
    fields.update(kwargs)
    with pytest.raises(WireError) as info:
        LayerMeta(**fields)
    assert str(info.value) == text


def test_scale_without_indexer_is_rejected() -> None:
    # Three tensors with main=2 and no indexer would be a LIC8 scale with no indexer.
    with pytest.raises(WireError, match=re.escape("expected 2")):
        LayerMeta((1, 2, 3), (1, 1, 1), (1, 1, 1), (0, 0, 0), 2, False)


def test_encode_rejects_non_messages() -> None:
    with pytest.raises(WireError, match="not an RD2H message"):
        encode((READ_DONE, 1))  # type: ignore[arg-type]


# ------------------------------------------------------------------ malformed table (W5)


def _blob_frame(blob: Any) -> bytes:
    return pack([MF_META, "h:1", blob])


_DUP_FIELD_BLOB = (
    b"\x81\xa2l0\x87"  # {"l0": map of 7 pairs, the last one repeats has_indexer}
    + b"".join(pack(k) + pack(v) for k, v in meta_map().items())
    + pack("has_indexer")
    + pack(True)
)

MALFORMED: list[tuple[str, Any, str]] = [
    ("str-not-bytes", "read_done", "frame: expected bytes, got str"),
    ("none", None, "frame: expected bytes, got NoneType"),
    ("empty-bytes", b"", "not valid msgpack"),
    ("format-byte", b"\xc1", "reserved or invalid format byte"),
    ("trailing", pack([READ_DONE, 1]) + b"\x00", "trailing bytes"),
    ("truncated", pack(ready_fields())[:-3], "incomplete input"),
    ("deep-nesting", b"\x91" * 5000, "nested too deeply"),
    ("bad-utf8", b"\x92\xc4\x09read_done\xa1\xff", "UnicodeDecodeError"),
    ("ext-type", pack([READ_DONE, msgpack.ExtType(1, b"x")]), "max_ext_len"),
    ("oversized", b"\x00" * (MAX_FRAME_BYTES + 1), "exceeds MAX_FRAME_BYTES"),
    ("top-map", pack({"kind": "read_done"}), "top level must be a msgpack array, got dict"),
    ("top-int", pack(7), "top level must be a msgpack array, got int"),
    ("empty-array", pack([]), "empty array"),
    ("kind-str", pack(["read_done", 1]), "kind must be msgpack bin (bytes), got str"),
    ("kind-int", pack([1, 1]), "kind must be msgpack bin (bytes), got int"),
    ("unknown-kind", pack([b"write_done", 1]), "unknown message kind b'write_done'"),
    ("too-many-fields", pack([READ_DONE, 1, *range(40)]), "fields exceed the limit"),
    ("done-short", pack([READ_DONE]), "read_done: expected at least 2 fields, got 1"),
    ("done-bool", pack([READ_DONE, True]), "read_done: layer_idx: expected int, got bool"),
    ("done-float", pack([READ_DONE, 1.0]), "layer_idx: expected int, got float"),
    ("done-negative", pack([READ_DONE, -1]), "layer_idx: -1 is out of range"),
    ("done-huge", pack([READ_DONE, 2**64 - 1]), "layer_idx: 18446744073709551615 is out of"),
    ("failed-short", pack([READ_FAILED, 1]), "read_failed: expected at least 3 fields"),
    ("failed-error-bin", pack([READ_FAILED, 1, b"x"]), "error: expected str, got bytes"),
    ("failed-layer-neg", pack([READ_FAILED, -1, "x"]),
     "read_failed: layer_idx: -1 is out of range [0, 65535]"),
    ("meta-layout-version-neg", pack([MF_META, "h", pack({}), 1, -1]),
     "mf_meta: layout_version: -1 is out of range [0, 4294967295]"),
    ("ready-4", pack(ready_fields()[:4]),
     "read_ready_batch: expected 5 (legacy) or at least 7 fields, got 4"),
    ("ready-6", pack(ready_fields()[:6]),
     "read_ready_batch: expected 5 (legacy) or at least 7 fields, got 6"),
    ("ready-name-bin", pack(ready_fields(layer_name=b"l")), "layer_name: expected str, got bytes"),
    ("ready-name-empty", pack(ready_fields(layer_name="")), "layer_name: must not be empty"),
    ("ready-layer-big", pack(ready_fields(layer_idx=MAX_LAYER_IDX + 1)), "layer_idx: 65536 is"),
    ("ready-reqs-map", pack(ready_fields(read_reqs={"a": 1})),
     "read_ready_batch: read_reqs: expected an array, got dict {'a': 1}"),
    ("ready-req-str", pack(ready_fields(read_reqs=["r"])),
     "read_reqs[0]: expected an array, got str 'r'"),
    (
        "ready-req-3",
        pack(ready_fields(read_reqs=[["r", [1], [1]]])),
        "read_reqs[0]: read_req: expected 2 (legacy) or at least 5 fields, got 3",
    ),
    (
        "ready-block-neg",
        pack(ready_fields(read_reqs=[["r", [1, -1], [], 0, 0]])),
        "read_reqs[0]: p_main_block_ids[1]: -1 is out of range",
    ),
    (
        "ready-block-big",
        pack(ready_fields(read_reqs=[["r", [MAX_BLOCK_ID + 1], [], 0, 0]])),
        "p_main_block_ids[0]: 2147483648 is out of range",
    ),
    (
        "ready-block-bool",
        pack(ready_fields(read_reqs=[["r", [], [0, True], 0, 0]])),
        "p_indexer_block_ids[1]: expected int, got bool",
    ),
    (
        "ready-block-str",
        pack(ready_fields(read_reqs=[["r", ["1"], [], 0, 0]])),
        "p_main_block_ids[0]: expected int, got str",
    ),
    (
        "ready-blocks-not-list",
        pack(ready_fields(read_reqs=[["r", 5, [], 0, 0]])),
        "p_main_block_ids: expected a list of ints, got int",
    ),
    (
        "ready-dest-neg",
        pack(ready_fields(read_reqs=[["r", [], [], -1, 0]])),
        "main_dest_start: -1 is out of range",
    ),
    (
        "ready-indexer-dest-neg",
        pack(ready_fields(read_reqs=[["r", [], [], 0, -1]])),
        "read_reqs[0]: indexer_dest_start: -1 is out of range [0, 2147483647]",
    ),
    (
        "ready-indexer-dest-big",
        pack(ready_fields(read_reqs=[["r", [5], [5], 0, MAX_BLOCK_ID + 1]])),
        "read_reqs[0]: indexer_dest_start: 2147483648 is out of range [0, 2147483647]",
    ),
    (
        "ready-id-empty",
        pack(ready_fields(read_reqs=[["", [], [], 0, 0]])),
        "ext_req_id: must not be empty",
    ),
    (
        "ready-id-long",
        pack(ready_fields(read_reqs=[["x" * (MAX_ID_LEN + 1), [], [], 0, 0]])),
        "ext_req_id: 1025 characters exceed the limit of 1024",
    ),
    ("ready-done-int", pack(ready_fields(done_ext_ids=[1])), "done_ext_ids[0]: expected str"),
    ("ready-done-str", pack(ready_fields(done_ext_ids="r")),
     "read_ready_batch: done_ext_ids: expected an array, got str 'r'"),
    ("ready-too-many", pack(ready_fields(read_reqs=[["r", []]] * (wire.MAX_ENTRIES + 1))),
     f"read_ready_batch: read_reqs: {wire.MAX_ENTRIES + 1} entries exceed the limit of "
     f"{wire.MAX_ENTRIES}"),
    (
        "ready-member-ge-ratio",
        pack(ready_fields(group_member_idx=2, tp_ratio=2)),
        "group_member_idx: 2 must be below tp_ratio=2",
    ),
    ("ready-ratio-0", pack(ready_fields(tp_ratio=0)), "tp_ratio: 0 is out of range"),
    ("ready-ratio-big", pack(ready_fields(tp_ratio=MAX_TP_RATIO + 1)), "tp_ratio: 1025 is out"),
    ("ready-ratio-bool", pack(ready_fields(tp_ratio=True)), "tp_ratio: expected int, got bool"),
    ("meta-4", pack([MF_META, "h", pack({}), 1]), "mf_meta: expected 3, 5 or at least 6"),
    ("meta-pp", pack([MF_META, "h", pack({}), 1, 3, 2]),
     "mf_meta: pp_rank=3 is not a rank of pp_size=2"),
    ("meta-pp-size-0", pack([MF_META, "h", pack({}), 1, 0, 0]),
     "mf_meta: pp_rank=0 is not a rank of pp_size=0"),
    ("meta-pp-size-big", pack([MF_META, "h", pack({}), 1, 0, 2**16]),
     "mf_meta: pp_rank=0 is not a rank of pp_size=65536"),
    ("meta-pp-rank-str", pack([MF_META, "h", pack({}), 1, "0", 1, "appendix"]),
     "mf_meta: pp_rank/pp_size must be ints, got list ['0', 1]"),
    ("meta-pp-size-str", pack([MF_META, "h", pack({}), 1, 0, "1"]),
     "mf_meta: pp_rank/pp_size must be ints, got list [0, '1']"),
    ("meta-session-bin", pack([MF_META, b"h", pack({})]), "p_session: expected str, got bytes"),
    ("meta-blob-str", _blob_frame("{}"), "layer metadata: expected msgpack bytes, got str"),
    ("meta-blob-garbage", _blob_frame(b"\xc1"), "layer metadata: not valid msgpack"),
    ("meta-blob-list", _blob_frame(pack([1])),
     "layer metadata: expected a map of layer name -> layout, got list [1]"),
    ("meta-blob-int-key", _blob_frame(pack({1: {}})), "int is not allowed for map key"),
    ("meta-layer-bin-name", _blob_frame(pack({b"l0": meta_map()})), "layer name: expected str"),
    ("meta-layer-not-map", _blob_frame(pack({"l0": [1]})),
     "layer metadata['l0']: expected a map of layout fields, got list [1]"),
    ("meta-unknown-key", _blob_frame(pack({"l0": meta_map(x=1)})),
     "unknown field str 'x'; expected only base_addrs, block_len, block_size_scale, "
     "tensor_group_idx, main_tensor_count, has_indexer"),
    (
        "meta-missing-key",
        _blob_frame(pack({"l0": meta_map(tensor_group_idx=_DROP)})),
        "layer metadata['l0']: missing field(s) tensor_group_idx",
    ),
    (
        "meta-missing-keys",
        _blob_frame(pack({"l0": meta_map(tensor_group_idx=_DROP, block_len=_DROP)})),
        "layer metadata['l0']: missing field(s) block_len, tensor_group_idx",
    ),
    ("meta-dup-key", _blob_frame(_DUP_FIELD_BLOB), "duplicate field 'has_indexer'"),
    (
        "meta-lengths",
        _blob_frame(pack({"l0": meta_map(block_len=[8])})),
        "block_len: has 1 entries but base_addrs has 2",
    ),
    (
        "meta-has-indexer-int",
        _blob_frame(pack({"l0": meta_map(has_indexer=1)})),
        "has_indexer: expected bool, got int",
    ),
    ("meta-addr-neg", _blob_frame(pack({"l0": meta_map(base_addrs=[-1, 2])})), "base_addrs[0]"),
    (
        "meta-version-bool",
        pack([MF_META, "h", pack({}), True, 1]),
        "protocol_version: expected int, got bool",
    ),
    ("ack-short", pack([MF_META_ACK, 0, 1]), "mf_meta_ack: expected at least 4 in a refusal"),
    ("ack-str", pack([MF_META_ACK, "yes", 1]),
     "mf_meta_ack: expected a version or a bool, got list ['yes']"),
    ("ack-empty", pack([MF_META_ACK]), "mf_meta_ack: expected a version or a bool, got list []"),
    ("ack-version-neg", pack([MF_META_ACK, True, -1, 1, ""]), "protocol_version: -1 is out"),
    ("ack-accepts-v0", pack([MF_META_ACK, True, 0, None, ""]),
     "mf_meta_ack: an accepting mf_meta_ack needs a protocol_version >= 1"),
]


@pytest.mark.parametrize(
    ("payload", "text"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_malformed_input_raises_wire_error(payload: Any, text: str) -> None:
    with pytest.raises(WireError, match=re.escape(text)) as info:
        decode(payload)
    assert "internal decoder error" not in str(info.value)


def test_decode_layer_metadata_rejects_directly() -> None:
    with pytest.raises(WireError, match=re.escape("layer metadata['l0']: block_len")):
        decode_layer_metadata(pack({"l0": meta_map(block_len=[0, 8])}))
    with pytest.raises(WireError, match="expected msgpack bytes"):
        decode_layer_metadata(None)  # type: ignore[arg-type]


# ------------------------------------------------------------------ properties

_ids = st.text(min_size=1, max_size=12)
_block_ids = st.lists(st.integers(0, MAX_BLOCK_ID), max_size=24)


@st.composite
def layer_metas(draw: st.DrawFn) -> LayerMeta:
    main = draw(st.integers(1, 3))
    has_indexer = draw(st.booleans())
    n = main + (1 + int(draw(st.booleans())) if has_indexer else 0)
    return LayerMeta(
        base_addrs=tuple(draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n))),
        block_len=tuple(draw(st.lists(st.integers(1, 2**20), min_size=n, max_size=n))),
        block_size_scale=tuple(draw(st.lists(st.integers(1, 64), min_size=n, max_size=n))),
        tensor_group_idx=tuple(draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))),
        main_tensor_count=main,
        has_indexer=has_indexer,
    )


_versions = st.one_of(st.just((None, None)), st.tuples(st.integers(0, 9), st.integers(0, 9)))

messages = st.one_of(
    st.builds(
        lambda s, layers, v: MfMeta(s, layers, *v),
        _ids,
        st.dictionaries(_ids, layer_metas(), max_size=3),
        _versions,
    ),
    st.builds(MfMetaAck, st.booleans(), st.integers(0, 9), st.integers(0, 9), st.text()),
    st.builds(
        lambda idx, name, reqs, done, ratio, member: ReadReadyBatch(
            idx, name, tuple(reqs), tuple(done), member % ratio, ratio
        ),
        st.integers(0, MAX_LAYER_IDX),
        _ids,
        st.lists(
            st.builds(
                ReadReq,
                _ids,
                _block_ids,
                _block_ids,
                st.integers(0, MAX_BLOCK_ID),
                st.integers(0, MAX_BLOCK_ID),
            ),
            max_size=4,
        ),
        st.lists(_ids, max_size=4),
        st.integers(1, MAX_TP_RATIO),
        st.integers(0, MAX_TP_RATIO),
    ),
    st.builds(ReadDone, st.integers(0, MAX_LAYER_IDX)),
    st.builds(ReadFailed, st.integers(0, MAX_LAYER_IDX), st.text()),
)

_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.sampled_from([READ_READY_BATCH, READ_DONE, READ_FAILED, MF_META, MF_META_ACK])
)
values = st.recursive(
    _leaves,
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=4) | st.binary(max_size=4) | st.integers(-9, 9), children,
                      max_size=3),
    max_leaves=20,
)  # fmt: skip


def _decode_or_wire_error(payload: Any) -> None:
    try:
        msg = decode(payload)
    except WireError as exc:
        assert "internal decoder error" not in str(exc), str(exc)
        return
    # Anything accepted must be canonical enough to survive its own round trip.
    assert decode(encode(msg)) == msg


@FAST
@given(messages)
def test_property_round_trip(msg: Any) -> None:
    assert decode(encode(msg)) == msg
    if isinstance(msg, ReadReadyBatch):
        assert layer_of(encode(msg)) == msg.layer_idx


_KIND_PREFIXES = [pack([k])[1:] for k in (READ_READY_BATCH, READ_DONE, READ_FAILED, MF_META,
                                           MF_META_ACK)]
# Arbitrary bytes, and arbitrary bytes behind an array header and a message kind, so the
# decoders get past the first byte and layer_of's positive path is reached.
_arbitrary = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda head, kind, tail: head + kind + tail,
              st.sampled_from([b"\x92", b"\x93", b"\x95", b"\x97", b"\xdc\x00\x07"]),
              st.sampled_from(_KIND_PREFIXES), st.binary(max_size=48)),
)


@FAST
@given(_arbitrary)
def test_property_arbitrary_bytes(data: bytes) -> None:
    """W5: arbitrary bytes never make the decoder raise anything but a ``WireError`` that
    names the problem (not the internal-error backstop); anything accepted round-trips;
    ``layer_of`` never raises and names a layer only for a READY that carries it."""
    try:
        msg = decode(data)
    except WireError as exc:
        assert "internal decoder error" not in str(exc), str(exc)
        assert str(exc)
        msg = None
    if msg is not None:
        assert decode(encode(msg)) == msg
    layer = layer_of(data)
    if isinstance(msg, ReadReadyBatch):
        assert layer == msg.layer_idx  # a READY that decodes is always identifiable (S3)
    elif msg is not None:
        assert layer is None  # anything else that decodes is not a READY
    if layer is not None:
        assert type(layer) is int and 0 <= layer <= MAX_LAYER_IDX
        unpacker = msgpack.Unpacker(raw=False)
        unpacker.feed(data)
        assert unpacker.read_array_header() >= 2
        assert unpacker.unpack() == READ_READY_BATCH and unpacker.unpack() == layer


@FAST
@given(messages, st.data())
def test_property_corrupted_valid_frames(msg: Any, data: st.DataObject) -> None:
    frame = bytearray(encode(msg))
    if data.draw(st.booleans()):
        frame = frame[: data.draw(st.integers(0, len(frame)))]
    else:
        i = data.draw(st.integers(0, len(frame) - 1))
        frame[i] = data.draw(st.integers(0, 255))
    _decode_or_wire_error(bytes(frame))
    layer_of(bytes(frame))


@FAST
@given(
    st.one_of(
        values,
        st.builds(
            lambda kind, rest: [kind, *rest],
            st.sampled_from([READ_READY_BATCH, READ_DONE, READ_FAILED, MF_META, MF_META_ACK]),
            st.lists(values, max_size=8),
        ),
    )
)
def test_property_arbitrary_structures(obj: Any) -> None:
    _decode_or_wire_error(pack(obj))


@FAST
@given(st.data())
def test_property_mutated_ready(data: st.DataObject) -> None:
    fields = ready_fields(
        read_reqs=[["a", [1, 2], [3], 0, 0], ["b", [4]]], group_member_idx=1, tp_ratio=2
    )
    target = data.draw(st.sampled_from(["top", "entry", "legacy-entry", "block"]))
    new = data.draw(values)
    if target == "top":
        fields[data.draw(st.integers(0, len(fields) - 1))] = new
    elif target == "entry":
        fields[3][0][data.draw(st.integers(0, 4))] = new
    elif target == "legacy-entry":
        fields[3][1][data.draw(st.integers(0, 1))] = new
    else:
        fields[3][0][1][data.draw(st.integers(0, 1))] = new
    _decode_or_wire_error(pack(fields))
    assert layer_of(pack(fields)) in (None, fields[1])


@FAST
@given(st.data())
def test_property_mutated_layer_metadata(data: st.DataObject) -> None:
    layer = meta_map()
    key = data.draw(st.sampled_from(sorted(layer)))
    layer[key] = data.draw(values)
    _decode_or_wire_error(_blob_frame(pack({"l0": layer})))


# ------------------------------------------------------------------ test strength (issue 12)


@pytest.mark.parametrize("layout_version", [0, LAYOUT_VERSION + 1, 2**32 - 1])
def test_prefill_refuses_an_ack_of_any_other_layout_version(layout_version: int) -> None:
    """F3 on Prefill: a Decode that accepted but speaks another layout version places bytes
    differently; lower or higher, the handshake fails, naming both versions."""
    frame = pack([MF_META_ACK, True, PROTOCOL_VERSION, layout_version, ""])
    ack = decode_meta_reply(frame)
    assert ack == MfMetaAck(True, PROTOCOL_VERSION, layout_version)
    with pytest.raises(VersionMismatch, match=(
            f"decode speaks layout version {layout_version}, prefill speaks {LAYOUT_VERSION}")):
        check_meta_ack(ack)
    check_meta_ack(MfMetaAck(True, PROTOCOL_VERSION, LAYOUT_VERSION))  # ours is fine
    check_meta_ack(MfMetaAck(True, PROTOCOL_VERSION))  # and so is an ack without one


def test_a_layer_named_twice_in_mf_meta_is_refused_by_name() -> None:
    """A duplicate layer name in the MF_META map must not let the second layout silently
    replace the first (which one Prefill meant is unknowable): a WireError naming it."""
    first, second = meta_map(), meta_map(base_addrs=[3, 4])
    blob = b"\x83" + b"".join(pack(k) + pack(v) for k, v in (
        ("l0", first), ("model.layers.7", second), ("model.layers.7", first)))
    with pytest.raises(WireError, match=re.escape("duplicate layer name 'model.layers.7'")):
        decode(_blob_frame(blob))
    with pytest.raises(WireError, match=re.escape("duplicate layer name 'model.layers.7'")):
        decode_layer_metadata(blob)
    with pytest.raises(WireError, match="duplicate layer name 'l0'"):
        LayerTable([("l0", META_MAIN), ("l0", META_FULL)])
    assert meta_refusal(_blob_frame(blob), "dup") is not None  # refused, and answered (W1)


def test_encode_refuses_a_frame_over_max_frame_bytes() -> None:
    """W5 when sending: what every receiver must refuse is never sent; just below the
    limit is fine."""
    ext = "x" * MAX_ID_LEN  # 1027 bytes each on the wire
    fits = ReadReadyBatch(0, "l0", (), (ext,) * 65000)
    frame = encode(fits)
    assert MAX_FRAME_BYTES - (1 << 20) < len(frame) <= MAX_FRAME_BYTES
    too_big = ReadReadyBatch(0, "l0", (), (ext,) * 65535)
    with pytest.raises(WireError, match=(
            r"encoded ReadReadyBatch is \d+ bytes, over MAX_FRAME_BYTES=67108864")):
        encode(too_big)


def test_ready_frames_refuse_a_frame_over_max_frame_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """W5 when sending, on Prefill's per-layer path too: a READY of exactly the limit goes
    out, one byte more is refused, naming its size and the limit."""
    frames = ReadyFrames((ReadReq("a", (1, 2), (3,)),))
    size = len(frames.encode(7, "l7", ("a",)))
    monkeypatch.setattr(wire_encode, "MAX_FRAME_BYTES", size)
    assert len(frames.encode(7, "l7", ("a",))) == size
    monkeypatch.setattr(wire_encode, "MAX_FRAME_BYTES", size - 1)
    assert _refusal(lambda: frames.encode(7, "l7", ("a",))) == (
        f"encoded ReadReadyBatch is {size} bytes, over MAX_FRAME_BYTES={size - 1}")


# The decoder proves all block ids of a READY valid in one C-level pass and only falls back
# to the per-list checks when that pass fails; the refusal must be the per-list one, word
# for word, wherever the offending id sits (bools pass the C pass as 0/1 and are caught by
# the type check the fast path runs on lists holding 0 or 1).
@pytest.mark.parametrize(
    "bad", [True, False, 1.5, -1, -2**63, 2**31, 2**64 - 1, "3", None, [1], b"1"])
# A legacy entry has one id list, so it has no field 2.
@pytest.mark.parametrize(("field", "legacy"), [(1, False), (2, False), (1, True)])
# With and without real 0 and 1 ids beside the offending one (a bool hides among them).
@pytest.mark.parametrize("ids", [[0, 1, 5, 7], [3, 4, 5, 7]], ids=["with-0-1", "without"])
# A READY over 1 MiB is decoded entry by entry, its ids widened as they come: same words.
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_fast_id_check_refuses_like_the_per_list_check(bad: Any, field: int, legacy: bool,
                                                       ids: list[int], streamed: bool) -> None:
    entries: list[list[Any]] = [["req-a", list(ids), list(ids), 0, 0] for _ in range(3)]
    if legacy:
        entries = [["req-a", list(ids)] for _ in range(3)]
    if streamed:
        entries[0][1] = [9] * (1 << 20)  # the frame passes 1 MiB before the bad entry
    entries[1][field][2] = bad
    frame = msgpack.packb([wire.READ_READY_BATCH, 3, "layer", entries, [], 0, 1],
                          use_bin_type=True)
    assert (len(frame) > wire_decode._STREAM_BYTES) is streamed
    name = "p_main_block_ids" if field == 1 else "p_indexer_block_ids"
    with pytest.raises(WireError) as exc:
        wire.decode(frame)
    with pytest.raises(WireError) as exact:
        args = (entries[1][0], entries[1][1], entries[1][1]) if legacy else tuple(entries[1])
        ReadReq(*args)
    assert str(exc.value) == f"read_ready_batch: read_reqs[1]: {exact.value}"
    assert str(exact.value).startswith(f"{name}[2]: ")


def test_a_ready_may_carry_max_entries() -> None:
    entries = [["r", [1]]] * wire.MAX_ENTRIES
    msg = decode(pack(ready_fields(read_reqs=entries, done_ext_ids=[])))
    assert isinstance(msg, ReadReadyBatch) and len(msg.read_reqs) == wire.MAX_ENTRIES


def test_fast_id_check_keeps_valid_zero_and_one_ids() -> None:
    msg = ReadReadyBatch(2, "layer", (ReadReq("r", (0, 1, 2**31 - 1), (1, 0), 0, 0),
                                      ReadReq("s", (4,), (4,))), (), 0, 1)
    assert wire.decode(wire.encode(msg)) == msg


@pytest.mark.parametrize("legacy", [False, True])
def test_a_large_ready_decodes_entry_by_entry_into_narrow_arrays(legacy: bool) -> None:  # W2
    """Over 1 MiB a READY is decoded one entry at a time into id arrays as narrow as the
    ids allow (uint8 for ids below 256, wider only from the list that needs it), and the
    message is the one the whole frame decodes to; its encoding is the same bytes."""
    rng = np.random.default_rng(5)
    small = rng.integers(0, 128, 1 << 20).tolist()
    big = rng.integers(0, 2**31 - 1, 1000).tolist()
    reqs = [["r0", small], ["r1", big]] if legacy else [
        ["r0", small, small[:10], 0, 3], ["r1", big, [300, 2], 7, 0]]
    frame = msgpack.packb([wire.READ_READY_BATCH, 2, "layer", reqs, ["r0"], 0, 1],
                          use_bin_type=True)
    assert len(frame) > wire_decode._STREAM_BYTES
    msg = wire.decode(frame)
    assert msg == wire_decode._decode_ready(wire_decode._unpack(frame))  # the whole-frame path
    r0, r1 = msg.read_reqs
    assert r0.p_main_block_ids.dtype == np.uint8 and r0.p_main_block_ids.tolist() == small
    assert r1.p_main_block_ids.dtype == np.uint32 and r1.p_main_block_ids.tolist() == big
    assert not r0.p_main_block_ids.flags.writeable
    if not legacy:  # a legacy entry goes out in today's 5-field form
        assert encode(msg) == frame
    assert _refusal(lambda: wire.decode(frame + b"\x00")) == (
        "not valid msgpack: trailing bytes after the message")  # as the whole frame says


# ------------------------------------------------------------------ issue 20: the msgspec paths


@FAST
@given(messages)
def test_property_encode_writes_msgpacks_bytes(msg: Any) -> None:  # W2
    """msgspec encodes every message byte for byte as ``msgpack.packb(use_bin_type=True)``
    packs the same fields: the wire format upstream peers read does not change."""
    assert encode(msg) == pack(wire_encode._fields(msg))


def test_encode_takes_str_and_int_subclasses_and_numpy_ids_as_plain_values() -> None:
    class Name(str):
        pass

    class Index(int):
        pass

    req = ReadReq("r", (np.int64(5), 2**31 - 1), [np.uint8(3)], Index(2), 0)
    msg = ReadReadyBatch(Index(4), Name("layer"), (req,), (Name("r"),), 0, 1)
    assert encode(msg) == pack([READ_READY_BATCH, 4, "layer", [["r", [5, 2**31 - 1], [3], 2, 0]],
                                ["r"], 0, 1])
    assert encode(MfMeta(Name("h:1"), LAYERS)) == encode(MfMeta("h:1", LAYERS))


_edge_ids = st.sampled_from([0, 1, 127, 128, 255, 256, 65535, 65536, MAX_BLOCK_ID,
                             MAX_BLOCK_ID + 1, 2**32 - 1, 2**32, 2**64 - 1, -1, -(2**63),
                             True, False, 1.0, "1", None, b"\x01", [1]])


# the two ways the fast path reads id lists: the C scanner, and msgspec + array without it
_FAST_ROUTES = {"c": wire_decode._SCANNED, "python": wire_decode._LISTED}
if wire_decode._idscan is None:
    del _FAST_ROUTES["c"]  # test_the_id_scanner_is_built_where_setup_built_it says why


def test_the_id_scanner_is_built_where_setup_built_it() -> None:
    """.ci/setup builds the scanner and leaves a marker; a checkout set up that way must
    decode with it, never fall back to the slower route unnoticed."""
    from pathlib import Path

    # The running venv's marker, not the checkout's: the mutation tool runs these tests
    # from a staged copy of the checkout, with the checkout's venv.
    marker = Path(sys.prefix) / ".sfa_rd2h_idscan"
    if not marker.exists():
        pytest.skip("this venv was not made by .ci/setup, which builds the id scanner")
    assert wire_decode.ID_SCANNER == "c", "the C id scanner (spec/_idscan.c) is not built"


def _scan(lists: list[bytes]) -> tuple[list[int], list[int]] | None:
    got = wire_decode._idscan.scan(lists, MAX_BLOCK_ID, MAX_BLOCKS_PER_ENTRY)
    if got is None:
        return None
    return np.frombuffer(got[0], dtype=np.uint32).tolist(), got[1]


@pytest.mark.skipif(wire_decode._idscan is None, reason="the C id scanner is not built")
def test_the_scanner_reads_every_unsigned_form_and_passes_on_every_other() -> None:  # W2
    """Each unsigned width msgpack has, at its edges, is read as its value; signed forms of
    the same values, other types, ids past MAX_BLOCK_ID, short and overlong lists are left
    to the general path (None), which accepts or refuses them with its own words."""
    edges = [0, 127, 128, 255, 256, 65535, 65536, MAX_BLOCK_ID]
    one_list = msgpack.packb(edges)
    assert _scan([one_list, msgpack.packb([]), msgpack.packb([5])]) == (
        [*edges, 5], [len(edges), len(edges), len(edges) + 1])
    assert _scan([]) == ([], [])
    # 16- and 32-bit array headers, and an id packed in the 64-bit form
    assert _scan([msgpack.packb(list(range(20)))]) == (list(range(20)), [20])
    assert _scan([b"\xdd\x00\x00\x00\x01\xcf" + (7).to_bytes(8, "big")]) == ([7], [1])
    assert _scan([b"\xdc\x00\x02\x01\x02"]) == ([1, 2], [2])
    passed_on = [
        b"\x91\xd0\x05",  # int 8 holding 5: a legal int, but not a form Prefill writes
        b"\x91\xff",  # negative fixint -1
        b"\x91\xc3",  # True
        b"\x91\xc0",  # nil
        b"\x91\xca\x00\x00\x00\x00",  # float 32
        b"\x91\xa11",  # the string "1"
        b"\x91\xce\x80\x00\x00\x00",  # MAX_BLOCK_ID + 1
        b"\x91\xcf\x00\x00\x00\x01\x00\x00\x00\x00",  # 2**32
        b"\x92\x01",  # says two ids, holds one
        b"\x91\x01\x02",  # one id and a stray byte
        b"\x91\xcd\x01",  # an id cut short
        b"\xdd\xff\xff\xff\xff\x01",  # 4 billion ids declared in 6 bytes
        b"\xa3abc",  # a string, not a list
        b"",
    ]
    for raw in passed_on:
        assert _scan([one_list, raw]) is None, raw
    over = msgpack.packb(list(range(3)))
    assert wire_decode._idscan.scan([over], MAX_BLOCK_ID, 2) is None
    with pytest.raises(TypeError):
        wire_decode._idscan.scan([[1, 2]], MAX_BLOCK_ID, 2)


@FAST
@given(ids=st.lists(st.lists(st.integers(0, MAX_BLOCK_ID), max_size=40), max_size=6))
def test_property_both_id_readers_agree_with_msgpack(ids: list[list[int]]) -> None:  # W2
    raws = [msgpack.packb(one) for one in ids]
    flat = [i for one in ids for i in one]
    ends = np.cumsum([len(one) for one in ids], dtype=int).tolist()
    readers = [wire_decode._ids_listed(ids)]
    if "c" in _FAST_ROUTES:
        readers.append(wire_decode._ids_scanned(raws))
    for got, got_ends in readers:
        assert got.tolist() == flat and got_ends == ends and got.dtype == np.uint32
        assert not got.flags.writeable


@FAST
@given(st.data())
def test_property_fast_ready_path_accepts_only_what_the_general_path_accepts(
        data: st.DataObject) -> None:  # W2, W5
    """The msgspec path (``_ready_fast``) takes a READY only when the general path takes it
    too, as the same message; every offence it passes on is worded by the general path.
    Both ways of reading its ids (``_FAST_ROUTES``) are held to that."""
    entries = [[f"r{i}", data.draw(_block_ids), data.draw(_block_ids),
                data.draw(st.integers(0, MAX_BLOCK_ID)), data.draw(st.integers(0, 9))]
               for i in range(data.draw(st.integers(0, 3)))]
    fields = ready_fields(read_reqs=entries, done_ext_ids=["r0"], group_member_idx=1,
                          tp_ratio=2)
    where = data.draw(st.sampled_from(["none", "top", "entry", "id", "append"]))
    if where == "top":
        fields[data.draw(st.integers(1, len(fields) - 1))] = data.draw(values | _edge_ids)
    elif where == "entry" and entries:
        entries[0][data.draw(st.integers(0, 4))] = data.draw(values | _edge_ids)
    elif where == "id" and entries and entries[-1][1]:
        entries[-1][1][data.draw(st.integers(0, len(entries[-1][1]) - 1))] = data.draw(_edge_ids)
    elif where == "append" and entries:
        entries[0].append(data.draw(values))
    frame = pack(fields)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wire_decode, "_FAST", _FAST_ROUTES[data.draw(st.sampled_from(
            sorted(_FAST_ROUTES)))])
        fast = wire_decode._ready_fast(frame)
    if where == "none":
        assert fast is not None  # Prefill's own shape takes the fast path
    try:
        general = wire_decode._decode_ready(wire_decode._unpack(frame))
    except WireError:
        assert fast is None
        return
    if fast is not None:
        assert fast == general and fast.read_reqs == general.read_reqs
        assert all(not ids.flags.writeable for r in fast.read_reqs
                   for ids in (r.p_main_block_ids, r.p_indexer_block_ids))
    assert decode(frame) == general
