"""RD2H handshake and framing (spec/PROTOCOL.md F3, W1, W5): what surrounds the messages.

The F3 version check on both sides of MF_META and the reply Decode sends (the raw
``b"ACK"`` a 3-field peer expects, or a structured ``MF_META_ACK``), the refusal of an
MF_META that did not decode, the ROUTER envelope around a payload, and the external
request id both sides share.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgpack

from .errors import VersionMismatch, WireError
from .wire_decode import decode
from .wire_encode import encode
from .wire_fields import (
    LAYOUT_VERSION,
    LEGACY_PROTOCOL_VERSION,
    MAX_ID_LEN,
    MF_META,
    PROTOCOL_VERSION,
    RAW_ACK,
    show,
)
from .wire_messages import MfMeta, MfMetaAck


def check_versions(msg: MfMeta) -> MfMetaAck:
    """F3 on Decode: accept a peer whose versions equal ours, refuse anything else, and
    answer in the form the peer spoke (see ``MfMetaAck``).

    A 3-field MF_META carries no versions and is judged as version 1 of both.
    """
    pv = LEGACY_PROTOCOL_VERSION if msg.protocol_version is None else msg.protocol_version
    problems = []
    if pv != PROTOCOL_VERSION:
        problems.append(f"F3: protocol version {pv} from prefill, decode speaks {PROTOCOL_VERSION}")
    if msg.layout_version is not None and msg.layout_version != LAYOUT_VERSION:
        problems.append(f"F3: layout version {msg.layout_version} from prefill, decode speaks "
                        f"{LAYOUT_VERSION}")
    if msg.pp_size != 1:
        problems.append(f"X3: prefill pipeline rank {msg.pp_rank} of {msg.pp_size}; decode "
                        "serves pp_size 1 only")
    lv = None if msg.protocol_version is None or msg.layout_version is None else LAYOUT_VERSION
    return MfMetaAck(not problems, PROTOCOL_VERSION, lv, "; ".join(problems))


def encode_meta_reply(msg: MfMeta, ack: MfMetaAck) -> bytes:
    """The frame Decode sends back for ``msg``.

    A 3-field peer only understands the raw ``b"ACK"``; anything it would not understand
    (including a refusal) goes out structured, which such a peer reports as an unexpected
    reply: a loud failure, as F3 asks.
    """
    if msg.protocol_version is None and ack.accepted:
        return RAW_ACK
    return encode(ack)


def meta_refusal(payload: bytes, error: str) -> bytes | None:
    """The refusal Decode sends for an MF_META it could not decode (W5: a refusal is never
    silence), or None when the frame is not recognisably an MF_META. Never raises.

    Recognisably an MF_META means the frame starts as a msgpack array whose first element
    is the MF_META kind, read from a short prefix as ``layer_of`` reads a READY's layer: so
    a truncated or oversized MF_META is still answered, and nothing else is (a substring
    test also matched ``mf_meta_ack`` and refused, and disconnected, frames that were no
    MF_META at all).
    """
    try:
        if not isinstance(payload, bytes | bytearray | memoryview):
            return None
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=64, max_str_len=64,
                                    max_bin_len=64, max_array_len=2**32 - 1,
                                    max_map_len=64, max_ext_len=0)
        unpacker.feed(bytes(memoryview(payload)[:64]))
        n_fields = unpacker.read_array_header()
        if n_fields < 1 or unpacker.unpack() != MF_META:
            return None
    except Exception:
        return None
    old_form = n_fields == 5
    ack = MfMetaAck(False, PROTOCOL_VERSION, LAYOUT_VERSION if old_form else None,
                    f"W1: MF_META refused: {error}")
    return encode(ack)


def decode_meta_reply(frame: bytes) -> MfMetaAck:
    """Decode Decode's reply to MF_META (on Prefill).

    A raw ``b"ACK"`` comes from an upstream or legacy Decode, which speaks the legacy
    versions; it is reported as accepted at ``LEGACY_PROTOCOL_VERSION`` so that
    ``check_meta_ack`` refuses it once our version moves on.
    """
    if isinstance(frame, bytes | bytearray | memoryview) and bytes(frame) == RAW_ACK:
        return MfMetaAck(True, LEGACY_PROTOCOL_VERSION)
    msg = decode(frame)
    if not isinstance(msg, MfMetaAck):
        raise WireError(f"mf_meta reply: expected ACK or mf_meta_ack, got {type(msg).__name__}")
    return msg


def check_meta_ack(ack: MfMetaAck) -> None:
    """F3 on Prefill: raise ``VersionMismatch`` unless Decode accepted and matches us."""
    if not ack.accepted:
        raise VersionMismatch(f"F3: decode refused the handshake: {ack.error or 'no reason given'}")
    if ack.protocol_version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"F3: decode speaks protocol version {ack.protocol_version}, "
            f"prefill speaks {PROTOCOL_VERSION}"
        )
    if ack.layout_version is not None and ack.layout_version != LAYOUT_VERSION:
        raise VersionMismatch(
            f"F3: decode speaks layout version {ack.layout_version}, "
            f"prefill speaks {LAYOUT_VERSION}"
        )



def split_router_frames(frames: Sequence[bytes]) -> tuple[bytes, bytes]:
    """``[identity, b"", payload]`` or ``[identity, payload]`` -> ``(identity, payload)``."""
    if not isinstance(frames, Sequence) or isinstance(frames, bytes | bytearray | str):
        raise WireError(f"router frames: expected a sequence of frames, got {show(frames)}")
    if len(frames) < 2:
        raise WireError(f"router frames: expected identity and payload, got {len(frames)} frame(s)")
    out = []
    for i, frame in enumerate(frames):
        if not isinstance(frame, bytes | bytearray | memoryview):
            raise WireError(f"router frames[{i}]: expected bytes, got {show(frame)}")
        out.append(bytes(frame))
    identity = out[0]
    if not identity:
        raise WireError("router frames[0]: empty identity")
    payload = [f for f in out[1:] if f]
    if len(payload) != 1:
        raise WireError(
            f"router frames: expected exactly one non-empty payload frame, got {len(payload)}"
        )
    return identity, payload[0]



def external_request_id(vllm_request_id: str) -> str:
    """Strip vLLM's 9-character engine suffix (the id P and D share on the wire)."""
    if not isinstance(vllm_request_id, str):
        raise WireError(f"vllm request id: expected str, got {show(vllm_request_id)}")
    if len(vllm_request_id) <= 9:
        # The public connector returns such ids unchanged; here that would let two
        # different internal ids collide or map to an empty id, so it is refused.
        raise WireError(
            f"vllm request id {vllm_request_id!r}: must be longer than its 9-character "
            "engine suffix"
        )
    ext = vllm_request_id[:-9]
    if len(ext) > MAX_ID_LEN:
        raise WireError(
            f"vllm request id: external id of {len(ext)} characters exceeds {MAX_ID_LEN}"
        )
    return ext
