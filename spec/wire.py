"""RD2H wire schemas and codec (spec/PROTOCOL.md W1-W5, F3, and its wire encoding).

Everything here is a pure function or a frozen value: no sockets, no threads, no clock.
The runtime hands raw frames in and gets typed messages out (or a ``WireError``), and the
model checker drives the same code with simulated frames, so a codec bug shows up in both.

This module is the one import for every user (``from sfa_rd2h.spec import wire``); the code
lives in five parts, one purpose each:

* ``wire_fields``: message kinds, versions, limits (W5) and the checks of one field.
* ``wire_messages``: the message dataclasses, each validating itself at construction: the
  one validation site, so a value that decodes is a value that could have been built.
* ``wire_encode``: messages to frames, and ``ReadyFrames`` for one Prefill step's READYs.
* ``wire_decode``: frames to messages, of which only ``WireError`` escapes (W5), with the
  fast and streamed READY paths, ``layer_of`` for a READY that did not decode, and
  ``ready_body``, a READY's bytes past its layer.
* ``wire_handshake``: the F3 version checks and MF_META replies, the ROUTER envelope and
  external request ids.

The names below are bound to the parts' objects; a test that monkeypatches a module-level
name (a limit, a helper) patches it in the part that uses it, since rebinding it here
changes nothing there.

Wire encoding
-------------
The public vllm-ascend connector uses these exact encodings; speaking them lets this project
interoperate with (and be tested against) deployments of it.

* Message kinds are msgpack ``bytes``: ``b"mf_meta"``, ``b"read_ready_batch"``,
  ``b"read_done"``, ``b"read_failed"``. Each message is a msgpack array, the kind first.
* The reply to a 3-field MF_META is a single raw frame ``b"ACK"`` (not msgpack). A versioned
  handshake appends fields to MF_META (protocol version, ...) and gets a structured msgpack
  acknowledgement back; a legacy 3-field MF_META still gets the raw ``b"ACK"``.
* The ROUTER sees ``[identity, b"", payload]`` or ``[identity, payload]``; empty frames are
  dropped and exactly one payload frame must remain. Replies go to the same identity.
* The layer metadata of MF_META is itself a msgpack blob: a map from main layer name to
  ``{base_addrs, block_len, block_size_scale, tensor_group_idx: [int], main_tensor_count:
  int, has_indexer: bool}``. Tensor order: main K, main V, indexer, optional LIC8 scale. One
  external block of tensor *i* spans ``block_len[i] * block_size_scale[i]`` bytes.
* Legacy READY entries with only ``(ext_req_id, block_ids)`` use the same ids for main and
  indexer, with both destination offsets 0.
* Request ids: the external id is the vLLM request id without its 9-character engine suffix.
* Rendezvous (Decode to the metaserver, HTTP JSON POST): ``request_id`` (external),
  ``do_remote_prefill: false``, ``do_remote_decode: true``, ``remote_engine_id``,
  ``remote_host``, ``remote_port`` (the Decode base port), ``remote_tp_size``,
  ``remote_cached_tokens``. No Decode block ids.
"""

from __future__ import annotations

from .errors import VersionMismatch as VersionMismatch
from .errors import WireError as WireError
from .wire_decode import ID_SCANNER, decode, decode_layer_metadata, layer_of, ready_body
from .wire_encode import ReadyFrames as ReadyFrames
from .wire_encode import encode, encode_layer_metadata
from .wire_fields import (
    LAYOUT_VERSION,
    LEGACY_LAYOUT_VERSION,
    LEGACY_PROTOCOL_VERSION,
    MAX_ADDR,
    MAX_BLOCK_ID,
    MAX_BLOCK_LEN,
    MAX_BLOCK_SIZE_SCALE,
    MAX_BLOCKS_PER_ENTRY,
    MAX_ENTRIES,
    MAX_ERROR_LEN,
    MAX_FIELDS,
    MAX_FRAME_BYTES,
    MAX_GROUP_IDX,
    MAX_ID_LEN,
    MAX_LAYER_IDX,
    MAX_LAYERS,
    MAX_STR_LEN,
    MAX_TENSORS_PER_LAYER,
    MAX_TP_RATIO,
    MAX_VERSION,
    MF_META,
    MF_META_ACK,
    PROTOCOL_VERSION,
    RAW_ACK,
    READ_DONE,
    READ_FAILED,
    READ_READY_BATCH,
)
from .wire_handshake import (
    check_meta_ack,
    check_versions,
    decode_meta_reply,
    encode_meta_reply,
    external_request_id,
    meta_refusal,
    split_router_frames,
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
)

__all__ = [
    "ID_SCANNER",
    "LAYOUT_VERSION",
    "LEGACY_LAYOUT_VERSION",
    "LEGACY_PROTOCOL_VERSION",
    "MAX_ADDR",
    "MAX_BLOCK_ID",
    "MAX_BLOCK_LEN",
    "MAX_BLOCK_SIZE_SCALE",
    "MAX_BLOCKS_PER_ENTRY",
    "MAX_ENTRIES",
    "MAX_ERROR_LEN",
    "MAX_FIELDS",
    "MAX_FRAME_BYTES",
    "MAX_GROUP_IDX",
    "MAX_ID_LEN",
    "MAX_LAYER_IDX",
    "MAX_LAYERS",
    "MAX_STR_LEN",
    "MAX_TENSORS_PER_LAYER",
    "MAX_TP_RATIO",
    "MAX_VERSION",
    "MF_META",
    "MF_META_ACK",
    "PROTOCOL_VERSION",
    "RAW_ACK",
    "READ_DONE",
    "READ_FAILED",
    "READ_READY_BATCH",
    "LayerMeta",
    "LayerTable",
    "Message",
    "MfMeta",
    "MfMetaAck",
    "ReadDone",
    "ReadFailed",
    "ReadReadyBatch",
    "ReadReq",
    "check_meta_ack",
    "check_versions",
    "meta_refusal",
    "decode",
    "decode_layer_metadata",
    "decode_meta_reply",
    "encode",
    "encode_layer_metadata",
    "encode_meta_reply",
    "external_request_id",
    "layer_of",
    "ready_body",
    "split_router_frames",
]
