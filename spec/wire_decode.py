"""RD2H frame decoding (spec/PROTOCOL.md W1-W5, F3 and its wire encoding): bytes to messages.

Pure functions: the runtime hands raw frames in and gets typed messages out (or a
``WireError``), and the model checker drives the same code with simulated frames.

* **Only ``WireError`` escapes a decoder (W5).** msgpack, Unicode, overflow and recursion
  failures are translated; a final catch-all turns any remaining surprise into a
  ``WireError`` whose text starts with ``internal decoder error`` so tests can tell such a
  bug apart from a deliberate rejection.
* **Extensions append fields (W4).** Decoders accept and ignore fields beyond the ones
  they know (up to ``MAX_FIELDS``). Shapes that are neither a known legacy form nor a
  known form plus appendices are rejected rather than guessed, because guessing a missing
  destination offset or version would silently write to the wrong blocks (L1, F3).
* **Three READY paths, one answer.** The shape Prefill writes is decoded by msgspec
  (``_ready_fast``), its ids read from the frame's bytes by a C scanner (``_idscan``,
  built at install; without it by msgspec and ``array``), a READY over ``_STREAM_BYTES``
  entry by entry (``_stream_ready``), anything else by the general path, which words
  every refusal; the first two only ever change speed.

``layer_of`` reads the layer of a READY that failed to decode, so Decode can still answer.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from typing import Annotated, Any

import msgpack
import msgspec
import numpy as np

from .errors import WireError

try:  # built by the install where a C compiler is found (pyproject.toml, ext-modules)
    from . import _idscan
except ImportError:
    _idscan = None
from .wire_encode import READY_HEADER
from .wire_fields import (
    INT_ONLY,
    MAX_BLOCK_ID,
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
    MAX_TP_RATIO,
    MF_META,
    MF_META_ACK,
    READ_DONE,
    READ_FAILED,
    READ_READY_BATCH,
    bounded_repr,
    check_int,
    check_int_tuple,
    check_str,
    show,
)
from .wire_messages import (
    READ_REQ_SETTERS,
    READY_SETTERS,
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

# The header every current READY starts with: the fast path and ``layer_of`` look for it.
_READY_HEAD_LEN = len(READY_HEADER)

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
        raise WireError(f"expected a map of layout fields, got {show(fields)}")
    values: dict[str, Any] = {}
    for key, value in fields:
        if key not in _META_KEYS:
            # Unknown layout fields are refused, not skipped: a field we do not understand
            # may change where bytes live, and F3 says never to discover that as corruption.
            raise WireError(f"unknown field {show(key)}; expected only {', '.join(_META_KEYS)}")
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
        raise WireError(f"layer metadata: expected msgpack bytes, got {show(blob)}")
    try:
        top = _unpack(bytes(blob), pairs=True)
    except WireError as exc:
        raise WireError(f"layer metadata: {exc}") from None
    if type(top) is not _Pairs:
        raise WireError(f"layer metadata: expected a map of layer name -> layout, got {show(top)}")
    pairs: list[tuple[str, LayerMeta]] = []
    for name, fields in top:
        check_str(name, "layer metadata: layer name", MAX_STR_LEN)
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
        raise WireError(f"mf_meta: pp_rank/pp_size must be ints, got {show(f[4:6])}")
    if not 1 <= f[5] <= MAX_GROUP_IDX or not 0 <= f[4] < f[5]:
        raise WireError(f"mf_meta: pp_rank={f[4]} is not a rank of pp_size={f[5]}")
    return MfMeta(f[1], layers, f[3], None, f[4], f[5])


class _IdBuffer:
    """The block ids of one READY, list by list, each list appended in C (``array.extend``)
    to the narrowest of three flat arrays that takes it (``B``, ``H``, ``I``), so an id
    costs at most the bytes it took on the wire. A list that no array takes (an id not an
    int, negative or too large) or that holds a bool (which ``array`` takes as 0 or 1) goes
    through ``check_int_tuple``, which refuses it with the words a constructed ``ReadReq`` uses;
    ids above MAX_BLOCK_ID, which ``I`` holds, are found by a max over the lists in it."""

    __slots__ = ("bufs", "spans")

    def __init__(self) -> None:
        self.bufs = {code: array(code) for code in _ARRAY_DTYPES}
        self.spans: list[tuple[str, int, int]] = []

    def add(self, ids: Any, field: str) -> int:
        """Append one list; returns its index among the lists added."""
        if type(ids) is not list:
            check_int_tuple(ids, field, 0, MAX_BLOCK_ID, MAX_BLOCKS_PER_ENTRY)  # raises, worded
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
            if (0 in ids or 1 in ids) and set(map(type, ids)) != INT_ONLY:
                del buf[start:]
                break
            self.spans.append((code, start, len(buf)))
            return len(self.spans) - 1
        check_int_tuple(ids, field, 0, MAX_BLOCK_ID, MAX_BLOCKS_PER_ENTRY)  # raises, worded
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
_ARRAY_DTYPES = {"B": np.dtype(np.uint8), "H": np.dtype(np.uint16), "I": np.dtype(np.uint32)}
_U32 = _ARRAY_DTYPES["I"]
assert array("I").itemsize == 4


# --- The READY as Prefill writes it, decoded by msgspec (typed, constrained, in C).
# Every current READY is a 7-field array of 5-field entries; msgspec decodes exactly that
# shape, with every bound the messages check (lengths, ranges; bools are not ints to
# msgspec) checked as it goes, and keeps each id list as its raw bytes, which ``_FAST``
# turns into one flat uint32 array per field. Anything refused on the way - or any other
# shape: legacy forms, W4 appendices - goes to the general path below, which decides again
# and words any refusal, so this path changes only speed: what it accepts the general
# path accepts as the same message.
_Start = Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_ID)]
_ExtId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)]
_IdList = Annotated[list[int], msgspec.Meta(max_length=MAX_BLOCKS_PER_ENTRY)]


def _ready_decoder(id_list: Any) -> msgspec.msgpack.Decoder:
    """A decoder of the READY's shape whose id lists decode as ``id_list``."""
    shape = {"array_like": True, "forbid_unknown_fields": True}
    entry = msgspec.defstruct("ReadyEntry", [
        ("ext_req_id", _ExtId), ("main", id_list), ("indexer", id_list),
        ("main_dest_start", _Start), ("indexer_dest_start", _Start)], **shape)
    ready = msgspec.defstruct("Ready", [
        ("kind", bytes),
        ("layer_idx", Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYER_IDX)]),
        ("layer_name", Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STR_LEN)]),
        ("read_reqs", Annotated[list[entry], msgspec.Meta(max_length=MAX_ENTRIES)]),
        ("done_ext_ids", Annotated[list[_ExtId], msgspec.Meta(max_length=MAX_ENTRIES)]),
        ("group_member_idx", Annotated[int, msgspec.Meta(ge=0, le=MAX_TP_RATIO - 1)]),
        ("tp_ratio", Annotated[int, msgspec.Meta(ge=1, le=MAX_TP_RATIO)])], **shape)
    return msgspec.msgpack.Decoder(ready)


