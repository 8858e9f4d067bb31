"""Layout validation (L1) and read planning for one batched transfer (C4).

Decode pulls from Prefill's registered memory. Before a layer is read, the source layout
Prefill published in MF_META (W1) is checked against what Decode registered for that layer,
and every block id is range-checked, so a mismatch fails the layer *before* any byte is
written (L1: no partial update). Then the block pairs are turned into the three parallel
arrays that ``batch_transfer_sync_read(session, local_addrs, peer_addrs, lengths)`` takes,
with runs that are contiguous on both sides merged into one descriptor: fewer descriptors
means less per-descriptor overhead in the transfer engine.

Tensor order on both sides (W1 wire encoding): main tensors (K, V, ...), then the indexer
if present, then the optional LIC8 scale, which only exists alongside an indexer. Main
tensors use the main block ids; indexer and scale use the indexer block ids (T3).

All per-block work is numpy; Python loops only run over tensors (a handful per layer).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .errors import LayoutError

_U64_MAX = (1 << 64) - 1
_I64_MAX = (1 << 63) - 1


class LayerLayout(Protocol):
    """The per-layer source layout Prefill publishes in MF_META (``wire.LayerMeta`` fits).

    Only these fields are read; whether a LIC8 scale tensor exists is derived from the
    tensor count, so any object carrying them (a dataclass, a namedtuple) is accepted.
    """

    @property
    def base_addrs(self) -> Sequence[int]: ...

    @property
    def block_len(self) -> Sequence[int]: ...

    @property
    def block_size_scale(self) -> Sequence[int]: ...

    @property
    def tensor_group_idx(self) -> Sequence[int]: ...

    @property
    def main_tensor_count(self) -> int: ...

    @property
    def has_indexer(self) -> bool: ...


def _plain_int(value: Any, what: str) -> int:
    # Bools are ints in Python; a bool where a size belongs is a caller bug, not a 0/1.
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise LayoutError(f"L1: {what} must be an int, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class _SrcTensors:
    """A source layout checked for internal consistency, with per-tensor external bytes."""

    base_addrs: tuple[int, ...]
    ext_block_bytes: tuple[int, ...]
    main_tensor_count: int
    has_indexer: bool
    has_scale: bool


def _check_src(src: LayerLayout) -> _SrcTensors:
    """Reject a self-inconsistent source layout, so later comparisons compare like with like."""
    try:
        base = tuple(_plain_int(a, "prefill base address") for a in src.base_addrs)
        blen = tuple(_plain_int(b, "prefill block_len") for b in src.block_len)
        scale = tuple(_plain_int(s, "prefill block_size_scale") for s in src.block_size_scale)
        main = _plain_int(src.main_tensor_count, "prefill main_tensor_count")
        has_indexer = src.has_indexer
    except (AttributeError, TypeError) as exc:
        raise LayoutError(f"L1: prefill layer layout is malformed: {exc}") from exc
    if not isinstance(has_indexer, (bool, np.bool_)):
        raise LayoutError(f"L1: prefill has_indexer must be a bool, got {has_indexer!r}")
    has_indexer = bool(has_indexer)
    if not len(base) == len(blen) == len(scale):
        raise LayoutError(
            f"L1: prefill per-tensor field lengths differ: base_addrs {len(base)}, "
            f"block_len {len(blen)}, block_size_scale {len(scale)}"
        )
    if main < 1:
        raise LayoutError(f"L1: prefill main_tensor_count={main} must be >= 1")
    extra = len(base) - main - int(has_indexer)
    if extra not in (0, 1) or (extra == 1 and not has_indexer):
        raise LayoutError(
            f"L1: prefill tensor count {len(base)} does not fit main_tensor_count={main}, "
            f"has_indexer={has_indexer} (+ optional LIC8 scale, only with an indexer)"
        )
    for i, (a, b, s) in enumerate(zip(base, blen, scale, strict=True)):
        if a < 0 or b < 1 or s < 1:
            raise LayoutError(
                f"L1: prefill tensor {i} has base_addr={a}, block_len={b}, "
                f"block_size_scale={s} (need >= 0, >= 1, >= 1)"
            )
    return _SrcTensors(
        base_addrs=base,
        ext_block_bytes=tuple(b * s for b, s in zip(blen, scale, strict=True)),
        main_tensor_count=main,
        has_indexer=has_indexer,
        has_scale=extra == 1,
    )


@dataclass(frozen=True)
class DestLayout:
    """What Decode registered for one layer, in the same tensor order as the source.

    ``num_blocks`` is each tensor's destination capacity: main tensors live in the
    TP-shared CPU pool, indexer/scale in the rank-local NPU copy, so capacities can differ.
    """

    base_addrs: tuple[int, ...]
    block_bytes: tuple[int, ...]
    num_blocks: tuple[int, ...]
    main_tensor_count: int
    has_indexer: bool
    has_scale: bool

    def __post_init__(self) -> None:
        # Normalise to tuples of plain ints so the frozen value is hashable and comparable.
        for name in ("base_addrs", "block_bytes", "num_blocks"):
            vals = tuple(_plain_int(v, f"decode {name}") for v in getattr(self, name))
            object.__setattr__(self, name, vals)
        main = _plain_int(self.main_tensor_count, "decode main_tensor_count")
        object.__setattr__(self, "main_tensor_count", main)
        for name in ("has_indexer", "has_scale"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise LayoutError(f"L1: decode {name} must be a bool")
            object.__setattr__(self, name, bool(getattr(self, name)))
        if main < 1:
            raise LayoutError(f"L1: decode main_tensor_count={main} must be >= 1")
        if self.has_scale and not self.has_indexer:
            raise LayoutError("L1: decode has a LIC8 scale tensor without an indexer")
        n = main + int(self.has_indexer) + int(self.has_scale)
        if not len(self.base_addrs) == len(self.block_bytes) == len(self.num_blocks) == n:
            raise LayoutError(
                f"L1: decode per-tensor field lengths (base_addrs {len(self.base_addrs)}, "
                f"block_bytes {len(self.block_bytes)}, num_blocks {len(self.num_blocks)}) "
                f"must all equal the tensor count {n}"
            )
        triples = zip(self.base_addrs, self.block_bytes, self.num_blocks, strict=True)
        for i, (a, b, c) in enumerate(triples):
            if a < 0 or b < 1 or c < 0:
                raise LayoutError(
                    f"L1: decode tensor {i} has base_addr={a}, block_bytes={b}, "
                    f"num_blocks={c} (need >= 0, >= 1, >= 0)"
                )

    @property
    def indexer_tensor(self) -> int | None:
        """Tensor index of the indexer, or None."""
        return self.main_tensor_count if self.has_indexer else None

    @property
    def scale_tensor(self) -> int | None:
        """Tensor index of the LIC8 scale, or None."""
        return self.main_tensor_count + 1 if self.has_scale else None


def _mismatch(field: str, p: object, d: object) -> LayoutError:
    return LayoutError(f"L1: {field}: prefill {p} != decode {d}")


def validate_layer(src: LayerLayout, dst: DestLayout) -> None:
    """Check that Prefill's published layer layout matches Decode's registration (L1).

    Raises ``LayoutError`` naming the first field that differs and both values.
    """
    _checked_pair(src, dst)


@functools.lru_cache(maxsize=1024)
def _cached_pair(src: LayerLayout, dst: DestLayout, types: tuple[type, ...]) -> _SrcTensors:
    return _check_pair(src, dst)


def _checked_pair(src: LayerLayout, dst: DestLayout) -> _SrcTensors:
    """:func:`_check_pair`, remembered for layouts that compare by value: Decode plans every
    layer of every READY against the same few (MF_META layer, registration) pairs, and a
    failed check is never remembered. The key holds the source fields' types too, because
    ``1.0 == 1``: a float address must not pass as the int one checked earlier."""
    try:
        types = tuple(map(type, (*src.base_addrs, *src.block_len, *src.block_size_scale,
                                 src.main_tensor_count, src.has_indexer)))
        return _cached_pair(src, dst, types)
    except (TypeError, AttributeError):  # unhashable or malformed: check it every time
        return _check_pair(src, dst)


def _check_pair(src: LayerLayout, dst: DestLayout) -> _SrcTensors:
    s = _check_src(src)
    if s.main_tensor_count != dst.main_tensor_count:
        raise _mismatch("main tensor count", s.main_tensor_count, dst.main_tensor_count)
    for i in range(s.main_tensor_count):
        if s.ext_block_bytes[i] != dst.block_bytes[i]:
            raise _mismatch(
                f"main tensor {i} block bytes", s.ext_block_bytes[i], dst.block_bytes[i]
            )
    if s.has_indexer != dst.has_indexer:
        raise _mismatch("indexer presence", s.has_indexer, dst.has_indexer)
    if s.has_indexer:
        i = s.main_tensor_count
        if s.ext_block_bytes[i] != dst.block_bytes[i]:
            raise _mismatch("indexer block bytes", s.ext_block_bytes[i], dst.block_bytes[i])
    if s.has_scale != dst.has_scale:
        raise _mismatch("LIC8 scale presence", s.has_scale, dst.has_scale)
    if s.has_scale:
        i = s.main_tensor_count + 1
        if s.ext_block_bytes[i] != dst.block_bytes[i]:
            raise _mismatch("LIC8 scale block bytes", s.ext_block_bytes[i], dst.block_bytes[i])
    return s


def as_block_ids(ids: Any, what: str) -> np.ndarray:
    """Return ``ids`` as a 1-D int64 array, rejecting floats, bools and nested shapes."""
    arr = np.asarray(ids)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1:
        raise LayoutError(f"L1: {what} block ids must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise LayoutError(f"L1: {what} block ids must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > _I64_MAX:
        raise LayoutError(f"L1: {what} block id {int(arr.max())} is out of range")
    return arr.astype(np.int64, copy=False)


def validate_dest_range(dest_block_ids: Any, capacity: int, what: str) -> np.ndarray:
    """Check destination ids lie in ``0..capacity-1`` and are distinct (L1: dest range).

    A duplicate destination would be two reads racing into one block, so it is refused as
    firmly as an out-of-range id. Returns the ids as int64.
    """
    ids = as_block_ids(dest_block_ids, what)
    _dest_range(ids, capacity, what)
    return ids


def _dest_range(ids: np.ndarray, capacity: int, what: str) -> int:
    """``validate_dest_range`` on int64 ids; returns their maximum (-1 for none)."""
    capacity = _plain_int(capacity, f"{what} destination capacity")
    if ids.size == 0:
        return -1
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= capacity:
        bad = lo if lo < 0 else hi
        raise LayoutError(
            f"L1: {what} destination block id {bad} is outside 0..{capacity - 1} "
            f"(capacity {capacity})"
        )
    if ids.size > 1 and not _distinct(ids, capacity):
        srt = np.sort(ids)
        dup = np.flatnonzero(srt[1:] == srt[:-1])
        raise LayoutError(
            f"L1: {what} destination block id {int(srt[dup[0]])} appears more than once"
        )
    return hi


def _distinct(ids: np.ndarray, capacity: int) -> bool:
    """Whether ``ids`` (all in ``0..capacity-1``) are pairwise distinct, in O(n) where a sort
    would cost O(n log n): a strictly increasing list (every run of a request) proves it in
    one comparison pass, any other by marking a bitmap of the capacity, when that is not far
    larger than the list. Only a refusal sorts, to name the smallest repeated id."""
    steps = ids[1:] > ids[:-1]
    if steps.all():
        return True
    if capacity <= 64 * ids.size:
        seen = np.zeros(capacity, dtype=bool)
        seen[ids] = True
        return int(np.count_nonzero(seen)) == ids.size
    srt = np.sort(ids)
    return not (srt[1:] == srt[:-1]).any()


def validate_src_range(src_block_ids: Any, num_blocks: int | None, what: str) -> np.ndarray:
    """Check source ids are >= 0 and, if the source's block count is known, below it (L1).

    Sources may legitimately repeat an id (several destinations of one source block), so
    only the range is checked. Returns the ids as int64.
    """
    ids = as_block_ids(src_block_ids, what)
    _src_range(ids, num_blocks, what)
    return ids


def _src_range(ids: np.ndarray, num_blocks: int | None, what: str) -> int:
    """``validate_src_range`` on int64 ids; returns their maximum (-1 for none)."""
    if ids.size == 0:
        return -1
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0:
        raise LayoutError(f"L1: {what} source block id {lo} is negative")
    if num_blocks is not None:
        num_blocks = _plain_int(num_blocks, f"{what} source block count")
        if hi >= num_blocks:
            raise LayoutError(
                f"L1: {what} source block id {hi} is outside 0..{num_blocks - 1} "
                f"(prefill registered {num_blocks})"
            )
    return hi


@dataclass(frozen=True, eq=False)
class ReadPlan:
    """Descriptors for one batched read: parallel uint64 arrays, one entry per descriptor.

    ``local_addrs`` are destinations on Decode, ``peer_addrs`` sources on Prefill, matching
    ``batch_transfer_sync_read(session, local_addrs, peer_addrs, lengths)``.
    """

    local_addrs: np.ndarray
    peer_addrs: np.ndarray
    lengths: np.ndarray

    def __post_init__(self) -> None:
        arrs = [
            np.asarray(a, dtype=np.uint64).reshape(-1)
            for a in (self.local_addrs, self.peer_addrs, self.lengths)
        ]
        if not arrs[0].shape == arrs[1].shape == arrs[2].shape:
            raise LayoutError(
                f"L1: read plan arrays differ in length: local {arrs[0].size}, "
                f"peer {arrs[1].size}, lengths {arrs[2].size}"
            )
        for name, arr in zip(("local_addrs", "peer_addrs", "lengths"), arrs, strict=True):
            object.__setattr__(self, name, arr)

    @classmethod
    def of_uint64(cls, local: np.ndarray, peer: np.ndarray, lengths: np.ndarray) -> ReadPlan:
        """A plan of three 1-D uint64 arrays of one length, taken as they are: the planner
        builds them so, and the conversions of ``__post_init__`` would only copy."""
        plan = object.__new__(cls)
        for name, arr in (("local_addrs", local), ("peer_addrs", peer), ("lengths", lengths)):
            object.__setattr__(plan, name, arr)
        return plan

    @classmethod
    def empty(cls) -> ReadPlan:
        z = np.zeros(0, dtype=np.uint64)
        return cls(z, z, z)

    def __len__(self) -> int:
        return int(self.lengths.size)

    @property
    def total_bytes(self) -> int:
        # Sum as Python ints would be exact but slow; uint64 cannot overflow for real plans
        # (< 16 EiB), and an empty sum is 0.
        return int(self.lengths.sum(dtype=np.uint64))

    def coalesced(self) -> ReadPlan:
        """Merge neighbours that continue each other on both sides into one descriptor.

        Descriptor ``k+1`` extends ``k`` when both its source and its destination start
        exactly where ``k`` ends. Order is kept; the set of (source byte, destination byte)
        pairs and the total are unchanged.
        """
        n = len(self)
        if n < 2:
            return self
        loc, peer, ln = self.local_addrs, self.peer_addrs, self.lengths
        starts = np.ones(n, dtype=bool)
        starts[1:] = (loc[1:] != loc[:-1] + ln[:-1]) | (peer[1:] != peer[:-1] + ln[:-1])
        heads = np.flatnonzero(starts)
        if heads.size == n:
            return self
        return ReadPlan(loc[heads], peer[heads], np.add.reduceat(ln, heads))


def concat(plans: Iterable[ReadPlan]) -> ReadPlan:
    """Merge the plans of several requests into one batch (one read per layer, C4).

    Runs that happen to continue across request boundaries are coalesced too.
    """
    plans = [p for p in plans if len(p)]
    if not plans:
        return ReadPlan.empty()
    if len(plans) == 1:
        return plans[0]
    return ReadPlan(
        np.concatenate([p.local_addrs for p in plans]),
        np.concatenate([p.peer_addrs for p in plans]),
        np.concatenate([p.lengths for p in plans]),
    ).coalesced()


def _check_group_addrs(src: _SrcTensors, dst: DestLayout, tensors: range, src_hi: int,
                       dst_hi: int, name: str) -> None:
    """Check the highest address of each tensor of one group (its highest ids given) in
    Python ints: uint64 arithmetic would wrap silently."""
    top = {"prefill": src_hi + 1, "decode": dst_hi + 1}
    for t in tensors:
        nbytes = src.ext_block_bytes[t]
        for side, base in (("prefill", src.base_addrs[t]), ("decode", dst.base_addrs[t])):
            if base + top[side] * nbytes - 1 > _U64_MAX:
                raise LayoutError(f"L1: {name} tensor {t} {side} address overflows 64 bits")


def _runs(src_ids: np.ndarray, dst_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The runs of one group's id pairs: the ids where a run starts and each run's length.

    Within a tensor, block ``k+1``'s descriptor continues block ``k``'s on both sides exactly
    when both ids step by one (every block of a tensor has the same length), so runs found
    once on the ids hold for each of the group's tensors."""
    n = src_ids.size
    # written into one full-length mask, so no head has to be prepended by a copy
    starts = np.empty(n, dtype=bool)
    starts[0] = True
    np.not_equal(src_ids[1:], src_ids[:-1] + 1, out=starts[1:])
    starts[1:] |= dst_ids[1:] != dst_ids[:-1] + 1
    heads = np.flatnonzero(starts)
    if heads.size == n:
        return src_ids, dst_ids, np.ones(n, dtype=np.uint64)
    runs = np.empty(heads.size, dtype=np.uint64)
    runs[:-1] = heads[1:] - heads[:-1]
    runs[-1] = n - heads[-1]
    return src_ids[heads], dst_ids[heads], runs


