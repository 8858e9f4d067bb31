"""RD2H wire messages (spec/PROTOCOL.md W1-W3): frozen values that check themselves.

Each message dataclass validates its fields, and normalises lists to tuples, in
``__post_init__``: this is the one validation site. The decoder (``wire_decode``) only
checks the shape of a frame and then builds these, so a value that decodes is exactly a
value that could have been constructed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import WireError
from .wire_fields import (
    MAX_ADDR,
    MAX_BLOCK_ID,
    MAX_BLOCK_LEN,
    MAX_BLOCK_SIZE_SCALE,
    MAX_BLOCKS_PER_ENTRY,
    MAX_ENTRIES,
    MAX_GROUP_IDX,
    MAX_ID_LEN,
    MAX_LAYER_IDX,
    MAX_LAYERS,
    MAX_STR_LEN,
    MAX_TENSORS_PER_LAYER,
    MAX_TP_RATIO,
    MAX_VERSION,
    bounded_repr,
    check_bool,
    check_int,
    check_int_tuple,
    check_str,
    error_text,
    set_slot,
    show,
)


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
        addrs = check_int_tuple(self.base_addrs, "base_addrs", 0, MAX_ADDR, n_max)
        lens = check_int_tuple(self.block_len, "block_len", 1, MAX_BLOCK_LEN, n_max)
        scales = check_int_tuple(
            self.block_size_scale, "block_size_scale", 1, MAX_BLOCK_SIZE_SCALE, n_max
        )
        groups = check_int_tuple(self.tensor_group_idx, "tensor_group_idx", 0, MAX_GROUP_IDX, n_max)
        main = check_int(self.main_tensor_count, "main_tensor_count", 1, n_max)
        has_indexer = check_bool(self.has_indexer, "has_indexer")
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
        set_slot(self, "base_addrs", addrs)
        set_slot(self, "block_len", lens)
        set_slot(self, "block_size_scale", scales)
        set_slot(self, "tensor_group_idx", groups)
        set_slot(self, "main_tensor_count", main)

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
            check_str(name, "layer name", MAX_STR_LEN)
            if not isinstance(meta, LayerMeta):
                raise WireError(f"layers[{name!r}]: expected LayerMeta, got {show(meta)}")
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
        check_str(self.p_session, "p_session", MAX_STR_LEN)
        if not isinstance(self.layers, LayerTable):
            if not isinstance(self.layers, Mapping):
                raise WireError(f"layers: expected a mapping, got {show(self.layers)}")
            set_slot(self, "layers", LayerTable(self.layers))
        pv, lv = self.protocol_version, self.layout_version
        if pv is None and lv is not None:
            raise WireError(f"layout_version {lv!r} given without a protocol_version")
        if pv is not None:
            set_slot(self, "protocol_version", check_int(pv, "protocol_version", 0, MAX_VERSION))
        if lv is not None:
            set_slot(self, "layout_version", check_int(lv, "layout_version", 0, MAX_VERSION))
        set_slot(self, "pp_size", check_int(self.pp_size, "pp_size", 1, MAX_GROUP_IDX))
        set_slot(self, "pp_rank", check_int(self.pp_rank, "pp_rank", 0, self.pp_size - 1))

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
        check_bool(self.accepted, "accepted")
        set_slot(
            self,
            "protocol_version",
            check_int(self.protocol_version, "protocol_version", 0, MAX_VERSION),
        )
        if self.layout_version is not None:
            set_slot(self, "layout_version",
                 check_int(self.layout_version, "layout_version", 0, MAX_VERSION))
        set_slot(self, "error", error_text(self.error, "error"))
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
        check_str(self.ext_req_id, "ext_req_id", MAX_ID_LEN)
        main = _id_array(self.p_main_block_ids, "p_main_block_ids")
        if self.p_indexer_block_ids is self.p_main_block_ids:
            indexer = main  # legacy entries share one list; validate it once
        else:
            indexer = _id_array(self.p_indexer_block_ids, "p_indexer_block_ids")
        given = (self.p_main_block_ids, self.p_indexer_block_ids)
        if all(type(g) is tuple or type(g) is list for g in given):
            # checked by _id_array (plain ints in range); copied, so no caller can change them
            set_slot(self, "_given", tuple(g if type(g) is tuple else tuple(g) for g in given))
        set_slot(self, "p_main_block_ids", main)
        set_slot(self, "p_indexer_block_ids", indexer)
        set_slot(self, "main_dest_start",
                 check_int(self.main_dest_start, "main_dest_start", 0, MAX_BLOCK_ID))
        set_slot(
            self,
            "indexer_dest_start",
            check_int(self.indexer_dest_start, "indexer_dest_start", 0, MAX_BLOCK_ID),
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
        return (f"ReadReq({self.ext_req_id!r}, {bounded_repr(self.p_main_block_ids.tolist())}, "
                f"{bounded_repr(self.p_indexer_block_ids.tolist())}, {self.main_dest_start}, "
                f"{self.indexer_dest_start})")


def _narrow(top: int) -> np.dtype:
    """The narrowest unsigned dtype for ids up to ``top`` (at most MAX_BLOCK_ID)."""
    return _U8 if top < 256 else _U16 if top < 65536 else _U32


_U8, _U16, _U32 = np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32)


def _id_array(value: Any, field: str) -> np.ndarray:
    """Block ids given by a local caller as a read-only narrow array, checked as
    ``check_int_tuple`` checks them (the same refusals, the same words)."""
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu":
        if value.size > MAX_BLOCKS_PER_ENTRY:
            raise WireError(f"{field}: {value.size} items exceed the limit of "
                            f"{MAX_BLOCKS_PER_ENTRY}")
        top = int(value.max()) if value.size else 0
        if value.size and (int(value.min()) < 0 or top > MAX_BLOCK_ID):
            check_int_tuple(value, field, 0, MAX_BLOCK_ID, MAX_BLOCKS_PER_ENTRY)  # raises, worded
        if not value.flags.writeable and value.dtype.kind == "u" and \
                value.dtype.itemsize <= 4:
            return value
        ids: Any = value
    else:
        ids = check_int_tuple(value, field, 0, MAX_BLOCK_ID, MAX_BLOCKS_PER_ENTRY)
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
        set_slot(self, "layer_idx", check_int(self.layer_idx, "layer_idx", 0, MAX_LAYER_IDX))
        check_str(self.layer_name, "layer_name", MAX_STR_LEN)
        reqs = self.read_reqs
        if type(reqs) is not tuple:
            if type(reqs) is not list:
                raise WireError(f"read_reqs: expected a list, got {show(reqs)}")
            reqs = tuple(reqs)
        if len(reqs) > MAX_ENTRIES:
            raise WireError(f"read_reqs: {len(reqs)} entries exceed the limit of {MAX_ENTRIES}")
        for i, req in enumerate(reqs):
            if not isinstance(req, ReadReq):
                raise WireError(f"read_reqs[{i}]: expected ReadReq, got {show(req)}")
        done = self.done_ext_ids
        if type(done) is not tuple:
            if type(done) is not list:
                raise WireError(f"done_ext_ids: expected a list, got {show(done)}")
            done = tuple(done)
        if len(done) > MAX_ENTRIES:
            raise WireError(f"done_ext_ids: {len(done)} ids exceed the limit of {MAX_ENTRIES}")
        for i, ext_id in enumerate(done):
            check_str(ext_id, f"done_ext_ids[{i}]", MAX_ID_LEN)
        ratio = check_int(self.tp_ratio, "tp_ratio", 1, MAX_TP_RATIO)
        member = check_int(self.group_member_idx, "group_member_idx", 0, MAX_TP_RATIO - 1)
        if member >= ratio:
            # T1: member index = p_rank % ratio, so it is always below the ratio.
            raise WireError(f"group_member_idx: {member} must be below tp_ratio={ratio}")
        set_slot(self, "read_reqs", reqs)
        set_slot(self, "done_ext_ids", done)
        set_slot(self, "tp_ratio", ratio)
        set_slot(self, "group_member_idx", member)


@dataclass(frozen=True, slots=True)
class ReadDone:
    """W3 ``(READ_DONE, layer_idx)``."""

    layer_idx: int

    def __post_init__(self) -> None:
        set_slot(self, "layer_idx", check_int(self.layer_idx, "layer_idx", 0, MAX_LAYER_IDX))


@dataclass(frozen=True, slots=True)
class ReadFailed:
    """W3 ``(READ_FAILED, layer_idx, error)``; error text is truncated to MAX_ERROR_LEN."""

    layer_idx: int
    error: str

    def __post_init__(self) -> None:
        set_slot(self, "layer_idx", check_int(self.layer_idx, "layer_idx", 0, MAX_LAYER_IDX))
        set_slot(self, "error", error_text(self.error, "error"))


Message = MfMeta | ReadReadyBatch | ReadDone | ReadFailed | MfMetaAck


def entry_fields(reqs: Sequence[ReadReq]) -> tuple[tuple[Any, ...], ...]:
    """The W2 ``read_reqs`` entries of ``reqs`` as the encoder packs them: each entry's
    fields in wire order, its block ids as the checked lists a local caller gave or, for a
    decoded entry, its arrays as lists of ints (msgpack packs no arrays)."""
    return tuple(
        (
            r.ext_req_id,
            *(r._given or (r.p_main_block_ids.tolist(), r.p_indexer_block_ids.tolist())),
            r.main_dest_start,
            r.indexer_dest_start,
        )
        for r in reqs
    )


# Slot setters of the frozen messages, in field order, for a decoder that has checked every
# field already (``wire_decode``): it fills a message in directly instead of having
# ``__post_init__`` validate it again.
READ_REQ_SETTERS = tuple(ReadReq.__dict__[f].__set__ for f in (
    "ext_req_id", "p_main_block_ids", "p_indexer_block_ids", "main_dest_start",
    "indexer_dest_start", "_given"))
READY_SETTERS = tuple(ReadReadyBatch.__dict__[f].__set__ for f in (
    "layer_idx", "layer_name", "read_reqs", "done_ext_ids", "group_member_idx", "tp_ratio"))