_IdLists = tuple[np.ndarray, list[int]]


def _ids_scanned(raws: list[msgspec.Raw]) -> _IdLists | None:
    """The ids of ``raws`` (each list's msgpack bytes) in one read-only uint32 array and
    each list's end in it, read in C without a Python int per id; None where a list is not
    plainly unsigned ids within the bounds (the general path then words why)."""
    got = _idscan.scan(raws, MAX_BLOCK_ID, MAX_BLOCKS_PER_ENTRY)
    if got is None:
        return None
    data, ends = got
    return (np.frombuffer(data, dtype=_U32) if data else _NO_IDS), ends


def _ids_listed(lists: list[list[int]]) -> _IdLists | None:
    """``_ids_scanned`` where the scanner was not built, from lists msgspec decoded:
    ``array`` takes them in C; negative ids and ids of 2**32 and over raise there, a max
    over the array finds the rest."""
    ids, ends = array("I"), []
    add = ids.extend
    try:
        for one in lists:
            add(one)
            ends.append(len(ids))
    except OverflowError:
        return None
    if not ids:
        return _NO_IDS, ends
    flat = np.frombuffer(ids, dtype=_U32)
    if int(flat.max()) > MAX_BLOCK_ID:
        return None
    flat.flags.writeable = False
    return flat, ends