@functools.lru_cache(maxsize=1024)
def _group_consts(s: _SrcTensors, dst: DestLayout,
                  tensors: range) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Block bytes, destination and source bases of a group's tensors as uint64 columns,
    so one broadcast builds every tensor's descriptors of the group at once."""
    def column(values: Iterable[int]) -> np.ndarray:
        return np.array(list(values), dtype=np.uint64).reshape(-1, 1)
    return (column(s.ext_block_bytes[t] for t in tensors),
            column(dst.base_addrs[t] for t in tensors),
            column(s.base_addrs[t] for t in tensors))


def _coalesced_plan(s: _SrcTensors, dst: DestLayout,
                    groups: list[tuple[range, np.ndarray, np.ndarray]]) -> ReadPlan:
    """The plan ``ReadPlan.coalesced`` would make of the per-block descriptors of ``groups``
    (tensor after tensor), built from the runs' heads only, in place: no per-block
    descriptor is built to be merged, no part built to be copied into the whole."""
    return _plan_from_runs(s, dst, [(tensors, *_runs(sid, did)) for tensors, sid, did in groups])


def _plan_from_runs(s: _SrcTensors, dst: DestLayout,
                    runs: list[tuple[range, np.ndarray, np.ndarray, np.ndarray]]) -> ReadPlan:
    """:func:`_coalesced_plan` from each group's runs: (tensors, source ids where a run
    starts, destination ids where it starts, run lengths in blocks)."""
    # Written straight into the plan's arrays: a layer planned once needs no offsets kept
    # (plan_joined keeps them, through _plan_of_offsets, for the layers that repeat it).
    total = sum(len(tensors) * heads.size for tensors, heads, _, _ in runs)
    local, peer, lengths = (np.empty(total, dtype=np.uint64) for _ in range(3))
    at = 0
    for tensors, sid, did, count in runs:
        k, end = count.size, at + len(tensors) * count.size
        nbytes, dst_base, src_base = _group_consts(s, dst, tensors)
        # one row per tensor of the group: (ids x its block bytes) + its base
        loc = local[at:end].reshape(-1, k)
        np.multiply(did.astype(np.uint64, copy=False), nbytes, out=loc)
        loc += dst_base
        src = peer[at:end].reshape(-1, k)
        np.multiply(sid.astype(np.uint64, copy=False), nbytes, out=src)
        src += src_base
        np.multiply(count, nbytes, out=lengths[at:end].reshape(-1, k))
        at = end
    groups = [(tensors, _run_ends(sid, did, count)) for tensors, sid, did, count in runs]
    if not _abutting(s, dst, groups):
        return ReadPlan.of_uint64(local, peer, lengths)
    return ReadPlan.of_uint64(local, peer, lengths).coalesced()


