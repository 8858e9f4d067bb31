"""RD2H wire schemas and codec (spec/PROTOCOL.md W1-W5, F3, and its wire encoding).

Everything here is a pure function or a frozen value: no sockets, no threads, no clock.
The runtime hands raw frames in and gets typed messages out (or a ``WireError``), and the
model checker drives the same code with simulated frames, so a codec bug shows up in both.

Design choices that other modules rely on:

* **One validation site.** Each message dataclass validates (and normalises lists to
  tuples) in ``__post_init__``. The decoder only checks the *shape* of the msgpack array
  and then calls the constructors, so a value that decodes is exactly a value that could
  have been constructed, and nothing is validated twice on the hot path.
* **Only ``WireError`` escapes a decoder (W5).** msgpack, Unicode, overflow and recursion
  failures are translated; a final catch-all turns any remaining surprise into a
  ``WireError`` whose text starts with ``internal decoder error`` so tests can tell such a
  bug apart from a deliberate rejection.
* **Extensions append fields (W4).** Decoders accept and ignore fields beyond the ones
  they know (up to ``MAX_FIELDS``). Shapes that are neither a known legacy form nor a
  known form plus appendices are rejected rather than guessed, because guessing a missing
  destination offset or version would silently write to the wrong blocks (L1, F3).

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

import operator
import reprlib
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgpack
import msgspec
import numpy as np

from .errors import VersionMismatch, WireError

__all__ = [
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
    "split_router_frames",
]

# --- Message kinds ("Wire encoding"): msgpack bin, exactly as the public connector sends.
MF_META = b"mf_meta"
READ_READY_BATCH = b"read_ready_batch"
READ_DONE = b"read_done"
READ_FAILED = b"read_failed"
MF_META_ACK = b"mf_meta_ack"
# The legacy reply to a 3-field MF_META is this single raw frame, not msgpack.
RAW_ACK = b"ACK"

# --- Versions (F3). A peer that sends no version is the legacy protocol, which is
# version 1 of both by definition; kept separate from ours so that bumping ours later
# makes a legacy peer a mismatch instead of silently matching.
PROTOCOL_VERSION = 1
LAYOUT_VERSION = 1
LEGACY_PROTOCOL_VERSION = 1
LEGACY_LAYOUT_VERSION = 1

# --- Limits (W5). Generous for real deployments, small enough that a hostile or corrupt
# frame cannot make the receiver allocate or loop without bound.
MAX_FRAME_BYTES = 64 * 1024 * 1024
MAX_FIELDS = 32  # appended W4 fields beyond this are not an extension but garbage
MAX_STR_LEN = 4096  # layer names, session ids
MAX_ID_LEN = 1024  # external request ids
MAX_ERROR_LEN = 65536  # UTF-8 bytes of READ_FAILED / ack error text; cut on build
MAX_BLOCK_ID = 2**31 - 1  # vLLM block ids and destination starts are int32 on device
MAX_LAYER_IDX = 2**16 - 1
MAX_TP_RATIO = 1024
MAX_ENTRIES = 65536  # read_reqs / done_ext_ids per READY
MAX_BLOCKS_PER_ENTRY = 2**20
MAX_LAYERS = 4096
MAX_TENSORS_PER_LAYER = 16
MAX_ADDR = 2**64 - 1
MAX_BLOCK_LEN = 2**40
MAX_BLOCK_SIZE_SCALE = 2**16  # with MAX_BLOCK_LEN keeps ext_block_bytes below 2**63
MAX_GROUP_IDX = 2**16 - 1
MAX_VERSION = 2**32 - 1

# Keys of one layer's metadata map, in the order the public connector writes them.
_META_KEYS = (
    "base_addrs",
    "block_len",
    "block_size_scale",
    "tensor_group_idx",
    "main_tensor_count",
    "has_indexer",
)

# What every form of the layer map carries; the others have upstream's defaults.
_REQUIRED_META_KEYS = ("base_addrs", "block_len", "tensor_group_idx")

_INT_ONLY = frozenset({int})

# Short, bounded renderings of offending values: an error message must never cost more
# than the frame it describes (reprlib caps list lengths, string lengths and depth).
_repr = reprlib.Repr()
_repr.maxstring = 60
_repr.maxother = 60
_repr.maxlong = 40
_repr.maxlist = 6
_repr.maxtuple = 6
_repr.maxdict = 4
_repr.maxlevel = 3


def _show(value: object) -> str:
    return f"{type(value).__name__} {_repr.repr(value)}"


# --------------------------------------------------------------------------- validators
# Python's bool is an int subclass and msgpack decodes true/false to bool, so every int
# check below rejects bool explicitly: a `True` block id is a peer bug, not block 1.


def _int(value: Any, field: str, lo: int, hi: int) -> int:
    if type(value) is not int:
        # Decoded frames only ever hold plain ints; this slower path lets local callers
        # pass numpy integers, which have __index__, without letting bools or floats in.
        if isinstance(value, bool) or not hasattr(type(value), "__index__"):
            raise WireError(f"{field}: expected int, got {_show(value)}")
        value = operator.index(value)
    if value < lo or value > hi:
        raise WireError(f"{field}: {value} is out of range [{lo}, {hi}]")
    return value


def _int_tuple(value: Any, field: str, lo: int, hi: int, max_len: int) -> tuple[int, ...]:
    if type(value) is tuple:
        items = value
    elif type(value) is list:
        items = tuple(value)
    elif type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 1:
        # 1-D numpy array built by a local caller; tolist() yields plain Python scalars
        # (and floats stay floats, so they are still refused below).
        items = tuple(value.tolist())
    else:
        raise WireError(f"{field}: expected a list of ints, got {_show(value)}")
    if len(items) > max_len:
        raise WireError(f"{field}: {len(items)} items exceed the limit of {max_len}")
    if not items:
        return items
    # Hot path (READY block ids): one C-level pass over the element types, then C-level
    # min/max, instead of a Python-level check per block.
    if set(map(type, items)) != _INT_ONLY:
        items = tuple(_int(x, f"{field}[{i}]", lo, hi) for i, x in enumerate(items))
    lo_seen = min(items)
    hi_seen = max(items)
    if lo_seen < lo or hi_seen > hi:
        bad = lo_seen if lo_seen < lo else hi_seen
        raise WireError(f"{field}[{items.index(bad)}]: {bad} is out of range [{lo}, {hi}]")
    return items


def _str(value: Any, field: str, max_len: int, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise WireError(f"{field}: expected str, got {_show(value)}")
    if not value and not allow_empty:
        raise WireError(f"{field}: must not be empty")
    if len(value) > max_len:
        raise WireError(f"{field}: {len(value)} characters exceed the limit of {max_len}")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            # A lone surrogate cannot be sent as msgpack str; refuse it here, at
            # construction, instead of failing later inside the encoder.
            raise WireError(f"{field}: not encodable as UTF-8: {_show(value)}") from None
    return value


def _bool(value: Any, field: str) -> bool:
    if type(value) is not bool:
        raise WireError(f"{field}: expected bool, got {_show(value)}")
    return value


def _error_text(value: Any, field: str) -> str:
    # Error text is diagnostic only: over-long or unencodable text from a local exception
    # is repaired (lone surrogates -> "?", cut to MAX_ERROR_LEN UTF-8 bytes at a character
    # boundary) rather than refused, so building a failure reply can never itself fail
    # (S3/S4). Decoding still rejects longer text through the msgpack string limit.
    if not isinstance(value, str):
        raise WireError(f"{field}: expected str, got {_show(value)}")
    if value.isascii():
        return value[:MAX_ERROR_LEN]
    raw = value.encode("utf-8", "replace")
    if len(raw) <= MAX_ERROR_LEN and len(raw) == len(value.encode("utf-8", "ignore")):
        return value
    return raw[:MAX_ERROR_LEN].decode("utf-8", "ignore")


def _set(obj: object, name: str, value: object) -> None:
    # Frozen dataclasses normalise their own fields once, at construction.
    object.__setattr__(obj, name, value)


# --------------------------------------------------------------------------- layer meta


@dataclass(frozen=True, slots=True)
class LayerMeta:
    """One main layer's source cache layout on Prefill (W1).

    Tensor order: ``main_tensor_count`` main tensors (K, V, ...), then the indexer if
    ``has_indexer``, then optionally the indexer's LIC8 scale. A scale without an
    indexer is rejected: the scale quantises the indexer and has no meaning alone.
    """

    base_addrs: tuple[int, ...]
    block_len: tuple[int, ...]
    block_size_scale: tuple[int, ...]
    tensor_group_idx: tuple[int, ...]
    main_tensor_count: int
    has_indexer: bool

    def __post_init__(self) -> None:
        n_max = MAX_TENSORS_PER_LAYER
        addrs = _int_tuple(self.base_addrs, "base_addrs", 0, MAX_ADDR, n_max)
        lens = _int_tuple(self.block_len, "block_len", 1, MAX_BLOCK_LEN, n_max)
        scales = _int_tuple(
            self.block_size_scale, "block_size_scale", 1, MAX_BLOCK_SIZE_SCALE, n_max
        )
        groups = _int_tuple(self.tensor_group_idx, "tensor_group_idx", 0, MAX_GROUP_IDX, n_max)
        main = _int(self.main_tensor_count, "main_tensor_count", 1, n_max)
        has_indexer = _bool(self.has_indexer, "has_indexer")
        n = len(addrs)
        for name, seq in (
            ("block_len", lens),
            ("block_size_scale", scales),
            ("tensor_group_idx", groups),
        ):
            if len(seq) != n:
                raise WireError(
                    f"{name}: has {len(seq)} entries but base_addrs has {n}; "
                    "every per-tensor list must have one entry per tensor"
                )
        base = main + int(has_indexer)
        allowed = (base, base + 1) if has_indexer else (base,)
        if n not in allowed:
            want = " or ".join(str(a) for a in allowed)
            raise WireError(
                f"base_addrs: {n} tensors do not fit main_tensor_count={main}, "
                f"has_indexer={has_indexer} (expected {want})"
            )
        _set(self, "base_addrs", addrs)
        _set(self, "block_len", lens)
        _set(self, "block_size_scale", scales)
        _set(self, "tensor_group_idx", groups)
        _set(self, "main_tensor_count", main)

    @property
    def tensor_count(self) -> int:
        return len(self.base_addrs)

    @property
    def has_scale(self) -> bool:
        """True when a LIC8 scale tensor follows the indexer."""
        return len(self.base_addrs) == self.main_tensor_count + int(self.has_indexer) + 1

    @property
    def indexer_tensor_idx(self) -> int | None:
        return self.main_tensor_count if self.has_indexer else None

    @property
    def scale_tensor_idx(self) -> int | None:
        return self.main_tensor_count + 1 if self.has_scale else None

    @property
    def ext_block_bytes(self) -> tuple[int, ...]:
        """Bytes of one external block per tensor: ``block_len[i] * block_size_scale[i]``."""
        return tuple(b * s for b, s in zip(self.block_len, self.block_size_scale, strict=True))


class LayerTable(Mapping[str, LayerMeta]):
    """Immutable, hashable, insertion-ordered ``layer name -> LayerMeta`` map.

    Order is kept because it is the order P wrote and re-encoding must reproduce it.
    Equality and hashing follow ``dict`` semantics (order-insensitive), so
    ``msg.layers == {"l0": meta}`` works as a reader expects.
    """

    __slots__ = ("_data", "_hash")

    def __init__(self, layers: Mapping[str, LayerMeta] | Sequence[tuple[str, LayerMeta]]) -> None:
        pairs = layers.items() if isinstance(layers, Mapping) else layers
        data: dict[str, LayerMeta] = {}
        for name, meta in pairs:
            _str(name, "layer name", MAX_STR_LEN)
            if not isinstance(meta, LayerMeta):
                raise WireError(f"layers[{name!r}]: expected LayerMeta, got {_show(meta)}")
            if name in data:
                raise WireError(f"layers: duplicate layer name {name!r}")
            data[name] = meta
            if len(data) > MAX_LAYERS:
                raise WireError(f"layers: more than {MAX_LAYERS} layers")
        self._data = data
        self._hash: int | None = None

    def __getitem__(self, name: str) -> LayerMeta:
        return self._data[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LayerTable):
            return self._data == other._data
        if isinstance(other, Mapping):
            return self._data == dict(other.items())
        return NotImplemented

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._data.items()))
        return self._hash

    def __repr__(self) -> str:
        return f"LayerTable({self._data!r})"


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


class _Pairs(list):  # type: ignore[type-arg]
    """A decoded msgpack map kept as its key/value pairs, so duplicates are visible."""


def _unpack(data: bytes, *, pairs: bool = False) -> Any:
    n = len(data)
    if n > MAX_FRAME_BYTES:
        raise WireError(f"frame of {n} bytes exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}")
    try:
        # Container limits are capped by the input length as well: msgpack preallocates a
        # container from its declared size, and a 10-byte frame must not reserve megabytes.
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            object_pairs_hook=_Pairs if pairs else None,
            max_str_len=min(MAX_ERROR_LEN, n),
            max_bin_len=n,
            max_array_len=min(MAX_BLOCKS_PER_ENTRY, n),
            max_map_len=min(MAX_LAYERS, n),
            max_ext_len=0,
        )
    except msgpack.ExtraData:
        raise WireError("not valid msgpack: trailing bytes after the message") from None
    except msgpack.StackError:
        raise WireError("not valid msgpack: nested too deeply") from None
    except msgpack.FormatError:
        raise WireError("not valid msgpack: reserved or invalid format byte") from None
    except Exception as exc:  # msgpack raises many unrelated types; all mean "bad bytes"
        raise WireError(f"not valid msgpack: {type(exc).__name__}: {exc}") from None


def _layer_from_pairs(fields: Any) -> LayerMeta:
    if type(fields) is not _Pairs:
        raise WireError(f"expected a map of layout fields, got {_show(fields)}")
    values: dict[str, Any] = {}
    for key, value in fields:
        if key not in _META_KEYS:
            # Unknown layout fields are refused, not skipped: a field we do not understand
            # may change where bytes live, and F3 says never to discover that as corruption.
            raise WireError(f"unknown field {_show(key)}; expected only {', '.join(_META_KEYS)}")
        if key in values:
            raise WireError(f"duplicate field {key!r}")
        values[key] = value
    missing = [k for k in _REQUIRED_META_KEYS if k not in values]
    if missing:
        raise WireError(f"missing field(s) {', '.join(missing)}")
    # The predecessor connector sent only the required keys; upstream Decode fills the
    # rest with these defaults, and so do we.
    if "block_size_scale" not in values and type(values["base_addrs"]) is list:
        values["block_size_scale"] = [1] * len(values["base_addrs"])
    values.setdefault("main_tensor_count", 2)
    if ("has_indexer" not in values and type(values["base_addrs"]) is list
            and type(values["main_tensor_count"]) is int):
        values["has_indexer"] = len(values["base_addrs"]) > values["main_tensor_count"]
    return LayerMeta(**values)


def _decode_layer_table(blob: Any) -> LayerTable:
    if not isinstance(blob, bytes | bytearray | memoryview):
        raise WireError(f"layer metadata: expected msgpack bytes, got {_show(blob)}")
    try:
        top = _unpack(bytes(blob), pairs=True)
    except WireError as exc:
        raise WireError(f"layer metadata: {exc}") from None
    if type(top) is not _Pairs:
        raise WireError(f"layer metadata: expected a map of layer name -> layout, got {_show(top)}")
    pairs: list[tuple[str, LayerMeta]] = []
    for name, fields in top:
        _str(name, "layer metadata: layer name", MAX_STR_LEN)
        try:
            pairs.append((name, _layer_from_pairs(fields)))
        except WireError as exc:
            raise WireError(f"layer metadata[{name!r}]: {exc}") from None
    return LayerTable(pairs)


def decode_layer_metadata(blob: bytes) -> dict[str, LayerMeta]:
    """Decode a W1 metadata blob; raises only ``WireError``."""
    try:
        return dict(_decode_layer_table(blob).items())
    except WireError:
        raise
    except Exception as exc:  # W5 backstop, see module docstring
        raise WireError(f"internal decoder error: {type(exc).__name__}: {exc}") from None


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class MfMeta:
    """W1 MF_META in the three forms met in the field, told apart by their fields:

    * ``(MF_META, p_session, blob)``: upstream and legacy (``protocol_version`` is None);
      answered by the raw ``b"ACK"``.
    * ``(MF_META, p_session, blob, protocol_version, pp_rank, pp_size)``: the versioned
      form the fork speaks and this project sends; upstream reads its first three fields.
    * ``(MF_META, p_session, blob, protocol_version, layout_version)``: this project's
      earlier form (``layout_version`` given), still understood for rolling upgrades.
    """

    p_session: str
    layers: Mapping[str, LayerMeta]
    protocol_version: int | None = None
    layout_version: int | None = None
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        _str(self.p_session, "p_session", MAX_STR_LEN)
        if not isinstance(self.layers, LayerTable):
            if not isinstance(self.layers, Mapping):
                raise WireError(f"layers: expected a mapping, got {_show(self.layers)}")
            _set(self, "layers", LayerTable(self.layers))
        pv, lv = self.protocol_version, self.layout_version
        if pv is None and lv is not None:
            raise WireError(f"layout_version {lv!r} given without a protocol_version")
        if pv is not None:
            _set(self, "protocol_version", _int(pv, "protocol_version", 0, MAX_VERSION))
        if lv is not None:
            _set(self, "layout_version", _int(lv, "layout_version", 0, MAX_VERSION))
        _set(self, "pp_size", _int(self.pp_size, "pp_size", 1, MAX_GROUP_IDX))
        _set(self, "pp_rank", _int(self.pp_rank, "pp_rank", 0, self.pp_size - 1))

    @property
    def is_legacy(self) -> bool:
        return self.protocol_version is None


@dataclass(frozen=True, slots=True)
class MfMetaAck:
    """Decode's answer to a versioned MF_META; the versions are the *replying* Decode's.

    Sent in the form the MF_META came in: ``(MF_META_ACK, protocol_version)`` accepts a
    6-field MF_META exactly as the fork expects, ``(MF_META_ACK, 0, protocol_version,
    error)`` refuses it (a 0 the fork reports as an unexpected ack, never silence), and
    ``(MF_META_ACK, accepted, protocol_version, layout_version, error)`` answers the
    project's earlier 5-field form (``layout_version`` given).
    """

    accepted: bool
    protocol_version: int
    layout_version: int | None = None
    error: str = ""

    def __post_init__(self) -> None:
        _bool(self.accepted, "accepted")
        _set(
            self,
            "protocol_version",
            _int(self.protocol_version, "protocol_version", 0, MAX_VERSION),
        )
        if self.layout_version is not None:
            _set(self, "layout_version",
                 _int(self.layout_version, "layout_version", 0, MAX_VERSION))
        _set(self, "error", _error_text(self.error, "error"))
        if self.accepted and self.layout_version is None and self.protocol_version == 0:
            raise WireError("an accepting mf_meta_ack needs a protocol_version >= 1")


@dataclass(frozen=True, slots=True, eq=False)
class ReadReq:
    """One W2 ``read_reqs`` entry: P source block ids and D destination start offsets.

    The block ids are read-only 1-D arrays of unsigned ints, in the narrowest of uint8,
    uint16 and uint32 that holds them (ids are below 2**31): a decoded READY keeps each
    id in at most the bytes it took on the wire, and the Decode core cuts, checks and
    plans from the arrays without converting them. Lists and tuples of ints are taken and
    checked as before; equality compares the ids by value, whatever their dtype.
    """

    ext_req_id: str
    p_main_block_ids: np.ndarray
    p_indexer_block_ids: np.ndarray
    main_dest_start: int = 0
    indexer_dest_start: int = 0
    # The checked lists a local caller gave, kept for encoding (msgpack packs them as they
    # are, where an array would first become a list); None for a decoded entry.
    _given: tuple[Any, Any] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _str(self.ext_req_id, "ext_req_id", MAX_ID_LEN)
        main = _id_array(self.p_main_block_ids, "p_main_block_ids")
        if self.p_indexer_block_ids is self.p_main_block_ids:
            indexer = main  # legacy entries share one list; validate it once
        else:
            indexer = _id_array(self.p_indexer_block_ids, "p_indexer_block_ids")
        given = (self.p_main_block_ids, self.p_indexer_block_ids)
        if all(type(g) is tuple or type(g) is list for g in given):
            # checked by _id_array (plain ints in range); copied, so no caller can change them
            _set(self, "_given", tuple(g if type(g) is tuple else tuple(g) for g in given))
        _set(self, "p_main_block_ids", main)
        _set(self, "p_indexer_block_ids", indexer)
        _set(
            self, "main_dest_start", _int(self.main_dest_start, "main_dest_start", 0, MAX_BLOCK_ID)
        )
        _set(
            self,
            "indexer_dest_start",
            _int(self.indexer_dest_start, "indexer_dest_start", 0, MAX_BLOCK_ID),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ReadReq):
            return NotImplemented
        return (self.ext_req_id == other.ext_req_id
                and self.main_dest_start == other.main_dest_start
                and self.indexer_dest_start == other.indexer_dest_start
                and np.array_equal(self.p_main_block_ids, other.p_main_block_ids)
                and np.array_equal(self.p_indexer_block_ids, other.p_indexer_block_ids))

    def __hash__(self) -> int:
        # equal entries have equal ids whatever their dtype, so only dtype-free parts
        return hash((self.ext_req_id, self.main_dest_start, self.indexer_dest_start,
                     len(self.p_main_block_ids), len(self.p_indexer_block_ids)))

    def __repr__(self) -> str:
        return (f"ReadReq({self.ext_req_id!r}, {_repr.repr(self.p_main_block_ids.tolist())}, "
                f"{_repr.repr(self.p_indexer_block_ids.tolist())}, {self.main_dest_start}, "
                f"{self.indexer_dest_start})")


def _narrow(top: int) -> np.dtype:
    """The narrowest unsigned dtype for ids up to ``top`` (at most MAX_BLOCK_ID)."""
    return _U8 if top < 256 else _U16 if top < 65536 else _U32


_U8, _U16, _U32 = np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32)


def _id_array(value: Any, field: str) -> np.ndarray:
    """Block ids given by a local caller as a read-only narrow array, checked as
    ``_int_tuple`` checks them (the same refusals, the same words)."""
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu":
        if value.size > MAX_BLOCKS_PER_ENTRY:
            raise WireError(f"{field}: {value.size} items exceed the limit of "
                            f"{MAX_BLOCKS_PER_ENTRY}")
        top = int(value.max()) if value.size else 0
        if value.size and (int(value.min()) < 0 or top > MAX_BLOCK_ID):
            _int_tuple(value, field, 0, MAX_BLOCK_ID, MAX_BLOCKS_PER_ENTRY)  # raises, worded
        if not value.flags.writeable and value.dtype.kind == "u" and \
                value.dtype.itemsize <= 4:
            return value
        ids: Any = value
    else:
        ids = _int_tuple(value, field, 0, MAX_BLOCK_ID, MAX_BLOCKS_PER_ENTRY)
        top = max(ids) if ids else 0
    arr = np.array(ids, dtype=_narrow(top))
    arr.flags.writeable = False
    return arr


@dataclass(frozen=True, slots=True)
class ReadReadyBatch:
    """W2 READY for one layer and one Decode endpoint; always encoded with 7 fields."""

    layer_idx: int
    layer_name: str
    read_reqs: tuple[ReadReq, ...]
    done_ext_ids: tuple[str, ...]
    group_member_idx: int = 0
    tp_ratio: int = 1

    def __post_init__(self) -> None:
        _set(self, "layer_idx", _int(self.layer_idx, "layer_idx", 0, MAX_LAYER_IDX))
        _str(self.layer_name, "layer_name", MAX_STR_LEN)
        reqs = self.read_reqs
        if type(reqs) is not tuple:
            if type(reqs) is not list:
                raise WireError(f"read_reqs: expected a list, got {_show(reqs)}")
            reqs = tuple(reqs)
        if len(reqs) > MAX_ENTRIES:
            raise WireError(f"read_reqs: {len(reqs)} entries exceed the limit of {MAX_ENTRIES}")
        for i, req in enumerate(reqs):
            if not isinstance(req, ReadReq):
                raise WireError(f"read_reqs[{i}]: expected ReadReq, got {_show(req)}")
        done = self.done_ext_ids
        if type(done) is not tuple:
            if type(done) is not list:
                raise WireError(f"done_ext_ids: expected a list, got {_show(done)}")
            done = tuple(done)
        if len(done) > MAX_ENTRIES:
            raise WireError(f"done_ext_ids: {len(done)} ids exceed the limit of {MAX_ENTRIES}")
        for i, ext_id in enumerate(done):
            _str(ext_id, f"done_ext_ids[{i}]", MAX_ID_LEN)
        ratio = _int(self.tp_ratio, "tp_ratio", 1, MAX_TP_RATIO)
        member = _int(self.group_member_idx, "group_member_idx", 0, MAX_TP_RATIO - 1)
        if member >= ratio:
            # T1: member index = p_rank % ratio, so it is always below the ratio.
            raise WireError(f"group_member_idx: {member} must be below tp_ratio={ratio}")
        _set(self, "read_reqs", reqs)
        _set(self, "done_ext_ids", done)
        _set(self, "tp_ratio", ratio)
        _set(self, "group_member_idx", member)


@dataclass(frozen=True, slots=True)
class ReadDone:
    """W3 ``(READ_DONE, layer_idx)``."""

    layer_idx: int

    def __post_init__(self) -> None:
        _set(self, "layer_idx", _int(self.layer_idx, "layer_idx", 0, MAX_LAYER_IDX))


@dataclass(frozen=True, slots=True)
class ReadFailed:
    """W3 ``(READ_FAILED, layer_idx, error)``; error text is truncated to MAX_ERROR_LEN."""

    layer_idx: int
    error: str

    def __post_init__(self) -> None:
        _set(self, "layer_idx", _int(self.layer_idx, "layer_idx", 0, MAX_LAYER_IDX))
        _set(self, "error", _error_text(self.error, "error"))


Message = MfMeta | ReadReadyBatch | ReadDone | ReadFailed | MfMetaAck


# --------------------------------------------------------------------------- encoding


def _fields(msg: Message) -> tuple[Any, ...]:
    # msgpack packs tuples and lists as arrays; block id arrays go out as lists of ints.
    if isinstance(msg, ReadReadyBatch):
        return (
            READ_READY_BATCH,
            msg.layer_idx,
            msg.layer_name,
            tuple(
                (
                    r.ext_req_id,
                    *(r._given or (r.p_main_block_ids.tolist(), r.p_indexer_block_ids.tolist())),
                    r.main_dest_start,
                    r.indexer_dest_start,
                )
                for r in msg.read_reqs
            ),
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
    raise WireError(f"cannot encode {_show(msg)}: not an RD2H message")


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
    raise TypeError(f"cannot encode {_show(obj)}")


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
        layer_idx = _int(layer_idx, "layer_idx", 0, MAX_LAYER_IDX)
        _str(layer_name, "layer_name", MAX_STR_LEN)
        done = tuple(done_ext_ids)
        if done:  # only the last layer of a step names finished requests
            ReadReadyBatch(layer_idx, layer_name, (), done)
        payload = b"".join((_READY_HEADER, _pack((layer_idx, layer_name))[1:], self._entries,
                            _pack(done), self._tail))
        if len(payload) > MAX_FRAME_BYTES:
            raise WireError(f"encoded ReadReadyBatch is {len(payload)} bytes, over "
                            f"MAX_FRAME_BYTES={MAX_FRAME_BYTES}")
        return payload


# A 7-element fixarray and the packed kind: the first bytes of every current READY.
_READY_HEADER = bytes([0x90 | 7]) + msgpack.packb(READ_READY_BATCH, use_bin_type=True)
_READY_HEAD_LEN = len(_READY_HEADER)


# --------------------------------------------------------------------------- decoding


def _arity(name: str, fields: list[Any], allowed: str, ok: bool) -> None:
    if not ok:
        raise WireError(f"{name}: expected {allowed} fields, got {len(fields)}")


def _decode_mf_meta(f: list[Any]) -> MfMeta:
    n = len(f)
    # 3 = upstream/legacy; 5 = this project's earlier form; 6+ = the versioned form (+ W4
    # appendices). 4 would be a protocol version with nothing to place it, so it is refused.
    _arity("mf_meta", f, "3, 5 or at least 6", n == 3 or n >= 5)
    layers = _decode_layer_table(f[2])
    if n == 3:
        return MfMeta(f[1], layers)
    if n == 5:
        return MfMeta(f[1], layers, f[3], f[4])
    if type(f[5]) is not int or type(f[4]) is not int:
        raise WireError(f"mf_meta: pp_rank/pp_size must be ints, got {_show(f[4:6])}")
    if not 1 <= f[5] <= MAX_GROUP_IDX or not 0 <= f[4] < f[5]:
        raise WireError(f"mf_meta: pp_rank={f[4]} is not a rank of pp_size={f[5]}")
    return MfMeta(f[1], layers, f[3], None, f[4], f[5])


class _IdBuffer:
    """The block ids of one READY, list by list, each list appended in C (``array.extend``)
    to the narrowest of three flat arrays that takes it (``B``, ``H``, ``I``), so an id
    costs at most the bytes it took on the wire. A list that no array takes (an id not an
    int, negative or too large) or that holds a bool (which ``array`` takes as 0 or 1) goes
    through ``_int_tuple``, which refuses it with the words a constructed ``ReadReq`` uses;
    ids above MAX_BLOCK_ID, which ``I`` holds, are found by a max over the lists in it."""

    __slots__ = ("bufs", "spans")

    def __init__(self) -> None:
        self.bufs = {code: array(code) for code in _ARRAY_DTYPES}
        self.spans: list[tuple[str, int, int]] = []

    def add(self, ids: Any, field: str) -> int:
        """Append one list; returns its index among the lists added."""
        if type(ids) is not list:
            _int_tuple(ids, field, 0, MAX_BLOCK_ID, MAX_BLOCKS_PER_ENTRY)  # raises, worded
        if len(ids) > MAX_BLOCKS_PER_ENTRY:
            raise WireError(f"{field}: {len(ids)} items exceed the limit of "
                            f"{MAX_BLOCKS_PER_ENTRY}")
        for code, buf in self.bufs.items():
            start = len(buf)
            try:
                buf.extend(ids)
            except OverflowError:
                del buf[start:]
                continue
            except TypeError:
                del buf[start:]
                break
            # array takes True and False as 1 and 0; only a list holding a 0 or 1 can hide one
            if (0 in ids or 1 in ids) and set(map(type, ids)) != _INT_ONLY:
                del buf[start:]
                break
            self.spans.append((code, start, len(buf)))
            return len(self.spans) - 1
        _int_tuple(ids, field, 0, MAX_BLOCK_ID, MAX_BLOCKS_PER_ENTRY)  # raises, worded
        raise AssertionError("unreachable: _int_tuple accepted what no array took")

    def check_wide(self) -> int | None:
        """The index of the first list holding an id above MAX_BLOCK_ID, or None."""
        wide = np.frombuffer(self.bufs["I"], dtype=_U32)
        if not wide.size or int(wide.max()) <= MAX_BLOCK_ID:
            return None
        return next(i for i, (code, a, b) in enumerate(self.spans)
                    if code == "I" and b > a and int(wide[a:b].max()) > MAX_BLOCK_ID)

    def views(self) -> list[np.ndarray]:
        flats = {}
        for code, buf in self.bufs.items():
            flats[code] = np.frombuffer(buf, dtype=_ARRAY_DTYPES[code])
            flats[code].flags.writeable = False
        return [flats[code][a:b] for code, a, b in self.spans]


# array typecodes of _IdBuffer and their numpy dtypes (I is 4 bytes wherever numpy runs)
_ARRAY_DTYPES = {"B": _U8, "H": _U16, "I": _U32}
assert array("I").itemsize == 4


# --- The READY as Prefill writes it, decoded by msgspec (typed, constrained, in C).
# Every current READY is a 7-field array of 5-field entries; msgspec decodes exactly that
# shape, with every bound this module checks (lengths, ranges, non-empty ids; bools are
# not ints to msgspec) checked as it goes, and the ids as plain lists that ``array``
# takes in C. Anything it refuses - or any other shape: legacy forms, W4 appendices -
# goes to the general path below, which decides again and words any refusal, so this
# path changes only speed: what it accepts the general path accepts as the same message.
_Start = Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_ID)]
_ExtId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)]
_IdList = Annotated[list[int], msgspec.Meta(max_length=MAX_BLOCKS_PER_ENTRY)]


class _ReadyEntry(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    ext_req_id: _ExtId
    main: _IdList
    indexer: _IdList
    main_dest_start: _Start
    indexer_dest_start: _Start


class _Ready(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    kind: bytes
    layer_idx: Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYER_IDX)]
    layer_name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STR_LEN)]
    read_reqs: Annotated[list[_ReadyEntry], msgspec.Meta(max_length=MAX_ENTRIES)]
    done_ext_ids: Annotated[list[_ExtId], msgspec.Meta(max_length=MAX_ENTRIES)]
    group_member_idx: Annotated[int, msgspec.Meta(ge=0, le=MAX_TP_RATIO - 1)]
    tp_ratio: Annotated[int, msgspec.Meta(ge=1, le=MAX_TP_RATIO)]


_READY_DECODER = msgspec.msgpack.Decoder(_Ready)

# Slot setters of the frozen messages: a decoded READY was checked field by field above,
# so its objects are filled in directly instead of validated again by ``__post_init__``.
_REQ_SET = tuple(ReadReq.__dict__[f].__set__ for f in (
    "ext_req_id", "p_main_block_ids", "p_indexer_block_ids", "main_dest_start",
    "indexer_dest_start", "_given"))
_BATCH_SET = tuple(ReadReadyBatch.__dict__[f].__set__ for f in (
    "layer_idx", "layer_name", "read_reqs", "done_ext_ids", "group_member_idx", "tp_ratio"))


def _ready_fast(payload: bytes | bytearray | memoryview) -> ReadReadyBatch | None:
    """A READY in the shape Prefill writes, or None for the general path to decide.

    The ids go into two flat ``I`` arrays in C, every main list after the other and every
    indexer list after the other, and each entry holds read-only views of them; ``array``
    refuses negative ids and ids of 2**32 and over, a max over each array the rest."""
    try:
        ready = _READY_DECODER.decode(payload)
    except msgspec.DecodeError:  # ValidationError too: the general path words it
        return None
    if ready.group_member_idx >= ready.tp_ratio:
        return None
    entries = ready.read_reqs
    mains, indexers = array("I"), array("I")
    add_main, add_indexer = mains.extend, indexers.extend
    try:
        for e in entries:
            add_main(e.main)
            add_indexer(e.indexer)
    except OverflowError:
        return None
    flat_main = np.frombuffer(mains, dtype=_U32) if mains else _NO_IDS
    flat_indexer = np.frombuffer(indexers, dtype=_U32) if indexers else _NO_IDS
    if (flat_main.size and int(flat_main.max()) > MAX_BLOCK_ID) or (
            flat_indexer.size and int(flat_indexer.max()) > MAX_BLOCK_ID):
        return None
    flat_main.flags.writeable = False
    flat_indexer.flags.writeable = False
    set_ext, set_main, set_indexer, set_main_start, set_indexer_start, set_given = _REQ_SET
    new = object.__new__
    reqs = []
    at_main = at_indexer = 0
    for e in entries:
        req = new(ReadReq)
        set_ext(req, e.ext_req_id)
        end = at_main + len(e.main)
        set_main(req, flat_main[at_main:end])
        at_main = end
        end = at_indexer + len(e.indexer)
        set_indexer(req, flat_indexer[at_indexer:end])
        at_indexer = end
        set_main_start(req, e.main_dest_start)
        set_indexer_start(req, e.indexer_dest_start)
        set_given(req, None)
        reqs.append(req)
    msg = new(ReadReadyBatch)
    for setter, value in zip(_BATCH_SET, (
            ready.layer_idx, ready.layer_name, tuple(reqs), tuple(ready.done_ext_ids),
            ready.group_member_idx, ready.tp_ratio), strict=True):
        setter(msg, value)
    return msg


_NO_IDS = np.zeros(0, dtype=_U32)
_NO_IDS.flags.writeable = False


def _decode_entries(raw_reqs: Iterable[Any]) -> tuple[ReadReq, ...]:
    """The entries of one READY, their ids in one flat array (``_IdBuffer``) of which each
    entry holds views; every field checked as ``ReadReq`` checks it, in the same order
    (ext_req_id, main ids, indexer ids, starts), the first offence named with its entry."""
    ids = _IdBuffer()
    rows: list[tuple[str, int, int, int, int]] = []
    fields: list[tuple[int, str]] = []  # per list: (entry, field name), for a late refusal
    i = -1
    try:
        for i, entry in enumerate(raw_reqs):
            if type(entry) is not list:
                raise WireError(f"expected an array, got {_show(entry)}")
            n = len(entry)
            # 3 or 4 fields would leave a destination offset to guess; guessing 0 writes
            # into the wrong D blocks, so those shapes are refused (W5) instead of defaulted.
            if n != 2:
                _arity("read_req", entry, "2 (legacy) or at least 5", n >= 5)
            ext = _str(entry[0], "ext_req_id", MAX_ID_LEN)
            main = ids.add(entry[1], "p_main_block_ids")
            fields.append((i, "p_main_block_ids"))
            if n == 2:  # legacy (ext_req_id, block_ids): one list for both, offsets 0
                rows.append((ext, main, main, 0, 0))
                continue
            idx = ids.add(entry[2], "p_indexer_block_ids")
            fields.append((i, "p_indexer_block_ids"))
            rows.append((ext, main, idx, _int(entry[3], "main_dest_start", 0, MAX_BLOCK_ID),
                         _int(entry[4], "indexer_dest_start", 0, MAX_BLOCK_ID)))
    except WireError as exc:
        _refuse_wide(ids, fields, upto=i)
        raise WireError(f"read_reqs[{i}]: {exc}") from None
    _refuse_wide(ids, fields, upto=None)
    views = ids.views()
    out = []
    new = object.__new__
    for ext, main, idx, m_start, i_start in rows:
        req = new(ReadReq)
        _set(req, "ext_req_id", ext)
        _set(req, "p_main_block_ids", views[main])
        _set(req, "p_indexer_block_ids", views[idx])
        _set(req, "main_dest_start", m_start)
        _set(req, "indexer_dest_start", i_start)
        _set(req, "_given", None)
        out.append(req)
    return tuple(out)


def _refuse_wide(ids: _IdBuffer, fields: list[tuple[int, str]], upto: int | None) -> None:
    """Refuse the first list, of entries before ``upto``, holding an id above MAX_BLOCK_ID,
    exactly as ``_int_tuple`` words it (those ids fit the ``I`` array, so only here are
    they seen)."""
    bad = ids.check_wide()
    if bad is None or (upto is not None and fields[bad][0] >= upto):
        return
    entry, field = fields[bad]
    _, start, end = ids.spans[bad]
    try:
        _int_tuple(np.frombuffer(ids.bufs["I"], dtype=_U32)[start:end], field, 0,
                   MAX_BLOCK_ID, MAX_BLOCKS_PER_ENTRY)
    except WireError as exc:
        raise WireError(f"read_reqs[{entry}]: {exc}") from None


def _decode_ready(f: list[Any], decoded: tuple[ReadReq, ...] | None = None) -> ReadReadyBatch:
    """``f``: the READY's fields; ``decoded``: its entries when ``_stream_ready`` decoded
    them already (``f[3]`` is then their count)."""
    n = len(f)
    # 5 = legacy single contributor (W4: member 0 of a group of 1); 7+ = current.
    # 6 (a member index without its ratio) is not a form any sender produces.
    _arity("read_ready_batch", f, "5 (legacy) or at least 7", n == 5 or n >= 7)
    layer_idx = _int(f[1], "read_ready_batch: layer_idx", 0, MAX_LAYER_IDX)
    raw_reqs = f[3]
    if decoded is None:
        if type(raw_reqs) is not list:
            raise WireError(
                f"read_ready_batch: read_reqs: expected an array, got {_show(raw_reqs)}")
        if len(raw_reqs) > MAX_ENTRIES:
            raise WireError(
                f"read_ready_batch: read_reqs: {len(raw_reqs)} entries exceed the limit of "
                f"{MAX_ENTRIES}"
            )
        try:
            decoded = _decode_entries(raw_reqs)
        except WireError as exc:
            raise WireError(f"read_ready_batch: {exc}") from None
    reqs = decoded
    done = f[4]
    if type(done) is not list:
        raise WireError(f"read_ready_batch: done_ext_ids: expected an array, got {_show(done)}")
    member, ratio = (f[5], f[6]) if n >= 7 else (0, 1)
    try:
        return ReadReadyBatch(layer_idx, f[2], tuple(reqs), tuple(done), member, ratio)
    except WireError as exc:
        raise WireError(f"read_ready_batch: {exc}") from None


def _decode_done(f: list[Any]) -> ReadDone:
    _arity("read_done", f, "at least 2", len(f) >= 2)
    return ReadDone(f[1])


def _decode_failed(f: list[Any]) -> ReadFailed:
    _arity("read_failed", f, "at least 3", len(f) >= 3)
    return ReadFailed(f[1], f[2])


def _decode_ack(f: list[Any]) -> MfMetaAck:
    n = len(f)
    if n >= 5 and type(f[1]) is bool:
        return MfMetaAck(f[1], f[2], f[3], f[4])
    if type(f[1] if n > 1 else None) is not int:
        raise WireError(f"mf_meta_ack: expected a version or a bool, got {_show(f[1:2])}")
    if f[1] == 0:
        _arity("mf_meta_ack", f, "at least 4 in a refusal", n >= 4)
        return MfMetaAck(False, f[2], None, f[3])
    return MfMetaAck(True, f[1])


_DECODERS = {
    READ_READY_BATCH: _decode_ready,
    READ_DONE: _decode_done,
    READ_FAILED: _decode_failed,
    MF_META: _decode_mf_meta,
    MF_META_ACK: _decode_ack,
}


# A READY over this many bytes is decoded entry by entry (``_stream_ready``): unpacked
# whole, a frame of small ids costs a list slot of 8 bytes per 1-byte id before any check.
_STREAM_BYTES = 1 << 20


def _stream_ready(data: bytes) -> ReadReadyBatch | None:
    """A large READY decoded with one entry unpacked at a time, its ids kept in arrays as
    narrow as they allow, so decoding it costs a small multiple of its size at most; None
    when the frame is not shaped as a READY (the whole-frame path then words why)."""
    n = len(data)
    unpacker = msgpack.Unpacker(
        raw=False, strict_map_key=True, use_list=True, max_buffer_size=n,
        max_str_len=min(MAX_ERROR_LEN, n), max_bin_len=n,
        max_array_len=min(MAX_BLOCKS_PER_ENTRY, n), max_map_len=min(MAX_LAYERS, n),
        max_ext_len=0)
    unpacker.feed(data)
    try:
        n_fields = unpacker.read_array_header()
        if n_fields > MAX_FIELDS:
            raise WireError(f"frame: {n_fields} fields exceed the limit of {MAX_FIELDS}")
        if not (n_fields == 5 or n_fields >= 7):
            return None
        if unpacker.unpack() != READ_READY_BATCH:
            return None
        head = [READ_READY_BATCH, unpacker.unpack(), unpacker.unpack()]
        _int(head[1], "read_ready_batch: layer_idx", 0, MAX_LAYER_IDX)
        count = unpacker.read_array_header()
    except WireError:
        raise
    except Exception:  # noqa: BLE001 - not a READY's shape: the whole-frame path words it
        return None
    if count > MAX_ENTRIES:
        raise WireError(f"read_ready_batch: read_reqs: {count} entries exceed the limit of "
                        f"{MAX_ENTRIES}")

    def entries() -> Iterator[Any]:
        for _ in range(count):
            yield unpacker.unpack()

    try:
        reqs = _decode_entries(entries())
        tail = [unpacker.unpack() for _ in range(n_fields - 4)]
    except WireError as exc:
        raise WireError(f"read_ready_batch: {exc}") from None
    except Exception as exc:  # msgpack raises many unrelated types; all mean "bad bytes"
        raise WireError(f"not valid msgpack: {type(exc).__name__}: {exc}") from None
    if unpacker.tell() != n:
        raise WireError("not valid msgpack: trailing bytes after the message")
    return _decode_ready([*head, count, *tail], reqs)


def _decode(payload: Any) -> Message:
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise WireError(f"frame: expected bytes, got {_show(payload)}")
    if len(payload) > _STREAM_BYTES:
        if len(payload) <= MAX_FRAME_BYTES:
            msg = _stream_ready(bytes(payload))
            if msg is not None:
                return msg
    elif payload[:_READY_HEAD_LEN] == _READY_HEADER:
        msg = _ready_fast(payload)
        if msg is not None:
            return msg
    fields = _unpack(bytes(payload))
    if type(fields) is not list:
        raise WireError(f"frame: top level must be a msgpack array, got {_show(fields)}")
    if not fields:
        raise WireError("frame: empty array, no message kind")
    if len(fields) > MAX_FIELDS:
        raise WireError(f"frame: {len(fields)} fields exceed the limit of {MAX_FIELDS}")
    kind = fields[0]
    if type(kind) is not bytes:
        # The public connector sends kinds as msgpack bin; a str kind is a different,
        # incompatible encoder and is named as such.
        raise WireError(f"frame: message kind must be msgpack bin (bytes), got {_show(kind)}")
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise WireError(f"frame: unknown message kind {_repr.repr(kind)}")
    try:
        return decoder(fields)
    except WireError as exc:
        text = str(exc)
        prefix = kind.decode()
        # Prefix the kind once, so every message says which message was wrong.
        raise WireError(text if text.startswith(prefix) else f"{prefix}: {text}") from None


# Decoded small frames (replies and acks: a handful of distinct byte strings per run), by
# their bytes. Decoding is a pure function and messages are frozen, so a hit returns what a
# fresh decode would; the table stops growing at _SMALL_FRAMES entries, so a peer cannot
# make it large. Frames that fail to decode are never kept.
_SMALL_FRAME_BYTES = 64
_SMALL_FRAMES = 4096
_small: dict[bytes, Message] = {}


def decode(payload: bytes) -> Message:
    """Decode one payload frame; raises only ``WireError`` (W5)."""
    small = type(payload) is bytes and len(payload) <= _SMALL_FRAME_BYTES
    if small:
        msg = _small.get(payload)
        if msg is not None:
            return msg
    try:
        msg = _decode(payload)
    except WireError:
        raise
    except Exception as exc:  # W5 backstop, see module docstring
        raise WireError(f"internal decoder error: {type(exc).__name__}: {exc}") from None
    if small and len(_small) < _SMALL_FRAMES:
        _small[payload] = msg
    return msg


# --------------------------------------------------------------------------- handshake


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


# --------------------------------------------------------------------------- framing & ids


def split_router_frames(frames: Sequence[bytes]) -> tuple[bytes, bytes]:
    """``[identity, b"", payload]`` or ``[identity, payload]`` -> ``(identity, payload)``."""
    if not isinstance(frames, Sequence) or isinstance(frames, bytes | bytearray | str):
        raise WireError(f"router frames: expected a sequence of frames, got {_show(frames)}")
    if len(frames) < 2:
        raise WireError(f"router frames: expected identity and payload, got {len(frames)} frame(s)")
    out = []
    for i, frame in enumerate(frames):
        if not isinstance(frame, bytes | bytearray | memoryview):
            raise WireError(f"router frames[{i}]: expected bytes, got {_show(frame)}")
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


def layer_of(payload: bytes) -> int | None:
    """Best-effort layer index of a READY that failed to decode, so D can answer
    READ_FAILED instead of leaving P's slot gate waiting (W5, S3). Never raises."""
    try:
        if not isinstance(payload, bytes | bytearray | memoryview):
            return None
        if payload[:_READY_HEAD_LEN] == _READY_HEADER:
            # Every current READY starts with these bytes; a layer index below 2**16 packs
            # as a fixint, uint8 or uint16 (anything else takes the general path below).
            tag = payload[_READY_HEAD_LEN]
            if tag < 0x80:
                return tag
            if tag == 0xCC:
                return payload[_READY_HEAD_LEN + 1]
            if tag == 0xCD and len(payload) >= _READY_HEAD_LEN + 3:
                return int.from_bytes(payload[_READY_HEAD_LEN + 1:_READY_HEAD_LEN + 3], "big")
        # The kind and layer index sit in the first ~32 bytes; reading only a prefix keeps
        # this cheap and lets even oversized or truncated frames be answered.
        head = bytes(memoryview(payload)[:64])
        unpacker = msgpack.Unpacker(
            raw=False,
            strict_map_key=True,
            max_buffer_size=64,
            max_str_len=64,
            max_bin_len=64,
            max_array_len=64,
            max_map_len=64,
            max_ext_len=0,
        )
        unpacker.feed(head)
        if unpacker.read_array_header() < 2:
            return None
        if unpacker.unpack() != READ_READY_BATCH:
            return None
        idx = unpacker.unpack()
        if type(idx) is int and 0 <= idx <= MAX_LAYER_IDX:
            return idx
        return None
    except Exception:
        return None


def external_request_id(vllm_request_id: str) -> str:
    """Strip vLLM's 9-character engine suffix (the id P and D share on the wire)."""
    if not isinstance(vllm_request_id, str):
        raise WireError(f"vllm request id: expected str, got {_show(vllm_request_id)}")
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
