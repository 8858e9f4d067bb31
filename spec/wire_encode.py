"""RD2H frame encoding (spec/PROTOCOL.md W1-W3 and its wire encoding): messages to bytes.

A message goes out as one msgpack array, its kind first, packed by msgspec (byte for byte
what ``msgpack.packb(..., use_bin_type=True)`` writes, faster); the W1 layer metadata is a
msgpack map of its own. ``ReadyFrames`` writes the per-layer READYs of one Prefill step
from entries validated and packed once. Nothing over ``MAX_FRAME_BYTES`` is sent (W5).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import msgspec

from .errors import WireError
from .wire_fields import (
    MAX_FRAME_BYTES,
    MAX_LAYER_IDX,
    MAX_STR_LEN,
    MF_META,
    MF_META_ACK,
    READ_DONE,
    READ_FAILED,
    READ_READY_BATCH,
    check_int,
    check_str,
    show,
)
from .wire_messages import (
    LayerMeta,
    LayerTable,
    Message,
    MfMeta,
    MfMetaAck,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
    ReadReq,
    entry_fields,
)


def _layer_meta_map(meta: LayerMeta) -> dict[str, Any]:
    return {
        "base_addrs": meta.base_addrs,
        "block_len": meta.block_len,
        "block_size_scale": meta.block_size_scale,
        "tensor_group_idx": meta.tensor_group_idx,
        "main_tensor_count": meta.main_tensor_count,
        "has_indexer": meta.has_indexer,
    }


def encode_layer_metadata(layers: Mapping[str, LayerMeta]) -> bytes:
    """Encode the W1 metadata blob: a msgpack map name -> layout map, in the given order."""
    table = layers if isinstance(layers, LayerTable) else LayerTable(layers)
    return msgpack.packb(
        {name: _layer_meta_map(meta) for name, meta in table.items()}, use_bin_type=True
    )


def _fields(msg: Message) -> tuple[Any, ...]:
    # msgpack packs tuples and lists as arrays.
    if isinstance(msg, ReadReadyBatch):
        return (
            READ_READY_BATCH,
            msg.layer_idx,
            msg.layer_name,
            entry_fields(msg.read_reqs),
            msg.done_ext_ids,
            msg.group_member_idx,
            msg.tp_ratio,
        )
    if isinstance(msg, ReadDone):
        return (READ_DONE, msg.layer_idx)
    if isinstance(msg, ReadFailed):
        return (READ_FAILED, msg.layer_idx, msg.error)
    if isinstance(msg, MfMeta):
        blob = encode_layer_metadata(msg.layers)
        if msg.protocol_version is None:
            return (MF_META, msg.p_session, blob)
        if msg.layout_version is not None:
            return (MF_META, msg.p_session, blob, msg.protocol_version, msg.layout_version)
        return (MF_META, msg.p_session, blob, msg.protocol_version, msg.pp_rank, msg.pp_size)
    if isinstance(msg, MfMetaAck):
        if msg.layout_version is not None:
            return (MF_META_ACK, msg.accepted, msg.protocol_version, msg.layout_version,
                    msg.error)
        if msg.accepted:
            return (MF_META_ACK, msg.protocol_version)
        return (MF_META_ACK, 0, msg.protocol_version, msg.error)
    raise WireError(f"cannot encode {show(msg)}: not an RD2H message")


def _plain(obj: Any) -> Any:
    # msgspec encodes exact builtin types only; a message may hold a caller's str or int
    # subclass (or numpy ints in the id lists it keeps for encoding), which msgpack packed
    # as the plain value, and so does this.
    if isinstance(obj, str):
        return str.__str__(obj)
    if isinstance(obj, bytes):
        return bytes(obj)
    if not isinstance(obj, bool) and hasattr(type(obj), "__index__"):
        return operator.index(obj)
    raise TypeError(f"cannot encode {show(obj)}")


# msgspec's encoder writes what ``msgpack.packb(..., use_bin_type=True)`` writes for the
# types a message holds (ints, bools, None, str, bytes, tuples, lists; every int in its
# shortest form), byte for byte, about 4x faster; a test holds the two equal.
_pack = msgspec.msgpack.Encoder(enc_hook=_plain).encode


def encode(msg: Message) -> bytes:
    """Encode a message as one msgpack array frame (kinds as bin, strings as str)."""
    payload = _pack(_fields(msg))
    if len(payload) > MAX_FRAME_BYTES:
        # Refuse to send what every receiver must refuse (W5); the caller splits or fails.
        raise WireError(
            f"encoded {type(msg).__name__} is {len(payload)} bytes, over "
            f"MAX_FRAME_BYTES={MAX_FRAME_BYTES}"
        )
    return payload


class ReadyFrames:
    """The READYs of one Prefill step to one endpoint, for every layer, validated once.

    Within a step every layer's READY to an endpoint carries the same entries; only the
    layer index and name change, and the last layer adds the finished requests. The entries
    are validated (as a ``ReadReadyBatch``) and packed once here; ``encode`` then writes a
    layer's frame as the array header and the packed fields joined, which is byte for byte
    what ``encode(ReadReadyBatch(...))`` produces (msgpack packs an array as its header
    followed by each element's packing). A test holds the two equal.
    """

    __slots__ = ("read_reqs", "group_member_idx", "tp_ratio", "_entries", "_tail")

    def __init__(self, read_reqs: Sequence[ReadReq], group_member_idx: int = 0,
                 tp_ratio: int = 1) -> None:
        # Validate every field but the per-layer ones through the message's own checks.
        probe = ReadReadyBatch(0, "-", tuple(read_reqs), (), group_member_idx, tp_ratio)
        self.read_reqs = probe.read_reqs
        self.group_member_idx = probe.group_member_idx
        self.tp_ratio = probe.tp_ratio
        self._entries = _pack(_fields(probe)[3])
        self._tail = _pack(probe.group_member_idx) + _pack(probe.tp_ratio)

    def encode(self, layer_idx: int, layer_name: str, done_ext_ids: Sequence[str] = ()) -> bytes:
        """The frame of ``ReadReadyBatch(layer_idx, layer_name, read_reqs, done_ext_ids,
        group_member_idx, tp_ratio)``."""
        layer_idx = check_int(layer_idx, "layer_idx", 0, MAX_LAYER_IDX)
        check_str(layer_name, "layer_name", MAX_STR_LEN)
        done = tuple(done_ext_ids)
        if done:  # only the last layer of a step names finished requests
            ReadReadyBatch(layer_idx, layer_name, (), done)
        payload = b"".join((READY_HEADER, _pack((layer_idx, layer_name))[1:], self._entries,
                            _pack(done), self._tail))
        if len(payload) > MAX_FRAME_BYTES:
            raise WireError(f"encoded ReadReadyBatch is {len(payload)} bytes, over "
                            f"MAX_FRAME_BYTES={MAX_FRAME_BYTES}")
        return payload


# A 7-element fixarray and the packed kind: the first bytes of every current READY.
READY_HEADER = bytes([0x90 | 7]) + msgpack.packb(READ_READY_BATCH, use_bin_type=True)