def _offsets_of(s: _SrcTensors, dst: DestLayout, tensors: range, sid: np.ndarray,
                did: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One group's descriptors less their bases, one row per tensor of the group: ids (and
    run lengths) times the tensor's block bytes, as destination offsets, source offsets
    and lengths."""
    nbytes = _group_consts(s, dst, tensors)[0]
    return (np.multiply(did.astype(np.uint64, copy=False), nbytes),
            np.multiply(sid.astype(np.uint64, copy=False), nbytes), count * nbytes)


def _plan_of_offsets(s: _SrcTensors, dst: DestLayout, tensors: list[range],
                     offsets: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                     ends: list[tuple[int, int, int, int]]) -> ReadPlan:
    """The plan of groups whose descriptors less their bases are ``offsets`` (see
    ``_offsets_of``) and whose runs end as ``ends`` say (``_run_ends``): each tensor's
    bases added, written tensor after tensor into the plan's arrays."""
    total = sum(lens.size for _, _, lens in offsets)
    local, peer, lengths = (np.empty(total, dtype=np.uint64) for _ in range(3))
    at = 0
    for ts, (loc_off, peer_off, lens) in zip(tensors, offsets, strict=True):
        end = at + lens.size
        _, dst_base, src_base = _group_consts(s, dst, ts)
        np.add(loc_off, dst_base, out=local[at:end].reshape(lens.shape))
        np.add(peer_off, src_base, out=peer[at:end].reshape(lens.shape))
        lengths[at:end] = lens.reshape(-1)
        at = end
    if not _abutting(s, dst, list(zip(tensors, ends, strict=True))):
        return ReadPlan.of_uint64(local, peer, lengths)
    return ReadPlan.of_uint64(local, peer, lengths).coalesced()


