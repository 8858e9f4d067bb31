"""Unequal-TP mapping, port arithmetic and block-share cutting (T1-T6, P1-P2, X3).

Everything here is pure integer arithmetic so Prefill, Decode, the model checker and the
operator CLI (`sfa-rd2h plan`) compute exactly the same answer from the same inputs. Rule
IDs refer to spec/PROTOCOL.md; every rejection is a ``TopologyError`` whose message starts with
the ID of the rule it enforces, so a log line leads straight to the spec.

Block shares
------------
A chunk of a request covers request-relative block positions ``[start, stop)``. For one
layer, Prefill sends every member of a contributor group the chunk's **full** main and
indexer block lists, each with its destination start ``start`` (T6, as upstream does), and
each Decode rank cuts what it reads:

* **main** (T2, T5): replicated across the group on Prefill, so only member 0's main is
  read. The Decode ranks share one CPU pool for it, so each rank reads its own near-equal
  piece, the piece order rotated by the chunk's start.
* **indexer** (T3): every Decode rank needs the full indexer, so the ``ratio`` members of a
  group split the chunk among themselves. The optional LIC8 scale tensor follows the
  indexer range exactly.

Because the lists are by position, destination position ``start + k`` is simply the
request's ``dest_ids[start + k]`` on Decode (C1: Decode block ids never leave Decode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import TopologyError

MIN_PORT = 1
MAX_PORT = 65535


def _int(value: Any, name: str, rule: str, minimum: int = 0) -> int:
    """Return ``value`` as a plain int, rejecting bools, floats and values below ``minimum``.

    numpy integers are accepted (ids and ranks often come out of arrays); bools are not,
    because ``True`` silently acting as ``1`` would hide a caller passing the wrong field.
    """
    if type(value) is not int:  # plain ints (the per-entry hot path) skip the type tests
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TopologyError(f"{rule}: {name} must be an int, got {value!r}")
        value = int(value)
    if value < minimum:
        raise TopologyError(f"{rule}: {name}={value} must be >= {minimum}")
    return value


# --------------------------------------------------------------------------------------
# T1 / X3: the P -> D rank mapping
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TpMapping:
    """A validated Prefill/Decode TP pairing. Build it with :func:`tp_mapping` (T1)."""

    p_tp: int
    d_tp: int

    @property
    def ratio(self) -> int:
        """Prefill ranks per Decode rank: the size of one contributor group (T1)."""
        return self.p_tp // self.d_tp

    def _check_p_rank(self, p_rank: int) -> int:
        p_rank = _int(p_rank, "p_rank", "T1")
        if p_rank >= self.p_tp:
            raise TopologyError(f"T1: p_rank={p_rank} is outside 0..{self.p_tp - 1}")
        return p_rank

    def d_rank(self, p_rank: int) -> int:
        """The Decode rank that Prefill rank ``p_rank`` sends to (T1)."""
        return self._check_p_rank(p_rank) // self.ratio

    def group_member_idx(self, p_rank: int) -> int:
        """Position of ``p_rank`` inside its contributor group; member 0 sends main KV (T2)."""
        return self._check_p_rank(p_rank) % self.ratio

    def contributors(self, d_rank: int) -> range:
        """The Prefill ranks mapped to ``d_rank``; Decode waits for all of them (R1)."""
        d_rank = _int(d_rank, "d_rank", "T1")
        if d_rank >= self.d_tp:
            raise TopologyError(f"T1: d_rank={d_rank} is outside 0..{self.d_tp - 1}")
        return range(d_rank * self.ratio, (d_rank + 1) * self.ratio)


def tp_mapping(p_tp: int, d_tp: int, *, d_pcp: int = 1, d_dcp: int = 1) -> TpMapping:
    """Validate a Prefill/Decode TP pairing and return its mapping (T1, X3).

    ``d_pcp`` / ``d_dcp`` are Decode's context-parallel sizes as advertised in the
    rendezvous; Decode supports TP only (X3), so anything but 1 is refused here at start-up
    rather than surfacing later as a wrong block split.
    """
    p_tp = _int(p_tp, "p_tp", "T1", minimum=1)
    d_tp = _int(d_tp, "d_tp", "T1", minimum=1)
    d_pcp = _int(d_pcp, "d_pcp", "X3", minimum=1)
    d_dcp = _int(d_dcp, "d_dcp", "X3", minimum=1)
    if d_pcp != 1 or d_dcp != 1:
        raise TopologyError(
            f"X3: Decode supports tensor parallelism only, got d_pcp={d_pcp} d_dcp={d_dcp}"
        )
    if p_tp < d_tp:
        raise TopologyError(f"T1: p_tp={p_tp} is smaller than d_tp={d_tp} (need p_tp >= d_tp)")
    if p_tp % d_tp:
        raise TopologyError(f"T1: p_tp={p_tp} is not a multiple of d_tp={d_tp}")
    return TpMapping(p_tp, d_tp)


# --------------------------------------------------------------------------------------
# P1 / P2: ports
# --------------------------------------------------------------------------------------


def _check_port_span(base_port: int, d_tp: int, rule: str) -> None:
    """Every Decode rank port ``base_port .. base_port + d_tp - 1`` must be a valid port."""
    if not MIN_PORT <= base_port <= MAX_PORT:
        raise TopologyError(f"{rule}: base port {base_port} is outside {MIN_PORT}..{MAX_PORT}")
    highest = base_port + d_tp - 1
    if highest > MAX_PORT:
        raise TopologyError(
            f"P2: highest Decode TP port {highest} (base {base_port} + d_tp {d_tp} - 1) "
            f"exceeds {MAX_PORT}"
        )


def decode_base_port(kv_port: int, global_dp_rank: int, d_tp: int) -> int:
    """Base port of a Decode DP replica: ``kv_port + global_dp_rank * d_tp`` (P1).

    The *global* DP rank keeps two engines on one host from colliding (P1). The whole span
    of rank ports is validated here, so a replica cannot start with an unusable port (P2).
    """
    kv_port = _int(kv_port, "kv_port", "P1")
    if not MIN_PORT <= kv_port <= MAX_PORT:
        raise TopologyError(f"P1: kv_port={kv_port} is outside {MIN_PORT}..{MAX_PORT}")
    global_dp_rank = _int(global_dp_rank, "global_dp_rank", "P1")
    d_tp = _int(d_tp, "d_tp", "P1", minimum=1)
    base = kv_port + global_dp_rank * d_tp
    if base > MAX_PORT:
        raise TopologyError(
            f"P2: base port {base} (kv_port {kv_port} + dp rank {global_dp_rank} * d_tp {d_tp}) "
            f"exceeds {MAX_PORT}"
        )
    _check_port_span(base, d_tp, "P2")
    return base


def _rank_port(base_port: int, rank: int, d_tp: int, rule: str) -> int:
    base_port = _int(base_port, "base_port", rule)
    d_tp = _int(d_tp, "d_tp", rule, minimum=1)
    rank = _int(rank, "rank", rule)
    if rank >= d_tp:
        raise TopologyError(f"{rule}: Decode TP rank {rank} is outside 0..{d_tp - 1}")
    _check_port_span(base_port, d_tp, rule)
    return base_port + rank


def decode_rank_port(base_port: int, tp_rank: int, d_tp: int) -> int:
    """The port Decode TP rank ``tp_rank`` binds its ROUTER on (P1)."""
    return _rank_port(base_port, tp_rank, d_tp, "P1")


def remote_port(base_port: int, d_rank: int, d_tp: int) -> int:
    """The port a Prefill rank connects to: advertised base port + mapped Decode rank (P2).

    ``base_port`` comes from the metaserver, i.e. from another process, so both the highest
    Decode port and the final port are re-validated here rather than trusted (P2).
    """
    return _rank_port(base_port, d_rank, d_tp, "P2")


def plan(p_tp: int, d_tp: int, kv_port: int, d_dp_rank: int) -> dict[str, Any]:
    """The full rank/port table for one Decode DP replica and its Prefill peers.

    Backs ``sfa-rd2h plan`` so an operator can see, before starting anything, which Prefill
    rank talks to which Decode port. Keys: ``prefill`` (one entry per P rank), ``decode``
    (one per D rank), plus the inputs and derived ``tp_ratio`` / ``base_port`` for context.
    """
    m = tp_mapping(p_tp, d_tp)
    base = decode_base_port(kv_port, d_dp_rank, m.d_tp)
    prefill = [
        {
            "p_rank": p,
            "d_rank": m.d_rank(p),
            "group_member_idx": m.group_member_idx(p),
            "tp_ratio": m.ratio,
            "remote_port": remote_port(base, m.d_rank(p), m.d_tp),
        }
        for p in range(m.p_tp)
    ]
    decode = [{"d_rank": d, "port": decode_rank_port(base, d, m.d_tp)} for d in range(m.d_tp)]
    return {
        "p_tp": m.p_tp,
        "d_tp": m.d_tp,
        "tp_ratio": m.ratio,
        "kv_port": kv_port,
        "d_dp_rank": d_dp_rank,
        "base_port": base,
        "prefill": prefill,
        "decode": decode,
    }


# --------------------------------------------------------------------------------------
# T2 / T3 / T5: block shares
# --------------------------------------------------------------------------------------


def split_bounds(start: Any, stop: Any, idx: Any, parts: Any) -> tuple[Any, Any]:
    """Bounds of the ``idx``-th of ``parts`` near-equal contiguous pieces of ``[start, stop)``.

    The first ``(stop - start) % parts`` pieces hold one block more than the rest, so sizes
    differ by at most one and the pieces tile the range exactly. Branch-free, so it works
    elementwise on numpy arrays as well as on ints; no validation (callers do that).
    """
    q, r = divmod(stop - start, parts)
    if type(start) is int and type(stop) is int and type(idx) is int and type(parts) is int:
        # Same formula on plain ints (Decode cuts every entry of every layer): np.minimum on
        # Python scalars costs far more than the arithmetic around it.
        lo = start + idx * q + (idx if idx < r else r)
        return lo, lo + q + (idx < r)
    lo = start + idx * q + np.minimum(idx, r)
    hi = lo + q + (idx < r)
    if isinstance(lo, np.ndarray):
        return lo, hi
    return int(lo), int(hi)


def _check_chunk(start: int, stop: int, rule: str) -> tuple[int, int]:
    start = _int(start, "start", rule)
    stop = _int(stop, "stop", rule)
    if stop < start:
        raise TopologyError(f"{rule}: chunk [{start}, {stop}) has stop < start")
    return start, stop


def subrange(n: Any, rank: Any, size: Any, start: Any) -> tuple[Any, Any]:
    """Offsets ``(lo, hi)`` within ``[0, n)`` of the piece that ``rank`` of ``size`` takes of
    ``n`` blocks whose first block sits at request position ``start``.

    The upstream Decode's rule, kept bit for bit so mixed deployments agree (T6): the piece
    order is rotated by ``start``, so consecutive small chunks land on different ranks
    instead of always on rank 0 (T5). Pieces differ by at most one block and tile
    ``[0, n)``. Branch-free, so it also works elementwise on numpy arrays.
    """
    logical = (rank - start % size) % size
    return split_bounds(0, n, logical, size)


@dataclass(frozen=True)
class Cut:
    """What one Decode rank reads of one READY entry: offsets into the entry's main and
    indexer block lists (the LIC8 scale follows the indexer, T3)."""

    main: tuple[int, int]
    indexer: tuple[int, int]


@dataclass(frozen=True)
class Cuts:
    """:class:`Cut` for every entry of a layer at once: int64 arrays of offsets into each
    entry's main and indexer lists, entry ``i`` at index ``i``."""

    main_lo: np.ndarray
    main_hi: np.ndarray
    indexer_lo: np.ndarray
    indexer_hi: np.ndarray

    def __getitem__(self, i: int) -> Cut:
        return Cut(main=(int(self.main_lo[i]), int(self.main_hi[i])),
                   indexer=(int(self.indexer_lo[i]), int(self.indexer_hi[i])))


