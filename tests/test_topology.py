"""Unequal-TP mapping, ports and block shares (T1-T6, P1-P2, X3)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sfa_rd2h.spec.errors import ProtocolError, TopologyError
from sfa_rd2h.spec.topology import (
    Cut,
    TpMapping,
    decode_base_port,
    decode_cut,
    decode_cuts,
    decode_rank_port,
    indexer_share,
    main_share,
    plan,
    remote_port,
    split_bounds,
    subrange,
    tp_mapping,
)

# ---------------------------------------------------------------- T1 mapping


def test_mapping_4_to_2() -> None:
    m = tp_mapping(4, 2)
    assert m == TpMapping(4, 2)
    assert m.ratio == 2
    assert [m.d_rank(p) for p in range(4)] == [0, 0, 1, 1]
    assert [m.group_member_idx(p) for p in range(4)] == [0, 1, 0, 1]
    assert m.d_rank(3) == 1 and m.group_member_idx(3) == 1
    assert m.contributors(0) == range(0, 2)
    assert m.contributors(1) == range(2, 4)


def test_mapping_equal_tp_is_legacy_ratio_1() -> None:
    m = tp_mapping(8, 8)
    assert m.ratio == 1
    assert all(m.d_rank(p) == p and m.group_member_idx(p) == 0 for p in range(8))


def test_numpy_ints_are_accepted() -> None:
    assert tp_mapping(np.int64(16), np.int32(4)).ratio == 4


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "needle"),
    [
        (3, 2, "T1: p_tp=3 is not a multiple of d_tp=2"),
        (2, 4, "T1: p_tp=2 is smaller than d_tp=4"),
        (0, 1, "T1: p_tp=0"),
        (4, 0, "T1: d_tp=0"),
        (-4, 2, "T1: p_tp=-4"),
        (True, 1, "T1: p_tp must be an int"),
        (4, True, "T1: d_tp must be an int"),
        (4.0, 2, "T1: p_tp must be an int"),
        ("4", 2, "T1: p_tp must be an int"),
        (None, 2, "T1: p_tp must be an int"),
        (6, 4, "T1: p_tp=6 is not a multiple of d_tp=4"),
    ],
)
def test_invalid_topologies(p_tp: object, d_tp: object, needle: str) -> None:
    with pytest.raises(TopologyError) as exc:
        tp_mapping(p_tp, d_tp)  # type: ignore[arg-type]
    assert str(exc.value).startswith(needle)
    assert isinstance(exc.value, ProtocolError)


@pytest.mark.parametrize(("kw"), [{"d_pcp": 2}, {"d_dcp": 2}, {"d_dcp": 0}])
def test_x3_decode_is_tp_only(kw: dict[str, int]) -> None:
    with pytest.raises(TopologyError, match=r"^X3: "):
        tp_mapping(4, 2, **kw)


def test_rank_range_checks() -> None:
    m = tp_mapping(4, 2)
    for bad in (4, -1):
        with pytest.raises(TopologyError, match=r"^T1: p_rank"):
            m.d_rank(bad)
        with pytest.raises(TopologyError, match=r"^T1: p_rank"):
            m.group_member_idx(bad)
    with pytest.raises(TopologyError, match=r"^T1: d_rank=2 is outside 0..1"):
        m.contributors(2)


@given(d_tp=st.integers(1, 16), ratio=st.integers(1, 16))
def test_contributor_groups_partition_prefill_ranks(d_tp: int, ratio: int) -> None:
    m = tp_mapping(d_tp * ratio, d_tp)
    seen: list[int] = []
    for d in range(d_tp):
        group = m.contributors(d)
        assert len(group) == ratio
        assert [m.d_rank(p) for p in group] == [d] * ratio
        assert [m.group_member_idx(p) for p in group] == list(range(ratio))
        seen.extend(group)
    assert seen == list(range(m.p_tp))


# ---------------------------------------------------------------- P1 / P2 ports


def test_ports_example() -> None:
    base = decode_base_port(30000, 1, 2)
    assert base == 30002
    assert [decode_rank_port(base, r, 2) for r in range(2)] == [30002, 30003]
    assert [remote_port(base, r, 2) for r in range(2)] == [30002, 30003]
    assert decode_base_port(30000, 0, 8) == 30000
    assert decode_base_port(30000, 3, 8) == 30024


def test_p2_overflow_names_p2() -> None:
    with pytest.raises(TopologyError, match=r"^P2: .*65536"):
        decode_base_port(65535, 0, 2)
    with pytest.raises(TopologyError, match=r"^P2: "):
        decode_base_port(65000, 100, 8)
    # The last port that still fits.
    assert decode_base_port(65534, 0, 2) == 65534
    # Prefill re-validates an advertised base port it did not compute itself.
    with pytest.raises(TopologyError, match=r"^P2: "):
        remote_port(65535, 0, 2)
    with pytest.raises(TopologyError, match=r"^P2: base port 0"):
        remote_port(0, 0, 1)
    with pytest.raises(TopologyError, match=r"^P2: Decode TP rank 2"):
        remote_port(30000, 2, 2)


@pytest.mark.parametrize(
    ("args", "prefix"),
    [
        ((0, 0, 1), "P1: kv_port=0"),
        ((65536, 0, 1), "P1: kv_port=65536"),
        ((30000, -1, 1), "P1: global_dp_rank=-1"),
        ((30000, 0, 0), "P1: d_tp=0"),
        ((30000, True, 1), "P1: global_dp_rank must be an int"),
    ],
)
def test_invalid_port_inputs(args: tuple[object, ...], prefix: str) -> None:
    with pytest.raises(TopologyError) as exc:
        decode_base_port(*args)  # type: ignore[arg-type]
    assert str(exc.value).startswith(prefix)


def test_decode_rank_port_range() -> None:
    with pytest.raises(TopologyError, match=r"^P1: Decode TP rank 4"):
        decode_rank_port(30000, 4, 4)


def test_plan_table() -> None:
    p = plan(4, 2, 30000, 1)
    assert p["prefill"] == [
        {"p_rank": 0, "d_rank": 0, "group_member_idx": 0, "tp_ratio": 2, "remote_port": 30002},
        {"p_rank": 1, "d_rank": 0, "group_member_idx": 1, "tp_ratio": 2, "remote_port": 30002},
        {"p_rank": 2, "d_rank": 1, "group_member_idx": 0, "tp_ratio": 2, "remote_port": 30003},
        {"p_rank": 3, "d_rank": 1, "group_member_idx": 1, "tp_ratio": 2, "remote_port": 30003},
    ]
    assert p["decode"] == [{"d_rank": 0, "port": 30002}, {"d_rank": 1, "port": 30003}]
    assert p["base_port"] == 30002 and p["tp_ratio"] == 2
    with pytest.raises(TopologyError, match=r"^T1: "):
        plan(3, 2, 30000, 0)
    with pytest.raises(TopologyError, match=r"^P2: "):
        plan(4, 2, 65535, 0)


# ---------------------------------------------------------------- T2 / T3 / T5 shares


def upstream_subrange(n: int, rank: int, size: int, start: int) -> tuple[int, int]:
    """The upstream Decode's rule, restated literally from its description."""
    logical = (rank - start % size) % size
    q, rem = divmod(n, size)
    lo = logical * q + min(logical, rem)
    return lo, lo + q + (1 if logical < rem else 0)