def _run_ends(sid: np.ndarray, did: np.ndarray, count: np.ndarray) -> tuple[int, int, int, int]:
    """A group's first source and destination ids and the ids just past its last run, as
    Python ints (numpy scalars cost about a microsecond per operation)."""
    last = int(count[-1])
    return int(sid[0]), int(did[0]), int(sid[-1]) + last, int(did[-1]) + last


def _abutting(s: _SrcTensors, dst: DestLayout,
              groups: list[tuple[range, tuple[int, int, int, int]]]) -> bool:
    """Whether, across tensors (and groups), a descriptor continues the one before it on
    both sides, which happens where the regions abut: then ``coalesced()`` merges them.
    Only each tensor's first and last descriptor can, so they are worked out from each
    group's run ends (``_run_ends``)."""
    ends: tuple[int, int] | None = None  # where the previous tensor's last descriptor ends
    for tensors, (first_s, first_d, last_s, last_d) in groups:
        for t in tensors:
            nbytes, d_base, s_base = s.ext_block_bytes[t], dst.base_addrs[t], s.base_addrs[t]
            if ends == (d_base + first_d * nbytes, s_base + first_s * nbytes):
                return True
            ends = (d_base + last_d * nbytes, s_base + last_s * nbytes)
    return False


@dataclass(frozen=True)
class _GroupLimits:
    """What bounds one group's ids in a layer: its tensors, the smallest destination
    capacity among them, and the largest source and destination ids whose last byte is
    still addressable in 64 bits on every tensor of the group."""

    tensors: range
    capacity: int
    src_top: int
    dst_top: int


