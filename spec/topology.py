"""Unequal-TP mapping, port arithmetic and block-share splitting (T1-T5, P1-P2, X3).

Everything here is pure integer arithmetic so Prefill, Decode, the model checker and the
operator CLI (`sfa-rd2h plan`) compute exactly the same answer from the same inputs. Rule
IDs refer to PROTOCOL.md; every rejection is a ``TopologyError`` whose message starts with
the ID of the rule it enforces, so a log line leads straight to the spec.

Block shares
------------
A chunk of a request covers request-relative block positions ``[start, stop)``. For one
layer each Prefill rank sends to its Decode rank:

* a **main** range (T2, T5): the chunk is split into ``d_tp`` near-equal contiguous ranges,
  one per Decode rank, because the Decode ranks share one CPU pool and each pulls its own
  part. Main KV is replicated across a contributor group on Prefill, so only member 0 sends
  it; other members get an empty range.
* an **indexer** range (T3): every Decode rank needs the full indexer, so the ``ratio``
  members of its contributor group split the chunk among themselves. The optional LIC8
  scale tensor follows the indexer range exactly (same positions, same destination start).

Because the ranges are positions, the destination start of a range is simply its ``lo``:
Decode maps position ``p`` to its own destination block ``dest_ids[p]`` (C1: Decode block
ids never leave Decode).
"""

from __future__ import annotations

import zlib
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


def rotation(ext_req_id: str, chunk_start: int, d_tp: int) -> int:
    """Which Decode rank receives the first main range of a chunk (T5).

    ``crc32`` (not ``hash()``, which is salted per process) makes every Prefill rank agree.
    Adding ``chunk_start`` turns consecutive chunks into a round robin: a chunk of ``n``
    blocks gives its ``n % d_tp`` extra blocks to the ranks starting at the rotation, and
    the next chunk's rotation starts exactly where those extras ended, so over a request
    the per-rank main totals differ by at most one block whatever the chunk sizes.
    """
    if not isinstance(ext_req_id, str):
        raise TopologyError(f"T5: ext_req_id must be a str, got {ext_req_id!r}")
    chunk_start = _int(chunk_start, "chunk_start", "T5")
    d_tp = _int(d_tp, "d_tp", "T5", minimum=1)
    return (zlib.crc32(ext_req_id.encode("utf-8")) + chunk_start) % d_tp


def main_share(start: int, stop: int, d_rank: int, d_tp: int, rotation: int) -> tuple[int, int]:
    """The main-KV range ``(lo, hi)`` that Decode rank ``d_rank`` pulls from a chunk (T5).

    Rank ``(i + rotation) % d_tp`` gets the ``i``-th of ``d_tp`` near-equal pieces, so for
    chunks shorter than ``d_tp`` the non-empty pieces start at the rotated rank instead of
    always at rank 0.
    """
    start, stop = _check_chunk(start, stop, "T5")
    d_tp = _int(d_tp, "d_tp", "T5", minimum=1)
    d_rank = _int(d_rank, "d_rank", "T5")
    if d_rank >= d_tp:
        raise TopologyError(f"T5: d_rank={d_rank} is outside 0..{d_tp - 1}")
    rot = _int(rotation, "rotation", "T5")
    return split_bounds(start, stop, (d_rank - rot) % d_tp, d_tp)


def indexer_share(start: int, stop: int, member: int, ratio: int) -> tuple[int, int]:
    """The indexer range ``(lo, hi)`` that contributor ``member`` sends (T3).

    The ``ratio`` members of a group send disjoint pieces whose union is the whole chunk,
    so each Decode rank assembles a full indexer copy. LIC8 scales use the same range.
    """
    start, stop = _check_chunk(start, stop, "T3")
    ratio = _int(ratio, "ratio", "T3", minimum=1)
    member = _int(member, "member", "T3")
    if member >= ratio:
        raise TopologyError(f"T3: member={member} is outside 0..{ratio - 1}")
    return split_bounds(start, stop, member, ratio)


@dataclass(frozen=True)
class Share:
    """What one Prefill rank sends for one chunk: request-relative block position ranges.

    ``main`` is empty (``(start, start)``) for members other than 0 (T2). ``indexer`` also
    covers the LIC8 scale tensor (T3). The destination starts are the ``lo`` of each range
    and go into the READY entry as ``main_dest_start`` / ``indexer_dest_start`` (W2).
    """

    main: tuple[int, int]
    indexer: tuple[int, int]

    @property
    def main_dest_start(self) -> int:
        return self.main[0]

    @property
    def indexer_dest_start(self) -> int:
        return self.indexer[0]

    @property
    def main_slice(self) -> slice:
        """Slice into the request's per-position block id array."""
        return slice(*self.main)

    @property
    def indexer_slice(self) -> slice:
        return slice(*self.indexer)


def prefill_share(start: int, stop: int, p_rank: int, mapping: TpMapping, rotation: int) -> Share:
    """The main and indexer ranges Prefill rank ``p_rank`` sends for chunk ``[start, stop)``."""
    start, stop = _check_chunk(start, stop, "T2")
    d_rank = mapping.d_rank(p_rank)
    member = mapping.group_member_idx(p_rank)
    rot = _int(rotation, "rotation", "T5")
    if member == 0:
        main = main_share(start, stop, d_rank, mapping.d_tp, rot)
    else:
        # T2: main KV is replicated across the group; only member 0 moves it.
        main = (start, start)
    return Share(main=main, indexer=indexer_share(start, stop, member, mapping.ratio))