@given(n=st.integers(0, 500), size=st.integers(1, 33), start=st.integers(0, 10_000))
def test_subrange_is_upstreams_rule(n: int, size: int, start: int) -> None:
    for rank in range(size):
        assert subrange(n, rank, size, start) == upstream_subrange(n, rank, size, start)


def test_main_share_examples() -> None:
    # 10 blocks over 4 ranks: sizes 3,3,2,2; a chunk starting at 1 rotates the order by one.
    assert [main_share(0, 10, d, 4) for d in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [main_share(1, 11, d, 4) for d in range(4)] == [(9, 11), (1, 4), (4, 7), (7, 9)]
    # A 1-block chunk lands on the rank its start rotates to; the others get empty ranges.
    assert [main_share(6, 7, d, 4) for d in range(4)] == [(7, 7), (7, 7), (6, 7), (7, 7)]


def test_indexer_share_examples() -> None:
    assert [indexer_share(3, 10, m, 3) for m in range(3)] == [(3, 6), (6, 8), (8, 10)]
    assert [indexer_share(0, 1, m, 2) for m in range(2)] == [(0, 1), (1, 1)]
    assert [indexer_share(1, 2, m, 2) for m in range(2)] == [(2, 2), (1, 2)]


def test_decode_cut_example_from_the_interop_report() -> None:
    # p_tp=2, d_tp=1, a 4-block chunk at 0: member 0 reads main and indexer [0, 2), member 1
    # reads no main and indexer [2, 4) of the full lists it was sent (T6).
    assert decode_cut(4, 4, 0, 0, 0, 2, 0, 1) == Cut(main=(0, 4), indexer=(0, 2))
    assert decode_cut(4, 4, 0, 0, 1, 2, 0, 1) == Cut(main=(0, 0), indexer=(2, 4))
    # Had Prefill cut first (member 1 sends only [2, 4) with start 2), Decode would cut that
    # again and read a single block: the silent loss the report measured.
    assert decode_cut(2, 2, 2, 2, 1, 2, 0, 1).indexer == (1, 2)
    # d_tp=2 with a shared pool: each rank reads its piece of member 0's main.
    assert [decode_cut(4, 4, 0, 0, 0, 2, d, 2).main for d in range(2)] == [(0, 2), (2, 4)]
    # A per-rank KV cache: member 0's rank reads the whole main range.
    assert decode_cut(4, 4, 0, 0, 0, 2, 1, 2, main_shared=False).main == (0, 4)


@pytest.mark.parametrize(
    ("call", "prefix"),
    [
        (lambda: main_share(5, 4, 0, 2), "T5: chunk [5, 4)"),
        (lambda: main_share(0, 4, 2, 2), "T5: d_rank=2"),
        (lambda: main_share(0, 4, 0, 0), "T5: d_tp=0"),
        (lambda: main_share(-1, 4, 0, 2), "T5: start=-1"),
        (lambda: indexer_share(0, 4, 3, 3), "T3: member=3"),
        (lambda: indexer_share(0, 4, 0, 0), "T3: ratio=0"),
        (lambda: decode_cut(-1, 0, 0, 0, 0, 1, 0, 1), "T6: main block count=-1"),
        (lambda: decode_cut(1, 0, True, 0, 0, 1, 0, 1), "T6: main_dest_start must be an int"),
    ],
)
def test_share_argument_checks(call, prefix: str) -> None:  # noqa: ANN001
    with pytest.raises(TopologyError) as exc:
        call()
    assert str(exc.value).startswith(prefix)


def _assert_tiles(ranges: list[tuple[int, int]], start: int, stop: int) -> None:
    """Ranges are well formed, pairwise disjoint and cover exactly [start, stop)."""
    covered = np.zeros(stop - start, dtype=np.int64)
    for lo, hi in ranges:
        assert start <= lo <= hi <= stop
        covered[lo - start : hi - start] += 1
    assert (covered == 1).all()
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1


chunks = st.tuples(st.integers(0, 10_000), st.integers(0, 300)).map(lambda t: (t[0], t[0] + t[1]))


@given(chunk=chunks, d_tp=st.integers(1, 32))
def test_main_shares_tile_the_chunk(chunk: tuple[int, int], d_tp: int) -> None:
    start, stop = chunk
    ranges = [main_share(start, stop, d, d_tp) for d in range(d_tp)]
    _assert_tiles(ranges, start, stop)
    # T5: the piece order is rotated by the chunk's start.
    assert ranges[start % d_tp][0] == start


@given(chunk=chunks, ratio=st.integers(1, 32))
def test_indexer_shares_tile_the_chunk(chunk: tuple[int, int], ratio: int) -> None:
    start, stop = chunk
    _assert_tiles([indexer_share(start, stop, m, ratio) for m in range(ratio)], start, stop)


@given(chunk=chunks, d_tp=st.sampled_from([1, 2, 4, 8]), ratio=st.sampled_from([1, 2, 3, 4]))
@settings(max_examples=60)
def test_decode_cuts_per_decode_rank(chunk: tuple[int, int], d_tp: int, ratio: int) -> None:
    """Every P rank sends the full lists (T6); over all D ranks, the main KV is read once
    into the shared pool and every D rank reads the whole indexer."""
    start, stop = chunk
    m = tp_mapping(d_tp * ratio, d_tp)
    n = stop - start
    mains, per_rank_indexer = [], {d: [] for d in range(d_tp)}
    for p in range(m.p_tp):
        d, member = m.d_rank(p), m.group_member_idx(p)
        cut = decode_cut(n, n, start, start, member, ratio, d, d_tp)
        if member:
            assert cut.main[0] == cut.main[1]  # T2
        else:
            mains.append((start + cut.main[0], start + cut.main[1]))
        per_rank_indexer[d].append((start + cut.indexer[0], start + cut.indexer[1]))
    _assert_tiles(mains, start, stop)  # T2 + T5
    for ranges in per_rank_indexer.values():
        _assert_tiles(ranges, start, stop)  # T3


@given(entries=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(0, 99),
                                  st.integers(0, 99)), max_size=12),
       group=st.sampled_from([(0, 1), (0, 2), (1, 2), (2, 4), (3, 4)]),
       d=st.sampled_from([(0, 1), (0, 2), (1, 2), (3, 4)]), shared=st.booleans())