def _counts(value: Any, name: str, rule: str) -> np.ndarray:
    """A one-dimensional array of non-negative integers (what a layer's entries carry)."""
    arr = np.asarray(value)
    if arr.dtype == np.int64 and arr.ndim == 1:  # what Decode passes, every layer
        if arr.size and int(arr.min()) < 0:
            raise TopologyError(f"{rule}: {name}={int(arr.min())} must be >= 0")
        return arr
    if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
        raise TopologyError(f"{rule}: {name} must be a 1-d array of ints, got {value!r}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and int(arr.min()) < 0:
        raise TopologyError(f"{rule}: {name}={int(arr.min())} must be >= 0")
    return arr


def decode_cuts(n_main: Any, n_indexer: Any, main_start: Any, indexer_start: Any, member: int,
                ratio: int, d_rank: int, d_tp: int, *, main_shared: bool = True) -> Cuts:
    """The share of each entry of a layer that Decode rank ``d_rank`` of ``d_tp`` reads when
    the layer came from member ``member`` of a contributor group of ``ratio`` (T2, T3, T5,
    T6). The first four arguments hold one value per entry; one numpy pass cuts them all.

    Prefill sends every member the chunk's full lists; Decode cuts here. Main KV is
    replicated across the group, so only member 0's main is read (T2); where the main
    destination is one pool shared by the Decode TP ranks (``main_shared``), each rank reads
    its own piece of it (T5), otherwise member 0's rank reads the whole range. Every Decode
    rank needs the whole indexer, so the members split it among themselves (T3).
    """
    n_main = _counts(n_main, "main block count", "T6")
    n_indexer = _counts(n_indexer, "indexer block count", "T6")
    main_start = _counts(main_start, "main_dest_start", "T6")
    indexer_start = _counts(indexer_start, "indexer_dest_start", "T6")
    if not n_main.size == n_indexer.size == main_start.size == indexer_start.size:
        raise TopologyError("T6: one count and one start per entry, for main and indexer")
    ratio = _int(ratio, "ratio", "T3", minimum=1)
    member = _int(member, "member", "T3")
    if member >= ratio:
        raise TopologyError(f"T3: member={member} is outside 0..{ratio - 1}")
    d_tp = _int(d_tp, "d_tp", "T5", minimum=1)
    d_rank = _int(d_rank, "d_rank", "T5")
    if d_rank >= d_tp:
        raise TopologyError(f"T5: d_rank={d_rank} is outside 0..{d_tp - 1}")
    if member != 0:
        main_lo = main_hi = np.zeros_like(n_main)
    elif main_shared:
        main_lo, main_hi = subrange(n_main, d_rank, d_tp, main_start)
    else:
        main_lo, main_hi = np.zeros_like(n_main), n_main
    indexer_lo, indexer_hi = subrange(n_indexer, member, ratio, indexer_start)
    return Cuts(main_lo, main_hi, indexer_lo, indexer_hi)


def decode_cut(n_main: int, n_indexer: int, main_start: int, indexer_start: int, member: int,
               ratio: int, d_rank: int, d_tp: int, *, main_shared: bool = True) -> Cut:
    """:func:`decode_cuts` for a single entry."""
    counts = [_int(v, name, "T6") for v, name in (
        (n_main, "main block count"), (n_indexer, "indexer block count"),
        (main_start, "main_dest_start"), (indexer_start, "indexer_dest_start"))]
    return decode_cuts(*([c] for c in counts), member, ratio, d_rank, d_tp,
                       main_shared=main_shared)[0]


def main_share(start: int, stop: int, d_rank: int, d_tp: int) -> tuple[int, int]:
    """The request positions ``(lo, hi)`` of chunk ``[start, stop)`` whose main KV Decode
    rank ``d_rank`` reads into a pool shared by the Decode TP ranks (T5)."""
    start, stop = _check_chunk(start, stop, "T5")
    cut = decode_cut(stop - start, 0, start, start, 0, 1, d_rank, d_tp)
    return start + cut.main[0], start + cut.main[1]


def indexer_share(start: int, stop: int, member: int, ratio: int) -> tuple[int, int]:
    """The request positions ``(lo, hi)`` of chunk ``[start, stop)`` whose indexer (and LIC8
    scale) every Decode rank reads from contributor ``member`` (T3). The members' ranges
    tile the chunk, so each Decode rank assembles a full indexer copy."""
    start, stop = _check_chunk(start, stop, "T3")
    cut = decode_cut(0, stop - start, start, start, member, ratio, 0, 1)
    return start + cut.indexer[0], start + cut.indexer[1]