# How ``_ready_fast`` decodes and reads id lists: the ids kept raw for the C scanner, or
# decoded as lists where it was not built. ID_SCANNER names the route for the bench.
_SCANNED = (_ready_decoder(msgspec.Raw), _ids_scanned)
_LISTED = (_ready_decoder(_IdList), _ids_listed)
_FAST = _SCANNED if _idscan is not None else _LISTED
ID_SCANNER = "c" if _idscan is not None else "python"


def _ready_fast(payload: bytes | bytearray | memoryview) -> ReadReadyBatch | None:
    """A READY in the shape Prefill writes, or None for the general path to decide.

    The ids go into two flat uint32 arrays, every main list after the other and every
    indexer list after the other, and each entry holds read-only views of them."""
    decoder, read_ids = _FAST
    try:
        ready = decoder.decode(payload)
    except msgspec.DecodeError:  # ValidationError too: the general path words it
        return None
    if ready.group_member_idx >= ready.tp_ratio:
        return None
    entries = ready.read_reqs
    mains = read_ids([e.main for e in entries])
    indexers = read_ids([e.indexer for e in entries]) if mains is not None else None
    if indexers is None:
        return None
    (flat_main, main_ends), (flat_indexer, indexer_ends) = mains, indexers
    set_ext, set_main, set_indexer, set_main_start, set_indexer_start, set_given = READ_REQ_SETTERS
    new = object.__new__
    reqs = []
    at_main = at_indexer = 0
    for e, main_end, indexer_end in zip(entries, main_ends, indexer_ends, strict=True):
        req = new(ReadReq)
        set_ext(req, e.ext_req_id)
        set_main(req, flat_main[at_main:main_end])
        set_indexer(req, flat_indexer[at_indexer:indexer_end])
        at_main, at_indexer = main_end, indexer_end
        set_main_start(req, e.main_dest_start)
        set_indexer_start(req, e.indexer_dest_start)
        set_given(req, None)
        reqs.append(req)
    msg = new(ReadReadyBatch)
    for setter, value in zip(READY_SETTERS, (
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
                raise WireError(f"expected an array, got {show(entry)}")
            n = len(entry)
            # 3 or 4 fields would leave a destination offset to guess; guessing 0 writes
            # into the wrong D blocks, so those shapes are refused (W5) instead of defaulted.
            if n != 2:
                _arity("read_req", entry, "2 (legacy) or at least 5", n >= 5)
            ext = check_str(entry[0], "ext_req_id", MAX_ID_LEN)
            main = ids.add(entry[1], "p_main_block_ids")
            fields.append((i, "p_main_block_ids"))
            if n == 2:  # legacy (ext_req_id, block_ids): one list for both, offsets 0
                rows.append((ext, main, main, 0, 0))
                continue
            idx = ids.add(entry[2], "p_indexer_block_ids")
            fields.append((i, "p_indexer_block_ids"))
            rows.append((ext, main, idx, check_int(entry[3], "main_dest_start", 0, MAX_BLOCK_ID),
                         check_int(entry[4], "indexer_dest_start", 0, MAX_BLOCK_ID)))
    except WireError as exc:
        _refuse_wide(ids, fields, upto=i)
        raise WireError(f"read_reqs[{i}]: {exc}") from None
    _refuse_wide(ids, fields, upto=None)
    views = ids.views()
    out = []
    new = object.__new__
    for ext, main, idx, m_start, i_start in rows:
        req = new(ReadReq)
        for setter, value in zip(READ_REQ_SETTERS, (
                ext, views[main], views[idx], m_start, i_start, None), strict=True):
            setter(req, value)
        out.append(req)
    return tuple(out)


def _refuse_wide(ids: _IdBuffer, fields: list[tuple[int, str]], upto: int | None) -> None:
    """Refuse the first list, of entries before ``upto``, holding an id above MAX_BLOCK_ID,
    exactly as ``check_int_tuple`` words it (those ids fit the ``I`` array, so only here are
    they seen)."""
    bad = ids.check_wide()
    if bad is None or (upto is not None and fields[bad][0] >= upto):
        return
    entry, field = fields[bad]
    _, start, end = ids.spans[bad]
    try:
        check_int_tuple(np.frombuffer(ids.bufs["I"], dtype=_U32)[start:end], field, 0,
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
    layer_idx = check_int(f[1], "read_ready_batch: layer_idx", 0, MAX_LAYER_IDX)
    raw_reqs = f[3]
    if decoded is None:
        if type(raw_reqs) is not list:
            raise WireError(
                f"read_ready_batch: read_reqs: expected an array, got {show(raw_reqs)}")
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
        raise WireError(f"read_ready_batch: done_ext_ids: expected an array, got {show(done)}")
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
        raise WireError(f"mf_meta_ack: expected a version or a bool, got {show(f[1:2])}")
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
        check_int(head[1], "read_ready_batch: layer_idx", 0, MAX_LAYER_IDX)
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
        raise WireError(f"frame: expected bytes, got {show(payload)}")
    if len(payload) > _STREAM_BYTES:
        if len(payload) <= MAX_FRAME_BYTES:
            msg = _stream_ready(bytes(payload))
            if msg is not None:
                return msg
    elif payload[:_READY_HEAD_LEN] == READY_HEADER:
        msg = _ready_fast(payload)
        if msg is not None:
            return msg
    fields = _unpack(bytes(payload))
    if type(fields) is not list:
        raise WireError(f"frame: top level must be a msgpack array, got {show(fields)}")
    if not fields:
        raise WireError("frame: empty array, no message kind")
    if len(fields) > MAX_FIELDS:
        raise WireError(f"frame: {len(fields)} fields exceed the limit of {MAX_FIELDS}")
    kind = fields[0]
    if type(kind) is not bytes:
        # The public connector sends kinds as msgpack bin; a str kind is a different,
        # incompatible encoder and is named as such.
        raise WireError(f"frame: message kind must be msgpack bin (bytes), got {show(kind)}")
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise WireError(f"frame: unknown message kind {bounded_repr(kind)}")
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



def layer_of(payload: bytes) -> int | None:
    """Best-effort layer index of a READY that failed to decode, so D can answer
    READ_FAILED instead of leaving P's slot gate waiting (W5, S3). Never raises."""
    try:
        if not isinstance(payload, bytes | bytearray | memoryview):
            return None
        if payload[:_READY_HEAD_LEN] == READY_HEADER:
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


# msgpack tags of an unsigned int and of a str: how many bytes follow the tag (the int's
# value, or the string's length)
_UINT_TAGS = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}
_STR_TAGS = {0xD9: 1, 0xDA: 2, 0xDB: 4}


def ready_body(payload: bytes | bytearray | memoryview) -> bytes | None:
    """The bytes of a current READY past its layer index and name (its entries, finished
    ids, member index and ratio), or None for a frame not in that form. Two READYs with
    equal bodies decode to equal entries, finished ids, member and ratio, so a receiver can
    tell a step's next layer naming the same blocks without comparing what it decoded.
    Never raises; it checks no field (``decode`` does)."""
    try:
        if payload[:_READY_HEAD_LEN] != READY_HEADER:
            return None
        at = _READY_HEAD_LEN
        tag = payload[at]
        at += 1 if tag < 0x80 else 1 + _UINT_TAGS[tag]
        tag = payload[at]
        if 0xA0 <= tag <= 0xBF:
            at += 1 + (tag & 0x1F)
        else:
            width = _STR_TAGS[tag]
            at += 1 + width + int.from_bytes(payload[at + 1:at + 1 + width], "big")
        return bytes(payload[at:]) if at <= len(payload) else None
    except (KeyError, IndexError, TypeError):
        return None