@settings(max_examples=80)
def test_a_layers_cuts_are_upstreams_rule_entry_by_entry(
        entries: list[tuple[int, int, int, int]], group: tuple[int, int],
        d: tuple[int, int], shared: bool) -> None:
    """T6: Decode cuts a whole layer's entries in one numpy pass; each entry gets exactly
    the piece upstream's per-entry rule gives it (T2 main from member 0 only, T5 the
    rank's piece of a shared pool, T3 the member's indexer piece)."""
    member, ratio = group
    d_rank, d_tp = d
    cols = np.array(entries, dtype=np.int64).reshape(-1, 4).T
    cuts = decode_cuts(*cols, member, ratio, d_rank, d_tp, main_shared=shared)
    for i, (n_main, n_idx, main_start, idx_start) in enumerate(entries):
        if member:
            main = (0, 0)
        elif shared:
            main = upstream_subrange(n_main, d_rank, d_tp, main_start)
        else:
            main = (0, n_main)
        assert cuts[i] == Cut(main=main,
                              indexer=upstream_subrange(n_idx, member, ratio, idx_start))


@pytest.mark.parametrize(("args", "message"), [
    (([1, -2], [0, 0], [0, 0], [0, 0]), "T6: main block count=-2 must be >= 0"),
    (([1.5], [0], [0], [0]), "T6: main block count must be a 1-d array of ints"),
    (([1], [[0]], [0], [0]), "T6: indexer block count must be a 1-d array of ints"),
    (([1, 2], [0], [0, 0], [0, 0]), "T6: one count and one start per entry"),
])
def test_a_layers_cuts_refuse_malformed_columns(args: tuple, message: str) -> None:
    with pytest.raises(TopologyError, match=re.escape(message)):
        decode_cuts(*args, 0, 1, 0, 1)


@given(d_tp=st.integers(2, 16))
@settings(max_examples=30)
def test_rotation_spreads_single_block_chunks(d_tp: int) -> None:
    """T5: consecutive one-block chunks land on every D rank in turn, not always rank 0."""
    owners = []
    for start in range(d_tp):
        ranges = [main_share(start, start + 1, d, d_tp) for d in range(d_tp)]
        owner = [d for d, (lo, hi) in enumerate(ranges) if hi > lo]
        assert len(owner) == 1
        owners.append(owner[0])
    assert sorted(owners) == list(range(d_tp))


def test_split_bounds_vectorised_matches_scalar() -> None:
    idx = np.arange(7)
    lo, hi = split_bounds(3, 20, idx, 7)
    assert list(zip(lo.tolist(), hi.tolist(), strict=True)) == [
        split_bounds(3, 20, i, 7) for i in range(7)
    ]