@functools.lru_cache(maxsize=1024)
def _group_limits(s: _SrcTensors, dst: DestLayout) -> tuple[_GroupLimits, _GroupLimits | None]:
    """Main's and (if the layer has one) the indexer's :class:`_GroupLimits`. The address
    bound is the one ``_check_group_addrs`` tests, solved for the id once per layout pair:
    ``base + (id + 1) * nbytes - 1 <= 2**64 - 1`` holds exactly for
    ``id <= (2**64 - base) // nbytes - 1``."""
    def limits(tensors: range) -> _GroupLimits:
        def top(bases: tuple[int, ...]) -> int:
            return min((_U64_MAX + 1 - bases[t]) // s.ext_block_bytes[t] - 1 for t in tensors)
        return _GroupLimits(tensors, min(dst.num_blocks[t] for t in tensors),
                            top(s.base_addrs), top(dst.base_addrs))
    main = limits(range(s.main_tensor_count))
    if not s.has_indexer:
        return main, None
    return main, limits(range(s.main_tensor_count, len(s.base_addrs)))


def plan_joined_reads(src: LayerLayout, dst: DestLayout, src_ids: np.ndarray,
                      dst_ids: np.ndarray, split: int, *, distinct: bool = False) -> ReadPlan:
    """:func:`plan_layer_reads` of a layer whose main and indexer pairs come joined: main's
    are ``[0, split)`` of ``src_ids`` and ``dst_ids``, the indexer's the rest (L1, C4).

    The same plan and the same refusals as ``plan_layer_reads(src, dst, src_ids[:split],
    dst_ids[:split], src_ids[split:], dst_ids[split:])``, in about half the numpy calls:
    Decode plans every layer of every READY, and on a few thousand ids each call's fixed
    cost is most of its time. Both groups are range-checked, proved distinct and cut into
    runs in one pass each; any check that fails hands the pairs to ``plan_layer_reads``,
    which words the refusal (so the first error found is the one it would name first).
    ``distinct``: the caller knows each group's destination ids to be pairwise distinct
    (a plan of these very ids, split alike, passed before), so that proof is skipped."""
    return plan_joined(src, dst, src_ids, dst_ids, split, distinct=distinct)[0]


class JoinedPairs:
    """What planning learned of one layer's joined id pairs that no layout changes: each
    group's lowest and highest ids, whether each group's destinations are distinct, the
    runs (see :func:`_runs`) and, per block size, the descriptors' offsets from their
    tensors' bases. Every layer of a Decode step carries the same pairs, so a step works
    them out once; :func:`plan_joined` takes them again only for pairs equal by value
    (the ids are kept as bytes), and still range-checks them against each layer's own
    limits (L1) and adds each layer's own bases."""

    __slots__ = ("_src", "_dst", "split", "groups", "lows", "highs", "distinct", "runs",
                 "ends", "_offsets")

    def __init__(self, src_ids: np.ndarray, dst_ids: np.ndarray, split: int,
                 groups: int) -> None:
        self._src = (src_ids.dtype, src_ids.tobytes())
        self._dst = (dst_ids.dtype, dst_ids.tobytes())
        self.split, self.groups = split, groups
        firsts = (0, split) if groups == 2 else (0,)
        # per group: destination low, destination high, source low, source high
        self.lows = (np.minimum.reduceat(dst_ids, firsts).tolist(),
                     np.minimum.reduceat(src_ids, firsts).tolist()
                     if src_ids.dtype.kind == "i" else [0] * groups)
        self.highs = (np.maximum.reduceat(dst_ids, firsts).tolist(),
                      np.maximum.reduceat(src_ids, firsts).tolist())
        self.distinct = False
        self.runs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.ends: list[tuple[int, int, int, int]] = []  # per group, see _run_ends
        self._offsets: dict[tuple[int, ...], list[tuple[np.ndarray, ...]]] = {}

    def same(self, src_ids: np.ndarray, dst_ids: np.ndarray, split: int, groups: int) -> bool:
        """Whether these pairs, split alike, are the ones this was worked out for."""
        return (split == self.split and groups == self.groups
                and self._dst == (dst_ids.dtype, dst_ids.tobytes())
                and self._src == (src_ids.dtype, src_ids.tobytes()))

    def find_runs(self, src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
        """The runs of both groups at once; a run never crosses from main into indexer."""
        n, split = src_ids.size, self.split
        hi_s, hi_d = max(self.highs[1]), max(self.highs[0])
        # Narrow ids step by one without wrapping only below their type's maximum (a
        # READY's ids may all fit uint8, and 255 + 1 must not read as 0).
        if src_ids.dtype.itemsize < 8 and hi_s >= _top_of(src_ids.dtype):
            src_ids = src_ids.astype(np.int64)
        if dst_ids.dtype.itemsize < 8 and hi_d >= _top_of(dst_ids.dtype):
            dst_ids = dst_ids.astype(np.int64)
        starts = np.empty(n, dtype=bool)
        starts[0] = True
        np.not_equal(src_ids[1:], src_ids[:-1] + 1, out=starts[1:])
        starts[1:] |= dst_ids[1:] != dst_ids[:-1] + 1
        if self.groups == 2:
            starts[split] = True
        heads = np.flatnonzero(starts)
        count = np.empty(heads.size, dtype=np.uint64)
        count[:-1] = heads[1:] - heads[:-1]
        count[-1] = n - heads[-1]
        sid, did = src_ids[heads].astype(np.uint64), dst_ids[heads].astype(np.uint64)
        if self.groups == 1:
            self.runs = [(sid, did, count)]
        else:
            k = int(np.count_nonzero(starts[:split]))
            self.runs = [(sid[:k], did[:k], count[:k]), (sid[k:], did[k:], count[k:])]
        self.ends = [_run_ends(*run) for run in self.runs]

    def offsets(self, s: _SrcTensors, dst: DestLayout,
                tensors: list[range]) -> list[tuple[np.ndarray, ...]]:
        """Per group (of ``tensors``): destination offsets, source offsets and lengths, one
        row per tensor, ids times the tensor's block bytes; kept per block-size pattern."""
        key = (s.main_tensor_count, *s.ext_block_bytes)
        got = self._offsets.get(key)
        if got is None:
            got = [_offsets_of(s, dst, ts, *run)
                   for ts, run in zip(tensors, self.runs, strict=True)]
            if len(self._offsets) < _OFFSET_KINDS:
                self._offsets[key] = got
        return got


#: block-size patterns of one layer's pairs whose offsets a :class:`JoinedPairs` keeps
_OFFSET_KINDS = 8


def plan_joined(src: LayerLayout, dst: DestLayout, src_ids: np.ndarray, dst_ids: np.ndarray,
                split: int, *, distinct: bool = False,
                known: JoinedPairs | None = None) -> tuple[ReadPlan, JoinedPairs | None]:
    """:func:`plan_joined_reads`, and the :class:`JoinedPairs` it worked out (None where
    the pairs were refused or are empty). ``known``: what an earlier call returned; used
    only where these pairs equal its own by value, split alike, and otherwise ignored."""
    s = _checked_pair(src, dst)
    main, indexer = _group_limits(s, dst)
    if indexer is None:  # a layer without indexer reads none of those ids (legacy entries)
        src_ids, dst_ids = src_ids[:split], dst_ids[:split]
    # a source list that is no array is refused just below, whatever n says
    n = src_ids.size if isinstance(src_ids, np.ndarray) else -1

    def refuse() -> tuple[ReadPlan, None]:
        return plan_layer_reads(src, dst, src_ids[:split], dst_ids[:split],
                                src_ids[split:], dst_ids[split:]), None

    if (not isinstance(src_ids, np.ndarray) or not isinstance(dst_ids, np.ndarray)
            or src_ids.ndim != 1 or dst_ids.ndim != 1 or dst_ids.size != n
            or not 0 <= split <= n
            or src_ids.dtype.kind not in "iu" or dst_ids.dtype.kind not in "iu"
            or src_ids.dtype.itemsize == 8 and src_ids.dtype.kind == "u"
            or dst_ids.dtype.itemsize == 8 and dst_ids.dtype.kind == "u"):
        return refuse()
    if n == 0:
        return ReadPlan.empty(), None
    groups = [g for g, size in ((main, split), (indexer, n - split)) if size]
    both = len(groups) == 2
    pairs = known if known is not None and known.same(src_ids, dst_ids, split, len(groups)) \
        else JoinedPairs(src_ids, dst_ids, split, len(groups))
    (d_lo, s_lo), (d_hi, s_hi) = pairs.lows, pairs.highs
    for g, dlo, dhi, slo, shi in zip(groups, d_lo, d_hi, s_lo, s_hi, strict=True):
        if dlo < 0 or dhi >= g.capacity or dhi > g.dst_top or slo < 0 or shi > g.src_top:
            return refuse()
    if not pairs.distinct:
        if n > 1 and not distinct and not _joined_distinct(
                dst_ids, split if both else 0, [g.capacity for g in groups]):
            return refuse()
        pairs.distinct = True  # of these destination ids, whatever the layout (L1)
    if not pairs.runs:
        pairs.find_runs(src_ids, dst_ids)
    tensors = [g.tensors for g in groups]
    return _plan_of_offsets(s, dst, tensors, pairs.offsets(s, dst, tensors), pairs.ends), pairs


@functools.lru_cache(maxsize=16)
def _top_of(dtype: np.dtype) -> int:
    """The largest value of an integer dtype (``np.iinfo`` costs microseconds a call)."""
    return int(np.iinfo(dtype).max)


def _joined_distinct(ids: np.ndarray, split: int, capacities: list[int]) -> bool:
    """Whether each group of ``ids`` (one group, or ``[0, split)`` and the rest when
    ``split``) is pairwise distinct, every id already within its group's capacity:
    :func:`_distinct` for both groups at once. Increasing groups prove it in one
    comparison pass; otherwise one bitmap holds both, the indexer's part starting past
    main's capacity, so a main id and an indexer id never meet."""
    steps = ids[1:] > ids[:-1]
    if split:
        steps[split - 1] = True  # the groups are independent: no step across them
    if steps.all():
        return True
    if sum(capacities) > 64 * ids.size:
        bounds = (0, split, ids.size) if split else (0, ids.size)
        return all(_distinct(ids[a:b], cap) for a, b, cap
                   in zip(bounds[:-1], bounds[1:], capacities, strict=True) if b - a > 1)
    seen = np.zeros(sum(capacities), dtype=bool)
    if split:
        seen[ids[:split]] = True
        seen[capacities[0]:][ids[split:]] = True  # a view: no shifted copy, no overflow
    else:
        seen[ids] = True
    return int(np.count_nonzero(seen)) == ids.size


def plan_layer_reads(
    src: LayerLayout,
    dst: DestLayout,
    src_main_ids: Any,
    dst_main_ids: Any,
    src_idx_ids: Any,
    dst_idx_ids: Any,
    *,
    src_num_blocks: Sequence[int] | None = None,
) -> ReadPlan:
    """Validate one layer of one request and build its coalesced read descriptors (L1, C4).

    ``src_*_ids`` are Prefill block ids (from READY), ``dst_*_ids`` the Decode destination
    block ids they land in, pairwise. Main ids apply to every main tensor; indexer ids to
    the indexer and, if present, the LIC8 scale (T3). If the layer has no indexer, the
    indexer ids are ignored (legacy READY entries repeat the main ids there). Everything is
    checked before anything is built, so a bad layer yields an error, never a partial plan.
    ``src_num_blocks`` (per tensor), when known, bounds the source ids.
    """
    s = _checked_pair(src, dst)
    n_tensors = len(s.base_addrs)
    if src_num_blocks is not None and len(src_num_blocks) != n_tensors:
        raise LayoutError(
            f"L1: src_num_blocks has {len(src_num_blocks)} entries for {n_tensors} tensors"
        )

    groups = [("main", range(s.main_tensor_count), src_main_ids, dst_main_ids)]
    if s.has_indexer:
        groups.append(("indexer", range(s.main_tensor_count, n_tensors), src_idx_ids, dst_idx_ids))

    # First pass: every check, so failure leaves nothing half-built (L1).
    checked = []
    for name, tensors, raw_src, raw_dst in groups:
        sid = as_block_ids(raw_src, f"{name} prefill")
        did = as_block_ids(raw_dst, f"{name} decode")
        if sid.size != did.size:
            raise _mismatch(f"{name} block id count", sid.size, did.size)
        # The ids are shared by the group's tensors, so checking against the smallest
        # capacity covers them all with one sort.
        t_dst = min(tensors, key=lambda t: dst.num_blocks[t])
        dst_hi = _dest_range(did, dst.num_blocks[t_dst], f"{name} tensor {t_dst}")
        if src_num_blocks is None:
            src_hi = _src_range(sid, None, name)
        else:
            t_src = min(tensors, key=lambda t: src_num_blocks[t])
            src_hi = _src_range(sid, src_num_blocks[t_src], f"{name} tensor {t_src}")
        checked.append((name, tensors, sid, did, src_hi, dst_hi))

    checked = [c for c in checked if c[2].size]
    for name, tensors, _, _, src_hi, dst_hi in checked:
        _check_group_addrs(s, dst, tensors, src_hi, dst_hi, name)
    if not checked:
        return ReadPlan.empty()
    return _coalesced_plan(s, dst, [(tensors, sid, did) for _, tensors, sid, did, _, _ in checked])
